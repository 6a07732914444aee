//! The byte-level codec under every layout of [`crate::wire`]: the bounds-checked [`Reader`]
//! over untrusted input, its mirror [`Writer`], LEB128 varints, and the rules that keep the
//! encoding canonical (varints only in their shortest form, counts checked against an absolute
//! cap and against the bytes left before anything is allocated, no trailing bytes).
//!
//! It knows fields, not messages: the frame, capability and envelope layouts are built from
//! these primitives in the sibling modules.

use crate::types::{Region, Token};

/// Largest opaque byte string (endpoint, remote key, inner conn info).
pub const MAX_BLOB: u32 = 1 << 20;

/// Reasons a byte string is not a valid frame, capability blob or envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The input ended inside a field.
    #[error("truncated: need {need} more bytes, have {have}")]
    Truncated {
        /// Bytes the field being read requires.
        need: usize,
        /// Bytes that were left.
        have: usize,
    },
    /// The input does not start with the expected magic.
    #[error("bad {what} magic")]
    BadMagic {
        /// Which layout was expected (`"frame"` or `"envelope"`).
        what: &'static str,
    },
    /// The layout version is not one this build speaks.
    #[error("unsupported {what} version {got}")]
    UnsupportedVersion {
        /// Which layout (`"frame"`, `"capabilities"` or `"envelope"`).
        what: &'static str,
        /// The version found.
        got: u16,
    },
    /// The frame's kind byte names no known message.
    #[error("unknown message kind {got}")]
    UnknownKind {
        /// The kind byte found.
        got: u8,
    },
    /// A count exceeds its absolute cap.
    #[error("{what} count {count} exceeds the cap {max}")]
    CountTooLarge {
        /// Which list or byte string.
        what: &'static str,
        /// The count found (or the length of an oversized value being checked).
        count: u64,
        /// The cap.
        max: u64,
    },
    /// Bytes remain after a complete value.
    #[error("{n} trailing bytes")]
    TrailingBytes {
        /// How many bytes remain.
        n: usize,
    },
    /// An envelope sets flag bits this build does not know (a newer peer's layout).
    #[error("unknown envelope flags {got:#04x}")]
    UnknownFlags {
        /// The flags byte found.
        got: u8,
    },
    /// A field holds a value the protocol forbids.
    #[error("invalid {what}")]
    Invalid {
        /// What is wrong.
        what: &'static str,
    },
}

/// Shorthand for results of this module.
pub type Result<T, E = WireError> = std::result::Result<T, E>;

pub(super) fn check_len(what: &'static str, len: usize, max: u32) -> Result<()> {
    if len > max as usize {
        return Err(WireError::CountTooLarge { what, count: len as u64, max: max.into() });
    }
    Ok(())
}

/// Length as written on the wire; an impossible length becomes `u32::MAX`, which exceeds every
/// cap, so the peer refuses it instead of misreading a wrapped count.
pub(super) fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Cursor over untrusted input: every read checks the bytes left first.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.0.len() {
            return Err(WireError::Truncated { need: n, have: self.0.len() });
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let (head, rest) =
            self.0.split_first_chunk::<N>().ok_or(WireError::Truncated { need: N, have: self.0.len() })?;
        self.0 = rest;
        Ok(*head)
    }

    pub(super) fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16> {
        self.array().map(u16::from_le_bytes)
    }

    pub(super) fn u32(&mut self) -> Result<u32> {
        self.array().map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self) -> Result<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// A transfer token: 16 little-endian bytes.
    pub(super) fn token(&mut self) -> Result<Token> {
        self.array().map(u128::from_le_bytes).map(Token)
    }

    /// Reads a `u32` count of `entry`-byte items and checks it against `max` and against the
    /// bytes left, so the caller may allocate `count` items safely.
    pub(super) fn count(&mut self, what: &'static str, max: u32, entry: usize) -> Result<usize> {
        let n = self.u32()?;
        if n > max {
            return Err(WireError::CountTooLarge { what, count: n.into(), max: max.into() });
        }
        let need = (n as usize).saturating_mul(entry);
        if need > self.0.len() {
            return Err(WireError::Truncated { need, have: self.0.len() });
        }
        Ok(n as usize)
    }

    pub(super) fn blob(&mut self, what: &'static str) -> Result<Vec<u8>> {
        let n = self.count(what, MAX_BLOB, 1)?;
        Ok(self.take(n)?.to_vec())
    }

    pub(super) fn region(&mut self) -> Result<Region> {
        Ok(Region { offset: self.u64()?, len: self.u64()? })
    }

    /// A LEB128 varint of at most 64 bits, in its one shortest form (canonical decoding).
    /// Reads the slice directly rather than byte by byte through [`Reader::u8`]: a PLAN or DATA
    /// decodes tens of thousands of these, on the receiver's critical path.
    #[inline(always)]
    pub(super) fn varint(&mut self) -> Result<u64> {
        let b = self.0;
        let mut v = 0u64;
        for (i, &byte) in b.iter().take(10).enumerate() {
            if i == 9 && byte > 1 {
                return Err(WireError::Invalid { what: "varint over 64 bits" });
            }
            v |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                if byte == 0 && i > 0 {
                    return Err(WireError::Invalid { what: "varint not in its shortest form" });
                }
                self.0 = &b[i + 1..];
                return Ok(v);
            }
        }
        // Fewer than 10 bytes, all with the continuation bit: the input ends inside the varint.
        self.0 = &b[b.len()..];
        Err(WireError::Truncated { need: 1, have: 0 })
    }

    pub(super) fn finish(self) -> Result<()> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(WireError::TrailingBytes { n }),
        }
    }
}

/// Little-endian appender; the mirror image of [`Reader`].
pub(super) struct Writer<'a>(pub(super) &'a mut Vec<u8>);

impl Writer<'_> {
    pub(super) fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }

    pub(super) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    pub(super) fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }

    pub(super) fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }

    pub(super) fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    pub(super) fn token(&mut self, t: Token) {
        self.bytes(&t.0.to_le_bytes());
    }

    pub(super) fn len(&mut self, n: usize) {
        self.u32(len_u32(n));
    }

    pub(super) fn blob(&mut self, b: &[u8]) {
        self.len(b.len());
        self.bytes(b);
    }

    pub(super) fn region(&mut self, g: &Region) {
        self.u64(g.offset);
        self.u64(g.len);
    }

    /// A LEB128 varint.
    pub(super) fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.u8(v as u8 | 0x80);
            v >>= 7;
        }
        self.u8(v as u8);
    }

    /// Room for `n` more bytes.
    pub(super) fn reserve(&mut self, n: usize) {
        self.0.reserve(n);
    }
}
