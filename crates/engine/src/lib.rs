//! The B^ε-tree key-value engine of betreefs.
//!
//! A [`Store`] keeps two trees ([`KeySpace::Meta`], [`KeySpace::Data`]) on
//! one device, sharing one redo log, one node cache and every checkpoint.
//! Writes are messages (put, delete, upsert, range delete) that enter at the
//! root and sink through per-child buffers in batches; see docs/design.md.
//!
//! Limits: keys up to [`MAX_KEY_BYTES`] (12 KiB), values and upsert arguments
//! up to [`MAX_VALUE_BYTES`] (128 KiB), keys compare by memcmp.

#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

pub mod btt;
pub mod buffer;
pub mod chunks;
pub mod codec;
pub mod entries;
pub mod error;
pub mod format;
pub mod merge;
pub mod message;
pub mod node;
pub mod point_map;
pub mod stats;
mod tree;
pub mod validate;

pub use error::{EngineError, EngineResult};
pub use message::{
    KeySpace, Message, Messages, RangeRename, WriteBatch, KEY_SPACES, MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
};
pub use tree::{TreeOptions, VerifyReport};
mod store;

pub use merge::{MergeRegistry, RecordOp, MERGE_PATCH, MERGE_RECORD, MERGE_TRUNCATE};
pub use stats::StatsSnapshot;
pub use store::{
    FaultObserver, MemoryBesideCache, Options, PairVisitor, RangeIter, RecoveryReport, Reservation,
    Store, TurnHook, WRITE_BACK_HEADROOM_NODES,
};
