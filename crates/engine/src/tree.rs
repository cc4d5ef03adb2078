//! The B^ε-trees of one store, their node cache, block table and allocator.
//!
//! All mutation happens under the store's lock, one operation at a time.
//! Nodes move out of the cache while they are changed ([`Tree::take`]) and
//! back in afterwards ([`Tree::put`]) so memory accounting stays exact.
//! Every step that can fail (reading a node) runs before the step that
//! changes anything, so an error leaves a consistent tree behind.

// Reviewed exception (indexing): the indices here are structural. `roots`
// and the per-level statistics are arrays indexed by a key space's or a
// level's index, which are below their lengths by construction; indices
// into a node's children, buffers, pivots and basements come from
// child_index, basement_for or loops over those counts, and the counts
// agree on every node — checked when it is loaded (validate::check_leaf,
// check_interior) and kept by split, merge and rebalance. Everything read
// from disk goes through the bounds-checked decoders and `get` first.
#![allow(clippy::indexing_slicing)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Bound;
use std::sync::Arc;

use betreefs_store::{
    crc32c_of, AlignedBuf, BlockAllocator, Device, Extent, Layout, Superblock, BLOCK_SIZE,
};

use crate::btt::{BlockTable, Slot};
use crate::buffer::{MessageBuffer, PointMsg, RangeDel};
use crate::codec::DecodeError;
use crate::entries::Entries;
use crate::error::{EngineError, EngineResult};
use crate::format::{
    decode_basement, decode_header, decode_meta, encode_node, meta_end, HEADER_BYTES,
};
use crate::merge::MergeRegistry;
use crate::message::{KeySpace, Message, RangeRename, WriteBatch, KEY_SPACES};
use crate::node::{Bounds, Interior, Leaf, Node, NodeBody};
use crate::stats::{add, level, Stats};
use crate::validate;

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
}

/// What part of a leaf a reader needs.
#[derive(Clone, Copy)]
enum Want<'a> {
    Whole,
    Key(&'a [u8]),
    Range(&'a [u8], Option<&'a [u8]>),
}

/// What [`Tree::verify`] found besides errors.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Nodes visited (each tree's nodes, read whole).
    pub nodes: u64,
    /// Node numbers the block table holds but no tree reaches.
    pub unreachable: Vec<u64>,
}

/// New right siblings produced by a split: (separator pivot, node number).
type Splits = Vec<(Vec<u8>, u64)>;

/// Key/value pairs of one scanned leaf range.
pub type ScanChunk = (Vec<(Vec<u8>, Vec<u8>)>, Option<Vec<u8>>);

/// Estimated on-disk bytes of a dirty node (header, meta and padding).
fn dirty_estimate(node: &Node) -> usize {
    if node.dirty {
        node.content_bytes() + 2 * BLOCK_SIZE
    } else {
        0
    }
}

fn point_msg(seq: u64, msg: &Message) -> Option<(Vec<u8>, PointMsg)> {
    match msg {
        Message::Put { key, value } => Some((key.clone(), PointMsg::put(seq, value.clone()))),
        Message::Delete { key } => Some((key.clone(), PointMsg::delete(seq))),
        Message::Upsert { key, func, arg } => {
            Some((key.clone(), PointMsg::upsert(seq, *func, arg.clone())))
        }
        Message::RangeDelete { .. } | Message::RangeRename(_) => None,
    }
}

/// The shortest key `s` with `left < s <= right` (suffix truncation keeps
/// pivots short, which makes lifted prefixes long).
fn separator(left: &[u8], right: &[u8]) -> Vec<u8> {
    debug_assert!(left < right);
    let common = left.iter().zip(right).take_while(|(a, b)| a == b).count();
    right[..(common + 1).min(right.len())].to_vec()
}

