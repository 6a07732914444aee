//! The IO shell: safe code that owns engines, loads the inner UCX plugin, and runs the reactor
//! and copy workers that drive the sans-IO core.

mod arena;
mod copy;
mod engine;
mod error;
mod inner_plugin;
mod reactor;
mod requests;
mod stats;
mod worker;
mod zmq_channel;

pub use engine::{CreateParams, DescView, Engine, InnerInit, Registration};
pub use error::{Error, Result};
pub use inner_plugin::{InnerPlugin, PLUGIN_API_VERSION, locate_ucx_plugin};
