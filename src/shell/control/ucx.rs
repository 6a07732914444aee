//! The UCX control channel (`bounce_control=ucx`, the default): frames ride the inner engine's
//! notifications. Sending is `genNotif`; receiving drains the control frames the
//! [`Mailroom`] sorted out of the inner engine's notifications (whichever thread pulled them).

use std::sync::Arc;

use super::{ControlChannel, ControlError, Inbound};
use crate::shell::mailroom::Mailroom;
use crate::sys::shim::Shim;

/// Control frames over the inner engine's notifications.
pub(crate) struct UcxChannel {
    shim: Shim,
    mail: Arc<Mailroom>,
}

impl UcxChannel {
    /// A channel over `shim`'s notifications, receiving what `mail` sorts out as control frames.
    pub(crate) fn new(shim: Shim, mail: Arc<Mailroom>) -> Self {
        Self { shim, mail }
    }
}

impl ControlChannel for UcxChannel {
    fn send(&mut self, peer: &str, frame: &[u8]) -> Result<(), ControlError> {
        crate::shell::marks::timed("slow-send", || self.shim.gen_notif(peer, frame)).map_err(ControlError::Notif)
    }

    fn poll(&mut self, budget: usize, out: &mut Vec<Inbound>) -> usize {
        self.mail.take_control(budget, out)
    }

    /// UCX keeps no per-peer state of ours: the inner engine handles the disconnect.
    fn forget(&mut self, _peer: &str) {}
}
