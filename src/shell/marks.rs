//! A flight recorder for [`super::mark`]: with `NIXL_BOUNCE_MARKS=DIR` set, each mark costs a
//! clock read and a push under an uncontended lock (about 0.1 us), where the `tracing` line to
//! stderr it otherwise becomes costs a formatted write and a syscall (several microseconds,
//! which slowed a traced 2-core control hop 3-4x: issue 12). A writer thread moves the marks
//! to `DIR/marks.PID.log` every [`FLUSH_EVERY`] (a lock and an empty swap when nothing came),
//! in the line format `benches/timeline.py` reads, so the marks survive a process that leaves
//! with `_exit` (as the benchmarks do) up to the last interval.
//!
//! Off unless the variable is set; then nothing is recorded and a mark is one atomic load.
//! A process forked after the first mark keeps no writer (the thread does not survive a fork).

use std::cell::Cell;
use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// How often the writer thread moves the recorded marks to their file.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(20);

/// One mark: when, what (a prefix and a frame or record kind, either may be empty), which
/// thread, and the id the call site gives (a transfer, job, peer or byte count).
struct Entry {
    ns: u64,
    what: &'static str,
    kind: &'static str,
    id: u64,
    thread: u32,
}

/// The process's recorder (see the module docs).
pub(crate) struct Recorder {
    out: PathBuf,
    pid: u32,
    entries: Mutex<Vec<Entry>>,
    /// Thread names by the index [`thread_index`] gave each marking thread.
    threads: Mutex<Vec<String>>,
    next_thread: AtomicU32,
    /// Also mark `faults` (id: how many) when a thread took minor page faults since its
    /// previous mark (`NIXL_BOUNCE_MARKS_FAULTS=1`; a system call a mark).
    faults: bool,
    /// Set when the marks can no longer be written (no writer thread, or a write failed):
    /// recording stops, so the unwritten marks cannot grow without bound.
    stopped: AtomicBool,
}

static RECORDER: OnceLock<Option<Recorder>> = OnceLock::new();

thread_local! {
    static THREAD: Cell<Option<u32>> = const { Cell::new(None) };
    /// The thread's minor faults at its previous mark (`NIXL_BOUNCE_MARKS_FAULTS`).
    static FAULTS: Cell<u64> = const { Cell::new(0) };
    /// The thread's last mark, to keep only the first of a run of equal ones.
    static LAST: Cell<(&'static str, &'static str, u64)> = const { Cell::new(("", "", u64::MAX)) };
}

/// The recorder when `NIXL_BOUNCE_MARKS` names a directory; its writer starts with it.
pub(crate) fn recorder() -> Option<&'static Recorder> {
    RECORDER
        .get_or_init(|| {
            let dir = std::env::var_os("NIXL_BOUNCE_MARKS").filter(|d| !d.is_empty())?;
            let pid = std::process::id();
            let out = PathBuf::from(dir).join(format!("marks.{pid}.log"));
            let faults = std::env::var("NIXL_BOUNCE_MARKS_FAULTS").is_ok_and(|v| v == "1");
            Some(Recorder::new(out, pid, faults))
        })
        .as_ref()
        .inspect(|rec| rec.start_writer())
}

/// Least duration of a call into the inner engine that [`timed`] marks.
pub(crate) const SLOW_CALL: Duration = Duration::from_micros(5);

/// Runs `f`; with the recorder on, marks `what` with the call's microseconds when it took at
/// least [`SLOW_CALL`]. Around calls into the inner engine, each under its lock: a slow one
/// tells whether a step waited for that lock (another thread's call slow at the same time) or
/// for UCX itself.
pub(crate) fn timed<T>(what: &'static str, f: impl FnOnce() -> T) -> T {
    let Some(rec) = recorder() else { return f() };
    let t = std::time::Instant::now();
    let out = f();
    let took = t.elapsed();
    if took >= SLOW_CALL {
        rec.mark(what, "", took.as_micros() as u64);
    }
    out
}

impl Recorder {
    fn new(out: PathBuf, pid: u32, faults: bool) -> Self {
        Self {
            out,
            pid,
            entries: Mutex::new(Vec::with_capacity(1 << 16)),
            threads: Mutex::new(Vec::new()),
            next_thread: AtomicU32::new(0),
            faults,
            stopped: AtomicBool::new(false),
        }
    }

