//! Counters of one engine, published to NIXL as `stats.<name>` backend params.
//!
//! Every change to any counter also moves one process-wide [`epoch`], so a publisher learns
//! that nothing changed from one load instead of comparing every counter: the application's
//! polling `getNotifs` publishes on every call, and that comparison was a third of an empty
//! call's time (issue 12).

use std::sync::atomic::{AtomicU64, Ordering, Ordering::Relaxed};

/// Moves on every change of any engine's counters (see the module docs).
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// A counter changed: called after its new value is stored (Release pairs with [`epoch`]'s
/// Acquire, so a publisher that reads the moved epoch reads the value too).
fn moved() {
    EPOCH.fetch_add(1, Ordering::Release);
}

/// The counters' epoch now. Read it before the counters: a change made after this read moves
/// the epoch past it, so the next publisher that compares will see that change.
pub(crate) fn epoch() -> u64 {
    EPOCH.load(Ordering::Acquire)
}

/// One counter or gauge: an atomic whose changes move the [`epoch`] (after the value, so a
/// publisher that sees the new epoch sees the value too).
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    /// Adds `v`; returns the previous value.
    pub(crate) fn fetch_add(&self, v: u64, order: Ordering) -> u64 {
        let old = self.0.fetch_add(v, order);
        if v != 0 {
            moved();
        }
        old
    }

    /// Subtracts `v` (a gauge); returns the previous value.
    pub(crate) fn fetch_sub(&self, v: u64, order: Ordering) -> u64 {
        let old = self.0.fetch_sub(v, order);
        if v != 0 {
            moved();
        }
        old
    }

    /// Sets the value (a gauge). Setting the value it already has is no change: the reactor
    /// sets every gauge on every pass.
    pub(crate) fn store(&self, v: u64, order: Ordering) {
        if self.0.load(Relaxed) != v {
            self.0.store(v, order);
            moved();
        }
    }

    /// The value.
    pub(crate) fn load(&self, order: Ordering) -> u64 {
        self.0.load(order)
    }
}

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters (relaxed atomics: they are observations, not synchronization).
        #[derive(Debug, Default)]
        pub(crate) struct Stats { $($(#[$doc])* pub(crate) $name: Counter,)* }

        impl Stats {
            /// Hands `f` every counter as `(index, name, value)`, always the same names in the
            /// same order, without allocating (a polling `getNotifs` publishes through this).
            pub(crate) fn for_each(&self, mut f: impl FnMut(usize, &'static str, u64)) {
                let all = [$((stringify!($name), &self.$name)),*];
                for (i, (name, c)) in all.into_iter().enumerate() {
                    f(i, name, c.load(Relaxed));
                }
            }
        }
    };
}

counters! {
    /// Transfers that took the bounce path (posts).
    bounce_xfers,
    /// Bounce transfers that completed successfully.
    bounce_ok,
    /// Bounce transfers that failed (any reason).
    bounce_failed,
    /// Of `bounce_ok`, the WRITEs.
    bounce_write_ok,
    /// Of `bounce_ok`, the READs (the peer gathered, we READ its region and scattered).
    bounce_read_ok,
    /// Chunks posted on the bounce path.
    bounce_chunks,
    /// Payload bytes posted on the bounce path.
    bounce_bytes,
    /// Of `bounce_chunks`, those staged in a GPU arena of ours (with `bounce_arena_mem=both`,
    /// the GPU-memory transfers; the rest went through the host arena).
    bounce_chunks_gpu_arena,
    /// Chunks written straight from user memory (no gather copy).
    chunks_direct,
    /// Bytes our host arena's scatters wrote with streaming (non-temporal) stores
    /// (`bounce_streaming_scatter`: the whole cache lines of each piece of 256 bytes or more,
    /// on x86-64).
    scatter_streamed_bytes,
    /// Transfers posted on the same-host path (one kernel through CUDA IPC, `bounce_cuda_ipc`).
    ipc_xfers,
    /// Of those, the ones that completed successfully.
    ipc_ok,
    /// Peer GPU allocations mapped here now (the same-host path; a gauge).
    ipc_mappings,
    /// Transfers posted on the same-host path for host memory (cross-memory attach,
    /// `bounce_cma`).
    cma_xfers,
    /// Of those, the ones that completed successfully.
    cma_ok,
    /// Pieces the same-host path for host memory cut at a part's end when it prepared a
    /// request, so that one large piece spreads over its threads (`bounce_cma_workers`).
    cma_pieces_cut,
    /// Bounce transfers that failed by no-progress timeout (the core's count).
    timeouts,
    /// Requests handed to the inner UCX engine unchanged.
    passthrough_xfers,
    /// Fallbacks to UCX: neither a WRITE nor a READ.
    fallback_op,
    /// Fallbacks to UCX: memory not of an arena of ours (or of the peer's), or one transfer's
    /// pieces spread over GPUs.
    fallback_mem,
    /// Fallbacks to UCX: fewer descriptors than the gate's minimum.
    fallback_count,
    /// Fallbacks to UCX: average descriptor larger than the gate's maximum.
    fallback_size,
    /// Fallbacks to UCX: the peer cannot bounce (no or incompatible capabilities).
    fallback_peer,
    /// Fallbacks to UCX: bounce disabled or unavailable in this engine.
    fallback_disabled,
    /// Fallbacks to UCX: a destination's metadata carried no BOUNCE key (not published by a
    /// BOUNCE engine), so the transfer could not prove it.
    fallback_unproven,
    /// Peers whose capabilities were incompatible with ours, or unreadable (another wire
    /// version, garbage): they stay on plain UCX.
    peers_incompatible,
    /// Control frames dropped (malformed, unknown sender, stale session, refused).
    control_dropped,
    /// Of those, frames that looked valid but were not authentic: a wrong transfer token, or a
    /// session other than the one in the sender's loaded metadata.
    control_forged,
    /// WANTs and opening PULLs for a transfer that already ended here: captured frames sent
    /// again (or a peer's very late WANT), ignored.
    control_replayed,
    /// Control frames this engine sent (its transfers' messages, HELLO, GOODBYE, PING and
    /// PONG), whatever the channel.
    control_sent,
    /// Their bytes: `control_sent_bytes / control_sent` is the mean frame (a small bounced
    /// WRITE's one frame is its inline WANT, its bytes and runs included).
    control_sent_bytes,
    /// Where the bounce path's (first) GPU arena is: its GPU's ordinal plus one, 0 for host
    /// arenas only or none (what `bounce_arena_mem=auto` chose; set once the path is ready).
    arena_gpu,
    /// How many arenas the bounce path has: one per GPU arena, plus the host one with
    /// `bounce_arena_mem=both` (0 while it is not running).
    arenas,
    /// Free bytes of the arena as last seen by the reactor.
    arena_free_bytes,
    /// Arena bytes resting in quarantine: reclaimed from peers' flows whose writer went silent
    /// or was lost, free again a quarter of the request timeout later (not leaked).
    arena_quarantined_bytes,
    /// Arena bytes held for peers' standing credits (`bounce_standing_bytes`): granted ahead of
    /// their WRITEs, not free, not leaked (a lease ends each unclaimed one).
    arena_standing_bytes,
    /// Staging regions of failed transfers waiting for their gather or write to end (the
    /// core's count).
    arena_orphans,
    /// Registrations made through this engine.
    registrations,
    /// Peers a transfer may bounce to now (compatible, arena loaded, HELLO confirmed).
    peers_ready,
    /// Remote flows reclaimed because their sender went silent (the core's count).
    flows_timed_out,
    /// Remote flows dropped before their first grant because their peer let another flow's
    /// grant lapse and had used none since: served, they would only hand the same silence
    /// the arena again (the core's count).
    flows_dropped_unserved,
    /// Arena regions put in quarantine after such a reclaim or a lost peer (the core's count).
    regions_quarantined,
    /// Liveness PINGs sent to silent peers we wait on (the core's count).
    pings_sent,
    /// PONGs that answered one of our PINGs (the core's count).
    pongs_received,
    /// Asks about peers' HELLOs: our HELLO and a PING only the peer can answer, repeats
    /// included (the core's count). A HELLO counts only once its PONG comes back.
    hello_asks,
    /// Peers' HELLOs confirmed by their PONG to our ask (the core's count).
    hellos_confirmed,
    /// Peers declared dead by the liveness probe; their bounced transfers failed (the core's
    /// count).
    peers_declared_dead,
    /// FORGETs sent: NIXL here unloaded a peer that could bounce with us, and we told it so
    /// (see the core's `forget` module), so its transfers to us go one way.
    forgets_sent,
    /// Peers whose FORGET proved they unloaded our metadata: our two-way transfers to them
    /// failed at once, and the later ones go one way (the core's count).
    peers_forgot_us,
    /// Peer arenas loaded through the inner engine and not yet unloaded (those retiring
    /// behind a write in flight included).
    peer_arenas_loaded,
    /// Transfers failed, scatters answered as failed, and copy jobs or direct writes refused
    /// because the application deregistered memory they touch (the core's count plus the
    /// reactor's refusals).
    dereg_failed,
    /// KEEPs sent: one of our writes into a peer's region was still in flight after an eighth
    /// of the request timeout (the core's count).
    keeps_sent,
    /// Bounce transfers we sent one way: the target never loaded our metadata and answered
    /// through its mailbox, which we READ (the core's count).
    one_way_sent,
    /// One-way flows we answered through our mailbox (the core's count).
    one_way_answered,
    /// Transfers prepared to a peer that could have been bounced to one way over ZMQ but whose
    /// advertised endpoint our socket has not reached (after a wait of at most 100 ms once per
    /// load): plain UCX, counted in `passthrough_xfers` too.
    one_way_unreached,
    /// One-way WANTs dropped for want of a mailbox slot (the queue of waiting WANTs was full,
    /// or one waited past its sender's timeout); their senders time out (the core's count).
    one_way_refused,
    /// One-way WANTs that found no mailbox slot and waited for one instead of being dropped
    /// (the core's count).
    one_way_queued,
    /// Mailbox records we wrote for one-way flows (the core's count).
    records_written,
    /// Mailbox records we read from targets (the core's count).
    records_read,
    /// Mailbox fetches (the READs of a target's mailbox, one-way initiator) that ended, done or
    /// failed.
    mailbox_fetches,
    /// Their summed time from post to seen complete by the reactor, in microseconds:
    /// `mailbox_fetch_us / mailbox_fetches` is what one poll of a target's answers costs here.
    mailbox_fetch_us,
    /// Mailbox records we read from targets and refused: forged, moved or replayed by a third
    /// party, or torn by the target's own write; each time one was read (the core's count).
    records_refused,
    /// READ chunks we gathered for peers and announced ready (the core's count).
    read_chunks_served,
    /// READ chunks we read from peers and scattered here (the core's count).
    read_chunks_pulled,
    /// Scatter plans we sent ahead of their chunk's DATA (a PLAN frame; the core's count).
    plans_sent,
    /// Peers' PLANs we checked and kept for their DATA (the core's count).
    plans_kept,
    /// Peers' PLANs we dropped: late, over the peer's budget, duplicate or invalid (the core's
    /// count).
    plans_dropped,
    /// DATAs without runs asked for them (ACK(Replan)), or sent again with them (the core's
    /// count).
    replans,
    /// Chunks we wrote with their scatter runs in the region behind their data (the core's
    /// count).
    region_plans_sent,
    /// Peers' chunks whose runs lay in their region, handed to our copy engine to check and
    /// scatter (the core's count).
    region_plans_received,
    /// Of those, scatters whose plan our copy engine refused (or whose copy failed): nothing
    /// was written for a refused plan, and its transfer failed.
    region_plans_failed,
    /// Peers' DATAs for a region their flow held, and WANTs' inline chunks, refused for their
    /// scatter runs (outside the chunk or the registrations the flow proved, degenerate, too
    /// many): nothing of them was written, and their flow was reclaimed (the core's count).
    data_runs_refused,
    /// Peers' chunks whose scatter waited for the scatters of their transfers that ended here
    /// while still scattering (released, refused or timed out): a peer's later bytes land
    /// after them, as on one UCX endpoint (the core's count).
    scatters_held,
    /// Regions of peers' READs whose gather waited the same way (the core's count).
    gathers_held,
    /// Our WRITEs held back at submission until a cancel of ours to the same peer, waiting for
    /// a released or failed transfer's writes, was out: the target learns of the release before
    /// the new WRITE's bytes come (the core's count).
    writes_deferred,
    /// Our READs held back the same way: their PULL reaches the target after the cancel, and the
    /// peer's transfer ids reach it in order (the core's count).
    reads_deferred,
    /// Bounced WRITEs whose first GRANT came: each is one WANT -> GRANT round trip timed
    /// (the core's count).
    grant_waits,
    /// Their summed WANT -> GRANT time in nanoseconds, from the reactor pass that sent the WANT
    /// to the one that read the GRANT: `grant_wait_ns / grant_waits` is one control round trip
    /// as this initiator sees it (the core's count).
    grant_wait_ns,
    /// Chunks we wrote that the target ACKed as scattered: each is one DATA -> ACK round trip
    /// timed (the core's count).
    ack_waits,
    /// Their summed DATA -> ACK time in nanoseconds, the target's scatter of the chunk
    /// included (one way: until a mailbox fetch found the ACK; the core's count).
    ack_wait_ns,
    /// Bounced WRITEs whose one chunk we sent inside the WANT (`bounce_inline_bytes`; the
    /// core's count).
    inline_sent,
    /// Of those, the ones the target declined: it GRANTed the chunk, which we then wrote as
    /// usual (the core's count).
    inline_declined,
    /// Of those, the ones the ACK alone completed: one control round trip and no write each
    /// (the core's count).
    inline_acks,
    /// Their summed WANT -> ACK time in nanoseconds, the target's put and scatter included:
    /// `inline_ack_wait_ns / inline_acks` is the whole transfer's round trip (the core's count).
    inline_ack_wait_ns,
    /// Peers' inline chunks we put in a region of our arena and scattered (the core's count).
    inline_taken,
    /// Standing flows we opened at targets we WRITE to (`bounce_standing_bytes`; the core's
    /// count).
    standing_opened_out,
    /// Bounced WRITEs whose first chunk we wrote into a standing credit, with no WANT -> GRANT
    /// round trip (the core's count).
    standing_claims,
    /// Standing flows peers opened here (the core's count).
    standing_opened,
    /// Standing flows refused here: none of that size given, one per peer, or the standing
    /// share of the arena taken (the core's count).
    standing_refused,
    /// Peers' transfers whose first chunk came in the standing credit we held for them (the
    /// core's count).
    standing_taken,
    /// Of those, the regions given back to the peer's standing flow with the chunk's ACK, so
    /// its next transfer needs no fresh grant (the core's count).
    standing_kept,
}

/// What a publisher last handed on (see [`Stats::publish_changes`]).
#[derive(Debug, Default)]
pub(crate) struct Published {
    epoch: Option<u64>,
    values: Vec<u64>,
}

impl Stats {
    /// Hands `publish` the counters that changed since `last` (all of them the first time),
    /// each with its index in [`Stats::for_each`]'s order; nothing, after one load, when no
    /// counter of any engine changed since.
    pub(crate) fn publish_changes(&self, last: &mut Published, mut publish: impl FnMut(usize, &'static str, u64)) {
        let now = epoch();
        if last.epoch == Some(now) {
            return;
        }
        let fresh = last.values.is_empty();
        self.for_each(|i, name, v| {
            if fresh {
                last.values.push(v);
                publish(i, name, v);
            } else if last.values[i] != v {
                last.values[i] = v;
                publish(i, name, v);
            }
        });
        last.epoch = Some(now);
    }

    /// Adds one to a counter.
    pub(crate) fn bump(c: &Counter) {
        c.fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(s: &Stats, last: &mut Published) -> Vec<(&'static str, u64)> {
        let mut got = Vec::new();
        s.publish_changes(last, |_, name, v| got.push((name, v)));
        got
    }

    #[test]
    fn a_publisher_gets_everything_once_then_only_what_changed() {
        let s = Stats::default();
        let mut last = Published::default();
        let first = changes(&s, &mut last);
        let mut all = 0;
        s.for_each(|_, _, _| all += 1);
        assert!(all > 40);
        assert_eq!(first.len(), all, "every counter");
        assert!(first.iter().all(|&(_, v)| v == 0));
        assert_eq!(changes(&s, &mut last), []);
        // Each kind of change alone is seen (each moves the epoch).
        Stats::bump(&s.bounce_xfers);
        assert_eq!(changes(&s, &mut last), [("bounce_xfers", 1)]);
        s.arena_free_bytes.store(4096, Relaxed);
        assert_eq!(changes(&s, &mut last), [("arena_free_bytes", 4096)]);
        s.arena_free_bytes.store(4096, Relaxed);
        assert_eq!(changes(&s, &mut last), [], "a gauge set to what it was");
        s.ipc_mappings.fetch_add(2, Relaxed);
        assert_eq!(changes(&s, &mut last), [("ipc_mappings", 2)]);
        s.ipc_mappings.fetch_sub(1, Relaxed);
        assert_eq!(changes(&s, &mut last), [("ipc_mappings", 1)]);
        Stats::bump(&s.bounce_xfers);
        s.arena_free_bytes.store(0, Relaxed);
        assert_eq!(changes(&s, &mut last), [("bounce_xfers", 2), ("arena_free_bytes", 0)], "in the counters' order");
    }

    /// A counter changed on another thread after a publish is published next time: the
    /// changes move the epoch, and the epoch is read before the counters.
    #[test]
    fn a_change_on_another_thread_is_published_next_time() {
        let s = std::sync::Arc::new(Stats::default());
        let mut last = Published::default();
        changes(&s, &mut last);
        for n in 1..=100u64 {
            let t = std::sync::Arc::clone(&s);
            std::thread::spawn(move || Stats::bump(&t.control_dropped)).join().unwrap();
            assert_eq!(changes(&s, &mut last), [("control_dropped", n)]);
        }
    }

    /// Setting a gauge to the value it has does not move the epoch (the reactor sets every
    /// gauge on every pass; each move makes every publisher compare again). Other tests move
    /// the epoch meanwhile, so it is enough that some attempt sees it still.
    #[test]
    fn setting_a_gauge_to_its_value_is_no_change() {
        let s = Stats::default();
        s.arena_free_bytes.store(7, Relaxed);
        let still = (0..1000).any(|_| {
            let e = epoch();
            s.arena_free_bytes.store(7, Relaxed);
            epoch() == e
        });
        assert!(still, "every equal store moved the epoch");
        let e = epoch();
        s.arena_free_bytes.store(8, Relaxed);
        assert!(epoch() > e);
    }
}
