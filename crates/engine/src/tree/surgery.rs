//! Range rename by tree surgery (BetrFS 0.4 §5): the source range's
//! subtrees are cut out along their boundary paths and hung where the
//! destination range was, under the new prefix, without reading or writing
//! a node inside them (docs/design.md, "Range rename by surgery").
//!
//! The steps, all under the tree lock like every other change:
//! 1. Walk down to the lowest node `L` whose one child does not hold both
//!    ranges, flushing on the way every buffer with messages for either
//!    range, so nothing above `L` concerns them.
//! 2. Slice: split `L`'s children at the four boundary keys (source start
//!    and end, destination start and end), splitting nodes down the four
//!    boundary paths; afterwards each range is a run of whole children of
//!    `L`, and pending messages were cut with their nodes.
//! 3. Swing: the source run (children, their buffers, the pivots between
//!    them re-keyed) takes the destination run's place; the destination's
//!    subtrees are freed (their leaves unread); an empty subtree fills the
//!    source's place.
//!    A range clone (docs/design.md, "Range clone") makes the same cuts
//!    and hangs the source run at the destination too: the subtrees are
//!    then shared, counted in the block table ([`share`](super::share)).
//! 4. Nothing inside the moved subtrees is touched: cached nodes keep the
//!    keys of their old place and are re-keyed when next reached
//!    ([`Node::move_to`]); their images decode under the new bounds
//!    unchanged (node format 2 records bounds relative to the lifted
//!    prefix), so a dirty node is written as it is.
//! 5. Heal (rename): under-full children where the source was merge with
//!    neighbours; `L` and its ancestors split if they now hold too many
//!    children.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use std::ops::Range;

use super::*;

/// Fewest basements of one leaf a range must touch to be renamed or cloned
/// by surgery rather than copied: three hold at least one whole basement
/// (128 KiB by default) and the two it is cut from.
const SURGERY_MIN_BASEMENTS: usize = 3;

/// Fewest bytes of messages for a range, pending in the buffers above its
/// leaf, that make it worth a surgery: two basements' worth. Measured on a
/// mount (rename + fsync of a just-written file, docs/design.md): a copy
/// of 256 KiB of pending writes cost 0.66 ms, its surgery 0.44 ms. Below
/// that surgery still saved 0.1-0.15 ms (4-128 KiB files), but it leaves
/// every small file renamed in a leaf of its own until merges heal it; a
/// copy leaves the tree as it was.
const SURGERY_MIN_PENDING_BASEMENTS: usize = 2;

impl Tree {
    /// Whether the source range [start, end) is worth a surgery: it
    /// reaches over more than one leaf, or over at least
    /// [`SURGERY_MIN_BASEMENTS`] basements of one, or the buffers on the
    /// way down hold [`SURGERY_MIN_PENDING_BASEMENTS`] basements' worth of
    /// messages for it (a file just written and synced is still in the
    /// buffers: a copy would copy every message). Below that a copy moves
    /// less than cutting does: a cut copies one basement
    /// (`Leaf::split_off`) and leaves fringe pieces to heal
    /// (docs/design.md gives the measurement).
    pub(super) fn worth_surgery(
        &mut self,
        ks: KeySpace,
        start: &[u8],
        end: &[u8],
    ) -> EngineResult<bool> {
        let enough_bytes = SURGERY_MIN_PENDING_BASEMENTS * self.opts.basement_size;
        let mut pending = 0;
        let (mut num, mut bounds) = (self.roots[ks.index()], Bounds::full());
        self.load(ks, num, &bounds, Want::Whole, None)?;
        loop {
            let NodeBody::Interior(int) = &self.node(num).body else {
                return Ok(false);
            };
            let i = int.child_index(start);
            let child_bounds = int.child_bounds(i, &bounds);
            if child_bounds.hi.as_deref().is_some_and(|hi| end > hi) {
                return Ok(true);
            }
            pending += int.buffers[i].point_bytes_in(start, end);
            if pending >= enough_bytes {
                return Ok(true);
            }
            let (child, height) = (int.children[i], int.height - 1);
            if height == 0 {
                // Header and meta (and one basement): the pivots say how
                // many basements the range covers.
                self.load(ks, child, &child_bounds, Want::Key(start), Some(0))?;
                let NodeBody::Leaf(leaf) = &self.node(child).body else {
                    return Ok(false);
                };
                let first = leaf.basement_for(start);
                let last = leaf.last_basement_before(end, first);
                return Ok(last + 1 - first >= SURGERY_MIN_BASEMENTS);
            }
            self.load(ks, child, &child_bounds, Want::Whole, Some(height))?;
            (num, bounds) = (child, child_bounds);
        }
    }

