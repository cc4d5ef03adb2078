//! Queries: point gets and range visits, with the messages pending above
//! the leaves applied on the fly; a query never changes the tree.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use std::borrow::Cow;
use std::ops::ControlFlow;

use super::readahead::LeafOnDisk;
use super::*;

impl Tree {
    /// Point query: the leaf value with the pending messages on the
    /// root-to-leaf path applied on the fly. Queries never change the tree
    /// (the 0.6 apply-on-query policy taken to its end: flushes alone move
    /// messages down, so a read never dirties a node).
    pub fn get(&mut self, ks: KeySpace, key: &[u8]) -> EngineResult<Option<Vec<u8>>> {
        let mut walk = PointWalk::new(self.roots[ks.index()]);
        let base = loop {
            self.load(ks, walk.num, &walk.bounds, Want::Key(key), walk.height)?;
            if let Some(base) = walk.step(self.node(walk.num), key) {
                break base;
            }
        };
        walk.finish(base, &self.merges)
    }

    /// [`Tree::get`] on the shared lock: the answer if every node and
    /// basement on the path is cached and reached as it was cached.
    /// Nothing changes but the nodes' LRU stamps.
    pub fn get_cached(&self, ks: KeySpace, key: &[u8]) -> Shared<EngineResult<Option<Vec<u8>>>> {
        let mut walk = PointWalk::new(self.roots[ks.index()]);
        let base = loop {
            let want = Want::Key(key);
            let Some(node) = self.cached_for(walk.num, &walk.bounds, want, walk.height) else {
                return self.shared_miss(ks, walk.num, &walk.bounds, walk.height);
            };
            if let Some(base) = walk.step(node, key) {
                break base;
            }
        };
        Shared::Answer(walk.finish(base, &self.merges))
    }

    /// What a walk on the shared lock that found node `num` (reached
    /// under `bounds` at `height`) not as it needs it should do: read it
    /// outside the lock if it is a leaf the cache does not hold, or one it
    /// holds without the basements the walk needs, else take the
    /// exclusive lock.
    fn shared_miss<T>(
        &self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        height: Option<u32>,
    ) -> Shared<T> {
        let leaf = match (height, self.cache.contains_key(&num)) {
            (Some(0), false) => self.leaf_on_disk(ks, num, bounds.clone()),
            (Some(0), true) => self.basements_on_disk(ks, num, bounds),
            _ => None,
        };
        leaf.map_or(Shared::Exclusive, Shared::ReadLeaf)
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
        let visited = self.visit_leaf(ks, start, end, &mut |k, v| {
            result.push((k.to_vec(), v.to_vec()));
            ControlFlow::Continue(())
        })?;
        Ok((result, visited.next))
    }

    /// Like [`Tree::scan_leaf`], but hands each pair to `visit` as borrowed
    /// slices: with nothing pending above the leaf (the common case) no
    /// pair is copied or allocated.
    pub fn visit_leaf(
        &mut self,
        ks: KeySpace,
        start: &[u8],
        end: Option<&[u8]>,
        visit: &mut PairVisitor<'_>,
    ) -> EngineResult<LeafVisited> {
        let mut walk = RangeWalk::new(self.roots[ks.index()]);
        loop {
            let hi = walk.hi(end);
            self.load(
                ks,
                walk.num,
                &walk.bounds,
                Want::Range(start, hi.as_deref()),
                walk.height,
            )?;
            if walk.step(self.node(walk.num), start, end) {
                break;
            }
        }
        self.visit_reached_leaf(&walk, start, end, visit)
    }

    /// [`Tree::visit_leaf`] on the shared lock, when every node on the way
    /// and every basement the range needs of the leaf is cached, reached
    /// as it was cached; otherwise nothing is visited.
    pub fn visit_leaf_cached(
        &self,
        ks: KeySpace,
        start: &[u8],
        end: Option<&[u8]>,
        visit: &mut PairVisitor<'_>,
    ) -> Shared<EngineResult<LeafVisited>> {
        let mut walk = RangeWalk::new(self.roots[ks.index()]);
        loop {
            let hi = walk.hi(end);
            let want = Want::Range(start, hi.as_deref());
            let Some(node) = self.cached_for(walk.num, &walk.bounds, want, walk.height) else {
                return self.shared_miss(ks, walk.num, &walk.bounds, walk.height);
            };
            if walk.step(node, start, end) {
                break;
            }
        }
        Shared::Answer(self.visit_reached_leaf(&walk, start, end, visit))
    }

