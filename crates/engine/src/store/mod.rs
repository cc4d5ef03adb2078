//! The public face of the engine: a durable key-value store over one
//! device, safe to share between threads.
//!
//! Concurrency: one reader-writer lock guards the trees (cache, block
//! table, allocator). Point queries whose path is cached share it; one
//! whose leaf is not cached reads it holding no lock; everything else
//! holds it exclusively — but writes of point messages and range
//! deletes are logged and staged under a small lock of their own and reach the trees in groups
//! (`staging`). The redo log has its own lock, so `sync` (a log
//! flush with group commit) never waits for tree work, and writers only
//! wait for a flush when the log region is full. A background thread
//! flushes the log at least once a `log_flush_interval` and checkpoints
//! every `checkpoint_interval` or when a third of the log is in use; the
//! log flusher writes the log whenever writers have buffered enough;
//! checkpoints encode dirty nodes in turns under the lock and write them
//! without it (docs/design.md, "Checkpoints that do not stop the world").
//!
//! Parts: `write` (a batch's admission, logging, staging, application
//! and the settling after it), `staging` (the staged batches), `read`
//! (leaf visits, range iterators, read-ahead), `checkpoint`, `background`
//! (the checkpointer, the log flusher, the tree flusher, the write-back
//! thread); this file holds
//! the options, the public API and the state they share.

use std::collections::HashSet;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use betreefs_store::{
    replay_log, AlignedBuf, Device, FileDevice, Layout, LogBufferUse, LogHole, LogWriter,
    ReplayStart, StoreError, Superblock, BLOCK_SIZE,
};

use crate::error::{EngineError, EngineResult};
use crate::merge::MergeRegistry;
use crate::message::{KeySpace, Message, WriteBatch, KEY_SPACES};
use crate::node::Node;
use crate::stats::{add, note_max, record_max, Stats, StatsSnapshot};
use crate::tree::readahead::{read_leaf, LeafOnDisk, ReadFor};
pub use crate::tree::PairVisitor;
use crate::tree::{
    DirtyBudget, Flushing, LeafVisited, Shared, SharedBuffer, Tree, TreeOptions, VerifyReport, Want,
};
use crate::validate::{check_batch, check_message};

mod background;
mod checkpoint;
mod read;
mod staging;
mod write;

use background::{start_applier, start_log_flusher, start_tree_flusher, start_write_back};
use read::start_read_ahead;
pub use read::RangeIter;
use staging::{StagedAnswer, StagedBatch, StagedOverlay, Staging};

/// Tunables. The defaults were chosen by measurement on the reference
/// machine (docs/benchmarks/engine-tuning.md).
#[derive(Clone, Debug)]
pub struct Options {
    pub node_size: usize,
    pub basement_size: usize,
    pub fanout: usize,
    pub cache_bytes: usize,
    /// Flush the log at least this often (None: only on `sync`).
    pub log_flush_interval: Option<Duration>,
    /// Checkpoint at least this often (None: only when the log fills, on
    /// `checkpoint` and on close).
    pub checkpoint_interval: Option<Duration>,
    /// Size of the log region when creating a store (None: 1/16 of the
    /// device, clamped to [1 MiB, 512 MiB]).
    pub log_bytes: Option<u64>,
    pub merges: MergeRegistry,
    /// Open without writing a byte: the log is replayed in memory, writes
    /// and checkpoints are refused, the image is opened `O_RDONLY` with a
    /// shared lock (fsck, `mount -o ro`, images on read-only media).
    pub read_only: bool,
    /// Open read-write even when the log has a hole, dropping the records
    /// past it (`fsck --repair --accept-log-loss`); otherwise such an open
    /// fails with [`StoreError::LogHole`].
    pub accept_log_hole: bool,
    /// Read the next leaf ahead of a sequential scan on a thread of its
    /// own (on by default; deterministic tests of IO counts turn it off).
    pub read_ahead: bool,
    /// Bytes of node images a checkpoint encodes in one turn with the tree
    /// lock held (encoding runs at roughly 1 GB/s: 2 MiB is a few
    /// milliseconds). Tests make it small to interleave many turns.
    pub checkpoint_turn_bytes: usize,
    /// Called between a checkpoint's turns, without the tree lock (tests
    /// stop the checkpoint there to write and read in between).
    pub checkpoint_turn_hook: Option<TurnHook>,
    /// While syncs are coming, a background checkpoint and the write-back
    /// of dirty nodes write node images in pieces of at most this many
    /// bytes (a multiple of the block size), letting a sync's log flush go
    /// first between them: an fsync waits behind one piece, not the whole
    /// checkpoint or leaf (512 KiB: 0.3 ms at 1.8 GB/s). Tests make it a
    /// block so that every image goes in several pieces.
    pub write_piece_bytes: usize,
    /// Move messages down the trees on a thread of their own, in turns,
    /// rather than in the writer's thread (see docs/design.md, "Background
    /// flushing"; off by default: on this 2-core reference machine it
    /// neither shortened the longest waits nor sped an untar up —
    /// docs/benchmarks/background-flush.md). Writers wait only when a
    /// root's buffers hold more than the backlog bound.
    pub background_flush: bool,
    /// Dirty nodes the node cache must give up are written back on a
    /// thread of their own: a writer that takes the cache to within
    /// [`WRITE_BACK_HEADROOM_NODES`] nodes of its budget drops clean nodes
    /// and wakes the thread, and writes dirty ones back itself only as far
    /// past the budget.
    /// A writer's own write-back took its request 13-24 ms (encoding and
    /// writing a few 4 MiB leaves) during an untar, the lock let go
    /// meanwhile but the request waiting (docs/benchmarks/write-back-thread.md).
    /// Off in the library by default (tests count evictions where they
    /// happen); the mount daemon turns it on.
    pub background_write_back: bool,
    /// A writer whose batch takes the staged writes past their bound
    /// leaves their application (and the settling and eviction after it)
    /// to a thread of its own, the applier, and returns: only past twice
    /// the bound does a writer apply in its call. A writer that applied
    /// waited for the whole application and every settling step after it
    /// — a WS3 put's longest call, 13-27 ms, where its p99.9 is 20-80 µs
    /// (docs/benchmarks/applier.md). Writers on threads that work after
    /// their replies (`Store::work_after_replies_on_this_thread`) leave
    /// the work for then, as without it. Off in the library by default
    /// (tests count applications where they happen).
    pub background_apply: bool,
    /// Bytes of messages one turn of background flushing moves down with
    /// the tree lock held (a leaf takes them at roughly 300-500 MB/s:
    /// 1 MiB is 2-3 ms). Tests make it small to interleave many turns.
    pub flush_turn_bytes: usize,
    /// Called before each turn of background flushing, without the tree
    /// lock (tests hold the flusher there to fill the backlog).
    pub flush_turn_hook: Option<TurnHook>,
    /// Called between two steps of a writer's settling, without the tree
    /// lock (tests run other requests there).
    pub settle_step_hook: Option<TurnHook>,
    /// Called while a writer works out a step's merge into a leaf, with
    /// the tree lock held upgradable: queries go on, writers wait (tests
    /// run queries there).
    pub step_merge_hook: Option<TurnHook>,
    /// Most point messages one step of a writer's settling moves down (a
    /// step moves a quarter node's bytes otherwise). A quarter node of
    /// small messages (file creations, attribute updates: 20-22K of them)
    /// held the tree lock for 8-10 ms to merge into a leaf, about 400 ns a
    /// message, where a quarter node of file blocks (270 messages) took
    /// 0.3 ms; at most 6,144 keeps a step to a few milliseconds whatever
    /// the messages' size (docs/benchmarks/step-messages.md). Tests make
    /// it small.
    pub settle_step_messages: usize,
    /// Called while a writer's eviction writes a dirty node back, before
    /// the device write, without the tree lock (tests run other requests
    /// there).
    pub evict_step_hook: Option<TurnHook>,
    /// Called while a writer's eviction encodes a dirty node's image,
    /// without the tree lock (tests change the node there).
    pub evict_encode_hook: Option<TurnHook>,
    /// Writes of point messages (puts, deletes, upserts) and range deletes
    /// are logged and staged without the tree lock, and applied to the trees together
    /// under one hold of it once this many bytes are staged (or sooner,
    /// when a query or checkpoint needs them there): queries run beside
    /// writers (`store/staging.rs`). At most a quarter node counts; 0:
    /// every write holds the tree lock.
    pub staged_write_bytes: usize,
    /// Bytes of the trees' upper levels read into the cache at open, from
    /// the roots down (docs/design.md, "Warm upper levels"): a cold query
    /// after the open then reads only below them. 0 (the library's
    /// default: tests count reads): none; the mount daemon reads a
    /// sixteenth of its cache budget at most.
    pub warm_bytes: usize,
    /// The longest the open spends on that (1 s): 16 MiB took 60 ms on the
    /// reference machine, but a disk that seeks would take seconds for the
    /// leaves' metas, read a block at a time.
    pub warm_time: Duration,
}

