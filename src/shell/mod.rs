//! The IO shell: safe code between the FFI entry points above and `sys` below. It owns
//! engines, runs the reactor that drives the sans-IO core, and reaches the outside world only
//! through its seams: [`control::ControlChannel`] (how control frames travel),
//! [`copy::CopyEngine`] (where gathers and scatters run) and [`datapath::DataPath`] (where
//! writes go). It never imports `ffi`; `sys` never imports it.

/// One point of a transfer's timeline: a TRACE event of target `bounce_timeline`, off unless
/// `NIXL_BOUNCE_LOG` names it (`NIXL_BOUNCE_LOG=bounce_timeline=trace`), or, with
/// `NIXL_BOUNCE_MARKS=DIR`, an entry of the flight recorder ([`marks`]), which costs about
/// 0.1 us where a line to stderr costs microseconds. Each carries the process and thread, so
/// the marks of two processes interleave into one timeline (`benches/timeline.py`). Cheaper
/// than span timings (`NIXL_BOUNCE_LOG_SPANS`), which close a span at every reactor pass and
/// slowed a 2-core KV request several-fold; the stderr lines slowed it by a fifth to a half.
/// Nothing is evaluated while both are off. `mark!((prefix, kind), id)` names a frame or
/// record kind after a prefix (`"recv-"`, `"WANT"`) without formatting.
macro_rules! mark {
    (($what:expr, $kind:expr), $id:expr) => {
        match crate::shell::marks::recorder() {
            Some(rec) => rec.mark($what, $kind, $id as u64),
            None => tracing::trace!(
                target: "bounce_timeline",
                pid = std::process::id(),
                thread = %crate::shell::thread_name(),
                id = $id,
                "{}{}",
                $what,
                $kind
            ),
        }
    };
    ($what:expr, $id:expr) => {
        crate::shell::mark!(($what, ""), $id)
    };
}
pub(crate) use mark;

/// The calling thread's name for [`mark`] (`app` for an unnamed application thread).
pub(crate) fn thread_name() -> String {
    std::thread::current().name().unwrap_or("app").to_owned()
}

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
pub(crate) mod marks;
mod oneway_area;
mod peers;
mod progress;
mod reactor;
mod registry;
mod requests;
mod stats;
mod streak;

pub(crate) use engine::{CreateParams, DescView, Engine, Progress};
pub(crate) use error::{Error, Result};
pub(crate) use mailroom::Diverted;
pub(crate) use registry::Registration;
