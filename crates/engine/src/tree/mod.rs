//! The B^ε-trees of one store, their node cache, block table and allocator.
//!
//! All mutation happens under the store's lock, one operation at a time.
//! Nodes move out of the cache while they are changed ([`Tree::take`]) and
//! back in afterwards ([`Tree::put`]) so memory accounting stays exact.
//! Every step that can fail (reading a node) runs before the step that
//! changes anything, so an error leaves a consistent tree behind.
//!
//! This module has the types, the helpers and opening; the rest of `Tree`
//! is split by responsibility: [`cache`] (the node map and its
//! accounting), [`io`] (reading nodes and basements), [`query`] (get and
//! range visits), [`apply`] (logged batches into the roots, range
//! renames), [`flush`] (moving messages down, background flushing),
//! [`readahead`] (leaves read ahead of a sequential scan, off the lock),
//! [`reshape`] (split, merge, subtrees), [`surgery`] (range renames that
//! move subtrees), [`writeback`] (eviction,
//! checkpoints, space) and [`verify`].

// Reviewed exception (indexing): the indices here are structural. `roots`
// and the per-level statistics are arrays indexed by a key space's or a
// level's index, which are below their lengths by construction; indices
// into a node's children, buffers, pivots and basements come from
// child_index, basement_for or loops over those counts, and the counts
// agree on every node — checked when it is loaded (validate::check_leaf,
// check_interior) and kept by split, merge and rebalance. Everything read
// from disk goes through the bounds-checked decoders and `get` first.
#![allow(clippy::indexing_slicing)]

use std::collections::{HashMap, HashSet};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::Arc;

use rustc_hash::FxHashMap;

use betreefs_store::{
    crc32c_of, AlignedBuf, BlockAllocator, Device, Extent, Layout, Superblock, BLOCK_SIZE,
};

use crate::btt::{BlockTable, Slot};
use crate::buffer::{MessageBuffer, PointMsg, RangeDel};
use crate::codec::DecodeError;
use crate::entries::Entries;
use crate::error::{EngineError, EngineResult};
use crate::format::{
    decode_basement_in_image, decode_header, decode_meta, encode_node, load_all_segments,
    load_segment, meta_end, NodeHeader, NodeImage, PlacedBasement, HEADER_BYTES,
};
use crate::merge::MergeRegistry;
use crate::message::{KeySpace, Message, RangeRename, WriteBatch, KEY_SPACES};
use crate::node::{min_end, BasementLoc, Bounds, Interior, Leaf, Node, NodeBody};
use crate::stats::{add, level, note_max, record_max, Stats};
use crate::validate;

/// An interior node read in part is read whole once queries through it
/// have needed more segments than this.
const COMPLETE_AFTER_SEGMENTS: usize = 4;

/// Shape and memory parameters of the trees.
#[derive(Clone, Debug)]
pub struct TreeOptions {
    /// A leaf holding more than this splits; an interior node whose buffers
    /// hold more than this flushes to its heaviest child.
    pub node_size: usize,
    /// Target size of the independently readable pieces of a leaf.
    pub basement_size: usize,
    /// Most children an interior node keeps before it splits.
    pub fanout: usize,
    /// Memory the node cache may use before clean nodes are dropped and dirty
    /// ones written back.
    pub cache_bytes: usize,
    /// Most point messages one step of a writer's settling moves
    /// ([`Options::settle_step_messages`](crate::Options::settle_step_messages)).
    pub settle_step_messages: usize,
}

/// What part of a leaf a reader needs.
#[derive(Clone, Copy)]
pub(crate) enum Want<'a> {
    Whole,
    Key(&'a [u8]),
    Range(&'a [u8], Option<&'a [u8]>),
}

/// What [`Tree::verify`] found besides errors.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Nodes visited (each tree's nodes, read whole).
    pub nodes: u64,
    /// Leaves among them, and the bytes of entries they hold: how full
    /// the leaves are.
    pub leaves: u64,
    pub leaf_bytes: u64,
    /// Node numbers the block table holds but no tree reaches.
    pub unreachable: Vec<u64>,
}

/// New right siblings produced by a split: (separator pivot, node number).
type Splits = Vec<(Vec<u8>, u64)>;

/// Key/value pairs of one scanned leaf range.
pub type ScanChunk = (Vec<(Vec<u8>, Vec<u8>)>, Option<Vec<u8>>);

/// Estimated on-disk bytes of a dirty node: its content, a block each for
/// the header with the meta and for the padding after the body, and in a
/// leaf a block more per basement (each begins on a block).
///
/// With the basements' padding left out, a full device's dirty nodes
/// passed the space check (`Tree::space_low`) and then took half as much
/// again when written (leaves of 64 KiB with basements of 8 KiB): the
/// checkpoint found no room, in the running store and when the store was
/// opened after a power cut (`crates/fs/tests/full_device.rs`).
fn dirty_estimate(node: &Node) -> usize {
    if !node.dirty {
        return 0;
    }
    let basements = match &node.body {
        NodeBody::Leaf(leaf) => leaf.basements.len(),
        NodeBody::Interior(_) => 0,
    };
    node.content_bytes() + (2 + basements) * BLOCK_SIZE
}