/// See [`Options::checkpoint_turn_hook`].
#[derive(Clone)]
pub struct TurnHook(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for TurnHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TurnHook")
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            node_size: 4 << 20,
            basement_size: 128 << 10,
            fanout: 16,
            cache_bytes: 256 << 20,
            log_flush_interval: Some(Duration::from_secs(1)),
            checkpoint_interval: Some(Duration::from_secs(60)),
            log_bytes: None,
            merges: MergeRegistry::default(),
            read_only: false,
            accept_log_hole: false,
            read_ahead: true,
            checkpoint_turn_bytes: 2 << 20,
            checkpoint_turn_hook: None,
            write_piece_bytes: 512 << 10,
            background_flush: false,
            background_write_back: false,
            background_apply: false,
            flush_turn_bytes: 1 << 20,
            flush_turn_hook: None,
            settle_step_hook: None,
            step_merge_hook: None,
            settle_step_messages: 6 << 10,
            evict_step_hook: None,
            evict_encode_hook: None,
            staged_write_bytes: 1 << 20,
            warm_bytes: 0,
            warm_time: Duration::from_secs(1),
        }
    }
}

impl Options {
    fn validate(&self) -> EngineResult<()> {
        let bad = |s: String| Err(EngineError::InvalidOption(s));
        if !(16 << 10..=64 << 20).contains(&self.node_size) {
            return bad(format!(
                "node_size {} must be within [16 KiB, 64 MiB]",
                self.node_size
            ));
        }
        if self.basement_size < 1024 || self.basement_size > self.node_size {
            return bad(format!(
                "basement_size {} must be within [1 KiB, node_size]",
                self.basement_size
            ));
        }
        if self.settle_step_messages == 0 {
            return bad("settle_step_messages must be positive".into());
        }
        if !(4..=1024).contains(&self.fanout) {
            return bad(format!("fanout {} must be within [4, 1024]", self.fanout));
        }
        if self.warm_bytes > self.cache_bytes / 2 {
            return bad(format!(
                "warm_bytes {} must be at most half of cache_bytes {}",
                self.warm_bytes, self.cache_bytes
            ));
        }
        if self.cache_bytes < 4 * self.node_size {
            return bad(format!(
                "cache_bytes {} must hold at least four nodes",
                self.cache_bytes
            ));
        }
        let block = betreefs_store::BLOCK_SIZE;
        if self.write_piece_bytes < block || !self.write_piece_bytes.is_multiple_of(block) {
            return bad(format!(
                "write_piece_bytes {} must be a positive multiple of {block}",
                self.write_piece_bytes
            ));
        }
        Ok(())
    }

    /// The staged bytes past which a writer applies what is staged:
    /// [`Options::staged_write_bytes`], at most a quarter node (the roots
    /// take it all at once).
    fn staging_bound(&self) -> usize {
        self.staged_write_bytes.min(self.node_size / 4)
    }

    fn tree_options(&self) -> TreeOptions {
        TreeOptions {
            node_size: self.node_size,
            basement_size: self.basement_size,
            fanout: self.fanout,
            cache_bytes: self.cache_bytes,
            settle_step_messages: self.settle_step_messages,
        }
    }
}

/// The most unflushed log bytes at which the log flusher writes the log
/// without waiting for its interval (see [`log_flush_eager_bytes`]). Each
/// flush ends with a device cache flush, ~10 ms on the reference
/// machine's loop device behind a checkpoint's writes: at 4 MiB a 2 GiB
/// sequential write spent ~4 of its ~9 s in them; at 16 MiB it runs
/// 215-235 → 279-321 MB/s (docs/benchmarks/log-flush-bound.md).
const LOG_FLUSH_EAGER_MAX_BYTES: u64 = 16 << 20;

/// Unflushed log bytes at which the log flusher writes the log without
/// waiting for its interval: bounds the memory a burst of writes holds,
/// which the cache's clean nodes make room for (`Tree::clean_budget`) —
/// but in a sequential write nearly every node is dirty, so the buffer
/// must also be small beside the budget: an eighth of the cache's, at
/// least 1 MiB and at most [`LOG_FLUSH_EAGER_MAX_BYTES`] (the default
/// 256 MiB budget gets the most; a 64 MiB one, 5 MiB).
fn log_flush_eager_bytes(cache_bytes: usize) -> u64 {
    (cache_bytes as u64 / 8).clamp(1 << 20, LOG_FLUSH_EAGER_MAX_BYTES)
}

/// Chunks of the log's buffer kept for the next appends once written (see
/// `crates/store/src/log_buffer.rs`): what one eager flush frees, so that a
/// stream of appends reuses them, but no more than an eighth of the cache,
/// whose budget counts them.
fn log_spare_bytes(cache_bytes: usize) -> usize {
    let eager = usize::try_from(log_flush_eager_bytes(cache_bytes)).unwrap_or(usize::MAX);
    eager.min(cache_bytes / 8)
}

