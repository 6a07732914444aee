//! The connection-info envelope: what the BOUNCE backend's `getConnInfo` returns, our
//! [`Capabilities`] (when bounce is usable here) around the inner UCX engine's own opaque conn
//! info.

use super::caps::Capabilities;
use super::codec::{Reader, Result, WireError, Writer, len_u32};

/// Magic that starts a connection-info envelope.
pub const ENVELOPE_MAGIC: [u8; 8] = *b"NXBOUNCE";
/// Version of the envelope layout this build speaks.
pub const ENVELOPE_VERSION: u16 = 1;
/// Envelope flag: a capability blob follows the flags byte.
pub(super) const FLAG_CAPS: u8 = 0x01;

/// What the BOUNCE backend's `getConnInfo` returns: our capabilities, if bounce is usable here,
/// around the inner UCX engine's own conn info (opaque).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct ConnEnvelope {
    /// Our capabilities; `None` when bounce is disabled or unusable, so the peer stays on UCX.
    pub caps: Option<Capabilities>,
    /// The inner UCX engine's conn info, passed through untouched.
    pub inner: Vec<u8>,
}

impl ConnEnvelope {
    /// Appends the envelope's encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut w = Writer(out);
        w.bytes(&ENVELOPE_MAGIC);
        w.u16(ENVELOPE_VERSION);
        match &self.caps {
            Some(caps) => {
                w.u8(FLAG_CAPS);
                let at = w.0.len();
                w.u32(0);
                caps.encode(w.0);
                let n = w.0.len() - at - 4;
                w.0[at..at + 4].copy_from_slice(&len_u32(n).to_le_bytes());
            }
            None => w.u8(0),
        }
        w.blob(&self.inner);
    }

    /// The envelope's encoding as a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes exactly one envelope; trailing bytes are an error.
    ///
    /// # Errors
    /// [`WireError::BadMagic`], [`WireError::UnsupportedVersion`], [`WireError::UnknownFlags`]
    /// (a newer layout), truncation, an oversized inner blob, trailing bytes, or any error of
    /// [`Capabilities::decode`] on the embedded blob.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        match Self::decode_lenient(bytes)? {
            (env, None) => Ok(env),
            (_, Some(caps_error)) => Err(caps_error),
        }
    }

    /// [`decode`](Self::decode), except that capabilities that do not decode (another wire
    /// version, a newer layout, garbage) are dropped instead of failing the whole envelope: the
    /// envelope comes back without them, with their error. The capability blob is
    /// length-prefixed, so the inner conn info after it is still found; an agent whose
    /// capabilities we cannot read is one we cannot bounce with, and it stays on plain UCX.
    ///
    /// # Errors
    /// As [`decode`](Self::decode), except the capability blob's own errors.
    pub fn decode_lenient(bytes: &[u8]) -> Result<(Self, Option<WireError>)> {
        let mut r = Reader(bytes);
        if r.array::<8>()? != ENVELOPE_MAGIC {
            return Err(WireError::BadMagic { what: "envelope" });
        }
        let version = r.u16()?;
        if version != ENVELOPE_VERSION {
            return Err(WireError::UnsupportedVersion { what: "envelope", got: version });
        }
        let flags = r.u8()?;
        if flags & !FLAG_CAPS != 0 {
            return Err(WireError::UnknownFlags { got: flags });
        }
        let (caps, caps_error) = if flags & FLAG_CAPS != 0 {
            // The caps blob is bounded by the input itself, and decoding it allocates only its
            // own (capped) byte strings, so no absolute cap is needed on its length.
            let n = r.count("capabilities", u32::MAX, 1)?;
            match Capabilities::decode(r.take(n)?) {
                Ok(caps) => (Some(caps), None),
                Err(e) => (None, Some(e)),
            }
        } else {
            (None, None)
        };
        let inner = r.blob("inner conn info")?;
        r.finish()?;
        Ok((Self { caps, inner }, caps_error))
    }
}
