//! Control frames in and out: decoding and admitting a peer's frame (its session, one way or two
//! way) before the core sees it, and sending the core's frames over the control channel.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use bounce_proto::endpoint::Pong;
use bounce_proto::peers::{Forgot, FrameRefused, Hello};
use bounce_proto::wire::{self, Frame, Msg};
use bounce_proto::{PeerId, Token};

use super::{Driver, RateLimit};
use crate::shell::control::ControlError;
use crate::shell::stats::Stats;
use crate::sys::nixl::NixlStatus;

impl RateLimit {
    pub(super) fn allow(&mut self, now: Instant) -> bool {
        if now.duration_since(self.window) > Duration::from_secs(1) {
            self.window = now;
            self.left = 10;
        }
        self.left.checked_sub(1).map(|l| self.left = l).is_some()
    }
}

impl Driver {
    pub(super) fn drop_frame(&mut self, now: Instant, peer: &str, why: &dyn std::fmt::Display) {
        Stats::bump(&self.shared.stats.control_dropped);
        if self.warn_budget.allow(now) {
            tracing::warn!(peer, reason = %why, "dropping control frame");
        }
    }

    pub(super) fn on_control(&mut self, now: Instant, peer: &str, bytes: &[u8]) {
        let _span = tracing::trace_span!("control", peer, len = bytes.len()).entered();
        crate::shell::mark!("frame", bytes.len());
        // One decoder for every frame kind: HELLO is a frame like the others (the core's).
        let frame = match wire::ControlFrame::decode(bytes) {
            Ok(f) => f,
            Err(e) => return self.drop_frame(now, peer, &e),
        };
        let msg = match frame.body {
            wire::Body::Hello { load } => {
                // A HELLO counts only once the peer answers the ask it opens (our HELLO and a
                // PING only the peer sees; `bounce_proto::hello`): its session is published,
                // so anyone holding its metadata could forge one.
                match self.shared.peers.hello(peer, frame.session, load) {
                    // A confirmed peer's HELLO for another load is asked about too (at most once
                    // a second): it unloaded and loaded us again, and lacks our HELLO.
                    h @ (Hello::Ask | Hello::Reloaded | Hello::Repeat) => {
                        if let Some(id) = self.shared.peers.known_id(peer) {
                            self.ep.handle_hello(now, id, h);
                        }
                    }
                    // The loads race: the peer says HELLO again once our HELLO on loading it
                    // reaches it.
                    Hello::NotLoaded => tracing::debug!(peer, "HELLO from an agent not loaded (yet): dropped"),
                    other => {
                        if let Some(refused) = other.refusal(frame.session) {
                            self.sessions_forged += 1;
                            self.drop_frame(now, peer, &refused);
                        }
                    }
                }
                return;
            }
            wire::Body::Ping { .. } | wire::Body::Pong { .. } => return self.on_probe(now, peer, frame),
            wire::Body::Forget { proof } => return self.on_forget(now, peer, frame.session, proof),
            wire::Body::Goodbye => {
                // Anyone holding the peer's metadata knows its session: the GOODBYE is only
                // asked about (a PING whose farewell PONG only the peer can make, `on_probe`).
                match self.shared.peers.admit(peer, frame.session) {
                    Ok(id) => {
                        tracing::debug!(peer, "peer said goodbye: asking it to confirm");
                        self.ep.handle_goodbye_said(now, id);
                    }
                    // A one-way initiator we never loaded says GOODBYE too: nothing binds it
                    // to a session, so it cannot end its flows here (their timers do).
                    Err(FrameRefused::NotLoaded) => tracing::debug!(peer, "GOODBYE from an agent never loaded"),
                    Err(e) => {
                        if matches!(e, FrameRefused::StaleSession { .. }) {
                            self.sessions_forged += 1;
                        }
                        self.drop_frame(now, peer, &e);
                    }
                }
                return;
            }
            wire::Body::Msg(msg) => msg,
        };
        crate::shell::mark!(("recv-", msg.kind_name()), bytes.len());
        // The session must be the one of the peer's loaded metadata; a new one arrives only
        // through a metadata reload (`Engine::load_conn_info`), never through a frame.
        // One way: an initiator we never loaded, or another incarnation of one we did (it
        // restarted; we still hold its old metadata), may open a flow answered through our
        // mailbox, then send that flow's frames (each carries the flow's token).
        // A name never heard of, or a loaded one under another session, is given an id only
        // once its opening proofs verify (review 59: invented sessions under a published name
        // spent an id each).
        if self.shared.peers.is_unvouched(peer, frame.session) {
            if let Some(e) = self.ep.refuse_forged_opening(peer, &msg) {
                return self.drop_frame(now, peer, &e);
            }
        }
        let ep = &self.ep;
        let admitted = self.shared.peers.admit_message(
            peer,
            frame.session,
            |id| ep.admits_one_way(id, &msg),
            |id| ep.holds_nothing_for(id),
        );
        let id = match admitted {
            Ok((id, gone)) => {
                if let Some(gone) = gone {
                    // A one-way name forgotten to make room: its id goes, its replay window
                    // stays with its name.
                    self.ep.handle_peer_evicted(now, gone);
                }
                id
            }
            Err(e) => {
                if matches!(e, FrameRefused::StaleSession { .. }) {
                    self.sessions_forged += 1;
                }
                return self.drop_frame(now, peer, &e);
            }
        };
        if let Err(e) = self.ep.handle_msg_named(now, id, peer, msg) {
            self.drop_frame(now, peer, &e);
        }
    }