    /// Visits [start, end) within the leaf `walk` reached (its basements
    /// for the range loaded), the messages pending above applied, until
    /// `visit` breaks (then no next leaf is named).
    fn visit_reached_leaf(
        &self,
        walk: &RangeWalk,
        start: &[u8],
        end: Option<&[u8]>,
        visit: &mut PairVisitor<'_>,
    ) -> EngineResult<LeafVisited> {
        let NodeBody::Leaf(leaf) = &self.node(walk.num).body else {
            unreachable!("a range walk ends at a leaf")
        };
        let bounds = &walk.bounds;
        let hi = min_end(end, bounds.hi.as_deref());
        let first = leaf.basement_for(start);
        let last = hi.map_or(leaf.basements.len() - 1, |h| {
            leaf.last_basement_before(h, first)
        });
        // A scan across basements reads on sequentially (the rest of this
        // leaf was read with it): the next leaf is worth reading ahead.
        let read_on = (last > first).then(|| bounds.hi.clone()).flatten();
        // Each basement whole, or (a range within one basement) the
        // chunks read below it that hold the range.
        let runs = leaf.basements[first..=last].iter().flat_map(|b| {
            let Some(runs) = b.runs_for(start, hi) else {
                unreachable!("loaded above")
            };
            runs
        });
        let entries = runs.flat_map(|entries| {
            (entries.lower_bound(start)..entries.len())
                .map(move |i| (entries.key(i), entries.value(i)))
        });
        let entries = entries.take_while(|(k, _)| hi.is_none_or(|h| *k < h));
        let mut levels: Vec<PendingLevel<'_>> = walk
            .path
            .iter()
            .map(|(num, i, span)| {
                let NodeBody::Interior(int) = &self.node(*num).body else {
                    unreachable!("a range walk passes interior nodes above its leaf")
                };
                PendingLevel::of(int, *i, span.clone(), start)
            })
            .collect();
        levels.retain_mut(|l| l.pending_before(hi));
        let flow = if levels.is_empty() {
            // The common case: nothing pending here.
            entries
                .map(|(k, v)| visit(k, v))
                .find(ControlFlow::is_break)
                .unwrap_or(ControlFlow::Continue(()))
        } else {
            visit_with_pending(entries, levels, hi, &self.merges, visit)
                .map_err(EngineError::UnknownMergeFunction)?
        };
        if flow.is_break() {
            return Ok(LeafVisited {
                next: None,
                read_on: None,
            });
        }
        let next = match (&bounds.hi, end) {
            (Some(h), Some(e)) if h.as_slice() < e => Some(h.clone()),
            (Some(h), None) => Some(h.clone()),
            _ => None,
        };
        Ok(LeafVisited { next, read_on })
    }
}

/// A point query's way down from a root: where it is, and the messages
/// for its key pending above (newest first), which the base value found
/// lower down is put through on the way back.
struct PointWalk {
    num: u64,
    bounds: Bounds,
    height: Option<u32>,
    pending: Vec<PointMsg>,
}

impl PointWalk {
    fn new(root: u64) -> PointWalk {
        PointWalk {
            num: root,
            bounds: Bounds::full(),
            height: None,
            pending: Vec::new(),
        }
    }

    /// Looks at `node` (the walk's current one, loaded for the key):
    /// `Some(base)` when the walk ends here with the value the pending
    /// messages apply to, `None` after stepping to the child on the path.
    fn step(&mut self, node: &Node, key: &[u8]) -> Option<Option<Vec<u8>>> {
        match &node.body {
            NodeBody::Interior(int) => {
                let i = int.child_index(key);
                let buf = &int.buffers[i];
                let Some(point) = int.point(i, key) else {
                    unreachable!("loaded for the key above")
                };
                if let Some(m) = point {
                    self.pending.push(m.clone());
                    if m.hides_older() {
                        return Some(None);
                    }
                }
                if buf.covering(key).is_some() {
                    return Some(None);
                }
                self.bounds = int.child_bounds(i, &self.bounds);
                self.height = Some(int.height - 1);
                self.num = int.children[i];
                None
            }
            NodeBody::Leaf(leaf) => Some(leaf.get(key).flatten().map(|v| v.to_vec())),
        }
    }

