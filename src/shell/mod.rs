//! The IO shell: safe code between the FFI entry points above and `sys` below. It owns
//! engines, runs the reactor that drives the sans-IO core, and reaches the outside world only
//! through its seams: [`control::ControlChannel`] (how control frames travel),
//! [`copy::CopyEngine`] (where gathers and scatters run) and [`datapath::DataPath`] (where
//! writes go). It never imports `ffi`; `sys` never imports it.

mod arena;
mod cma;
pub(crate) mod control;
pub(crate) mod copy;
pub(crate) mod datapath;
mod doorbell;
mod drbg;
mod engine;
mod error;
mod fence;
mod ipc;
mod keys;
mod mailroom;
mod oneway_area;
mod peers;
mod reactor;
mod registry;
mod requests;
mod stats;

pub(crate) use engine::{CreateParams, DescView, Engine, Progress};
pub(crate) use error::{Error, Result};
pub(crate) use registry::Registration;
