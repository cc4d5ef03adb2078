//! Queries: point gets and range visits, with the messages pending above
//! the leaves applied on the fly; a query never changes the tree.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

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
    /// basement on the path is cached and reached as it was cached, `None`
    /// if the query needs the exclusive lock (a read, a re-keying, or the
    /// error a load reports). Nothing changes but the nodes' LRU stamps.
    pub fn get_cached(&self, ks: KeySpace, key: &[u8]) -> Option<EngineResult<Option<Vec<u8>>>> {
        let mut walk = PointWalk::new(self.roots[ks.index()]);
        let base = loop {
            let node = self.cached_for(walk.num, &walk.bounds, Want::Key(key), walk.height)?;
            if let Some(base) = walk.step(node, key) {
                break base;
            }
        };
        Some(walk.finish(base, &self.merges))
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
                    let first = leaf.basement_for(start);
                    let last = hi.map_or(leaf.basements.len() - 1, |h| {
                        leaf.last_basement_before(h, first)
                    });
                    // A scan across basements reads on sequentially (the
                    // rest of this leaf was read with it): the next leaf
                    // is worth reading ahead.
                    let read_on = (last > first).then(|| bounds.hi.clone()).flatten();
                    let entries = leaf.basements[first..=last].iter().flat_map(|b| {
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
                    if let Some(next_leaf) = read_on {
                        self.read_ahead_hint = Some((ks, next_leaf));
                    }
                    return Ok(next);
                }
            }
        }
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
                if let Some(m) = buf.points().get(key) {
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
