//! The core's counters copied into the engine's published stats.

use std::sync::atomic::Ordering;

use super::Driver;

impl Driver {
    /// Counters the core keeps itself are copied, never counted a second time here.
    pub(super) fn publish_gauges(&self) {
        let (s, core) = (&self.shared.stats, self.ep.stats());
        s.arena_free_bytes.store(self.ep.arena_free_bytes(), Ordering::Relaxed);
        s.arena_standing_bytes.store(self.ep.arena_standing_bytes(), Ordering::Relaxed);
        s.arena_quarantined_bytes.store(self.ep.arena_quarantined_bytes(), Ordering::Relaxed);
        s.arena_orphans.store(self.ep.orphans() as u64, Ordering::Relaxed);
        s.chunks_direct.store(core.chunks_direct, Ordering::Relaxed);
        s.timeouts.store(core.timeouts, Ordering::Relaxed);
        s.flows_timed_out.store(core.flows_timed_out, Ordering::Relaxed);
        s.flows_dropped_unserved.store(core.flows_dropped_unserved, Ordering::Relaxed);
        s.regions_quarantined.store(core.regions_quarantined, Ordering::Relaxed);
        s.pings_sent.store(core.pings_sent, Ordering::Relaxed);
        s.pongs_received.store(core.pongs_received, Ordering::Relaxed);
        s.hello_asks.store(core.hello_asks, Ordering::Relaxed);
        s.hellos_confirmed.store(core.hellos_confirmed, Ordering::Relaxed);
        s.peers_declared_dead.store(core.peers_declared_dead, Ordering::Relaxed);
        s.peers_forgot_us.store(core.peers_forgot_us, Ordering::Relaxed);
        s.dereg_failed.store(core.dereg_failed + self.dereg_refused, Ordering::Relaxed);
        s.keeps_sent.store(core.keeps_sent, Ordering::Relaxed);
        s.one_way_sent.store(core.one_way_sent, Ordering::Relaxed);
        s.one_way_answered.store(core.one_way_answered, Ordering::Relaxed);
        s.one_way_refused.store(core.one_way_refused, Ordering::Relaxed);
        s.one_way_queued.store(core.one_way_queued, Ordering::Relaxed);
        s.records_written.store(core.records_written, Ordering::Relaxed);
        s.records_read.store(core.records_read, Ordering::Relaxed);
        s.records_refused.store(core.records_refused, Ordering::Relaxed);
        s.read_chunks_served.store(core.chunks_served, Ordering::Relaxed);
        s.read_chunks_pulled.store(core.chunks_pulled, Ordering::Relaxed);
        s.plans_sent.store(core.plans_sent, Ordering::Relaxed);
        s.plans_kept.store(core.plans_kept, Ordering::Relaxed);
        s.plans_dropped.store(core.plans_dropped, Ordering::Relaxed);
        s.replans.store(core.replans, Ordering::Relaxed);
        s.region_plans_sent.store(core.region_plans_sent, Ordering::Relaxed);
        s.region_plans_received.store(core.region_plans_received, Ordering::Relaxed);
        s.scatters_held.store(core.scatters_held, Ordering::Relaxed);
        s.gathers_held.store(core.gathers_held, Ordering::Relaxed);
        s.data_runs_refused.store(core.data_runs_refused, Ordering::Relaxed);
        s.writes_deferred.store(core.writes_deferred, Ordering::Relaxed);
        s.reads_deferred.store(core.reads_deferred, Ordering::Relaxed);
        s.grant_waits.store(core.grant_waits, Ordering::Relaxed);
        s.grant_wait_ns.store(core.grant_wait_ns, Ordering::Relaxed);
        s.ack_waits.store(core.ack_waits, Ordering::Relaxed);
        s.ack_wait_ns.store(core.ack_wait_ns, Ordering::Relaxed);
        s.inline_sent.store(core.inline_sent, Ordering::Relaxed);
        s.inline_declined.store(core.inline_declined, Ordering::Relaxed);
        s.inline_acks.store(core.inline_acks, Ordering::Relaxed);
        s.inline_ack_wait_ns.store(core.inline_ack_wait_ns, Ordering::Relaxed);
        s.inline_taken.store(core.inline_taken, Ordering::Relaxed);
        s.standing_opened_out.store(core.standing_opened_out, Ordering::Relaxed);
        s.standing_claims.store(core.standing_claims, Ordering::Relaxed);
        s.standing_opened.store(core.standing_opened, Ordering::Relaxed);
        s.standing_refused.store(core.standing_refused, Ordering::Relaxed);
        s.standing_taken.store(core.standing_taken, Ordering::Relaxed);
        s.standing_kept.store(core.standing_kept, Ordering::Relaxed);
        s.control_forged.store(core.control_forged + self.sessions_forged, Ordering::Relaxed);
        s.control_replayed.store(core.control_replayed, Ordering::Relaxed);
    }
}
