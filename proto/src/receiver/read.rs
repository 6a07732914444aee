//! The receiver as the target of READs (our addition: the reference design only writes, and
//! vLLM's decode side pulls): a PULL opens or extends a READ flow with
//! its chunks' gather runs, checked against the registrations it proves; each granted region
//! is gathered here and announced ready (a GRANT); the initiator's RELEASE frees it. A chunk
//! whose sources went meanwhile fails its flow.

use tracing::{debug, trace};

use super::*;

impl Receiver {
    /// A READ flow's regions were granted: gather each chunk into its region (announced ready
    /// once gathered). A chunk whose sources are no longer registered fails the flow.
    /// While the peer's orphaned scatters run, the gathers wait for them (see `order`).
    pub(super) fn start_gathers(&mut self, ctx: &mut Ctx<'_>, key: FlowKey, token: Token, credits: &[Credit]) {
        if self.behind.hold_gathers(key, token, credits) {
            trace!(
                peer = key.peer.0,
                xfer = key.xfer.0,
                regions = credits.len(),
                "READ gathers held behind an orphaned scatter"
            );
            ctx.stats.gathers_held += credits.len() as u64;
            return;
        }
        let mut freed = false;
        for c in credits {
            let Some(flow) = self.flows.get_mut(&key) else { return };
            if flow.pull.as_ref().is_some_and(|p| p.failed) {
                freed = true;
                // The READ failed while these waited behind orphans (review 59): nothing will
                // READ them, so they are freed, not gathered; its initiator's cancel ends it.
                let sched = ctx.sched(flow.arena);
                if sched.begin_scatter(key, c.region.offset).is_err() || sched.end_scatter(c.region.offset).is_err() {
                    internal_error("freeing a failed READ's held region", &c.region.offset);
                }
                continue;
            }
            let i = c.chunk.0 as usize;
            let Some((runs, span, removals)) =
                flow.pull.as_ref().and_then(|p| p.chunks.get(i)).map(|c| (Arc::clone(&c.runs), c.span, c.removals))
            else {
                internal_error("grant for a READ chunk without runs", &c.chunk.0);
                continue;
            };
            // Checked at the PULL; again only if a registration went since (a deregistration
            // racing the READ), as a kept PLAN is.
            let still_registered = removals == self.registered.removals() || {
                let proven = self.registered.proven_ranges(&flow.proven);
                runs.iter().all(|r| r.addr_span().is_some_and(|(a, b)| proven.covers(a, b)))
            };
            if !still_registered {
                debug!(peer = key.peer.0, xfer = key.xfer.0, chunk = c.chunk.0, "READ source no longer registered");
                ctx.stats.dereg_failed += 1;
                let arena = flow.arena;
                self.fail_chunk(ctx, key, token, c.chunk, (arena, c.region));
                continue;
            }
            if let Err(e) = ctx.sched(flow.arena).begin_scatter(key, c.region.offset) {
                internal_error("begin a READ gather on a region just granted", &e);
                continue;
            }
            flow.scattering += 1;
            let (job, arena) = (ctx.job(), flow.arena);
            let gather = PullGather { flow: key, arena, token, chunk: c.chunk, region: c.region, span, doomed: false };
            self.gathers.insert(job, gather);
            trace!(peer = key.peer.0, xfer = key.xfer.0, chunk = c.chunk.0, region = %c.region, "READ gather");
            ctx.push(Action::Gather { job, xfer: key.xfer, arena, region: c.region, runs: JobRuns::Pulled(runs) });
        }
        if freed {
            self.forget_if_ended(ctx, key);
        }
    }

    /// True when `job` is one of this target's READ gathers.
    pub(crate) fn owns_gather(&self, job: JobId) -> bool {
        self.gathers.contains_key(&job)
    }

