//! Flushing: moving a child's messages from its parent's buffer down to
//! it, the cascade that follows, and flushes as background work within a
//! budget.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;
use crate::buffer::{PartCut, PartLimit};
use crate::node::MergedBasement;
use crate::tree::readahead::LeafOnDisk;

/// What a step of a writer's settling works on ([`Tree::settle_target`]).
pub enum SettleTarget {
    /// The root of a tree.
    Root(KeySpace),
    /// Child `i` of interior node `parent` (reached under
    /// `parent_bounds`), below a root.
    Below {
        ks: KeySpace,
        parent: u64,
        i: usize,
        parent_bounds: Bounds,
    },
}

/// A step's merge of part of a buffer into a leaf, worked out before the
/// step holding no tree lock ([`StepMergeInput::merge`]): the step, holding
/// the lock alone, takes the same part out of the buffer
/// ([`PreparedMerge::part_in`]) and puts the merged basements in place.
/// The merge was most of a step's hold of the lock (a quarter node of
/// messages into a few basements), during which every query waited — and,
/// made on the upgradable lock with queries let in, every other writer
/// past the staging bound still did.
pub struct PreparedMerge {
    /// The buffer the part was cut from, held until the step checks that
    /// its parent still has this one: a buffer is changed copy-on-write,
    /// and this reference makes any change copy it, so the same allocation
    /// means the same messages.
    buffer: Arc<MessageBuffer>,
    /// Where the part ends, and the key bound it was cut under
    /// ([`Tree::step_key_bound`]): the step takes the same part out
    /// without searching the buffer again.
    cut: PartCut,
    before: Option<Vec<u8>>,
    merge: LeafMerge,
}

/// The leaf side of a [`PreparedMerge`]: what the step checks against the
/// leaf and puts in place.
struct LeafMerge {
    /// The leaf merged into.
    leaf: u64,
    /// Its basements' entries as they were merged from: the step checks
    /// that the leaf still has these before it takes the merge.
    from: Vec<Option<Arc<Entries>>>,
    /// The basements rewritten, by index.
    merged: Vec<MergedBasement>,
    /// The messages of the part merged: the step checks that it takes as
    /// many out of the buffer.
    messages: usize,
}

/// What a step's merge into a leaf is worked out from, taken from the tree
/// under its lock for the merge to be made with the lock let go
/// ([`Tree::step_merge_input`]): the leaf and the buffer shared, not
/// copied (the leaf's basements and the buffer are replaced, not changed
/// in place, while these references live).
pub struct StepMergeInput {
    leaf_num: u64,
    leaf: Leaf,
    buffer: Arc<MessageBuffer>,
    /// The key the part stops before ([`Tree::step_key_bound`]).
    before: Option<Vec<u8>>,
    limit: PartLimit<'static>,
    merges: Arc<MergeRegistry>,
    basement_size: usize,
}

impl StepMergeInput {
    /// The merge, or None if it fails (an unknown merge function: the
    /// step under the lock fails the same way).
    pub fn merge(self) -> Option<PreparedMerge> {
        let limit = PartLimit {
            before: self.before.as_deref(),
            ..self.limit
        };
        let cut = self.buffer.part_cut(limit);
        let part = self.buffer.part(&cut);
        let merged = self
            .leaf
            .merged_basements(&part, &self.merges, self.basement_size)
            .ok()?;
        let messages = part.message_count();
        Some(PreparedMerge {
            buffer: self.buffer,
            cut,
            before: self.before,
            merge: LeafMerge {
                leaf: self.leaf_num,
                from: self.leaf.basements.into_iter().map(|b| b.entries).collect(),
                merged,
                messages,
            },
        })
    }
}

impl PreparedMerge {
    /// Where the part this merge was made of ends in `buffer` as it is
    /// now, cut under the key bound `before`, with the leaf side to check
    /// and put in place: None unless the merge was cut from this very
    /// buffer under the same bound (then it is the same part). The
    /// reference to the buffer goes either way, so that taking the part
    /// out does not copy it.
    fn part_in(
        self,
        buffer: &Arc<MessageBuffer>,
        before: Option<&[u8]>,
    ) -> Option<(PartCut, LeafMerge)> {
        (Arc::ptr_eq(&self.buffer, buffer) && self.before.as_deref() == before)
            .then_some((self.cut, self.merge))
    }
}

