//! Credits meet local staging: a granted chunk is given a staging region in its arena (or is
//! parked until one frees up; each arena keeps a reserve of one largest chunk), gathered into it
//! (or written from user memory when direct) to the granted remote region; writes in flight send
//! KEEPs so that the receiver does not reclaim their regions.

use super::*;

impl Sender {
    /// Gives parked credits the local staging space that freed up, oldest first (a chunk that
    /// does not fit does not block smaller ones behind it, until it has waited an eighth of a
    /// timeout: see below), falling back on the reserve; then refills the reserve (or returns
    /// it when no transfer is left). Call before the scheduler's `schedule()`, so freed space
    /// serves local credits before new remote grants.
    pub(crate) fn retry_parked(&mut self, ctx: &mut Ctx<'_>) {
        if !self.parked.is_empty() {
            let mut keep = VecDeque::new();
            // Arenas whose oldest waiting credit has waited an eighth of a timeout and still
            // does not fit: credits behind it there wait too, so that the space freed
            // piecemeal coalesces into a block it fits. Served first-fit for ever, a large
            // credit whose space came back in small pieces (last chunks, small transfers) went
            // to the smaller credits behind it, and timed out at a quarter of a timeout while
            // the engine was making progress (review 52, sender F4).
            let mut held = std::mem::take(&mut self.staging_held);
            held.clear();
            while let Some((id, i)) = self.parked.pop_front() {
                let patience = self.xfers.get(&id).map_or(self.timeout, |x| self.lease_base(x.peer)) / 8;
                let Some(x) = self.xfers.get_mut(&id) else {
                    continue;
                };
                let Stage::Parked { credit } = x.stages[i] else {
                    continue;
                };
                let (read, arena) = (x.read, x.plan.local_arena);
                if held.contains(&arena) {
                    keep.push_back((id, i));
                    continue;
                }
                let bytes = x.plan.chunks[i].bytes;
                match stage_credit(ctx, (&mut self.reserve, &mut self.reserve_stale), arena, bytes, false) {
                    Some(local) if read => {
                        trace!(xfer = id.0, chunk = i, "parked READ credit staged");
                        if let Err(e) = self.start_read(ctx, id, i, (arena, local), credit) {
                            self.fail(ctx, id, e, true);
                        }
                    }
                    Some(local) => {
                        trace!(xfer = id.0, chunk = i, "parked credit staged");
                        let job = start_gather(ctx, &mut self.jobs, id, x, i, local);
                        x.stages[i] = Stage::Gathering { local, job, credit: Some(credit) };
                    }
                    None => {
                        if ctx.now >= credit.at + patience {
                            held.push(arena);
                        }
                        keep.push_back((id, i));
                    }
                }
            }
            self.parked = keep;
            self.staging_held = held;
        } else {
            self.staging_held.clear();
        }
        // Each arena's reserve goes back once no transfer stages there, and is retaken while
        // one does.
        if !self.reserve_stale {
            return;
        }
        let idle: Vec<ArenaId> =
            self.reserve.keys().copied().filter(|a| self.staging_xfers.get(a).is_none_or(|&n| n == 0)).collect();
        for arena in idle {
            if let Some(r) = self.reserve.remove(&arena) {
                release(ctx, arena, r);
            }
        }
        let wanting: Vec<ArenaId> = self
            .staging_xfers
            .iter()
            .filter(|&(a, &n)| n > 0 && !self.reserve.contains_key(a))
            .map(|(&a, _)| a)
            .collect();
        for arena in wanting {
            self.take_reserve_of(ctx, arena);
        }
        // An arena still without its reserve (full for now) is looked at again next time.
        self.reserve_stale = self.staging_xfers.iter().any(|(a, &n)| n > 0 && !self.reserve.contains_key(a));
    }

    /// A transfer staging in `arena` starts: counted, and the arena's reserve taken if it has
    /// none (before any eager staging can take the budget the reserve lives in).
    pub(super) fn start_staging(&mut self, ctx: &mut Ctx<'_>, arena: ArenaId) {
        *self.staging_xfers.entry(arena).or_default() += 1;
        if !self.reserve.contains_key(&arena) {
            self.take_reserve_of(ctx, arena);
            self.reserve_stale |= !self.reserve.contains_key(&arena);
        }
    }

