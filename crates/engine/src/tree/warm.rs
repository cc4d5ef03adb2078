//! Warming the trees' upper levels when a store opens (docs/design.md,
//! "Warm upper levels"): the nodes every cold query passes through are
//! read once, at open, instead of by the first queries after it.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

impl Tree {
    /// Reads the nodes nearest the roots into the cache, level by level
    /// from the roots down, both key spaces together, until `budget`
    /// bytes have been read: interior nodes whole while the budget has
    /// room for all of their extent (their buffers then answer every
    /// query passing through), else their header and meta alone (pivots
    /// and the places of their segments); leaves their header and meta
    /// alone (pivots and the places of their basements), so a cold point
    /// query reads only its basement's chunk directory and chunk. The
    /// nodes are clean and leave the cache as any other; what was read is
    /// counted in the stats (`nodes_warmed`, `warm_bytes_read`). Stops at
    /// the first error, which it returns: the node that failed is not
    /// cached, and the query that needs it reads it again and reports.
    /// It also stops at `until` (on a slow device the budget's reads,
    /// some of them a block each, one after another, could hold the open
    /// for seconds) and once the cache is at its budget for clean nodes.
    pub(crate) fn warm_upper_levels(
        &mut self,
        budget: u64,
        until: std::time::Instant,
    ) -> EngineResult<()> {
        let warmed = self.warm_levels(budget, until);
        // The last node read may have taken the cache past its budget
        // (its size in memory is known only once it is read): clean
        // nodes make room again, the least recently used first.
        self.evict_clean_if_needed();
        warmed
    }

    fn warm_levels(&mut self, budget: u64, until: std::time::Instant) -> EngineResult<()> {
        let mut level: Vec<(KeySpace, u64, Bounds, Option<u32>)> = KeySpace::ALL
            .into_iter()
            .map(|ks| (ks, self.roots[ks.index()], Bounds::full(), None))
            .collect();
        // A node is visited once: shared subtrees (range clones) are
        // reached through several parents, and a forged image may name a
        // node below itself.
        let mut visited = HashSet::new();
        let start = self.node_bytes_read();
        while !level.is_empty() {
            let mut below = Vec::new();
            for (ks, num, bounds, height) in level {
                let read = self.node_bytes_read() - start;
                // A long log replay may have filled the cache already:
                // warming never takes it past its budget.
                let full = self.cache_excess(0, DirtyBudget::Clean) > 0;
                if full || read >= budget || std::time::Instant::now() >= until {
                    return Ok(());
                }
                if !visited.insert(num) {
                    continue;
                }
                if !self.cache.contains_key(&num) {
                    let whole_fits = match self.btt.get(num) {
                        Slot::OnDisk { extent, .. } => u64::from(extent.len) <= budget - read,
                        _ => false,
                    };
                    // A root's height is known only once it is read: one
                    // that fits is read whole, leaf or not.
                    let interior = height.is_none_or(|h| h > 0);
                    let want = (whole_fits && interior).then_some(Want::Whole);
                    let loaded = self.read_uncached(ks, num, &bounds, want, height);
                    add(
                        &self.stats.warm_bytes_read,
                        self.node_bytes_read() - start - read,
                    );
                    loaded?;
                    add(&self.stats.nodes_warmed, 1);
                }
                let Some(node) = self.cache.get(&num) else {
                    continue;
                };
                // A node cached before (by replay) at another height than
                // its parent gives is left to the query that reaches it,
                // which reports it; the warming goes no deeper there.
                if height.is_some_and(|h| h != node.height()) {
                    continue;
                }
                if let NodeBody::Interior(int) = &node.body {
                    let Some(child_height) = int.height.checked_sub(1) else {
                        continue;
                    };
                    below.extend(int.children.iter().enumerate().map(|(i, &child)| {
                        (ks, child, int.child_bounds(i, &bounds), Some(child_height))
                    }));
                }
            }
            level = below;
        }
        Ok(())
    }

    /// Node bytes read from the device so far, at every level.
    fn node_bytes_read(&self) -> u64 {
        self.stats
            .node_bytes_read
            .iter()
            .map(|b| b.load(AtomicOrdering::Relaxed))
            .sum()
    }
}