fn point_msg(seq: u64, msg: Message) -> Option<(Vec<u8>, PointMsg)> {
    match msg {
        Message::Put { key, value } => Some((key, PointMsg::put(seq, value))),
        Message::Delete { key } => Some((key, PointMsg::delete(seq))),
        Message::Upsert { key, func, arg } => Some((key, PointMsg::upsert(seq, func, arg))),
        Message::RangeDelete { .. } | Message::RangeRename(_) | Message::RangeClone(_) => None,
    }
}

/// The shortest key `s` with `left < s <= right` (suffix truncation keeps
/// pivots short, which makes lifted prefixes long).
fn separator(left: &[u8], right: &[u8]) -> Vec<u8> {
    debug_assert!(left < right);
    let common = left.iter().zip(right).take_while(|(a, b)| a == b).count();
    right[..(common + 1).min(right.len())].to_vec()
}

pub(crate) struct Tree {
    pub opts: TreeOptions,
    device: Arc<dyn Device>,
    pub layout: Layout,
    merges: Arc<MergeRegistry>,
    stats: Arc<Stats>,
    btt: BlockTable,
    pub alloc: BlockAllocator,
    pub roots: [u64; KEY_SPACES],
    /// By node number, hashed with FxHash: the numbers are the engine's
    /// own (no one can choose them to collide), and every request looks
    /// nodes up here several times.
    cache: FxHashMap<u64, Node>,
    cache_bytes: usize,
    /// The most `cache_bytes` has been (eviction runs between steps of a
    /// write: this shows how far a write overshot the budget).
    cache_bytes_peak: usize,
    dirty_bytes: usize,
    /// The clock of node uses ([`crate::node::LastUse`]): atomic, as queries on the
    /// shared lock advance it too.
    tick: AtomicU64,
    /// The sequence number the next batch gets.
    pub next_seq: u64,
    /// Generation of the newest durable superblock.
    pub generation: u64,
    btt_extent: Option<Extent>,
    /// Removal messages since the last attempt to reclaim space.
    pub removals_since_reclaim: u64,
    /// `next_seq` at the last attempt to reclaim space.
    pub reclaimed_at_seq: u64,
    /// Free blocks lying in runs long enough for the largest image when
    /// they were last counted, and the blocks allocated since (see
    /// [`Tree::image_sized_run_bytes`]).
    image_sized_free_blocks: u64,
    blocks_allocated_since_count: u64,
    /// The largest extent, in blocks, asked of the allocator since the
    /// store was opened ([`Tree::allocate_extent`]).
    largest_extent_asked: u64,
    /// Opened read-only: nothing is ever written (dirty nodes made by log
    /// replay stay in memory).
    pub read_only: bool,
    /// Nodes a checkpoint in flight has given extents that it has not yet
    /// written ([`writeback`]): clean in the cache, but not on the device,
    /// so eviction must keep them until the checkpoint is durable.
    unwritten: HashSet<u64>,
    /// Dirty nodes whose image a writer's eviction step is writing with
    /// the lock let go ([`Tree::evict_step`]), each under a token: taking
    /// the node out to change it ([`Tree::take`]) withdraws the entry, so
    /// an image that no longer shows the node is dropped on return.
    writing_back: FxHashMap<u64, u64>,
    /// The last token handed to a write-back.
    write_back_tokens: u64,
    /// A checkpoint still making its images ([`writeback`]).
    checkpoint: Option<writeback::CheckpointInProgress>,
    /// A writer's step of settling ([`Tree::settle_step`]) may have left
    /// an interior node below a root holding more than it may: the next
    /// step looks for it.
    unsettled_below_roots: bool,
    /// What a step took out of the trees for the store to free with the
    /// lock let go ([`Tree::take_freed_later`]): the part of a buffer that
    /// a merge worked out unlocked replaced, a quarter node of small
    /// messages (thousands of frees, 15% of such a step's hold).
    freed_later: Vec<MessageBuffer>,
}

impl Tree {
    /// The fields every tree starts with; `create` and `open` fill the rest.
    fn with_parts(
        device: Arc<dyn Device>,
        layout: Layout,
        opts: TreeOptions,
        merges: Arc<MergeRegistry>,
        stats: Arc<Stats>,
        btt: BlockTable,
        alloc: BlockAllocator,
    ) -> Tree {
        Tree {
            opts,
            device,
            layout,
            merges,
            stats,
            btt,
            alloc,
            roots: [0; KEY_SPACES],
            cache: FxHashMap::default(),
            cache_bytes: 0,
            cache_bytes_peak: 0,
            dirty_bytes: 0,
            tick: AtomicU64::new(0),
            next_seq: 1,
            generation: 0,
            btt_extent: None,
            removals_since_reclaim: 0,
            reclaimed_at_seq: 0,
            image_sized_free_blocks: 0,
            blocks_allocated_since_count: 0,
            largest_extent_asked: 0,
            read_only: false,
            unwritten: HashSet::new(),
            writing_back: FxHashMap::default(),
            write_back_tokens: 0,
            checkpoint: None,
            unsettled_below_roots: false,
            freed_later: Vec::new(),
        }
    }

