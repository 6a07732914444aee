//! Preparing a request: the gate decides, per memory kind and with that kind's thresholds,
//! whether it bounces, takes a same-host path or passes through to UCX, and counts why not.

use super::*;

impl MappedLimits {
    pub(super) fn new(
        config: &Config,
        gpu_arena: bool,
        params: &[(&str, &str)],
        env: impl Fn(&str) -> Option<String>,
    ) -> Self {
        let of = |c: &Config| (c.min_descriptor_count, c.max_average_descriptor_size);
        let other_kind = if gpu_arena { MemKind::Dram } else { MemKind::Vram };
        // Its warnings were said by the configuration's load; one that does not validate with
        // the other kind's defaults keeps the configuration's thresholds.
        let other = Config::from_params_as(Some(other_kind), params.iter().copied(), env)
            .map_or(of(config), |loaded| of(&loaded.config));
        let dram_large = config.cma_large_bytes;
        match gpu_arena {
            true => Self { dram: other, vram: of(config), dram_large },
            false => Self { dram: of(config), vram: other, dram_large },
        }
    }

    /// `input` under the thresholds for memory `mem`. A large host-memory transfer has none:
    /// split over the CMA path's threads it beats UCX's cma, which copies it on one.
    fn apply<'a>(&self, mem: MemKind, input: &GateInput<'a>) -> GateInput<'a> {
        let large = || {
            self.dram_large > 0 && input.local.iter().map(|d| d.len).fold(0u64, u64::saturating_add) >= self.dram_large
        };
        let (min_descriptor_count, max_average_descriptor_size) = match mem {
            MemKind::Dram if large() => (1, u64::MAX),
            MemKind::Dram => self.dram,
            MemKind::Vram => self.vram,
        };
        GateInput { min_descriptor_count, max_average_descriptor_size, ..*input }
    }
}

/// The lists a prep builds and drops (both sides' descriptors for the gate, the planner's pairs
/// and segments), kept for the next prep. Built fresh, each was new memory at every prep (the
/// allocator gives large freed blocks back to the kernel), and a prep of 8192 descriptors, as
/// vLLM's connector makes for each request, spent 0.43 of its 0.96 ms in page faults on 2
/// cores (issue 13; BENCHMARKS.md "Session 47").
#[derive(Debug, Default)]
pub(crate) struct PrepScratch {
    l: Vec<gate::Desc>,
    r: Vec<gate::Desc>,
    pairs: Vec<DescPair>,
    segs: Vec<u32>,
}

impl PrepScratch {
    /// Largest lists kept (descriptors): a larger prep's are dropped after it, so one huge
    /// request does not hold its memory for good.
    const KEPT: usize = 1 << 16;

    fn trim(&mut self) {
        if self.l.capacity().max(self.r.capacity()).max(self.pairs.capacity()) > Self::KEPT {
            *self = Self::default();
        }
    }
}

impl Engine {
    /// Routing decision for a request (the gate, README "What takes the bounce path"):
    /// `Some(handle)` when BOUNCE owns it, `None` to delegate it to UCX unchanged. `None` for
    /// an operation or memory segment NIXL does not define.
    pub(crate) fn prep(
        &self,
        op: Option<XferOp>,
        local: &[DescView],
        local_mem: Option<MemSeg>,
        remote: &[DescView],
        remote_mem: Option<MemSeg>,
        agent: &str,
    ) -> Option<u64> {
        // Another thread's prep holds the kept lists: this one builds its own.
        let mut kept = self.prep_scratch.try_lock();
        let mut own = PrepScratch::default();
        let scratch = kept.as_deref_mut().unwrap_or(&mut own);
        let h = self.prep_in(scratch, op, (local, local_mem), (remote, remote_mem), agent);
        scratch.trim();
        h
    }

