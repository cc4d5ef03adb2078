//! Write-back: writing dirty nodes (eviction and checkpoints), the
//! checkpoint itself, and space accounting.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

impl Tree {
    /// Writes a dirty node to a fresh extent (copy-on-write).
    pub(super) fn write_node(&mut self, num: u64) -> EngineResult<()> {
        if self.read_only {
            return Err(EngineError::ReadOnly);
        }
        let node = self.node(num);
        debug_assert!(node.dirty);
        if let NodeBody::Leaf(leaf) = &node.body {
            assert!(
                leaf.is_fully_loaded(),
                "tree invariant: dirty leaf {num} must be fully loaded"
            );
        }
        let height = node.height();
        let img = encode_node(node, num);
        let Some(extent) = self.alloc.allocate(img.len) else {
            tracing::warn!(
                "no {} byte extent for node {num} (height {height}); {} of {} blocks in use",
                img.len,
                self.alloc.used_blocks(),
                self.layout.nodes_bytes / BLOCK_SIZE as u64
            );
            return Err(EngineError::NoSpace);
        };
        if let Err(e) = self
            .device
            .write_at(&img.buf, self.layout.extent_offset(extent))
        {
            self.alloc.free(extent);
            return Err(betreefs_store::StoreError::io("writing node", e).into());
        }
        if let Some(old) = self.btt.set(num, extent, img.crc) {
            self.alloc.free(old);
        }
        add(
            &self.stats.node_bytes_written[level(height)],
            img.buf.len() as u64,
        );
        add(&self.stats.nodes_written, 1);
        let mut node = self.take(num);
        node.dirty = false;
        if let NodeBody::Leaf(leaf) = &mut node.body {
            for (b, loc) in leaf.basements.iter_mut().zip(img.basement_locs) {
                b.loc = Some(loc);
            }
        }
        self.put(num, node);
        Ok(())
    }

    /// Drops nodes until the cache is under 90% of its budget: clean ones
    /// first in least-recently-used order (dropping them costs a later
    /// re-read at most), then dirty ones, which must be written back (a
    /// write now, and another when they are dirtied again). Interior nodes
    /// stay longer than leaves of the same age: every query and flush passes
    /// through them. Roots stay.
    pub fn evict_if_needed(&mut self) -> EngineResult<()> {
        self.evict(!self.read_only)
    }

    /// What a read does after loading nodes: drops clean nodes only (leaves
    /// before interior nodes, least recently used first), so it never
    /// writes and cannot fail. Without it a read-only workload (a cold read
    /// of a big file) grew the cache without bound: only writes evicted.
    pub fn evict_clean_if_needed(&mut self) {
        // Cannot fail: nothing is written when dirty nodes are skipped.
        let _ = self.evict(false);
    }

    pub(super) fn evict(&mut self, write_dirty: bool) -> EngineResult<()> {
        if self.cache_bytes <= self.opts.cache_bytes {
            return Ok(());
        }
        let target = self.opts.cache_bytes / 10 * 9;
        let mut order: Vec<(bool, bool, u64, u64)> = self
            .cache
            .iter()
            .filter(|(_, n)| write_dirty || !n.dirty)
            .map(|(num, n)| (n.dirty, n.height() > 0, n.last_used, *num))
            .collect();
        order.sort_unstable();
        for (dirty, _, _, num) in order {
            if self.cache_bytes <= target {
                break;
            }
            if self.roots.contains(&num) {
                continue;
            }
            if dirty {
                self.write_node(num)?;
            }
            drop(self.take(num));
            add(&self.stats.evictions, 1);
        }
        Ok(())
    }

