//! The routing gate (design §3): whether a transfer takes the bounce path or passes through to
//! the inner UCX engine untouched, and which chunks of a bounced transfer may be written
//! straight from user memory.
//!
//! Pure functions over what the shell knows at `prepXfer` time; the shell counts each
//! [`FallbackReason`] and hands pass-through transfers to UCX, which answers malformed lists
//! with its own statuses (the same errors a user of UCX gets).

use crate::config::Config;
use crate::plan::Plan;
use crate::types::{ArenaId, MemKind};

/// The NIXL operation of a transfer request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferOp {
    /// `NIXL_READ`: bounced the other way round (the target gathers, we READ and scatter).
    Read,
    /// `NIXL_WRITE`.
    Write,
}

/// One side of one descriptor: an address, a length and the device it lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Desc {
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// NIXL's device id (the GPU for VRAM; ignored for DRAM).
    pub dev: u64,
}

/// Where an arena lives: its memory kind and, for GPU memory, its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ArenaPlace {
    /// Memory kind.
    pub mem: MemKind,
    /// Device id (the GPU for VRAM; 0 for DRAM).
    pub dev: u64,
}

impl ArenaPlace {
    /// Memory `mem` where the first of `descs` lies: its device for GPU memory, 0 for host
    /// memory (whose device ids mean nothing).
    fn first_of(mem: MemKind, descs: &[Desc]) -> Self {
        let dev = match mem {
            MemKind::Vram => descs.first().map_or(0, |d| d.dev),
            MemKind::Dram => 0,
        };
        Self { mem, dev }
    }

    /// Whether descriptors of memory `mem` lying on devices `devs` can be copied to or from this
    /// arena by its copy engine: same memory kind, and for GPU memory the arena's own GPU.
    fn serves(&self, mem: Option<MemKind>, descs: &[Desc]) -> bool {
        mem == Some(self.mem) && (self.mem == MemKind::Dram || descs.iter().all(|d| d.dev == self.dev))
    }
}

/// What the gate decides on.
#[derive(Debug, Clone, Copy)]
pub struct GateInput<'a> {
    /// The bounce path is running in this engine (enabled in the config and set up).
    pub bounce_running: bool,
    /// The operation.
    pub op: XferOp,
    /// Memory kind of the local descriptors; `None` for a NIXL segment kind bounce does not
    /// know (block, file, object).
    pub local_mem: Option<MemKind>,
    /// Memory kind of the remote descriptors, as `local_mem`.
    pub remote_mem: Option<MemKind>,
    /// Our arena: local descriptors must be of its memory (and GPU) to be gathered into it.
    pub arena: ArenaPlace,
    /// The peer's arena, when its capabilities are known and compatible: remote descriptors
    /// must be of its memory (and GPU) to be scattered from it.
    pub peer_arena: Option<ArenaPlace>,
    /// Local descriptors (the sources of a write).
    pub local: &'a [Desc],
    /// Remote descriptors (the destinations), pairwise with `local`.
    pub remote: &'a [Desc],
    /// [`Config::min_descriptor_count`].
    pub min_descriptor_count: u64,
    /// [`Config::max_average_descriptor_size`].
    pub max_average_descriptor_size: u64,
    /// [`crate::peers::PeerTable::can_bounce`] for the target agent.
    pub peer_can_bounce: bool,
}

impl<'a> GateInput<'a> {
    /// An input with the thresholds of `config`; the caller fills in the request.
    #[allow(clippy::too_many_arguments)] // reason: one argument per fact the gate weighs
    pub fn new(
        config: &Config,
        bounce_running: bool,
        op: XferOp,
        (local_mem, arena): (Option<MemKind>, ArenaPlace),
        (remote_mem, peer_arena): (Option<MemKind>, Option<ArenaPlace>),
        local: &'a [Desc],
        remote: &'a [Desc],
        peer_can_bounce: bool,
    ) -> Self {
        Self {
            bounce_running,
            op,
            local_mem,
            remote_mem,
            arena,
            peer_arena,
            local,
            remote,
            min_descriptor_count: config.min_descriptor_count,
            max_average_descriptor_size: config.max_average_descriptor_size,
            peer_can_bounce,
        }
    }
}

