//! The public face of the engine: a durable key-value store over one
//! device, safe to share between threads.
//!
//! Concurrency: one reader-writer lock guards the trees (cache, block
//! table, allocator). Point queries whose path is cached share it; one
//! whose leaf is not cached reads it holding no lock; everything else
//! holds it exclusively. The redo log has its own lock, so `sync` (a log
//! flush with group commit) never waits for tree work, and writers only
//! wait for a flush when the log region is full. A background thread
//! flushes the log at least once a `log_flush_interval` and checkpoints
//! every `checkpoint_interval` or when a third of the log is in use;
//! checkpoints encode dirty nodes in turns under the lock and write them
//! without it (docs/design.md, "Checkpoints that do not stop the world").

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use betreefs_store::{
    replay_log, AlignedBuf, Device, FileDevice, Layout, LogHole, LogWriter, ReplayStart,
    StoreError, Superblock, BLOCK_SIZE,
};

use crate::error::{EngineError, EngineResult};
use crate::merge::MergeRegistry;
use crate::message::{KeySpace, Message, WriteBatch};
use crate::node::Node;
use crate::stats::{add, record_max, Stats, StatsSnapshot};
use crate::tree::readahead::{read_leaf, LeafOnDisk, ReadFor};
use crate::tree::{Flushing, Shared, Tree, TreeOptions, VerifyReport, Want};
use crate::validate::{check_batch, check_message};

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
    /// While syncs are coming, a background checkpoint writes its node
    /// images in pieces of at most this many bytes (a multiple of the
    /// block size), letting a sync's log flush go first between them: an
    /// fsync waits behind one piece, not the whole checkpoint (512 KiB:
    /// 0.3 ms at 1.8 GB/s). Tests make it a block so that every image goes
    /// in several pieces.
    pub checkpoint_piece_bytes: usize,
    /// Move messages down the trees on a thread of their own, in turns,
    /// rather than in the writer's thread (see docs/design.md, "Background
    /// flushing"; off by default: on this 2-core reference machine it
    /// neither shortened the longest waits nor sped an untar up —
    /// docs/benchmarks/background-flush.md). Writers wait only when a
    /// root's buffers hold more than the backlog bound.
    pub background_flush: bool,
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
    /// Called while a writer's eviction writes a dirty node back, before
    /// the device write, without the tree lock (tests run other requests
    /// there).
    pub evict_step_hook: Option<TurnHook>,
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
            checkpoint_piece_bytes: 512 << 10,
            background_flush: false,
            flush_turn_bytes: 1 << 20,
            flush_turn_hook: None,
            settle_step_hook: None,
            evict_step_hook: None,
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
        if !(4..=1024).contains(&self.fanout) {
            return bad(format!("fanout {} must be within [4, 1024]", self.fanout));
        }
        if self.cache_bytes < 4 * self.node_size {
            return bad(format!(
                "cache_bytes {} must hold at least four nodes",
                self.cache_bytes
            ));
        }
        let block = betreefs_store::BLOCK_SIZE;
        if self.checkpoint_piece_bytes < block || !self.checkpoint_piece_bytes.is_multiple_of(block)
        {
            return bad(format!(
                "checkpoint_piece_bytes {} must be a positive multiple of {block}",
                self.checkpoint_piece_bytes
            ));
        }
        Ok(())
    }

    fn tree_options(&self) -> TreeOptions {
        TreeOptions {
            node_size: self.node_size,
            basement_size: self.basement_size,
            fanout: self.fanout,
            cache_bytes: self.cache_bytes,
        }
    }
}

/// The most unflushed log bytes at which the background thread flushes
/// without waiting for its interval (see [`log_flush_eager_bytes`]). Each
/// flush ends with a device cache flush, ~10 ms on the reference
/// machine's loop device behind a checkpoint's writes: at 4 MiB a 2 GiB
/// sequential write spent ~4 of its ~9 s in them; at 16 MiB it runs
/// 215-235 → 279-321 MB/s (docs/benchmarks/log-flush-bound.md).
const LOG_FLUSH_EAGER_MAX_BYTES: u64 = 16 << 20;

/// Unflushed log bytes at which the background thread flushes without
/// waiting for its interval: bounds the memory a burst of writes holds,
/// which the cache's clean nodes make room for (`Tree::clean_budget`) —
/// but in a sequential write nearly every node is dirty, so the buffer
/// must also be small beside the budget: an eighth of the cache's, at
/// least 1 MiB and at most [`LOG_FLUSH_EAGER_MAX_BYTES`] (the default
/// 256 MiB budget gets the most; a 64 MiB one, 5 MiB).
fn log_flush_eager_bytes(cache_bytes: usize) -> u64 {
    (cache_bytes as u64 / 8).clamp(1 << 20, LOG_FLUSH_EAGER_MAX_BYTES)
}

/// Unflushed log bytes at which a writer flushes the log itself (twice
/// the eager bound): the background thread is behind (it writes a
/// checkpoint, which takes seconds on a busy disk), and the log's buffer
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
}

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
    /// Wakes the tree flusher (with `background`).
    tree_flush_wake: Condvar,
    /// Signalled after every turn of the tree flusher: writers past the
    /// backlog bound wait on it.
    flush_progress: TreeEvent,
    /// The tree flusher runs: writers may leave messages in the roots and
    /// wait for it past the backlog bound.
    tree_flusher_running: std::sync::atomic::AtomicBool,
}

