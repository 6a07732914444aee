//! Background progress for an agent that asked for NIXL's progress thread when the bounce
//! path, whose reactor gives that progress, did not start (a `vram` arena without a GPU or
//! with a copy engine that cannot start, an arena or control channel refused): the inner
//! engine was created without UCX's own thread, decided before the path could start, so
//! without this the agent progressed only inside its own NIXL calls, and a passive target
//! served no READ over TCP until its application next called (review 57).
//!
//! One thread pulls the inner engine's notifications into the mailroom, which progresses
//! UCX, every `bounce_idle_park_us` (1 ms by default), as an idle reactor does: sleeping, not
//! spinning. The application's `getNotifs` then takes what it pulled, in order.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::shell::mailroom::Mailroom;
use crate::sys::shim::Shim;

/// The thread; stopped (and joined) by [`ProgressThread::stop`] or on drop.
pub(crate) struct ProgressThread {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ProgressThread {
    /// Starts pulling `shim`'s inner engine into `mail` every `every`.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub(crate) fn start(shim: Shim, mail: Arc<Mailroom>, every: Duration) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name("bounce-progress".into()).spawn(move || {
            while !stopping.load(Ordering::Acquire) {
                // A panic must not end the agent's background progress, nor cross anything.
                let pulled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| mail.try_pull(&shim)));
                match pulled {
                    Ok(Ok(_)) => {}
                    Ok(Err(status)) => tracing::debug!(?status, "background progress: getNotifs failed"),
                    Err(_) => tracing::error!("background progress: a pull panicked"),
                }
                std::thread::park_timeout(every);
            }
        })?;
        Ok(Self { stop, thread: Some(thread) })
    }

    /// Stops the thread and waits for its pull in progress, if any: the inner engine may go
    /// once this returns.
    pub(crate) fn stop(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        self.stop.store(true, Ordering::Release);
        thread.thread().unpark();
        if thread.join().is_err() {
            tracing::error!("background progress thread panicked");
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        self.stop();
    }
}
