//! What each control hop of a small bounced WRITE costs the reactors' CPUs, with no network
//! and no copies: the initiator's submit and WANT encoding; the target's decoding and handling
//! of the WANT up to its GRANT; the initiator's handling of the GRANT up to the write, and of
//! the write's completion up to the DATA; the target's handling of the DATA up to the scatter,
//! and of the scatter's completion up to the ACK; the initiator's handling of the ACK. Set
//! beside `benches/control_hops.py`'s round trips (each is two hops of UCX plus two of these),
//! it says how much of a control round trip is the core's own work.
//!
//! `cargo run --release -p bounce-proto --example hop_cpu_path [-- PIECES PIECE_BYTES]`
//! (default 256 x 64: the control-hops benchmark's WRITE, every piece a gap apart on both
//! sides). Prints the minimum and the median of 2000 transfers, host-memory defaults.

mod common;
use common::{MEM_BASE, agent, endpoint, key};

use std::time::{Duration, Instant};

use bounce_proto::config::Config;
use bounce_proto::endpoint::{Action, Endpoint};
use bounce_proto::plan::{self, DescPair, PlanParams};
use bounce_proto::proof::Destination;
use bounce_proto::wire::Frame;
use bounce_proto::{MemKind, PeerId, RegId, Token, XferId};

const ROUNDS: usize = 2000;
const STEPS: [&str; 7] = [
    "initiator: submit, WANT encoded",
    "target: WANT decoded and handled, GRANT encoded",
    "initiator: GRANT decoded and handled, write posted",
    "initiator: write done, DATA encoded",
    "target: DATA decoded and handled, scatter out",
    "target: scatter done, ACK encoded",
    "initiator: ACK decoded and handled, complete",
];

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().expect("a number"));
    let pieces = args.next().unwrap_or(256);
    let piece = args.next().unwrap_or(64);
    let defaults = Config::from_params_as(Some(MemKind::Dram), [], |_| None).expect("defaults").config;
    // The full exchange, whose seven steps these are: no chunk inside the WANT, no standing
    // credit (both on by default for host memory since sessions 15 and 16, when a transfer this
    // small takes one round trip or skips its WANT -> GRANT).
    let config = Config { inline_bytes: 0, standing_bytes: 0, ..defaults };
    let descs: Vec<DescPair> = (0..pieces)
        .map(|i| DescPair { src: MEM_BASE + i * 2 * piece, dst: MEM_BASE + i * 2 * piece, len: piece })
        .collect();
    let params = PlanParams { region_plan_runs: 0, ..PlanParams::from_config(&config) };
    let mut plan = plan::plan(&descs, params).expect("plan");
    plan.dests = vec![Destination { reg: RegId(0), key: key(1) }];
    let plan = std::sync::Arc::new(plan);
    let now = Instant::now();
    let (mut ini, mut tgt) = (endpoint(&config, 0, now), endpoint(&config, 1, now));
    let mut samples: Vec<[Duration; 7]> = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS {
        let mut t = [Duration::ZERO; 7];
        let xfer = XferId(round as u64 + 1);
        // Each step: the calls its reactor makes, and the frame it sends, encoded as the shell does.
        let (want, gathers) = timed(&mut t[0], || {
            ini.submit(now, xfer, Token(7), PeerId(1), plan.clone()).expect("submit");
            drain(&mut ini, 0)
        });
        for job in gathers.gathers {
            ini.handle_gather_done(now, job, true);
        }
        let _ = drain(&mut ini, 0);
        let (grant, _) = timed(&mut t[1], || {
            tgt.handle_frame(now, &agent(0), &want.expect("a WANT")).expect("WANT accepted");
            drain(&mut tgt, 1)
        });
        let (_, jobs) = timed(&mut t[2], || {
            ini.handle_frame(now, &agent(1), &grant.expect("a GRANT")).expect("GRANT accepted");
            drain(&mut ini, 0)
        });
        let (data, _) = timed(&mut t[3], || {
            ini.handle_write_done(now, jobs.writes[0], true);
            drain(&mut ini, 0)
        });
        let (_, jobs) = timed(&mut t[4], || {
            tgt.handle_frame(now, &agent(0), &data.expect("a DATA")).expect("DATA accepted");
            drain(&mut tgt, 1)
        });
        let (ack, _) = timed(&mut t[5], || {
            tgt.handle_scatter_done(now, jobs.scatters[0], true);
            drain(&mut tgt, 1)
        });
        let (_, jobs) = timed(&mut t[6], || {
            ini.handle_frame(now, &agent(1), &ack.expect("an ACK")).expect("ACK accepted");
            drain(&mut ini, 0)
        });
        assert_eq!(jobs.completes, 1, "the transfer completed");
        samples.push(t);
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("{pieces} x {piece} B WRITE, host-memory defaults, {ROUNDS} transfers: min / median");
    let mut sums = (0.0, 0.0);
    for (i, name) in STEPS.iter().enumerate() {
        let mut col: Vec<Duration> = samples.iter().map(|s| s[i]).collect();
        col.sort();
        let (min, med) = (us(col[0]), us(col[col.len() / 2]));
        sums = (sums.0 + min, sums.1 + med);
        println!("  {name:52} {min:6.2} / {med:6.2} us");
    }
    println!("  {:52} {:6.2} / {:6.2} us", "all seven", sums.0, sums.1);
}

/// Runs `f`, storing how long it took in `took`.
fn timed<R>(took: &mut Duration, f: impl FnOnce() -> R) -> R {
    let s = Instant::now();
    let r = f();
    *took = s.elapsed();
    r
}

#[derive(Default)]
struct Jobs {
    gathers: Vec<bounce_proto::event::JobId>,
    writes: Vec<bounce_proto::event::JobId>,
    scatters: Vec<bounce_proto::event::JobId>,
    completes: usize,
}

/// Takes every action; returns the last message sent, encoded with the sender's `session`, and
/// the jobs started.
fn drain(ep: &mut Endpoint, session: u64) -> (Option<Vec<u8>>, Jobs) {
    let (mut sent, mut jobs) = (None, Jobs::default());
    while let Some(a) = ep.poll_action() {
        match a {
            Action::Send { msg, .. } => sent = Some(Frame { session, msg }.to_vec()),
            Action::Gather { job, .. } => jobs.gathers.push(job),
            Action::Write { job, .. } => jobs.writes.push(job),
            Action::Scatter { job, .. } => jobs.scatters.push(job),
            Action::Complete { .. } => jobs.completes += 1,
            _ => {}
        }
    }
    (sent, jobs)
}
