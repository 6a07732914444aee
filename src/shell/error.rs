//! The shell's error type; `ffi::status` maps it to NIXL status codes in one place.

use std::path::PathBuf;

/// Everything that can go wrong in the shell.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The backend params or `NIXL_BOUNCE_*` variables describe an impossible configuration.
    #[error("invalid BOUNCE configuration: {0}")]
    Config(#[from] bounce_proto::config::ConfigError),
    /// No UCX plugin where we looked.
    #[error(
        "NIXL's UCX plugin was not found at {path}; put BOUNCE next to libplugin_UCX.so or set \
         the backend param bounce_ucx_plugin / NIXL_BOUNCE_UCX_PLUGIN"
    )]
    InnerPluginMissing {
        /// Where we looked.
        path: PathBuf,
    },
    /// dlopen or symbol lookup failed.
    #[error("could not load the UCX plugin {path}: {reason}")]
    InnerPluginLoad {
        /// The plugin file.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
    /// The inner plugin speaks another plugin API version.
    #[error("the UCX plugin {path} has plugin API version {got}, BOUNCE supports {want}")]
    InnerPluginVersion {
        /// The plugin file.
        path: PathBuf,
        /// Its API version.
        got: i32,
        /// Ours.
        want: i32,
    },
    /// The configured inner plugin is BOUNCE itself (would recurse forever).
    #[error("the configured inner plugin {path} is BOUNCE itself, not UCX")]
    InnerPluginIsBounce {
        /// The plugin file.
        path: PathBuf,
    },
    /// A peer's connection info is not a BOUNCE envelope we understand.
    #[error("connection info from agent {agent:?} is malformed: {source}")]
    BadEnvelope {
        /// The peer.
        agent: String,
        /// What the decoder found.
        source: bounce_proto::wire::WireError,
    },
    /// A pointer argument was null.
    #[error("null {0} argument")]
    NullArgument(&'static str),
    /// A string argument was not UTF-8.
    #[error("{0} is not valid UTF-8")]
    BadUtf8(&'static str),
}

/// Result with the shell's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
