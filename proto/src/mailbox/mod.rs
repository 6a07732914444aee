//! One-sided answers (issue 13, docs/one-way.md): a target that never loaded its initiator's
//! metadata answers it by writing authenticated records into a mailbox in its own registered
//! arena, and the initiator fetches them with small RDMA READs. No reverse connection, so no
//! peer bytes ever reach UCX's address parser.
//!
//! One job per file: `record.rs` the 64-byte record, its per-transfer key and MAC, and the
//! slot and sequence ids it carries; `slots.rs` the target's side (mailbox layout, candidate
//! slots, bounded slot allocation per peer, record sequencing and ring flow control);
//! `writer.rs` the target's record writer over the slot table (keys, backlog while a ring is
//! full, write order); `waiting.rs` the bounded, fair queue of transfers waiting for a slot;
//! `reader.rs` the initiator's side (locating the slot, what to fetch, what comes next, the
//! replay / forgery / duplicate rules); `fuzzing.rs` the fuzz entry points; `tests.rs` the
//! property tests. This file only declares and re-exports them. Like the rest of the core: no
//! threads, clocks or IO.

#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod reader;
mod record;
mod slots;
#[cfg(test)]
mod tests;
mod waiting;
mod writer;

pub use reader::{MailboxReader, ReaderError, ReaderStats};
pub use record::{Answer, FailReason, RECORD_LEN, RECORD_VERSION, Record, RecordError, RecordKey, Seq, SlotId, Token};
pub use slots::{CANDIDATES, MailboxLayout, RecordPlace, SlotConfig, SlotError, SlotTable, candidates};
pub use waiting::{QueueConfig, QueueError, SlotQueue, Waiter};
pub use writer::{MailboxWriter, RecordWrite};
