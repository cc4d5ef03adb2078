//! IO and work counters, for write-amplification reports on any workload.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Tree levels tracked separately; deeper levels are counted in the last.
pub const LEVELS_TRACKED: usize = 8;

#[derive(Default)]
pub struct Stats {
    pub user_bytes_written: AtomicU64,
    pub user_messages: AtomicU64,
    pub node_bytes_written: [AtomicU64; LEVELS_TRACKED],
    pub node_bytes_read: [AtomicU64; LEVELS_TRACKED],
    pub nodes_written: AtomicU64,
    pub nodes_read: AtomicU64,
    /// Interior nodes read in part for point queries (their meta alone).
    pub interior_nodes_read_in_part: AtomicU64,
    /// Segments of point messages such nodes' queries read.
    pub segments_read: AtomicU64,
    /// Interior nodes read in part, then made whole by reading the
    /// segments they lacked (for a change, a clone or verify).
    pub interior_nodes_completed: AtomicU64,
    /// Chunk directories of basements read below (`chunks.rs`).
    pub chunk_dirs_read: AtomicU64,
    /// Chunks read below a basement instead of the basement whole.
    pub chunks_read: AtomicU64,
    /// Leaves read ahead of a sequential scan and cached.
    pub nodes_read_ahead: AtomicU64,
    /// Query reads that began where the last one in their tree ended,
    /// each handing the read-ahead planner what follows.
    pub sequential_query_reads: AtomicU64,
    /// Leaves point queries read holding no tree lock and cached.
    pub leaves_read_unlocked: AtomicU64,
    /// Basements of cached leaves read by queries holding no lock and
    /// taken into the cache.
    pub basement_reads_unlocked: AtomicU64,
    /// Leaves (or the missing basements of cached ones) a writer's next
    /// settle step flushes into, read holding no tree lock before the
    /// step and cached.
    pub leaves_read_for_flushes: AtomicU64,
    /// Nodes read at open to warm the trees' upper levels, and the bytes
    /// that took (`Options::warm_bytes`).
    pub nodes_warmed: AtomicU64,
    pub warm_bytes_read: AtomicU64,
    /// Leaves read holding no tree lock (by queries, read-ahead or writers)
    /// and dropped: the tree changed them meanwhile, or the read failed
    /// (a query then reads again under the lock, and reports).
    pub unlocked_reads_dropped: AtomicU64,
    pub superblock_bytes_written: AtomicU64,
    pub block_table_bytes_written: AtomicU64,
    pub messages_inserted: AtomicU64,
    pub messages_flushed: AtomicU64,
    pub messages_obviated: AtomicU64,
    pub flushes: AtomicU64,
    pub splits: AtomicU64,
    pub merges: AtomicU64,
    pub subtrees_dropped: AtomicU64,
    /// Range renames done by moving subtrees (tree surgery), and by copying
    /// pairs (ranges within one leaf).
    pub range_renames_by_surgery: AtomicU64,
    pub range_renames_copied: AtomicU64,
    /// Range clones done by sharing subtrees, and by copying pairs.
    pub range_clones_by_surgery: AtomicU64,
    pub range_clones_copied: AtomicU64,
    /// Shared nodes copied because one of their parents changed them
    /// (copy-on-write of a cloned subtree).
    pub nodes_unshared: AtomicU64,
    /// Cached nodes re-keyed for the place they were reached at (moved
    /// or shared subtrees).
    pub nodes_rekeyed: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub evictions: AtomicU64,
    /// Write-backs of an eviction step (made with the tree lock let go)
    /// whose node changed before they finished: the image was dropped.
    pub write_backs_dropped: AtomicU64,
    pub checkpoints: AtomicU64,
    /// Time checkpoints held the tree lock: the total, and the longest
    /// single turn (a request may have waited that long).
    pub checkpoint_micros_total: AtomicU64,
    pub checkpoint_micros_max: AtomicU64,
    /// Time checkpoints spent writing without the tree lock (requests went
    /// on meanwhile).
    pub checkpoint_io_micros_total: AtomicU64,
    pub checkpoint_io_micros_max: AtomicU64,
    /// The longest a write spent, with the tree lock held, applying its
    /// batch (the flushes, splits and merges it set off included when it
    /// settles inline; settling in steps is `settle_step_micros_max`).
    pub apply_micros_max: AtomicU64,
    /// The longest a request spent copying a node the checkpoint in
    /// flight had not imaged yet, before changing it (`CheckpointInProgress::before_change`;
    /// part of an apply, settle or eviction hold above).
    pub checkpoint_image_micros_max: AtomicU64,
    /// Nodes copied for the checkpoint in flight (by a request about to
    /// change one, or by a turn) and encoded by its thread without the
    /// tree lock.
    pub checkpoint_node_copies: AtomicU64,
    /// Nodes a checkpoint in flight named at a write-back's extent rather
    /// than write them itself (`Tree::take_for_checkpoint`).
    pub checkpoint_nodes_from_write_backs: AtomicU64,
    /// The most content bytes of such copies a turn handed to the
    /// checkpoint's thread at once (a turn's budget and one node at most:
    /// their images are in memory together).
    pub checkpoint_copies_handed_bytes_max: AtomicU64,
    /// Node images a checkpoint encoded with the tree lock held: those of
    /// a checkpoint run under the lock (close, a full log, space
    /// reclaim), and copies still waiting at the seal. A background
    /// checkpoint copies nodes and encodes them without the lock.
    pub checkpoint_images_locked: AtomicU64,
    /// Root buffers shared with the checkpoint in flight's copy of a root
    /// that a writer copied with the tree lock let go before changing
    /// them, and those copied under the lock by a point message's change
    /// (`Arc::make_mut`): the second are the first's misses.
    pub root_buffers_copied_unlocked: AtomicU64,
    pub root_buffers_copied_locked: AtomicU64,
    /// A writer's settling in steps (`Flushing::Stepwise`): the steps
    /// after which it let waiting requests take the lock, the longest
    /// step (the longest anyone waited for a writer's flushes), and the
    /// most messages a step moved down, and the most basements of a leaf
    /// a step rewrote.
    pub settle_steps: AtomicU64,
    pub settle_step_micros_max: AtomicU64,
    pub settle_step_messages_max: AtomicU64,
    pub settle_step_basements_max: AtomicU64,
    /// Steps whose merge into a leaf was worked out before the step with
    /// the tree lock let go (`PreparedMerge`, tree/flush.rs), and the
    /// longest such merge.
    pub step_merges_unlocked: AtomicU64,
    pub step_merge_micros_max: AtomicU64,
    /// Merges worked out with the lock let go that the step found made
    /// from a leaf or buffer changed meanwhile, and made again under it.
    pub step_merges_redone: AtomicU64,
    /// Writers that left their settling to another writer's merge in
    /// flight (which settles on after it, their messages included).
    pub settling_left_to_a_merging_writer: AtomicU64,
    /// A writer's eviction in steps: the write-backs after which it let
    /// waiting requests take the lock; `evict_micros_max` is the longest
    /// step.
    pub eviction_steps: AtomicU64,
    /// Of `eviction_steps`, those the write-back thread took
    /// (`Options::background_write_back`).
    pub background_eviction_steps: AtomicU64,
    pub evict_micros_max: AtomicU64,
    /// Writes that needed a checkpoint (a full log, space low) while one
    /// was in flight, and waited for it.
    pub writes_waited_for_checkpoint: AtomicU64,
    /// Writes held back by the log: its buffer past the bound
    /// (`log_flush_writer_bytes`), they waited for its device writes to
    /// make room (how many, the longest wait, all waits together), and
    /// those of them that found no flush under way and wrote the log
    /// themselves.
    pub writes_waited_for_log: AtomicU64,
    pub log_wait_micros_max: AtomicU64,
    pub log_wait_micros_total: AtomicU64,
    pub writes_flushed_log: AtomicU64,
    /// Background flushing (`Options::background_flush`): its turns
    /// with the tree lock held (how many, the longest), and the writes
    /// that found a root's buffers past the backlog bound and waited for
    /// it (how many, the longest wait, all waits together).
    pub flush_turns: AtomicU64,
    pub flush_turn_micros_max: AtomicU64,
    pub writes_waited_for_flush: AtomicU64,
    pub flush_wait_micros_max: AtomicU64,
    pub flush_wait_micros_total: AtomicU64,
    /// Writes staged without the tree lock (`store/staging.rs`), the
    /// applications of what was staged (each under one hold of the
    /// lock), the holds that applied the oldest of them alone, handing
    /// the lock on after (`Inner::apply_staged_in_turns`), the most
    /// staged payload one hold applied, and the point queries the staged
    /// writes answered.
    pub writes_staged: AtomicU64,
    pub staged_applications: AtomicU64,
    pub staged_application_turns: AtomicU64,
    pub staged_application_bytes_max: AtomicU64,
    pub queries_answered_staged: AtomicU64,
    /// Writes' work done after their replies (`Store::work_after_reply`),
    /// and the longest such piece of work: a FUSE serving thread that
    /// does it itself takes no request of its queue meanwhile, and a
    /// request that came in waits that long before its own time (the
    /// request latency) starts.
    pub work_after_reply: AtomicU64,
    pub work_after_reply_micros_max: AtomicU64,
    /// With the applier (`Options::background_apply`): writers that found
    /// twice the staging bound staged and waited for it to take some, how
    /// long in all and the longest wait.
    pub staging_room_waits: AtomicU64,
    pub staging_room_wait_micros_total: AtomicU64,
    pub staging_room_wait_micros_max: AtomicU64,
    /// Applications that found a root past twice a node's worth (past a
    /// node where settling is inline, past twice the backlog bound with
    /// background flushing) and settled it whole under the lock
    /// (`Tree::apply_messages`): a safety valve, and a long hold.
    pub roots_settled_in_applications: AtomicU64,
    /// Settlings a FUSE serving thread left to the after-reply worker
    /// (`Store::hand_long_work_on_from_this_thread`): at a step that had
    /// to read from the device, or past its budget.
    pub settles_handed_on: AtomicU64,
    pub log_replayed_records: AtomicU64,
    /// Memory the log's buffer holds (a gauge the store sets after each
    /// append and each log write, `LogWriter::buffer_use`): clean
    /// nodes make room for it (see `Tree::clean_budget`).
    pub log_buffered: AtomicU64,
    /// What the store's user reports holding in its own tables (not a
    /// counter: a gauge the node cache's budget makes room for).
    pub memory_beside_cache: AtomicU64,
    /// What the process's allocator holds beyond the bytes allocated
    /// (freed pages not yet given back, size-class slack), as the store's
    /// user last measured it: a gauge the cache's budget makes room for.
    pub allocator_overhead: AtomicU64,
}

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// Raises a maximum to `n`, if that is more.
pub(crate) fn note_max(max: &AtomicU64, n: u64) {
    max.fetch_max(n, Ordering::Relaxed);
}

