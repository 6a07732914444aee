//! How flows end without finishing: a lost peer, a silent flow timed out, a cancel, shutdown.
//! Their regions are reclaimed (quarantined when their writer may only be slow) and the
//! flow's state forgotten.

use super::*;

impl Receiver {
    /// The peer's id is retired (lost, reloaded, an evicted one-way name): its flows are
    /// reclaimed. Its name's replay state stays with the name's other ids, or, for its last,
    /// is kept for the name's next id (see [`ended::Party`]); an id never named takes its own.
    pub(crate) fn handle_peer_lost(&mut self, ctx: &mut Ctx<'_>, peer: PeerId) {
        self.reclaim_flows_of(ctx, peer);
        self.drop_held_of(peer);
        match self.initiators.remove(&peer) {
            Some(name) => {
                let live = self.named_ids.get_mut(&name).map_or(0, |n| {
                    *n -= 1;
                    *n
                });
                if live == 0 {
                    self.named_ids.remove(&name);
                    if let Some(state) = self.replay.remove(&ended::Party::Name(name)) {
                        self.evicted.keep(name, state);
                    }
                }
            }
            None => {
                self.replay.remove(&ended::Party::Id(peer));
            }
        }
    }

    /// Reclaims every flow of `peer`, keeping its replay floors: for a peer that keeps its id
    /// and session here (declared dead by the probe, or one that unloaded our metadata), whose
    /// captured inline WANTs or standing claims must stay refused as replays.
    pub(crate) fn reclaim_flows_of(&mut self, ctx: &mut Ctx<'_>, peer: PeerId) {
        let r = ctx.scheds.reclaim_peer(peer, self.rest(ctx));
        ctx.stats.regions_quarantined += r.quarantined.len() as u64;
        let keys: Vec<FlowKey> = self.flows.keys().filter(|k| k.peer == peer).copied().collect();
        if !keys.is_empty() {
            debug!(
                peer = peer.0,
                flows = keys.len(),
                freed = r.freed.len(),
                quarantined = r.quarantined.len(),
                deferred = r.deferred.len(),
                "peer lost: flows reclaimed"
            );
        }
        for key in keys {
            self.note_resting(ctx, key);
            self.forget(key);
        }
    }

    pub(crate) fn handle_timeout(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now;
        // Quarantines that ended (the endpoint lifts them first) need no cancel any more.
        if !self.resting.is_empty() {
            self.resting.retain(|&k, _| ctx.scheds.is_resting(k));
        }
        while let Some(key) = self.timers.pop_due(now) {
            let Some(flow) = self.flows.get_mut(&key) else {
                continue;
            };
            // A DATA held behind its peer's orphaned scatters came, and a held gather is ours
            // to start (see `order`).
            let held = self.behind.held_of(key) + self.behind.gathers_held_of(key);
            let waiting_for_data = ctx.scheds.flow_held_count(key).saturating_sub(flow.scattering + held);
            let waiting_for_pulls = flow.pull.as_ref().is_some_and(|p| !p.complete());
            // Regions left idle past their own lease cap, beyond those we hold back ourselves
            // (a standing flow's one region is its lease, kept by `kept`'s cap alone): the flow
            // is granted nothing more, and ends by its lease (see `REGION_LEASES`).
            let cap = self.idle_timeout * REGION_LEASES;
            let given_at = &self.given_at;
            let overdue = !flow.standing
                && !flow.frozen
                && ctx
                    .scheds
                    .get(flow.arena)
                    .idle_regions(key)
                    .filter(|&off| given_at.get(&(flow.arena, off)).is_some_and(|&t| t + cap <= now))
                    .count()
                    > held;
            if overdue {
                debug!(
                    peer = key.peer.0,
                    xfer = key.xfer.0,
                    "a region idle past its cap: the flow is granted nothing more"
                );
                flow.frozen = true;
                ctx.scheds.drop_pending(key);
            }
            if flow.deadline <= now && (waiting_for_data > 0 || waiting_for_pulls) {
                // Counted (`flows_timed_out`, published by the shell); at debug, since a peer
                // that opens many flows and goes silent must not flood the log.
                debug!(
                    peer = key.peer.0,
                    xfer = key.xfer.0,
                    regions = waiting_for_data,
                    "flow silent too long: reclaimed"
                );
                ctx.stats.flows_timed_out += 1;
                let given = flow.given;
                self.reclaim(ctx, key, self.rest(ctx));
                if self.wrote.get(&key.peer).is_none_or(|&w| given.is_none_or(|g| w < g)) {
                    self.drop_unserved(ctx, key.peer);
                }
            } else {
                // Waiting for our arena or our own scatters is not the sender's fault.
                if flow.deadline <= now {
                    flow.deadline = now + self.idle_timeout;
                }
                self.timers.set(key, flow.deadline);
            }
        }
    }

    pub(crate) fn shutdown(&mut self, ctx: &mut Ctx<'_>) {
        self.shutting_down = true;
        let keys: Vec<FlowKey> = self.flows.keys().copied().collect();
        for key in keys {
            self.reclaim(ctx, key, Reuse::Now);
        }
        // The arena goes with the engine; a late write then fails at its writer.
        ctx.scheds.lift_quarantine(None);
        self.resting.clear();
    }

    /// Drops flow `key` as a cancel would (the endpoint found no way to answer it).
    pub(crate) fn drop_flow(&mut self, ctx: &mut Ctx<'_>, key: FlowKey) {
        self.reclaim(ctx, key, self.rest(ctx));
    }

    /// The quarantine of a region reclaimed now from a writer that did not say it is done.
    pub(super) fn rest(&self, ctx: &Ctx<'_>) -> Reuse {
        Reuse::After(ctx.now + self.quarantine)
    }