    fn finish(
        self,
        base: Option<Vec<u8>>,
        merges: &MergeRegistry,
    ) -> EngineResult<Option<Vec<u8>>> {
        self.pending.into_iter().rev().try_fold(base, |value, m| {
            m.into_value(value, merges)
                .map_err(EngineError::UnknownMergeFunction)
        })
    }
}

/// What a query on the shared tree lock came to.
pub enum Shared<T> {
    /// Its answer.
    Answer(T),
    /// Everything on its way is cached but this leaf, or basements of it:
    /// read them holding no lock, then query under the exclusive lock.
    ReadLeaf(LeafOnDisk),
    /// Something else needs the exclusive lock: an interior node to read,
    /// a re-keying, an error to report.
    Exclusive,
}

/// What a range visit calls with each key and value, in key order: it
/// breaks to stop the visit (no later pair is visited, no later leaf
/// read).
pub type PairVisitor<'a> = dyn FnMut(&[u8], &[u8]) -> ControlFlow<()> + 'a;

/// What a range visit of one leaf tells its caller.
pub struct LeafVisited {
    /// Where the next leaf begins, if the range goes on there.
    pub next: Option<Vec<u8>>,
    /// The same key, when the visit read on across basements: a
    /// sequential reader, whose next leaf is worth reading ahead.
    pub read_on: Option<Vec<u8>>,
}

/// A range query's way down from a root to the leaf holding its start:
/// where it is, and the buffers on the way restricted to the range.
struct RangeWalk {
    num: u64,
    bounds: Bounds,
    height: Option<u32>,
    /// The interior nodes passed, root first: each node, the child taken
    /// and the segments of its buffer the range needs (a node read in
    /// part). Their messages are read where they are when the leaf is
    /// reached ([`PendingLevel::of`]); every node of the walk is cached
    /// by then and nothing evicts it meanwhile.
    path: Vec<(u64, usize, std::ops::Range<usize>)>,
}

impl RangeWalk {
    fn new(root: u64) -> RangeWalk {
        RangeWalk {
            num: root,
            bounds: Bounds::full(),
            height: None,
            path: Vec::new(),
        }
    }

    /// Where the range ends within the current node's bounds.
    fn hi(&self, end: Option<&[u8]>) -> Option<Vec<u8>> {
        min_end(end, self.bounds.hi.as_deref()).map(|h| h.to_vec())
    }

    /// Looks at `node` (the walk's current one, loaded for the range):
    /// whether it is the leaf; otherwise steps to the child holding
    /// `start`, keeping the part of its buffer the range needs.
    fn step(&mut self, node: &Node, start: &[u8], end: Option<&[u8]>) -> bool {
        let NodeBody::Interior(int) = &node.body else {
            return true;
        };
        let i = int.child_index(start);
        let child_bounds = int.child_bounds(i, &self.bounds);
        let hi = min_end(end, child_bounds.hi.as_deref());
        let (_, span) = int.segment_span(start, hi);
        self.path.push((self.num, i, span));
        self.height = Some(int.height - 1);
        self.num = int.children[i];
        self.bounds = child_bounds;
        false
    }
}

/// A level's point messages in key order, from wherever they lie.
type PendingPoints<'a> = Box<dyn Iterator<Item = (&'a Vec<u8>, &'a PointMsg)> + 'a>;

/// The messages one interior node holds for a child, as a range visit
/// reads them where they lie: its point messages from `start` on (a node
/// read in part keeps them in segments, in key order) and its range
/// deletes from the one covering `start` on. Copying each level's part
/// of the buffer out for the visit (twice: once on the way down, once cut
/// to the leaf) was most of what a visit of a leaf with messages above it
/// cost besides the merge — every rmdir's emptiness check after its
/// directory's unlinks.
struct PendingLevel<'a> {
    points: std::iter::Peekable<PendingPoints<'a>>,
    ranges: std::iter::Peekable<std::collections::btree_map::Range<'a, Vec<u8>, RangeDel>>,
}