    /// A READ gather ended: the region is announced ready (a GRANT) or, failed, the flow is
    /// answered ACK(Failed) and reclaimed.
    pub(crate) fn handle_gather_done(&mut self, ctx: &mut Ctx<'_>, job: JobId, ok: bool) {
        let Some(g) = self.gathers.remove(&job) else { return };
        match ctx.sched(g.arena).end_job(g.region.offset) {
            Ok(Some(_freed)) => return, // the flow was reclaimed meanwhile: nobody waits
            Ok(None) => {}
            Err(e) => return internal_error("end of a READ gather", &e),
        }
        if let Some(flow) = self.flows.get_mut(&g.flow) {
            flow.scattering -= 1;
            flow.progressed(ctx.now, self.idle_timeout);
        }
        if ok && !g.doomed {
            ctx.stats.chunks_served += 1;
            // The region waits for the initiator from now on: its idle cap runs from here, not
            // from the grant (our gather, or a wait behind orphaned scatters, is not the
            // initiator's delay; review 61, diff L1).
            self.given_at.insert((g.arena, g.region.offset), ctx.now);
            let credit = Credit { chunk: g.chunk, region: g.region };
            ctx.send(g.flow.peer, Grant { xfer: g.flow.xfer, token: g.token, credits: vec![credit] });
        } else {
            self.fail_chunk(ctx, g.flow, g.token, g.chunk, (g.arena, g.region));
        }
    }

    /// A READ chunk that cannot be served: its region (never announced) is freed and the
    /// initiator told with ACK(Failed). The flow itself stays: the initiator may be READing
    /// other regions of it, which must not be freed under it; its cancel ends the flow.
    fn fail_chunk(
        &mut self,
        ctx: &mut Ctx<'_>,
        key: FlowKey,
        token: Token,
        chunk: ChunkIdx,
        (arena, region): (ArenaId, Region),
    ) {
        let ack = Ack { xfer: key.xfer, token, chunk, region, status: AckStatus::Failed };
        ctx.send(key.peer, ack);
        // The transfer has failed: grant it nothing more (its initiator cancels the rest).
        ctx.scheds.drop_pending(key);
        if let Some(p) = self.flows.get_mut(&key).and_then(|f| f.pull.as_mut()) {
            p.failed = true;
        }
        let sched = ctx.sched(arena);
        if sched.begin_scatter(key, region.offset).is_err() || sched.end_scatter(region.offset).is_err() {
            internal_error("freeing a failed READ region", &region.offset);
        }
        self.forget_if_ended(ctx, key);
    }

    /// Forgets READ flow `key` once it holds nothing and no PULL of it is still to come: a
    /// READ whose first chunks were served before the rest were announced goes on.
    fn forget_if_ended(&mut self, ctx: &Ctx<'_>, key: FlowKey) -> bool {
        let ended = !ctx.scheds.has_flow(key)
            && self.flows.get(&key).is_none_or(|f| f.pull.as_ref().is_none_or(PullRuns::complete));
        ended && self.forget(key)
    }

