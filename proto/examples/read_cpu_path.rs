//! What a bounced READ costs its two reactors before the target's first gather: the
//! initiator's submit and the encoding of its first PULL, then the target's decoding and
//! handling of that PULL, up to the first `Action::Gather`. The shell does nothing more on
//! this path (the frame goes out through UCX in between), so this is the READ's serial CPU
//! cost, on this machine, with no network and no copies. Also printed: the whole READ's
//! PULLs (all of them encoded, all of them decoded and handled), work that overlaps the
//! gathers once the first PULL is in, and what planning the transfer costs at its prep.
//!
//! `cargo run --release -p bounce-proto --example read_cpu_path [-- PIECES PIECE_BYTES]`
//! (default 16384 x 4096: the benchmarks' scattered 64 MiB). Prints the minimum of 50 rounds
//! for host-memory defaults (2 MiB chunks) and GPU-memory defaults (32 MiB chunks).

mod common;
use common::{MEM_BASE, agent, endpoint, key};

use std::time::{Duration, Instant};

use bounce_proto::config::Config;
use bounce_proto::endpoint::Action;
use bounce_proto::plan::{self, DescPair, PlanParams};
use bounce_proto::proof::Destination;
use bounce_proto::wire::{self, Frame};
use bounce_proto::{MemKind, PeerId, RegId, Token, XferId};

const ROUNDS: usize = 200;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().expect("a number"));
    let pieces = args.next().unwrap_or(16384);
    let piece = args.next().unwrap_or(4096);
    for (name, mem) in [("host-memory defaults", MemKind::Dram), ("GPU-memory defaults", MemKind::Vram)] {
        let config = Config::from_params_as(Some(mem), [], |_| None).expect("defaults").config;
        let t = measure(&config, pieces, piece);
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "{pieces} x {piece} B READ, {name} ({} MiB chunks, {} chunks, {} PULLs, {} B):",
            config.max_chunk_size >> 20,
            t.chunks,
            t.pulls,
            t.frame_bytes,
        );
        println!(
            "  to the first gather: initiator submit + first PULL encoded {:7.1} us, target decode + handle {:7.1} us",
            us(t.initiator),
            us(t.target),
        );
        println!(
            "  all PULLs:           encoded {:7.1} us, decoded + handled {:7.1} us",
            us(t.all_encoded),
            us(t.all_handled)
        );
        println!("  before all that, at prep (the application's thread): planned in {:7.1} us", us(t.planned));
    }
}

struct Timing {
    planned: Duration,
    initiator: Duration,
    target: Duration,
    all_encoded: Duration,
    all_handled: Duration,
    frame_bytes: usize,
    chunks: usize,
    pulls: usize,
}

/// Both sides' minimum over [`ROUNDS`] fresh transfers of one scattered plan.
fn measure(config: &Config, pieces: u64, piece: u64) -> Timing {
    // Pieces at shuffled slots of a registration 4x their total, on both sides (paged KV).
    let slots = pieces * 4;
    let mut order: Vec<u64> = (0..slots).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let descs: Vec<DescPair> = (0..pieces as usize)
        .map(|i| DescPair {
            src: MEM_BASE + order[i] * piece,
            dst: MEM_BASE + order[order.len() - 1 - i] * piece,
            len: piece,
        })
        .collect();
    let params = PlanParams { region_plan_runs: 0, ..PlanParams::from_config(config) };
    let max = Duration::MAX;
    let mut best = Timing {
        planned: max,
        initiator: max,
        target: max,
        all_encoded: max,
        all_handled: max,
        frame_bytes: 0,
        chunks: 0,
        pulls: 0,
    };
    for round in 0..ROUNDS {
        let now = Instant::now();
        let (mut initiator, mut target) = (endpoint(config, 0, now), endpoint(config, 1, now));
        let tp = Instant::now();
        let mut plan = plan::plan(&descs, params).expect("plan");
        best.planned = best.planned.min(tp.elapsed());
        plan.read = true;
        plan.dests = vec![Destination { reg: RegId(0), key: key(1) }];
        best.chunks = plan.chunks.len();

        // As the initiator's reactor does: submit, then encode and send each PULL in turn.
        let t0 = Instant::now();
        let xfer = XferId(round as u64 + 1);
        initiator.submit_read(now, xfer, Token(7), PeerId(1), plan, None).expect("submit");
        let mut frames = Vec::new();
        let mut first_sent = None;
        while let Some(a) = initiator.poll_action() {
            if let Action::Send { msg: m @ wire::Msg::Pull(_), .. } = a {
                frames.push(Frame { session: 0, msg: m }.to_vec());
                first_sent.get_or_insert_with(Instant::now);
            }
        }
        let t1 = Instant::now();
        let first_sent = first_sent.expect("a PULL");
        // As the target's reactor does: each frame decoded, handled and answered in turn.
        let mut first_gather = None;
        for bytes in &frames {
            target.handle_frame(now, &agent(0), bytes).expect("PULL accepted");
            while let Some(a) = target.poll_action() {
                if matches!(a, Action::Gather { .. }) {
                    first_gather.get_or_insert_with(Instant::now);
                }
            }
        }
        let t2 = Instant::now();
        let first_gather = first_gather.expect("the target gathers");
        best.initiator = best.initiator.min(first_sent - t0);
        best.target = best.target.min(first_gather - t1);
        best.all_encoded = best.all_encoded.min(t1 - t0);
        best.all_handled = best.all_handled.min(t2 - t1);
        best.frame_bytes = frames.iter().map(Vec::len).sum();
        best.pulls = frames.len();
    }
    best
}
