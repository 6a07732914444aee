//! What an idle reactor thread sleeps on when its control channel has a socket of its own
//! (ZMQ): the socket's descriptor and an eventfd that wakers ring, so a frame from a peer
//! wakes it at once instead of at the end of its idle park.
//!
//! Why: over UCX notifications nothing announces a frame (the inner engine offers no
//! descriptor through NIXL), so an idle reactor looks at the end of each park, and a WANT to a
//! target whose application does not poll waits for that look. A ZMQ socket has a descriptor
//! that turns readable when messages arrive; waiting on it beside the wakers' eventfd answers
//! such a WANT as soon as ZMQ delivers it.
//!
//! The socket's descriptor is only polled here, never read: the socket itself belongs to the
//! driver (ZMQ sockets are not thread-safe), which is dropped only after the reactor thread's
//! loop, the one caller of [`Alarm::wait`], has ended; so the descriptor is open for every
//! wait. That descriptor signals that ZMQ has commands to process, edge-triggered: a look at
//! the socket by another thread may take the signal of a frame that is then handled by that
//! thread's pass. A signal with no frame behind it costs a pass that finds nothing.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustix::event::{EventfdFlags, eventfd};

/// The eventfd wakers ring and the control socket's descriptor, waited on together.
#[derive(Debug)]
pub(crate) struct Alarm {
    bell: OwnedFd,
    socket: RawFd,
    /// The reactor thread is in (or entering) [`Self::wait`]: a ring must write the eventfd.
    waiting: AtomicBool,
    /// Rung since the last wait began: the next wait returns at once.
    rung: AtomicBool,
}

impl Alarm {
    /// An alarm beside the control socket's descriptor `socket`.
    ///
    /// # Errors
    /// When no eventfd can be made.
    pub(crate) fn new(socket: RawFd) -> rustix::io::Result<Self> {
        let bell = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Self { bell, socket, waiting: AtomicBool::new(false), rung: AtomicBool::new(false) })
    }

    /// Wakes the thread in [`Self::wait`], or makes its next wait return at once. A system
    /// call only while it waits.
    pub(crate) fn ring(&self) {
        // SeqCst with `wait`'s pair: either this sees `waiting` and writes, or the waiter sees
        // `rung` before it sleeps.
        self.rung.store(true, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) {
            // A full counter (never: each wait empties it) would only mean it is readable.
            let _ = rustix::io::write(&self.bell, &1u64.to_ne_bytes());
        }
    }

    /// Sleeps until rung, the socket's descriptor turns readable, or `max` has passed (in whole
    /// milliseconds, rounded up: ZMQ's poll counts milliseconds; an idle park is cut short by
    /// the events themselves, so its length only bounds how late a timer runs).
    pub(crate) fn wait(&self, max: Duration) {
        self.waiting.store(true, Ordering::SeqCst);
        if !self.rung.swap(false, Ordering::SeqCst) {
            let ms = i64::try_from(max.as_micros().div_ceil(1000)).unwrap_or(i64::MAX);
            let mut items = [
                zmq::PollItem::from_fd(self.socket, zmq::POLLIN),
                zmq::PollItem::from_fd(self.bell.as_raw_fd(), zmq::POLLIN),
            ];
            // An error (EINTR) ends the wait early: the reactor's pass looks anyway.
            let _ = zmq::poll(&mut items, ms);
        }
        self.waiting.store(false, Ordering::SeqCst);
        self.rung.store(false, Ordering::SeqCst);
        // Empty the counter (non-blocking; nothing to read is fine).
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.bell, &mut buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    fn socket_pair() -> (zmq::Context, zmq::Socket, zmq::Socket) {
        let ctx = zmq::Context::new();
        let pull = ctx.socket(zmq::PULL).unwrap();
        pull.set_linger(0).unwrap();
        pull.bind("tcp://127.0.0.1:*").unwrap();
        let push = ctx.socket(zmq::PUSH).unwrap();
        push.set_linger(0).unwrap();
        push.connect(&pull.get_last_endpoint().unwrap().unwrap()).unwrap();
        // A first frame through: the connection is up, its set-up signals are behind us.
        push.send(&b"hello"[..], 0).unwrap();
        assert_eq!(pull.recv_bytes(0).unwrap(), b"hello");
        (ctx, pull, push)
    }

    /// Nothing happens: the wait lasts its whole length (rounded up to milliseconds).
    #[test]
    fn an_unrung_alarm_waits_its_length() {
        let ctx = zmq::Context::new();
        let pull = ctx.socket(zmq::PULL).unwrap();
        pull.bind("tcp://127.0.0.1:*").unwrap();
        let alarm = Alarm::new(pull.get_fd().unwrap()).unwrap();
        let _ = pull.get_events(); // take the socket's own signals
        let t0 = Instant::now();
        alarm.wait(Duration::from_micros(20_500));
        assert!(t0.elapsed() >= Duration::from_millis(20), "{:?}", t0.elapsed());
    }

    /// A ring before the wait, a ring during it, a frame arriving: each ends it long before its
    /// length (a minute).
    #[test]
    fn a_ring_or_a_frame_ends_the_wait() {
        let (_ctx, pull, push) = socket_pair();
        let alarm = Arc::new(Alarm::new(pull.get_fd().unwrap()).unwrap());
        let minute = Duration::from_secs(60);
        let short = Duration::from_secs(20);

        alarm.ring();
        let t0 = Instant::now();
        alarm.wait(minute);
        assert!(t0.elapsed() < short, "a ring before the wait");

        let _ = pull.get_events();
        let ringer = {
            let alarm = Arc::clone(&alarm);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                alarm.ring();
            })
        };
        let t0 = Instant::now();
        alarm.wait(minute);
        assert!(t0.elapsed() < short, "a ring during the wait");
        ringer.join().unwrap();

        // As the reactor does: nothing waits on the socket (asked, which takes its signals),
        // then it sleeps until a frame comes.
        while pull.get_events().unwrap().contains(zmq::POLLIN) {
            let _ = pull.recv_bytes(zmq::DONTWAIT);
        }
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            push.send(&b"frame"[..], 0).unwrap();
            push
        });
        let t0 = Instant::now();
        alarm.wait(minute);
        assert!(t0.elapsed() < short, "a frame during the wait");
        let _push = sender.join().unwrap();
        assert!(pull.get_events().unwrap().contains(zmq::POLLIN), "the frame waits for the pass");
    }
}