    /// A PULL: the initiator READs these chunks of our registered memory through our arena. As
    /// a WANT, but each chunk comes with its gather runs, checked here against the chunk and
    /// the registrations the flow proved; an empty PULL cancels. The first PULL of a READ opens
    /// its flow; the next ones (same token, the chunks that follow) add to it.
    pub(crate) fn handle_pull(&mut self, ctx: &mut Ctx<'_>, from: PeerId, pull: Pull) -> Result<(), ProtocolError> {
        let key = FlowKey { peer: from, xfer: pull.xfer };
        // A transfer's id never carries the standing flows' bit (see `handle_want`).
        if pull.xfer.0 & STANDING_XFER_BIT != 0 {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::StandingWant { peer: from, xfer: pull.xfer });
        }
        let flow = self.flows.get(&key);
        if flow.is_some_and(|f| f.token != pull.token) {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::WrongToken { peer: from, xfer: pull.xfer });
        }
        let refuse = |ctx: &mut Ctx<'_>| {
            let region = Region { offset: 0, len: 1 };
            let ack =
                Ack { xfer: pull.xfer, token: pull.token, chunk: ChunkIdx(0), region, status: AckStatus::Refused };
            ctx.send(from, ack);
        };
        if pull.chunks.is_empty() && flow.is_none() {
            return self.cancel_resting(ctx, key, pull.token);
        }
        // An opening PULL of a READ that ended here is a replay (a later one of an ended READ
        // is only late: counted below).
        if flow.is_none() && pull.first.0 == 0 {
            self.refuse_replay(ctx, key)?;
        }
        if pull.chunks.is_empty() {
            debug!(peer = from.0, xfer = pull.xfer.0, "READ cancel");
            self.reclaim(ctx, key, Reuse::Now);
            return Ok(());
        }
        let bad = |why| Err(ProtocolError::BadPull { peer: from, xfer: pull.xfer, why });
        let opens = match flow.map(|f| f.pull.as_ref()) {
            None if pull.first.0 == 0 => true,
            // A later PULL of a flow already ended (failed, canceled or reclaimed): its
            // initiator has failed the transfer or will; nothing to do.
            None => {
                ctx.stats.late_data += 1;
                return Ok(());
            }
            Some(None) => return bad("a PULL for a WRITE flow"),
            Some(Some(p)) if p.failed => return Ok(()),
            Some(Some(p)) if pull.first.0 as usize != p.chunks.len() || pull.total != p.total => {
                return bad("a PULL out of its flow's order");
            }
            Some(Some(_)) => false,
        };
        if self.shutting_down {
            refuse(ctx);
            return Ok(());
        }
        if !self.arena_ok(ctx.scheds, key, pull.arena) {
            refuse(ctx);
            return Err(ProtocolError::WrongArena { peer: from, xfer: pull.xfer, arena: pull.arena });
        }
        let load = self.load.get(&from).copied().unwrap_or_default();
        // A PULL's gather runs are kept until its flow ends: they count against the peer's
        // budget with its chunks, so a peer cannot park unbounded run lists here.
        let runs: u64 = pull.chunks.iter().map(|c| c.runs.len() as u64).sum();
        let units = (pull.chunks.len() as u64).saturating_add(runs);
        let (flows, chunks) = (load.flows + usize::from(opens), load.chunks.saturating_add(units));
        if flows > self.caps.flows || chunks > self.caps.chunks {
            refuse(ctx);
            return Err(ProtocolError::PeerOverLimit { peer: from, xfer: pull.xfer, flows, chunks });
        }
        if let Err(total) = self.within_total(units) {
            refuse(ctx);
            return Err(ProtocolError::OverTotalLimit { peer: from, xfer: pull.xfer, chunks: total });
        }
        let by = self.initiator_of(from);
        // The opening PULL proves its sources, one way or two way (see `handle_want`).
        let verified = if opens {
            self.registered.verify_opening((pull.token, pull.xfer), &by, &pull.proofs, pull.arena)
        } else {
            self.registered.verify((pull.token, pull.xfer), &by, &pull.proofs, pull.arena)
        };
        let mut proven = match verified {
            Ok(proven) => {
                ctx.stats.frames_authentic += 1;
                proven
            }
            Err(source @ (BadProof::Deregistered(_) | BadProof::WrongArena(..))) => {
                refuse(ctx);
                return Err(ProtocolError::BadProof { peer: from, xfer: pull.xfer, source });
            }
            Err(source) => {
                ctx.stats.control_forged += 1;
                return Err(ProtocolError::BadProof { peer: from, xfer: pull.xfer, source });
            }
        };
        // A later PULL reads what the flow proved so far, and what it proves itself.
        proven.extend_from_slice(self.flows.get(&key).map_or(&[][..], |f| &f.proven[..]));
        proven.sort_unstable();
        proven.dedup();
        let ranges = self.registered.proven_ranges(&proven);
        let removals = self.registered.removals();
        let mut pulled = Vec::with_capacity(pull.chunks.len());
        for c in pull.chunks.iter() {
            let (mut copies, mut span, mut inside) = (0u64, (u64::MAX, 0), !c.runs.is_empty());
            for r in c.runs.iter() {
                copies = copies.saturating_add(r.len.saturating_mul(u64::from(r.count)));
                match (r.region_span(), r.addr_span()) {
                    (Some((_, end)), Some((a, b))) if r.len > 0 && end <= c.bytes && ranges.covers(a, b) => {
                        span = (span.0.min(a), span.1.max(b));
                    }
                    _ => inside = false,
                }
            }
            if copies > c.bytes || !inside {
                refuse(ctx);
                return bad("a run reads outside its chunk or the proven registrations");
            }
            pulled.push(PulledChunk { runs: Arc::clone(&c.runs), span, removals });
        }
        let sizes: Vec<u64> = pull.chunks.iter().map(|c| c.bytes).collect();
        if let Err(source) = ctx.sched(pull.arena).want_from(key, pull.first.0.into(), &sizes) {
            refuse(ctx);
            return Err(ProtocolError::BadWant { peer: from, xfer: pull.xfer, source });
        }
        self.load.insert(from, PeerLoad { flows, chunks });
        ctx.stats.wants += 1;
        let deadline = ctx.now + self.idle_timeout;
        match self.flows.get_mut(&key) {
            Some(flow) => {
                flow.chunks.extend_from_slice(&sizes);
                flow.proven = proven;
                flow.kept(ctx.now, self.idle_timeout);
                if flow.frozen {
                    ctx.scheds.drop_pending(key);
                }
                if let Some(p) = flow.pull.as_mut() {
                    p.chunks.extend(pulled);
                }
            }
            None => {
                self.timers.set(key, deadline);
                let flow = Flow {
                    token: pull.token,
                    arena: pull.arena,
                    proven,
                    chunks: sizes,
                    scattering: 0,
                    pull: Some(PullRuns { chunks: pulled, total: pull.total, failed: false }),
                    plans: BTreeMap::new(),
                    replanned: BTreeSet::new(),
                    inline: None,
                    standing: false,
                    claimed_from: None,
                    deadline,
                    progress: ctx.now,
                    given: None,
                    frozen: false,
                };
                self.flows.insert(key, flow);
            }
        }
        debug!(peer = from.0, xfer = pull.xfer.0, first = pull.first.0, total = pull.total, "READ flow wants");
        Ok(())
    }

    /// A RELEASE: the initiator has READ the chunk's region; it is freed (and the window
    /// refills). The last one ends the flow.
    pub(crate) fn handle_release(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        rel: Release,
    ) -> Result<(), ProtocolError> {
        let key = FlowKey { peer: from, xfer: rel.xfer };
        let Some(flow) = self.flows.get_mut(&key) else {
            ctx.stats.late_data += 1;
            return Ok(());
        };
        if flow.token != rel.token {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::WrongToken { peer: from, xfer: rel.xfer });
        }
        self.wrote.insert(from, ctx.now);
        let bad = Err(ProtocolError::BadRelease { peer: from, xfer: rel.xfer, chunk: rel.chunk });
        if flow.pull.is_none() {
            return bad;
        }
        // Held, ready (its gather ended, not held back: see `order`), and the very region and
        // chunk announced.
        let arena = flow.arena;
        match ctx.sched(arena).is_held(key, rel.region.offset) {
            Some(g) if g.region == rel.region && g.chunk == rel.chunk && !self.behind.holds_gather(key, g.region) => {}
            _ => return bad,
        }
        flow.progressed(ctx.now, self.idle_timeout);
        let sched = ctx.sched(arena);
        if sched.begin_scatter(key, rel.region.offset).is_err() || sched.end_scatter(rel.region.offset).is_err() {
            internal_error("freeing a released READ region", &rel.region.offset);
        }
        if self.forget_if_ended(ctx, key) {
            debug!(peer = from.0, xfer = rel.xfer.0, "READ flow done");
        }
        Ok(())
    }
}
