//! Counters of one engine, published to NIXL as `stats.<name>` backend params.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters (relaxed atomics: they are observations, not synchronization).
        #[derive(Debug, Default)]
        pub(crate) struct Stats { $($(#[$doc])* pub(crate) $name: AtomicU64,)* }

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
    /// Chunks written straight from user memory (no gather copy).
    chunks_direct,
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
    /// Bounce transfers that failed by no-progress timeout (the core's count).
    timeouts,
    /// Requests handed to the inner UCX engine unchanged.
    passthrough_xfers,
    /// Fallbacks to UCX: neither a WRITE nor a READ.
    fallback_op,
    /// Fallbacks to UCX: not DRAM on both sides.
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
    /// Peers whose capabilities were incompatible with ours.
    peers_incompatible,
    /// Control frames dropped (malformed, unknown sender, stale session, refused).
    control_dropped,
    /// Of those, frames that looked valid but were not authentic: a wrong transfer token, or a
    /// session other than the one in the sender's loaded metadata.
    control_forged,
    /// Free bytes of the arena as last seen by the reactor.
    arena_free_bytes,
    /// Staging regions of failed transfers waiting for their gather or write to end (the
    /// core's count).
    arena_orphans,
    /// Registrations made through this engine.
    registrations,
    /// Peers a transfer may bounce to now (compatible, arena loaded, HELLO received).
    peers_ready,
    /// Remote flows reclaimed because their sender went silent (the core's count).
    flows_timed_out,
    /// Liveness PINGs sent to silent peers we wait on (the core's count).
    pings_sent,
    /// PONGs that answered one of our PINGs (the core's count).
    pongs_received,
    /// Peers declared dead by the liveness probe; their bounced transfers failed (the core's
    /// count).
    peers_declared_dead,
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
}

impl Stats {
    /// Adds one to a counter.
    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Relaxed);
    }
}
