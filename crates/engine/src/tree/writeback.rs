//! Write-back: writing dirty nodes (eviction and checkpoints), the
//! checkpoint itself, and space accounting.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

impl Tree {
    /// Encodes a dirty node and finds it a fresh extent (copy-on-write);
    /// nothing changes yet but the allocation.
    fn encode_for_write(&mut self, num: u64) -> EngineResult<(Extent, NodeImage)> {
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
        Ok((extent, img))
    }

    /// Records node `num` as living at `extent` (its previous copy freed)
    /// and clean; returns the image's bytes, for whoever writes them.
    fn mark_written(&mut self, num: u64, extent: Extent, img: NodeImage) -> AlignedBuf {
        if let Some(old) = self.btt.set(num, extent, img.crc) {
            self.alloc.free(old);
        }
        let mut node = self.take(num);
        add(
            &self.stats.node_bytes_written[level(node.height())],
            img.buf.len() as u64,
        );
        add(&self.stats.nodes_written, 1);
        node.dirty = false;
        if let NodeBody::Leaf(leaf) = &mut node.body {
            for (b, loc) in leaf.basements.iter_mut().zip(img.basement_locs) {
                b.loc = Some(loc);
            }
        }
        self.put(num, node);
        img.buf
    }

    /// Writes a dirty node to a fresh extent (copy-on-write).
    pub(super) fn write_node(&mut self, num: u64) -> EngineResult<()> {
        let (extent, img) = self.encode_for_write(num)?;
        if let Err(e) = self
            .device
            .write_at(&img.buf, self.layout.extent_offset(extent))
        {
            self.alloc.free(extent);
            return Err(betreefs_store::StoreError::io("writing node", e).into());
        }
        self.mark_written(num, extent, img);
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
            .filter(|(num, n)| {
                (write_dirty || !n.dirty) && (n.dirty || !self.unwritten.contains(num))
            })
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

    /// The first half of a checkpoint, under the tree lock: every dirty
    /// node is encoded and given a fresh extent, the block table naming
    /// them is encoded, and the superblock is prepared; the nodes count as
    /// clean from here on. Nothing is written: [`CheckpointWrites::write`]
    /// does that without the lock while requests go on, and
    /// [`Tree::finish_checkpoint`] (or [`Tree::abort_checkpoint`]) ends it.
    /// `log_head` is where replay must start for what comes after; `clean`
    /// marks the final checkpoint of a close (no record follows).
    ///
    /// What keeps the snapshot whole while writers change the tree
    /// (docs/design.md, "Checkpoints that do not stop the world"): the
    /// images are bytes, so later changes cannot reach them; the blocks
    /// they go to are held by the allocator's pending generation even if
    /// their nodes are written elsewhere or freed meanwhile; and eviction
    /// keeps the nodes whose new extents are not yet written (`unwritten`),
    /// so no one reads them back from the device too early.
    pub fn begin_checkpoint(
        &mut self,
        log_head: u64,
        log_epoch: u32,
        clean: bool,
    ) -> EngineResult<CheckpointWrites> {
        if self.read_only {
            return Err(EngineError::ReadOnly);
        }
        assert!(
            !self.checkpoint_in_flight(),
            "tree invariant: one checkpoint at a time"
        );
        let mut dirty: Vec<(u32, u64)> = self
            .cache
            .iter()
            .filter(|(_, n)| n.dirty)
            .map(|(num, n)| (n.height(), *num))
            .collect();
        dirty.sort_unstable();
        let mut nodes = Vec::with_capacity(dirty.len());
        for (_, num) in dirty {
            match self.encode_for_write(num) {
                Ok((extent, img)) => {
                    let offset = self.layout.extent_offset(extent);
                    nodes.push((offset, self.mark_written(num, extent, img)));
                    self.unwritten.insert(num);
                }
                Err(e) => return Err(self.write_prepared_nodes(&nodes, e)),
            }
        }
        let table = self.btt.encode();
        let Some(extent) = self.alloc.allocate(table.len() as u32) else {
            tracing::warn!(
                "no {} byte extent for the block table; {} of {} blocks in use",
                table.len(),
                self.alloc.used_blocks(),
                self.layout.nodes_bytes / BLOCK_SIZE as u64
            );
            return Err(self.write_prepared_nodes(&nodes, EngineError::NoSpace));
        };
        let table_buf = AlignedBuf::from_slice(&table);
        // The newest durable checkpoint still holds the old table's
        // blocks; freed now, they stay held for two more checkpoints.
        if let Some(old) = self.btt_extent.replace(extent) {
            self.alloc.free(old);
        }
        self.alloc.begin_checkpoint();
        let superblock = Superblock {
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
        Ok(CheckpointWrites {
            nodes,
            table: (self.layout.extent_offset(extent), table_buf),
            superblock,
        })
    }

    /// A checkpoint could not be prepared (no space for a node or the
    /// table): the nodes already given extents are clean now, so their
    /// images are written at once (the tree stays as it was, only partly
    /// written back). Returns the error to report.
    fn write_prepared_nodes(&mut self, nodes: &[(u64, AlignedBuf)], e: EngineError) -> EngineError {
        for (offset, buf) in nodes {
            if let Err(io) = self.device.write_at(buf, *offset) {
                self.redirty_unwritten();
                return betreefs_store::StoreError::io("writing node", io).into();
            }
        }
        self.unwritten.clear();
        e
    }

    /// Whether a checkpoint has begun and not ended.
    pub fn checkpoint_in_flight(&self) -> bool {
        self.alloc.checkpoint_in_flight()
    }

    /// The second half of a checkpoint, under the tree lock again: its
    /// superblock (generation `generation`) is durable.
    pub fn finish_checkpoint(&mut self, generation: u64) {
        self.generation = generation;
        self.alloc.commit_pending_checkpoint();
        self.unwritten.clear();
        let node_blocks = (self.opts.node_size / BLOCK_SIZE) as u64;
        self.node_sized_free_blocks = self.alloc.free_blocks_in_runs(node_blocks);
        self.used_blocks_at_checkpoint = self.alloc.used_blocks();
        add(&self.stats.checkpoints, 1);
    }

    /// A checkpoint whose writes failed: the nodes it meant to write are
    /// dirty again (their contents are still in memory), and its blocks
    /// stay held, since part of it may have reached the device.
    pub fn abort_checkpoint(&mut self) {
        self.redirty_unwritten();
        self.alloc.abort_pending_checkpoint();
    }

    fn redirty_unwritten(&mut self) {
        for num in std::mem::take(&mut self.unwritten) {
            if self.cache.get(&num).is_some_and(|n| !n.dirty) {
                let mut node = self.take(num);
                node.dirty = true;
                self.put(num, node);
            }
        }
    }

    /// A whole checkpoint with the lock held throughout (close, and the
    /// paths that need one before they can go on: a full log, reclaiming
    /// space).
    pub fn write_checkpoint(
        &mut self,
        log_head: u64,
        log_epoch: u32,
        clean: bool,
        before_superblock: impl FnOnce() -> EngineResult<()>,
    ) -> EngineResult<()> {
        let writes = self.begin_checkpoint(log_head, log_epoch, clean)?;
        match writes.write(self.device.as_ref(), &self.stats, before_superblock) {
            Ok(()) => {
                self.finish_checkpoint(writes.generation());
                Ok(())
            }
            Err(e) => {
                self.abort_checkpoint();
                Err(e)
            }
        }
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

/// What a checkpoint writes, encoded by [`Tree::begin_checkpoint`]: dirty
/// nodes with their offsets (in allocation order, so mostly sequential),
/// the block table, and the superblock naming them.
pub(crate) struct CheckpointWrites {
    nodes: Vec<(u64, AlignedBuf)>,
    table: (u64, AlignedBuf),
    superblock: Superblock,
}

impl CheckpointWrites {
    /// The superblock's generation (for [`Tree::finish_checkpoint`]).
    pub fn generation(&self) -> u64 {
        self.superblock.generation
    }

    /// Writes the nodes and the table, syncs, runs `before_superblock`
    /// (the store makes the log durable up to the checkpoint's head there),
    /// then writes the superblock and syncs: the superblock reaches the
    /// device only after everything it names. Needs no tree lock.
    pub fn write(
        &self,
        device: &dyn Device,
        stats: &Stats,
        before_superblock: impl FnOnce() -> EngineResult<()>,
    ) -> EngineResult<()> {
        let io = |context| move |e| EngineError::from(betreefs_store::StoreError::io(context, e));
        for (offset, buf) in &self.nodes {
            device.write_at(buf, *offset).map_err(io("writing node"))?;
        }
        let (offset, table) = &self.table;
        device
            .write_at(table, *offset)
            .map_err(io("writing block table"))?;
        add(&stats.block_table_bytes_written, table.len() as u64);
        device.sync().map_err(io("syncing nodes"))?;
        before_superblock()?;
        self.superblock.write(device)?;
        add(&stats.superblock_bytes_written, BLOCK_SIZE as u64);
        Ok(())
    }
}
