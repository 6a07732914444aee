//! Per-thread scheduling settings the reactor asks of the kernel.

/// Asks the kernel to wake the calling thread's timed sleeps within 1 us of their deadline
/// instead of Linux's default 50 us timer slack. The reactor sleeps 50 us between polls while a
/// transfer is in flight; with the default slack each such sleep lasted about twice that, and
/// every control hop waits for one. Best effort: on failure sleeps stay as coarse as before.
pub(crate) fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument by value and changes only the
    // calling thread's timer slack; no memory is passed to the kernel.
    let rc = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "could not set the reactor's timer slack");
    }
}

/// The calling thread's minor page faults so far (`getrusage(RUSAGE_THREAD)`), or `None` when
/// the kernel refuses. For the flight recorder's fault counts (`shell::marks`).
pub(crate) fn minor_faults() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: `usage` is valid for writes of one `rusage`, which the kernel fills on success
    // (checked before it is read); RUSAGE_THREAD concerns only the calling thread.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    // SAFETY: rc == 0: the kernel wrote the whole struct.
    (rc == 0).then(|| u64::try_from(unsafe { usage.assume_init() }.ru_minflt).unwrap_or(0))
}