/// Unflushed log bytes at which a writer flushes the log itself (twice
/// the eager bound): the log flusher is behind (the device is busy with
/// a checkpoint's writes, or the store has no log flusher), and the log's buffer
/// would otherwise grow by everything written meanwhile — hundreds of MiB
/// in a sequential write.
fn log_flush_writer_bytes(cache_bytes: usize) -> u64 {
    2 * log_flush_eager_bytes(cache_bytes)
}

#[derive(Default)]
struct BackgroundState {
    shutdown: bool,
    checkpoint_wanted: bool,
    flush_wanted: bool,
    /// A root's buffers hold more than a node's worth: the tree flusher
    /// has work.
    tree_flush_wanted: bool,
    /// The node cache is over its budget: the write-back thread has work.
    write_back_wanted: bool,
    /// A writer took the staged writes past their bound: the applier has
    /// work.
    apply_wanted: bool,
    /// Writers buffered more of the log than the eager bound: the log
    /// flusher has work.
    log_flush_wanted: bool,
}

/// With the write-back thread ([`Options::background_write_back`]): how
/// far below its budget, in nodes, the thread keeps the node cache, and
/// how far past it the cache may go before a writer writes dirty nodes
/// back itself. The thread starts before writers would have, so the
/// cache, and the daemon's memory, stay where they were; the writer's
/// own write-back is for a thread that falls behind.
pub const WRITE_BACK_HEADROOM_NODES: usize = 1;

/// What opening a store found in its log and superblocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Log records replayed on top of the checkpoint.
    pub replayed_records: u64,
    /// A hole in the log: acknowledged records past it were not replayed.
    pub hole: Option<LogHole>,
    /// Why one superblock copy was unusable (recovery used the other).
    pub damaged_superblock: Option<String>,
}

struct Inner {
    /// The device the trees live on, for reads and writes made without
    /// the tree lock (leaves read outside it, a checkpoint's images).
    device: Arc<dyn Device>,
    /// Shared by queries that find their whole path cached ([`Store::get`],
    /// [`Store::visit_range`], [`Store::range`]) and by the read-ahead
    /// thread's walks; exclusive for everything else. The paths that
    /// must checkpoint while they hold it wait for a checkpoint in flight
    /// through `checkpoint_ended` without giving up their guard.
    tree: parking_lot::RwLock<Tree>,
    checkpoint_ended: TreeEvent,
    log: LogWriter,
    stats: Arc<Stats>,
    merges: Arc<MergeRegistry>,
    failure: Mutex<Option<String>>,
    /// Whether `failure` is set: every write checks it, and a lock taken
    /// by every write on both cores costs the cache line's trip between
    /// them each time (tokubench's two clients).
    failed: std::sync::atomic::AtomicBool,
    background: Mutex<BackgroundState>,
    wake: Condvar,
    options: Options,
    recovery: RecoveryReport,
    /// Writes refused for now (a remount read-only of a store opened
    /// read-write): see [`Store::set_writes_refused`].
    writes_refused: std::sync::atomic::AtomicBool,
    /// Bytes promised to writes not yet made ([`Reservation`]); changed
    /// only under the tree lock, with the write that changes it.
    promised_bytes: AtomicU64,
    /// How many batches were applied ([`Store::batches_applied`]).
    batches_applied: AtomicU64,
    /// Told of every device fault ([`Store::set_fault_observer`]).
    fault_observer: Mutex<Option<FaultObserver>>,
    /// Where sequential scans hand the read-ahead planner the next leaf to
    /// read (None without one, or once it is stopped).
    read_ahead: Mutex<Option<ReadAheadSender>>,
    /// Leaves the read-ahead readers are reading or about to read: a scan
    /// that reaches one waits for it ([`Inner::wait_for_read_ahead`])
    /// rather than read it a second time.
    reading_ahead: Mutex<HashSet<u64>>,
    read_ahead_landed: Condvar,
    /// For each tree, where the basements a query last read from the
    /// device ended (None past the tree's last key): a read that begins
    /// there is sequential ([`Inner::note_query_read`]).
    query_read_ends: Mutex<[Option<Vec<u8>>; KEY_SPACES]>,
    /// Wakes the tree flusher (with `background`).
    tree_flush_wake: Condvar,
    /// Signalled after every turn of the tree flusher: writers past the
    /// backlog bound wait on it.
    flush_progress: TreeEvent,
    /// The tree flusher runs: writers may leave messages in the roots and
    /// wait for it past the backlog bound.
    tree_flusher_running: std::sync::atomic::AtomicBool,
    /// Wakes the write-back thread (with `background_write_back`).
    write_back_wake: Condvar,
    /// The write-back thread runs: writers leave dirty nodes to it.
    write_back_running: std::sync::atomic::AtomicBool,
    /// Wakes the applier (with `background_apply`).
    applier_wake: Condvar,
    /// The applier runs: writers past the staging bound leave the
    /// application to it.
    applier_running: std::sync::atomic::AtomicBool,
    /// Writers waiting for room in the staged batches (with the applier;
    /// `Inner::wait_for_staging_room`), the lock they wait under and what
    /// wakes them (an application's take).
    staging_room_waiters: std::sync::atomic::AtomicUsize,
    staging_room_lock: Mutex<()>,
    staging_room: Condvar,
    /// Wakes the log flusher.
    log_flush_wake: Condvar,
    /// The log flusher runs: writers leave eager log flushes to it.
    log_flusher_running: std::sync::atomic::AtomicBool,
    /// Batches logged but not yet applied to the trees, and the next
    /// sequence number (`store/staging.rs`). Taken inside the tree lock,
    /// never the other way round.
    staging: parking_lot::RwLock<Staging>,
    /// Whether space is ample enough that a write may be staged without
    /// the tree's space check: set by whoever applies batches, under the
    /// tree lock, with the staged bytes' worth to spare.
    space_ample: std::sync::atomic::AtomicBool,
    /// A write on a thread that works after its replies
    /// ([`Store::work_after_replies_on_this_thread`]) left work for then:
    /// the staged batches past the bound to apply, the buffers to settle
    /// and the cache to evict ([`Store::work_after_reply`]).
    work_after_reply: std::sync::atomic::AtomicBool,
    /// The work left for after replies includes a staged range rename (a
    /// surgery: up to tens of milliseconds under the tree lock),
    /// better done by a thread that serves no request
    /// ([`Store::work_after_reply_is_long`]). A hint, cleared when the
    /// work begins.
    work_after_reply_is_long: std::sync::atomic::AtomicBool,
    /// Whether a writer is working out a step's merge into a leaf with the
    /// tree lock let go ([`write::StepMergeClaim`]).
    step_merge_in_flight: std::sync::atomic::AtomicBool,
    /// The process is near its memory limit ([`Store::set_memory_short`]).
    memory_short: std::sync::atomic::AtomicBool,
}