    /// A transfer staging in `arena` ended (the arena's last: its reserve goes back at the
    /// next `retry_parked`).
    pub(super) fn stop_staging(&mut self, arena: ArenaId) {
        if let Some(n) = self.staging_xfers.get_mut(&arena) {
            *n -= 1;
            // The entry stays at 0 (an arena's count comes and goes with every transfer).
            self.reserve_stale |= *n == 0;
        }
    }

    /// The largest chunk `arena` stages (the first arena's for one never set).
    pub(super) fn max_chunk(&self, arena: ArenaId) -> u64 {
        self.max_chunks.get(usize::from(arena.0)).copied().unwrap_or(self.max_chunks[0])
    }

    /// Sets the largest chunk `arena` stages (see [`crate::endpoint::Endpoint::add_arena`]).
    pub(crate) fn set_max_chunk(&mut self, arena: ArenaId, bytes: u64) {
        let i = usize::from(arena.0);
        if self.max_chunks.len() <= i {
            let first = self.max_chunks[0];
            self.max_chunks.resize(i + 1, first);
        }
        self.max_chunks[i] = bytes;
    }

    /// Takes `arena`'s reserve: one region of the largest chunk it stages.
    fn take_reserve_of(&mut self, ctx: &mut Ctx<'_>, arena: ArenaId) {
        let sched = ctx.sched(arena);
        let bytes = self.max_chunk(arena).min(sched.max_chunk_bytes());
        if let Some(r) = sched.acquire_local(bytes, true) {
            self.reserve.insert(arena, r);
        }
    }

    /// Binds a validated credit to chunk `i` of `id`.
    pub(super) fn attach(&mut self, ctx: &mut Ctx<'_>, id: XferId, i: usize, credit: Credit) -> Result<(), XferError> {
        let Some(x) = self.xfers.get_mut(&id) else {
            internal_error("credit for a vanished transfer", &id.0);
            return Ok(());
        };
        if x.read {
            let Stage::Idle = x.stages[i] else {
                internal_error("READ credit for a chunk that already has one", &i);
                return Ok(());
            };
            let arena = x.plan.local_arena;
            let (bytes, held) = (x.plan.chunks[i].bytes, self.staging_held.contains(&arena));
            return match stage_credit(ctx, (&mut self.reserve, &mut self.reserve_stale), arena, bytes, held) {
                Some(local) => self.start_read(ctx, id, i, (arena, local), credit),
                None => {
                    trace!(xfer = id.0, chunk = i, "READ credit parked: no local staging space");
                    x.stages[i] = Stage::Parked { credit };
                    self.parked.push_back((id, i));
                    Ok(())
                }
            };
        }
        if let (Stage::Idle, Some(addr)) = (x.stages[i], x.plan.chunks[i].direct) {
            return self.post_write(ctx, id, i, WriteSource::User { addr }, credit);
        }
        let arena = x.plan.local_arena;
        // Behind an old parked credit in this arena (see `retry_parked`): no freed space, only
        // the reserve, which the old credit could already have taken.
        let (bytes, held) = (x.plan.chunks[i].bytes, self.staging_held.contains(&arena));
        match x.stages[i] {
            Stage::Idle => match stage_credit(ctx, (&mut self.reserve, &mut self.reserve_stale), arena, bytes, held) {
                Some(local) => {
                    let job = start_gather(ctx, &mut self.jobs, id, x, i, local);
                    x.stages[i] = Stage::Gathering { local, job, credit: Some(credit) };
                }
                None => {
                    trace!(xfer = id.0, chunk = i, "credit parked: no local staging space");
                    x.stages[i] = Stage::Parked { credit };
                    self.parked.push_back((id, i));
                }
            },
            Stage::Gathering { local, job, credit: None } => {
                promote(ctx, arena, local);
                x.stages[i] = Stage::Gathering { local, job, credit: Some(credit) };
            }
            Stage::Gathered { local } => {
                promote(ctx, arena, local);
                return self.post_write(ctx, id, i, WriteSource::Arena(local), credit);
            }
            _ => internal_error("credit for a chunk that already has one", &i),
        }
        Ok(())
    }

