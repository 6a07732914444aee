//! NIXL status codes and the single mapping from our errors to them.

use bounce_proto::endpoint::XferError;

use crate::shell::Error;
use crate::sys::inner_plugin::LoadError;
pub use crate::sys::nixl::NixlStatus as Status;

impl From<&Error> for Status {
    fn from(e: &Error) -> Self {
        match e {
            Error::Config(_) | Error::Endpoint(_) => Self::ErrInvalidParam,
            Error::InnerPlugin(LoadError::Missing { .. } | LoadError::Load { .. }) => Self::ErrNotFound,
            Error::InnerPlugin(_) => Self::ErrMismatch,
            Error::BadEnvelope { .. } | Error::BadPublicData(_) => Self::ErrMismatch,
            Error::BadUtf8(_) | Error::NoBounce => Self::ErrInvalidParam,
            Error::UnknownRequest(_) => Self::ErrNotFound,
            Error::RepostActive(_) => Self::ErrRepostActive,
            Error::NotPosted(_) => Self::ErrNotPosted,
            Error::Xfer(XferError::PeerLost) => Self::ErrRemoteDisconnect,
            // Not ERR_REMOTE_DISCONNECT: NIXL would unload the peer for every backend, and a
            // peer that answered no PING for two seconds may only be stalled.
            Error::Xfer(XferError::Unresponsive) => Self::ErrBackend,
            Error::Xfer(XferError::Canceled) => Self::ErrCanceled,
            Error::Xfer(_) | Error::BounceClosed => Self::ErrBackend,
            // An inner-engine call reports what the inner engine answered (getNotifs), which
            // is an error: a success or in-progress code there would read as no failure.
            Error::Inner { status, .. } if status.code() < 0 => *status,
            Error::Inner { .. } => Self::ErrBackend,
            Error::Arena { .. } | Error::Arenas(_) | Error::Control(_) | Error::Spawn { .. } | Error::Random { .. } => {
                Self::ErrBackend
            }
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

    /// The statuses a bounce request's calls answered before the mapping moved here.
    #[test]
    fn request_errors_keep_their_nixl_statuses() {
        let cases = [
            (Error::NoBounce, Status::ErrInvalidParam),
            (Error::UnknownRequest(3), Status::ErrNotFound),
            (Error::RepostActive(3), Status::ErrRepostActive),
            (Error::NotPosted(3), Status::ErrNotPosted),
            (Error::BounceClosed, Status::ErrBackend),
            (Error::Xfer(XferError::PeerLost), Status::ErrRemoteDisconnect),
            (Error::Xfer(XferError::Unresponsive), Status::ErrBackend),
            (Error::Xfer(XferError::Canceled), Status::ErrCanceled),
            (Error::Xfer(XferError::Forgotten), Status::ErrBackend),
            (Error::Xfer(XferError::Timeout), Status::ErrBackend),
            (Error::Xfer(XferError::Refused), Status::ErrBackend),
            (Error::InnerPlugin(LoadError::Missing { path: "/x".into() }), Status::ErrNotFound),
            (Error::InnerPlugin(LoadError::IsBounce { path: "/x".into() }), Status::ErrMismatch),
            (Error::Inner { op: "getNotifs", status: Status::ErrNotAllowed }, Status::ErrNotAllowed),
            // An inner failure carrying a code that is no error must never read as success.
            (Error::Inner { op: "postXfer", status: Status::Success }, Status::ErrBackend),
            (Error::Inner { op: "postXfer", status: Status::InProg }, Status::ErrBackend),
        ];
        for (e, want) in cases {
            assert_eq!(Status::from(&e), want, "{e}");
        }
    }
}
