//! One way (docs/one-way.md): transfers to a target that never loaded our metadata, answered
//! through mailboxes instead of control frames. As initiator, the endpoint submits them and
//! reads the target's answers from the images the shell fetches; as target, it opens their
//! flows in answering slots (a genuine WANT or PULL waits for a slot, a forged one takes none)
//! and writes their answers as records.

use super::*;

impl Endpoint {
    /// As [`submit`](Self::submit), to a target that may never have loaded our metadata: the
    /// WANT asks it to answer through its mailbox of shape `mailbox` (from its capabilities,
    /// checked by [`crate::oneway::peer_layout`]), and the shell READs the answers
    /// ([`fetch`](Self::fetch), [`handle_fetched`](Self::handle_fetched)).
    ///
    /// # Errors
    /// As [`submit`](Self::submit).
    pub fn submit_one_way(
        &mut self,
        now: Instant,
        xfer: XferId,
        token: Token,
        peer: PeerId,
        plan: impl Into<Arc<Plan>>,
        mailbox: MailboxLayout,
    ) -> Result<(), SubmitError> {
        self.submit_write(now, xfer, token, peer, plan, WriteRoute { mailbox: Some(mailbox), ..WriteRoute::default() })
    }

    /// A READ of one-way transfer `xfer`'s mailbox failed (the target is gone, or its mailbox
    /// no longer loaded): no answer can come, so it fails as lost.
    pub fn handle_fetch_failed(&mut self, now: Instant, xfer: XferId) {
        if self.reading.contains(xfer) {
            self.sender.fail_by_peer(&mut ctx!(self, now), xfer, XferError::PeerLost);
            self.pump(now);
        }
    }

    /// Keeps a mailbox (the shell has a one-way area to write records into) and answers one-way
    /// WANTs through it, or not.
    pub fn keep_mailbox(&mut self, yes: bool) {
        let layout = self.one_way.mailbox;
        let layout = yes.then_some(MailboxLayout { slots: layout.slots, ring: layout.ring });
        self.answering = Answering::new(layout, self.one_way.mailbox.offset, self.answering.linger());
    }

    /// Mailbox slots held now (open or closing), for stats and tests.
    pub fn answering_slots_held(&self) -> u32 {
        self.answering.slots_held()
    }

    /// Where our mailbox and fetch area lie (the shell sizes its one-way area by it).
    pub fn one_way_layout(&self) -> OneWayLayout {
        self.one_way
    }

    /// True when we keep a mailbox (see [`keep_mailbox`](Self::keep_mailbox)).
    pub fn has_mailbox(&self) -> bool {
        self.answering.has_mailbox()
    }

