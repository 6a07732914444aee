//! Our one-way transfers' mailbox READs on the data path (the bookkeeping and poll policy are
//! [`super::fetch`]'s), and the records the core writes into our own mailbox.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bounce_proto::XferId;

use super::Driver;
use crate::shell::datapath::Posted;
use crate::shell::stats::Stats;
use crate::sys::nixl::MemSeg;
use crate::sys::shim::{WriteSide, WriteState};

/// How long an ended transfer's mailbox READ may stay in flight before its fetch slice is
/// taken back (see `poll_fetches`). A READ normally takes microseconds.
pub(super) const FETCH_LET_GO: Duration = Duration::from_secs(1);

impl Driver {
    /// Our one-way transfers' mailbox READs: hands finished fetches to the core, frees the
    /// slices of ended transfers, and posts the fetches that are due (see `fetch`).
    pub(super) fn poll_fetches(&mut self, now: Instant) -> bool {
        if self.area.is_none() {
            return false;
        }
        let mut moved = false;
        for xfer in self.fetches.xfers() {
            let live = self.ep.fetch(xfer).is_some();
            let Some(poll) = self.fetches.existing(xfer) else { continue };
            let mut pending = false;
            // A READ let go below: the peer registration it went through.
            let mut let_go = None;
            let mut k = 0;
            while k < poll.reads.len() {
                match self.data.check(&poll.reads[k]) {
                    WriteState::InProg => {
                        pending = true;
                        k += 1;
                        continue;
                    }
                    WriteState::Done => {}
                    WriteState::Failed(st) => {
                        tracing::debug!(xfer = xfer.0, status = %st, "a mailbox READ failed");
                        poll.failed = true;
                    }
                }
                let id = poll.reads.swap_remove(k);
                self.data.release(id);
            }
            if pending && !live && now.saturating_duration_since(poll.posted_at) >= FETCH_LET_GO {
                // An ended transfer's READ that has not come back (a target stopped, over a
                // transport that needs it to run) would hold its slice for ever, and a few such
                // targets every slice. Released, it may still land in the slice later: the next
                // transfer there takes nothing from it, since it accepts only records made under
                // its own key, at its slot and sequence (stale bytes read as garbage does), and
                // the slice is our own fetch area, mapped while the engine lives.
                tracing::debug!(xfer = xfer.0, "an ended transfer's mailbox READ never came back: its slice is reused");
                for id in std::mem::take(&mut poll.reads) {
                    self.data.release(id);
                }
                // Set before its READs were posted (`post_fetch`), so there is one.
                let_go = poll.remote_md;
                pending = false;
            }
            if pending {
                continue;
            }
            if !live {
                if let Some(md) = let_go {
                    self.fetches.note_let_go(md);
                }
                self.fetches.remove(xfer);
                continue;
            }
            if poll.posted {
                let (failed, slice, len) = (poll.failed, poll.slice, poll.len);
                let took = now.saturating_duration_since(poll.posted_at);
                crate::shell::mark!("fetch-done", xfer.0);
                moved = true;
                let stats = &self.shared.stats;
                Stats::bump(&stats.mailbox_fetches);
                stats.mailbox_fetch_us.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
                if failed {
                    // The target is gone or its arena unreachable: no answer will come.
                    self.fetches.fetched(xfer, 0, now);
                    self.ep.handle_fetch_failed(now, xfer);
                } else {
                    let at = self.one_way.fetch_offset + u64::from(slice) * self.one_way.fetch_slice;
                    // An unreadable fetch reads as nothing new: the next poll tries again, and
                    // the transfer's timeout bounds the wait.
                    // (The core takes only an image of the length it asked for: an empty one
                    // would fail the transfer as a broken mailbox.)
                    let image = match self.area.as_ref().map(|a| a.get(at, len)) {
                        Some(Some(image)) => Some(image),
                        Some(None) => {
                            self.area_outside("reading fetched answers");
                            None
                        }
                        None => None,
                    };
                    let new = image.map_or(0, |image| self.ep.handle_fetched(now, xfer, &image));
                    if new > 0 {
                        crate::shell::mark!("fetched", new);
                    }
                    self.fetches.fetched(xfer, new, now);
                }
                let _ = self.drain_actions();
            }
        }
        let due: Vec<XferId> = self.ep.one_way_xfers().collect();
        for xfer in due {
            moved |= self.post_fetch(now, xfer);
        }
        moved
    }

    /// Posts the fetch of `xfer` when it is due and none is in flight; true when it posted.
    fn post_fetch(&mut self, now: Instant, xfer: XferId) -> bool {
        // A transfer's first poll takes a slice of its target's share; later ones ask the core
        // for the regions to read only when a fetch is due (a pass looks at every poll).
        if self.fetches.existing(xfer).is_none() {
            let Some(peer) = self.ep.fetch(xfer).map(|f| f.peer) else { return false };
            if self.fetches.poll(xfer, peer, now).is_none() {
                return false;
            }
        }
        let Some(poll) = self.fetches.existing(xfer) else { return false };
        if poll.posted || poll.next_at > now {
            return false;
        }
        let Some(f) = self.ep.fetch(xfer) else { return false };
        let slice_at = self.one_way.fetch_offset + u64::from(poll.slice) * self.one_way.fetch_slice;
        let (Some(area), Some((name, mb))) = (self.area, self.shared.peers.mailbox_target(f.peer)) else {
            self.ep.handle_fetch_failed(now, xfer);
            let _ = self.drain_actions();
            return true;
        };
        poll.posted = true;
        poll.posted_at = now;
        crate::shell::mark!("fetch", xfer.0);
        poll.remote_md = Some(mb.md);
        let mut off = 0;
        for r in &f.regions {
            // Within our slice (the core's fetches never exceed one) and the peer's mailbox
            // registration (its layout was checked against it when it was loaded).
            let inside =
                mb.offset.checked_add(r.offset).and_then(|o| o.checked_add(r.len)).is_some_and(|end| end <= mb.len)
                    && off + r.len <= self.one_way.fetch_slice;
            let local = area.side(slice_at + off, r.len).filter(|_| inside);
            // The base came from the peer's metadata: one that wraps names no memory of it.
            let addr = mb.offset.checked_add(r.offset).and_then(|o| mb.base.checked_add(o));
            let (Some(local), Some(addr)) = (local, addr) else {
                poll.failed = true;
                break;
            };
            let remote = WriteSide { mem: MemSeg::Dram, md: mb.md, addr, dev: 0 };
            match self.data.read(&name, local, remote, r.len) {
                Ok(Posted::Done) => {}
                Ok(Posted::InFlight(id)) => poll.reads.push(id),
                Err(st) => {
                    tracing::debug!(peer = name, status = %st, "posting a mailbox READ failed");
                    poll.failed = true;
                    break;
                }
            }
            off += r.len;
        }
        poll.len = off;
        true
    }

    /// The core placed a record or a fetch outside our one-way area (a core bug: it places
    /// them inside).
    pub(super) fn area_outside(&mut self, what: &'static str) {
        if self.warn_budget.allow(Instant::now()) {
            tracing::warn!("{what} failed: range outside the one-way area");
        }
    }
}