    /// A cancel for flow `key`, which we no longer track: if we reclaimed it and its regions
    /// still rest in quarantine, its sender now says its writes have ended (a cancel follows
    /// them), so they are freed at once. It must carry the flow's token, as any cancel must;
    /// a cancel for a flow we never knew or that rests no more changes nothing.
    pub(super) fn cancel_resting(
        &mut self,
        ctx: &mut Ctx<'_>,
        key: FlowKey,
        token: Token,
    ) -> Result<(), ProtocolError> {
        let Some(&rested) = self.resting.get(&key) else {
            trace!(peer = key.peer.0, xfer = key.xfer.0, "cancel of an unknown flow");
            return Ok(());
        };
        if rested != token {
            ctx.stats.control_forged += 1;
            return Err(ProtocolError::WrongToken { peer: key.peer, xfer: key.xfer });
        }
        self.resting.remove(&key);
        let lifted = ctx.scheds.lift_flow(key);
        debug!(peer = key.peer.0, xfer = key.xfer.0, regions = lifted, "cancel ends a quarantine");
        Ok(())
    }

    /// Notes the token of reclaimed flow `key` while its regions rest (see `resting`).
    fn note_resting(&mut self, ctx: &Ctx<'_>, key: FlowKey) {
        if let Some(flow) = self.flows.get(&key).filter(|_| ctx.scheds.is_resting(key)) {
            self.resting.insert(key, flow.token);
        }
    }

    /// Cancels flow `key`: orphans its scattering regions and frees the others as `reuse` says.
    pub(super) fn reclaim(&mut self, ctx: &mut Ctx<'_>, key: FlowKey, reuse: Reuse) {
        let r = ctx.scheds.reclaim_flow(key, reuse);
        ctx.stats.regions_quarantined += r.quarantined.len() as u64;
        self.note_resting(ctx, key);
        if self.flows.get(&key).is_some_and(|f| f.claimed_from.is_some()) {
            self.rearm_standing(ctx, key.peer);
        }
        if self.forget(key) {
            trace!(
                peer = key.peer.0,
                xfer = key.xfer.0,
                freed = r.freed.len(),
                quarantined = r.quarantined.len(),
                deferred = r.deferred.len(),
                "flow reclaimed"
            );
        }
    }

    /// Peer `peer` let a grant lapse and has used none since it was given: its flows that have
    /// waited for the arena since their WANT, never given a region, are dropped too (standing
    /// flows aside: they hold one region at most and keep their own lease). Served, they would
    /// only hand the same silence the next regions, a lease at a time: a peer that announced a
    /// hundred transfers and stalled held the arena for a chain of leases while its queue
    /// lasted. Their senders, if alive, fail them at their timeout, as for a WANT the flow cap
    /// drops; a flow announced later is served as usual. Counted in `flows_dropped_unserved`.
    pub(super) fn drop_unserved(&mut self, ctx: &mut Ctx<'_>, peer: PeerId) {
        let unserved: Vec<FlowKey> = self
            .flows
            .range(FlowKey::all_of(peer))
            .filter(|(k, f)| {
                f.given.is_none() && !f.standing && f.scattering == 0 && ctx.scheds.flow_held_count(**k) == 0
            })
            .map(|(k, _)| *k)
            .collect();
        if unserved.is_empty() {
            return;
        }
        debug!(peer = peer.0, flows = unserved.len(), "peer let a grant lapse: its unserved flows dropped");
        ctx.stats.flows_dropped_unserved += unserved.len() as u64;
        for key in unserved {
            self.reclaim(ctx, key, Reuse::Now);
        }
    }

    /// A frame that would open flow `key` again after it ended here is a replay: counted
    /// ([`Stats::control_replayed`]) and refused.
    /// So is one for a transfer of the same name still open under another of the name's ids:
    /// a captured opening frame sent again one way under an invented session (which buys an id
    /// of its own) while its flow was open opened a second flow of it (review 61, READ M1).
    pub(super) fn refuse_replay(&self, ctx: &mut Ctx<'_>, key: FlowKey) -> Result<(), ProtocolError> {
        // Looked for only while the name has several live ids (a restart, or invented
        // sessions): rare, and then a pass over the named ids.
        let open_elsewhere = || {
            let Some(by) = self.initiators.get(&key.peer) else { return false };
            self.named_ids.get(by).is_some_and(|&n| n > 1)
                && self.initiators.iter().any(|(&id, b)| {
                    id != key.peer && b == by && self.flows.contains_key(&FlowKey { peer: id, xfer: key.xfer })
                })
        };
        if self.replay_of(key.peer).is_some_and(|r| r.ended.covers(key.xfer)) || open_elsewhere() {
            ctx.stats.control_replayed += 1;
            return Err(ProtocolError::Replayed { peer: key.peer, xfer: key.xfer });
        }
        Ok(())
    }

    /// Drops the receiver's record of `key`; true when there was one.
    pub(super) fn forget(&mut self, key: FlowKey) -> bool {
        match self.flows.remove(&key) {
            Some(flow) => {
                if flow.scattering > 0 || self.behind.holds(key.peer) {
                    self.orphan_scatters_of(key);
                }
                self.replay_mut(key.peer).ended.note(key.xfer);
                self.timers.stop(key);
                self.inline_held -= flow.inline.as_ref().map_or(0, |i| i.bytes.len() as u64);
                if flow.standing {
                    self.standing.remove(&key.peer);
                }
                if let Some(load) = self.load.get_mut(&key.peer) {
                    load.flows -= 1;
                    load.chunks -= flow.units();
                    if load.flows == 0 {
                        self.load.remove(&key.peer);
                        self.wrote.remove(&key.peer);
                    }
                }
                true
            }
            None => false,
        }
    }
}
