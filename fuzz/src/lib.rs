//! Operation-sequence fuzzing of the whole sans-IO endpoint (sender + receiver + scheduler):
//! arbitrary peer messages (well-formed or not) interleaved with real submits, job completions
//! in any order, cancels, peer losses and clock jumps. Shared by the `endpoint_ops` cargo-fuzz
//! target and a stable test that runs it over seeded random inputs.
//!
//! Checked after every step: no panic, the arena's conservation invariants, at most one
//! `Complete` per transfer. At the end, after shutdown and every outstanding job's completion:
//! the whole arena is free again.

pub mod buddy_ops;

/// Deterministic pseudo-random fuzz inputs for the stable tests: `count` byte strings whose
/// lengths come from `len_of(i)`, from an xorshift generator seeded with `seed`.
pub fn seeded_inputs(seed: u64, count: usize, len_of: impl Fn(usize) -> usize) -> impl Iterator<Item = Vec<u8>> {
    let mut state = seed;
    (0..count).map(move |i| {
        (0..len_of(i))
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect()
    })
}

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use arbitrary::Unstructured;
use bounce_proto::config::Config;
use bounce_proto::endpoint::{Action, Endpoint, JobId};
use bounce_proto::plan::{DescPair, PlanParams, plan};
use bounce_proto::wire::Msg;
use bounce_proto::{PeerId, XferId};

/// One thing that can happen to an endpoint.
#[derive(Debug)]
pub enum Op {
    /// A control message from peer `from % 3` (anything a decoder could produce).
    Msg { from: u8, msg: Msg },
    /// The application submits a transfer of `descs` pieces of `size` bytes to `peer % 3`.
    Submit { peer: u8, descs: u8, size: u16, packed: bool },
    /// The job at `which` among the outstanding ones completes.
    Done { which: u8, ok: bool },
    /// The application cancels transfer `xfer`.
    Cancel { xfer: u8 },
    /// Peer `peer % 3` is lost.
    PeerLost { peer: u8 },
    /// Time passes.
    Tick { ms: u16 },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Gather,
    Write,
    Scatter,
}

const USER_BASE: u64 = 0x10_0000;
const USER_LEN: u64 = 1 << 20;

fn config() -> Config {
    let params = [
        ("bounce_arena_size", "64KiB"),
        ("bounce_arena_granularity", "4KiB"),
        ("bounce_max_chunk_size", "16KiB"),
        ("bounce_max_inflight_chunks", "2"),
        ("bounce_request_timeout_ms", "100"),
    ];
    Config::from_params(params, |_| None).expect("a valid fuzz configuration").config
}

impl Op {
    /// Draws one operation. Peer messages are drawn less often than the rest: an arbitrary
    /// message eats many input bytes, and the interesting states need submits and completions.
    fn draw(u: &mut Unstructured<'_>) -> arbitrary::Result<Self> {
        Ok(match u.int_in_range(0u8..=11)? {
            0 => Self::Msg { from: u.arbitrary()?, msg: u.arbitrary()? },
            1 | 2 => Self::Submit {
                peer: u.arbitrary()?,
                descs: u.arbitrary()?,
                size: u.arbitrary()?,
                packed: u.arbitrary()?,
            },
            3..=7 => Self::Done { which: u.arbitrary()?, ok: u.int_in_range(0u8..=15)? != 0 },
            8 => Self::Cancel { xfer: u.arbitrary()? },
            9 => Self::PeerLost { peer: u.arbitrary()? },
            _ => Self::Tick { ms: u.arbitrary()? },
        })
    }
}

/// What one run exercised (so a test can prove it is not vacuous).
#[derive(Debug, Default, Clone, Copy)]
pub struct Coverage {
    /// Operations applied.
    pub ops: usize,
    /// Transfers the endpoint accepted.
    pub submitted: usize,
    /// Transfers that completed (either way).
    pub completed: usize,
    /// Gather/write/scatter jobs completed by the harness.
    pub jobs_done: usize,
}