    fn prep_in(
        &self,
        scratch: &mut PrepScratch,
        op: Option<XferOp>,
        (local, local_mem): (&[DescView], Option<MemSeg>),
        (remote, remote_mem): (&[DescView], Option<MemSeg>),
        agent: &str,
    ) -> Option<u64> {
        // An operation NIXL does not define goes to UCX, which refuses it (ERR_INVALID_PARAM):
        // read as neither READ nor WRITE, it must not bounce either way.
        let Some(op) = op else { return self.count_fallback(FallbackReason::Op) };
        // Our GPU memory registered under another GPU's id: no kernel of ours may touch it.
        if self.registry.any_misplaced(local.iter().map(|d| d.md)) {
            return self.count_fallback(FallbackReason::Mem);
        }
        let PrepScratch { l, r, pairs, segs } = scratch;
        let to_desc = |d: &DescView| gate::Desc { addr: d.addr, len: d.len, dev: d.dev };
        l.clear();
        l.extend(local.iter().map(to_desc));
        r.clear();
        r.extend(remote.iter().map(to_desc));
        let (l, r) = (&l[..], &r[..]);
        // Two way once the peer said HELLO; else one way, answered through its mailbox, when
        // it keeps one and so do we (our READs of it land in our fetch area).
        let one_way_here = self.bounce.as_ref().is_some_and(|b| b.caps.mailbox.is_some());
        let two_way_arenas = self.peers.bounce_arenas(agent);
        let peer_arenas = two_way_arenas.or_else(|| one_way_here.then(|| self.one_way_places(agent)).flatten());
        // Each side bounces through the arena of its descriptors' memory (docs/arenas.md); with
        // none, the first, which the gate refuses for its memory.
        let (local_kind, remote_kind) = (local_mem.and_then(MemSeg::kind), remote_mem.and_then(MemSeg::kind));
        let ours = self.bounce.as_ref().map_or(&[HOST_ARENA][..], |b| &b.places[..]);
        let (our_id, our_place) = gate::arena_for(ours, local_kind, l).unwrap_or((ArenaId(0), HOST_ARENA));
        let theirs = peer_arenas.as_deref().and_then(|p| gate::arena_for(p, remote_kind, r));
        let config = self.arena_config(our_place.mem);
        let input = GateInput::new(
            config,
            self.bounce.is_some(),
            match op {
                XferOp::Write => gate::XferOp::Write,
                XferOp::Read => gate::XferOp::Read,
            },
            (local_kind, our_place),
            (remote_kind, theirs.map(|(_, place)| place)),
            l,
            r,
            theirs.is_some(),
        );
        let their_id = theirs.map_or(ArenaId(0), |(id, _)| id);
        // A READ's bytes go the other way: the peer's descriptors are the sources (its gather
        // runs), ours the destinations (our scatter runs).
        let read = matches!(op, XferOp::Read);
        let pair = |(l, r): (&DescView, &DescView)| match read {
            false => DescPair { src: l.addr, dst: r.addr, len: l.len },
            true => DescPair { src: r.addr, dst: l.addr, len: l.len },
        };
        // A peer process of this host whose records we loaded: one kernel (GPU memory) or one
        // kernel copy per piece (host memory, CMA), no bounce.
        if let Some(h) = self.prep_mapped(op, &input, (local, remote), agent, (pairs, pair)) {
            return Some(h);
        }
        // The gate runs once; `Bounce` without a running reactor cannot happen (the gate checks
        // `bounce_running`), and would count as disabled.
        let sh = match (gate::route(&input), self.shared()) {
            (Route::Bounce, Some(sh)) => sh,
            (Route::PassThrough(reason), _) => {
                if reason == FallbackReason::Mem {
                    self.tell_unserved_once(&input, ours);
                }
                return self.count_fallback(reason);
            }
            (Route::Bounce, None) => return self.count_fallback(FallbackReason::Disabled),
        };
        pairs.clear();
        pairs.extend(local.iter().zip(remote).map(pair));
        // Where the transfer writes must be registrations whose metadata (and key) we were
        // given: the WANT proves each, and the receiver scatters nowhere else.
        let Some(dests) = self.keys.destinations(remote.iter().map(|d| d.md)) else {
            tracing::debug!(peer = agent, "a destination has no BOUNCE key (metadata not ours); plain UCX");
            Stats::bump(&self.stats.fallback_unproven);
            Stats::bump(&self.stats.passthrough_xfers);
            return None;
        };
        let mut params = PlanParams::from_config(config);
        // Chunks that both arenas can hold: the smaller of our arena's max chunk (our caps
        // carry the config's) and the peer's arena's (a host arena's and a GPU arena's defaults
        // differ); the peer grants regions of the planned sizes.
        if let Some(chunk) =
            self.bounce.as_ref().and_then(|b| self.peers.chunk_with(agent, (&b.caps, our_id), their_id))
        {
            params.max_chunk = chunk;
        }
        // Plans in regions are for WRITEs, two way and one way (the DATA that names them goes
        // from the initiator either way): a READ's initiator scatters by its own runs.
        if read {
            params.region_plan_runs = 0;
        }
        // Runs never merge across registrations (either side's): the receiver checks each run
        // inside one.
        let mut seg = 0u32;
        segs.clear();
        segs.extend(local.iter().zip(remote).enumerate().map(|(i, (l, r))| {
            if i > 0 && (local[i - 1].md, remote[i - 1].md) != (l.md, r.md) {
                seg = seg.wrapping_add(1);
            }
            seg
        }));
        match plan::plan_segmented(pairs, segs, params) {
            Ok(mut p) => {
                p.dests = dests;
                p.read = read;
                (p.local_arena, p.peer_arena) = (our_id, their_id);
                // A chunk may be written straight from user memory only when one registration
                // of the arena's memory made through this engine covers its whole source range.
                gate::restrict_direct(&mut p, &self.registry.for_gate(), input.arena.mem, self.config.direct_writes);
                // The incarnation the plan is for: a post after the peer was lost or reloaded
                // fails (its arenas and proofs were that incarnation's), as NIXL's own handles of
                // an unloaded agent's metadata do.
                Some(sh.requests.insert(agent.to_owned(), self.peers.known_id(agent), p))
            }
            Err(e) => {
                tracing::warn!(peer = agent, error = %e, "cannot plan the transfer; plain UCX");
                self.count_fallback(FallbackReason::Op)
            }
        }
    }

