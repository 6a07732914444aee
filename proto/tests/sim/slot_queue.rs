//! More one-way transfers in flight than the target's mailbox slots allow one initiator: the
//! WANTs past the initiator's quarter of the slots wait for one (not dropped), and every
//! transfer completes byte-exact (the harness checks every destination byte and that nothing
//! else changed).

use bounce_proto::oneway::MAILBOX_SLOTS;

use super::*;

/// Transfers one initiator has in flight into one target: 40 past its share of the slots.
const XFERS: usize = (MAILBOX_SLOTS / 4) as usize + 40;

#[test]
fn more_one_way_transfers_than_an_initiators_slots_all_complete() {
    for_seeds(0..6, |seed| {
        let rng = &mut scenario_rng(seed);
        let arena = [8192, 16384][rng.random_range(0..2)];
        let window = rng.random_range(1..=4);
        let knobs = Knobs { fifo: rng.random_bool(0.5), one_way: true, ..Knobs::default() };
        let mut sim = Sim::new(2, &sim_config(arena, window, rng.random_bool(0.5)), knobs, seed);
        for _ in 0..XFERS {
            let bytes = sim.rng().random_range(1..=3000);
            let at = us(sim.rng().random_range(0..50));
            sim.add_xfer(1, 0, bytes, at);
        }
        settle(&mut sim, None);
        let outcomes = &sim.nodes[1].outcomes;
        assert_eq!(outcomes.len(), XFERS);
        assert!(outcomes.values().all(Result::is_ok), "seed {seed}: {outcomes:?}");
        let st = sim.nodes[0].ep.stats();
        assert!(st.one_way_queued > 0, "seed {seed}: no WANT waited for a slot");
        assert_eq!(st.one_way_refused, 0, "seed {seed}");
        assert_eq!(st.one_way_answered, XFERS as u64, "seed {seed}");
    });
}
