//! A DATA's checks before anything is scattered: the flow holds the named region for that
//! chunk, and every run lies within the chunk's bytes and inside memory the flow proved.
//! A DATA that fails them is answered ACK(Refused) and its flow reclaimed.

use super::*;

impl Receiver {
    /// Checks a DATA of known flow `key`; returns the chunk's byte size.
    /// Refuses an invalid DATA: ACK(Refused), and the flow's regions are freed at once (its
    /// sender fails on the refusal).
    pub(super) fn refuse_data(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: PeerId,
        data: &Data,
        fault: DataFault,
    ) -> Result<(), ProtocolError> {
        ctx.stats.data_refused += 1;
        if fault.is_about_runs() {
            ctx.stats.data_runs_refused += 1;
        }
        if data.region.len != 0 {
            // The peer's region, unless no record could carry it (its end past 2^64, which the
            // wire refuses): then the generic refusal's, as for a refused WANT.
            let region = if data.region.checked_end().is_some() { data.region } else { Region { offset: 0, len: 1 } };
            let (xfer, token, chunk) = (data.xfer, data.token, data.chunk);
            ctx.send(from, Ack { xfer, token, chunk, region, status: AckStatus::Refused });
        }
        // Its other regions may still have writes in flight.
        self.reclaim(ctx, FlowKey { peer: from, xfer: data.xfer }, self.rest(ctx));
        Err(ProtocolError::InvalidData { peer: from, xfer: data.xfer, chunk: data.chunk, fault })
    }

    /// The DATA's region is the one the flow holds for its chunk: returns the chunk's bytes and
    /// how far into the region its runs may read.
    pub(super) fn check_held(
        &self,
        ctx: &Ctx<'_>,
        key: FlowKey,
        flow: &Flow,
        data: &Data,
    ) -> Result<(u64, u64), DataFault> {
        // A READ flow's regions hold our gathered bytes for its initiator to READ: never a
        // DATA's to scatter.
        if flow.pull.is_some() {
            return Err(DataFault::NotHeld);
        }
        let held = ctx.scheds.get(flow.arena).is_held(key, data.region.offset).ok_or(DataFault::NotHeld)?;
        if held.region != data.region {
            return Err(DataFault::RegionMismatch);
        }
        if held.chunk != data.chunk {
            return Err(DataFault::ChunkMismatch);
        }
        let Some(&bytes) = flow.chunks.get(data.chunk.0 as usize) else {
            internal_error("held chunk beyond the flow's WANT", &data.chunk.0);
            return Err(DataFault::ChunkMismatch);
        };
        // Only the chunk's bytes were written: the rest of the block holds an earlier flow's data.
        Ok((bytes, bytes.min(held.region.len)))
    }

    /// Every run reads inside the first `limit` bytes of the chunk's region and writes inside
    /// one registration the flow proved.
    pub(super) fn check_runs(&self, flow: &Flow, runs: &[CopyRun], limit: u64) -> Result<(), DataFault> {
        self.check_bounds(runs, limit)?;
        // Sorted ranges built once: a flow proving 32 registrations (one per layer) otherwise
        // costs 32 lookups per run.
        let proven = self.registered.proven_ranges(&flow.proven);
        match runs.iter().position(|run| run.addr_span().is_none_or(|(a, b)| !proven.covers(a, b))) {
            Some(index) => Err(DataFault::RunOutsideRegistered { index }),
            None => Ok(()),
        }
    }

    /// Every run is well-formed, reads inside the first `limit` bytes of the region, and all
    /// together copy no more than `limit` bytes.
    pub(super) fn check_bounds(&self, runs: &[CopyRun], limit: u64) -> Result<(), DataFault> {
        if runs.is_empty() {
            return Err(DataFault::NoRuns);
        }
        if runs.len() > wire::MAX_RUNS as usize {
            return Err(DataFault::TooManyRuns);
        }
        // Each piece of an honest chunk sits once in the chunk, so its runs copy at most the
        // chunk's bytes. Without this bound a run of 2^32 pieces with zero strides passes every
        // span check below and pins a copy worker for hours.
        let copies = runs.iter().fold(0u64, |sum, r| sum.saturating_add(r.len.saturating_mul(u64::from(r.count))));
        if copies > limit {
            return Err(DataFault::TooManyBytes { copies, chunk: limit });
        }
        for (index, run) in runs.iter().enumerate() {
            let (Some((_, end)), Some(_)) = (run.region_span(), run.addr_span()) else {
                return Err(DataFault::BadRun { index });
            };
            if run.len == 0 {
                return Err(DataFault::BadRun { index });
            }
            if end > limit {
                return Err(DataFault::RunOutsideChunk { index });
            }
        }
        Ok(())
    }
}
