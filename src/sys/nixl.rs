//! NIXL's integer enums as Rust types: `nixl_status_t`, `nixl_mem_t` and `nixl_xfer_op_t`
//! (cpp/include/nixl_abi.h). Raw integers are converted here, at the edge, and nowhere else.

use bounce_proto::MemKind;

/// NIXL's `nixl_status_t`.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NixlStatus {
    /// `NIXL_IN_PROG`
    InProg = 1,
    /// `NIXL_SUCCESS`
    Success = 0,
    /// `NIXL_ERR_NOT_POSTED`
    ErrNotPosted = -1,
    /// `NIXL_ERR_INVALID_PARAM`
    ErrInvalidParam = -2,
    /// `NIXL_ERR_BACKEND`
    ErrBackend = -3,
    /// `NIXL_ERR_NOT_FOUND`
    ErrNotFound = -4,
    /// `NIXL_ERR_MISMATCH`
    ErrMismatch = -5,
    /// `NIXL_ERR_NOT_ALLOWED`
    ErrNotAllowed = -6,
    /// `NIXL_ERR_REPOST_ACTIVE`
    ErrRepostActive = -7,
    /// `NIXL_ERR_UNKNOWN`
    ErrUnknown = -8,
    /// `NIXL_ERR_NOT_SUPPORTED`
    ErrNotSupported = -9,
    /// `NIXL_ERR_REMOTE_DISCONNECT`
    ErrRemoteDisconnect = -10,
    /// `NIXL_ERR_CANCELED`
    ErrCanceled = -11,
    /// `NIXL_ERR_NO_TELEMETRY`
    ErrNoTelemetry = -12,
}

impl NixlStatus {
    /// The raw code.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The status a raw code names; a code NIXL does not define reads as `ErrUnknown`.
    pub fn from_code(code: i32) -> Self {
        const ALL: [NixlStatus; 14] = [
            NixlStatus::InProg,
            NixlStatus::Success,
            NixlStatus::ErrNotPosted,
            NixlStatus::ErrInvalidParam,
            NixlStatus::ErrBackend,
            NixlStatus::ErrNotFound,
            NixlStatus::ErrMismatch,
            NixlStatus::ErrNotAllowed,
            NixlStatus::ErrRepostActive,
            NixlStatus::ErrUnknown,
            NixlStatus::ErrNotSupported,
            NixlStatus::ErrRemoteDisconnect,
            NixlStatus::ErrCanceled,
            NixlStatus::ErrNoTelemetry,
        ];
        ALL.into_iter().find(|s| s.code() == code).unwrap_or(Self::ErrUnknown)
    }

    /// `Ok(())` for `NIXL_SUCCESS`, the status itself otherwise.
    pub fn ok(self) -> Result<(), Self> {
        if self == Self::Success { Ok(()) } else { Err(self) }
    }
}

impl std::fmt::Display for NixlStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?} ({})", self.code())
    }
}

/// NIXL's `nixl_mem_t`: the segment kind of a registration or descriptor list.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemSeg {
    /// `DRAM_SEG`: host memory.
    Dram = 0,
    /// `VRAM_SEG`: GPU memory.
    Vram = 1,
    /// `BLK_SEG`: block storage.
    Blk = 2,
    /// `OBJ_SEG`: object storage.
    Obj = 3,
    /// `FILE_SEG`: files.
    File = 4,
}

impl MemSeg {
    /// The raw code.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The segment a raw code names, if NIXL defines it.
    pub fn from_code(code: i32) -> Option<Self> {
        [Self::Dram, Self::Vram, Self::Blk, Self::Obj, Self::File].into_iter().find(|m| m.code() == code)
    }

    /// The memory kinds the bounce path knows (host and GPU memory); other segments never
    /// take it.
    pub fn kind(self) -> Option<MemKind> {
        match self {
            Self::Dram => Some(MemKind::Dram),
            Self::Vram => Some(MemKind::Vram),
            Self::Blk | Self::Obj | Self::File => None,
        }
    }
}

impl From<MemKind> for MemSeg {
    fn from(k: MemKind) -> Self {
        match k {
            MemKind::Dram => Self::Dram,
            MemKind::Vram => Self::Vram,
        }
    }
}

/// NIXL's `nixl_xfer_op_t`.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferOp {
    /// `NIXL_READ`
    Read = 0,
    /// `NIXL_WRITE`
    Write = 1,
}

impl XferOp {
    /// The operation a raw code names, if NIXL defines it.
    pub fn from_code(code: i32) -> Option<Self> {
        match code {
            0 => Some(Self::Read),
            1 => Some(Self::Write),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_named() {
        for code in -12..=1 {
            assert_eq!(NixlStatus::from_code(code).code(), code);
        }
        assert_eq!(NixlStatus::from_code(7), NixlStatus::ErrUnknown);
        assert_eq!(NixlStatus::from_code(-99), NixlStatus::ErrUnknown);
        assert_eq!(MemSeg::from_code(0), Some(MemSeg::Dram));
        assert_eq!(MemSeg::from_code(1).and_then(MemSeg::kind), Some(MemKind::Vram));
        assert_eq!(MemSeg::from_code(4).and_then(MemSeg::kind), None);
        assert_eq!(MemSeg::from_code(5), None);
        assert_eq!(MemSeg::from(MemKind::Dram).code(), 0);
        assert_eq!(XferOp::from_code(1), Some(XferOp::Write));
        assert_eq!(XferOp::from_code(0), Some(XferOp::Read));
        assert_eq!(XferOp::from_code(2), None);
        assert_eq!(NixlStatus::Success.ok(), Ok(()));
        assert_eq!(NixlStatus::InProg.ok(), Err(NixlStatus::InProg));
    }
}