/// Where a leaf to read ahead begins, and in which tree.
type ReadAheadSender = std::sync::mpsc::Sender<(KeySpace, Vec<u8>)>;

/// What [`Store::set_fault_observer`] installs: called with the error and
/// whether the store now refuses writes.
pub type FaultObserver = Arc<dyn Fn(&EngineError, bool) + Send + Sync>;

/// Space a write promises to later writes, or gives back.
///
/// A file system that preallocates (fallocate) promises space without
/// writing: the store counts the promise as used, so other writes are
/// refused before they could take it, and a later write that draws on it
/// (`release`) is checked against a smaller copy-on-write reserve (see
/// `Tree::space_low`). The store does not remember promises across opens:
/// whoever made them persists them and sets the total again with
/// [`Store::set_promised_bytes`] after opening.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reservation {
    /// Bytes newly promised: the write is refused with `NoSpace` unless
    /// they fit beside everything used and promised already.
    pub take: u64,
    /// Bytes of earlier promises this write uses up or gives back.
    pub release: u64,
}

/// A durable B^ε-tree key-value store with two key spaces.
pub struct Store {
    inner: Arc<Inner>,
    worker: Option<JoinHandle<()>>,
    tree_flusher: Option<JoinHandle<()>>,
    write_back_thread: Option<JoinHandle<()>>,
    applier: Option<JoinHandle<()>>,
    log_flusher: Option<JoinHandle<()>>,
    read_ahead_threads: Vec<JoinHandle<()>>,
    closed: bool,
}

fn fresh_epoch() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u32);
    (nanos ^ (std::process::id() << 16)).max(1)
}

impl Store {
    /// Formats `path` (a new sparse file of `size` bytes, or the first
    /// `size` bytes of an existing block device) and opens the empty store.
    pub fn create(path: &Path, size: u64, options: Options) -> EngineResult<Store> {
        use std::os::unix::fs::FileTypeExt;
        let is_block_device =
            std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
        let device = if is_block_device {
            FileDevice::open(path).map(|d| d.limited_to(size))
        } else {
            FileDevice::create_file(path, size)
        }
        .map_err(|e| StoreError::io("creating image", e))?;
        Self::create_on(Arc::new(device), options)
    }

    /// Opens an existing store, recovering from its newest checkpoint and log.
    pub fn open(path: &Path, options: Options) -> EngineResult<Store> {
        let device = if options.read_only {
            FileDevice::open_read_only(path)
        } else {
            FileDevice::open(path)
        }
        .map_err(|e| StoreError::io("opening image", e))?;
        Self::open_on(Arc::new(device), options)
    }

    /// Formats any device.
    pub fn create_on(device: Arc<dyn Device>, options: Options) -> EngineResult<Store> {
        options.validate()?;
        let layout = Layout::plan(device.len_bytes(), options.log_bytes)?;
        if layout.nodes_bytes < 8 * options.node_size as u64 {
            return Err(EngineError::InvalidOption(format!(
                "a {} byte node region is too small for {} byte nodes",
                layout.nodes_bytes, options.node_size
            )));
        }
        // Old superblocks or log records of a previous image must not survive.
        device
            .write_at(&AlignedBuf::zeroed(3 * BLOCK_SIZE), 0)
            .map_err(|e| StoreError::io("wiping superblocks", e))?;
        let stats = Arc::new(Stats::default());
        let merges = Arc::new(options.merges.clone());
        let tree = Tree::create(
            device.clone(),
            layout,
            options.tree_options(),
            merges.clone(),
            stats.clone(),
        );
        let log = LogWriter::new(
            device.clone(),
            layout.log_offset,
            layout.log_bytes,
            fresh_epoch(),
            0,
        )?;
        let recovery = RecoveryReport::default();
        let store = Self::assemble(device, tree, log, stats, merges, options, recovery);
        store.checkpoint_both_copies()?;
        Ok(store)
    }

    /// Opens any device holding a store.
    pub fn open_on(device: Arc<dyn Device>, options: Options) -> EngineResult<Store> {
        options.validate()?;
        if options.read_only && options.accept_log_hole {
            return Err(EngineError::InvalidOption(
                "accepting a log hole needs a read-write open".into(),
            ));
        }
        let copies = Superblock::read_copies(device.as_ref())?;
        let sb = copies.newest;
        let stats = Arc::new(Stats::default());
        let merges = Arc::new(options.merges.clone());
        let mut tree = Tree::open(
            device.clone(),
            &sb,
            options.tree_options(),
            merges.clone(),
            stats.clone(),
        )?;
        tree.read_only = options.read_only;
        let layout = sb.layout;
        // After a clean close nothing follows the checkpoint; otherwise (or
        // when the other superblock copy, perhaps the newer, is unusable)
        // replay looks past its end for proof of a hole.
        let start = ReplayStart {
            head: sb.log_head,
            epoch: sb.log_epoch,
            first_seq: sb.checkpoint_seq + 1,
            look_beyond: !sb.clean || copies.damaged.is_some(),
        };
        let mut replay_error: Option<EngineError> = None;
        let replayed = replay_log(
            device.as_ref(),
            layout.log_offset,
            layout.log_bytes,
            &start,
            |seq, payload| {
                let applied = WriteBatch::decode(payload)
                    .map_err(|e| EngineError::CorruptLogRecord { seq, reason: e.0 })
                    .and_then(|batch| {
                        check_batch(&batch, &merges).map_err(|e| {
                            EngineError::CorruptLogRecord {
                                seq,
                                reason: e.to_string(),
                            }
                        })?;
                        tree.next_seq = seq + 1;
                        tree.apply_batch(seq, &batch, Flushing::Inline)?;
                        match tree.evict_if_needed() {
                            Err(e) if !e.is_no_space() => Err(e),
                            _ => Ok(()),
                        }
                    });
                applied.map_err(|e| {
                    replay_error = Some(e);
                    StoreError::Failed("log replay stopped".into())
                })
            },
        );
        let end = match (replayed, replay_error) {
            (_, Some(e)) => return Err(e),
            (Err(e), None) => return Err(e.into()),
            (Ok(end), None) => end,
        };
        if let Some(hole) = &end.hole {
            if !(options.read_only || options.accept_log_hole) {
                return Err(StoreError::LogHole(hole.clone()).into());
            }
            tracing::error!("the redo log has a hole; records past it are not replayed: {hole}");
        }
        add(&stats.log_replayed_records, end.records);
        tree.next_seq = end.next_seq;
        let recovery = RecoveryReport {
            replayed_records: end.records,
            hole: end.hole.clone(),
            damaged_superblock: copies.damaged,
        };
        // A new epoch: records of the crashed run that lie beyond the end
        // of replay must never be mistaken for new ones.
        let epoch = sb.log_epoch.wrapping_add(1).max(1);
        let log = LogWriter::new(
            device.clone(),
            layout.log_offset,
            layout.log_bytes,
            epoch,
            end.end_pos,
        )?;
        if options.warm_bytes > 0 {
            // A node that fails to read here is reported by the query that
            // needs it; the open goes on without the rest.
            let until = std::time::Instant::now() + options.warm_time;
            if let Err(e) = tree.warm_upper_levels(options.warm_bytes as u64, until) {
                tracing::warn!("warming the upper levels stopped: {e}");
            }
        }
        let read_only = options.read_only;
        let store = Self::assemble(device, tree, log, stats, merges, options, recovery);
        if !read_only {
            store.checkpoint_both_copies()?;
        }
        Ok(store)
    }