/// Leaves kept read ahead of a sequential scan, the next one included.
const READ_AHEAD_LEAVES: usize = 4;
/// Threads reading them: this many leaves are read from the device at
/// once. One read at a time leaves a scan bound by the device's
/// single-request latency (about half its bandwidth on the machines
/// measured, `docs/benchmarks/readahead-depth.md`).
const READ_AHEAD_READERS: usize = 3;
/// A checkpoint writes its nodes in pieces while a sync began within this
/// long (see `Inner::write_checkpoint_turn`).
const URGENT_FLUSH_WINDOW: Duration = Duration::from_secs(1);

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
    read_ahead_threads: Vec<JoinHandle<()>>,
    closed: bool,
}

/// Starts the threads that read leaves ahead of sequential scans
/// (`tree::readahead`): a planner that finds, for each leaf a scan
/// reaches, the leaves after it to read, and [`READ_AHEAD_READERS`]
/// readers that read them, several at once. They hold the store weakly:
/// closing the scans' channel ends the planner, which closes the readers'.
fn start_read_ahead(inner: &Arc<Inner>) -> Vec<JoinHandle<()>> {
    let (send, receive) = std::sync::mpsc::channel::<(KeySpace, Vec<u8>)>();
    let (send_leaf, receive_leaf) = std::sync::mpsc::channel::<LeafOnDisk>();
    let receive_leaf = Arc::new(Mutex::new(receive_leaf));
    let mut threads = Vec::new();
    let weak = Arc::downgrade(inner);
    let planner = std::thread::Builder::new()
        .name("betreefs-readahead".into())
        .spawn(move || {
            while let Ok((ks, key)) = receive.recv() {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                inner.plan_read_ahead(ks, &key, &send_leaf);
            }
        });
    match planner {
        Ok(handle) => threads.push(handle),
        Err(e) => {
            tracing::warn!("could not start the read-ahead thread: {e}; reading on demand");
            return threads;
        }
    }
    for i in 0..READ_AHEAD_READERS {
        let (weak, receive_leaf) = (Arc::downgrade(inner), receive_leaf.clone());
        let reader = std::thread::Builder::new()
            .name(format!("betreefs-readahead-{i}"))
            .spawn(move || loop {
                let next = receive_leaf
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .recv();
                let Ok(place) = next else {
                    return;
                };
                match weak.upgrade() {
                    Some(inner) => inner.read_leaf_ahead(&place),
                    None => return,
                }
            });
        match reader {
            Ok(handle) => threads.push(handle),
            // The planner's sends then wait for the readers there are;
            // with none, they fail and the scans read on demand.
            Err(e) => tracing::warn!("could not start a read-ahead reader: {e}"),
        }
    }
    *inner.read_ahead.lock().unwrap_or_else(|e| e.into_inner()) = Some(send);
    threads
}