impl LeafMerge {
    /// Whether this merge was made from `leaf` as it is now (node `num`)
    /// and the part `taken` out of the buffer.
    fn made_from(&self, num: u64, leaf: &Leaf, taken: &MessageBuffer) -> bool {
        self.leaf == num
            && self.messages == taken.message_count()
            && self.from.len() == leaf.basements.len()
            && self
                .from
                .iter()
                .zip(&leaf.basements)
                .all(|(from, b)| match (from, &b.entries) {
                    (Some(from), Some(now)) => Arc::ptr_eq(from, now),
                    _ => false,
                })
    }
}

/// A step that flushes part of buffer `i` of interior node `node` into
/// its leaf child `leaf`, reached under `leaf_bounds`, in tree `ks`
/// ([`Tree::step_into_leaf`]).
struct StepIntoLeaf {
    ks: KeySpace,
    node: u64,
    i: usize,
    leaf: u64,
    leaf_bounds: Bounds,
}

/// Whether a flush of up to `limit` bytes out of buffer `i` of `int`
/// (its child under `child_bounds`) drops that child's subtree unread: the
/// buffer is within the flush's bytes and a range delete in it covers the
/// child. (A step's flush, capped in messages too, may then move only
/// part of the buffer into the fresh subtree; the rest follows.)
fn drops_child_unread(int: &Interior, i: usize, child_bounds: &Bounds, limit: usize) -> bool {
    let buffer = &int.buffers[i];
    buffer.bytes() <= limit && buffer.covers_whole(&child_bounds.lo, child_bounds.hi.as_deref())
}

/// Who moves a batch's messages down from the roots
/// ([`Tree::apply_batch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flushing {
    /// The writer, all of it within the batch's application: log replay,
    /// and a device short of room.
    Inline,
    /// The writer, before its write returns, in steps
    /// ([`Tree::settle_step`]) between which the store lets other
    /// requests take the lock (a store without the flusher thread).
    Stepwise,
    /// The store's flusher thread, in turns ([`Tree::flush_turn`]).
    Background,
}

/// Whether a flush into a child goes on down from there
/// ([`Tree::flush_part`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cascade {
    /// The child is settled at once: its own buffers flushed down until
    /// they fit, all the way to the leaves.
    Down,
    /// An interior child keeps what it took, even past a node's worth, for
    /// a later step (a leaf child always splits at once).
    OneLevel,
}

impl Tree {
    /// Flushes node `num` until its buffers fit, then splits it if it is too
    /// big. Returns the new right siblings for the parent to adopt.
    pub(super) fn settle(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
    ) -> EngineResult<Splits> {
        self.flush_heaviest(ks, num, bounds, usize::MAX)?;
        self.split_if_needed(ks, num, bounds)
    }

    /// Flushes the heaviest buffer of node `num` down, again and again,
    /// until its buffers hold no more than a node's worth or about
    /// `budget` bytes have left it (a turn of background flushing takes
    /// parts of a buffer; `usize::MAX` moves whole buffers).
    pub(super) fn flush_heaviest(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        budget: usize,
    ) -> EngineResult<()> {
        let mut left = budget.max(1);
        while left > 0 {
            let NodeBody::Interior(int) = &self.node(num).body else {
                break;
            };
            if int.buffer_bytes() <= self.opts.node_size {
                break;
            }
            let heaviest = self.heaviest_buffer(num);
            let moved = self.flush_part(
                ks,
                num,
                heaviest,
                bounds,
                PartLimit::bytes(left),
                Cascade::Down,
                None,
            )?;
            left = left.saturating_sub(moved.max(1));
        }
        Ok(())
    }

    /// Moves the buffer for child `i` of `parent` into the child, settles
    /// the child, adopts its splits and merges it if it became too small.
    pub(super) fn flush_child(
        &mut self,
        ks: KeySpace,
        parent: u64,
        i: usize,
        parent_bounds: &Bounds,
    ) -> EngineResult<()> {
        self.flush_part(
            ks,
            parent,
            i,
            parent_bounds,
            PartLimit::ALL,
            Cascade::Down,
            None,
        )
        .map(|_| ())
    }

