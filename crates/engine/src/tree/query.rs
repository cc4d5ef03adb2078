//! Queries: point gets and range visits, with the messages pending above
//! the leaves applied on the fly; a query never changes the tree.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

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
            result.push((k.to_vec(), v.to_vec()))
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
        visit: &mut dyn FnMut(&[u8], &[u8]),
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
        visit: &mut dyn FnMut(&[u8], &[u8]),
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
    /// for the range loaded), the messages pending above applied.
    fn visit_reached_leaf(
        &self,
        walk: &RangeWalk,
        start: &[u8],
        end: Option<&[u8]>,
        visit: &mut dyn FnMut(&[u8], &[u8]),
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
        let entries = leaf.basements[first..=last].iter().flat_map(|b| {
            let Some(entries) = &b.entries else {
                unreachable!("loaded above")
            };
            (entries.lower_bound(start)..entries.len())
                .map(move |i| (entries.key(i), entries.value(i)))
        });
        let entries = entries.take_while(|(k, _)| hi.is_none_or(|h| *k < h));
        // Upper levels were restricted to their child's range, which is
        // wider than this leaf's: cut them to the leaf's.
        let levels: Vec<MessageBuffer> = walk
            .levels
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
    levels: Vec<MessageBuffer>,
}

impl RangeWalk {
    fn new(root: u64) -> RangeWalk {
        RangeWalk {
            num: root,
            bounds: Bounds::full(),
            height: None,
            levels: Vec::new(),
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
        let mut level = restricted(&int.buffers[i], start, hi);
        // A node read in part: its buffer holds the range deletes, the
        // segments loaded for the range its point messages.
        let (_, span) = int.segment_span(start, hi);
        for points in int.segment_points(i, span) {
            level.absorb_disjoint(restricted(points, start, hi));
        }
        self.levels.push(level);
        self.height = Some(int.height - 1);
        self.num = int.children[i];
        self.bounds = child_bounds;
        false
    }
}
