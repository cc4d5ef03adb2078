//! The node map: taking nodes out while they change and putting them back,
//! LRU ticks and memory accounting.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

/// How much a node changed in place grew ([`Tree::change_dirty_in_place`]).
pub(super) struct Grown {
    /// In memory ([`Node::mem_bytes`]).
    pub(super) mem: isize,
    /// In content ([`Node::content_bytes`]).
    pub(super) content: isize,
}

impl Tree {
    pub(super) fn take(&mut self, num: u64) -> Node {
        let node = match self.cache.remove(&num) {
            Some(node) => node,
            None => panic!("tree invariant: node {num} must be cached here"),
        };
        self.cache_bytes -= node.mem_bytes();
        self.dirty_bytes -= dirty_estimate(&node);
        if let Some(cp) = &mut self.checkpoint {
            cp.before_change(num, &node, &self.stats);
        }
        // A write-back of its image in flight no longer shows it.
        self.writing_back.remove(&num);
        node
    }

    /// The next tick of the clock of node uses.
    pub(super) fn next_tick(&self) -> u64 {
        self.tick.fetch_add(1, AtomicOrdering::Relaxed) + 1
    }

    pub(super) fn put(&mut self, num: u64, node: Node) {
        // A node read in part holds stand-ins for what it left on disk:
        // written, it would lose them. Whatever changes a node reads it
        // whole first.
        assert!(
            !(node.dirty && node.is_partial()),
            "tree invariant: node {num} changed while read in part"
        );
        node.last_used.set(self.next_tick());
        self.cache_bytes += node.mem_bytes();
        self.cache_bytes_peak = self.cache_bytes_peak.max(self.cache_bytes);
        self.dirty_bytes += dirty_estimate(&node);
        let previous = self.cache.insert(num, node);
        debug_assert!(previous.is_none(), "node {num} cached twice");
    }

    /// Changes node `num`, cached and dirty, where it lies in the cache:
    /// what [`Tree::take`] and [`Tree::put`] do around a change, the
    /// cache's memory and dirty bytes moved by what `change` says the
    /// node grew by instead of summed over the whole node twice (for a
    /// node already dirty, its dirty estimate moves with its content).
    /// `arg` comes back unused when the node is clean: a change that makes
    /// it dirty goes through `take` and `put`, counted whole. Debug builds
    /// check the growth against the node's sums.
    pub(super) fn change_dirty_in_place<A, T>(
        &mut self,
        num: u64,
        arg: A,
        change: impl FnOnce(&mut Node, &MergeRegistry, A) -> (T, Grown),
    ) -> Result<T, A> {
        let tick = self.next_tick();
        let Some(node) = self.cache.get_mut(&num).filter(|node| node.dirty) else {
            return Err(arg);
        };
        if let Some(cp) = &mut self.checkpoint {
            cp.before_change(num, node, &self.stats);
        }
        self.writing_back.remove(&num);
        node.last_used.set(tick);
        #[cfg(debug_assertions)]
        let before = (node.mem_bytes(), dirty_estimate(node));
        let (value, grown) = change(node, &self.merges, arg);
        #[cfg(debug_assertions)]
        {
            let after = (node.mem_bytes(), dirty_estimate(node));
            debug_assert_eq!(
                (
                    after.0 as isize - before.0 as isize,
                    after.1 as isize - before.1 as isize
                ),
                (grown.mem, grown.content),
                "tree invariant: node {num} changed in place counts what it grew by"
            );
        }
        let counted = |total: usize, change: isize| match total.checked_add_signed(change) {
            Some(total) => total,
            None => panic!("tree invariant: counted bytes below zero ({total} {change:+})"),
        };
        self.cache_bytes = counted(self.cache_bytes, grown.mem);
        self.cache_bytes_peak = self.cache_bytes_peak.max(self.cache_bytes);
        self.dirty_bytes = counted(self.dirty_bytes, grown.content);
        Ok(value)
    }

    pub(super) fn new_node(&mut self, ks: KeySpace, body: NodeBody, bounds: Bounds) -> u64 {
        let num = self.btt.allocate();
        self.put(
            num,
            Node {
                body,
                bounds,
                tree: ks as u8,
                dirty: true,
                last_used: Default::default(),
            },
        );
        num
    }

    pub(super) fn node(&self, num: u64) -> &Node {
        match self.cache.get(&num) {
            Some(node) => node,
            None => panic!("tree invariant: node {num} must be cached here"),
        }
    }

    pub(super) fn interior(&self, num: u64) -> &Interior {
        match &self.node(num).body {
            NodeBody::Interior(int) => int,
            NodeBody::Leaf(_) => panic!("tree invariant: node {num} must be interior"),
        }
    }

    /// Changes an interior node in place (marking it dirty).
    pub(super) fn with_interior<R>(&mut self, num: u64, f: impl FnOnce(&mut Interior) -> R) -> R {
        debug_assert!(self.is_private(num), "change of shared node {num}");
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
    pub(super) fn free_node(&mut self, num: u64) {
        if self.cache.contains_key(&num) {
            drop(self.take(num));
        }
        if let Some(extent) = self.btt.release(num) {
            self.alloc.free(extent);
        }
    }
}
