//! The node map: taking nodes out while they change and putting them back,
//! LRU ticks and memory accounting.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

impl Tree {
    pub(super) fn take(&mut self, num: u64) -> Node {
        let node = match self.cache.remove(&num) {
            Some(node) => node,
            None => panic!("tree invariant: node {num} must be cached here"),
        };
        self.cache_bytes -= node.mem_bytes();
        self.dirty_bytes -= dirty_estimate(&node);
        self.before_change(num, &node);
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
