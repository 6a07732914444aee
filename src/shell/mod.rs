//! The IO shell: safe code that owns engines, loads the inner UCX plugin and (later) runs the
//! reactor that drives the sans-IO core.

mod engine;
mod error;
mod inner_plugin;

pub use engine::{CreateParams, Engine, InnerInit, PeerInfo, Registration};
pub use error::{Error, Result};
pub use inner_plugin::{InnerPlugin, PLUGIN_API_VERSION, locate_ucx_plugin};