    /// Writes every dirty node, the block table and a new superblock naming
    /// them; `log_head` is where replay must start for what comes after.
    /// `clean` marks the final checkpoint of a close (no record follows).
    pub fn write_checkpoint(
        &mut self,
        log_head: u64,
        log_epoch: u32,
        clean: bool,
    ) -> EngineResult<()> {
        if self.read_only {
            return Err(EngineError::ReadOnly);
        }
        let mut dirty: Vec<(u32, u64)> = self
            .cache
            .iter()
            .filter(|(_, n)| n.dirty)
            .map(|(num, n)| (n.height(), *num))
            .collect();
        dirty.sort_unstable();
        for (_, num) in dirty {
            self.write_node(num)?;
        }
        let table = self.btt.encode();
        let Some(extent) = self.alloc.allocate(table.len() as u32) else {
            tracing::warn!(
                "no {} byte extent for the block table; {} of {} blocks in use",
                table.len(),
                self.alloc.used_blocks(),
                self.layout.nodes_bytes / BLOCK_SIZE as u64
            );
            return Err(EngineError::NoSpace);
        };
        let buf = AlignedBuf::from_slice(&table);
        let io = |context| move |e| EngineError::from(betreefs_store::StoreError::io(context, e));
        let written = self
            .device
            .write_at(&buf, self.layout.extent_offset(extent))
            .map_err(io("writing block table"))
            .and_then(|()| self.device.sync().map_err(io("syncing nodes")));
        if let Err(e) = written {
            self.alloc.free(extent);
            return Err(e);
        }
        add(&self.stats.block_table_bytes_written, buf.len() as u64);
        let sb = Superblock {
            generation: self.generation + 1,
            layout: self.layout,
            checkpoint_seq: self.next_seq - 1,
            log_head,
            log_epoch,
            btt: extent,
            btt_crc: crc32c_of(&[&table]),
            roots: self.roots.to_vec(),
            clean,
        };
        sb.write(self.device.as_ref())?;
        add(&self.stats.superblock_bytes_written, BLOCK_SIZE as u64);
        self.generation = sb.generation;
        if let Some(old) = self.btt_extent.replace(extent) {
            self.alloc.free(old);
        }
        self.alloc.commit_checkpoint();
        let node_blocks = (self.opts.node_size / BLOCK_SIZE) as u64;
        self.node_sized_free_blocks = self.alloc.free_blocks_in_runs(node_blocks);
        self.used_blocks_at_checkpoint = self.alloc.used_blocks();
        add(&self.stats.checkpoints, 1);
        Ok(())
    }

    /// Whether writes that add data should be refused: the node region
    /// could not absorb the dirty nodes plus a reserve for copy-on-write.
    ///
    /// Nodes are written as contiguous extents, so free space counts only
    /// where it comes in node-sized runs: on a nearly full, fragmented
    /// device the dirty nodes (and the nodes a checkpoint after deletes
    /// rewrites) must still find room, or no checkpoint could ever run.
    ///
    /// `promised` is the space held for writes already allowed (see
    /// [`crate::Reservation`]): it counts as used, and it must be there in
    /// node-sized runs as the dirty nodes must. A write that draws on
    /// its own promise (`drawing`) may use half of the copy-on-write
    /// reserve as well: the promise was checked against the full reserve
    /// when it was made, so the space is there, and what the write costs
    /// beyond its own bytes (dirty copies of nodes) is what the reserve is
    /// for.
    pub fn space_low(&self, promised: u64, drawing: bool) -> bool {
        let capacity = self.layout.nodes_bytes;
        let node = self.opts.node_size as u64;
        let reserve = if drawing {
            (capacity / 16).max(4 * node)
        } else {
            (capacity / 8).max(8 * node)
        };
        let used = promised
            + self.alloc.used_blocks() * BLOCK_SIZE as u64
            + self.dirty_bytes as u64
            + (self.btt.live_count() as u64 * 16).next_multiple_of(BLOCK_SIZE as u64);
        let consumed = self
            .alloc
            .used_blocks()
            .saturating_sub(self.used_blocks_at_checkpoint);
        let runs = self
            .node_sized_free_blocks
            .saturating_sub(consumed)
            .saturating_mul(BLOCK_SIZE as u64);
        used + reserve > capacity || promised + self.dirty_bytes as u64 + 4 * node > runs
    }
}