    /// Carries out `r` (a rename, or a clone with `how` = `Share`) by
    /// surgery; `Ok(false)` if the tree is a single leaf (nothing changed:
    /// the caller copies instead).
    pub(super) fn transplant_by_surgery(
        &mut self,
        ks: KeySpace,
        r: &RangeRename,
        how: Transplant,
    ) -> EngineResult<bool> {
        let (dst_start, dst_end) = r.destination_range();
        let lo = r.start.as_slice().min(&dst_start).to_vec();
        let hi = r.end.as_slice().max(&dst_end).to_vec();
        // Step 1: down to L, with (node, bounds, child index) of each
        // ancestor for the splits to come back up.
        let mut path: Vec<(u64, Bounds, usize)> = Vec::new();
        let (mut num, mut bounds) = (self.roots[ks.index()], Bounds::full());
        self.load(ks, num, &bounds, Want::Whole, None)?;
        loop {
            let NodeBody::Interior(int) = &self.node(num).body else {
                return Ok(false);
            };
            let i = int.child_index(&lo);
            let child_bounds = int.child_bounds(i, &bounds);
            if child_bounds
                .hi
                .as_deref()
                .is_some_and(|h| hi.as_slice() > h)
            {
                break;
            }
            let buffer = &int.buffers[i];
            if buffer.touches(&r.start, &r.end) || buffer.touches(&dst_start, &dst_end) {
                // Messages above L are newer than everything below: they
                // must reach L, where they are cut and moved with the nodes.
                self.flush_child(ks, num, i, &bounds)?;
                continue;
            }
            if int.height == 1 {
                // Both ranges in one leaf: it is cut here.
                break;
            }
            let height = int.height - 1;
            path.push((num, bounds.clone(), i));
            let child = self.private_child(ks, num, i, &bounds)?;
            self.load(ks, child, &child_bounds, Want::Whole, Some(height))?;
            (num, bounds) = (child, child_bounds);
        }

        // Step 2: slice along the four boundary paths.
        for key in [&r.start, &r.end, &dst_start, &dst_end] {
            self.cut_children_at(ks, num, &bounds, key)?;
        }
        let int = self.interior(num);
        let source = Self::child_run(int, &bounds, &r.start, &r.end);
        let destination = Self::child_run(int, &bounds, &dst_start, &dst_end);
        let height = int.height;
        let doomed_roots = destination
            .clone()
            .map(|j| (int.children[j], int.child_bounds(j, &bounds), height - 1))
            .collect();
        let doomed = self.doomed_subtrees(ks, doomed_roots)?;
        // The swing and the release below cannot fail; healing after them
        // reads a neighbour before it changes anything, so an error there
        // leaves a whole tree (with an under-full node) behind.

        // Step 3: the pointer swing.
        let vacated = match how {
            Transplant::Move => {
                let range = Bounds {
                    lo: r.start.clone(),
                    hi: Some(r.end.clone()),
                };
                Some(self.empty_subtree(ks, height - 1, &range))
            }
            Transplant::Share => {
                for j in source.clone() {
                    let child = self.interior(num).children[j];
                    self.btt.add_ref(child);
                }
                None
            }
        };
        let empty_at = self.with_interior(num, |int| swing(int, &source, &destination, vacated, r));
        self.release(doomed);

        // Step 5: heal where the source was: the empty subtree and the
        // fringe pieces beside it merge with a neighbour (from the right,
        // so indices to the left stay valid). The moved run is left as it
        // is, cut exactly at its ends: merging a fringe piece into it would
        // make the next rename of the same range cut it again.
        let mut around: Vec<usize> = Vec::new();
        if let Some(at) = empty_at {
            around.extend([at + 1, at]);
            around.extend(at.checked_sub(1));
        }
        for i in around {
            if i < self.interior(num).children.len() {
                self.maybe_merge(ks, num, i, &bounds)?;
            }
        }
        let mut splits = if path.is_empty() {
            Vec::new()
        } else {
            self.split_if_needed(ks, num, &bounds)?
        };
        for (depth, (parent, parent_bounds, i)) in path.iter().enumerate().rev() {
            self.adopt_splits(*parent, *i, splits);
            // The root's splits are settle_root's (it grows the tree).
            splits = if depth == 0 {
                Vec::new()
            } else {
                self.split_if_needed(ks, *parent, parent_bounds)?
            };
        }
        Ok(true)
    }

    /// The children of `int` (with bounds `bounds`) covering exactly
    /// [start, end), whose ends are pivots or `bounds`' own ends.
    fn child_run(int: &Interior, bounds: &Bounds, start: &[u8], end: &[u8]) -> Range<usize> {
        let first = int.child_index(start);
        let past = if bounds.hi.as_deref() == Some(end) {
            int.children.len()
        } else {
            int.child_index(end)
        };
        debug_assert_eq!(int.child_bounds(first, bounds).lo, start);
        debug_assert!(first < past, "an empty run of children");
        debug_assert_eq!(int.child_bounds(past - 1, bounds).hi.as_deref(), Some(end));
        first..past
    }