impl<'a> PendingLevel<'a> {
    fn of(int: &'a Interior, i: usize, span: std::ops::Range<usize>, start: &'a [u8]) -> Self {
        let from = (Bound::Included(start), Bound::Unbounded);
        let segments = int
            .segment_points(i, span)
            .flat_map(move |p| p.points().range(from));
        PendingLevel::with_points(&int.buffers[i], start, segments)
    }

    /// `buffer`'s messages from `start` on, and the point messages
    /// `more` (sorted, after the buffer's own: a node read in part has
    /// none of its own).
    fn with_points(
        buffer: &'a MessageBuffer,
        start: &'a [u8],
        more: impl Iterator<Item = (&'a Vec<u8>, &'a PointMsg)> + 'a,
    ) -> Self {
        let from = (Bound::Included(start), Bound::Unbounded);
        let points: PendingPoints<'a> = Box::new(buffer.points().range(from).chain(more));
        let first = buffer.covering(start).map_or(start, |(s, _)| s.as_slice());
        PendingLevel {
            points: points.peekable(),
            ranges: buffer
                .ranges()
                .range::<[u8], _>((Bound::Included(first), Bound::Unbounded))
                .peekable(),
        }
    }

    /// Whether a message of this level lies before `hi` (where the visit
    /// ends), from the visit's start.
    fn pending_before(&mut self, hi: Option<&[u8]>) -> bool {
        let before = |k: &[u8]| hi.is_none_or(|h| k < h);
        self.points.peek().is_some_and(|(k, _)| before(k))
            || self.ranges.peek().is_some_and(|(s, _)| before(s))
    }

    /// Whether a range delete of this level covers `key`; keys must be
    /// asked in increasing order.
    fn deletes(&mut self, key: &[u8]) -> bool {
        while self
            .ranges
            .peek()
            .is_some_and(|(_, r)| r.end.as_slice() <= key)
        {
            self.ranges.next();
        }
        self.ranges
            .peek()
            .is_some_and(|(start, _)| start.as_slice() <= key)
    }
}