    /// Two checkpoints in a row, before the store accepts a write: both
    /// superblock copies then name the current log epoch, so whichever copy
    /// survives finds every record the epoch appends.
    fn checkpoint_both_copies(&self) -> EngineResult<()> {
        self.checkpoint()?;
        self.checkpoint()
    }

    /// What the open found in the log and the superblocks.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.inner.recovery
    }

    /// Whether the store was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.inner.options.read_only
    }

    /// Refuses writes from now on (`ReadOnly`) and checkpoints, so that
    /// the image is complete without its log, as after an unmount; or
    /// takes writes again. What a remount read-only and back does. A
    /// store opened read-only cannot take writes (`ReadOnly`).
    pub fn set_writes_refused(&self, refused: bool) -> EngineResult<()> {
        use std::sync::atomic::Ordering;
        if !refused {
            if self.is_read_only() {
                return Err(EngineError::ReadOnly);
            }
            self.inner.writes_refused.store(false, Ordering::SeqCst);
            return Ok(());
        }
        let was = self.inner.writes_refused.swap(true, Ordering::SeqCst);
        if was || self.is_read_only() {
            return Ok(());
        }
        self.checkpoint()
    }

    /// Whether writes are refused for now ([`Store::set_writes_refused`]).
    pub fn writes_refused(&self) -> bool {
        self.inner
            .writes_refused
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    fn assemble(
        device: Arc<dyn Device>,
        tree: Tree,
        log: LogWriter,
        stats: Arc<Stats>,
        merges: Arc<MergeRegistry>,
        options: Options,
        recovery: RecoveryReport,
    ) -> Store {
        let staging = Staging::new(tree.next_seq);
        log.set_spare_limit(log_spare_bytes(options.cache_bytes));
        let inner = Arc::new(Inner {
            device,
            tree: parking_lot::RwLock::new(tree),
            checkpoint_ended: TreeEvent::default(),
            log,
            stats,
            merges,
            failure: Mutex::new(None),
            failed: std::sync::atomic::AtomicBool::new(false),
            background: Mutex::new(BackgroundState::default()),
            wake: Condvar::new(),
            options,
            recovery,
            writes_refused: std::sync::atomic::AtomicBool::new(false),
            promised_bytes: AtomicU64::new(0),
            batches_applied: AtomicU64::new(0),
            fault_observer: Mutex::new(None),
            read_ahead: Mutex::new(None),
            reading_ahead: Mutex::new(HashSet::new()),
            read_ahead_landed: Condvar::new(),
            query_read_ends: Mutex::new([None, None]),
            tree_flush_wake: Condvar::new(),
            flush_progress: TreeEvent::default(),
            tree_flusher_running: std::sync::atomic::AtomicBool::new(false),
            write_back_wake: Condvar::new(),
            applier_wake: Condvar::new(),
            applier_running: std::sync::atomic::AtomicBool::new(false),
            staging_room_waiters: std::sync::atomic::AtomicUsize::new(0),
            staging_room_lock: Mutex::new(()),
            staging_room: Condvar::new(),
            write_back_running: std::sync::atomic::AtomicBool::new(false),
            log_flush_wake: Condvar::new(),
            log_flusher_running: std::sync::atomic::AtomicBool::new(false),
            staging: parking_lot::RwLock::new(staging),
            space_ample: std::sync::atomic::AtomicBool::new(false),
            work_after_reply: std::sync::atomic::AtomicBool::new(false),
            work_after_reply_is_long: std::sync::atomic::AtomicBool::new(false),
            step_merge_in_flight: std::sync::atomic::AtomicBool::new(false),
            memory_short: std::sync::atomic::AtomicBool::new(false),
        });
        if !inner.options.read_only {
            // As an application would: the first writes may be staged.
            inner.note_space(&inner.lock_tree());
        }
        let read_ahead_threads = if inner.options.read_ahead {
            start_read_ahead(&inner)
        } else {
            Vec::new()
        };
        let needs_worker = !inner.options.read_only
            && (inner.options.log_flush_interval.is_some()
                || inner.options.checkpoint_interval.is_some());
        let worker = needs_worker.then(|| {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name("betreefs-flusher".into())
                .spawn(move || inner.run_background())
        });
        let worker = match worker {
            Some(Ok(handle)) => Some(handle),
            Some(Err(e)) => {
                tracing::error!(
                    "could not start the background flusher: {e}; relying on explicit syncs"
                );
                None
            }
            None => None,
        };
        let tree_flusher = if inner.options.background_flush && !inner.options.read_only {
            start_tree_flusher(&inner)
        } else {
            None
        };
        let write_back_thread = if inner.options.background_write_back && !inner.options.read_only {
            start_write_back(&inner)
        } else {
            None
        };
        let applier = if inner.options.background_apply && !inner.options.read_only {
            start_applier(&inner)
        } else {
            None
        };
        let log_flusher = if needs_worker {
            start_log_flusher(&inner)
        } else {
            None
        };
        Store {
            inner,
            worker,
            tree_flusher,
            write_back_thread,
            applier,
            log_flusher,
            read_ahead_threads,
            closed: false,
        }
    }

    pub fn put(&self, ks: KeySpace, key: &[u8], value: &[u8]) -> EngineResult<u64> {
        self.write(WriteBatch::new().put(ks, key, value))
    }

    pub fn delete(&self, ks: KeySpace, key: &[u8]) -> EngineResult<u64> {
        self.write(WriteBatch::new().delete(ks, key))
    }

    /// Blind read-modify-write with merge function `func` (see [`crate::merge`]).
    pub fn upsert(&self, ks: KeySpace, key: &[u8], func: u8, arg: &[u8]) -> EngineResult<u64> {
        self.write(WriteBatch::new().upsert(ks, key, func, arg))
    }

    /// Deletes every key in [start, end).
    pub fn range_delete(&self, ks: KeySpace, start: &[u8], end: &[u8]) -> EngineResult<u64> {
        self.write(WriteBatch::new().range_delete(ks, start, end))
    }

    /// Applies a batch atomically; returns its sequence number. Visible to
    /// readers on return, durable after the next [`Store::sync`] (or log
    /// flush interval).
    pub fn write(&self, batch: &WriteBatch) -> EngineResult<u64> {
        self.inner.write(batch, Reservation::default())
    }

    /// Writes made on the calling thread from now on leave the work that
    /// follows a write in the writer's request — applying the staged
    /// batches once past their bound, settling the buffers, evicting — to
    /// [`Store::work_after_reply`], which the thread promises will be
    /// called once the replies to the requests it served are on their way
    /// (a FUSE serving thread: by itself, or by a thread of its own it
    /// hands the work to): the client goes on with its next request while
    /// the daemon applies. A write leaves at most one such piece of work
    /// pending; the next one past it does its work itself, as do writes
    /// on every other thread, so the buffers stay bounded.
    pub fn work_after_replies_on_this_thread(&self) {
        write::work_after_replies_on_this_thread();
    }

    /// The calling thread (one that works after its replies) hands work
    /// flagged long ([`Store::work_after_reply_is_long`]) to a thread of
    /// its own: a settling step it would take that must first read its
    /// leaf from the device is left for that thread instead — flagged
    /// pending and long — so the requests on its queue do not wait for
    /// the read (docs/design.md, "Who does it").
    pub fn hand_long_work_on_from_this_thread(&self) {
        write::hand_long_work_on_from_this_thread();
    }

    /// Whether a write left work for [`Store::work_after_reply`].
    pub fn has_work_after_reply(&self) -> bool {
        self.inner.work_after_reply.load(Ordering::Acquire)
    }

    /// Whether the work left for after replies is long (a staged rename's
    /// surgery): a transport serving requests on the thread
    /// that would do it hands it to a thread of its own instead, so the
    /// requests that come meanwhile are not held behind it.
    pub fn work_after_reply_is_long(&self) -> bool {
        self.inner.work_after_reply_is_long.load(Ordering::Acquire)
    }

    /// Does the work writes left for after their replies, if any (see
    /// [`Store::work_after_replies_on_this_thread`]). An error is the
    /// store's failure, which later writes and syncs report too.
    pub fn work_after_reply(&self) -> EngineResult<()> {
        self.inner.work_after_reply()
    }

    /// [`Store::write`] that also changes the space promised to later
    /// writes, atomically with the batch (see [`Reservation`]).
    pub fn write_reserving(
        &self,
        batch: &WriteBatch,
        reservation: Reservation,
    ) -> EngineResult<u64> {
        self.inner.write(batch, reservation)
    }

    /// Sets the space promised to later writes (after opening: the store
    /// keeps no record of promises itself).
    pub fn set_promised_bytes(&self, bytes: u64) {
        let tree = self.inner.lock_tree();
        self.inner.promised_bytes.store(bytes, Ordering::Relaxed);
        self.inner.note_space(&tree);
    }

    /// Calls `observer` on every device fault the store meets (see
    /// [`EngineError::is_device_fault`]): a read that fails, and the first
    /// failure after which the store refuses writes (the flag). It may be
    /// called with the store's locks held, so it must not call back into
    /// the store (hand the work to a thread of its own).
    pub fn set_fault_observer(&self, observer: FaultObserver) {
        *self
            .inner
            .fault_observer
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(observer);
    }

    /// A point query. Reads go on after a failure that refuses writes:
    /// they see what the store holds in memory and on the device.
    ///
    /// A query whose path is cached runs on the shared tree lock, beside
    /// other such queries. One that finds only its leaf uncached (or
    /// cached without the basement it needs) reads what it needs holding
    /// no lock, then caches it under the exclusive lock (if the tree still
    /// names that leaf there, as it was); anything
    /// else — an interior node to read, a node to re-key, a read that
    /// failed (read again, to report) — is done under the exclusive lock.
    ///
    /// Writes staged and not yet applied ([`Options::staged_write_bytes`])
    /// are read first, without the tree lock: when they decide the key (a
    /// put or a delete among them) they answer; upserts onto the trees'
    /// value are applied, and read again, in the hold of the tree lock
    /// that reads the trees.
    pub fn get(&self, ks: KeySpace, key: &[u8]) -> EngineResult<Option<Vec<u8>>> {
        // A key the staged batches decide needs no tree lock: such a
        // query goes on while someone holds it exclusively. One they do
        // not touch is answered by the trees alone: a write staged since
        // is one this query overlaps, and either answer is right (only
        // upserts, combined with the trees' value, need both read in one
        // hold of the tree lock — the exclusive path below).
        let staged = self.inner.staging.read().lookup(ks, key);
        let shared = match staged {
            StagedAnswer::Found(value) => {
                add(&self.inner.stats.queries_answered_staged, 1);
                return Ok(value);
            }
            StagedAnswer::NeedsTrees => Shared::Exclusive,
            // The shared guard ends with this statement: errors are
            // reported (to the fault observer, which may call back)
            // holding no lock.
            StagedAnswer::NotStaged => self.inner.tree.read().get_cached(ks, key),
        };
        let mut tree = match shared {
            Shared::Answer(value) => return value.map_err(|e| self.inner.read_failed(e)),
            // A read-ahead reader reading the leaf: waited for, then
            // looked up under the lock, the leaf most likely cached.
            Shared::ReadLeaf(place) if self.inner.wait_for_read_ahead(place.num) => {
                self.inner.lock_tree()
            }
            Shared::ReadLeaf(place) => {
                self.inner
                    .read_leaf_unlocked(&place, Want::Key(key), ReadFor::Query)
            }
            Shared::Exclusive => self.inner.lock_tree(),
        };
        // The lock was let go: what was staged since is read again, in
        // this hold, and upserts onto the trees' value are applied first
        // (their settling lets the lock go between steps: again).
        loop {
            let staged = self.inner.staging.read().lookup(ks, key);
            match staged {
                StagedAnswer::Found(value) => {
                    add(&self.inner.stats.queries_answered_staged, 1);
                    return Ok(value);
                }
                StagedAnswer::NeedsTrees => {
                    let wants_tree_flush = self.inner.apply_staged(&mut tree)?;
                    if wants_tree_flush {
                        self.inner.want_tree_flush();
                    }
                }
                StagedAnswer::NotStaged => break,
            }
        }
        let value = tree.get(ks, key);
        tree.evict_clean_if_needed();
        value.map_err(|e| self.inner.read_failed(e))
    }

    /// How many batches were written since the store was opened. A
    /// caller whose writes all hold one lock of its own can read this,
    /// let its lock go, query, take the lock and read this again: the
    /// same count says none of its writes came between, so what the query
    /// found is what the store holds (the file system's lookups query
    /// without its table's lock on that condition).
    pub fn batches_applied(&self) -> u64 {
        self.inner.batches_applied.load(Ordering::Acquire)
    }

    /// Iterates [start, end) in key order (`end == None`: to the last key).
    /// Each leaf's worth of results is read atomically; writes made while
    /// iterating may or may not be seen in later leaves.
    pub fn range(&self, ks: KeySpace, start: &[u8], end: Option<&[u8]>) -> RangeIter<'_> {
        RangeIter {
            store: self,
            ks,
            next: Some(start.to_vec()),
            end: end.map(|e| e.to_vec()),
            chunk: Vec::new().into_iter(),
        }
    }

    /// Calls `visit` on every pair of [start, end) in key order, borrowing
    /// keys and values from the tree (no copy of a pair when nothing is
    /// pending above its leaf). Each leaf's worth is visited under the tree
    /// lock, atomically, like [`Store::range`] — the shared lock when the
    /// leaf and the path to it are cached, so that such visits and point
    /// queries run side by side; `visit` must not call back into the store.
    pub fn visit_range(
        &self,
        ks: KeySpace,
        start: &[u8],
        end: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]),
    ) -> EngineResult<()> {
        self.visit_range_while(ks, start, end, &mut |k, v| {
            visit(k, v);
            ControlFlow::Continue(())
        })
    }

    /// [`Store::visit_range`] until `visit` breaks: it is called for no
    /// pair after that, and no leaf past the one it broke in is read (a
    /// caller taking the first few pairs of a long range pays for the
    /// leaves it needs, not the range).
    pub fn visit_range_while(
        &self,
        ks: KeySpace,
        start: &[u8],
        end: &[u8],
        visit: &mut PairVisitor<'_>,
    ) -> EngineResult<()> {
        let mut next = Some(start.to_vec());
        while let Some(from) = next {
            if from.as_slice() >= end {
                break;
            }
            next = self.inner.visit_one_leaf(ks, &from, Some(end), visit)?;
        }
        Ok(())
    }

    /// Makes every write that returned before this call durable.
    pub fn sync(&self) -> EngineResult<()> {
        self.inner.check_failed()?;
        if self.is_read_only() {
            return Ok(());
        }
        self.inner
            .flush_log(true)
            .map_err(|e| self.inner.poison(e.into()))
    }

    /// Pushes every buffered message down to the leaves (and merges the
    /// leaves it empties), then checkpoints. Frees the space of pending
    /// deletes; costs a pass over every node that holds messages.
    pub fn compact(&self) -> EngineResult<()> {
        self.inner.check_writable()?;
        let mut tree = self.inner.lock_tree();
        self.inner.wait_for_checkpoint(&mut tree);
        self.inner.check_failed()?;
        self.inner.apply_staged_now(&mut tree)?;
        tree.flush_everything().map_err(|e| self.inner.poison(e))?;
        self.inner.checkpoint_locked(&mut tree)
    }

    /// Writes a checkpoint now; the log before it becomes reusable.
    pub fn checkpoint(&self) -> EngineResult<()> {
        self.inner.checkpoint()
    }

    /// A handle through which the store's user reports the memory its
    /// own tables hold: the node cache makes room for it, so that one
    /// budget (`Options::cache_bytes`) covers both.
    pub fn memory_beside_cache(&self) -> MemoryBesideCache {
        MemoryBesideCache(self.inner.stats.clone(), Beside::Tables)
    }

    /// A handle through which the store's user reports what the process's
    /// allocator holds beyond the bytes allocated — pages freed and not
    /// yet given back, size-class slack — which the node cache makes room
    /// for as well: the budget is the process's resident size, and a
    /// cache that churns through megabyte images leaves tens of megabytes
    /// of such pages behind it (docs/design.md, "One memory budget for
    /// the mount daemon").
    pub fn allocator_overhead(&self) -> MemoryBesideCache {
        MemoryBesideCache(self.inner.stats.clone(), Beside::Allocator)
    }

    /// Tells the store whether its process is near its memory limit
    /// (the mount daemon's memory watch, when that changes). While it
    /// is, the log's buffer keeps no spare chunks (freed at once), and
    /// the write-back thread — woken now, then by the writers that find
    /// the cache past the budget — writes dirty nodes back until the
    /// cache is within the clean nodes' budget, so that the memory beside the
    /// cache — the allocator's free pages, the log's buffer, a
    /// checkpoint's images — is made room for even when the cache is
    /// nearly all dirty (a file of tens of megabytes written before its
    /// fsync), where clean nodes alone cannot make it
    /// (docs/benchmarks/memory-short.md).
    pub fn set_memory_short(&self, short: bool) {
        if self.inner.memory_short.swap(short, Ordering::SeqCst) == short {
            return;
        }
        let spares = if short {
            0
        } else {
            log_spare_bytes(self.inner.options.cache_bytes)
        };
        self.inner.log.set_spare_limit(spares);
        self.inner.note_log_buffer();
        if short && !self.inner.options.read_only {
            self.inner.want_write_back();
        }
    }

    /// The counters, with derived totals.
    pub fn stats(&self) -> StatsSnapshot {
        self.inner.stats_snapshot()
    }

    /// Verifies every node of both trees (checksums, order, bounds,
    /// heights) and finds nodes no tree reaches.
    pub fn verify(&self) -> EngineResult<VerifyReport> {
        let mut tree = self.inner.lock_tree();
        let report = tree.verify();
        tree.evict_clean_if_needed();
        report
    }

    /// Frees nodes the block table holds but no tree reaches (fsck's
    /// repair of leaked space), then checkpoints.
    pub fn free_unreachable_nodes(&self) -> EngineResult<u64> {
        self.inner.check_writable()?;
        let mut tree = self.inner.lock_tree();
        // Unreachable means unreachable by the live tree and every
        // checkpoint: none may be in flight.
        self.inner.wait_for_checkpoint(&mut tree);
        let unreachable = tree.verify()?.unreachable;
        tree.free_unreachable(&unreachable);
        self.inner.checkpoint_locked(&mut tree)?;
        Ok(unreachable.len() as u64)
    }

    /// Stops the background thread and writes a final checkpoint.
    pub fn close(mut self) -> EngineResult<()> {
        self.stop_worker();
        self.closed = true;
        self.inner.check_failed()?;
        if self.is_read_only() {
            return Ok(());
        }
        // The log first: if the checkpoint cannot be written (a full
        // device), recovery still has every write.
        self.sync()?;
        self.inner.final_checkpoint()
    }

    fn stop_worker(&mut self) {
        // Closing the channel ends the read-ahead threads.
        drop(
            self.inner
                .read_ahead
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        for thread in self.read_ahead_threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("read-ahead thread panicked");
            }
        }
        let threads = [
            (self.write_back_thread.take(), "write-back thread"),
            (self.applier.take(), "applier"),
            (self.worker.take(), "background flusher"),
            (self.tree_flusher.take(), "tree flusher"),
            (self.log_flusher.take(), "log flusher"),
        ];
        if threads.iter().any(|(thread, _)| thread.is_some()) {
            self.inner.lock_background().shutdown = true;
            self.inner.wake.notify_all();
            self.inner.tree_flush_wake.notify_all();
            self.inner.write_back_wake.notify_all();
            self.inner.applier_wake.notify_all();
            self.inner.log_flush_wake.notify_all();
        }
        for (thread, name) in threads {
            if thread.is_some_and(|t| t.join().is_err()) {
                tracing::error!("{name} panicked");
            }
        }
    }
}