    /// Records a mark of `what` followed by `kind` with `id`, on the calling thread, now; not
    /// when it equals the thread's previous mark. A run of equal marks keeps its first: an
    /// application spinning on `getNotifs` marks each of its millions of pulls ("app-pull"),
    /// and writing those out took the core the measurement needed.
    pub(crate) fn mark(&self, what: &'static str, kind: &'static str, id: u64) {
        if self.stopped.load(Ordering::Relaxed) {
            return;
        }
        if LAST.with(|l| l.replace((what, kind, id)) == (what, kind, id)) {
            return;
        }
        let ns = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let thread = self.thread_index();
        let faulted = match self.faults.then(crate::sys::thread::minor_faults).flatten() {
            Some(now) => FAULTS.with(|f| now.saturating_sub(f.replace(now))),
            None => 0,
        };
        let mut entries = self.entries.lock();
        if faulted > 0 {
            entries.push(Entry { ns, what: "faults", kind: "", id: faulted, thread });
        }
        entries.push(Entry { ns, what, kind, id, thread });
    }

    fn thread_index(&self) -> u32 {
        THREAD.with(|t| match t.get() {
            Some(i) => i,
            None => {
                let i = self.next_thread.fetch_add(1, Ordering::Relaxed);
                self.threads.lock().push(super::thread_name());
                t.set(Some(i));
                // Faults count from the thread's first mark, not from its start.
                if let Some(n) = self.faults.then(crate::sys::thread::minor_faults).flatten() {
                    FAULTS.with(|f| f.set(n));
                }
                i
            }
        })
    }

    /// Starts the writer thread once (every later call finds it started).
    fn start_writer(&'static self) {
        static STARTED: OnceLock<()> = OnceLock::new();
        STARTED.get_or_init(|| {
            let spawned = std::thread::Builder::new().name("bounce-marks".into()).spawn(move || {
                loop {
                    std::thread::sleep(FLUSH_EVERY);
                    if let Err(e) = self.flush() {
                        tracing::warn!(path = %self.out.display(), error = %e, "NIXL_BOUNCE_MARKS: cannot write the marks; recording stops");
                        self.stop();
                        return;
                    }
                }
            });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "NIXL_BOUNCE_MARKS: no writer thread; recording stops");
                self.stop();
            }
        });
    }

    /// Stops recording and drops what was not written.
    fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        drop(std::mem::take(&mut *self.entries.lock()));
    }

    /// Appends the marks recorded so far to the file, one line each:
    /// `@NS TRACE WHAT pid=P thread=T id=I`, NS the nanoseconds since the Unix epoch.
    fn flush(&self) -> std::io::Result<()> {
        let entries = std::mem::take(&mut *self.entries.lock());
        if entries.is_empty() {
            return Ok(());
        }
        let threads = self.threads.lock().clone();
        let mut text = String::with_capacity(entries.len() * 64);
        for e in &entries {
            let thread = threads.get(e.thread as usize).map_or("?", String::as_str);
            use std::fmt::Write as _;
            let _ =
                writeln!(text, "@{} TRACE {}{} pid={} thread={} id={}", e.ns, e.what, e.kind, self.pid, thread, e.id);
        }
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&self.out)?;
        f.write_all(text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_written_as_timeline_lines_in_order() {
        let dir = std::env::temp_dir().join(format!("bounce-marks-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rec = Recorder::new(dir.join("m.log"), 7, false);
        rec.mark("recv-", "WANT", 42);
        rec.mark("recv-", "WANT", 42); // a repeat: not recorded
        rec.mark("complete", "", 3);
        rec.flush().unwrap();
        rec.flush().unwrap(); // nothing new: nothing appended
        let text = std::fs::read_to_string(dir.join("m.log")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        let parse = |l: &str| -> (u64, String) {
            let (ns, rest) = l.strip_prefix('@').unwrap().split_once(' ').unwrap();
            (ns.parse().unwrap(), rest.to_owned())
        };
        let (t0, first) = parse(lines[0]);
        let (t1, second) = parse(lines[1]);
        let me = super::super::thread_name();
        assert_eq!(first, format!("TRACE recv-WANT pid=7 thread={me} id=42"));
        assert_eq!(second, format!("TRACE complete pid=7 thread={me} id=3"));
        assert!(t0 <= t1 && t0 > 1_600_000_000_000_000_000, "{t0} {t1}");
    }

    #[test]
    fn a_recorder_whose_marks_cannot_be_written_stops_recording() {
        let rec = Recorder::new(PathBuf::from("/nonexistent-bounce-marks-dir/m.log"), 7, false);
        rec.mark("submit", "", 1);
        assert!(rec.flush().is_err(), "the directory does not exist");
        rec.stop();
        rec.mark("complete", "", 1);
        assert!(rec.entries.lock().is_empty(), "nothing is kept once recording stopped");
    }
}
