//! The ZMQ socket options the zmq crate has no setter for, set through libzmq's C API.

use std::ffi::c_void;

/// Sets socket option `opt` of `sock` to the bytes `value` (`zmq_setsockopt`).
///
/// # Errors
/// The error libzmq reports (an option it does not know, a value it refuses).
pub(crate) fn set_bytes(sock: &mut zmq::Socket, opt: u32, value: &[u8]) -> zmq::Result<()> {
    let opt = i32::try_from(opt).map_err(|_| zmq::Error::EINVAL)?;
    // SAFETY: `sock.as_mut_ptr()` is the live socket `sock` owns, borrowed mutably for the call
    // (libzmq sockets are not used from two threads at once); `value` is readable for
    // `value.len()` bytes during the call, and libzmq copies what it keeps.
    let rc = unsafe { zmq_sys::zmq_setsockopt(sock.as_mut_ptr(), opt, value.as_ptr().cast::<c_void>(), value.len()) };
    if rc == 0 {
        Ok(())
    } else {
        // SAFETY: reads this thread's libzmq errno, set by the failed call above.
        Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }))
    }
}

/// Sets the integer socket option `opt` of `sock` to `value`.
///
/// # Errors
/// As [`set_bytes`].
pub(crate) fn set_int(sock: &mut zmq::Socket, opt: u32, value: i32) -> zmq::Result<()> {
    set_bytes(sock, opt, &value.to_ne_bytes())
}

pub(crate) use zmq_sys::{ZMQ_CONNECT_ROUTING_ID, ZMQ_STREAM_NOTIFY};
