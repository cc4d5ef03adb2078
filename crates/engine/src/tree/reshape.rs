//! Reshaping: splitting nodes that grew too big, merging underfull
//! ones, and the subtrees a range rename moves or empties.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

impl Tree {
    /// An empty subtree of the given height: a chain of single-child
    /// interior nodes over an empty leaf (merges heal it later).
    pub(super) fn empty_subtree(&mut self, ks: KeySpace, height: u32, bounds: &Bounds) -> u64 {
        let mut num = self.new_node(ks, NodeBody::Leaf(Leaf::default()), bounds.clone());
        for h in 1..=height {
            let int = Interior {
                height: h,
                pivots: Vec::new(),
                children: vec![num],
                buffers: vec![Default::default()],
                partial: None,
            };
            num = self.new_node(ks, NodeBody::Interior(int), bounds.clone());
        }
        num
    }

    pub(super) fn is_underfull(&self, node: &Node) -> bool {
        match &node.body {
            NodeBody::Leaf(leaf) => leaf.is_underfull(self.opts.node_size),
            NodeBody::Interior(int) => int.children.len() < (self.opts.fanout / 4).max(2),
        }
    }

    /// Merges child `i` with a neighbour when it has become too small; the
    /// merged node splits again if it is now too big (a rebalance).
    pub(super) fn maybe_merge(
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
        let (lb, rb) = (
            int.child_bounds(l, parent_bounds),
            int.child_bounds(r, parent_bounds),
        );
        let height = int.height - 1;
        let left_num = self.private_child(ks, parent, l, parent_bounds)?;
        let right_num = self.private_child(ks, parent, r, parent_bounds)?;
        // Loaded after both are private: when they were one shared node,
        // unsharing the right one re-keyed it for the right-hand place.
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
            Arc::make_mut(&mut int.buffers[l]).absorb_disjoint(Arc::unwrap_or_clone(right_buffer));
            sep
        });
        match (&mut left.body, right.body) {
            (NodeBody::Leaf(a), NodeBody::Leaf(b)) => {
                a.append(b, separator);
                // Appending keeps basements as they were; many small ones
                // (fringe pieces of surgeries) are packed again.
                let usual = (self.opts.node_size / self.opts.basement_size).max(1);
                if a.basements.len() > 2 * usual {
                    let entries = a.take_entries();
                    *a = Leaf::from_sorted(&entries, self.opts.basement_size);
                }
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
    pub(super) fn split_if_needed(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
    ) -> EngineResult<Splits> {
        debug_assert!(self.is_private(num), "split of shared node {num}");
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
            // Cut between whole basements: no entry is copied (a leaf grown
            // by flushes, or by appends when neighbours merged, is split
            // without copying its megabytes).
            NodeBody::Leaf(leaf) if leaf.basements.len() >= 2 => {
                let mut cuts = if leaf.grows_at_end {
                    full_pieces_cuts(leaf, self.opts.node_size)
                } else {
                    even_pieces_cuts(leaf, self.opts.node_size)
                };
                if cuts.is_empty() {
                    cuts.push(leaf.basements.len() / 2);
                }
                // Only the last piece holds the end the leaf grew at.
                let grows_at_end = std::mem::take(&mut leaf.grows_at_end);
                for (n, &c) in cuts.iter().rev().enumerate() {
                    let basements = leaf.basements.split_off(c);
                    let mut pivots = leaf.pivots.split_off(c - 1);
                    // The lower bound of basement `c` separates the pieces.
                    let sep = pivots.remove(0);
                    let mut piece = Leaf {
                        pivots,
                        basements,
                        grows_at_end: grows_at_end && n == 0,
                    };
                    piece.forget_locations();
                    pieces.push((sep, NodeBody::Leaf(piece)));
                }
                pieces.reverse();
            }
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
                            partial: None,
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
}

/// Where the pieces of a leaf split between whole basements begin (basement
/// indices of pieces 1..k): pieces of about equal bytes, at most three
/// quarters of a node each, so that inserts anywhere find room in them.
fn even_pieces_cuts(leaf: &Leaf, node_size: usize) -> Vec<usize> {
    let total = leaf.bytes();
    let target_piece = (node_size * 3 / 4).max(1);
    let k = total.div_ceil(target_piece).clamp(2, leaf.basements.len());
    let per = total.div_ceil(k);
    let mut cuts = Vec::with_capacity(k - 1);
    let mut acc = 0;
    for (i, b) in leaf.basements.iter().enumerate() {
        if i > 0 && cuts.len() < k - 1 && acc >= per * (cuts.len() + 1) {
            cuts.push(i);
        }
        acc += b.bytes;
    }
    cuts
}

/// The cuts for a leaf that grows at its end ([`Leaf::grows_at_end`]):
/// every piece but the last as full as a node allows, the last one what
/// is left, where the appends go on. Halves would leave every leaf of a
/// file written sequentially half full for good — twice the leaves to
/// write, read, cache and point at (docs/design.md, "Leaves that grow at
/// their end").
fn full_pieces_cuts(leaf: &Leaf, node_size: usize) -> Vec<usize> {
    let mut cuts = Vec::new();
    let mut acc = 0;
    for (i, b) in leaf.basements.iter().enumerate() {
        if i > 0 && acc + b.bytes > node_size {
            cuts.push(i);
            acc = 0;
        }
        acc += b.bytes;
    }
    cuts
}
