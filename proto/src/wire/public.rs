//! The public-data envelope: what the BOUNCE backend's `getPublicData` returns for a
//! registration -- its id and key (see [`crate::proof`]) around the inner UCX engine's own
//! public data (the remote key), which passes through untouched.
//!
//! Layout: magic, `u16` version, `u64` registration id, the 32-byte key, then the inner blob to
//! the end (NIXL keeps the blob's length). Version 2, written only for a GPU registration this
//! engine could export, puts its [`IpcRecord`] between the key and the inner blob; version 3,
//! for a host registration of an engine that lets same-host peers copy by CMA, its
//! [`CmaRecord`]; version 1 has neither. All three decode.

use super::codec::{Reader, Result, WireError, Writer};
use crate::types::{RegId, RegKey};

/// Magic that starts a public-data envelope.
pub const PUBLIC_MAGIC: [u8; 8] = *b"NXBNCREG";
/// Version of the public-data layout without an IPC record.
pub const PUBLIC_VERSION: u16 = 1;
/// Version of the layout with an [`IpcRecord`].
pub const PUBLIC_VERSION_IPC: u16 = 2;
/// Version of the layout with a [`CmaRecord`].
pub const PUBLIC_VERSION_CMA: u16 = 3;

/// How a process of the same host may copy into and out of a host registration with
/// `process_vm_writev` / `process_vm_readv` (`bounce_cma`): the owner process as the kernel
/// knows it, and the registration. Opaque to the core; the shell checks that `pid` in its own
/// PID namespace is that very process (namespace and start time) before every copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "fuzzing", derive(arbitrary::Arbitrary))]
pub struct CmaRecord {
    /// The host's identity (its boot id).
    pub node: [u8; 16],
    /// The owner's PID namespace (the inode of `/proc/self/ns/pid`).
    pub pidns: u64,
    /// The owner's process id in that namespace.
    pub pid: u32,
    /// The owner's start time (`/proc/<pid>/stat` field 22): a reused pid has another.
    pub start: u64,
    /// The registration's address in its owner's process.
    pub addr: u64,
    /// The registration's length.
    pub len: u64,
    /// Address, in its owner's process, of the registration's liveness word: it holds `tag`
    /// while the registration lives and 0 from its deregistration on. A copier reads it before
    /// every copy, so a deregistered registration is not written.
    pub live: u64,
    /// The liveness word's value while the registration lives (never 0).
    pub tag: u64,
}

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
    /// How a process of the same host may copy into and out of it (host memory only; never
    /// together with `ipc`, which wins when both are set).
    pub cma: Option<CmaRecord>,
    /// The inner UCX engine's public data, opaque.
    pub inner: Vec<u8>,
}

impl PublicData {
    /// The envelope's encoding.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(154 + self.inner.len());
        let mut w = Writer(&mut out);
        w.bytes(&PUBLIC_MAGIC);
        w.u16(match (&self.ipc, &self.cma) {
            (Some(_), _) => PUBLIC_VERSION_IPC,
            (None, Some(_)) => PUBLIC_VERSION_CMA,
            (None, None) => PUBLIC_VERSION,
        });
        w.u64(self.reg.0);
        w.bytes(&self.key.0);
        match (&self.ipc, &self.cma) {
            (Some(ipc), _) => {
                w.bytes(&ipc.node);
                w.bytes(&ipc.handle);
                w.u64(ipc.alloc_off);
                w.u64(ipc.addr);
                w.u64(ipc.len);
            }
            (None, Some(cma)) => {
                w.bytes(&cma.node);
                w.u64(cma.pidns);
                w.u32(cma.pid);
                w.u64(cma.start);
                w.u64(cma.addr);
                w.u64(cma.len);
                w.u64(cma.live);
                w.u64(cma.tag);
            }
            (None, None) => {}
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
        if !matches!(version, PUBLIC_VERSION | PUBLIC_VERSION_IPC | PUBLIC_VERSION_CMA) {
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
        let cma = match version {
            PUBLIC_VERSION_CMA => Some(CmaRecord {
                node: r.array()?,
                pidns: r.u64()?,
                pid: r.u32()?,
                start: r.u64()?,
                addr: r.u64()?,
                len: r.u64()?,
                live: r.u64()?,
                tag: r.u64()?,
            }),
            _ => None,
        };
        Ok(Self { reg, key, ipc, cma, inner: r.0.to_vec() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_data_round_trips_and_foreign_blobs_are_told_apart() {
        let p = PublicData { reg: RegId(7), key: RegKey([3; 32]), ipc: None, cma: None, inner: b"ucx-rkey".to_vec() };
        let bytes = p.to_vec();
        assert_eq!(&bytes[..10], b"NXBNCREG\x01\x00");
        assert_eq!(PublicData::decode(&bytes), Ok(p));
        assert_eq!(PublicData::decode(b"plain ucx rkey blob"), Err(WireError::BadMagic { what: "public data" }));
        assert!(matches!(PublicData::decode(&bytes[..20]), Err(WireError::Truncated { .. })));
        let mut other = bytes.clone();
        other[8] = 4;
        assert_eq!(PublicData::decode(&other), Err(WireError::UnsupportedVersion { what: "public data", got: 4 }));
        let empty = PublicData { reg: RegId(1), key: RegKey([0; 32]), ipc: None, cma: None, inner: Vec::new() };
        assert_eq!(PublicData::decode(&empty.to_vec()), Ok(empty));
    }

    #[test]
    fn an_ipc_record_travels_as_version_2_between_key_and_inner_blob() {
        let ipc = IpcRecord { node: [9; 16], handle: [5; 64], alloc_off: 4096, addr: 0x7f00_0000_1000, len: 1 << 20 };
        let p =
            PublicData { reg: RegId(7), key: RegKey([3; 32]), ipc: Some(ipc), cma: None, inner: b"ucx-rkey".to_vec() };
        let bytes = p.to_vec();
        assert_eq!(&bytes[..10], b"NXBNCREG\x02\x00");
        assert_eq!(bytes.len(), 10 + 8 + 32 + 16 + 64 + 24 + 8);
        assert_eq!(&bytes[50..66], &[9; 16]);
        assert_eq!(&bytes[bytes.len() - 8..], b"ucx-rkey");
        assert_eq!(PublicData::decode(&bytes), Ok(p));
        // Cut inside the record: truncated, not an envelope with a shorter inner blob.
        assert!(matches!(PublicData::decode(&bytes[..100]), Err(WireError::Truncated { .. })));
    }

    #[test]
    fn a_cma_record_travels_as_version_3() {
        let cma = CmaRecord {
            node: [9; 16],
            pidns: 4026531836,
            pid: 4242,
            start: 123_456,
            addr: 0x7f00_0000,
            len: 4096,
            live: 0x5500_0008,
            tag: 77,
        };
        let p = PublicData { reg: RegId(7), key: RegKey([3; 32]), ipc: None, cma: Some(cma), inner: b"ucx".to_vec() };
        let bytes = p.to_vec();
        assert_eq!(&bytes[..10], b"NXBNCREG\x03\x00");
        assert_eq!(bytes.len(), 10 + 8 + 32 + 16 + 8 + 4 + 8 + 8 + 8 + 8 + 8 + 3);
        assert_eq!(&bytes[66..74], &4026531836u64.to_le_bytes());
        assert_eq!(&bytes[74..78], &4242u32.to_le_bytes());
        assert_eq!(PublicData::decode(&bytes), Ok(p));
        assert!(matches!(PublicData::decode(&bytes[..90]), Err(WireError::Truncated { .. })));
    }
}