/// Raises a maximum kept in microseconds.
pub(crate) fn record_max(max: &AtomicU64, took: std::time::Duration) {
    note_max(max, took.as_micros() as u64);
}

pub(crate) fn level(height: u32) -> usize {
    (height as usize).min(LEVELS_TRACKED - 1)
}

/// A point-in-time copy of the counters.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct StatsSnapshot {
    pub user_bytes_written: u64,
    pub user_messages: u64,
    pub log_bytes_written: u64,
    pub log_flushes: u64,
    /// Log bytes appended and not yet durable (held in memory).
    pub log_unflushed_bytes: u64,
    /// Memory the log's buffer holds: the unflushed bytes, those a flush
    /// in flight writes, rounded up to its chunks (what the cache's
    /// budget makes room for).
    pub log_buffer_bytes: u64,
    /// Index = height above the leaves (0 = leaves).
    pub node_bytes_written_per_level: Vec<u64>,
    pub node_bytes_read_per_level: Vec<u64>,
    pub nodes_written: u64,
    pub nodes_read: u64,
    pub interior_nodes_read_in_part: u64,
    pub segments_read: u64,
    pub interior_nodes_completed: u64,
    pub chunk_dirs_read: u64,
    pub chunks_read: u64,
    pub nodes_read_ahead: u64,
    pub sequential_query_reads: u64,
    pub leaves_read_unlocked: u64,
    pub basement_reads_unlocked: u64,
    pub leaves_read_for_flushes: u64,
    pub nodes_warmed: u64,
    pub warm_bytes_read: u64,
    pub unlocked_reads_dropped: u64,
    pub superblock_bytes_written: u64,
    pub block_table_bytes_written: u64,
    pub device_bytes_written: u64,
    pub device_bytes_read: u64,
    pub write_amplification: f64,
    pub messages_inserted: u64,
    pub messages_flushed: u64,
    pub messages_obviated: u64,
    pub flushes: u64,
    pub splits: u64,
    pub merges: u64,
    pub subtrees_dropped: u64,
    pub range_renames_by_surgery: u64,
    pub range_renames_copied: u64,
    pub range_clones_by_surgery: u64,
    pub range_clones_copied: u64,
    pub nodes_unshared: u64,
    pub nodes_rekeyed: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub evictions: u64,
    pub write_backs_dropped: u64,
    pub checkpoints: u64,
    pub checkpoint_micros_total: u64,
    pub checkpoint_micros_max: u64,
    pub checkpoint_io_micros_total: u64,
    pub checkpoint_io_micros_max: u64,
    pub apply_micros_max: u64,
    pub checkpoint_image_micros_max: u64,
    pub checkpoint_node_copies: u64,
    pub checkpoint_nodes_from_write_backs: u64,
    pub checkpoint_copies_handed_bytes_max: u64,
    pub checkpoint_images_locked: u64,
    pub root_buffers_copied_unlocked: u64,
    pub root_buffers_copied_locked: u64,
    pub settle_steps: u64,
    pub settle_step_micros_max: u64,
    pub settle_step_messages_max: u64,
    pub settle_step_basements_max: u64,
    pub step_merges_unlocked: u64,
    pub step_merge_micros_max: u64,
    pub step_merges_redone: u64,
    pub settling_left_to_a_merging_writer: u64,
    pub eviction_steps: u64,
    pub background_eviction_steps: u64,
    pub evict_micros_max: u64,
    pub writes_waited_for_checkpoint: u64,
    pub writes_waited_for_log: u64,
    pub log_wait_micros_max: u64,
    pub log_wait_micros_total: u64,
    pub writes_flushed_log: u64,
    pub flush_turns: u64,
    pub flush_turn_micros_max: u64,
    pub writes_waited_for_flush: u64,
    pub flush_wait_micros_max: u64,
    pub flush_wait_micros_total: u64,
    pub writes_staged: u64,
    pub work_after_reply: u64,
    pub work_after_reply_micros_max: u64,
    pub staging_room_waits: u64,
    pub staging_room_wait_micros_total: u64,
    pub staging_room_wait_micros_max: u64,
    pub roots_settled_in_applications: u64,
    pub settles_handed_on: u64,
    pub staged_applications: u64,
    pub staged_application_turns: u64,
    pub staged_application_bytes_max: u64,
    pub queries_answered_staged: u64,
    /// The most any root's buffers hold now, and the bound past which
    /// writers wait for background flushing (0: writers flush themselves).
    pub flush_backlog_bytes: u64,
    pub flush_backlog_bound_bytes: u64,
    pub log_replayed_records: u64,
    pub cache_bytes: u64,
    /// The most the cache has held since the store was opened.
    pub cache_peak_bytes: u64,
    pub cache_dirty_bytes: u64,
    /// Images a checkpoint in flight holds, made by requests about to
    /// change its nodes and not yet written; the cache's budget makes room
    /// for them.
    pub checkpoint_held_image_bytes: u64,
    /// The user's tables beside the cache (see `Store::memory_beside_cache`),
    /// and the node cache's budget after making room for them.
    pub memory_beside_cache_bytes: u64,
    /// The allocator's overhead last reported (see
    /// `Store::allocator_overhead`), which the budget makes room for too.
    pub allocator_overhead_bytes: u64,
    pub cache_budget_bytes: u64,
    /// The part of the budget clean nodes may fill: less the images a
    /// checkpoint in flight holds and the allocator's overhead.
    pub cache_clean_budget_bytes: u64,
    pub tree_heights: Vec<u32>,
    pub node_region_bytes: u64,
    pub node_region_used_bytes: u64,
    /// Space promised to writes not yet made ([`crate::Reservation`]).
    pub promised_bytes: u64,
}