impl Drop for Store {
    /// Dropping without [`Store::close`] still stops the flusher and tries a
    /// final checkpoint; its error can only be logged.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        self.stop_worker();
        if self.inner.check_failed().is_ok() && !self.is_read_only() {
            if let Err(e) = self.sync() {
                tracing::error!("final log flush failed: {e}");
            }
            if let Err(e) = self.inner.final_checkpoint() {
                tracing::error!("final checkpoint failed: {e}");
            }
        }
    }
}

/// A gauge of memory held beside the node cache: see
/// [`Store::memory_beside_cache`] and [`Store::allocator_overhead`].
#[derive(Clone)]
pub struct MemoryBesideCache(Arc<Stats>, Beside);

/// Which memory a [`MemoryBesideCache`] reports.
#[derive(Clone, Copy)]
enum Beside {
    Tables,
    Allocator,
}

impl MemoryBesideCache {
    /// The bytes held beside the cache now (replaces the last report).
    pub fn set(&self, bytes: u64) {
        let gauge = match self.1 {
            Beside::Tables => &self.0.memory_beside_cache,
            Beside::Allocator => &self.0.allocator_overhead,
        };
        gauge.store(bytes, Ordering::Relaxed);
    }
}

type TreeGuard<'a> = parking_lot::RwLockWriteGuard<'a, Tree>;