/// Why a transfer passes through to UCX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FallbackReason {
    /// Bounce is disabled or not running in this engine.
    Disabled,
    /// Neither a WRITE nor a READ.
    Op,
    /// The local descriptors are not of our arena's memory, or the remote ones not of the
    /// peer arena's (a GPU arena also needs every descriptor on its own GPU).
    Mem,
    /// Fewer descriptors than `min_descriptor_count`.
    Count,
    /// Average descriptor larger than `max_average_descriptor_size`.
    Size,
    /// The peer cannot bounce with us (not loaded, incompatible, no arena or no HELLO).
    Peer,
    /// Empty lists, unequal counts, or a pair of unequal lengths.
    Malformed,
}

/// Where a transfer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Gather, one write per chunk, scatter.
    Bounce,
    /// Straight to the inner UCX engine.
    PassThrough(FallbackReason),
}

/// The gate, checked in this order (the first failing rule is the reason): bounce running,
/// write, each side of its arena's memory, well-formed lists, descriptor count at least the
/// minimum, average descriptor size at most the maximum, peer can bounce, and (GPU arenas)
/// every descriptor on its arena's GPU. A peer whose arena is not known yet is judged by the
/// memory kind alone against ours; it fails on `Peer` then.
pub fn route(input: &GateInput<'_>) -> Route {
    use FallbackReason as R;
    let pass = Route::PassThrough;
    if !input.bounce_running {
        return pass(R::Disabled);
    }
    // WRITEs and READs bounce with either arena kind: a READ's gather runs on the target's
    // copy engine and its scatter on ours, the same engines a WRITE uses the other way round.
    // (One way, with no HELLO, needs a mailbox on both sides: the caller offers a peer arena
    // only then.)
    let peer_mem = input.peer_arena.map_or(input.arena.mem, |a| a.mem);
    if input.local_mem != Some(input.arena.mem) || input.remote_mem != Some(peer_mem) {
        return pass(R::Mem);
    }
    let n = input.local.len();
    if n == 0 || input.remote.len() != n || input.local.iter().zip(input.remote).any(|(l, r)| l.len != r.len) {
        return pass(R::Malformed);
    }
    if let Some(reason) = too_few_or_too_large(input) {
        return pass(reason);
    }
    let Some(peer_arena) = input.peer_arena.filter(|_| input.peer_can_bounce) else {
        return pass(R::Peer);
    };
    if !input.arena.serves(input.local_mem, input.local) || !peer_arena.serves(input.remote_mem, input.remote) {
        return pass(R::Mem);
    }
    Route::Bounce
}

/// Why no arena of ours served a transfer that only that kept off the bounce path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unserved {
    /// No arena of ours is memory of this kind (a GPU-arena engine moving host memory, or a
    /// host-arena one moving GPU memory).
    Kind(MemKind),
    /// We have GPU arenas, none on this GPU, where every local descriptor lies.
    Gpu(u64),
    /// We have GPU arenas, but the local descriptors lie on several GPUs: one transfer
    /// stages in one arena.
    SeveralGpus,
}

/// Why a transfer that passes through would have bounced but for our arenas (`arenas`, in
/// the order of our capabilities): its local descriptors are many and small enough for the
/// thresholds, and no arena serves their memory ([`Unserved`]). `None` when an arena serves
/// them or the gate's other rules keep the transfer off anyway. Arenas are fixed before any
/// memory is registered (`bounce_arena_mem`, `bounce_arena_gpus`), so the shell says this once.
pub fn unserved(input: &GateInput<'_>, arenas: &[ArenaPlace]) -> Option<Unserved> {
    let kind = input.local_mem?;
    let first = input.local.first()?;
    if too_few_or_too_large(input).is_some() || arenas.iter().any(|a| a.serves(Some(kind), input.local)) {
        return None;
    }
    if !arenas.iter().any(|a| a.mem == kind) {
        return Some(Unserved::Kind(kind));
    }
    // An arena of this kind that serves none of them is a GPU arena (a host arena serves any
    // host memory): the descriptors are on another GPU, or on several.
    Some(match input.local.iter().all(|d| d.dev == first.dev) {
        true => Unserved::Gpu(first.dev),
        false => Unserved::SeveralGpus,
    })
}