/// Hands `visit` the leaf's pairs `entries` (in key order, below `hi`)
/// with the messages pending above them applied — `levels`, root first,
/// each from where the visit begins (they may reach past `hi`, where the
/// merge stops) — in key order, as one merge of sorted runs: per key, the
/// leaf's value (borrowed), then each level from the oldest (the one
/// nearest the leaf) on, its range delete over the key first, then its
/// message for the key. Collecting the range into a map of copies and
/// editing it level by level, as before, copied every pair (a 4 KiB block
/// twice on its way to a read's reply) and allocated a map node per key:
/// the bulk of a range visit's time after an untar, when every leaf has
/// messages above it. Stops where `visit` breaks (and says so); `Err(id)`
/// names an unknown merge function.
fn visit_with_pending<'a>(
    entries: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    mut levels: Vec<PendingLevel<'a>>,
    hi: Option<&[u8]>,
    merges: &MergeRegistry,
    visit: &mut PairVisitor<'_>,
) -> Result<ControlFlow<()>, u8> {
    let mut entries = entries.peekable();
    // Oldest first: the level nearest the leaf is the last of the walk.
    levels.reverse();
    loop {
        let mut next: Option<&'a [u8]> = entries.peek().map(|(k, _)| *k);
        for level in &mut levels {
            if let Some((k, _)) = level.points.peek() {
                if next.is_none_or(|n| k.as_slice() < n) {
                    next = Some(k.as_slice());
                }
            }
        }
        let Some(key) = next.filter(|k| hi.is_none_or(|h| *k < h)) else {
            return Ok(ControlFlow::Continue(()));
        };
        let mut value: Option<Cow<'a, [u8]>> = match entries.peek() {
            Some((k, v)) if *k == key => {
                let v = Cow::Borrowed(*v);
                entries.next();
                Some(v)
            }
            _ => None,
        };
        for level in &mut levels {
            if level.deletes(key) {
                value = None;
            }
            if let Some((_, msg)) = level.points.next_if(|(k, _)| k.as_slice() == key) {
                value = crate::node::value_after(msg, value.as_deref(), merges)?;
            }
        }
        if let Some(value) = value {
            if visit(key, &value).is_break() {
                return Ok(ControlFlow::Break(()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge::{patch_arg, MERGE_PATCH};
    use proptest::collection::{btree_map, vec};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn key(k: u8) -> Vec<u8> {
        vec![b'k', k]
    }

    /// The messages of `buffer` that concern [lo, hi), range deletes
    /// clamped: the model's cut of a level (how visits took their levels
    /// before they read them in place).
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
        for (k, m) in buffer.points().range((Bound::Included(lo), upper)) {
            out.push_decoded_point(k.clone(), m.clone());
        }
        out
    }

    proptest! {
        /// A range visit with messages pending above the leaf hands out
        /// what applying every level, oldest first, to a map of the
        /// leaf's pairs leaves (the way visits were made before they
        /// merged sorted runs). A level: range deletes as (start, length),
        /// then point messages (key, kind: a put, a delete or a patch, byte).
        #[test]
        fn pending_levels_merged_in_order_are_the_levels_applied(
            leaf in btree_map(0u8..40, vec(any::<u8>(), 0..6), 0..30),
            levels in vec((vec((0u8..40, 1u8..8), 0..3), vec((0u8..40, 0u8..3, any::<u8>()), 0..12)), 0..4),
            from in 0u8..40,
            span in 1u8..45,
        ) {
            let merges = MergeRegistry::default();
            let (lo, hi) = (key(from), key(from.saturating_add(span)));
            let mut seq = 1;
            // Root first, as a walk collects them: the last is the oldest.
            let mut buffers: Vec<MessageBuffer> = Vec::new();
            for (ranges, points) in levels.iter().rev() {
                let mut b = MessageBuffer::default();
                for &(start, len) in ranges {
                    seq += 1;
                    b.insert_range_delete(key(start), key(start.saturating_add(len)), seq);
                }
                for &(k, kind, v) in points {
                    seq += 1;
                    let msg = match kind {
                        0 => PointMsg::put(seq, vec![v]),
                        1 => PointMsg::delete(seq),
                        _ => PointMsg::upsert(seq, MERGE_PATCH, patch_arg(1, &[v])),
                    };
                    b.insert_point(key(k), msg, &merges);
                }
                buffers.insert(0, b);
            }
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = leaf
                .iter()
                .map(|(k, v)| (key(*k), v.clone()))
                .filter(|(k, _)| *k >= lo && *k < hi)
                .collect();
            // Read from where the visit begins, as a walk does; the end is
            // the merge's to keep.
            // The first `stop` pairs (all if None), and whether the visit
            // said it stopped.
            let visited = |stop: Option<usize>| {
                let levels: Vec<PendingLevel<'_>> = buffers
                    .iter()
                    .map(|b| PendingLevel::with_points(b, &lo, std::iter::empty()))
                    .collect();
                let mut got: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
                let flow = visit_with_pending(
                    pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())),
                    levels,
                    Some(&hi),
                    &merges,
                    &mut |k, v| {
                        got.push((k.to_vec(), v.to_vec()));
                        if stop.is_some_and(|n| got.len() >= n) {
                            ControlFlow::Break(())
                        } else {
                            ControlFlow::Continue(())
                        }
                    },
                )
                .unwrap();
                (got, flow)
            };

            let (got, whole) = visited(None);
            prop_assert!(whole.is_continue());
            // A visit that breaks after half the pairs saw those, and says
            // it stopped.
            let half = got.len() / 2;
            let (first, flow) = visited(Some(half + 1));
            prop_assert_eq!(flow.is_break(), half < got.len());
            prop_assert_eq!(&first[..], &got[..(half + 1).min(got.len())]);

            let mut want: BTreeMap<Vec<u8>, Vec<u8>> = pairs.iter().cloned().collect();
            for level in buffers.iter().rev().map(|b| restricted(b, &lo, Some(&hi))) {
                for (s, r) in level.ranges() {
                    want.retain(|k, _| !(k >= s && *k < r.end));
                }
                for (k, m) in level.points() {
                    match m.apply(want.get(k).map(|v| v.as_slice()), &merges).unwrap() {
                        Some(v) => want.insert(k.clone(), v),
                        None => want.remove(k),
                    };
                }
            }
            prop_assert_eq!(got, want.into_iter().collect::<Vec<_>>());
        }
    }
}
