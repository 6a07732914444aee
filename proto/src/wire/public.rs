//! The public-data envelope: what the BOUNCE backend's `getPublicData` returns for a
//! registration -- its id and key (see [`crate::proof`]) around the inner UCX engine's own
//! public data (the remote key), which passes through untouched.
//!
//! Layout: magic, `u16` version, `u64` registration id, the 32-byte key, then the inner blob to
//! the end (NIXL keeps the blob's length).

use super::codec::{Reader, Result, WireError, Writer};
use crate::types::{RegId, RegKey};

/// Magic that starts a public-data envelope.
pub const PUBLIC_MAGIC: [u8; 8] = *b"NXBNCREG";
/// Version of the public-data layout this build speaks.
pub const PUBLIC_VERSION: u16 = 1;

/// A registration's public data as BOUNCE publishes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct PublicData {
    /// The registration's id at its owner.
    pub reg: RegId,
    /// Its key: whoever holds it may name the registration as a bounce destination.
    pub key: RegKey,
    /// The inner UCX engine's public data, opaque.
    pub inner: Vec<u8>,
}

impl PublicData {
    /// The envelope's encoding.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(50 + self.inner.len());
        let mut w = Writer(&mut out);
        w.bytes(&PUBLIC_MAGIC);
        w.u16(PUBLIC_VERSION);
        w.u64(self.reg.0);
        w.bytes(&self.key.0);
        w.bytes(&self.inner);
        out
    }

    /// Decodes an envelope; everything after the key is the inner blob.
    ///
    /// # Errors
    /// [`WireError::BadMagic`] for bytes that are not ours (a plain UCX blob, say),
    /// [`WireError::UnsupportedVersion`], or truncation.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader(bytes);
        if r.array::<8>()? != PUBLIC_MAGIC {
            return Err(WireError::BadMagic { what: "public data" });
        }
        let version = r.u16()?;
        if version != PUBLIC_VERSION {
            return Err(WireError::UnsupportedVersion { what: "public data", got: version });
        }
        let reg = RegId(r.u64()?);
        let key = RegKey(r.array()?);
        Ok(Self { reg, key, inner: r.0.to_vec() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_data_round_trips_and_foreign_blobs_are_told_apart() {
        let p = PublicData { reg: RegId(7), key: RegKey([3; 32]), inner: b"ucx-rkey".to_vec() };
        let bytes = p.to_vec();
        assert_eq!(&bytes[..10], b"NXBNCREG\x01\x00");
        assert_eq!(PublicData::decode(&bytes), Ok(p));
        assert_eq!(PublicData::decode(b"plain ucx rkey blob"), Err(WireError::BadMagic { what: "public data" }));
        assert!(matches!(PublicData::decode(&bytes[..20]), Err(WireError::Truncated { .. })));
        let mut other = bytes.clone();
        other[8] = 2;
        assert_eq!(PublicData::decode(&other), Err(WireError::UnsupportedVersion { what: "public data", got: 2 }));
        let empty = PublicData { reg: RegId(1), key: RegKey([0; 32]), inner: Vec::new() };
        assert_eq!(PublicData::decode(&empty.to_vec()), Ok(empty));
    }
}