    /// A PING or PONG of the liveness probe: admitted by the same session and loading rules as
    /// any frame (a PONG of a dead incarnation is stale), then handed to the core.
    fn on_probe(&mut self, now: Instant, peer: &str, frame: wire::ControlFrame) {
        let id = match self.shared.peers.admit(peer, frame.session) {
            Ok(id) => id,
            Err(e) => {
                if matches!(e, FrameRefused::StaleSession { .. }) {
                    self.sessions_forged += 1;
                }
                return self.drop_frame(now, peer, &e);
            }
        };
        match frame.body {
            wire::Body::Ping { nonce } => {
                self.ep.handle_ping(now, id, nonce);
                self.farewells.remove(peer);
            }
            wire::Body::Pong { nonce, forget } => match self.ep.handle_pong(now, id, nonce) {
                Pong::Farewell => self.farewell(now, peer, frame.session),
                // Confirmed for the incarnation the PONG was admitted as only: a reload between
                // the two must not confirm the new one on the old one's answer.
                Pong::Hello => {
                    if self.shared.peers.confirm_hello(peer, id, forget) {
                        tracing::debug!(peer, "HELLO confirmed: the peer may be bounced to two way");
                    }
                }
                Pong::Other => {}
            },
            _ => {}
        }
    }

    /// A FORGET: the peer unloaded our metadata, if it proves the secret of its load here
    /// (`bounce_proto::forget`). Then our transfers to it fail at once, its flows into us are
    /// reclaimed, and our later transfers to it go one way; its arena stays loaded for them.
    fn on_forget(&mut self, now: Instant, peer: &str, session: u64, proof: Token) {
        match self.shared.peers.forgot_us(peer, session, proof) {
            Ok(Forgot::Us(id)) => {
                tracing::info!(peer, "the peer unloaded our metadata: our transfers to it go one way from now on");
                self.ep.handle_forgotten(now, id);
            }
            // Never confirmed (or already forgotten): our route to it is one way already.
            Ok(Forgot::NotConfirmed) => tracing::debug!(peer, "FORGET from a peer whose HELLO is not confirmed"),
            Ok(Forgot::Forged) => {
                self.sessions_forged += 1;
                self.drop_frame(now, peer, &FrameRefused::ForgedForget);
            }
            Err(e) => {
                if matches!(e, FrameRefused::StaleSession { .. }) {
                    self.sessions_forged += 1;
                }
                self.drop_frame(now, peer, &e);
            }
        }
    }

