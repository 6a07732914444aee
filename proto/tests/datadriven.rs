//! Data-driven scenarios for the buddy allocator and the credit scheduler (raft datadriven
//! style): each file under `tests/testdata/{buddy,scheduler}/` is a script of cases, each a
//! command line, a `----` line, then the expected printout up to a blank line. Every file starts
//! from a fresh state and runs its cases in order.
//!
//! Set `BOUNCE_DATADRIVEN_REWRITE=1` to rewrite the expected printouts from the actual ones
//! (then review the diff).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use bounce_proto::buddy::Buddy;
use bounce_proto::scheduler::{CreditScheduler, Reuse};
use bounce_proto::{FlowKey, PeerId, Region, XferId};

/// One case: `cmd key=value ...`, `----`, expected output.
struct Case {
    /// Comment lines right before the case (kept on rewrite).
    comment: String,
    line: usize,
    cmd: String,
    args: Vec<(String, String)>,
    expected: String,
}

fn parse(text: &str) -> Vec<Case> {
    let lines: Vec<&str> = text.lines().collect();
    let mut cases = Vec::new();
    let mut comment = String::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i].trim();
        if l.starts_with('#') {
            comment.push_str(l);
            comment.push('\n');
        }
        if l.is_empty() || l.starts_with('#') {
            i += 1;
            continue;
        }
        let mut words = l.split_whitespace();
        let cmd = words.next().unwrap_or_default().to_string();
        let args = words
            .map(|w| match w.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (w.to_string(), String::new()),
            })
            .collect();
        assert_eq!(lines.get(i + 1).map(|s| s.trim()), Some("----"), "line {}: expected ----", i + 2);
        let mut j = i + 2;
        let mut expected = String::new();
        while j < lines.len() && !lines[j].trim().is_empty() {
            expected.push_str(lines[j]);
            expected.push('\n');
            j += 1;
        }
        cases.push(Case { comment: std::mem::take(&mut comment), line: i + 1, cmd, args, expected });
        i = j;
    }
    cases
}

fn render(cases: &[Case], outputs: &[String]) -> String {
    let mut out = String::new();
    for (c, o) in cases.iter().zip(outputs) {
        let args: Vec<String> =
            c.args.iter().map(|(k, v)| if v.is_empty() { k.clone() } else { format!("{k}={v}") }).collect();
        let head = std::iter::once(c.cmd.clone()).chain(args).collect::<Vec<_>>().join(" ");
        if !c.comment.is_empty() {
            let _ = writeln!(out, "{}", c.comment.trim_end());
            // The file's leading comment block stands apart from the first case.
            if std::ptr::eq(c, &cases[0]) {
                out.push('\n');
            }
        }
        let _ = write!(out, "{head}\n----\n{o}\n");
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

/// Runs every `*.txt` under `testdata/<topic>` through a fresh handler from `make`.
fn run_dir<H: Handler>(topic: &str, make: impl Fn() -> H) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/testdata").join(topic);
    let rewrite = std::env::var_os("BOUNCE_DATADRIVEN_REWRITE").is_some();
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "txt"));
    files.sort();
    assert!(!files.is_empty(), "no scenarios in {}", dir.display());
    let mut failures = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let cases = parse(&text);
        let mut h = make();
        let outputs: Vec<String> = cases.iter().map(|c| h.run(c)).collect();
        if rewrite {
            std::fs::write(&path, render(&cases, &outputs)).unwrap();
            continue;
        }
        for (c, o) in cases.iter().zip(&outputs) {
            if *o != c.expected {
                failures.push(format!(
                    "{}:{}: {}\n--- expected\n{}--- actual\n{}",
                    path.display(),
                    c.line,
                    c.cmd,
                    c.expected,
                    o
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

trait Handler {
    /// Runs one command and returns its printout (newline-terminated, never empty).
    fn run(&mut self, case: &Case) -> String;
}

fn arg<'a>(c: &'a Case, key: &str) -> &'a str {
    c.args
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("line {}: `{}` needs {key}=", c.line, c.cmd))
}

fn opt<'a>(c: &'a Case, key: &str) -> Option<&'a str> {
    c.args.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// Milliseconds since a handler's time zero.
fn millis(ms: &str) -> Duration {
    Duration::from_millis(ms.parse().unwrap_or_else(|_| panic!("bad milliseconds {ms}")))
}