    /// Our one-way transfers waiting for answers, lowest id first: the shell keeps a READ of
    /// each one's [`fetch`](Self::fetch) going.
    pub fn one_way_xfers(&self) -> impl Iterator<Item = XferId> + '_ {
        self.reading.xfers()
    }

    /// What to READ now for one-way transfer `xfer`: regions of the target's mailbox (relative
    /// to its mailbox base), to be read back to back. `None` once the transfer has ended.
    pub fn fetch(&self, xfer: XferId) -> Option<crate::oneway::Fetch> {
        self.reading.fetch(xfer)
    }

    /// The bytes a READ of [`fetch`](Self::fetch) brought for `xfer`: the new answers go to the
    /// sender as if they had come as frames (same token and credit checks). Returns how many
    /// records were new (the shell's poll policy backs off while there are none).
    pub fn handle_fetched(&mut self, now: Instant, xfer: XferId, image: &[u8]) -> usize {
        let mut reads = std::mem::take(&mut self.reads);
        let mut cursor = None;
        let mut written_after = now;
        let n = self.reading.handle_fetched((now, &mut written_after), xfer, image, &mut reads, &mut cursor);
        self.stats.records_read += n as u64;
        self.stats.records_refused = self.reading.refused();
        // A GRANT beside a FAIL of the same image is dead: the target ended the flow, and may
        // have granted the region to another since (review 60, mailbox H1).
        let failed = reads.iter().any(|r| matches!(r, Read::Failed(..)));
        for read in reads.drain(..) {
            let mut ctx = ctx!(self, now);
            let r = match read {
                Read::Msg(_, wire::Msg::Grant(_)) if failed => Ok(()),
                // A record is a sign of life only with its transfer's token (any holder of the
                // peer's arena key can write its mailbox). Its credits are as old as it may be.
                Read::Msg(peer, wire::Msg::Grant(g)) => {
                    if self.sender.is_answer(peer, g.xfer, g.token) {
                        self.liveness.heard(now, peer);
                    }
                    self.sender.handle_grant_written_after(&mut ctx, peer, g, written_after)
                }
                Read::Msg(peer, wire::Msg::Ack(a)) => {
                    if self.sender.is_answer(peer, a.xfer, a.token) {
                        self.liveness.heard(now, peer);
                    }
                    self.sender.handle_ack(&mut ctx, peer, a)
                }
                Read::Msg(..) => Ok(()),
                Read::Failed(xfer, reason) => {
                    let err = match reason {
                        FailReason::TimedOut => XferError::Timeout,
                        FailReason::Shutdown => XferError::PeerLost,
                        FailReason::CopyFailed => XferError::ScatterFailed,
                        FailReason::Cancelled | FailReason::Refused => XferError::Refused,
                    };
                    self.sender.fail_by_peer(&mut ctx, xfer, err);
                    Ok(())
                }
            };
            if let Err(e) = r {
                self.stats.protocol_errors += 1;
                debug!(xfer = xfer.0, error = %e, "protocol error in a mailbox answer");
            }
        }
        self.reads = reads;
        if let Some((peer, msg)) = cursor {
            self.out.push_back(Action::Send { peer, msg });
        }
        self.pump(now);
        n
    }

    /// For a message from the agent `name`, which has no id here yet, that opens a one-way
    /// flow with proofs `name` did not make: the error to refuse it with before the peer table
    /// gives the name an id, counted as a forgery (the shell, with its own peer table, asks
    /// this too). Checked later, each invented name took an id for good, and a flood of them
    /// could use the id space up and close one-way admission until a restart (review 54,
    /// control M2). `None`: admit it as usual.
    pub fn refuse_forged_opening(&mut self, name: &str, msg: &wire::Msg) -> Option<ProtocolError> {
        if !self.answering.has_mailbox() {
            return None;
        }
        let source = self.receiver.forged_opening(name, msg)?;
        self.stats.control_forged += 1;
        Some(ProtocolError::BadProof { peer: PeerId(u64::MAX), xfer: msg.xfer(), source })
    }

    /// Whether a message from an agent never loaded here (`peer`: its id, if it has one) may
    /// pass as one-way traffic: a one-way WANT when we keep a mailbox, or any message of a
    /// one-way flow it holds. The shell, which keeps its own peer table, asks this too.
    pub fn admits_one_way(&self, peer: Option<PeerId>, msg: &wire::Msg) -> bool {
        Self::one_way_admissible(&self.answering, peer, msg)
    }

    /// [`admits_one_way`](Self::admits_one_way) with only the part of the endpoint it reads,
    /// so the peer table may ask it while the endpoint's other parts are borrowed.
    pub(super) fn one_way_admissible(answering: &Answering, peer: Option<PeerId>, msg: &wire::Msg) -> bool {
        if !answering.has_mailbox() {
            return false;
        }
        match msg {
            wire::Msg::Want(w) if w.endpoint == wire::REPLY_MAILBOX && !w.is_cancel() => return true,
            wire::Msg::Pull(p) if p.endpoint == wire::REPLY_MAILBOX && !p.is_cancel() => return true,
            _ => {}
        }
        let Some(peer) = peer else { return false };
        match msg {
            // The last CURSOR may come after the slot freed (then it is ignored).
            wire::Msg::Cursor(_) => true,
            wire::Msg::Want(_)
            | wire::Msg::Data(_)
            | wire::Msg::Plan(_)
            | wire::Msg::Keep(_)
            | wire::Msg::Pull(_)
            | wire::Msg::Release(_) => answering.knows(FlowKey { peer, xfer: msg.xfer() }),
            wire::Msg::Grant(_) | wire::Msg::Ack(_) => false,
        }
    }

    /// A message `from` a one-way flow waiting for a slot (see [`Answering::hold`]).
    pub(super) fn hold_waiting(&mut self, from: PeerId, mut msg: wire::Msg) -> Result<(), ProtocolError> {
        Self::strip_inline(&mut msg);
        let xfer = msg.xfer();
        let r = match self.answering.hold(FlowKey { peer: from, xfer }, msg) {
            Ok(held) => {
                trace!(peer = from.0, xfer = xfer.0, ?held, "message of a transfer waiting for a slot");
                Ok(())
            }
            Err(HoldError::WrongToken) => {
                self.stats.control_forged += 1;
                Err(ProtocolError::WrongToken { peer: from, xfer })
            }
            Err(HoldError::Full(_)) => {
                self.stats.one_way_refused += 1;
                Err(ProtocolError::NoMailboxSlot { peer: from, xfer })
            }
        };
        if let Err(e) = &r {
            self.stats.protocol_errors += 1;
            debug!(peer = from.0, error = %e, "protocol error");
        }
        r
    }

    /// Opens the waiting one-way flows a slot is free for now: each one's held messages are
    /// replayed as they came (the opening WANT or PULL judged by the receiver for the first
    /// time, then its further WANTs or PULLs). Returns true when one was opened.
    pub(super) fn serve_waiting(&mut self, now: Instant) -> bool {
        let mut served = false;
        while let Some((key, held)) = self.answering.next_servable(now) {
            served = true;
            for (n, msg) in held.into_iter().enumerate() {
                let mut ctx = ctx!(self, now);
                let r = match msg {
                    msg if n == 0 => Self::open_one_way(&mut self.receiver, &mut self.answering, &mut ctx, key, msg),
                    wire::Msg::Want(m) if self.answering.is_one_way(key) => {
                        Self::more_one_way_chunks(&mut self.receiver, &mut self.answering, &mut ctx, key, m)
                    }
                    wire::Msg::Pull(m) if self.answering.is_one_way(key) => {
                        self.receiver.handle_pull(&mut ctx, key.peer, m)
                    }
                    // The first one opened nothing (the receiver refused it unanswered).
                    _ => Ok(()),
                };
                if let Err(e) = &r {
                    self.stats.protocol_errors += 1;
                    debug!(peer = key.peer.0, error = %e, "protocol error in a WANT that waited for a slot");
                }
            }
        }
        served
    }

    /// Routes what the roles emitted for one-way transfers: answers to one-way flows become
    /// mailbox records, and an ended one-way transfer of ours stops being read, with the CURSOR
    /// that frees its slot at the target.
    pub(super) fn one_way_outputs(&mut self, now: Instant) {
        if !self.reading.is_empty() {
            let ended: Vec<XferId> = self
                .out
                .iter()
                .filter_map(|a| match a {
                    Action::Complete { xfer, .. } if self.reading.contains(*xfer) => Some(*xfer),
                    _ => None,
                })
                .collect();
            for xfer in ended {
                if let Some((peer, msg)) = self.reading.finish(xfer) {
                    self.out.push_back(Action::Send { peer, msg });
                }
            }
        }
        let receiver = &self.receiver;
        let shutting_down = self.closing || receiver.is_shutting_down();
        let written = self.answering.translate(now, &mut self.out, |k| receiver.has_flow(k), shutting_down);
        self.stats.records_written += written as u64;
    }

    /// Tells the liveness probe which peers we wait on now (transfers to them, flows from them).
    /// A peer we deal with only one way cannot answer a PING (it never loaded us, or we never
    /// loaded it): its transfers end by their timeouts or by a failed READ of its mailbox.
    pub(super) fn watch_waited(&mut self, now: Instant) {
        self.waited.clear();
        self.sender.peers_waited_on(&mut self.waited);
        self.receiver.peers_waited_on(&mut self.waited);
        // A held WRITE waits on its peer too: a peer that stops answering fails it as it fails
        // the transfer whose writes the held WRITE waits behind.
        self.deferred.peers_into(&mut self.waited);
        let (peers, answering, reading) = (&self.peers, &self.answering, &self.reading);
        let answers = &self.answers_pings;
        self.waited.retain(|&p| {
            let one_way = answering.has_peer(p) || reading.has_peer(p);
            !one_way || answers.as_ref().map_or_else(|| peers.answers_pings(p), |f| f(p))
        });
        self.liveness.watch(now, &self.waited);
    }

    /// A further WANT of open one-way flow `key`: the receiver takes its chunks (checking the
    /// token), and the flow's answers then count them.
    pub(super) fn more_one_way_chunks(
        receiver: &mut Receiver,
        answering: &mut Answering,
        ctx: &mut Ctx<'_>,
        key: FlowKey,
        want: wire::Want,
    ) -> Result<(), ProtocolError> {
        let (token, chunks) = (want.token, want.chunks.len());
        let r = receiver.handle_want(ctx, key.peer, want);
        if r.is_ok() {
            let _ = answering.open(ctx.now, key, token, chunks);
        }
        r
    }

    /// Drops a WANT's inline chunk: one that waits for a mailbox slot is served the usual way when
    /// it gets one, so the queue of waiting WANTs holds no payloads (only [`MAX_INLINE_HELD`]
    /// bytes are ever held for inline chunks).
    ///
    /// [`MAX_INLINE_HELD`]: crate::receiver::MAX_INLINE_HELD
    fn strip_inline(msg: &mut wire::Msg) {
        if let wire::Msg::Want(w) = msg {
            w.inline = None;
        }
    }

    /// Opens one-way flow `key` with its first WANT or PULL (`msg`). When no slot is free for it,
    /// a genuine one (its proofs verify under our registrations' keys, or are late for a
    /// registration just removed) waits for one (see [`Answering`]: held, not judged, and replayed
    /// here when a slot frees), counted in `one_way_queued`; only one the queue has no room for is
    /// dropped (`one_way_refused`). Otherwise the receiver judges it first: a forgery (a bad proof)
    /// must neither take a slot nor a place in the queue, or invented names could pin the whole
    /// mailbox. An accepted one, or a refusal worth answering (the receiver emitted an
    /// ACK(Refused)), gets a slot that carries the answer.
    pub(super) fn open_one_way(
        receiver: &mut Receiver,
        answering: &mut Answering,
        ctx: &mut Ctx<'_>,
        key: FlowKey,
        msg: wire::Msg,
    ) -> Result<(), ProtocolError> {
        let by = receiver.initiator_of(key.peer);
        let regs = receiver.registrations();
        let (token, chunks, verdict) = match &msg {
            wire::Msg::Want(m) => {
                (m.token, m.chunks.len(), regs.verify_opening((m.token, m.xfer), &by, &m.proofs, m.arena))
            }
            // A READ's answers count all its chunks, those of its later PULLs too.
            wire::Msg::Pull(m) => {
                (m.token, m.total as usize, regs.verify_opening((m.token, m.xfer), &by, &m.proofs, m.arena))
            }
            _ => return Ok(()),
        };
        // A forgery (no proof, or one no key of ours made) is judged before anything else: the
        // receiver answers some refusals before it looks at proofs (shutting down, an arena we
        // lack, a peer over its limits, a standing WANT), and each answer would take a slot for
        // a full timeout, so keyless names could pin the mailbox.
        let genuine = match verdict {
            Ok(_) | Err(BadProof::Deregistered(_)) => true,
            // It holds a key of ours (the receiver refuses it, with an answer).
            Err(BadProof::WrongArena(..)) => false,
            Err(source) => {
                ctx.stats.control_forged += 1;
                return Err(ProtocolError::BadProof { peer: key.peer, xfer: key.xfer, source });
            }
        };
        if genuine && matches!(answering.vacancy(ctx.now, key, token), Err(OneWayRefused::Slot(_))) {
            let mut msg = msg;
            Self::strip_inline(&mut msg);
            if answering.wait(ctx.now, key, msg).is_ok() {
                ctx.stats.one_way_queued += 1;
                trace!(peer = key.peer.0, xfer = key.xfer.0, "one-way WANT waits for a mailbox slot");
                return Ok(());
            }
            ctx.stats.one_way_refused += 1;
            return Err(ProtocolError::NoMailboxSlot { peer: key.peer, xfer: key.xfer });
        }
        let before = ctx.out.len();
        let r = match msg {
            wire::Msg::Want(m) => receiver.handle_want(ctx, key.peer, m),
            wire::Msg::Pull(m) => receiver.handle_pull(ctx, key.peer, m),
            _ => Ok(()),
        };
        let answered = ctx.out.len() > before;
        if (r.is_ok() || answered) && answering.open(ctx.now, key, token, chunks).is_err() {
            ctx.stats.one_way_refused += 1;
            ctx.out.truncate(before);
            if r.is_ok() {
                receiver.drop_flow(ctx, key);
            }
            return Err(ProtocolError::NoMailboxSlot { peer: key.peer, xfer: key.xfer });
        }
        if r.is_ok() {
            ctx.stats.one_way_answered += 1;
        }
        r
    }
}