/// Something about the trees that a holder of the exclusive tree lock
/// waits for, giving the lock up meanwhile (a condition variable for a
/// reader-writer lock, which `parking_lot::Condvar` does not serve).
/// The waiter checks its condition under the lock and reads the count of
/// signals before letting go; whoever changes the condition does so under
/// the lock and signals after, so a signal for a change the waiter did
/// not see always finds the count moved on.
#[derive(Default)]
struct TreeEvent {
    signals: parking_lot::Mutex<u64>,
    signalled: parking_lot::Condvar,
}

impl TreeEvent {
    fn notify_all(&self) {
        *self.signals.lock() += 1;
        self.signalled.notify_all();
    }

    /// Lets `tree` go until the next signal (or `timeout`), then takes it
    /// back. The caller checks its condition again: signals are shared.
    fn wait(&self, tree: &mut TreeGuard<'_>, timeout: Option<Duration>) {
        let seen = *self.signals.lock();
        parking_lot::RwLockWriteGuard::unlocked(tree, || {
            let mut signals = self.signals.lock();
            let deadline = timeout.map(|t| Instant::now() + t);
            while *signals == seen {
                match deadline {
                    Some(deadline) => {
                        if self
                            .signalled
                            .wait_until(&mut signals, deadline)
                            .timed_out()
                        {
                            break;
                        }
                    }
                    None => self.signalled.wait(&mut signals),
                }
            }
        });
    }
}

