//! The Simple File Layer of betreefs (BetrFS 0.6 §3.1, adapted).
//!
//! One image file or block device is split into fixed regions:
//!
//! ```text
//! | superblock A | superblock B | redo log (circular) | node region ... |
//!   block 0        block 1        blocks 2..2+L         the rest
//! ```
//!
//! This crate owns everything about that layout and nothing about the tree:
//! the IO seam ([`Device`], with a file/block-device implementation using
//! `O_DIRECT` and an in-memory implementation that simulates crashes), the
//! two alternating [`Superblock`] copies, the circular redo log
//! ([`LogWriter`], [`replay_log`]) with group commit, and the two-generation
//! [`BlockAllocator`] of BetrFS 0.2 §3 for the node region.
//!
//! Limits: the block size is 4 KiB; one log record carries at most a quarter
//! of the log region; the node region is addressed in 4 KiB blocks with
//! 64-bit numbers. The exact byte layout of every structure is in
//! `docs/format.md` (format version [`FORMAT_VERSION`]).

#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

mod aligned;
mod allocator;
mod bytes;
mod device;
mod error;
mod layout;
mod log;
mod log_buffer;
mod superblock;

pub use aligned::{buffer_pool_bytes, set_buffer_pool_limit, AlignedBuf};
pub use allocator::BlockAllocator;
pub use device::{finishes_within, CrashMode, Device, FileDevice, HeldReads, MemDevice};
pub use error::{StoreError, StoreResult};
pub use layout::{Extent, Layout, BLOCK_SIZE};
pub use log::{
    replay_log, LogBufferUse, LogHole, LogWriter, ReplayEnd, ReplayStart, Room,
    LOG_RECORD_HEADER_BYTES, LOG_RECORD_OVERHEAD_BYTES, LOG_RECORD_TRAILER_BYTES,
};
pub use superblock::{Superblock, SuperblockCopies, FORMAT_VERSION, MAGIC, MAX_TREES};

/// Computes the CRC32C of several byte slices as if they were one.
pub fn crc32c_of(parts: &[&[u8]]) -> u32 {
    parts
        .iter()
        .fold(0u32, |crc, part| crc32c::crc32c_append(crc, part))
}