impl Stats {
    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let written: Vec<u64> = self.node_bytes_written.iter().map(get).collect();
        let read: Vec<u64> = self.node_bytes_read.iter().map(get).collect();
        StatsSnapshot {
            user_bytes_written: get(&self.user_bytes_written),
            user_messages: get(&self.user_messages),
            device_bytes_read: read.iter().sum(),
            node_bytes_written_per_level: written,
            node_bytes_read_per_level: read,
            nodes_written: get(&self.nodes_written),
            nodes_read: get(&self.nodes_read),
            interior_nodes_read_in_part: get(&self.interior_nodes_read_in_part),
            segments_read: get(&self.segments_read),
            interior_nodes_completed: get(&self.interior_nodes_completed),
            chunk_dirs_read: get(&self.chunk_dirs_read),
            chunks_read: get(&self.chunks_read),
            nodes_read_ahead: get(&self.nodes_read_ahead),
            sequential_query_reads: get(&self.sequential_query_reads),
            leaves_read_unlocked: get(&self.leaves_read_unlocked),
            basement_reads_unlocked: get(&self.basement_reads_unlocked),
            leaves_read_for_flushes: get(&self.leaves_read_for_flushes),
            nodes_warmed: get(&self.nodes_warmed),
            warm_bytes_read: get(&self.warm_bytes_read),
            unlocked_reads_dropped: get(&self.unlocked_reads_dropped),
            superblock_bytes_written: get(&self.superblock_bytes_written),
            block_table_bytes_written: get(&self.block_table_bytes_written),
            messages_inserted: get(&self.messages_inserted),
            messages_flushed: get(&self.messages_flushed),
            messages_obviated: get(&self.messages_obviated),
            flushes: get(&self.flushes),
            splits: get(&self.splits),
            merges: get(&self.merges),
            subtrees_dropped: get(&self.subtrees_dropped),
            range_renames_by_surgery: get(&self.range_renames_by_surgery),
            range_renames_copied: get(&self.range_renames_copied),
            range_clones_by_surgery: get(&self.range_clones_by_surgery),
            range_clones_copied: get(&self.range_clones_copied),
            nodes_unshared: get(&self.nodes_unshared),
            nodes_rekeyed: get(&self.nodes_rekeyed),
            cache_hits: get(&self.cache_hits),
            cache_misses: get(&self.cache_misses),
            evictions: get(&self.evictions),
            write_backs_dropped: get(&self.write_backs_dropped),
            checkpoints: get(&self.checkpoints),
            checkpoint_micros_total: get(&self.checkpoint_micros_total),
            checkpoint_micros_max: get(&self.checkpoint_micros_max),
            checkpoint_io_micros_total: get(&self.checkpoint_io_micros_total),
            checkpoint_io_micros_max: get(&self.checkpoint_io_micros_max),
            apply_micros_max: get(&self.apply_micros_max),
            checkpoint_image_micros_max: get(&self.checkpoint_image_micros_max),
            checkpoint_node_copies: get(&self.checkpoint_node_copies),
            checkpoint_nodes_from_write_backs: get(&self.checkpoint_nodes_from_write_backs),
            checkpoint_copies_handed_bytes_max: get(&self.checkpoint_copies_handed_bytes_max),
            checkpoint_images_locked: get(&self.checkpoint_images_locked),
            root_buffers_copied_unlocked: get(&self.root_buffers_copied_unlocked),
            root_buffers_copied_locked: get(&self.root_buffers_copied_locked),
            settle_steps: get(&self.settle_steps),
            settle_step_micros_max: get(&self.settle_step_micros_max),
            settle_step_messages_max: get(&self.settle_step_messages_max),
            settle_step_basements_max: get(&self.settle_step_basements_max),
            step_merges_unlocked: get(&self.step_merges_unlocked),
            step_merge_micros_max: get(&self.step_merge_micros_max),
            step_merges_redone: get(&self.step_merges_redone),
            settling_left_to_a_merging_writer: get(&self.settling_left_to_a_merging_writer),
            eviction_steps: get(&self.eviction_steps),
            background_eviction_steps: get(&self.background_eviction_steps),
            evict_micros_max: get(&self.evict_micros_max),
            writes_waited_for_checkpoint: get(&self.writes_waited_for_checkpoint),
            writes_waited_for_log: get(&self.writes_waited_for_log),
            log_wait_micros_max: get(&self.log_wait_micros_max),
            log_wait_micros_total: get(&self.log_wait_micros_total),
            writes_flushed_log: get(&self.writes_flushed_log),
            flush_turns: get(&self.flush_turns),
            flush_turn_micros_max: get(&self.flush_turn_micros_max),
            writes_waited_for_flush: get(&self.writes_waited_for_flush),
            flush_wait_micros_max: get(&self.flush_wait_micros_max),
            flush_wait_micros_total: get(&self.flush_wait_micros_total),
            writes_staged: get(&self.writes_staged),
            work_after_reply: get(&self.work_after_reply),
            work_after_reply_micros_max: get(&self.work_after_reply_micros_max),
            staging_room_waits: get(&self.staging_room_waits),
            staging_room_wait_micros_total: get(&self.staging_room_wait_micros_total),
            staging_room_wait_micros_max: get(&self.staging_room_wait_micros_max),
            roots_settled_in_applications: get(&self.roots_settled_in_applications),
            settles_handed_on: get(&self.settles_handed_on),
            staged_applications: get(&self.staged_applications),
            staged_application_turns: get(&self.staged_application_turns),
            staged_application_bytes_max: get(&self.staged_application_bytes_max),
            queries_answered_staged: get(&self.queries_answered_staged),
            memory_beside_cache_bytes: get(&self.memory_beside_cache),
            allocator_overhead_bytes: get(&self.allocator_overhead),
            log_replayed_records: get(&self.log_replayed_records),
            ..StatsSnapshot::default()
        }
    }
}

impl StatsSnapshot {
    /// Fills the derived totals.
    pub(crate) fn finish(&mut self) {
        self.device_bytes_written = self.log_bytes_written
            + self.node_bytes_written_per_level.iter().sum::<u64>()
            + self.superblock_bytes_written
            + self.block_table_bytes_written;
        self.write_amplification = if self.user_bytes_written == 0 {
            0.0
        } else {
            self.device_bytes_written as f64 / self.user_bytes_written as f64
        };
    }
}