/// Starts the thread that moves messages down the trees in turns and
/// tells the tree to leave them in the roots' buffers for it.
fn start_tree_flusher(inner: &Arc<Inner>) -> Option<JoinHandle<()>> {
    inner.tree_flusher_running.store(true, Ordering::SeqCst);
    let worker = inner.clone();
    let spawned = std::thread::Builder::new()
        .name("betreefs-tree-flush".into())
        .spawn(move || worker.run_tree_flusher());
    match spawned {
        Ok(handle) => Some(handle),
        Err(e) => {
            inner.tree_flusher_running.store(false, Ordering::SeqCst);
            tracing::warn!("could not start the tree flusher: {e}; writers flush themselves");
            None
        }
    }
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
        let inner = Arc::new(Inner {
            device,
            tree: parking_lot::RwLock::new(tree),
            checkpoint_ended: TreeEvent::default(),
            log,
            stats,
            merges,
            failure: Mutex::new(None),
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
            tree_flush_wake: Condvar::new(),
            flush_progress: TreeEvent::default(),
            tree_flusher_running: std::sync::atomic::AtomicBool::new(false),
        });
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
        Store {
            inner,
            worker,
            tree_flusher,
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
        let _tree = self.inner.lock_tree();
        self.inner.promised_bytes.store(bytes, Ordering::Relaxed);
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
    pub fn get(&self, ks: KeySpace, key: &[u8]) -> EngineResult<Option<Vec<u8>>> {
        // The shared guard ends with this statement: errors are reported
        // (to the fault observer, which may call back) holding no lock.
        let shared = self.inner.tree.read().get_cached(ks, key);
        let mut tree = match shared {
            Shared::Answer(value) => return value.map_err(|e| self.inner.read_failed(e)),
            Shared::ReadLeaf(place) => {
                self.inner
                    .read_leaf_unlocked(&place, Want::Key(key), ReadFor::Query)
            }
            Shared::Exclusive => self.inner.lock_tree(),
        };
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
        let (worker, tree_flusher) = (self.worker.take(), self.tree_flusher.take());
        if worker.is_some() || tree_flusher.is_some() {
            self.inner.lock_background().shutdown = true;
            self.inner.wake.notify_all();
            self.inner.tree_flush_wake.notify_all();
        }
        if let Some(worker) = worker {
            if worker.join().is_err() {
                tracing::error!("background flusher panicked");
            }
        }
        if let Some(flusher) = tree_flusher {
            if flusher.join().is_err() {
                tracing::error!("tree flusher panicked");
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

/// The turns a checkpoint held the tree lock.
#[derive(Default)]
struct LockTurns {
    total: Duration,
    longest: Duration,
}

impl LockTurns {
    fn add(&mut self, turn: Duration) {
        self.total += turn;
        self.longest = self.longest.max(turn);
    }
}

/// Bytes a batch that deletes may also add (a file system's unlink rewrites
/// its parent directory's record) and still be let into the reserve when
/// space is low: deleting must stay possible on a full device.
const REMOVAL_BATCH_ALLOWANCE: u64 = 64 << 10;

/// What a write needs to know of its batch before it takes the tree lock.
struct Admission {
    /// The batch must be refused when space is low.
    needs_space: bool,
    /// Key and value bytes (write amplification's denominator).
    user_bytes: u64,
}

/// Checks a caller's batch ([`check_message`]) and works out its
/// [`Admission`] in the same pass: each pass decodes every message.
fn admit(batch: &WriteBatch, merges: &MergeRegistry) -> EngineResult<Admission> {
    let mut removes = false;
    let mut added = 0;
    let mut user_bytes = 0;
    for (_, m) in batch.messages() {
        check_message(&m, merges)?;
        user_bytes += m.user_bytes();
        match m {
            // A range rename moves subtrees (surgery) or copies at most a
            // leaf of pairs, and deletes its source: admitted like a delete.
            m if m.is_removal() || matches!(m, Message::RangeRename(_)) => removes = true,
            m => added += m.user_bytes(),
        }
    }
    Ok(Admission {
        needs_space: added > 0 && !(removes && added <= REMOVAL_BATCH_ALLOWANCE),
        user_bytes,
    })
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
    /// every append and log write); returns its unflushed bytes.
    fn note_log_buffer(&self) -> u64 {
        let buffer = self.log.buffer_use();
        self.stats
            .log_buffered
            .store(buffer.held, Ordering::Relaxed);
        buffer.unflushed
    }

    fn lock_tree(&self) -> TreeGuard<'_> {
        self.tree.write()
    }

    fn lock_background(&self) -> MutexGuard<'_, BackgroundState> {
        self.background.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_failed(&self) -> EngineResult<()> {
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
                first
            };
            self.log.fail(e.to_string());
            if first {
                self.tell_fault_observer(&e, true);
            }
        }
        e
    }

    /// Visits [from, end) within the leaf holding `from` (see
    /// [`Store::visit_range`]): on the shared tree lock if it and the path
    /// to it are cached, else on the exclusive one, loading what is
    /// missing. Returns where the next leaf begins; tells the read-ahead
    /// thread when the visit read on across basements.
    fn visit_one_leaf(
        &self,
        ks: KeySpace,
        from: &[u8],
        end: Option<&[u8]>,
        visit: &mut dyn FnMut(&[u8], &[u8]),
    ) -> EngineResult<Option<Vec<u8>>> {
        self.wait_for_read_ahead(ks, from);
        let shared = self.tree.read().visit_leaf_cached(ks, from, end, visit);
        let visited = match shared {
            Shared::Answer(visited) => visited,
            Shared::ReadLeaf(place) => {
                let want = Want::Range(from, end);
                let mut tree = self.read_leaf_unlocked(&place, want, ReadFor::Query);
                let visited = tree.visit_leaf(ks, from, end, visit);
                tree.evict_clean_if_needed();
                visited
            }
            Shared::Exclusive => {
                let mut tree = self.lock_tree();
                let visited = tree.visit_leaf(ks, from, end, visit);
                tree.evict_clean_if_needed();
                visited
            }
        };
        let visited = visited.map_err(|e| self.read_failed(e))?;
        if let Some(read_on) = visited.read_on {
            self.read_ahead_from(ks, read_on);
        }
        Ok(visited.next)
    }

    /// The tree lock, exclusively — after reading, holding no lock, what
    /// `want` needs of the leaf at `place` (`by` whom: a query or a
    /// read-ahead reader) and caching it if the tree still names it there
    /// ([`Inner::adopt_read`]). Other requests go on while the device
    /// reads.
    fn read_leaf_unlocked(&self, place: &LeafOnDisk, want: Want<'_>, by: ReadFor) -> TreeGuard<'_> {
        let read = read_leaf(place, self.device.as_ref(), want, &self.stats);
        let mut tree = self.lock_tree();
        self.adopt_read(&mut tree, place, read, by);
        tree
    }

    /// Caches what was read of the leaf at `place` holding no lock if the
    /// tree still names it there (`Tree::adopt_leaf_read`). A read that
    /// failed is dropped: whoever needs the leaf reads it again under the
    /// lock, where failures are reported.
    fn adopt_read(
        &self,
        tree: &mut Tree,
        place: &LeafOnDisk,
        read: EngineResult<Node>,
        by: ReadFor,
    ) {
        match read {
            Ok(leaf) => {
                tree.adopt_leaf_read(place, leaf, by);
            }
            Err(e) => {
                tracing::debug!("read of node {} outside the lock: {e}", place.num);
                add(&self.stats.unlocked_reads_dropped, 1);
            }
        }
    }

    /// Hands the read-ahead planner the leaf after one a scan just read
    /// sequentially (it begins at `key`), if there is such a thread.
    fn read_ahead_from(&self, ks: KeySpace, key: Vec<u8>) {
        if let Some(send) = &*self.read_ahead.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = send.send((ks, key));
        }
    }

    /// Hands the read-ahead readers the leaf holding `key` and the ones
    /// after it, [`READ_AHEAD_LEAVES`] in all, that are neither cached nor
    /// being read: a reader that has just asked for the next leaf would
    /// otherwise often reach it first and read it itself.
    fn plan_read_ahead(&self, ks: KeySpace, key: &[u8], readers: &Sender<LeafOnDisk>) {
        // One hold of the shared lock for the whole walk: nothing here
        // waits for the device (the readers do).
        let tree = self.tree.read();
        let mut key = key.to_vec();
        for _ in 0..READ_AHEAD_LEAVES {
            let Some((place, next)) = tree.leaf_for(ks, &key) else {
                return;
            };
            // Marked under the tree lock: a scan that finds the leaf
            // uncached after this waits for it.
            if let Some(place) = place {
                if self.lock_reading_ahead().insert(place.num) {
                    if let Err(unsent) = readers.send(place) {
                        self.lock_reading_ahead().remove(&unsent.0.num);
                        return;
                    }
                }
            }
            match next {
                Some(next) => key = next,
                None => return,
            }
        }
    }

    /// Reads a leaf the planner handed over, caches it if the tree still
    /// names it there, and wakes scans waiting for it.
    fn read_leaf_ahead(&self, place: &LeafOnDisk) {
        self.read_leaf_unlocked(place, Want::Whole, ReadFor::ReadAhead)
            .evict_clean_if_needed();
        self.lock_reading_ahead().remove(&place.num);
        self.read_ahead_landed.notify_all();
    }

    fn lock_reading_ahead(&self) -> MutexGuard<'_, HashSet<u64>> {
        self.reading_ahead.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Before a scan reads the leaf holding `key`: if the read-ahead
    /// thread is reading that leaf now, wait (without the tree lock) until
    /// it lands, so it is read once. Bounded: a slow device never holds a
    /// scan up for more than a moment.
    fn wait_for_read_ahead(&self, ks: KeySpace, key: &[u8]) {
        if self.lock_reading_ahead().is_empty() {
            return;
        }
        let num = match self.tree.read().leaf_for(ks, key) {
            Some((Some(place), _)) => place.num,
            _ => return,
        };
        let deadline = Instant::now() + Duration::from_millis(200);
        let mut reading = self.lock_reading_ahead();
        while reading.contains(&num) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            reading = match self.read_ahead_landed.wait_timeout(reading, left) {
                Ok((guard, _)) => guard,
                Err(e) => e.into_inner().0,
            };
        }
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

    fn write(&self, batch: &WriteBatch, reservation: Reservation) -> EngineResult<u64> {
        self.check_writable()?;
        let Admission {
            needs_space,
            user_bytes,
        } = admit(batch, &self.merges)?;
        if batch.is_empty() {
            // A promise is kept by what the batch writes (see Reservation).
            if reservation != Reservation::default() {
                return Err(EngineError::InvalidMessage(
                    "space promised or given back by an empty batch".into(),
                ));
            }
            return Ok(0);
        }
        let (count, body) = batch.payload_parts();
        let mut tree = self.lock_tree();
        self.wait_for_flush_backlog(&mut tree);
        // Everything from here to the log append is decided under one hold
        // of the lock: the sequence number, the promised space. A step that
        // needs a checkpoint while one is in flight waits for it — which
        // lets the lock go, so the decisions are made again from the start.
        let (seq, promised_after) = 'admit: loop {
            // Again under the lock: a checkpoint for a remount read-only
            // must not be followed by a write that checked before it began.
            self.check_writable()?;
            let promised = self.promised_bytes.load(Ordering::Relaxed);
            let promised_after = promised
                .saturating_add(reservation.take)
                .saturating_sub(reservation.release);
            if reservation.take > 0 || needs_space {
                // A write drawing on a promise is checked with the promise
                // already given back; one making a promise, with it taken.
                let drawing = reservation.release > 0 && reservation.take == 0;
                let counted = if drawing {
                    promised_after
                } else {
                    promised.saturating_add(reservation.take)
                };
                if tree.space_low(counted, drawing) {
                    if tree.checkpoint_in_flight() {
                        self.wait_for_checkpoint_to_admit(&mut tree);
                        continue 'admit;
                    }
                    self.reclaim_space(&mut tree)?;
                    if tree.space_low(counted, drawing) {
                        return Err(EngineError::NoSpace);
                    }
                }
            }
            let seq = tree.next_seq;
            let mut attempts = 0;
            loop {
                match self.log.append(seq, &[&count, body]) {
                    Ok(_) => break 'admit (seq, promised_after),
                    Err(StoreError::LogFull { .. }) if tree.checkpoint_in_flight() => {
                        self.wait_for_checkpoint_to_admit(&mut tree);
                        continue 'admit;
                    }
                    // The log keeps the previous checkpoint's records too,
                    // so freeing it may take two checkpoints.
                    Err(StoreError::LogFull { .. }) if attempts < 2 => {
                        attempts += 1;
                        match self.checkpoint_locked(&mut tree) {
                            // A full device cannot take the checkpoint that
                            // would free the log: push pending deletes down
                            // and free their space first (a delete must
                            // never be refused for lack of room).
                            Err(e) if e.is_no_space() => {
                                self.reclaim_space(&mut tree)?;
                                self.checkpoint_locked(&mut tree)?;
                            }
                            other => other?,
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        tree.next_seq = seq + 1;
        self.promised_bytes.store(promised_after, Ordering::Relaxed);
        let flushing = self.flushing_now(&tree);
        let applying = Instant::now();
        if let Err(e) = tree.apply_batch(seq, batch, flushing) {
            return Err(self.poison(e));
        }
        record_max(&self.stats.apply_micros_max, applying.elapsed());
        // Counted before the locks go: whoever is ordered after this write
        // (through the tree lock, or a lock the caller held across it)
        // reads the count moved.
        self.batches_applied.fetch_add(1, Ordering::Release);
        if flushing == Flushing::Stepwise {
            self.settle_in_steps(&mut tree)?;
        }
        add(&self.stats.user_bytes_written, user_bytes);
        add(&self.stats.user_messages, batch.len() as u64);
        let unflushed = self.note_log_buffer();
        self.evict_in_steps(&mut tree)?;
        // A third of the log: the writer keeps the records of the previous
        // checkpoint's head on as well, so two of these fit in the region
        // with room to spare while the checkpoint runs.
        let wants_checkpoint = self.log.used() > self.log.capacity() / 3;
        let wants_flush = unflushed > log_flush_eager_bytes(self.options.cache_bytes);
        let wants_tree_flush =
            flushing == Flushing::Background && tree.flush_backlog() > tree.flush_low_water();
        drop(tree);
        if wants_checkpoint || wants_flush {
            let mut state = self.lock_background();
            state.checkpoint_wanted |= wants_checkpoint;
            state.flush_wanted |= wants_flush;
            self.wake.notify_all();
        }
        if wants_tree_flush {
            self.want_tree_flush();
        }
        if unflushed > log_flush_writer_bytes(self.options.cache_bytes) {
            // Back-pressure, without the tree lock: this writer waits for
            // the log's device writes as a synchronous writer would.
            add(&self.stats.writes_flushed_log, 1);
            if let Err(e) = self.flush_log(false) {
                // The batch is applied, as any write not yet synced; what
                // failed is its durability, which the next sync reports
                // (the store refuses writes from here on).
                let _ = self.poison(e.into());
            }
        }
        Ok(seq)
    }

    /// Before refusing a write for lack of space: push pending deletes down
    /// to the leaves and checkpoint, which frees what they deleted — and,
    /// with nothing deleted, checkpoint anyway: the copies of nodes that
    /// writes replaced stay allocated until two checkpoints no longer need
    /// them (once per batch written: refusing again with nothing written
    /// in between frees nothing more).
    fn reclaim_space(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        if tree.removals_since_reclaim == 0 {
            if tree.reclaimed_at_seq == tree.next_seq {
                return Ok(());
            }
            tree.reclaimed_at_seq = tree.next_seq;
            for _ in 0..2 {
                match self.checkpoint_locked(tree) {
                    Err(e) if e.is_no_space() => return Ok(()),
                    other => other?,
                }
            }
            return Ok(());
        }
        tree.removals_since_reclaim = 0;
        tree.reclaimed_at_seq = tree.next_seq;
        // Step by step: each step rewrites no more than the free space can
        // take; blocks the previous checkpoint freed become reusable only
        // once a second one no longer needs the first's copy (two
        // generations), so each step ends with two checkpoints.
        loop {
            let budget = tree.reclaim_budget();
            let done = match tree.flush_some(budget) {
                Ok(done) => done,
                Err(e) => return Err(self.poison(e)),
            };
            for _ in 0..2 {
                match self.checkpoint_locked(tree) {
                    Err(e) if e.is_no_space() => return Ok(()),
                    Err(e) => return Err(e),
                    Ok(()) => {}
                }
            }
            if done {
                return Ok(());
            }
        }
    }

    /// A checkpoint written while requests go on: the tree lock is held
    /// only in short turns — to note what is dirty, to encode a bounded
    /// part of it, to give the images their places — and to record that
    /// it is durable (docs/design.md, "Checkpoints that do not stop the
    /// world").
    fn checkpoint(&self) -> EngineResult<()> {
        self.check_image_writable()?;
        let mut tree = self.lock_tree();
        self.wait_for_checkpoint(&mut tree);
        // After the wait: the checkpoint waited for may have failed.
        self.check_failed()?;
        let mut turn = Instant::now();
        let mut locked = LockTurns::default();
        let head = self.log.append_pos();
        tree.begin_checkpoint(head, self.log.epoch(), false)
            .map_err(|e| self.poison(e))?;
        let mut io = Duration::ZERO;
        // Turns: encode a bounded part under the lock, write it without.
        loop {
            let turn_result = tree.encode_checkpoint_nodes(self.options.checkpoint_turn_bytes);
            locked.add(turn.elapsed());
            drop(tree);
            let (done, images) = match turn_result {
                Ok(turn) => turn,
                Err(e) => {
                    self.checkpoint_ended.notify_all();
                    return Err(self.poison(e));
                }
            };
            let writing = Instant::now();
            let written = self.write_checkpoint_turn(&images);
            io += writing.elapsed();
            if let Err(e) = written {
                self.lock_tree().cancel_checkpoint();
                self.checkpoint_ended.notify_all();
                return Err(self.poison(e));
            }
            if !done {
                if let Some(hook) = &self.options.checkpoint_turn_hook {
                    (hook.0)();
                }
            }
            tree = self.lock_tree();
            turn = Instant::now();
            if done {
                break;
            }
        }
        let sealed = tree.seal_checkpoint();
        locked.add(turn.elapsed());
        drop(tree);
        let writes = match sealed {
            Ok(writes) => writes,
            Err(e) => {
                self.checkpoint_ended.notify_all();
                return Err(self.poison(e));
            }
        };
        let io_started = Instant::now();
        let written = writes.write(self.device.as_ref(), &self.stats, || {
            self.flush_log(false).map_err(EngineError::from)
        });
        io += io_started.elapsed();
        let mut tree = self.lock_tree();
        let relocked = Instant::now();
        let result = match written {
            Ok(()) => {
                tree.finish_checkpoint(writes.generation());
                self.log.set_head(head);
                Ok(())
            }
            Err(e) => {
                tree.abort_checkpoint();
                Err(e)
            }
        };
        locked.add(relocked.elapsed());
        drop(tree);
        self.checkpoint_ended.notify_all();
        self.record_checkpoint_times(locked, io);
        result.map_err(|e| self.poison(e))
    }

    /// Writes one turn of a background checkpoint's node images so that
    /// an fsync meanwhile waits for little of it. While syncs are coming
    /// (one began within [`URGENT_FLUSH_WINDOW`]), the images go in pieces
    /// of at most [`Options::checkpoint_piece_bytes`], each after the log
    /// flushes that syncs wait on have finished: written in one go, a
    /// checkpoint's hundreds of megabytes queued in front of every log
    /// write (an unlink + fsync took 5-15 ms while one ran on the
    /// reference machine's loop device, 1 ms in pieces, 0.15 ms with none
    /// running). Otherwise whole: the device takes big writes faster, and
    /// a burst of writes with no sync waits for checkpoints to free the
    /// log (docs/design.md, "Checkpoints that do not stop the world").
    fn write_checkpoint_turn(&self, images: &crate::tree::NodeWrites) -> EngineResult<()> {
        for (offset, image) in images {
            let piece_bytes = if self.log.urgent_flush_within(URGENT_FLUSH_WINDOW) {
                self.options.checkpoint_piece_bytes
            } else {
                image.len().max(1)
            };
            for (i, piece) in image.chunks(piece_bytes).enumerate() {
                self.log.wait_for_urgent_flushes();
                let at = offset + (i * piece_bytes) as u64;
                self.device
                    .write_at(piece, at)
                    .map_err(|e| EngineError::from(StoreError::io("writing node", e)))?;
            }
        }
        Ok(())
    }

    /// A write's wait for the checkpoint in flight (counted: it is
    /// back-pressure a writer felt).
    fn wait_for_checkpoint_to_admit(&self, tree: &mut TreeGuard<'_>) {
        add(&self.stats.writes_waited_for_checkpoint, 1);
        self.wait_for_checkpoint(tree);
    }

    /// Waits (giving up the tree lock meanwhile) until no checkpoint is
    /// being written: one is in flight at a time.
    fn wait_for_checkpoint(&self, tree: &mut TreeGuard<'_>) {
        while tree.checkpoint_in_flight() {
            self.checkpoint_ended.wait(tree, None);
        }
    }

    /// The checkpoint of a close, marked clean: nothing follows it in the log.
    fn final_checkpoint(&self) -> EngineResult<()> {
        self.check_image_writable()?;
        let mut tree = self.lock_tree();
        self.check_failed()?;
        self.write_checkpoint(&mut tree, true)
    }

    fn checkpoint_locked(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        self.write_checkpoint(tree, false)
    }

    /// A checkpoint with the tree lock held throughout, for the paths that
    /// cannot go on without one (a full log, reclaiming space, close).
    fn write_checkpoint(&self, tree: &mut TreeGuard<'_>, clean: bool) -> EngineResult<()> {
        self.wait_for_checkpoint(tree);
        let started = Instant::now();
        let head = self.log.append_pos();
        // Every record before the new head reaches the log before the
        // superblock, although the checkpoint contains it: recovery from
        // the previous superblock copy (should this one be lost) replays
        // it from there.
        let turn_bytes = self.options.checkpoint_turn_bytes;
        tree.write_checkpoint(head, self.log.epoch(), clean, turn_bytes, || {
            self.flush_log(false).map_err(EngineError::from)
        })
        .map_err(|e| self.poison(e))?;
        self.log.set_head(head);
        let mut locked = LockTurns::default();
        locked.add(started.elapsed());
        self.record_checkpoint_times(locked, Duration::ZERO);
        Ok(())
    }

    /// `locked`: the checkpoint's turns with the tree lock held (a request
    /// may have waited as long as the longest); `io`: how long it wrote
    /// without it.
    fn record_checkpoint_times(&self, locked: LockTurns, io: Duration) {
        let stats = &self.stats;
        add(
            &stats.checkpoint_micros_total,
            locked.total.as_micros() as u64,
        );
        record_max(&stats.checkpoint_micros_max, locked.longest);
        add(&stats.checkpoint_io_micros_total, io.as_micros() as u64);
        record_max(&stats.checkpoint_io_micros_max, io);
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

    /// Wakes the tree flusher.
    fn want_tree_flush(&self) {
        let mut state = self.lock_background();
        if !state.tree_flush_wanted {
            state.tree_flush_wanted = true;
            self.tree_flush_wake.notify_all();
        }
    }

    /// A writer's settling ([`Flushing::Stepwise`]): what its batch left
    /// over a node's worth in the roots' buffers is flushed down a step
    /// at a time (`Tree::settle_step`: one flush, or one split), and
    /// between steps the lock goes fairly to whoever waits for it, so that
    /// no request waits for more than one step of someone else's cascade.
    /// The leaf a step flushes into is read beforehand with the lock let
    /// go. Each step leaves the tree whole. Counted: the steps that let
    /// others in, the longest step, and the leaves read for steps.
    fn settle_in_steps(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        loop {
            let mut stepping = Instant::now();
            let mut target = tree.settle_target();
            if let Some(place) = target.as_ref().and_then(|t| tree.settle_step_leaf(t)) {
                // The leaf the step flushes into is read with the lock
                // let go (fairly): a device read under it would shut out
                // every request for its whole length. If the tree changed
                // meanwhile, the step reads what it needs under the lock.
                let read = parking_lot::RwLockWriteGuard::unlocked_fair(tree, || {
                    read_leaf(&place, self.device.as_ref(), Want::Whole, &self.stats)
                });
                self.adopt_read(tree, &place, read, ReadFor::Flush);
                stepping = Instant::now();
                target = tree.settle_target();
            }
            let Some(target) = target else {
                return Ok(());
            };
            tree.settle_step(target).map_err(|e| self.poison(e))?;
            record_max(&self.stats.settle_step_micros_max, stepping.elapsed());
            add(&self.stats.settle_steps, 1);
            self.hand_on(tree, &self.options.settle_step_hook);
        }
    }

    /// A writer's eviction when its batch took the cache over budget: a
    /// dirty node written back per step ([`Tree::evict_step`]), its device
    /// write made with the lock let go and handed on fairly meanwhile.
    /// Counted: the steps that let others in, and the longest hold of the
    /// lock (`evict_micros_max`: choosing and encoding, or taking the
    /// written node in).
    fn evict_in_steps(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        let mut continuing = false;
        loop {
            let evicting = Instant::now();
            let write_back = match tree.evict_step(continuing) {
                Ok(write_back) => write_back,
                Err(e) if e.is_no_space() => {
                    tracing::warn!("cache over budget: no space to write back dirty nodes");
                    None
                }
                Err(e) => return Err(self.poison(e)),
            };
            record_max(&self.stats.evict_micros_max, evicting.elapsed());
            let Some(write_back) = write_back else {
                return Ok(());
            };
            add(&self.stats.eviction_steps, 1);
            // The device write, of up to a node, with the lock let go
            // (fairly: whoever waits goes first).
            let written = parking_lot::RwLockWriteGuard::unlocked_fair(tree, || {
                if let Some(hook) = &self.options.evict_step_hook {
                    (hook.0)();
                }
                write_back.write(self.device.as_ref())
            });
            let finishing = Instant::now();
            if let Err(e) = tree.finish_write_back(write_back, written) {
                return Err(self.poison(e));
            }
            record_max(&self.stats.evict_micros_max, finishing.elapsed());
            continuing = true;
        }
    }

    /// Between two steps of a writer's work: the lock goes fairly to
    /// whoever waits for it (or, in tests, to the hook's requests).
    fn hand_on(&self, tree: &mut TreeGuard<'_>, hook: &Option<TurnHook>) {
        match hook {
            Some(hook) => parking_lot::RwLockWriteGuard::unlocked_fair(tree, || (hook.0)()),
            None => parking_lot::RwLockWriteGuard::bump(tree),
        }
    }

    /// Back-pressure: while a root's buffers hold more than the backlog
    /// bound, a writer waits (giving up the tree lock) for the tree
    /// flusher's turns to bring them down. Counted: how many writes
    /// waited, and how long.
    fn wait_for_flush_backlog(&self, tree: &mut TreeGuard<'_>) {
        let flushing = |tree: &Tree| self.background_flush_now(tree);
        let over = |tree: &Tree| tree.flush_backlog() > tree.flush_backlog_bound();
        if !flushing(tree) || !over(tree) {
            return;
        }
        add(&self.stats.writes_waited_for_flush, 1);
        let waiting = Instant::now();
        self.want_tree_flush();
        while over(tree) && flushing(tree) && self.check_failed().is_ok() {
            // A timeout only as a safeguard: every turn signals.
            self.flush_progress
                .wait(tree, Some(Duration::from_millis(100)));
        }
        let waited = waiting.elapsed();
        record_max(&self.stats.flush_wait_micros_max, waited);
        add(
            &self.stats.flush_wait_micros_total,
            waited.as_micros() as u64,
        );
    }

    /// The tree flusher: woken when a root's buffers hold more than a
    /// node's worth, it moves messages down in turns of
    /// `Options::flush_turn_bytes` with the tree lock held, handing the
    /// lock on fairly in between so that requests go on (docs/design.md,
    /// "Background flushing").
    fn run_tree_flusher(&self) {
        loop {
            {
                let mut state = self.lock_background();
                while !state.shutdown && !state.tree_flush_wanted {
                    state = self
                        .tree_flush_wake
                        .wait_timeout(state, Duration::from_secs(1))
                        .map(|(s, _)| s)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                if state.shutdown {
                    break;
                }
                state.tree_flush_wanted = false;
            }
            if self.check_failed().is_err() {
                continue;
            }
            while self.flush_turn() {}
        }
        self.tree_flusher_running.store(false, Ordering::SeqCst);
        // Writers waiting for it settle in their own thread from now on.
        let _guard = self.lock_tree();
        self.flush_progress.notify_all();
    }

    /// Who settles what a write leaves in the roots: the flusher thread
    /// if it runs, else the writer in steps — both only with room to
    /// spare (`Tree::room_to_defer_settling`): a write's admission checks
    /// that the space its own settling dirties will fit, which the
    /// flusher's later work would escape, and either lets a checkpoint or
    /// an eviction write an interior node fuller than a node (an image
    /// past the allocator's node-sized runs). Short of room, the writer
    /// settles inline, as before.
    fn flushing_now(&self, tree: &Tree) -> Flushing {
        if !tree.room_to_defer_settling(self.promised_bytes.load(Ordering::Relaxed)) {
            Flushing::Inline
        } else if self.tree_flusher_running.load(Ordering::SeqCst) {
            Flushing::Background
        } else {
            Flushing::Stepwise
        }
    }

    /// Whether messages are left to the tree flusher now.
    fn background_flush_now(&self, tree: &Tree) -> bool {
        self.flushing_now(tree) == Flushing::Background
    }

    /// One turn of the tree flusher; whether there is more to do (and no
    /// reason to stop).
    fn flush_turn(&self) -> bool {
        if let Some(hook) = &self.options.flush_turn_hook {
            (hook.0)();
        }
        let mut tree = self.lock_tree();
        if !self.background_flush_now(&tree) {
            // Space is getting low: writers settle for themselves.
            return false;
        }
        let started = Instant::now();
        let turn = tree
            .flush_turn(self.options.flush_turn_bytes)
            .and_then(|more| {
                // A write's eviction, as for the nodes a writer's own settling
                // would have loaded and dirtied.
                match tree.evict_if_needed() {
                    Err(e) if !e.is_no_space() => Err(e),
                    _ => Ok(more),
                }
            });
        record_max(&self.stats.flush_turn_micros_max, started.elapsed());
        add(&self.stats.flush_turns, 1);
        let more = turn.unwrap_or_else(|e| {
            tracing::error!("background flushing failed: {e}");
            self.poison(e);
            false
        });
        self.flush_progress.notify_all();
        parking_lot::RwLockWriteGuard::unlock_fair(tree);
        more && !self.lock_background().shutdown
    }

    fn run_background(&self) {
        let tick = Duration::from_millis(50);
        let mut last_flush = Instant::now();
        let mut last_checkpoint = Instant::now();
        loop {
            let (checkpoint_wanted, flush_wanted) = {
                let mut state = self.lock_background();
                if !state.shutdown && !state.checkpoint_wanted && !state.flush_wanted {
                    state = self
                        .wake
                        .wait_timeout(state, tick)
                        .map(|(s, _)| s)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                if state.shutdown {
                    return;
                }
                (
                    std::mem::take(&mut state.checkpoint_wanted),
                    std::mem::take(&mut state.flush_wanted),
                )
            };
            if self.check_failed().is_err() {
                continue;
            }
            let interval_due = self
                .options
                .log_flush_interval
                .is_some_and(|i| last_flush.elapsed() >= i);
            if flush_wanted || interval_due {
                if self.log.has_unflushed() {
                    if let Err(e) = self.flush_log(false) {
                        tracing::error!("background log flush failed: {e}");
                        self.poison(e.into());
                    }
                }
                last_flush = Instant::now();
            }
            let due = self
                .options
                .checkpoint_interval
                .is_some_and(|i| last_checkpoint.elapsed() >= i);
            if checkpoint_wanted || due {
                if let Err(e) = self.checkpoint() {
                    tracing::error!("background checkpoint failed: {e}");
                }
                last_checkpoint = Instant::now();
            }
        }
    }
}

/// Iterator over a key range; see [`Store::range`].
pub struct RangeIter<'a> {
    store: &'a Store,
    ks: KeySpace,
    next: Option<Vec<u8>>,
    end: Option<Vec<u8>>,
    chunk: std::vec::IntoIter<(Vec<u8>, Vec<u8>)>,
}

impl Iterator for RangeIter<'_> {
    type Item = EngineResult<(Vec<u8>, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(kv) = self.chunk.next() {
                return Some(Ok(kv));
            }
            let start = self.next.take()?;
            if self.end.as_ref().is_some_and(|e| *e <= start) {
                return None;
            }
            let mut items = Vec::new();
            let scanned = self.store.inner.visit_one_leaf(
                self.ks,
                &start,
                self.end.as_deref(),
                &mut |k, v| items.push((k.to_vec(), v.to_vec())),
            );
            match scanned {
                Ok(next) => {
                    self.chunk = items.into_iter();
                    self.next = next;
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }
}