    /// A new, empty pair of trees (one leaf root each), all dirty.
    pub fn create(
        device: Arc<dyn Device>,
        layout: Layout,
        opts: TreeOptions,
        merges: Arc<MergeRegistry>,
        stats: Arc<Stats>,
    ) -> Tree {
        let alloc = BlockAllocator::new(layout.node_blocks());
        let mut tree = Self::with_parts(
            device,
            layout,
            opts,
            merges,
            stats,
            BlockTable::default(),
            alloc,
        );
        tree.count_image_sized_runs();
        for ks in KeySpace::ALL {
            tree.roots[ks.index()] =
                tree.new_node(ks, NodeBody::Leaf(Leaf::default()), Bounds::full());
        }
        tree
    }

    /// The trees as of a durable checkpoint.
    pub fn open(
        device: Arc<dyn Device>,
        sb: &Superblock,
        opts: TreeOptions,
        merges: Arc<MergeRegistry>,
        stats: Arc<Stats>,
    ) -> EngineResult<Tree> {
        let layout = sb.layout;
        let mut buf = AlignedBuf::zeroed(sb.btt.len as usize);
        device
            .read_at(&mut buf, layout.extent_offset(sb.btt))
            .map_err(|e| betreefs_store::StoreError::io("reading block table", e))?;
        let bytes = buf.get(..sb.btt.len as usize).unwrap_or_default();
        if crc32c_of(&[bytes]) != sb.btt_crc {
            return Err(EngineError::CorruptBlockTable("checksum mismatch".into()));
        }
        let btt = BlockTable::decode(bytes).map_err(|e| EngineError::CorruptBlockTable(e.0))?;
        let mut alloc = BlockAllocator::new(layout.node_blocks());
        if !alloc.mark_loaded(sb.btt) {
            return Err(EngineError::CorruptBlockTable(
                "table extent outside the node region".into(),
            ));
        }
        for (num, extent) in btt.extents() {
            if !alloc.mark_loaded(extent) {
                return Err(EngineError::CorruptBlockTable(format!(
                    "node {num} at {extent:?} overlaps another or lies outside the region"
                )));
            }
        }
        let mut roots = [0; KEY_SPACES];
        for ks in KeySpace::ALL {
            let root = *sb
                .roots
                .get(ks.index())
                .ok_or_else(|| EngineError::CorruptBlockTable("missing root".into()))?;
            if !matches!(btt.get(root), Slot::OnDisk { .. }) {
                return Err(EngineError::CorruptBlockTable(format!(
                    "root {root} of tree {} is not a written node",
                    ks.index()
                )));
            }
            roots[ks.index()] = root;
        }
        let mut tree = Self::with_parts(device, layout, opts, merges, stats, btt, alloc);
        tree.count_image_sized_runs();
        tree.roots = roots;
        tree.next_seq = sb.checkpoint_seq + 1;
        tree.generation = sb.generation;
        tree.btt_extent = Some(sb.btt);
        Ok(tree)
    }

    pub fn cache_bytes(&self) -> usize {
        self.cache_bytes
    }

    pub fn cache_bytes_peak(&self) -> usize {
        self.cache_bytes_peak
    }

    pub fn dirty_bytes(&self) -> usize {
        self.dirty_bytes
    }

    pub fn heights(&self) -> Vec<u32> {
        self.root_heights().collect()
    }

    /// Each tree's height (0 for a root not cached, which only an open
    /// without warming leaves so).
    fn root_heights(&self) -> impl Iterator<Item = u32> + '_ {
        self.roots
            .iter()
            .map(|r| self.cache.get(r).map_or(0, |n| n.height()))
    }
}

mod apply;
mod cache;
mod flush;
mod io;
mod query;
pub mod readahead;
mod reshape;
mod share;
mod surgery;
mod verify;
mod warm;
mod writeback;
pub use apply::SharedBuffer;
pub(crate) use flush::Flushing;
pub use query::PairVisitor;
pub(crate) use query::{LeafVisited, Shared};
pub use writeback::DirtyBudget;
pub(crate) use writeback::{encode_snapshots, NodeWrites, SnapshotImages};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separators_are_short_and_between() {
        assert_eq!(separator(b"apple", b"banana"), b"b");
        assert_eq!(separator(b"dir\x00cat", b"dir\x00dog"), b"dir\x00d");
        assert_eq!(separator(b"ab", b"abc"), b"abc");
    }
}
