//! Shared subtrees (docs/design.md, "Range clone"): a range clone makes
//! two parents name the same child, counted in the block table. A shared
//! node is never changed: whatever would change it first takes a private
//! copy for the parent it is reached through ([`Tree::private_child`]),
//! copy-on-write one node at a time, down the path a change takes. Cached
//! shared nodes carry the keys of the place they were last reached at and
//! are re-keyed when reached through another ([`Node::move_to`]); their
//! images are the same under every parent (node format 2).
//!
//! Dropping a subtree ([`Tree::doomed_subtrees`], [`Tree::release`]) frees
//! a node only once every reference to it is gone; nodes still named
//! elsewhere lose the references the dropped parents held.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

/// What dropping some subtrees does to their nodes.
#[derive(Default)]
pub(super) struct Release {
    /// Nodes no longer referenced at all.
    free: Vec<u64>,
    /// Shared nodes named elsewhere too, with the references dropped.
    unreference: Vec<(u64, u32)>,
}

impl Tree {
    /// Child `i` of interior node `parent` (bounds `parent_bounds`), made
    /// private to `parent` so that it may be changed: a shared child is
    /// copied to a new node number (its children gain a reference from
    /// the copy) and the parent points at the copy. `parent` itself must
    /// be private.
    pub(super) fn private_child(
        &mut self,
        ks: KeySpace,
        parent: u64,
        i: usize,
        parent_bounds: &Bounds,
    ) -> EngineResult<u64> {
        let int = self.interior(parent);
        let child = int.children[i];
        let bounds = int.child_bounds(i, parent_bounds);
        let height = int.height - 1;
        // Loaded (and so re-keyed) for this place even when private: a
        // node shared until a copy was taken for its other place is still
        // keyed for wherever it was last reached, and a change made with
        // its pivots under this place's bounds would mix the two (a
        // settle step after a rename and a clone failed so: its child
        // reached with bounds half of one place, half of the other).
        self.load(ks, child, &bounds, Want::Whole, Some(height))?;
        if self.is_private(child) {
            return Ok(child);
        }
        let original = self.node(child);
        let mut copy = Node {
            body: original.body.clone(),
            bounds,
            tree: original.tree,
            dirty: true,
            last_used: Default::default(),
        };
        match &mut copy.body {
            NodeBody::Interior(int) => {
                for &grandchild in &int.children {
                    self.btt.add_ref(grandchild);
                }
            }
            NodeBody::Leaf(leaf) => leaf.forget_locations(),
        }
        let num = self.btt.allocate();
        self.put(num, copy);
        self.btt.drop_refs(child, 1);
        self.with_interior(parent, |int| int.children[i] = num);
        add(&self.stats.nodes_unshared, 1);
        Ok(num)
    }

    /// Whether node `num` may be changed in place (no other parent names
    /// it). Checked before every change of a node reached through a parent.
    pub(super) fn is_private(&self, num: u64) -> bool {
        self.btt.refs(num) == 1
    }

    /// What dropping the subtrees `roots` (node, bounds, height) releases:
    /// a node is freed when every reference to it lies inside the dropped
    /// subtrees (counted as the walk finds them), and only then is its
    /// subtree walked; leaves are never read. Changes nothing, so it may
    /// fail (reading an interior node) before anything changed.
    pub(super) fn doomed_subtrees(
        &mut self,
        ks: KeySpace,
        roots: Vec<(u64, Bounds, u32)>,
    ) -> EngineResult<Release> {
        let mut dropped: HashMap<u64, u32> = HashMap::new();
        let mut release = Release::default();
        let mut stack = roots;
        while let Some((num, bounds, height)) = stack.pop() {
            let count = dropped.entry(num).or_insert(0);
            *count += 1;
            debug_assert!(*count <= self.btt.refs(num), "node {num} over-referenced");
            if *count < self.btt.refs(num) {
                continue;
            }
            release.free.push(num);
            if height > 0 {
                self.load(ks, num, &bounds, Want::Whole, Some(height))?;
                let int = self.interior(num);
                stack.extend(
                    (0..int.children.len())
                        .map(|j| (int.children[j], int.child_bounds(j, &bounds), height - 1)),
                );
            }
        }
        release.unreference = dropped
            .into_iter()
            .filter(|&(num, count)| count < self.btt.refs(num))
            .collect();
        Ok(release)
    }

    /// Carries out a [`Release`]; cannot fail.
    pub(super) fn release(&mut self, release: Release) {
        for (num, count) in release.unreference {
            self.btt.drop_refs(num, count);
        }
        for num in release.free {
            // Every reference to it lay inside the dropped subtrees.
            let refs = self.btt.refs(num);
            if refs > 1 {
                self.btt.drop_refs(num, refs - 1);
            }
            self.free_node(num);
        }
    }
}