    /// [`Tree::flush_child`] of only the messages of the lowest keys in
    /// the buffer, `limit`'s worth of them (all if there are no more;
    /// background flushing's step): the child, settled after, passes on
    /// about what it took. Returns the bytes moved. With
    /// [`Cascade::OneLevel`] an interior child is not settled (only split,
    /// if it has too many children). A leaf child takes `prepared`, the
    /// merge of the same part into it worked out beforehand, if it was
    /// made from the leaf as it is.
    #[allow(clippy::too_many_arguments)]
    fn flush_part(
        &mut self,
        ks: KeySpace,
        parent: u64,
        i: usize,
        parent_bounds: &Bounds,
        limit: PartLimit<'_>,
        cascade: Cascade,
        prepared: Option<PreparedMerge>,
    ) -> EngineResult<usize> {
        let int = self.interior(parent);
        let child_bounds = int.child_bounds(i, parent_bounds);
        let child_height = int.height - 1;
        let mut child = int.children[i];
        if drops_child_unread(int, i, &child_bounds, limit.bytes) {
            // A range delete covers the whole child: drop its subtree without
            // reading a single leaf and start over with an empty one.
            let doomed =
                self.doomed_subtrees(ks, vec![(child, child_bounds.clone(), child_height)])?;
            let fresh = self.empty_subtree(ks, child_height, &child_bounds);
            self.release(doomed);
            self.with_interior(parent, |int| int.children[i] = fresh);
            add(&self.stats.subtrees_dropped, 1);
            child = fresh;
        } else {
            child = self.private_child(ks, parent, i, parent_bounds)?;
            self.load(ks, child, &child_bounds, Want::Whole, Some(child_height))?;
        }
        let before = match cascade {
            Cascade::OneLevel => self.step_key_bound(parent, i, child),
            Cascade::Down => None,
        };
        let limit = PartLimit {
            before: before.as_deref().or(limit.before),
            ..limit
        };
        // A merge worked out with the lock let go is of this buffer only
        // if its parent has the very buffer it was cut from; then the part
        // it was made of is taken out as it was cut.
        let offered = prepared.is_some();
        let prepared =
            prepared.and_then(|p| p.part_in(&self.interior(parent).buffers[i], limit.before));
        let (batch, prepared) = self.with_interior(parent, |int| {
            let buffer = Arc::make_mut(&mut int.buffers[i]);
            match prepared {
                Some((cut, merge)) => (buffer.take_part(cut), Some(merge)),
                None => (buffer.take_first(limit), None),
            }
        });
        let moved = batch.bytes();
        let count = batch.message_count() as u64;
        let merges = self.merges.clone();
        let mut node = self.take(child);
        let result = match &mut node.body {
            NodeBody::Leaf(leaf) => {
                let r = match prepared {
                    Some(merge) if merge.made_from(child, leaf, &batch) => {
                        add(&self.stats.step_merges_unlocked, 1);
                        self.freed_later.push(batch);
                        Ok(leaf.install_basements(merge.merged))
                    }
                    _ => {
                        if offered {
                            add(&self.stats.step_merges_redone, 1);
                        }
                        leaf.apply_buffer(batch, &merges, self.opts.basement_size)
                    }
                };
                leaf.rebalance_basements(self.opts.basement_size);
                r.map(|rewritten| {
                    if cascade == Cascade::OneLevel {
                        note_max(&self.stats.settle_step_basements_max, rewritten as u64);
                    }
                })
                .map_err(EngineError::UnknownMergeFunction)
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
        if cascade == Cascade::OneLevel {
            note_max(&self.stats.settle_step_messages_max, count);
        }
        add(&self.stats.flushes, 1);
        add(&self.stats.messages_flushed, count);
        let splits = match cascade {
            Cascade::Down => self.settle(ks, child, &child_bounds)?,
            Cascade::OneLevel => {
                if child_height > 0 {
                    self.unsettled_below_roots = true;
                }
                self.split_if_needed(ks, child, &child_bounds)?
            }
        };
        self.adopt_splits(parent, i, splits);
        self.maybe_merge(ks, parent, i, parent_bounds)?;
        Ok(moved)
    }

    /// Whether interior node `num` holds more than it may: buffers past a
    /// node's worth, or more children than the fanout.
    fn unsettled(&self, num: u64) -> bool {
        match &self.node(num).body {
            NodeBody::Interior(int) => {
                int.buffer_bytes() > self.opts.node_size || int.children.len() > self.opts.fanout
            }
            NodeBody::Leaf(_) => false,
        }
    }

    /// What the next step of a writer's settling ([`Tree::settle_step`])
    /// works on: the first node, top down, that holds more than it may —
    /// a root, then interior nodes reached through cached ones. None when
    /// nothing does.
    pub fn settle_target(&mut self) -> Option<SettleTarget> {
        for ks in KeySpace::ALL {
            let root = self.roots[ks.index()];
            if self.cache.contains_key(&root) && self.unsettled(root) {
                return Some(SettleTarget::Root(ks));
            }
        }
        if !self.unsettled_below_roots {
            return None;
        }
        for ks in KeySpace::ALL {
            if let Some((parent, i, parent_bounds)) = self.first_unsettled_below_root(ks) {
                return Some(SettleTarget::Below {
                    ks,
                    parent,
                    i,
                    parent_bounds,
                });
            }
        }
        self.unsettled_below_roots = false;
        None
    }

    /// One step of a writer's settling ([`Flushing::Stepwise`]) on
    /// `target` ([`Tree::settle_target`]), with the tree whole before and
    /// after it: the node flushes the first quarter-node of its heaviest
    /// buffer into that child and no further ([`Cascade::OneLevel`]; a
    /// leaf child splits), or splits. A cascade that held the lock for
    /// tens of milliseconds (a root's buffer down to an interior node, its
    /// buffers down to leaves, the leaves and then the node split) is
    /// thus steps of a bounded part each, and the store lets waiting
    /// requests in between them (docs/design.md, "Settling in steps").
    /// A step into a leaf takes `prepared`, its merge worked out
    /// beforehand ([`Tree::step_merge_input`]), if it still fits.
    pub fn settle_step(
        &mut self,
        target: SettleTarget,
        prepared: Option<PreparedMerge>,
    ) -> EngineResult<()> {
        match target {
            SettleTarget::Root(ks) => {
                let root = self.roots[ks.index()];
                self.flush_step(ks, root, &Bounds::full(), prepared)?;
                self.settle_root_shape(ks)
            }
            SettleTarget::Below {
                ks,
                parent,
                i,
                parent_bounds,
            } => {
                let child = self.private_child(ks, parent, i, &parent_bounds)?;
                let bounds = self.interior(parent).child_bounds(i, &parent_bounds);
                self.flush_step(ks, child, &bounds, prepared)?;
                let splits = self.split_if_needed(ks, child, &bounds)?;
                self.adopt_splits(parent, i, splits);
                self.maybe_merge(ks, parent, i, &parent_bounds)
            }
        }
    }

    /// A step's flush: if interior node `num` (reached under `bounds`)
    /// holds more than a node, the first quarter-node of its heaviest
    /// buffer goes one level down. The lowest keys' messages first, as the
    /// flusher's turns move them: the buffer invariant holds between
    /// steps.
    fn flush_step(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        prepared: Option<PreparedMerge>,
    ) -> EngineResult<()> {
        if let Some(i) = self.flush_step_buffer(num) {
            let part = self.flush_step_limit();
            self.flush_part(ks, num, i, bounds, part, Cascade::OneLevel, prepared)?;
        }
        Ok(())
    }

    /// What the steps since the last call took out of the trees to be
    /// freed with the lock let go.
    pub fn take_freed_later(&mut self) -> Vec<MessageBuffer> {
        std::mem::take(&mut self.freed_later)
    }

    /// What the merge into a leaf that the step on `target` will make is
    /// worked out from, for the writer to work it out with the tree lock
    /// let go, before the step ([`StepMergeInput::merge`]). None when the
    /// step does not merge into a leaf that is cached whole and private
    /// (it splits, flushes into an interior node, drops a subtree, reads
    /// or copies the leaf first).
    pub fn step_merge_input(&self, target: &SettleTarget) -> Option<StepMergeInput> {
        let step = self.step_into_leaf(target)?;
        // A node below a root that others share is copied by the step
        // first (`private_child`), and so is a shared leaf.
        let below_root = matches!(target, SettleTarget::Below { .. });
        if (below_root && !self.is_private(step.node)) || !self.is_private(step.leaf) {
            return None;
        }
        let int = self.interior(step.node);
        let Some(Node {
            body: NodeBody::Leaf(leaf),
            ..
        }) = self.cache.get(&step.leaf)
        else {
            return None;
        };
        if int.is_partial() || !leaf.is_fully_loaded() {
            return None;
        }
        // The part the step will take: flush_part's, with a leaf child.
        Some(StepMergeInput {
            leaf_num: step.leaf,
            leaf: leaf.clone(),
            buffer: int.buffers[step.i].clone(),
            before: self.step_key_bound(step.node, step.i, step.leaf),
            limit: self.flush_step_limit(),
            merges: self.merges.clone(),
            basement_size: self.opts.basement_size,
        })
    }

    /// Where the step on `target` flushes into a leaf: None when it
    /// flushes into an interior node, splits, or drops the child unread
    /// (what [`Tree::settle_step_leaf`] and [`Tree::step_merge_input`]
    /// both look for, as the step itself will find it).
    fn step_into_leaf(&self, target: &SettleTarget) -> Option<StepIntoLeaf> {
        let (ks, node, bounds) = match target {
            SettleTarget::Root(ks) => (*ks, self.roots[ks.index()], Bounds::full()),
            SettleTarget::Below {
                ks,
                parent,
                i,
                parent_bounds,
            } => {
                let int = self.interior(*parent);
                (*ks, int.children[*i], int.child_bounds(*i, parent_bounds))
            }
        };
        let int = self.interior(node);
        if int.height != 1 {
            return None;
        }
        let i = self.flush_step_buffer(node)?;
        let leaf_bounds = int.child_bounds(i, &bounds);
        if drops_child_unread(int, i, &leaf_bounds, self.flush_step_limit().bytes) {
            return None;
        }
        Some(StepIntoLeaf {
            ks,
            node,
            i,
            leaf: int.children[i],
            leaf_bounds,
        })
    }

    /// The buffer of interior node `num` a step's flush empties part of
    /// (its heaviest), if the node holds more than a node's worth.
    fn flush_step_buffer(&self, num: u64) -> Option<usize> {
        (self.interior(num).buffer_bytes() > self.opts.node_size).then(|| self.heaviest_buffer(num))
    }

    /// How much of a buffer one step's flush moves: a quarter node, and
    /// no more than [`TreeOptions::settle_step_messages`] point messages.
    fn flush_step_limit(&self) -> PartLimit<'static> {
        PartLimit {
            bytes: self.opts.node_size / 4,
            points: self.opts.settle_step_messages,
            before: None,
        }
    }

    /// Where a step's part out of buffer `i` of `parent` stops when the
    /// child, `child`, is a leaf: past the basements a quarter node fills,
    /// counted from the first one the buffer's messages reach. A quarter
    /// node of messages spread over a whole leaf (uniform keys: WS3)
    /// rewrote every basement of it in one step, 4 MiB copied in 3-6 ms
    /// of the lock; bounded, a step rewrites about a quarter node of it
    /// and the next steps the rest. None for an interior child, or when
    /// the leaf has no such basement.
    fn step_key_bound(&self, parent: u64, i: usize, child: u64) -> Option<Vec<u8>> {
        let NodeBody::Leaf(leaf) = &self.node(child).body else {
            return None;
        };
        let first = self.interior(parent).buffers[i].first_key()?;
        let span = (self.opts.node_size / 4 / self.opts.basement_size).max(1);
        leaf.pivots
            .get(leaf.basement_for(first) + span - 1)
            .cloned()
    }

    /// The leaf a step on `target` flushes into, when the cache does not
    /// hold it whole: where it, or its missing basements, lie on disk —
    /// for the writer to read holding no lock before the step, which would
    /// otherwise read it with every other request shut out. None when the
    /// step reads no leaf.
    pub fn settle_step_leaf(&self, target: &SettleTarget) -> Option<LeafOnDisk> {
        let StepIntoLeaf {
            ks,
            leaf,
            leaf_bounds,
            ..
        } = self.step_into_leaf(target)?;
        match self.cache.get(&leaf) {
            None => self.leaf_on_disk(ks, leaf, leaf_bounds),
            Some(Node {
                body: NodeBody::Leaf(cached),
                ..
            }) if cached.basements.iter().any(|b| b.entries.is_none()) => {
                self.basements_on_disk(ks, leaf, &leaf_bounds)
            }
            Some(_) => None,
        }
    }

    /// The index of the buffer of interior node `num` holding the most.
    fn heaviest_buffer(&self, num: u64) -> usize {
        let int = self.interior(num);
        (0..int.buffers.len())
            .max_by_key(|&i| int.buffers[i].bytes())
            .unwrap_or(0)
    }

    /// The topmost interior node below the root of `ks` that holds more
    /// than it may, among those reached through cached interior nodes, as
    /// its parent, its index there and the parent's bounds (breadth
    /// first: a parent is worked on before its children).
    fn first_unsettled_below_root(&self, ks: KeySpace) -> Option<(u64, usize, Bounds)> {
        let mut level = vec![(self.roots[ks.index()], Bounds::full())];
        while !level.is_empty() {
            let mut next = Vec::new();
            for (num, bounds) in level {
                let Some(Node {
                    body: NodeBody::Interior(int),
                    ..
                }) = self.cache.get(&num)
                else {
                    continue;
                };
                // A node read in part is not changed (a step would split or
                // merge below it): a child left unsettled under it is
                // found once a flush through the node reads it whole.
                if int.height < 2 || int.is_partial() {
                    continue;
                }
                for (i, &child) in int.children.iter().enumerate() {
                    // A shared child is changed only through a flush that
                    // makes it private: nothing is left unsettled below it.
                    if !self.cache.contains_key(&child) || !self.is_private(child) {
                        continue;
                    }
                    let child_bounds = int.child_bounds(i, &bounds);
                    if self.unsettled(child) {
                        return Some((num, i, bounds));
                    }
                    next.push((child, child_bounds));
                }
            }
            level = next;
        }
        None
    }

    /// The most bytes the buffers of any tree's root hold (what background
    /// flushing has yet to move down).
    pub fn flush_backlog(&self) -> usize {
        KeySpace::ALL
            .into_iter()
            .map(|ks| self.root_buffer_bytes(ks))
            .max()
            .unwrap_or(0)
    }

    /// The bytes a root's buffers may hold before writers wait for
    /// background flushing (back-pressure): a node and a half, enough to
    /// take a burst while a turn runs, or an eighth of the cache's budget
    /// if that is less (the roots are cached nodes), never under a node.
    /// Only the roots are fuller than a node between turns: what a turn moves into
    /// a child is settled at once.
    pub fn flush_backlog_bound(&self) -> usize {
        let node = self.opts.node_size;
        (self.cache_budget() / 8).clamp(node, node + node / 2)
    }

    /// The bytes of a root's buffers past which background flushing
    /// works: a node's worth, where a writer's own settling began.
    pub fn flush_low_water(&self) -> usize {
        self.opts.node_size
    }

    /// One turn of background flushing, with the tree lock held: the tree
    /// whose root's buffers hold the most past a node's worth settles as a
    /// writer's would, but moving about `budget` bytes out of its root at
    /// most ([`Tree::settle_root_within`]: the heaviest buffer's first
    /// part, part after part). Returns whether a root still holds more
    /// than a node's worth. Between two turns the tree is whole and every
    /// message is where a query looks for it.
    pub fn flush_turn(&mut self, budget: usize) -> EngineResult<bool> {
        let low_water = self.flush_low_water();
        let fullest = KeySpace::ALL
            .into_iter()
            .map(|ks| (self.root_buffer_bytes(ks), ks))
            .filter(|&(bytes, _)| bytes > low_water)
            .max_by_key(|&(bytes, _)| bytes);
        if let Some((_, ks)) = fullest {
            self.settle_root_within(ks, budget)?;
        }
        Ok(self.flush_backlog() > low_water)
    }

    /// Inserts the right siblings a split of child `i` produced. The
    /// parent's buffer for child `i` is cut at the new pivots so every
    /// message stays with the child whose range holds its key (after a
    /// merge-then-resplit that buffer is not empty).
    pub(super) fn adopt_splits(&mut self, parent: u64, i: usize, splits: Splits) {
        if splits.is_empty() {
            return;
        }
        self.with_interior(parent, |int| {
            for (k, (pivot, num)) in splits.into_iter().enumerate() {
                let right = Arc::make_mut(&mut int.buffers[i + k]).split_off(&pivot);
                int.pivots.insert(i + k, pivot);
                int.children.insert(i + 1 + k, num);
                int.buffers.insert(i + 1 + k, Arc::new(right));
            }
        });
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

    /// How many dirty bytes a reclaim step may make: a quarter of what the
    /// image-sized free runs hold, at least two nodes. When the dirty
    /// bytes counted what nodes hold and not the blocks their basements
    /// begin on (`dirty_estimate` counts those now), the images came to
    /// nearly twice the count with basements of a few kilobytes, and a
    /// step budgeted at half the runs made more than its checkpoint
    /// could place.
    pub fn reclaim_budget(&self) -> usize {
        let runs = self.image_sized_run_bytes();
        ((runs / 4) as usize).max(2 * self.opts.node_size)
    }

    pub(super) fn flush_subtree(
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
            // A shared subtree keeps its pending messages: flushing them
            // would copy it (reclaiming space is why this runs).
            if height > 0 && self.is_private(child) {
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
}
