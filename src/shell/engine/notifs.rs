//! Notifications and progress on the application's threads: `getNotifs` pulls the inner engine,
//! takes our control frames out of what it returns, and runs a reactor pass when they or the
//! bounce path's work in flight call for one.

use super::*;

impl Engine {
    /// The application's notifications, in arrival order, after pulling what waits in the
    /// inner engine (control frames found there go to the reactor).
    ///
    /// # Errors
    /// [`Error::Inner`] when the inner engine's `getNotifs` failed.
    ///
    /// An application that spins on `getNotifs` while bounce requests are in flight takes a
    /// core the reactor and copy workers need (and, in NIXL's STRICT mode, the agent lock its
    /// other threads need). Such a busy poll (an empty call within [`BUSY_POLL_GAP`] of the
    /// previous empty one) that again finds nothing waits on the doorbell, bounded by
    /// `bounce_check_wait_us`, until a notification is sorted or a request finishes. The reactor
    /// keeps pulling the inner engine while bounce requests are in flight, so nothing arrives
    /// unseen; with none in flight, `getNotifs` never waits (pass-through keeps UCX's cost).
    pub(crate) fn take_notifs(&self) -> Result<Vec<Notif>> {
        // Same-host copies that ended since: their notifications go now, as UCX's would
        // without a status query (see `CmaPath::settle`).
        if let Some(cma) = &self.cma {
            cma.settle(self.shim);
        }
        if let Some(ipc) = &self.ipc {
            ipc.settle(self.shim);
        }
        let bell = self.mail.bell();
        let ticket = bell.ticket();
        let got = self.pull_and_take()?;
        let drove = self.after_app_pull();
        if !got.is_empty() || !self.notif_poll_is_busy() {
            return Ok(got);
        }
        let wait = self.poll_wait(drove.or_else(|| self.drive()));
        if !wait.is_zero() && bell.wait_past(ticket, wait) {
            let got = self.pull_and_take()?;
            if self.mail.control_waiting() {
                let _ = self.control_arrived();
            }
            return Ok(got);
        }
        Ok(got)
    }

    /// Whether the application's `getNotifs` may pull the inner engine straight into its own
    /// list (asked with the inner engine's lock held): nothing older waits in the mailroom
    /// ([`Mailroom::app_pull_is_direct`]) and no bounce request is in flight (a poller then
    /// takes [`Self::take_notifs`], whose busy-poll wait needs it). Pass-through traffic then
    /// costs what UCX's own `getNotifs` does.
    pub(crate) fn app_notifs_direct(&self) -> bool {
        let direct = self.shim.is_some()
            && self.shared().is_none_or(|sh| sh.requests.in_flight() == 0)
            && self.cma.as_ref().is_none_or(|c| !c.notifying())
            && self.ipc.as_ref().is_none_or(|i| !i.notifying())
            && self.mail.app_pull_is_direct();
        // The caller pulls the inner engine now; the other way notes its pull in
        // `Mailroom::pull_and_take`.
        if direct {
            self.mail.note_app_pull();
        }
        direct
    }

    /// Whether the bounce path has work in flight (a receiver's flows included), which a
    /// poller advances by driving ([`Self::control_arrived`] after its pull).
    pub(crate) fn bounce_busy(&self) -> bool {
        self.bounce.as_ref().is_some_and(|b| b.reactor.busy())
    }

    /// The bytes an application notification must travel as, when not its own: escaped when it
    /// begins with the frame magic and `bounce_escape_notifs` is on, so that the peer's
    /// mailroom hands it to its application rather than its reactor
    /// (`wire::escape_app_notif`). For the application's `genNotif` and pass-through
    /// notifications (the shim) and the notifications of the transfers BOUNCE moves.
    pub(crate) fn escape_notif(&self, msg: &[u8]) -> Option<Vec<u8>> {
        if !self.config.escape_notifs {
            return None;
        }
        bounce_proto::wire::escape_app_notif(msg)
    }

    /// For a direct pull: takes `msg` when it is a control frame (see [`Mailroom::divert`]).
    /// The caller says [`Self::control_arrived`] once its pull is over and the inner engine's
    /// lock released.
    pub(crate) fn divert_notif(&self, agent: &[u8], msg: &[u8]) -> Diverted {
        self.mail.divert(agent, msg)
    }