    /// Posts the write of chunk `i` from `source` (its gathered region, or user memory for a
    /// direct chunk), unless its credit is stale.
    pub(super) fn post_write(
        &mut self,
        ctx: &mut Ctx<'_>,
        id: XferId,
        i: usize,
        source: WriteSource,
        credit: Credit,
    ) -> Result<(), XferError> {
        let lease = self.xfers.get(&id).map_or(self.timeout, |x| self.lease_base(x.peer));
        let Some(x) = self.xfers.get_mut(&id) else {
            internal_error("write for a vanished transfer", &id.0);
            return Ok(());
        };
        if ctx.now >= credit.at + lease / 4 {
            // The receiver reclaims regions left unwritten for half a timeout (a lease: a silent
            // peer must not hold the arena long enough to time out everyone else's transfers);
            // writing after a quarter could land in a region it has granted to someone else.
            debug!(xfer = id.0, chunk = i, "credit went stale before the write");
            x.stages[i] = Stage::unwritten(source);
            return Err(XferError::Timeout);
        }
        let job = ctx.job();
        self.jobs.insert(job, JobRef { xfer: id, chunk: i, kind: JobKind::Write });
        x.stages[i] = Stage::Writing { source, job, credit };
        let len = x.plan.chunks[i].bytes;
        trace!(xfer = id.0, chunk = i, ?source, remote = %credit.region, len, "write");
        let (arena, remote_arena) = (x.plan.local_arena, x.plan.peer_arena);
        ctx.push(Action::Write {
            job,
            xfer: id,
            peer: x.peer,
            source,
            arena,
            remote_arena,
            remote: credit.region,
            len,
        });
        self.writes.insert(job, WriteInFlight { peer: x.peer, xfer: id, token: x.token });
        self.keep_from(ctx.now, lease);
        Ok(())
    }

    /// A write (or READ) in flight under a lease of `lease`: the next round of KEEPs comes
    /// within an eighth of it.
    pub(super) fn keep_from(&mut self, now: Instant, lease: Duration) {
        let every = self.keep_every.min(lease / 8);
        if !every.is_zero() {
            let due = now + every;
            self.next_keep = Some(self.next_keep.map_or(due, |t| t.min(due)));
        }
    }

    /// One round of KEEPs: one per flow with a write in flight, so the receiver does not
    /// reclaim a region a slow write may still land in. Re-armed while any write is in flight.
    ///
    /// Every write in flight counts, however young: its flow's lease at the receiver runs from
    /// the grant (half the timeout), and the write may be posted up to a quarter timeout after
    /// the credit came, so waiting until it is itself an eighth old could send its first KEEP
    /// half a timeout after the credit, when the flow is already reclaimed. This way the first
    /// KEEP leaves at most an eighth after the post: three eighths after the credit, an eighth
    /// ahead of the lease (the simulation found the race: a write landing in a region reclaimed
    /// under it).
    pub(super) fn send_keeps(&mut self, ctx: &mut Ctx<'_>) {
        let now = ctx.now;
        let mut kept = BTreeSet::new();
        for w in self.writes.values() {
            if kept.insert((w.peer, w.xfer)) {
                trace!(peer = w.peer.0, xfer = w.xfer.0, "write still in flight: KEEP");
                ctx.push(Action::Send { peer: w.peer, msg: wire::Keep { xfer: w.xfer, token: w.token }.into() });
            }
        }
        ctx.stats.keeps_sent += kept.len() as u64;
        // Every eighth of the shortest lease among the writes still in flight.
        let every = self.writes.values().map(|w| self.lease_base(w.peer) / 8).min().map(|e| e.min(self.keep_every));
        self.next_keep = every.filter(|e| !e.is_zero()).map(|e| now + e);
    }
}
