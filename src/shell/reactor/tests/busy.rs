//! The reactor's busy flag ([`Shared::reactor_busy`]), which lets an application spinning on
//! `getNotifs` wait on the doorbell instead of taking the cores the reactor needs: set in both
//! roles while a transfer is in flight (the receiver's too, waiting for a DATA), cleared when
//! nothing is.

use super::*;

/// Waits (at most 10 s) until `side`'s reactor reports `busy`.
fn wait_busy(side: &Side, busy: bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while side.shared.reactor_busy() != busy {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn both_roles_report_busy_while_a_transfer_is_in_flight_and_idle_after() {
    let cfg = config("10000");
    let net = MemNet::default();
    let (a, b) = pair(&cfg, &net);
    wait_busy(&a, false, "the HELLO exchange leaves the sender idle");
    wait_busy(&b, false, "the HELLO exchange leaves the receiver idle");
    let (src, mut dst) = buffers();
    let dest = b.register(&mut dst);
    let h = a.post("b", &cfg, &src, &mut dst, dest);
    assert_eq!(a.outcome(h, Duration::from_secs(20)), Ok(()));
    assert_exact(&src, &dst);
    wait_busy(&a, false, "a finished transfer leaves the sender idle");
    wait_busy(&b, false, "a finished flow leaves the receiver idle");

    // Every DATA is lost: the receiver holds its grants, waiting for them.
    let data = Arc::new(AtomicUsize::new(0));
    let d = Arc::clone(&data);
    net.set_fault(move |_, _, f| {
        if kind(f) == Some("data") {
            d.fetch_add(1, Ordering::Relaxed);
            Fate::Drop
        } else {
            Fate::Deliver
        }
    });
    let h = a.post("b", &cfg, &src, &mut dst, dest);
    wait_nonzero(&data, "no DATA was sent");
    wait_busy(&b, true, "a receiver waiting for a DATA reports busy");
    wait_busy(&a, true, "a sender with a transfer in flight reports busy");
    assert!(a.shared.requests.state(h).is_some_and(|s| !matches!(s, State::Done(_))), "still in flight");
    drop((a.reactor, b.reactor));
}