/// Runs one sequence of operations; panics (for the fuzzer to report) on a broken invariant.
pub fn run(data: &[u8]) -> Coverage {
    let mut cov = Coverage::default();
    let mut u = Unstructured::new(data);
    let mut ops = Vec::new();
    while !u.is_empty() && ops.len() < 256 {
        match Op::draw(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    let cfg = config();
    let mut now = Instant::now();
    let mut ep = Endpoint::new(&cfg, now).expect("endpoint");
    ep.add_registered(USER_BASE, USER_LEN);
    let mut jobs: Vec<(JobId, Kind)> = Vec::new();
    let mut completed: BTreeSet<XferId> = BTreeSet::new();
    let mut next_xfer = 1u64;
    let capacity = cfg.arena_usable_capacity();

    let drain = |ep: &mut Endpoint, jobs: &mut Vec<(JobId, Kind)>, completed: &mut BTreeSet<XferId>| {
        while let Some(a) = ep.poll_action() {
            match a {
                Action::Gather { job, .. } => jobs.push((job, Kind::Gather)),
                Action::Write { job, .. } => jobs.push((job, Kind::Write)),
                Action::Scatter { job, .. } => jobs.push((job, Kind::Scatter)),
                Action::Complete { xfer, .. } => assert!(completed.insert(xfer), "{xfer:?} completed twice"),
                Action::Send { .. } => {}
            }
        }
    };
    let done = |ep: &mut Endpoint, now: Instant, (job, kind): (JobId, Kind), ok: bool| match kind {
        Kind::Gather => ep.handle_gather_done(now, job, ok),
        Kind::Write => ep.handle_write_done(now, job, ok),
        Kind::Scatter => ep.handle_scatter_done(now, job, ok),
    };

    for op in ops.into_iter().take(256) {
        cov.ops += 1;
        match op {
            Op::Msg { from, msg } => {
                let _ = ep.handle_msg(now, PeerId(u32::from(from % 3)), msg);
            }
            Op::Submit { peer, descs, size, packed } => {
                let n = u64::from(descs % 64) + 1;
                let len = u64::from(size % 8192) + 1;
                let stride = if packed { len } else { len * 2 };
                let pairs: Vec<DescPair> = (0..n)
                    .map(|i| DescPair { src: USER_BASE + i * stride, dst: 0x4000_0000 + i * stride, len })
                    .collect();
                if let Ok(p) = plan(&pairs, PlanParams::from_config(&cfg)) {
                    if ep.submit(now, XferId(next_xfer), PeerId(u32::from(peer % 3)), p).is_ok() {
                        cov.submitted += 1;
                    }
                    next_xfer += 1;
                }
            }
            Op::Done { which, ok } => {
                if !jobs.is_empty() {
                    let j = jobs.remove(usize::from(which) % jobs.len());
                    done(&mut ep, now, j, ok);
                    cov.jobs_done += 1;
                }
            }
            Op::Cancel { xfer } => ep.cancel(now, XferId(u64::from(xfer))),
            Op::PeerLost { peer } => ep.handle_peer_lost(now, PeerId(u32::from(peer % 3))),
            Op::Tick { ms } => {
                now += Duration::from_millis(u64::from(ms % 200));
                ep.handle_timeout(now);
            }
        }
        drain(&mut ep, &mut jobs, &mut completed);
        if let Err(e) = ep.scheduler().check_invariants() {
            panic!("scheduler invariant broken: {e}");
        }
        if let Err(e) = ep.receiver().check_invariants() {
            panic!("receiver invariant broken: {e}");
        }
    }
    // Shut down, let every outstanding job end, and nothing may stay allocated.
    ep.shutdown(now);
    drain(&mut ep, &mut jobs, &mut completed);
    let mut guard = 0;
    while let Some(j) = jobs.pop() {
        done(&mut ep, now, j, false);
        drain(&mut ep, &mut jobs, &mut completed);
        guard += 1;
        assert!(guard < 100_000, "jobs keep coming after shutdown");
    }
    assert_eq!(ep.arena_free_bytes(), capacity, "arena bytes leaked after shutdown");
    cov.completed = completed.len();
    cov
}