    /// The same-host path's request for a transfer the gate would let bounce, when every
    /// remote descriptor's registration came with a record of this host this engine can use:
    /// CUDA IPC for GPU memory (the path of the GPU our descriptors are on), CMA for host
    /// memory, whatever our arena, under that memory kind's thresholds (for host memory, none
    /// from `bounce_cma_large_bytes` up).
    fn prep_mapped(
        &self,
        op: XferOp,
        input: &GateInput<'_>,
        (local, remote): (&[DescView], &[DescView]),
        agent: &str,
        (pairs, pair): (&mut Vec<DescPair>, impl Fn((&DescView, &DescView)) -> DescPair),
    ) -> Option<u64> {
        let place = gate::mapped_place(input)?;
        // The path for that memory, if this engine has it.
        enum Path<'a> {
            Ipc(&'a IpcPaths),
            Cma(&'a CmaPath),
        }
        let path = match place.mem {
            MemKind::Vram => Path::Ipc(self.ipc.as_ref()?),
            MemKind::Dram => Path::Cma(self.cma.as_ref()?),
        };
        let input = self.mapped_limits.apply(place.mem, input);
        if gate::route_mapped(&input, true) != Route::Bounce {
            return None;
        }
        // The loads the records came from: a post after any of them was unloaded fails.
        let (recs, stamp) = self.keys.reach_for_prep(remote.iter().map(|d| d.md))?;
        pairs.clear();
        pairs.extend(local.iter().zip(remote).map(pair));
        let read = matches!(op, XferOp::Read);
        match path {
            Path::Ipc(ipc) => {
                let recs: Option<Vec<_>> = recs.iter().map(|(r, n)| Some((r.ipc()?, *n))).collect();
                ipc.prep(place.dev, agent, pairs, &recs?, read, stamp)
            }
            Path::Cma(cma) => {
                let recs: Option<Vec<_>> = recs.iter().map(|(r, n)| Some((r.cma()?, *n))).collect();
                cma.prep(agent, pairs, &recs?, read, stamp)
            }
        }
    }

    /// Logs once per engine and cause that a transfer went to UCX only because no arena of
    /// ours serves its memory (the gate's [`gate::unserved`]: no arena of its kind, none on its
    /// GPU, or pieces on several GPUs) and no same-host path took it (another host, or the path
    /// off): the arenas are chosen before any memory is registered, so nothing else would tell
    /// the application.
    fn tell_unserved_once(&self, input: &GateInput<'_>, ours: &[ArenaPlace]) {
        let Some(why) = gate::unserved(input, ours) else { return };
        let told = match why {
            gate::Unserved::Kind(_) => &self.told_other_kind,
            gate::Unserved::Gpu(_) | gate::Unserved::SeveralGpus => &self.told_other_gpu,
        };
        if told.swap(true, Ordering::Relaxed) {
            return;
        }
        match why {
            gate::Unserved::Kind(kind) => tracing::warn!(
                agent = %self.agent,
                "{kind:?} transfers of many small descriptors go to UCX: no arena of this engine is {kind:?} \
                 memory ({:?} is the one they met) and no same-host path took them (set bounce_arena_mem={} \
                 or both on an engine that moves {kind:?} between hosts, README \"GPU memory\"); said once",
                input.arena.mem,
                if kind == MemKind::Dram { "dram" } else { "vram" },
            ),
            gate::Unserved::Gpu(dev) => tracing::warn!(
                agent = %self.agent,
                gpus = ?ours.iter().filter(|a| a.mem == MemKind::Vram).map(|a| a.dev).collect::<Vec<_>>(),
                "transfers of many small descriptors in GPU {dev}'s memory go to UCX: this engine's GPU arenas \
                 are on other GPUs (gpus) and no same-host path took them (list GPU {dev} in bounce_arena_gpus on an \
                 engine that moves its memory between hosts, README \"GPU memory\"); said once"
            ),
            gate::Unserved::SeveralGpus => tracing::warn!(
                agent = %self.agent,
                "a transfer of many small descriptors spread over several GPUs goes to UCX: one transfer \
                 stages in one GPU's arena (make one transfer per GPU to bounce them, README \"GPU memory\"); \
                 said once"
            ),
        }
    }

    /// A request to a peer BOUNCE keeps no record of (a name that is not UTF-8): counted as a
    /// pass-through for its peer, and left to UCX.
    pub(crate) fn prep_for_unkept_peer(&self) -> Option<u64> {
        self.count_fallback(FallbackReason::Peer)
    }

    /// Counts a pass-through and its reason (README "What takes the bounce path"); the request
    /// goes to UCX (`None`).
    fn count_fallback(&self, reason: FallbackReason) -> Option<u64> {
        let s = &self.stats;
        Stats::bump(match reason {
            FallbackReason::Disabled => &s.fallback_disabled,
            // Malformed lists are counted with the wrong operations, as they always were: UCX
            // answers both with its own statuses.
            FallbackReason::Op | FallbackReason::Malformed => &s.fallback_op,
            FallbackReason::Mem => &s.fallback_mem,
            FallbackReason::Count => &s.fallback_count,
            FallbackReason::Size => &s.fallback_size,
            _ => &s.fallback_peer,
        });
        Stats::bump(&s.passthrough_xfers);
        None
    }

    /// Where `agent`'s arenas live, when a transfer to it may bounce one way: its mailbox ring
    /// must fit one of our fetch slices ([`PeerTable::one_way_target`]).
    fn one_way_places(&self, agent: &str) -> Option<Vec<ArenaPlace>> {
        let fetch_slice = OneWayLayout::for_config(&self.config).fetch_slice;
        let (places, _) = self.peers.one_way_target(agent, fetch_slice)?;
        // Over ZMQ its WANT goes to the endpoint it advertises, and nothing of ours would ever
        // come back if that cannot be reached (loopback between hosts, a firewall): such a
        // peer stays on UCX, as one that cannot bounce (review 61, control M2).
        if let Some(links) = self.bounce.as_ref().and_then(|b| b.links.as_ref()) {
            let endpoint = self.peers.endpoint(agent)?;
            if !links.reached(agent, &endpoint, Instant::now()) {
                Stats::bump(&self.stats.one_way_unreached);
                return None;
            }
        }
        Some(places)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;

    fn limits(gpu_arena: bool, params: &[(&str, &str)], env: &[(&str, &str)]) -> MappedLimits {
        let env = |k: &str| env.iter().find(|(name, _)| *name == k).map(|(_, v)| (*v).to_owned());
        let kind = gpu_arena.then_some(MemKind::Vram).or(Some(MemKind::Dram));
        let config = Config::from_params_as(kind, params.iter().copied(), env).unwrap().config;
        MappedLimits::new(&config, gpu_arena, params, env)
    }

    #[test]
    fn each_memory_kind_takes_its_own_defaults_whatever_the_arena() {
        // Host memory: at most 64 KiB on average; GPU memory: 256 KiB (the manifest's columns).
        for gpu_arena in [false, true] {
            let l = limits(gpu_arena, &[], &[]);
            assert_eq!(l.dram, (256, 64 * KIB), "gpu arena: {gpu_arena}");
            assert_eq!(l.vram, (256, 256 * KIB), "gpu arena: {gpu_arena}");
        }
    }

    #[test]
    fn an_option_the_application_set_holds_for_both_kinds() {
        for gpu_arena in [false, true] {
            let l = limits(gpu_arena, &[("bounce_max_average_descriptor_size", "8KiB")], &[]);
            assert_eq!((l.dram.1, l.vram.1), (8 * KIB, 8 * KIB), "gpu arena: {gpu_arena}");
            let l = limits(gpu_arena, &[], &[("NIXL_BOUNCE_MIN_DESCRIPTOR_COUNT", "17")]);
            assert_eq!((l.dram.0, l.vram.0), (17, 17), "gpu arena: {gpu_arena}");
        }
    }

    /// A WRITE of host memory `d` to host memory `d`, our arena at `place`, no peer arena.
    fn host_write<'a>(config: &'a Config, place: ArenaPlace, d: &'a [gate::Desc]) -> GateInput<'a> {
        let dram = Some(MemKind::Dram);
        GateInput::new(config, true, gate::XferOp::Write, (dram, place), (dram, None), d, d, false)
    }

    #[test]
    fn the_same_host_gate_applies_the_thresholds_of_the_memory_it_copies() {
        let l = MappedLimits { dram: (4, 100), vram: (8, 1000), dram_large: 0 };
        let d: Vec<gate::Desc> = (0..6).map(|i| gate::Desc { addr: i * 0x1000, len: 512, dev: 0 }).collect();
        let place = ArenaPlace { mem: MemKind::Vram, dev: 0 };
        let config = Config::from_params_as(Some(MemKind::Vram), [], |_| None).unwrap().config;
        let mut input = host_write(&config, place, &d);
        // Six pieces of 512 bytes: too large on average for host memory here, too few for GPU.
        assert_eq!(gate::route_mapped(&l.apply(MemKind::Dram, &input), true), Route::PassThrough(FallbackReason::Size));
        (input.local_mem, input.remote_mem) = (Some(MemKind::Vram), Some(MemKind::Vram));
        assert_eq!(
            gate::route_mapped(&l.apply(MemKind::Vram, &input), true),
            Route::PassThrough(FallbackReason::Count)
        );
        let l = MappedLimits { vram: (4, 1000), ..l };
        assert_eq!(gate::route_mapped(&l.apply(MemKind::Vram, &input), true), Route::Bounce);
    }

    #[test]
    fn a_large_host_memory_transfer_passes_whatever_its_descriptors() {
        let d: Vec<gate::Desc> = (0..2).map(|i| gate::Desc { addr: i << 30, len: 4 << 20, dev: 0 }).collect();
        let place = ArenaPlace { mem: MemKind::Dram, dev: 0 };
        let config = Config::default();
        let input = host_write(&config, place, &d);
        let l = MappedLimits { dram: (256, 64 * KIB), vram: (256, 256 * KIB), dram_large: 8 << 20 };
        assert_eq!(gate::route_mapped(&l.apply(MemKind::Dram, &input), true), Route::Bounce, "8 MiB in two");
        let small = MappedLimits { dram_large: (8 << 20) + 1, ..l };
        assert_eq!(
            gate::route_mapped(&small.apply(MemKind::Dram, &input), true),
            Route::PassThrough(FallbackReason::Count)
        );
        let off = MappedLimits { dram_large: 0, ..l };
        assert_eq!(
            gate::route_mapped(&off.apply(MemKind::Dram, &input), true),
            Route::PassThrough(FallbackReason::Count)
        );
    }
}