/// `4096`, `4K`, `2M` (binary units).
fn bytes(s: &str) -> u64 {
    let (num, mul) = match s.as_bytes().last() {
        Some(b'K') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    num.parse::<u64>().unwrap_or_else(|_| panic!("bad size {s}")) * mul
}

fn fmt_bytes(n: u64) -> String {
    match n {
        0 => "0".into(),
        n if n % (1 << 20) == 0 => format!("{}M", n >> 20),
        n if n % (1 << 10) == 0 => format!("{}K", n >> 10),
        n => n.to_string(),
    }
}

fn fmt_region(r: Region) -> String {
    format!("[{}+{}]", fmt_bytes(r.offset), fmt_bytes(r.len))
}

fn fmt_regions(rs: impl IntoIterator<Item = Region>) -> String {
    let v: Vec<String> = rs.into_iter().map(fmt_region).collect();
    if v.is_empty() { "-".into() } else { v.join(" ") }
}

/// `peer:xfer`, e.g. `1:7`.
fn flow(s: &str) -> FlowKey {
    let (p, x) = s.split_once(':').unwrap_or_else(|| panic!("flow must be peer:xfer, got {s}"));
    FlowKey { peer: PeerId(p.parse().unwrap()), xfer: XferId(x.parse().unwrap()) }
}

fn fmt_flow(f: FlowKey) -> String {
    format!("{}:{}", f.peer.0, f.xfer.0)
}

// ---- buddy ------------------------------------------------------------------------------

/// Commands: `new capacity= granularity=`, `alloc bytes=`, `free offset=`, `state`.
struct BuddyHandler(Option<Buddy>);

impl Handler for BuddyHandler {
    fn run(&mut self, c: &Case) -> String {
        if c.cmd == "new" {
            return match Buddy::new(bytes(arg(c, "capacity")), bytes(arg(c, "granularity"))) {
                Ok(b) => {
                    let out = format!(
                        "usable={} largest_block={}\nfree: {}\n",
                        fmt_bytes(b.usable_capacity()),
                        fmt_bytes(b.largest_block()),
                        fmt_regions(sorted(b.free_regions()))
                    );
                    self.0 = Some(b);
                    out
                }
                Err(e) => format!("error: {e}\n"),
            };
        }
        let b = self.0.as_mut().expect("`new` first");
        let out = match c.cmd.as_str() {
            "alloc" => match b.alloc(bytes(arg(c, "bytes"))) {
                Some(r) => format!("{}\n", fmt_region(r)),
                None => "none\n".into(),
            },
            "free" => match b.free(bytes(arg(c, "offset"))) {
                Ok(r) => format!("freed {}\n", fmt_region(r)),
                Err(e) => format!("error: {e}\n"),
            },
            "state" => format!(
                "free: {}\nallocated: {}\nfree={} allocated={} largest_free={}\n",
                fmt_regions(sorted(b.free_regions())),
                fmt_regions(b.allocated_regions()),
                fmt_bytes(b.free_bytes()),
                fmt_bytes(b.allocated_bytes()),
                fmt_bytes(b.largest_free())
            ),
            other => panic!("line {}: unknown command {other}", c.line),
        };
        b.check_invariants().unwrap_or_else(|e| panic!("line {}: {e}", c.line));
        out
    }
}

fn sorted(rs: impl Iterator<Item = Region>) -> Vec<Region> {
    let mut v: Vec<Region> = rs.collect();
    v.sort();
    v
}

#[test]
fn buddy_scenarios() {
    run_dir("buddy", || BuddyHandler(None));
}

// ---- scheduler --------------------------------------------------------------------------

/// Commands: `new capacity= granularity= window=`, `want flow= chunks=a,b,..`, `schedule`,
/// `data flow= offset=` (is_held + begin_scatter), `end offset=`, `ack flow= offset=` (data +
/// end), `reclaim flow=`, `reclaim-peer peer=`, `local bytes= [eager]`, `promote offset=`,
/// `release offset=`, `state`. Invariants are checked after every command.
struct SchedHandler {
    s: Option<CreditScheduler>,
    seen: BTreeSet<FlowKey>,
    /// Time zero of the `rest=` and `lift at=` arguments (milliseconds).
    t0: Instant,
}

impl SchedHandler {
    fn data(s: &mut CreditScheduler, f: FlowKey, off: u64) -> Result<String, String> {
        if s.is_held(f, off).is_none() {
            // Still call begin_scatter: it must agree and name the reason.
            return Err(s
                .begin_scatter(f, off)
                .err()
                .map_or("is_held/begin_scatter disagree".into(), |e| e.to_string()));
        }
        let g = s.begin_scatter(f, off).map_err(|e| e.to_string())?;
        Ok(format!("scattering {} #{} {}\n", fmt_flow(g.flow), g.chunk.0, fmt_region(g.region)))
    }

    fn end(s: &mut CreditScheduler, off: u64) -> String {
        match s.end_scatter(off) {
            Ok(e) => format!(
                "freed {} of {} #{}{}\n",
                fmt_region(e.region),
                fmt_flow(e.flow),
                e.chunk.0,
                if e.orphaned { " (orphaned, no ACK)" } else { "" }
            ),
            Err(e) => format!("error: {e}\n"),
        }
    }
}

impl Handler for SchedHandler {
    fn run(&mut self, c: &Case) -> String {
        if c.cmd == "new" {
            let window = arg(c, "window").parse().unwrap();
            return match CreditScheduler::new(bytes(arg(c, "capacity")), bytes(arg(c, "granularity")), window) {
                Ok(s) => {
                    let out = format!(
                        "usable={} max_chunk={} eager_cap={}\n",
                        fmt_bytes(s.usable_capacity()),
                        fmt_bytes(s.max_chunk_bytes()),
                        fmt_bytes(s.eager_cap())
                    );
                    self.s = Some(s);
                    out
                }
                Err(e) => format!("error: {e}\n"),
            };
        }
        let s = self.s.as_mut().expect("`new` first");
        let out = match c.cmd.as_str() {
            "want" => {
                let f = flow(arg(c, "flow"));
                let chunks: Vec<u64> = arg(c, "chunks").split(',').filter(|x| !x.is_empty()).map(bytes).collect();
                self.seen.insert(f);
                match s.want(f, &chunks) {
                    Ok(()) => format!("ok, {} pending\n", s.pending_chunks(f)),
                    Err(e) => format!("error: {e}\n"),
                }
            }
            "schedule" => {
                let mut out = String::new();
                for g in s.schedule() {
                    let _ = writeln!(out, "grant {} #{} {}", fmt_flow(g.flow), g.chunk.0, fmt_region(g.region));
                }
                if out.is_empty() {
                    out.push_str("no grants\n");
                }
                if let Some(d) = s.drain_target() {
                    let _ = writeln!(out, "drain mode: waiting for {}", fmt_flow(d));
                }
                out
            }
            "data" => match Self::data(s, flow(arg(c, "flow")), bytes(arg(c, "offset"))) {
                Ok(o) => o,
                Err(e) => format!("rejected: {e}\n"),
            },
            "end" => Self::end(s, bytes(arg(c, "offset"))),
            "ack" => {
                let off = bytes(arg(c, "offset"));
                match Self::data(s, flow(arg(c, "flow")), off) {
                    Ok(_) => Self::end(s, off),
                    Err(e) => format!("rejected: {e}\n"),
                }
            }
            "reclaim" | "reclaim-peer" => {
                // `rest=<ms>`: quarantined until that instant; without it, freed at once.
                let reuse = opt(c, "rest").map_or(Reuse::Now, |ms| Reuse::After(self.t0 + millis(ms)));
                let r = if c.cmd == "reclaim" {
                    s.reclaim_flow(flow(arg(c, "flow")), reuse)
                } else {
                    s.reclaim_peer(PeerId(arg(c, "peer").parse().unwrap()), reuse)
                };
                let mut out = format!("freed: {}\n", fmt_regions(r.freed));
                if reuse != Reuse::Now {
                    let _ = writeln!(out, "quarantined: {}", fmt_regions(r.quarantined));
                }
                let _ = writeln!(out, "deferred: {}", fmt_regions(r.deferred));
                out
            }
            // The flow's writer says its writes ended (its cancel): its regions are freed now.
            "lift-flow" => format!("lifted: {}\n", fmt_regions(s.lift_flow(flow(arg(c, "flow"))))),
            // `lift at=<ms>` lifts the quarantines ended by then; `lift` alone, all (shutdown).
            "lift" => {
                let lifted = s.lift_quarantine(opt(c, "at").map(|ms| self.t0 + millis(ms)));
                let next = s.next_lift().map_or("-".into(), |t| format!("{}ms", (t - self.t0).as_millis()));
                format!("lifted: {}\nnext lift: {next}\n", fmt_regions(lifted))
            }
            "local" => match s.acquire_local(bytes(arg(c, "bytes")), opt(c, "eager").is_some()) {
                Some(r) => format!("{}\n", fmt_region(r)),
                None => "none\n".into(),
            },
            "promote" => match s.promote_local(bytes(arg(c, "offset"))) {
                Ok(()) => format!("ok, eager={}\n", fmt_bytes(s.eager_bytes())),
                Err(e) => format!("error: {e}\n"),
            },
            "release" => match s.release_local(bytes(arg(c, "offset"))) {
                Ok(r) => format!("released {}\n", fmt_region(r)),
                Err(e) => format!("error: {e}\n"),
            },
            "state" => {
                let mut out = format!(
                    "free={} local={} eager={} flows={} drain={}\n",
                    fmt_bytes(s.free_bytes()),
                    fmt_bytes(s.local_bytes()),
                    fmt_bytes(s.eager_bytes()),
                    s.active_flows(),
                    s.drain_target().map_or("-".into(), fmt_flow)
                );
                if s.quarantined_bytes() > 0 {
                    let _ = writeln!(out, "quarantined={}", fmt_bytes(s.quarantined_bytes()));
                }
                for &f in self.seen.iter().filter(|f| s.has_flow(**f)) {
                    let _ = writeln!(
                        out,
                        "{} pending={} held={} ({})",
                        fmt_flow(f),
                        s.pending_chunks(f),
                        s.flow_held_count(f),
                        fmt_bytes(s.flow_held_bytes(f))
                    );
                }
                out
            }
            other => panic!("line {}: unknown command {other}", c.line),
        };
        s.check_invariants().unwrap_or_else(|e| panic!("line {}: {e}", c.line));
        out
    }
}

#[test]
fn scheduler_scenarios() {
    run_dir("scheduler", || SchedHandler { s: None, seen: BTreeSet::new(), t0: Instant::now() });
}
