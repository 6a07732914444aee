//! The FFI edge, and only what NIXL's C++ calls into: raw C ABI entry points (`abi`), the one
//! status mapping (`status`) and the panic guard every entry point runs in. What Rust calls out
//! to (the shim, the inner plugin) lives in `crate::sys`.
//!
//! The C++ shim in `cpp/` implements NIXL's engine class and calls the functions in [`abi`];
//! `nixl_plugin_init` / `nixl_plugin_fini` are exported from here because a Rust cdylib does not
//! re-export symbols of a linked C++ static library.

pub mod abi;
pub mod status;

use std::panic::{AssertUnwindSafe, catch_unwind};

pub use status::Status;

/// Runs `f`, turning a panic into `Status::ErrUnknown` with an `error!` log line.
///
/// Since Rust 1.81 an unwind out of an `extern "C"` function aborts the process; catching it here
/// keeps that abort a backstop that never fires.
///
/// On the way out the calling thread's CUDA context is put back if anything in the call bound
/// another ([`crate::sys::cuda::restore_thread_context`]).
pub fn guard(what: &'static str, f: impl FnOnce() -> Status) -> Status {
    let outcome = catch_unwind(AssertUnwindSafe(f));
    // Under the guard too: nothing may unwind out of an entry point.
    let _ = catch_unwind(crate::sys::cuda::restore_thread_context);
    match outcome {
        Ok(s) => s,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned());
            tracing::error!(entry = what, panic = %msg, "panic caught at the FFI boundary");
            Status::ErrUnknown
        }
    }
}

/// Like [`guard`] for entry points that return a value: a panic is logged and `fallback`
/// returned (a null pointer, a zero count).
pub fn guard_value<T>(what: &'static str, fallback: T, f: impl FnOnce() -> T) -> T {
    let mut out = None;
    let _ = guard(what, || {
        out = Some(f());
        Status::Success
    });
    out.unwrap_or(fallback)
}

/// Like [`guard`] for entry points that return nothing: a panic is logged and swallowed.
pub fn guard_void(what: &'static str, f: impl FnOnce()) {
    let _ = guard(what, || {
        f();
        Status::Success
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_status_not_an_abort() {
        assert_eq!(guard("test", || panic!("boom")), Status::ErrUnknown);
        assert_eq!(guard("test", || panic!("{}", String::from("formatted"))), Status::ErrUnknown);
        assert_eq!(guard("test", || Status::InProg), Status::InProg);
        guard_void("test", || panic!("in a void entry point"));
        assert!(guard_value("test", std::ptr::null::<u8>(), || panic!("in a pointer entry point")).is_null());
        assert_eq!(guard_value("test", 0usize, || 7), 7);
    }
}