    /// After the application's pull of the inner engine: a reactor pass on this thread when
    /// the pull found control frames or the bounce path is busy ([`Self::control_arrived`]),
    /// or when a frame waits on the control channel's own socket (ZMQ), which no pull of the
    /// inner engine sees. A target whose application polls then answers a WANT at its next
    /// poll, as it does over UCX notifications, not when its reactor thread next looks.
    pub(crate) fn after_app_pull(&self) -> Option<Drove> {
        if self.mail.control_waiting() || self.bounce_busy() {
            let drove = self.control_arrived();
            // The pass moved nothing and left copies on the workers (a receiver's scatter):
            // this poller will be back at once with nothing to do until one finishes, so it
            // hands its core over, as `check` does. On a small host a copy worker woken onto
            // the core of an application spinning on getNotifs otherwise waited out the
            // poller's time slice (2 cores, a 1 MiB bounced WRITE to a polling target: p99
            // 4.0-5.2 ms, 0.65-1.3 ms with the yield).
            if drove.is_some_and(|d| d.copying && !d.moved) {
                std::thread::yield_now();
            }
            drove
        } else {
            self.bounce.as_ref()?.reactor.drive_if_readable()
        }
    }

    /// Whether the application's direct pull must be followed by [`Self::after_app_pull`]:
    /// the bounce path is busy, or control frames may wait on a socket of the channel's own.
    pub(crate) fn look_after_app_pull(&self) -> bool {
        self.bounce_busy() || self.bounce.as_ref().is_some_and(|b| b.reactor.own_socket())
    }

    /// This application thread pulled control frames, or polled while the bounce path is
    /// busy: run a reactor pass here, or wake the reactor thread when no pass can run here (a
    /// GPU arena, or the thread is in a pass of its own and may have polled before the frames
    /// were queued).
    pub(crate) fn control_arrived(&self) -> Option<Drove> {
        let drove = self.drive();
        if drove.is_none() {
            // A pass wanted even while the reactor thread stands down (`Inbox::kick`).
            match self.shared() {
                Some(sh) => sh.inbox.kick(),
                None => self.mail.wake_reactor(),
            }
        }
        drove
    }

    /// One reactor pass on the calling thread ([`Reactor::drive`]), or `None` when none ran.
    /// Called only by pollers and posters, never with a lock of ours or the shim's held.
    pub(super) fn drive(&self) -> Option<Drove> {
        self.bounce.as_ref()?.reactor.drive()
    }

    /// How long a busy poller of bounce requests waits, after `drove`, for one to finish.
    ///
    /// A poller whose pass ran and left no copy on the workers is the transfer's progress, as
    /// it is UCX's: it answers at once and drives again at its next call (waiting would leave
    /// the next frame to the reactor thread, which a spinning application keeps off the core on
    /// a small host). Otherwise it waits up to `bounce_check_wait_us`, so the copy workers and
    /// the reactor get the core (issue 12: a spinning poller cost them whole scheduler ticks).
    pub(super) fn poll_wait(&self, drove: Option<Drove>) -> Duration {
        match drove {
            Some(d) if d.moved || !d.copying => Duration::ZERO,
            Some(_) => {
                // This poller stops driving for a while: the reactor thread takes over now.
                if let Some(b) = self.bounce.as_ref().filter(|_| !self.config.check_wait.is_zero()) {
                    b.reactor.resign();
                }
                self.config.check_wait
            }
            None => self.config.check_wait,
        }
    }

    /// Pulls the inner engine's notifications and takes the application's.
    fn pull_and_take(&self) -> Result<Vec<Notif>> {
        match &self.shim {
            Some(shim) => self.mail.pull_and_take(shim).map_err(|status| Error::Inner { op: "getNotifs", status }),
            None => Ok(self.mail.take_app()),
        }
    }

    /// Whether this empty `getNotifs` is part of a busy poll while bounce requests are in
    /// flight (see [`Self::take_notifs`]); records it as the latest empty call.
    fn notif_poll_is_busy(&self) -> bool {
        // Cheap checks first: with nothing bounced in flight this is every idle getNotifs.
        let Some(sh) = self.shared() else { return false };
        if sh.requests.in_flight() == 0 || self.config.check_wait.is_zero() {
            return false;
        }
        let now = Instant::now();
        let last = self.last_empty_notifs.lock().replace(now);
        last.is_some_and(|t| now.saturating_duration_since(t) < BUSY_POLL_GAP)
    }
}
