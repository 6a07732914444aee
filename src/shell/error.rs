//! The shell's error type; `ffi::status` maps it to NIXL status codes in one place.

use bounce_proto::endpoint::{EndpointError, XferError};

use crate::sys::inner_plugin::LoadError;
use crate::sys::nixl::NixlStatus;

/// Everything that can go wrong in the shell.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum Error {
    /// The backend params or `NIXL_BOUNCE_*` variables describe an impossible configuration.
    #[error("invalid BOUNCE configuration: {0}")]
    Config(#[from] bounce_proto::config::ConfigError),
    /// The core refused the configuration.
    #[error("the bounce core refused the configuration: {0}")]
    Endpoint(#[from] EndpointError),
    /// NIXL's UCX plugin could not be used.
    #[error(transparent)]
    InnerPlugin(#[from] LoadError),
    /// A call into the inner UCX engine failed.
    #[error("inner UCX {op} failed: {status}")]
    Inner {
        /// What we asked of it.
        op: &'static str,
        /// What it answered.
        status: NixlStatus,
    },
    /// The staging arena could not be set up.
    #[error("the {len}-byte arena: {why}")]
    Arena {
        /// Its size.
        len: u64,
        /// What failed.
        why: ArenaFault,
    },
    /// The arenas handed to the reactor do not fit its core (a bug, never the user's input).
    #[error("the reactor's arenas: {0}")]
    Arenas(&'static str),
    /// The control channel failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The OS had no randomness for a secret the engine cannot run without.
    #[error("no randomness from the OS for {what}: {error}")]
    Random {
        /// Which secret.
        what: &'static str,
        /// The OS error.
        error: getrandom::Error,
    },
    /// A thread could not be started.
    #[error("spawning the {what} thread failed: {source}")]
    Spawn {
        /// Which thread.
        what: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// A peer's connection info is not a BOUNCE envelope we understand.
    #[error("connection info from agent {agent:?} is malformed: {source}")]
    BadEnvelope {
        /// The peer.
        agent: String,
        /// What the decoder found.
        source: bounce_proto::wire::WireError,
    },
    /// A peer's registration metadata is BOUNCE's (its magic) but not a layout we can read (a
    /// newer version, truncated): it must not reach UCX's rkey parser, which trusts its input.
    #[error("a peer's BOUNCE registration metadata is unreadable: {0}")]
    BadPublicData(bounce_proto::wire::WireError),
    /// A string argument was not UTF-8.
    #[error("{0} is not valid UTF-8")]
    BadUtf8(&'static str),
    /// A bounce request call on an engine whose bounce path is not running.
    #[error("the bounce path is not running in this engine")]
    NoBounce,
    /// No bounce request has this handle.
    #[error("no bounce request {0}")]
    UnknownRequest(u64),
    /// A post of a request still in flight.
    #[error("bounce request {0} is still in flight")]
    RepostActive(u64),
    /// A status check of a request never posted.
    #[error("bounce request {0} was never posted")]
    NotPosted(u64),
    /// The reactor is gone (engine shutting down, or it died): nothing would run a new post.
    #[error("the bounce reactor has stopped")]
    BounceClosed,
    /// A bounce transfer failed.
    #[error("bounce transfer failed: {0}")]
    Xfer(#[from] XferError),
}

/// What went wrong setting up the arena.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ArenaFault {
    /// Its size does not fit the address space.
    #[error("size does not fit this address space")]
    TooLarge,
    /// Mapping the memory failed.
    #[error("mapping failed: {0}")]
    Map(std::io::Error),
    /// Registering it with the inner engine failed.
    #[error("registering it with UCX failed: {0}")]
    Register(NixlStatus),
    /// Taking GPU memory failed.
    #[error("allocating it on the GPU failed: {0}")]
    Gpu(crate::sys::cuda::CudaError),
}

/// Why a control frame could not be sent (it is dropped; its transfer times out).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ControlError {
    /// The inner engine refused the notification.
    #[error("UCX genNotif failed: {0}")]
    Notif(NixlStatus),
    /// A ZMQ call failed.
    #[error("ZMQ {op} failed: {source}")]
    Zmq {
        /// Which call.
        op: &'static str,
        /// ZMQ's error.
        source: zmq::Error,
    },
    /// `bounce_zmq_host` is not one specific IP address (a name, a wildcard, multicast).
    #[error("bounce_zmq_host {0:?} is not a specific IP address to bind the ZMQ control socket on")]
    BindHost(String),
    /// The bound ZMQ endpoint is not UTF-8.
    #[error("the bound ZMQ endpoint is not UTF-8")]
    EndpointNotUtf8,
    /// The peer advertised no control endpoint (no capabilities loaded for it).
    #[error("no control endpoint known for this peer")]
    NoEndpoint,
    /// The peer's advertised endpoint is not a plausible `tcp://` address.
    #[error("the peer's ZMQ endpoint {0:?} is not a tcp:// address")]
    BadEndpoint(String),
    /// A frame (or our agent name) longer than the ZMQ framing can carry.
    #[error("a control frame of {0} bytes, or our agent name, is too long for the ZMQ framing")]
    FrameTooLong(usize),
    /// No such peer on an in-memory network.
    #[cfg(test)]
    #[error("no peer {0:?} on this in-memory network")]
    Unreachable(String),
}

/// Result with the shell's [`Error`].
pub(crate) type Result<T> = std::result::Result<T, Error>;