/// The gate's size rules on the local descriptors (a non-empty list): fewer than
/// `min_descriptor_count` of them, or an average above `max_average_descriptor_size`.
fn too_few_or_too_large(input: &GateInput<'_>) -> Option<FallbackReason> {
    let n = input.local.len() as u64;
    if n < input.min_descriptor_count {
        return Some(FallbackReason::Count);
    }
    let total: u64 = input.local.iter().map(|d| d.len).fold(0u64, u64::saturating_add);
    (total / n.max(1) > input.max_average_descriptor_size).then_some(FallbackReason::Size)
}

/// The gate for the same-host paths (`bounce_cuda_ipc` for GPU memory, `bounce_cma` for host
/// memory): the bounce gate's rules with no HELLO asked for (the paths need no arena and no
/// control frame, only the peer's records, which the caller has checked: `mapped`), and with
/// the transfer's own memory in place of the arenas: our side is [`mapped_place`] (any memory
/// kind this engine registers, on any one GPU, whatever its arena), the peer's is memory of the
/// same kind on the remote descriptors' device. The caller gives the thresholds of that kind.
pub fn route_mapped(input: &GateInput<'_>, mapped: bool) -> Route {
    let place = mapped_place(input).unwrap_or(input.arena);
    let peer = ArenaPlace::first_of(place.mem, input.remote);
    route(&GateInput { arena: place, peer_arena: Some(peer), peer_can_bounce: mapped, ..*input })
}

/// Where a same-host copy of this transfer runs: the local descriptors' memory kind and, for GPU
/// memory, the first one's GPU (the path of that GPU launches the kernel; [`route_mapped`]
/// refuses lists spread over several). `None` for a segment kind bounce does not know.
pub fn mapped_place(input: &GateInput<'_>) -> Option<ArenaPlace> {
    Some(ArenaPlace::first_of(input.local_mem?, input.local))
}

/// Which of `arenas` (an agent's, in the order of its capabilities) a transfer whose
/// descriptors on that side are memory `mem` on `descs`' devices bounces through: the first
/// that serves them (its memory kind, and for GPU memory the GPU of every descriptor), with
/// its id; else the first arena, which the gate then refuses ([`FallbackReason::Mem`]).
/// `None` only for an empty list.
pub fn arena_for(arenas: &[ArenaPlace], mem: Option<MemKind>, descs: &[Desc]) -> Option<(ArenaId, ArenaPlace)> {
    let at = arenas.iter().position(|a| a.serves(mem, descs)).unwrap_or(0);
    // At most MAX_ARENAS (16) arenas: the index fits a u8.
    arenas.get(at).map(|&a| (ArenaId(at as u8), a))
}

/// A memory registration made through this engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Registration {
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Memory kind.
    pub mem: MemKind,
}

/// Whether one registration of memory `mem` covers all of `[addr, addr + len)`: the condition
/// for writing straight from user memory (the NIC, or the GPU's copy path, needs one
/// registration's key for the whole source, and a GPU address must never be read by the CPU
/// path: a host arena writes only from host registrations).
pub fn covered(regs: &[Registration], mem: MemKind, addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    regs.iter().any(|r| r.mem == mem && r.addr <= addr && r.addr.checked_add(r.len).is_some_and(|e| end <= e))
}