    /// Makes `key` a pivot of interior node `num` (bounds `bounds`) unless
    /// it is one already or an end of its bounds, splitting the child that
    /// holds it down to the leaves.
    fn cut_children_at(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        key: &[u8],
    ) -> EngineResult<()> {
        if key <= bounds.lo.as_slice() || bounds.hi.as_deref().is_some_and(|h| key >= h) {
            return Ok(());
        }
        let int = self.interior(num);
        let i = int.child_index(key);
        let child_bounds = int.child_bounds(i, bounds);
        if child_bounds.lo.as_slice() == key {
            return Ok(());
        }
        let height = int.height - 1;
        let child = self.private_child(ks, num, i, bounds)?;
        let right = self.split_at(ks, child, &child_bounds, height, key)?;
        self.adopt_splits(num, i, vec![(key.to_vec(), right)]);
        Ok(())
    }

    /// Splits node `num` (bounds `bounds`, `key` strictly inside them) at
    /// `key`: it keeps [lo, key) and a new node, returned, takes [key, hi).
    /// Interior nodes are first cut down to the leaves so `key` becomes
    /// one of their pivots; pending messages go with their keys.
    pub(super) fn split_at(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        height: u32,
        key: &[u8],
    ) -> EngineResult<u64> {
        debug_assert!(bounds.contains(key) && key > bounds.lo.as_slice());
        self.load(ks, num, bounds, Want::Whole, Some(height))?;
        if height > 0 {
            self.cut_children_at(ks, num, bounds, key)?;
        }
        debug_assert!(self.is_private(num), "split of shared node {num}");
        let mut node = self.take(num);
        let right = match &mut node.body {
            NodeBody::Leaf(leaf) => NodeBody::Leaf(leaf.split_off(key)),
            NodeBody::Interior(int) => {
                let c = int.child_index(key);
                assert!(
                    c > 0 && int.pivots[c - 1] == key,
                    "tree invariant: the cut left {key:?} a pivot"
                );
                let pivots = int.pivots.split_off(c);
                int.pivots.pop();
                NodeBody::Interior(Interior {
                    height: int.height,
                    pivots,
                    children: int.children.split_off(c),
                    buffers: int.buffers.split_off(c),
                    partial: None,
                })
            }
        };
        node.bounds = Bounds {
            lo: bounds.lo.clone(),
            hi: Some(key.to_vec()),
        };
        node.dirty = true;
        self.put(num, node);
        add(&self.stats.splits, 1);
        let right_bounds = Bounds {
            lo: key.to_vec(),
            hi: bounds.hi.clone(),
        };
        Ok(self.new_node(ks, right, right_bounds))
    }
}

/// What a surgery does with the source run once it hangs at the
/// destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Transplant {
    /// A range rename: the source range is left empty.
    Move,
    /// A range clone: the source keeps its subtrees, now shared.
    Share,
}

/// The pointer swing in `int`: the `source` run of children (with their
/// buffers, re-keyed) replaces the `destination` run, whose buffers are
/// dropped (the rename deletes what the destination held). With `vacated`
/// (a rename) that empty subtree takes the source's place, and where it is
/// now is returned; without (a clone) the source run stays and its
/// buffers are copied.
fn swing(
    int: &mut Interior,
    source: &Range<usize>,
    destination: &Range<usize>,
    vacated: Option<u64>,
    r: &RangeRename,
) -> Option<usize> {
    let old_children = std::mem::take(&mut int.children);
    let old_pivots = std::mem::take(&mut int.pivots);
    let mut old_buffers: Vec<Arc<MessageBuffer>> = std::mem::take(&mut int.buffers);
    // Each child's low pivot; the first child's is never used.
    let low = |j: usize| -> Vec<u8> {
        j.checked_sub(1)
            .and_then(|p| old_pivots.get(p))
            .cloned()
            .unwrap_or_default()
    };
    let transplanted: Vec<(u64, MessageBuffer, Vec<u8>)> = source
        .clone()
        .map(|k| {
            let buffer = match vacated {
                Some(_) => std::mem::take(&mut old_buffers[k]),
                None => old_buffers[k].clone(),
            };
            let lo = if k == source.start {
                r.start.clone()
            } else {
                low(k)
            };
            let rekeyed = Arc::unwrap_or_clone(buffer).rekeyed(|key| r.moved(key));
            (old_children[k], rekeyed, r.destination(&lo))
        })
        .collect();
    let mut transplanted = Some(transplanted);
    let mut lows = Vec::with_capacity(old_children.len() + source.len());
    let mut empty_at = None;
    for j in 0..old_children.len() {
        if destination.contains(&j) {
            for (child, buffer, lo) in transplanted.take().into_iter().flatten() {
                int.children.push(child);
                int.buffers.push(Arc::new(buffer));
                lows.push(lo);
            }
        } else if let (true, Some(empty)) = (source.contains(&j), vacated) {
            if j == source.start {
                empty_at = Some(int.children.len());
                int.children.push(empty);
                int.buffers.push(Default::default());
                lows.push(r.start.clone());
            }
        } else {
            int.children.push(old_children[j]);
            int.buffers.push(std::mem::take(&mut old_buffers[j]));
            lows.push(low(j));
        }
    }
    int.pivots = lows.into_iter().skip(1).collect();
    debug_assert!(int.pivots.windows(2).all(|w| w[0] < w[1]));
    empty_at
}