    /// The peer confirmed its GOODBYE: its transfers fail, its arena is forgotten.
    fn farewell(&mut self, now: Instant, peer: &str, session: u64) {
        match self.shared.peers.goodbye(peer, session) {
            Ok((id, unload)) => {
                tracing::info!(peer, "peer said goodbye: its transfers fail, its arena is forgotten");
                self.greeted.remove(peer);
                self.retire(unload);
                self.ep.handle_goodbye(now, id);
            }
            Err(e) => self.drop_frame(now, peer, &e),
        }
    }

    pub(super) fn send(&mut self, peer: PeerId, msg: Msg) {
        let Some(name) = self.shared.peers.name(peer) else { return };
        crate::shell::mark!(("send-", msg.kind_name()), peer.0);
        let bytes = Frame { session: self.session, msg }.to_vec();
        let _span = tracing::trace_span!("send", peer = name, len = bytes.len()).entered();
        crate::shell::mark!("encoded", bytes.len());
        if let Err(e) = self.send_control(&name, &bytes) {
            self.send_failed(peer, &name, &e);
        }
        crate::shell::mark!("sent", bytes.len());
    }

    /// Sends `bytes` to `name` on the control channel, counted (`stats.control_sent`,
    /// `stats.control_sent_bytes`) whether or not the channel took it.
    pub(super) fn send_control(&mut self, name: &str, bytes: &[u8]) -> Result<(), ControlError> {
        self.count_sent(bytes.len());
        self.control.send(name, bytes)
    }

    /// Counts a control frame of `len` bytes handed to the channel (`stats.control_sent`,
    /// `stats.control_sent_bytes`).
    pub(super) fn count_sent(&self, len: usize) {
        let stats = &self.shared.stats;
        Stats::bump(&stats.control_sent);
        stats.control_sent_bytes.fetch_add(len as u64, Relaxed);
    }

    /// Sends our HELLO to `name` on loading it: it carries the tag of this load of the peer
    /// (`Endpoint::load_tag_of`), so the peer tells a reload from a repeat. A name without an
    /// id was unloaded meanwhile: nothing to say.
    pub(super) fn send_hello(&mut self, name: &str) -> Result<bool, ControlError> {
        let Some(id) = self.shared.peers.known_id(name) else { return Ok(false) };
        self.send_control(name, &wire::encode_hello(self.session, self.ep.load_tag_of(id))).map(|()| true)
    }

    /// Sends a link-level frame (the liveness probe's PING or PONG).
    pub(super) fn send_link(&mut self, peer: PeerId, body: wire::Body) {
        let Some(name) = self.shared.peers.name(peer) else { return };
        let bytes = wire::ControlFrame { session: self.session, body }.to_vec();
        if let Err(e) = self.send_control(&name, &bytes) {
            self.send_failed(peer, &name, &e);
        }
    }

    fn send_failed(&mut self, id: PeerId, peer: &str, e: &ControlError) {
        if self.warn_budget.allow(Instant::now()) {
            // The transfer this belonged to fails by the liveness probe or times out; never
            // block the reactor.
            tracing::warn!(peer, error = %e, "sending a control frame failed");
        }
        // UCX fails a send with ERR_REMOTE_DISCONNECT only once the peer's endpoint has failed
        // (measured: a SIGKILLed receiver's first PING, 250 ms after its last frame, already
        // failed so): nothing sent to it can arrive any more, so its transfers need not wait for
        // the probe's verdict.
        if matches!(e, ControlError::Notif(NixlStatus::ErrRemoteDisconnect)) {
            self.ep.handle_peer_unreachable(Instant::now(), id);
        }
    }
}
