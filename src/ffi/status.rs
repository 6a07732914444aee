//! NIXL status codes and the single mapping from our errors to them.

use crate::shell::Error;

/// NIXL's `nixl_status_t`, as the C++ shim passes it on to the core.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
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
}

impl Status {
    /// The raw code.
    pub fn code(self) -> i32 {
        self as i32
    }
}

impl From<&Error> for Status {
    fn from(e: &Error) -> Self {
        match e {
            Error::Config(_) => Self::ErrInvalidParam,
            Error::InnerPluginMissing { .. } | Error::InnerPluginLoad { .. } => Self::ErrNotFound,
            Error::InnerPluginVersion { .. } | Error::InnerPluginIsBounce { .. } => Self::ErrMismatch,
            Error::BadEnvelope { .. } => Self::ErrMismatch,
            Error::NullArgument(_) | Error::BadUtf8(_) => Self::ErrInvalidParam,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_nixl() {
        assert_eq!(Status::Success.code(), 0);
        assert_eq!(Status::InProg.code(), 1);
        assert_eq!(Status::ErrMismatch.code(), -5);
        assert_eq!(Status::ErrRemoteDisconnect.code(), -10);
        assert_eq!(Status::ErrCanceled.code(), -11);
    }

    #[test]
    fn a_malformed_envelope_from_a_peer_is_a_mismatch() {
        let source = bounce_proto::wire::ConnEnvelope::decode(b"not an envelope").unwrap_err();
        let e = Error::BadEnvelope { agent: "peer".into(), source };
        assert_eq!(Status::from(&e), Status::ErrMismatch);
        assert!(e.to_string().contains("\"peer\""), "{e}");
    }
}
