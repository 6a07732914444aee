//! The public-data envelope: what the BOUNCE backend's `getPublicData` returns for a
//! registration -- its id and key (see [`crate::proof`]) around the inner UCX engine's own
//! public data (the remote key), which passes through untouched.
//!
//! Layout: magic, `u16` version, `u64` registration id, the 32-byte key, then the inner blob to
//! the end (NIXL keeps the blob's length). Version 2, written only for a GPU registration this
//! engine could export, puts its [`IpcRecord`] between the key and the inner blob; version 1
//! has none. Both decode.

use super::codec::{Reader, Result, WireError, Writer};
use crate::types::{RegId, RegKey};

/// Magic that starts a public-data envelope.
pub const PUBLIC_MAGIC: [u8; 8] = *b"NXBNCREG";
/// Version of the public-data layout without an IPC record.
pub const PUBLIC_VERSION: u16 = 1;
/// Version of the layout with an [`IpcRecord`].
pub const PUBLIC_VERSION_IPC: u16 = 2;

/// How a process of the same host may map a GPU registration (`bounce_cuda_ipc`): the CUDA IPC
/// handle of the allocation holding it, and where the registration lies in it. Opaque to the
/// core; the shell checks `node` against its own before handing `handle` to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct IpcRecord {
    /// The host's identity (its boot id): a handle means nothing on another host.
    pub node: [u8; 16],
    /// `CUipcMemHandle` of the allocation.
    pub handle: [u8; 64],
    /// Offset of the registration's first byte inside the allocation.
    pub alloc_off: u64,
    /// The registration's address in its owner's process.
    pub addr: u64,
    /// The registration's length.
    pub len: u64,
}

/// A registration's public data as BOUNCE publishes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct PublicData {
    /// The registration's id at its owner.
    pub reg: RegId,
    /// Its key: whoever holds it may name the registration as a bounce destination.
    pub key: RegKey,
    /// How a process of the same host may map the registration (GPU memory only).
    pub ipc: Option<IpcRecord>,
    /// The inner UCX engine's public data, opaque.
    pub inner: Vec<u8>,
}

impl PublicData {
    /// The envelope's encoding.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(154 + self.inner.len());
        let mut w = Writer(&mut out);
        w.bytes(&PUBLIC_MAGIC);
        w.u16(if self.ipc.is_some() { PUBLIC_VERSION_IPC } else { PUBLIC_VERSION });
        w.u64(self.reg.0);
        w.bytes(&self.key.0);
        if let Some(ipc) = &self.ipc {
            w.bytes(&ipc.node);
            w.bytes(&ipc.handle);
            w.u64(ipc.alloc_off);
            w.u64(ipc.addr);
            w.u64(ipc.len);
        }
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
        if version != PUBLIC_VERSION && version != PUBLIC_VERSION_IPC {
            return Err(WireError::UnsupportedVersion { what: "public data", got: version });
        }
        let reg = RegId(r.u64()?);
        let key = RegKey(r.array()?);
        let ipc = match version {
            PUBLIC_VERSION_IPC => Some(IpcRecord {
                node: r.array()?,
                handle: r.array()?,
                alloc_off: r.u64()?,
                addr: r.u64()?,
                len: r.u64()?,
            }),
            _ => None,
        };
        Ok(Self { reg, key, ipc, inner: r.0.to_vec() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_data_round_trips_and_foreign_blobs_are_told_apart() {
        let p = PublicData { reg: RegId(7), key: RegKey([3; 32]), ipc: None, inner: b"ucx-rkey".to_vec() };
        let bytes = p.to_vec();
        assert_eq!(&bytes[..10], b"NXBNCREG\x01\x00");
        assert_eq!(PublicData::decode(&bytes), Ok(p));
        assert_eq!(PublicData::decode(b"plain ucx rkey blob"), Err(WireError::BadMagic { what: "public data" }));
        assert!(matches!(PublicData::decode(&bytes[..20]), Err(WireError::Truncated { .. })));
        let mut other = bytes.clone();
        other[8] = 3;
        assert_eq!(PublicData::decode(&other), Err(WireError::UnsupportedVersion { what: "public data", got: 3 }));
        let empty = PublicData { reg: RegId(1), key: RegKey([0; 32]), ipc: None, inner: Vec::new() };
        assert_eq!(PublicData::decode(&empty.to_vec()), Ok(empty));
    }

    #[test]
    fn an_ipc_record_travels_as_version_2_between_key_and_inner_blob() {
        let ipc = IpcRecord { node: [9; 16], handle: [5; 64], alloc_off: 4096, addr: 0x7f00_0000_1000, len: 1 << 20 };
        let p = PublicData { reg: RegId(7), key: RegKey([3; 32]), ipc: Some(ipc), inner: b"ucx-rkey".to_vec() };
        let bytes = p.to_vec();
        assert_eq!(&bytes[..10], b"NXBNCREG\x02\x00");
        assert_eq!(bytes.len(), 10 + 8 + 32 + 16 + 64 + 24 + 8);
        assert_eq!(&bytes[50..66], &[9; 16]);
        assert_eq!(&bytes[bytes.len() - 8..], b"ucx-rkey");
        assert_eq!(PublicData::decode(&bytes), Ok(p));
        // Cut inside the record: truncated, not an envelope with a shorter inner blob.
        assert!(matches!(PublicData::decode(&bytes[..100]), Err(WireError::Truncated { .. })));
    }
}