fn min_end<'a>(a: Option<&'a [u8]>, b: Option<&'a [u8]>) -> Option<&'a [u8]> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// The messages of `buffer` that concern [lo, hi), range deletes clamped.
fn restricted(buffer: &MessageBuffer, lo: &[u8], hi: Option<&[u8]>) -> MessageBuffer {
    let mut out = MessageBuffer::default();
    let upper = hi.map_or(Bound::Unbounded, Bound::Excluded);
    if let Some((start, r)) = buffer.covering(lo) {
        if start.as_slice() < lo {
            let end = min_end(Some(&r.end), hi).unwrap_or(&r.end).to_vec();
            out.push_decoded_range(lo.to_vec(), RangeDel { end, seq: r.seq });
        }
    }
    for (start, r) in buffer
        .ranges()
        .range::<[u8], _>((Bound::Included(lo), upper))
    {
        let end = min_end(Some(&r.end), hi).unwrap_or(&r.end).to_vec();
        out.push_decoded_range(start.clone(), RangeDel { end, seq: r.seq });
    }
    for (k, m) in buffer
        .points()
        .range::<[u8], _>((Bound::Included(lo), upper))
    {
        out.push_decoded_point(k.clone(), m.clone());
    }
    out
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
    cache: HashMap<u64, Node>,
    cache_bytes: usize,
    dirty_bytes: usize,
    tick: u64,
    /// The sequence number the next batch gets.
    pub next_seq: u64,
    /// Generation of the newest durable superblock.
    pub generation: u64,
    btt_extent: Option<Extent>,
    /// Removal messages since the last attempt to reclaim space.
    pub removals_since_reclaim: u64,
    /// Free blocks lying in runs long enough for a full node, and all
    /// blocks in use, as of the last checkpoint (see [`Tree::space_low`]).
    node_sized_free_blocks: u64,
    used_blocks_at_checkpoint: u64,
    /// Opened read-only: nothing is ever written (dirty nodes made by log
    /// replay stay in memory).
    pub read_only: bool,
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
            cache: HashMap::new(),
            cache_bytes: 0,
            dirty_bytes: 0,
            tick: 0,
            next_seq: 1,
            generation: 0,
            btt_extent: None,
            removals_since_reclaim: 0,
            node_sized_free_blocks: u64::MAX,
            used_blocks_at_checkpoint: 0,
            read_only: false,
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
        tree.roots = roots;
        tree.next_seq = sb.checkpoint_seq + 1;
        tree.generation = sb.generation;
        tree.btt_extent = Some(sb.btt);
        Ok(tree)
    }

    pub fn cache_bytes(&self) -> usize {
        self.cache_bytes
    }

    pub fn dirty_bytes(&self) -> usize {
        self.dirty_bytes
    }

    pub fn heights(&self) -> Vec<u32> {
        self.roots
            .iter()
            .map(|r| self.cache.get(r).map_or(0, |n| n.height()))
            .collect()
    }

    // ---- cache bookkeeping -------------------------------------------------

    fn take(&mut self, num: u64) -> Node {
        let node = match self.cache.remove(&num) {
            Some(node) => node,
            None => panic!("tree invariant: node {num} must be cached here"),
        };
        self.cache_bytes -= node.mem_bytes();
        self.dirty_bytes -= dirty_estimate(&node);
        node
    }

    fn put(&mut self, num: u64, mut node: Node) {
        self.tick += 1;
        node.last_used = self.tick;
        self.cache_bytes += node.mem_bytes();
        self.dirty_bytes += dirty_estimate(&node);
        let previous = self.cache.insert(num, node);
        debug_assert!(previous.is_none(), "node {num} cached twice");
    }

    fn new_node(&mut self, ks: KeySpace, body: NodeBody, bounds: Bounds) -> u64 {
        let num = self.btt.allocate();
        self.put(
            num,
            Node {
                body,
                bounds,
                tree: ks as u8,
                dirty: true,
                last_used: 0,
            },
        );
        num
    }

    fn node(&self, num: u64) -> &Node {
        match self.cache.get(&num) {
            Some(node) => node,
            None => panic!("tree invariant: node {num} must be cached here"),
        }
    }

    fn interior(&self, num: u64) -> &Interior {
        match &self.node(num).body {
            NodeBody::Interior(int) => int,
            NodeBody::Leaf(_) => panic!("tree invariant: node {num} must be interior"),
        }
    }

    /// Changes an interior node in place (marking it dirty).
    fn with_interior<R>(&mut self, num: u64, f: impl FnOnce(&mut Interior) -> R) -> R {
        let mut node = self.take(num);
        let result = match &mut node.body {
            NodeBody::Interior(int) => f(int),
            NodeBody::Leaf(_) => panic!("tree invariant: node {num} must be interior"),
        };
        node.dirty = true;
        self.put(num, node);
        result
    }

    /// Drops a node from the cache and the block table, releasing its extent.
    fn free_node(&mut self, num: u64) {
        if self.cache.contains_key(&num) {
            drop(self.take(num));
        }
        if let Some(extent) = self.btt.release(num) {
            self.alloc.free(extent);
        }
    }

    // ---- reading nodes ----------------------------------------------------

    fn corrupt(ks: KeySpace, num: u64, reason: impl Into<String>) -> EngineError {
        EngineError::CorruptNode {
            tree: ks as u8,
            num,
            reason: reason.into(),
        }
    }

    fn read_extent_bytes(
        &self,
        extent: Extent,
        offset: u64,
        len: usize,
        height: u32,
    ) -> EngineResult<AlignedBuf> {
        let mut buf = AlignedBuf::for_overwrite(len);
        self.device
            .read_at(&mut buf, self.layout.extent_offset(extent) + offset)
            .map_err(|e| betreefs_store::StoreError::io("reading node", e))?;
        add(&self.stats.node_bytes_read[level(height)], buf.len() as u64);
        Ok(buf)
    }

    /// Makes sure node `num` is cached with what `want` needs loaded, and
    /// (when known) that it sits at `height`. `bounds` are the node's key
    /// range from its parent; its lifted prefix is only needed to read.
    fn load(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        want: Want<'_>,
        height: Option<u32>,
    ) -> EngineResult<()> {
        if let Some(node) = self.cache.get_mut(&num) {
            self.tick += 1;
            node.last_used = self.tick;
            if node.bounds != *bounds {
                // Reached from a parent that disagrees with where the node
                // was found before: it is referenced twice, or the pivots
                // above it changed under it.
                return Err(Self::corrupt(
                    ks,
                    num,
                    format!(
                        "reached with bounds {bounds:?} but known with {:?}",
                        node.bounds
                    ),
                ));
            }
            if let Some(h) = height.filter(|&h| h != node.height()) {
                return Err(Self::corrupt(
                    ks,
                    num,
                    format!("at height {} where {h} was expected", node.height()),
                ));
            }
            let missing = match &node.body {
                NodeBody::Leaf(leaf) => {
                    Self::basement_span(leaf, want).any(|i| leaf.basements[i].entries.is_none())
                }
                NodeBody::Interior(_) => false,
            };
            if !missing {
                add(&self.stats.cache_hits, 1);
                return Ok(());
            }
            add(&self.stats.cache_misses, 1);
            let mut node = self.take(num);
            let result = self.read_basements(ks, num, &mut node, want);
            self.put(num, node);
            return result;
        }
        let prefix = bounds.lifted_prefix();
        let prefix = prefix.as_slice();
        add(&self.stats.cache_misses, 1);
        let Slot::OnDisk { extent, crc } = self.btt.get(num) else {
            return Err(Self::corrupt(ks, num, "referenced but never written"));
        };
        let bad = |e: DecodeError| Self::corrupt(ks, num, e.0);
        let whole = matches!(want, Want::Whole);
        let first_len = if whole {
            extent.len as usize
        } else {
            (extent.len as usize).min(BLOCK_SIZE)
        };
        let mut head = self.read_extent_bytes(extent, 0, first_len, height.unwrap_or(0))?;
        let header = decode_header(&head, crc, num, prefix).map_err(bad)?;
        if header.tree != ks as u8 {
            return Err(Self::corrupt(
                ks,
                num,
                format!("belongs to tree {}", header.tree),
            ));
        }
        if header.total_len > extent.len {
            return Err(Self::corrupt(ks, num, "longer than its extent"));
        }
        if let Some(h) = height {
            if header.height != h {
                return Err(Self::corrupt(
                    ks,
                    num,
                    format!("at height {} where {h} was expected", header.height),
                ));
            }
        }
        if meta_end(&header) > head.len() {
            head = self.read_extent_bytes(extent, 0, meta_end(&header), header.height)?;
        }
        let meta = head
            .get(HEADER_BYTES..meta_end(&header))
            .ok_or_else(|| Self::corrupt(ks, num, "meta beyond the node"))?;
        let mut node = decode_meta(&header, meta, bounds).map_err(bad)?;
        let max_seq = self.next_seq.saturating_sub(1);
        match &node.body {
            NodeBody::Interior(int) => {
                validate::check_interior(int, bounds, num, &self.merges, max_seq)
            }
            NodeBody::Leaf(leaf) => validate::check_leaf(leaf, bounds),
        }
        .map_err(|reason| Self::corrupt(ks, num, reason))?;
        add(&self.stats.nodes_read, 1);
        let result = if let (true, NodeBody::Leaf(leaf)) = (whole, &mut node.body) {
            // The whole extent is in memory already: decode every basement from it.
            (0..leaf.basements.len()).try_for_each(|i| {
                let Some(loc) = leaf.basements[i].loc else {
                    return Err(Self::corrupt(ks, num, "basement without location"));
                };
                let bytes = head
                    .get(loc.offset as usize..(loc.offset as usize + loc.len as usize))
                    .ok_or_else(|| Self::corrupt(ks, num, "basement beyond node"))?;
                let entries = Self::decode_checked_basement(ks, num, leaf, i, bounds, bytes)?;
                leaf.basements[i].entries = Some(entries);
                Ok(())
            })
        } else {
            self.read_basements(ks, num, &mut node, want)
        };
        result?;
        self.put(num, node);
        Ok(())
    }

    /// Decodes basement `i` of a leaf with bounds `bounds` from its bytes
    /// and checks that its keys lie in the basement's range.
    fn decode_checked_basement(
        ks: KeySpace,
        num: u64,
        leaf: &Leaf,
        i: usize,
        bounds: &Bounds,
        bytes: &[u8],
    ) -> EngineResult<Entries> {
        let b = &leaf.basements[i];
        let Some(loc) = b.loc else {
            return Err(Self::corrupt(ks, num, "basement without location"));
        };
        let prefix = bounds.lifted_prefix();
        let entries = decode_basement(bytes, &loc, b.count, &prefix)
            .map_err(|e| Self::corrupt(ks, num, e.0))?;
        validate::check_basement(&entries, &validate::basement_bounds(leaf, i, bounds))
            .map_err(|reason| Self::corrupt(ks, num, reason))?;
        Ok(entries)
    }

    /// The basements `want` covers.
    fn basement_span(leaf: &Leaf, want: Want<'_>) -> std::ops::RangeInclusive<usize> {
        let (first, last) = match want {
            Want::Whole => (0, leaf.basements.len() - 1),
            Want::Key(k) => (leaf.basement_for(k), leaf.basement_for(k)),
            Want::Range(s, e) => {
                let first = leaf.basement_for(s);
                let last = e.map_or(leaf.basements.len() - 1, |e| leaf.basement_for(e));
                // A scan over more than one basement is read ahead to the
                // end of the leaf (in the same IO): a sequential reader
                // asks for the rest next. Small ranges read only what they
                // touch, so random reads stay cheap.
                (
                    first,
                    if last > first {
                        leaf.basements.len() - 1
                    } else {
                        last
                    },
                )
            }
        };
        first..=last
    }

    fn read_basements(
        &self,
        ks: KeySpace,
        num: u64,
        node: &mut Node,
        want: Want<'_>,
    ) -> EngineResult<()> {
        let NodeBody::Leaf(leaf) = &mut node.body else {
            return Ok(());
        };
        let Slot::OnDisk { extent, .. } = self.btt.get(num) else {
            return Err(Self::corrupt(ks, num, "partly loaded leaf has no extent"));
        };
        // The missing basements of the span, read with one IO: basements
        // lie in key order at increasing offsets of the node's extent.
        let span = Self::basement_span(leaf, want);
        let missing: Vec<usize> = span
            .filter(|&i| leaf.basements[i].entries.is_none())
            .collect();
        let mut locs = Vec::with_capacity(missing.len());
        for &i in &missing {
            let Some(loc) = leaf.basements[i].loc else {
                return Err(Self::corrupt(ks, num, "basement without location"));
            };
            locs.push(loc);
        }
        let (Some(first), Some(last)) = (locs.first(), locs.last()) else {
            return Ok(());
        };
        let lo = first.offset as u64;
        let hi = last.offset as u64 + last.len as u64;
        let in_order = locs
            .iter()
            .zip(locs.iter().skip(1))
            .all(|(a, b)| a.offset <= b.offset);
        if !in_order || hi < lo {
            return Err(Self::corrupt(ks, num, "basements out of order"));
        }
        let buf = self.read_extent_bytes(extent, lo, (hi - lo) as usize, 0)?;
        for (&i, loc) in missing.iter().zip(&locs) {
            let at = (loc.offset as u64 - lo) as usize;
            // Offsets are in order, but a damaged length could still run
            // past what was read.
            let bytes = buf
                .get(at..at + loc.len as usize)
                .ok_or_else(|| Self::corrupt(ks, num, "basement runs past the next one"))?;
            let entries = Self::decode_checked_basement(ks, num, leaf, i, &node.bounds, bytes)?;
            leaf.basements[i].entries = Some(entries);
        }
        Ok(())
    }

    // ---- queries ----------------------------------------------------------

    /// Point query: the leaf value with the pending messages on the
    /// root-to-leaf path applied on the fly. Queries never change the tree
    /// (the 0.6 apply-on-query policy taken to its end: flushes alone move
    /// messages down, so a read never dirties a node).
    pub fn get(&mut self, ks: KeySpace, key: &[u8]) -> EngineResult<Option<Vec<u8>>> {
        let mut pending: Vec<PointMsg> = Vec::new();
        let mut num = self.roots[ks.index()];
        let mut bounds = Bounds::full();
        let mut height = None;
        let base = loop {
            self.load(ks, num, &bounds, Want::Key(key), height)?;
            match &self.node(num).body {
                NodeBody::Interior(int) => {
                    let i = int.child_index(key);
                    let buf = &int.buffers[i];
                    if let Some(m) = buf.points().get(key) {
                        pending.push(m.clone());
                        if m.hides_older() {
                            break None;
                        }
                    }
                    if buf.covering(key).is_some() {
                        break None;
                    }
                    bounds = int.child_bounds(i, &bounds);
                    height = Some(int.height - 1);
                    num = int.children[i];
                }
                NodeBody::Leaf(leaf) => break leaf.get(key).flatten().map(|v| v.to_vec()),
            }
        };
        pending.into_iter().rev().try_fold(base, |value, m| {
            m.into_value(value, &self.merges)
                .map_err(EngineError::UnknownMergeFunction)
        })
    }

    /// Scans [start, end) within the leaf holding `start`: returns its pairs
    /// and where the next leaf begins (if still before `end`).
    pub fn scan_leaf(
        &mut self,
        ks: KeySpace,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> EngineResult<ScanChunk> {
        let mut result = Vec::new();
        let next = self.visit_leaf(ks, start, end, &mut |k, v| {
            result.push((k.to_vec(), v.to_vec()))
        })?;
        Ok((result, next))
    }

    /// Like [`Tree::scan_leaf`], but hands each pair to `visit` as borrowed
    /// slices: with nothing pending above the leaf (the common case) no
    /// pair is copied or allocated. Returns where the next leaf begins.
    pub fn visit_leaf(
        &mut self,
        ks: KeySpace,
        start: &[u8],
        end: Option<&[u8]>,
        visit: &mut dyn FnMut(&[u8], &[u8]),
    ) -> EngineResult<Option<Vec<u8>>> {
        let mut levels: Vec<MessageBuffer> = Vec::new();
        let mut num = self.roots[ks.index()];
        let mut bounds = Bounds::full();
        let mut height = None;
        loop {
            let hi = min_end(end, bounds.hi.as_deref()).map(|h| h.to_vec());
            self.load(ks, num, &bounds, Want::Range(start, hi.as_deref()), height)?;
            match &self.node(num).body {
                NodeBody::Interior(int) => {
                    let i = int.child_index(start);
                    let child_bounds = int.child_bounds(i, &bounds);
                    let hi = min_end(end, child_bounds.hi.as_deref());
                    levels.push(restricted(&int.buffers[i], start, hi));
                    height = Some(int.height - 1);
                    num = int.children[i];
                    bounds = child_bounds;
                }
                NodeBody::Leaf(leaf) => {
                    let hi = min_end(end, bounds.hi.as_deref());
                    let last = hi.map_or(leaf.basements.len() - 1, |h| leaf.basement_for(h));
                    let entries = leaf.basements[leaf.basement_for(start)..=last]
                        .iter()
                        .flat_map(|b| {
                            let Some(entries) = &b.entries else {
                                unreachable!("loaded above")
                            };
                            (entries.lower_bound(start)..entries.len())
                                .map(move |i| (entries.key(i), entries.value(i)))
                        });
                    let entries = entries.take_while(|(k, _)| hi.is_none_or(|h| *k < h));
                    // Upper levels were restricted to their child's range, which
                    // is wider than this leaf's: cut them to the leaf's.
                    let levels: Vec<MessageBuffer> = levels
                        .iter()
                        .map(|l| restricted(l, start, hi))
                        .filter(|l| !l.is_empty())
                        .collect();
                    if levels.is_empty() {
                        // The common case: nothing pending here.
                        for (k, v) in entries {
                            visit(k, v);
                        }
                    } else {
                        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> =
                            entries.map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
                        for level in levels.iter().rev() {
                            for (s, r) in level.ranges() {
                                let mut doomed = merged.split_off(s);
                                let mut kept = doomed.split_off(&r.end);
                                merged.append(&mut kept);
                            }
                            for (k, m) in level.points() {
                                match m.apply(merged.get(k).map(|v| v.as_slice()), &self.merges) {
                                    Ok(Some(v)) => {
                                        merged.insert(k.clone(), v);
                                    }
                                    Ok(None) => {
                                        merged.remove(k);
                                    }
                                    Err(id) => return Err(EngineError::UnknownMergeFunction(id)),
                                }
                            }
                        }
                        for (k, v) in &merged {
                            visit(k, v);
                        }
                    }
                    let next = match (&bounds.hi, end) {
                        (Some(h), Some(e)) if h.as_slice() < e => Some(h.clone()),
                        (Some(h), None) => Some(h.clone()),
                        _ => None,
                    };
                    return Ok(next);
                }
            }
        }
    }

    // ---- updates ----------------------------------------------------------

    /// Applies one batch (already logged) with sequence number `seq`.
    pub fn apply_batch(&mut self, seq: u64, batch: &WriteBatch) -> EngineResult<()> {
        let mut touched = [false; KEY_SPACES];
        for (ks, msg) in batch.messages() {
            match msg {
                Message::RangeRename(r) => self.apply_range_rename(*ks, seq, r)?,
                _ => self.apply_message(*ks, seq, msg)?,
            }
            touched[ks.index()] = true;
            if msg.is_removal() {
                self.removals_since_reclaim += 1;
            }
        }
        for ks in KeySpace::ALL {
            if touched[ks.index()] {
                self.settle_root(ks)?;
            }
        }
        Ok(())
    }

    /// A range rename by copying (BetrFS 0.4 §5 before tree surgery): clear
    /// the destination, put a copy of every source pair there, one leaf at
    /// a time with the tree settled in between (so a large subtree never
    /// piles up in the root), then range-delete the source. Every message
    /// carries the rename's sequence number; they are applied in this order
    /// exactly as if the batch had listed them, and log replay repeats it
    /// on the same state, so the result is the same.
    fn apply_range_rename(&mut self, ks: KeySpace, seq: u64, r: &RangeRename) -> EngineResult<()> {
        let (start, end) = r.destination_range();
        self.apply_message(ks, seq, &Message::RangeDelete { start, end })?;
        let mut next: Option<Vec<u8>> = Some(r.start.clone());
        while let Some(from) = next {
            let (items, after) = self.scan_leaf(ks, &from, Some(&r.end))?;
            for (key, value) in items {
                let key = r.destination(&key);
                self.apply_message(ks, seq, &Message::Put { key, value })?;
            }
            self.settle_root(ks)?;
            match self.evict_if_needed() {
                Err(e) if !e.is_no_space() => return Err(e),
                _ => {}
            }
            next = after;
        }
        let (start, end) = (r.start.clone(), r.end.clone());
        self.apply_message(ks, seq, &Message::RangeDelete { start, end })?;
        self.removals_since_reclaim += 1;
        Ok(())
    }

    /// The root, loaded, with a buffer put above it if it is a leaf.
    /// Applied to a leaf, every message would rebuild a packed basement (a
    /// copy of up to `basement_size` bytes); a buffer takes it in O(log n)
    /// and flushes in batches, as everywhere else in the tree. Small trees
    /// (a fresh file system's metadata) are exactly where single messages
    /// arrive one at a time. `settle_root` keeps a root over a single leaf.
    fn interior_root(&mut self, ks: KeySpace) -> EngineResult<u64> {
        let root = self.roots[ks.index()];
        self.load(ks, root, &Bounds::full(), Want::Whole, None)?;
        if self.node(root).height() == 0 {
            let int = Interior {
                height: 1,
                pivots: Vec::new(),
                children: vec![root],
                buffers: vec![MessageBuffer::default()],
            };
            self.roots[ks.index()] = self.new_node(ks, NodeBody::Interior(int), Bounds::full());
        }
        Ok(self.roots[ks.index()])
    }

    fn apply_message(&mut self, ks: KeySpace, seq: u64, msg: &Message) -> EngineResult<()> {
        let root = self.interior_root(ks)?;
        let mut node = self.take(root);
        let NodeBody::Interior(int) = &mut node.body else {
            unreachable!("interior_root returns an interior node")
        };
        let eaten = match (msg, point_msg(seq, msg)) {
            (Message::RangeDelete { start, end }, _) => {
                int.insert_range_delete(start, end, seq, &Bounds::full())
            }
            (_, Some((key, m))) => int.insert_point(key, m, &self.merges),
            (_, None) => 0,
        };
        add(&self.stats.messages_obviated, eaten as u64);
        node.dirty = true;
        self.put(root, node);
        add(&self.stats.messages_inserted, 1);
        Ok(())
    }

    /// Flushes, splits and collapses at the root until it is within bounds.
    fn settle_root(&mut self, ks: KeySpace) -> EngineResult<()> {
        let root = self.roots[ks.index()];
        let splits = self.settle(ks, root, &Bounds::full())?;
        if !splits.is_empty() {
            let height = self.node(root).height() + 1;
            let mut int = Interior {
                height,
                pivots: Vec::new(),
                children: vec![root],
                buffers: vec![MessageBuffer::default()],
            };
            for (pivot, num) in splits {
                int.pivots.push(pivot);
                int.children.push(num);
                int.buffers.push(MessageBuffer::default());
            }
            self.roots[ks.index()] = self.new_node(ks, NodeBody::Interior(int), Bounds::full());
        }
        // A root with one interior child is only a detour: empty its buffer
        // and drop it. Over a single leaf it stays: its buffer is what
        // batches small writes for that leaf (see `grow_leaf_root`).
        loop {
            let root = self.roots[ks.index()];
            let NodeBody::Interior(int) = &self.node(root).body else {
                break;
            };
            if int.children.len() != 1 || int.height < 2 {
                break;
            }
            if !int.buffers[0].is_empty() {
                self.flush_child(ks, root, 0, &Bounds::full())?;
                continue;
            }
            let child = int.children[0];
            self.load(
                ks,
                child,
                &Bounds::full(),
                Want::Whole,
                Some(int.height - 1),
            )?;
            self.free_node(root);
            self.roots[ks.index()] = child;
        }
        Ok(())
    }

    /// Flushes node `num` until its buffers fit, then splits it if it is too
    /// big. Returns the new right siblings for the parent to adopt.
    fn settle(&mut self, ks: KeySpace, num: u64, bounds: &Bounds) -> EngineResult<Splits> {
        while let NodeBody::Interior(int) = &self.node(num).body {
            if int.buffer_bytes() <= self.opts.node_size {
                break;
            }
            let heaviest = (0..int.buffers.len())
                .max_by_key(|&i| int.buffers[i].bytes())
                .unwrap_or(0);
            self.flush_child(ks, num, heaviest, bounds)?;
        }
        self.split_if_needed(ks, num, bounds)
    }

    /// Moves the buffer for child `i` of `parent` into the child, settles
    /// the child, adopts its splits and merges it if it became too small.
    fn flush_child(
        &mut self,
        ks: KeySpace,
        parent: u64,
        i: usize,
        parent_bounds: &Bounds,
    ) -> EngineResult<()> {
        let int = self.interior(parent);
        let child_bounds = int.child_bounds(i, parent_bounds);
        let child_height = int.height - 1;
        let mut child = int.children[i];
        if int.buffers[i].covers_whole(&child_bounds.lo, child_bounds.hi.as_deref()) {
            // A range delete covers the whole child: drop its subtree without
            // reading a single leaf and start over with an empty one.
            let doomed = self.collect_subtree(ks, child, &child_bounds, child_height)?;
            let fresh = self.empty_subtree(ks, child_height, &child_bounds);
            for num in doomed {
                self.free_node(num);
            }
            self.with_interior(parent, |int| int.children[i] = fresh);
            add(&self.stats.subtrees_dropped, 1);
            child = fresh;
        } else {
            self.load(ks, child, &child_bounds, Want::Whole, Some(child_height))?;
        }
        let batch = self.with_interior(parent, |int| int.buffers[i].take());
        let count = batch.message_count() as u64;
        let merges = self.merges.clone();
        let mut node = self.take(child);
        let result = match &mut node.body {
            NodeBody::Leaf(leaf) => {
                let r = leaf.apply_buffer(batch, &merges);
                leaf.rebalance_basements(self.opts.basement_size);
                r.map_err(EngineError::UnknownMergeFunction)
            }
            NodeBody::Interior(int) => {
                let eaten = int.absorb_batch(batch, &child_bounds, &merges);
                add(&self.stats.messages_obviated, eaten as u64);
                Ok(())
            }
        };
        node.dirty = true;
        self.put(child, node);
        result?;
        add(&self.stats.flushes, 1);
        add(&self.stats.messages_flushed, count);
        let splits = self.settle(ks, child, &child_bounds)?;
        self.adopt_splits(parent, i, splits);
        self.maybe_merge(ks, parent, i, parent_bounds)
    }

    /// Inserts the right siblings a split of child `i` produced. The
    /// parent's buffer for child `i` is cut at the new pivots so every
    /// message stays with the child whose range holds its key (after a
    /// merge-then-resplit that buffer is not empty).
    fn adopt_splits(&mut self, parent: u64, i: usize, splits: Splits) {
        if splits.is_empty() {
            return;
        }
        self.with_interior(parent, |int| {
            for (k, (pivot, num)) in splits.into_iter().enumerate() {
                let right = int.buffers[i + k].split_off(&pivot);
                int.pivots.insert(i + k, pivot);
                int.children.insert(i + 1 + k, num);
                int.buffers.insert(i + 1 + k, right);
            }
        });
    }

    /// Every node number in a subtree; leaves are not read.
    fn collect_subtree(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        height: u32,
    ) -> EngineResult<Vec<u64>> {
        let mut out = vec![num];
        if height > 0 {
            self.load(ks, num, bounds, Want::Whole, Some(height))?;
            let int = self.interior(num);
            let kids: Vec<(u64, Bounds)> = (0..int.children.len())
                .map(|j| (int.children[j], int.child_bounds(j, bounds)))
                .collect();
            for (child, child_bounds) in kids {
                out.extend(self.collect_subtree(ks, child, &child_bounds, height - 1)?);
            }
        }
        Ok(out)
    }

    /// An empty subtree of the given height: a chain of single-child
    /// interior nodes over an empty leaf (merges heal it later).
    fn empty_subtree(&mut self, ks: KeySpace, height: u32, bounds: &Bounds) -> u64 {
        let mut num = self.new_node(ks, NodeBody::Leaf(Leaf::default()), bounds.clone());
        for h in 1..=height {
            let int = Interior {
                height: h,
                pivots: Vec::new(),
                children: vec![num],
                buffers: vec![MessageBuffer::default()],
            };
            num = self.new_node(ks, NodeBody::Interior(int), bounds.clone());
        }
        num
    }

    fn is_underfull(&self, node: &Node) -> bool {
        match &node.body {
            NodeBody::Leaf(leaf) => leaf.bytes() < self.opts.node_size / 4,
            NodeBody::Interior(int) => int.children.len() < (self.opts.fanout / 4).max(2),
        }
    }

    /// Merges child `i` with a neighbour when it has become too small; the
    /// merged node splits again if it is now too big (a rebalance).
    fn maybe_merge(
        &mut self,
        ks: KeySpace,
        parent: u64,
        i: usize,
        parent_bounds: &Bounds,
    ) -> EngineResult<()> {
        let int = self.interior(parent);
        let len = int.children.len();
        if len < 2 || i >= len {
            return Ok(());
        }
        let underfull = self
            .cache
            .get(&int.children[i])
            .is_some_and(|n| self.is_underfull(n));
        if !underfull {
            return Ok(());
        }
        let (l, r) = if i + 1 < len { (i, i + 1) } else { (i - 1, i) };
        let (left_num, right_num) = (int.children[l], int.children[r]);
        let (lb, rb) = (
            int.child_bounds(l, parent_bounds),
            int.child_bounds(r, parent_bounds),
        );
        let height = int.height - 1;
        self.load(ks, left_num, &lb, Want::Whole, Some(height))?;
        self.load(ks, right_num, &rb, Want::Whole, Some(height))?;
        let merged_bounds = Bounds {
            lo: lb.lo,
            hi: rb.hi,
        };
        let mut left = self.take(left_num);
        let right = self.take(right_num);
        let separator = self.with_interior(parent, |int| {
            let sep = int.pivots.remove(l);
            int.children.remove(r);
            let right_buffer = int.buffers.remove(r);
            int.buffers[l].absorb_disjoint(right_buffer);
            sep
        });
        match (&mut left.body, right.body) {
            (NodeBody::Leaf(a), NodeBody::Leaf(mut b)) => {
                let mut entries = a.take_entries();
                let right = b.take_entries();
                entries.extend_from(&right, 0, right.len());
                *a = Leaf::from_sorted(&entries, self.opts.basement_size);
            }
            (NodeBody::Interior(a), NodeBody::Interior(b)) => {
                a.pivots.push(separator);
                a.pivots.extend(b.pivots);
                a.children.extend(b.children);
                a.buffers.extend(b.buffers);
            }
            _ => unreachable!("both children were checked to be at height {height}"),
        }
        left.bounds = merged_bounds.clone();
        left.dirty = true;
        self.put(left_num, left);
        self.free_node(right_num);
        add(&self.stats.merges, 1);
        let splits = self.split_if_needed(ks, left_num, &merged_bounds)?;
        self.adopt_splits(parent, l, splits);
        Ok(())
    }

    /// Splits an over-full node; returns the new right siblings.
    fn split_if_needed(&mut self, ks: KeySpace, num: u64, bounds: &Bounds) -> EngineResult<Splits> {
        let over = match &self.node(num).body {
            NodeBody::Leaf(leaf) => leaf.bytes() > self.opts.node_size && leaf.entry_count() > 1,
            NodeBody::Interior(int) => int.children.len() > self.opts.fanout,
        };
        if !over {
            return Ok(Vec::new());
        }
        let mut node = self.take(num);
        let mut pieces: Vec<(Vec<u8>, NodeBody)> = Vec::new();
        match &mut node.body {
            NodeBody::Leaf(leaf) => {
                let entries = leaf.take_entries();
                let total = entries.bytes();
                let target_piece = (self.opts.node_size * 3 / 4).max(1);
                let k = total.div_ceil(target_piece).clamp(2, entries.len());
                let per = total.div_ceil(k);
                // Cut points: entry indices where pieces 1..k begin.
                let mut cuts = Vec::with_capacity(k - 1);
                let mut acc = 0;
                for i in 0..entries.len() {
                    let pieces_left = k - 1 - cuts.len();
                    let must_cut = entries.len() - i <= pieces_left;
                    if pieces_left > 0
                        && i > cuts.last().copied().unwrap_or(0)
                        && (acc >= per * (cuts.len() + 1) || must_cut)
                    {
                        cuts.push(i);
                    }
                    acc += entries.entry_bytes(i);
                }
                let bounds_of = |j: usize| -> (usize, usize) {
                    let from = if j == 0 { 0 } else { cuts[j - 1] };
                    let to = cuts.get(j).copied().unwrap_or(entries.len());
                    (from, to)
                };
                let piece = |from: usize, to: usize| {
                    let mut e = crate::entries::Entries::with_capacity(to - from, 0);
                    e.extend_from(&entries, from, to);
                    Leaf::from_sorted(&e, self.opts.basement_size)
                };
                let (from, to) = bounds_of(0);
                *leaf = piece(from, to);
                for j in 1..=cuts.len() {
                    let (from, to) = bounds_of(j);
                    let sep = separator(entries.key(from - 1), entries.key(from));
                    pieces.push((sep, NodeBody::Leaf(piece(from, to))));
                }
            }
            NodeBody::Interior(int) => {
                let n = int.children.len();
                let k = n.div_ceil((self.opts.fanout * 3 / 4).max(2)).max(2);
                let per = n.div_ceil(k);
                let mut cut = (k - 1) * per;
                while cut > 0 {
                    if cut < n {
                        let pivots = int.pivots.split_off(cut);
                        let sep = int.pivots.pop().unwrap_or_default();
                        let right = Interior {
                            height: int.height,
                            pivots,
                            children: int.children.split_off(cut),
                            buffers: int.buffers.split_off(cut),
                        };
                        pieces.push((sep, NodeBody::Interior(right)));
                    }
                    cut -= per;
                }
                pieces.reverse();
            }
        }
        let his: Vec<Option<Vec<u8>>> = pieces
            .iter()
            .skip(1)
            .map(|(p, _)| Some(p.clone()))
            .chain([bounds.hi.clone()])
            .collect();
        node.bounds = Bounds {
            lo: bounds.lo.clone(),
            hi: pieces.first().map(|(p, _)| p.clone()),
        };
        node.dirty = true;
        self.put(num, node);
        let mut splits = Vec::with_capacity(pieces.len());
        for ((sep, body), hi) in pieces.into_iter().zip(his) {
            let bounds = Bounds {
                lo: sep.clone(),
                hi,
            };
            let new = self.new_node(ks, body, bounds);
            splits.push((sep, new));
        }
        add(&self.stats.splits, splits.len() as u64);
        Ok(splits)
    }

    /// Pushes every buffered message down to the leaves (space reclaim:
    /// pending deletes free nothing until they reach the leaves).
    pub fn flush_everything(&mut self) -> EngineResult<()> {
        self.flush_some(usize::MAX).map(|_| ())
    }

    /// Like [`Tree::flush_everything`], but stops between two children once
    /// `budget` bytes of nodes are dirty (the tree is consistent there);
    /// returns whether every buffer was flushed. Reclaiming space on a full
    /// device goes step by step, checkpointing in between, so that the
    /// nodes it rewrites always fit in what the last step freed.
    pub fn flush_some(&mut self, budget: usize) -> EngineResult<bool> {
        for ks in KeySpace::ALL {
            let root = self.roots[ks.index()];
            self.load(ks, root, &Bounds::full(), Want::Whole, None)?;
            let done = self.flush_subtree(ks, root, &Bounds::full(), budget)?;
            // Splits the root, and grows the tree, if flushing filled it.
            self.settle_root(ks)?;
            if !done {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// How many dirty bytes a reclaim step may make: half of what the
    /// node-sized free runs hold, at least two nodes.
    pub fn reclaim_budget(&self) -> usize {
        let consumed = self
            .alloc
            .used_blocks()
            .saturating_sub(self.used_blocks_at_checkpoint);
        let runs = self.node_sized_free_blocks.saturating_sub(consumed) * BLOCK_SIZE as u64;
        ((runs / 2) as usize).max(2 * self.opts.node_size)
    }

    fn flush_subtree(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        budget: usize,
    ) -> EngineResult<bool> {
        let mut i = 0;
        loop {
            let NodeBody::Interior(int) = &self.node(num).body else {
                return Ok(true);
            };
            if i >= int.children.len() {
                return Ok(true);
            }
            if self.dirty_bytes > budget {
                return Ok(false);
            }
            if !int.buffers[i].is_empty() {
                self.flush_child(ks, num, i, bounds)?;
            }
            let int = self.interior(num);
            let i_now = i.min(int.children.len() - 1);
            let child = int.children[i_now];
            let child_bounds = int.child_bounds(i_now, bounds);
            let height = int.height - 1;
            let mut done = true;
            if height > 0 {
                self.load(ks, child, &child_bounds, Want::Whole, Some(height))?;
                done = self.flush_subtree(ks, child, &child_bounds, budget)?;
                let splits = self.split_if_needed(ks, child, &child_bounds)?;
                self.adopt_splits(num, i_now, splits);
            }
            if !done {
                return Ok(false);
            }
            i = i_now + 1;
        }
    }

    // ---- writing ------------------------------------------------------------

    /// Writes a dirty node to a fresh extent (copy-on-write).
    fn write_node(&mut self, num: u64) -> EngineResult<()> {
        if self.read_only {
            return Err(EngineError::ReadOnly);
        }
        let node = self.node(num);
        debug_assert!(node.dirty);
        if let NodeBody::Leaf(leaf) = &node.body {
            assert!(
                leaf.is_fully_loaded(),
                "tree invariant: dirty leaf {num} must be fully loaded"
            );
        }
        let height = node.height();
        let img = encode_node(node, num);
        let Some(extent) = self.alloc.allocate(img.len) else {
            tracing::warn!(
                "no {} byte extent for node {num} (height {height}); {} of {} blocks in use",
                img.len,
                self.alloc.used_blocks(),
                self.layout.nodes_bytes / BLOCK_SIZE as u64
            );
            return Err(EngineError::NoSpace);
        };
        if let Err(e) = self
            .device
            .write_at(&img.buf, self.layout.extent_offset(extent))
        {
            self.alloc.free(extent);
            return Err(betreefs_store::StoreError::io("writing node", e).into());
        }
        if let Some(old) = self.btt.set(num, extent, img.crc) {
            self.alloc.free(old);
        }
        add(
            &self.stats.node_bytes_written[level(height)],
            img.buf.len() as u64,
        );
        add(&self.stats.nodes_written, 1);
        let mut node = self.take(num);
        node.dirty = false;
        if let NodeBody::Leaf(leaf) = &mut node.body {
            for (b, loc) in leaf.basements.iter_mut().zip(img.basement_locs) {
                b.loc = Some(loc);
            }
        }
        self.put(num, node);
        Ok(())
    }

    /// Drops nodes until the cache is under 90% of its budget: clean ones
    /// first in least-recently-used order (dropping them costs a later
    /// re-read at most), then dirty ones, which must be written back (a
    /// write now, and another when they are dirtied again). Interior nodes
    /// stay longer than leaves of the same age: every query and flush passes
    /// through them. Roots stay.
    pub fn evict_if_needed(&mut self) -> EngineResult<()> {
        self.evict(!self.read_only)
    }

    /// What a read does after loading nodes: drops clean nodes only (leaves
    /// before interior nodes, least recently used first), so it never
    /// writes and cannot fail. Without it a read-only workload (a cold read
    /// of a big file) grew the cache without bound: only writes evicted.
    pub fn evict_clean_if_needed(&mut self) {
        // Cannot fail: nothing is written when dirty nodes are skipped.
        let _ = self.evict(false);
    }

    fn evict(&mut self, write_dirty: bool) -> EngineResult<()> {
        if self.cache_bytes <= self.opts.cache_bytes {
            return Ok(());
        }
        let target = self.opts.cache_bytes / 10 * 9;
        let mut order: Vec<(bool, bool, u64, u64)> = self
            .cache
            .iter()
            .filter(|(_, n)| write_dirty || !n.dirty)
            .map(|(num, n)| (n.dirty, n.height() > 0, n.last_used, *num))
            .collect();
        order.sort_unstable();
        for (dirty, _, _, num) in order {
            if self.cache_bytes <= target {
                break;
            }
            if self.roots.contains(&num) {
                continue;
            }
            if dirty {
                self.write_node(num)?;
            }
            drop(self.take(num));
            add(&self.stats.evictions, 1);
        }
        Ok(())
    }

    /// Writes every dirty node, the block table and a new superblock naming
    /// them; `log_head` is where replay must start for what comes after.
    /// `clean` marks the final checkpoint of a close (no record follows).
    pub fn write_checkpoint(
        &mut self,
        log_head: u64,
        log_epoch: u32,
        clean: bool,
    ) -> EngineResult<()> {
        if self.read_only {
            return Err(EngineError::ReadOnly);
        }
        let mut dirty: Vec<(u32, u64)> = self
            .cache
            .iter()
            .filter(|(_, n)| n.dirty)
            .map(|(num, n)| (n.height(), *num))
            .collect();
        dirty.sort_unstable();
        for (_, num) in dirty {
            self.write_node(num)?;
        }
        let table = self.btt.encode();
        let Some(extent) = self.alloc.allocate(table.len() as u32) else {
            tracing::warn!(
                "no {} byte extent for the block table; {} of {} blocks in use",
                table.len(),
                self.alloc.used_blocks(),
                self.layout.nodes_bytes / BLOCK_SIZE as u64
            );
            return Err(EngineError::NoSpace);
        };
        let buf = AlignedBuf::from_slice(&table);
        let io = |context| move |e| EngineError::from(betreefs_store::StoreError::io(context, e));
        let written = self
            .device
            .write_at(&buf, self.layout.extent_offset(extent))
            .map_err(io("writing block table"))
            .and_then(|()| self.device.sync().map_err(io("syncing nodes")));
        if let Err(e) = written {
            self.alloc.free(extent);
            return Err(e);
        }
        add(&self.stats.block_table_bytes_written, buf.len() as u64);
        let sb = Superblock {
            generation: self.generation + 1,
            layout: self.layout,
            checkpoint_seq: self.next_seq - 1,
            log_head,
            log_epoch,
            btt: extent,
            btt_crc: crc32c_of(&[&table]),
            roots: self.roots.to_vec(),
            clean,
        };
        sb.write(self.device.as_ref())?;
        add(&self.stats.superblock_bytes_written, BLOCK_SIZE as u64);
        self.generation = sb.generation;
        if let Some(old) = self.btt_extent.replace(extent) {
            self.alloc.free(old);
        }
        self.alloc.commit_checkpoint();
        let node_blocks = (self.opts.node_size / BLOCK_SIZE) as u64;
        self.node_sized_free_blocks = self.alloc.free_blocks_in_runs(node_blocks);
        self.used_blocks_at_checkpoint = self.alloc.used_blocks();
        add(&self.stats.checkpoints, 1);
        Ok(())
    }

    /// Whether writes that add data should be refused: the node region
    /// could not absorb the dirty nodes plus a reserve for copy-on-write.
    ///
    /// Nodes are written as contiguous extents, so free space counts only
    /// where it comes in node-sized runs: on a nearly full, fragmented
    /// device the dirty nodes (and the nodes a checkpoint after deletes
    /// rewrites) must still find room, or no checkpoint could ever run.
    pub fn space_low(&self) -> bool {
        let capacity = self.layout.nodes_bytes;
        let node = self.opts.node_size as u64;
        let reserve = (capacity / 8).max(8 * node);
        let used = self.alloc.used_blocks() * BLOCK_SIZE as u64
            + self.dirty_bytes as u64
            + (self.btt.live_count() as u64 * 16).next_multiple_of(BLOCK_SIZE as u64);
        let consumed = self
            .alloc
            .used_blocks()
            .saturating_sub(self.used_blocks_at_checkpoint);
        let runs = self
            .node_sized_free_blocks
            .saturating_sub(consumed)
            .saturating_mul(BLOCK_SIZE as u64);
        used + reserve > capacity || self.dirty_bytes as u64 + 4 * node > runs
    }

    // ---- verification (fsck and tests) -------------------------------------

    /// Walks every node of every tree, reading all of them, and checks
    /// ordering, bounds, heights, buffer placement and fanout; also finds
    /// nodes the block table holds but no tree reaches (leaked space).
    pub fn verify(&mut self) -> EngineResult<VerifyReport> {
        let mut visited = HashSet::new();
        for ks in KeySpace::ALL {
            let root = self.roots[ks.index()];
            self.load(ks, root, &Bounds::full(), Want::Whole, None)?;
            let height = self.node(root).height();
            self.verify_subtree(ks, root, &Bounds::full(), height, &mut visited)?;
        }
        let unreachable = self
            .btt
            .live_numbers()
            .filter(|n| !visited.contains(n))
            .collect();
        Ok(VerifyReport {
            nodes: visited.len() as u64,
            unreachable,
        })
    }

    /// Frees nodes no tree reaches (found by [`Tree::verify`]).
    pub fn free_unreachable(&mut self, nums: &[u64]) {
        for &num in nums {
            if !self.roots.contains(&num) {
                self.free_node(num);
            }
        }
    }

    fn verify_subtree(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        height: u32,
        visited: &mut HashSet<u64>,
    ) -> EngineResult<()> {
        if !visited.insert(num) {
            return Err(Self::corrupt(ks, num, "reached twice"));
        }
        self.load(ks, num, bounds, Want::Whole, Some(height))?;
        let bad = |reason: String| Self::corrupt(ks, num, reason);
        let kids: Vec<(u64, Bounds)> = match &self.node(num).body {
            NodeBody::Leaf(leaf) => {
                let mut prev: Option<&[u8]> = None;
                for (bi, b) in leaf.basements.iter().enumerate() {
                    let Some(entries) = &b.entries else {
                        unreachable!("loaded whole")
                    };
                    for (k, _) in entries.iter() {
                        if !bounds.contains(k) || prev.is_some_and(|p| p >= k) {
                            return Err(bad(format!(
                                "key {k:?} out of order or outside {bounds:?}"
                            )));
                        }
                        if bi > 0 && k < &leaf.pivots[bi - 1]
                            || bi < leaf.pivots.len() && k >= &leaf.pivots[bi]
                        {
                            return Err(bad(format!("key {k:?} in the wrong basement")));
                        }
                        prev = Some(k);
                    }
                }
                Vec::new()
            }
            NodeBody::Interior(int) => {
                if int.children.len() != int.pivots.len() + 1
                    || int.buffers.len() != int.children.len()
                {
                    return Err(bad("pivot, child and buffer counts disagree".into()));
                }
                if int.children.len() > self.opts.fanout.max(2) * 2 {
                    return Err(bad(format!(
                        "fanout {} far over the limit",
                        int.children.len()
                    )));
                }
                for (i, p) in int.pivots.iter().enumerate() {
                    if !bounds.contains(p) || (i > 0 && int.pivots[i - 1] >= *p) {
                        return Err(bad(format!(
                            "pivot {p:?} out of order or outside {bounds:?}"
                        )));
                    }
                }
                for i in 0..int.children.len() {
                    let cb = int.child_bounds(i, bounds);
                    let buf = &int.buffers[i];
                    let keys_ok = buf.points().keys().all(|k| cb.contains(k));
                    let ranges_ok = buf.ranges().iter().all(|(s, r)| {
                        cb.contains(s) && s < &r.end && cb.hi.as_ref().is_none_or(|hi| r.end <= *hi)
                    });
                    if !keys_ok || !ranges_ok {
                        return Err(bad(format!(
                            "buffer of child {i} holds messages outside {cb:?}"
                        )));
                    }
                }
                (0..int.children.len())
                    .map(|i| (int.children[i], int.child_bounds(i, bounds)))
                    .collect()
            }
        };
        for (child, child_bounds) in kids {
            self.verify_subtree(ks, child, &child_bounds, height - 1, visited)?;
            // A whole-tree walk must not hold the whole tree in memory.
            self.evict_clean_if_needed();
        }
        Ok(())
    }
}

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