impl Inner {
    /// Flushes the log (`urgent`: for a caller waiting on it, see
    /// [`LogWriter::flush_urgent`]) and tells the cache's budget what the
    /// log's buffer holds now.
    fn flush_log(&self, urgent: bool) -> Result<(), StoreError> {
        let flushed = if urgent {
            self.log.flush_urgent()
        } else {
            self.log.flush()
        };
        self.note_log_buffer();
        flushed
    }

    /// Tells the cache's budget what the log's buffer holds now (after
    /// every append and log write); returns what it holds.
    fn note_log_buffer(&self) -> LogBufferUse {
        let buffer = self.log.buffer_use();
        self.stats
            .log_buffered
            .store(buffer.held, Ordering::Relaxed);
        buffer
    }

    fn lock_tree(&self) -> TreeGuard<'_> {
        self.tree.write()
    }

    fn lock_background(&self) -> MutexGuard<'_, BackgroundState> {
        self.background.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_failed(&self) -> EngineResult<()> {
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        match &*self.failure.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(why) => Err(EngineError::Failed(why.clone())),
            None => Ok(()),
        }
    }

    /// Whether callers' batches may be written: the image is writable and
    /// writes are not refused for now.
    fn check_writable(&self) -> EngineResult<()> {
        if self
            .writes_refused
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(EngineError::ReadOnly);
        }
        self.check_image_writable()
    }

    /// Whether the store may write the image at all (checkpoints still do
    /// while callers' writes are refused).
    fn check_image_writable(&self) -> EngineResult<()> {
        if self.options.read_only {
            return Err(EngineError::ReadOnly);
        }
        self.check_failed()
    }

    /// Records a failure after which the in-memory state may differ from
    /// what recovery would produce: refuse writes until reopened (reads go
    /// on), and tell the fault observer.
    fn poison(&self, e: EngineError) -> EngineError {
        if !e.is_no_space() {
            let first = {
                let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
                let first = failure.is_none();
                failure.get_or_insert_with(|| e.to_string());
                // Set with the failure held: whoever sees the flag finds it.
                self.failed.store(true, Ordering::Release);
                first
            };
            self.log.fail(e.to_string());
            if first {
                self.tell_fault_observer(&e, true);
            }
        }
        e
    }

    /// A read that failed: the observer hears of device faults.
    fn read_failed(&self, e: EngineError) -> EngineError {
        if e.is_device_fault() {
            self.tell_fault_observer(&e, false);
        }
        e
    }

    fn tell_fault_observer(&self, e: &EngineError, refusing_writes: bool) {
        let observer = self
            .fault_observer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(observer) = observer {
            observer(e, refusing_writes);
        }
    }

    fn stats_snapshot(&self) -> StatsSnapshot {
        let mut snap = self.stats.snapshot();
        snap.log_bytes_written = self.log.bytes_written();
        snap.log_flushes = self.log.flush_count();
        let buffer = self.log.buffer_use();
        snap.log_unflushed_bytes = buffer.unflushed;
        snap.log_buffer_bytes = buffer.held;
        {
            let tree = self.tree.read();
            snap.cache_bytes = tree.cache_bytes() as u64;
            snap.cache_peak_bytes = tree.cache_bytes_peak() as u64;
            snap.cache_dirty_bytes = tree.dirty_bytes() as u64;
            snap.checkpoint_held_image_bytes = tree.checkpoint_held_image_bytes() as u64;
            snap.cache_budget_bytes = tree.cache_budget() as u64;
            snap.cache_clean_budget_bytes = tree.clean_budget() as u64;
            snap.tree_heights = tree.heights();
            snap.node_region_bytes = tree.layout.nodes_bytes;
            snap.node_region_used_bytes = tree.alloc.live_blocks() * BLOCK_SIZE as u64;
            snap.promised_bytes = self.promised_bytes.load(Ordering::Relaxed);
            snap.flush_backlog_bytes = tree.flush_backlog() as u64;
            if self.tree_flusher_running.load(Ordering::Relaxed) {
                snap.flush_backlog_bound_bytes = tree.flush_backlog_bound() as u64;
            }
        }
        snap.finish();
        snap
    }
}