/// Clears [`crate::plan::Chunk::direct`] of every chunk that may not be written straight from
/// user memory: all of them when `direct_writes` is off, otherwise those whose source is not
/// [`covered`] by one registration of the arena's memory `mem`. Those chunks are gathered into
/// the arena instead.
pub fn restrict_direct(plan: &mut Plan, regs: &[Registration], mem: MemKind, direct_writes: bool) {
    for c in &mut plan.chunks {
        if let Some(addr) = c.direct {
            if !direct_writes || !covered(regs, mem, addr, c.bytes) {
                c.direct = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{self, DescPair, PlanParams};

    const MIN: u64 = 4;
    const MAX_AVG: u64 = 4096;
    const HOST: ArenaPlace = ArenaPlace { mem: MemKind::Dram, dev: 0 };

    fn descs(n: usize, len: u64) -> Vec<Desc> {
        (0..n as u64).map(|i| Desc { addr: 0x1000 + i * 0x10000, len, dev: 0 }).collect()
    }

    /// Each side of a transfer goes through the first of its agent's arenas that serves its
    /// memory (kind, and GPU for GPU memory); with none, the first, which the gate refuses.
    #[test]
    fn a_transfer_takes_the_arena_of_its_memory_on_each_side() {
        let gpu = |dev| ArenaPlace { mem: MemKind::Vram, dev };
        let arenas = [HOST, gpu(0), gpu(1)];
        let on = |dev: u64| vec![Desc { addr: 0x1000, len: 64, dev }, Desc { addr: 0x9000, len: 64, dev }];
        assert_eq!(arena_for(&arenas, Some(MemKind::Dram), &on(5)), Some((ArenaId(0), HOST)), "host: any device id");
        assert_eq!(arena_for(&arenas, Some(MemKind::Vram), &on(1)), Some((ArenaId(2), gpu(1))));
        assert_eq!(arena_for(&arenas, Some(MemKind::Vram), &on(0)), Some((ArenaId(1), gpu(0))));
        // Spread over two GPUs, on a GPU with no arena, or an unknown kind: the first arena,
        // and the gate's memory rule then sends the transfer to UCX.
        let spread = [Desc { addr: 0, len: 64, dev: 0 }, Desc { addr: 64, len: 64, dev: 1 }];
        for (mem, d) in [(Some(MemKind::Vram), &spread[..]), (Some(MemKind::Vram), &on(7)[..]), (None, &on(0)[..])] {
            let (id, place) = arena_for(&arenas, mem, d).unwrap();
            assert_eq!(id, ArenaId(0));
            let local = d.to_vec();
            let refused = route(&GateInput { local_mem: mem, arena: place, ..input(&local, &local) });
            assert_eq!(refused, Route::PassThrough(FallbackReason::Mem));
        }
        assert_eq!(arena_for(&[], Some(MemKind::Dram), &on(0)), None);
    }

    /// A request that bounces; each test changes one fact.
    fn input<'a>(local: &'a [Desc], remote: &'a [Desc]) -> GateInput<'a> {
        GateInput {
            bounce_running: true,
            op: XferOp::Write,
            local_mem: Some(MemKind::Dram),
            remote_mem: Some(MemKind::Dram),
            arena: HOST,
            peer_arena: Some(HOST),
            local,
            remote,
            min_descriptor_count: MIN,
            max_average_descriptor_size: MAX_AVG,
            peer_can_bounce: true,
        }
    }

    #[test]
    fn a_write_of_many_small_dram_descriptors_to_a_ready_peer_bounces() {
        let d = descs(8, 512);
        assert_eq!(route(&input(&d, &d)), Route::Bounce);
    }

    #[test]
    fn only_a_transfer_kept_off_by_our_arenas_alone_says_which_arena_it_lacked() {
        let d = descs(8, 512);
        let gpu = |dev| ArenaPlace { mem: MemKind::Vram, dev };
        let gpu_arena = GateInput { arena: gpu(0), ..input(&d, &d) };
        assert_eq!(route(&gpu_arena), Route::PassThrough(FallbackReason::Mem));
        let host_memory = Some(Unserved::Kind(MemKind::Dram));
        assert_eq!(unserved(&gpu_arena, &[gpu(0)]), host_memory, "host memory in a GPU-arena engine");
        assert_eq!(unserved(&gpu_arena, &[gpu(0), gpu(1)]), host_memory, "in one of several GPU arenas");
        assert_eq!(unserved(&input(&d, &d), &[HOST]), None, "memory of the arena's kind");
        assert_eq!(unserved(&input(&d, &d), &[gpu(0), HOST]), None, "a host arena after a GPU one");
        assert_eq!(unserved(&GateInput { local_mem: None, ..gpu_arena }, &[gpu(0)]), None, "a kind bounce knows not");
        let few = descs(MIN as usize - 1, 512);
        assert_eq!(unserved(&GateInput { local: &few, remote: &few, ..gpu_arena }, &[gpu(0)]), None, "too few");
        let large = descs(8, MAX_AVG + 1);
        assert_eq!(unserved(&GateInput { local: &large, remote: &large, ..gpu_arena }, &[gpu(0)]), None, "too large");
        let none = GateInput { local: &[], remote: &[], min_descriptor_count: 0, ..gpu_arena };
        assert_eq!(unserved(&none, &[gpu(0)]), None);
        // GPU memory: no GPU arena at all, none on its GPU, or pieces on several GPUs.
        let on = |devs: &[u64]| -> Vec<Desc> { (0..8).map(|i| Desc { dev: devs[i % devs.len()], ..d[i] }).collect() };
        fn vram(local: &[Desc]) -> GateInput<'_> {
            GateInput { local_mem: Some(MemKind::Vram), ..input(local, local) }
        }
        let (on1, on0, spread) = (on(&[1]), on(&[0]), on(&[0, 1]));
        assert_eq!(unserved(&vram(&on1), &[HOST]), Some(Unserved::Kind(MemKind::Vram)));
        assert_eq!(unserved(&vram(&on1), &[HOST, gpu(0)]), Some(Unserved::Gpu(1)));
        assert_eq!(unserved(&vram(&on1), &[gpu(0), gpu(2)]), Some(Unserved::Gpu(1)));
        assert_eq!(unserved(&vram(&spread), &[gpu(0), gpu(1)]), Some(Unserved::SeveralGpus));
        assert_eq!(unserved(&vram(&on1), &[gpu(0), gpu(1)]), None, "served by GPU 1's arena");
        assert_eq!(unserved(&vram(&on0), &[HOST, gpu(0)]), None);
    }

    #[test]
    fn the_mapped_paths_need_the_peers_records_and_one_memory_kind_on_both_sides_but_no_hello() {
        let gpu = ArenaPlace { mem: MemKind::Vram, dev: 1 };
        let mine: Vec<Desc> = descs(8, 512).into_iter().map(|d| Desc { dev: 1, ..d }).collect();
        let theirs: Vec<Desc> = descs(8, 512).into_iter().map(|d| Desc { dev: 3, ..d }).collect();
        let mut i = input(&mine, &theirs);
        (i.arena, i.peer_arena, i.peer_can_bounce) = (gpu, None, false);
        (i.local_mem, i.remote_mem) = (Some(MemKind::Vram), Some(MemKind::Vram));
        assert_eq!(route(&i), Route::PassThrough(FallbackReason::Peer), "no HELLO: no bounce");
        assert_eq!(route_mapped(&i, true), Route::Bounce, "the peer's GPU is its descriptors' own");
        assert_eq!(mapped_place(&i), Some(gpu));
        assert_eq!(route_mapped(&i, false), Route::PassThrough(FallbackReason::Peer), "no handles");
        assert_eq!(route_mapped(&GateInput { op: XferOp::Read, ..i }, true), Route::Bounce);
        assert_eq!(
            route_mapped(&GateInput { remote_mem: Some(MemKind::Dram), ..i }, true),
            Route::PassThrough(FallbackReason::Mem),
            "GPU memory here, host memory there: no one path copies both"
        );
        assert_eq!(
            route_mapped(&GateInput { local_mem: Some(MemKind::Dram), ..i }, true),
            Route::PassThrough(FallbackReason::Mem),
            "host memory here, GPU memory there"
        );
        assert_eq!(route_mapped(&GateInput { local_mem: None, ..i }, true), Route::PassThrough(FallbackReason::Mem));
        let d = descs(8, 512);
        let host =
            GateInput { local_mem: Some(MemKind::Dram), remote_mem: Some(MemKind::Dram), local: &d, remote: &d, ..i };
        // The arena does not matter: a GPU-arena engine moves host memory by CMA, a host-arena
        // engine GPU memory by CUDA IPC (on the path of the GPU the memory is on).
        for arena in [gpu, HOST] {
            assert_eq!(route_mapped(&GateInput { arena, ..host }, true), Route::Bounce, "host memory both sides (CMA)");
            assert_eq!(mapped_place(&GateInput { arena, ..host }), Some(HOST));
            assert_eq!(route_mapped(&GateInput { arena, ..i }, true), Route::Bounce, "GPU memory both sides (IPC)");
            assert_eq!(mapped_place(&GateInput { arena, ..i }), Some(gpu), "the path of the local memory's GPU");
        }
        assert_eq!(route_mapped(&host, false), Route::PassThrough(FallbackReason::Peer));
        // The thresholds hold as for bouncing.
        assert_eq!(
            route_mapped(&GateInput { min_descriptor_count: 9, ..i }, true),
            Route::PassThrough(FallbackReason::Count)
        );
        // Every remote descriptor on one device, every local one on one GPU.
        let mut mixed = theirs.clone();
        mixed[5].dev = 2;
        assert_eq!(
            route_mapped(&GateInput { local: &mine, remote: &mixed, ..i }, true),
            Route::PassThrough(FallbackReason::Mem)
        );
        let mut elsewhere = mine.clone();
        elsewhere[3].dev = 0;
        assert_eq!(
            route_mapped(&GateInput { local: &elsewhere, remote: &theirs, ..i }, true),
            Route::PassThrough(FallbackReason::Mem)
        );
        let all_on_0: Vec<Desc> = mine.iter().map(|d| Desc { dev: 0, ..*d }).collect();
        assert_eq!(route_mapped(&GateInput { local: &all_on_0, remote: &theirs, ..i }, true), Route::Bounce);
        assert_eq!(mapped_place(&GateInput { local: &all_on_0, ..i }), Some(ArenaPlace { mem: MemKind::Vram, dev: 0 }));
    }

    #[test]
    fn every_reason_is_reported_in_gate_order() {
        let d = descs(8, 512);
        let pass = Route::PassThrough;
        let with = |f: &dyn Fn(&mut GateInput<'_>)| {
            let mut i = input(&d, &d);
            f(&mut i);
            route(&i)
        };
        assert_eq!(with(&|i| i.bounce_running = false), pass(FallbackReason::Disabled));
        assert_eq!(with(&|i| i.op = XferOp::Read), Route::Bounce, "a READ between host arenas bounces");
        assert_eq!(with(&|i| i.local_mem = Some(MemKind::Vram)), pass(FallbackReason::Mem));
        assert_eq!(with(&|i| i.remote_mem = Some(MemKind::Vram)), pass(FallbackReason::Mem));
        assert_eq!(with(&|i| i.remote_mem = None), pass(FallbackReason::Mem));
        assert_eq!(with(&|i| i.peer_can_bounce = false), pass(FallbackReason::Peer));
        assert_eq!(with(&|i| i.peer_arena = None), pass(FallbackReason::Peer));
        // The first failing rule wins: disabled beats everything else.
        assert_eq!(
            with(&|i| {
                i.bounce_running = false;
                i.op = XferOp::Read;
                i.peer_can_bounce = false;
            }),
            pass(FallbackReason::Disabled)
        );
        assert_eq!(
            with(&|i| {
                i.op = XferOp::Read;
                i.local_mem = None;
            }),
            pass(FallbackReason::Mem)
        );
        // A READ with GPU arenas bounces too, and is judged by memory like a WRITE.
        let gpu = ArenaPlace { mem: MemKind::Vram, dev: 0 };
        let vram = |i: &mut GateInput<'_>| {
            i.op = XferOp::Read;
            i.arena = gpu;
            i.peer_arena = Some(gpu);
            i.local_mem = Some(MemKind::Vram);
            i.remote_mem = Some(MemKind::Vram);
        };
        assert_eq!(with(&vram), Route::Bounce, "a READ between GPU arenas bounces");
        assert_eq!(
            with(&|i| {
                vram(i);
                i.local_mem = Some(MemKind::Dram);
            }),
            pass(FallbackReason::Mem),
            "a READ from VRAM into host memory does not"
        );
    }

    #[test]
    fn malformed_lists_pass_through() {
        let d = descs(8, 512);
        let m = Route::PassThrough(FallbackReason::Malformed);
        assert_eq!(route(&input(&[], &[])), m, "empty");
        assert_eq!(route(&input(&d, &d[..7])), m, "unequal counts");
        let mut other = d.clone();
        other[3].len = 511;
        assert_eq!(route(&input(&d, &other)), m, "a pair of unequal lengths");
        // Malformed is checked before the count: one descriptor against two is malformed.
        assert_eq!(route(&input(&d[..1], &d[..2])), m);
    }

    #[test]
    fn count_and_average_size_edges() {
        let at_min = descs(MIN as usize, 512);
        assert_eq!(route(&input(&at_min, &at_min)), Route::Bounce, "count == min bounces");
        let below = descs(MIN as usize - 1, 512);
        assert_eq!(route(&input(&below, &below)), Route::PassThrough(FallbackReason::Count));
        let at_max = descs(8, MAX_AVG);
        assert_eq!(route(&input(&at_max, &at_max)), Route::Bounce, "average == max bounces");
        let mut above = descs(8, MAX_AVG);
        above[0].len += 8; // total / n = MAX_AVG + 1
        assert_eq!(route(&input(&above, &above)), Route::PassThrough(FallbackReason::Size));
        let mut just_under = descs(8, MAX_AVG);
        just_under[0].len += 7; // integer average still MAX_AVG
        assert_eq!(route(&input(&just_under, &just_under)), Route::Bounce);
        // Huge lengths saturate instead of wrapping into a small average.
        let huge = vec![Desc { addr: 0, len: u64::MAX, dev: 0 }; 8];
        assert_eq!(route(&input(&huge, &huge)), Route::PassThrough(FallbackReason::Size));
    }

    #[test]
    fn new_takes_the_thresholds_from_the_config() {
        let cfg = Config { min_descriptor_count: 3, max_average_descriptor_size: 100, ..Config::default() };
        let d = descs(3, 100);
        let dram = (Some(MemKind::Dram), HOST);
        let i = GateInput::new(&cfg, true, XferOp::Write, dram, (dram.0, Some(HOST)), &d, &d, true);
        assert_eq!((i.min_descriptor_count, i.max_average_descriptor_size), (3, 100));
        assert_eq!(route(&i), Route::Bounce);
    }

    const DRAM: MemKind = MemKind::Dram;

    #[test]
    fn a_gpu_arena_bounces_gpu_descriptors_on_its_own_gpu_only() {
        let gpu = |dev| ArenaPlace { mem: MemKind::Vram, dev };
        let on = |dev| -> Vec<Desc> { descs(8, 512).into_iter().map(|d| Desc { dev, ..d }).collect() };
        let (l, r) = (on(0), on(1));
        let mut i = input(&l, &r);
        (i.local_mem, i.remote_mem, i.arena, i.peer_arena) =
            (Some(MemKind::Vram), Some(MemKind::Vram), gpu(0), Some(gpu(1)));
        assert_eq!(route(&i), Route::Bounce, "GPU 0 here to the peer's arena on its GPU 1");
        // Host descriptors cannot be gathered into a GPU arena (nor GPU ones into a host one).
        i.local_mem = Some(MemKind::Dram);
        assert_eq!(route(&i), Route::PassThrough(FallbackReason::Mem));
        i.local_mem = Some(MemKind::Vram);
        // A source on another GPU than our arena's, or a destination off the peer arena's GPU.
        let (l2, r2) = (on(3), on(0));
        let mut j = GateInput { local: &l2, ..i };
        assert_eq!(route(&j), Route::PassThrough(FallbackReason::Mem));
        j = GateInput { remote: &r2, ..i };
        assert_eq!(route(&j), Route::PassThrough(FallbackReason::Mem));
        // The peer's arena kind decides the destinations' kind: a host arena there takes host
        // destinations from our GPU arena (UCX writes GPU -> host).
        let mut k = GateInput { peer_arena: Some(HOST), remote_mem: Some(MemKind::Dram), ..i };
        assert_eq!(route(&k), Route::Bounce);
        k.remote_mem = Some(MemKind::Vram);
        assert_eq!(route(&k), Route::PassThrough(FallbackReason::Mem));
        // Host arenas ignore device ids.
        let (h1, h2) = (on(5), on(7));
        assert_eq!(route(&input(&h1, &h2)), Route::Bounce);
    }

    #[test]
    fn coverage_needs_one_dram_registration_around_the_whole_range() {
        let regs = [
            Registration { addr: 0x1000, len: 0x1000, mem: DRAM },
            Registration { addr: 0x2000, len: 0x1000, mem: DRAM },
            Registration { addr: 0x8000, len: 0x1000, mem: MemKind::Vram },
        ];
        assert!(covered(&regs, DRAM, 0x1000, 0x1000), "exactly one registration");
        assert!(covered(&regs, DRAM, 0x1800, 0x800), "ends at the registration's end");
        assert!(!covered(&regs, DRAM, 0x1800, 0x801), "one byte beyond");
        assert!(!covered(&regs, DRAM, 0x1800, 0x1000), "spans two adjacent registrations");
        assert!(!covered(&regs, DRAM, 0x0fff, 2), "starts before");
        assert!(!covered(&regs, DRAM, 0x8000, 0x10), "a VRAM registration never covers for a host arena");
        assert!(covered(&regs, MemKind::Vram, 0x8000, 0x10), "...but does for a GPU arena");
        assert!(!covered(&regs, MemKind::Vram, 0x1000, 0x10), "and a host one not for a GPU arena");
        assert!(!covered(&regs, DRAM, u64::MAX, 2), "wraps");
        assert!(!covered(&[], DRAM, 0x1000, 1));
    }

    #[test]
    fn restrict_direct_keeps_only_covered_chunks_and_honours_the_switch() {
        // Four contiguous 4 KiB descriptors: four direct chunks at 0x10000 + i * 4 KiB.
        let pairs: Vec<DescPair> =
            (0..4u64).map(|i| DescPair { src: 0x10000 + i * 4096, dst: 0x90000 + i * 4096, len: 4096 }).collect();
        let planned = plan::plan(&pairs, PlanParams::new(4096)).unwrap();
        assert!(planned.chunks.iter().all(|c| c.direct.is_some()));
        // Registered: the first two chunks' sources only.
        let regs = [Registration { addr: 0x10000, len: 2 * 4096, mem: DRAM }];
        let mut p = planned.clone();
        restrict_direct(&mut p, &regs, DRAM, true);
        let direct: Vec<bool> = p.chunks.iter().map(|c| c.direct.is_some()).collect();
        assert_eq!(direct, [true, true, false, false]);
        let mut p = planned;
        restrict_direct(&mut p, &regs, DRAM, false);
        assert!(p.chunks.iter().all(|c| c.direct.is_none()), "direct writes switched off");
    }
}
