//! Write-back: writing dirty nodes (eviction and checkpoints), the
//! checkpoint itself, and space accounting.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use std::sync::atomic::Ordering;

use super::*;

/// What an eviction does with the dirty nodes it would drop.
#[derive(Clone, Copy, PartialEq, Eq)]
enum DirtyNodes {
    /// Leaves them (a read's eviction, or a read-only tree).
    Keep,
    /// Writes them back under the lock, then drops them.
    WriteAll,
    /// Stops at the first and hands it out ([`Tree::evict_step`]).
    HandOut,
}

/// The budget past which an eviction writes dirty nodes back.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DirtyBudget {
    /// The node cache's own: clean nodes make room for the memory beside
    /// the cache, dirty ones stay (they would put device writes in front
    /// of the requests that wait for the room).
    Cache,
    /// The clean nodes' budget (the cache's less what the allocator, the
    /// log's buffer and a checkpoint hold): for a process near its memory
    /// limit with a cache nearly all dirty, where clean nodes alone
    /// cannot make the room ([`crate::Store::set_memory_short`]).
    Clean,
}

/// A dirty node's image on its way to the device — with the tree lock let
/// go, from [`Tree::evict_step`] — which becomes the node's copy only if
/// nothing changed the node meanwhile ([`Tree::end_write_back`]).
pub struct WriteBack {
    num: u64,
    /// Its entry in `Tree::writing_back` while the image shows the node.
    token: u64,
    extent: Extent,
    /// Byte offset of `extent` on the device.
    offset: u64,
    img: NodeImage,
}

/// A dirty node's copy for a write-back, to be encoded without the tree
/// lock ([`Tree::evict_step`]), as the checkpoint's copies are.
pub struct WriteBackCopy {
    token: u64,
    snapshot: NodeSnapshot,
}

impl WriteBackCopy {
    /// The copy's image (no lock needed), for [`Tree::place_write_back`].
    pub fn encode(self) -> EncodedWriteBack {
        EncodedWriteBack {
            num: self.snapshot.num,
            token: self.token,
            img: self.snapshot.encode(),
        }
    }
}

/// A write-back's image, not yet given an extent.
pub struct EncodedWriteBack {
    num: u64,
    token: u64,
    img: NodeImage,
}

impl WriteBack {
    /// Writes the image to its extent (no lock needed: the extent is the
    /// write-back's alone until it is finished).
    pub fn write(&self, device: &dyn Device) -> std::io::Result<()> {
        device.write_at(&self.img.buf, self.offset)
    }

    /// The image, for a writer of its own (in pieces).
    pub fn image(&self) -> &[u8] {
        &self.img.buf
    }

    /// Where [`WriteBack::image`] goes on the device.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl Tree {
    /// Records node `num` as living at `extent` (its previous copy freed)
    /// and clean, its basements where the image put them.
    fn mark_written(&mut self, num: u64, extent: Extent, crc: u32, locs: Vec<PlacedBasement>) {
        if let Some(old) = self.btt.set(num, extent, crc) {
            self.alloc.free(old);
        }
        let mut node = self.take(num);
        node.dirty = false;
        if let NodeBody::Leaf(leaf) = &mut node.body {
            for (b, (loc, dir)) in leaf.basements.iter_mut().zip(locs) {
                b.loc = Some(loc);
                b.dir = dir;
            }
        }
        self.put(num, node);
    }

    /// An extent of `len` bytes from the allocator, the request noted
    /// (found or not) for the count of free runs long enough for it
    /// ([`Tree::image_sized_run_bytes`]).
    fn allocate_extent(&mut self, len: u32) -> Option<Extent> {
        let blocks = (len as u64).div_ceil(BLOCK_SIZE as u64);
        self.largest_extent_asked = self.largest_extent_asked.max(blocks);
        let extent = self.alloc.allocate(len);
        if let Some(extent) = &extent {
            self.blocks_allocated_since_count += extent.blocks();
        }
        // Each extent may cut a counted run short of an image (the count
        // takes off only its own blocks): counted again once a quarter of
        // what was counted is taken, which on a nearly full device is
        // often, and on an empty one seldom.
        let taken = self.blocks_allocated_since_count;
        if taken >= (self.image_sized_free_blocks / 4).max(self.image_blocks_max()) {
            self.count_image_sized_runs();
        }
        extent
    }

    /// Counts the free blocks in runs long enough for the largest image
    /// ([`Tree::image_sized_run_bytes`]).
    pub(super) fn count_image_sized_runs(&mut self) {
        self.image_sized_free_blocks = self.alloc.free_blocks_in_runs(self.image_blocks_max());
        self.blocks_allocated_since_count = 0;
    }

    /// The blocks an image may take, as far as the store knows: a full
    /// leaf's, or the largest extent asked for since it opened (a root
    /// holding more than a node between two steps, a large block table, a
    /// single entry larger than a node), whichever is more.
    ///
    /// A full leaf holds a node's bytes and a basement (a split cuts
    /// between basements), in no more than twice as many basements as
    /// those bytes fill and one (neighbours that fit in one are joined,
    /// [`crate::node::basement_join_bytes`]), each beginning on a block;
    /// its header and meta take a block or two.
    pub(super) fn image_blocks_max(&self) -> u64 {
        let join = crate::node::basement_join_bytes(self.opts.basement_size);
        let bytes = self.opts.node_size + join;
        let basements = 2 * bytes.div_ceil(join) + 1;
        let full_leaf = bytes.div_ceil(BLOCK_SIZE) + basements + 2;
        (full_leaf as u64).max(self.largest_extent_asked)
    }

    /// Logs that no extent of `len` bytes was found for `what`.
    fn no_extent(&self, what: &str, len: u32) -> EngineError {
        tracing::warn!(
            "no {len} byte extent for {what}; {} of {} blocks in use",
            self.alloc.used_blocks(),
            self.layout.nodes_bytes / BLOCK_SIZE as u64
        );
        EngineError::NoSpace
    }

    fn count_node_written(&self, height: u32, bytes: usize) {
        add(&self.stats.node_bytes_written[level(height)], bytes as u64);
        add(&self.stats.nodes_written, 1);
    }

    /// Writes a dirty node to a fresh extent (copy-on-write), under the
    /// lock: a write-back that nothing can overtake.
    pub(super) fn write_node(&mut self, num: u64) -> EngineResult<()> {
        let wb = self.begin_write_back(num)?;
        let written = wb.write(self.device.as_ref());
        let taken = self.end_write_back(wb, written)?;
        debug_assert!(taken, "node {num} changed while the lock was held");
        Ok(())
    }

    /// Encodes dirty node `num` and gives the image a fresh extent
    /// (copy-on-write; nothing changes yet but the allocation), for
    /// [`WriteBack::write`] and then [`Tree::end_write_back`].
    fn begin_write_back(&mut self, num: u64) -> EngineResult<WriteBack> {
        let token = self.start_write_back(num)?;
        let img = encode_image(self.node(num), num);
        match self.place_write_back(EncodedWriteBack { num, token, img })? {
            Some(wb) => Ok(wb),
            None => unreachable!("node {num} changed while the lock was held"),
        }
    }

    /// Dirty node `num` picked to be written back, copied (a pointer per
    /// child buffer or basement) so that its image can be encoded without
    /// the tree lock ([`WriteBackCopy::encode`]).
    fn copy_for_write_back(&mut self, num: u64) -> EngineResult<WriteBackCopy> {
        let token = self.start_write_back(num)?;
        let snapshot = NodeSnapshot::of(num, self.node(num));
        Ok(WriteBackCopy { token, snapshot })
    }

    /// Enters dirty node `num` in `writing_back` under a new token, which
    /// a change of the node takes away ([`Tree::take`]).
    fn start_write_back(&mut self, num: u64) -> EngineResult<u64> {
        if self.read_only {
            return Err(EngineError::ReadOnly);
        }
        debug_assert!(self.node(num).dirty);
        self.write_back_tokens += 1;
        let token = self.write_back_tokens;
        self.writing_back.insert(num, token);
        Ok(token)
    }

    /// Gives an encoded write-back's image a fresh extent, if the node is
    /// as it was copied (its token still current); None if it changed
    /// meanwhile: the image is dropped, and the node stays dirty.
    pub fn place_write_back(&mut self, enc: EncodedWriteBack) -> EngineResult<Option<WriteBack>> {
        let EncodedWriteBack { num, token, img } = enc;
        if self.writing_back.get(&num) != Some(&token) {
            add(&self.stats.write_backs_dropped, 1);
            return Ok(None);
        }
        let Some(extent) = self.allocate_extent(img.len) else {
            self.writing_back.remove(&num);
            let height = self.node(num).height();
            return Err(self.no_extent(&format!("node {num} (height {height})"), img.len));
        };
        Ok(Some(WriteBack {
            num,
            token,
            offset: self.layout.extent_offset(extent),
            extent,
            img,
        }))
    }

    /// A write-back is back from the device, with `written` its outcome.
    /// If nothing took the node out to change it meanwhile, the image is
    /// its copy now: the node is clean at the new extent (true).
    /// Otherwise the image shows the node as it was, so it is dropped
    /// (its extent freed; nothing names it) and the node stays as the
    /// change left it (false).
    fn end_write_back(
        &mut self,
        wb: WriteBack,
        written: std::io::Result<()>,
    ) -> EngineResult<bool> {
        let current = self.writing_back.get(&wb.num) == Some(&wb.token);
        if current {
            self.writing_back.remove(&wb.num);
        }
        if let Err(e) = written {
            self.alloc.free(wb.extent);
            return Err(betreefs_store::StoreError::io("writing node", e).into());
        }
        if !current {
            self.alloc.free(wb.extent);
            add(&self.stats.write_backs_dropped, 1);
            return Ok(false);
        }
        debug_assert!(self.node(wb.num).dirty);
        self.count_node_written(self.node(wb.num).height(), wb.img.buf.len());
        self.take_for_checkpoint(&wb);
        self.mark_written(wb.num, wb.extent, wb.img.crc, wb.img.basement_locs);
        Ok(true)
    }

    /// A write-back of a node the checkpoint in flight still waits to
    /// image is the image it needs: the node is as the write-back copied
    /// it (its token is current) and as the checkpoint began (a change
    /// takes it out of `pending`). The checkpoint names the write-back's
    /// extent instead of writing the node again. In a sequential write
    /// the write-back thread wrote a third of the leaves a checkpoint
    /// was about to write, and each went to the device twice
    /// (docs/benchmarks/checkpoint-takes-write-backs.md).
    fn take_for_checkpoint(&mut self, wb: &WriteBack) {
        let Some(cp) = &mut self.checkpoint else {
            return;
        };
        if !cp.pending.remove(&wb.num) {
            return;
        }
        cp.from_write_backs.push((wb.num, wb.extent, wb.img.crc));
        self.alloc.hold_for_checkpoint(wb.extent);
        if let Slot::OnDisk { extent: old, .. } = self.btt.get(wb.num) {
            // Named by neither the checkpoint nor, once the write-back is
            // taken in, the live tree.
            self.alloc.release_from_checkpoint(old);
        }
        add(&self.stats.checkpoint_nodes_from_write_backs, 1);
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

    /// The node cache's budget: what the options give, less what the
    /// store's user holds beside it (`Store::memory_beside_cache`), and
    /// never under four nodes.
    pub fn cache_budget(&self) -> usize {
        let beside = self.stats.memory_beside_cache.load(Ordering::Relaxed) as usize;
        self.opts
            .cache_bytes
            .saturating_sub(beside)
            .max(4 * self.opts.node_size)
    }

    /// Bytes the node cache holds past `budget` less `headroom` (0
    /// within it).
    pub fn cache_excess(&self, headroom: usize, budget: DirtyBudget) -> usize {
        self.cache_bytes
            .saturating_sub(self.dirty_budget_bytes(budget).saturating_sub(headroom))
    }

    /// The bytes past which dirty nodes are written back.
    fn dirty_budget_bytes(&self, budget: DirtyBudget) -> usize {
        match budget {
            DirtyBudget::Cache => self.cache_budget(),
            DirtyBudget::Clean => self.cache_budget().min(self.clean_budget()),
        }
    }

    /// The budget for clean nodes: the cache's, less what a checkpoint in
    /// flight holds in images, what the allocator holds beyond the bytes
    /// allocated (`Store::allocator_overhead`) and what the log's buffer
    /// holds (up to twice its eager flush bound: tens of megabytes in a
    /// sequential write), never under four nodes. Clean nodes make room
    /// for all three; dirty ones are not written back for them — see
    /// [`Tree::evict`] (written back for the log's buffer, they would put
    /// device writes, and on a full device refusals, in front of writes
    /// that only wait for the next log flush to shrink it).
    pub fn clean_budget(&self) -> usize {
        let allocator = self.stats.allocator_overhead.load(Ordering::Relaxed) as usize;
        let log = self.stats.log_buffered.load(Ordering::Relaxed) as usize;
        self.cache_budget()
            .saturating_sub(self.checkpoint_held_image_bytes())
            .saturating_sub(allocator)
            .saturating_sub(log)
            .max(4 * self.opts.node_size)
    }

    /// Bytes of checkpoint images made by requests and not yet written
    /// (see [`CheckpointInProgress`]): the cache makes room for them.
    pub fn checkpoint_held_image_bytes(&self) -> usize {
        self.checkpoint.as_ref().map_or(0, |cp| {
            let images: usize = cp.images.iter().map(|(_, _, img)| img.buf.len()).sum();
            images
                + cp.snapshots
                    .iter()
                    .map(NodeSnapshot::held_bytes)
                    .sum::<usize>()
        })
    }

    /// Drops nodes, least recently used first, clean leaves before clean
    /// interior nodes before dirty ones (written back first, when
    /// `write_dirty`), once the cache is over its budget: down to 90% of it.
    /// Images a checkpoint in flight holds and the allocator's overhead
    /// count against the budget for clean nodes only
    /// ([`Tree::clean_budget`]). A checkpoint that yields to syncs lasts
    /// longer, and requests meanwhile image every pending node they
    /// change: evicting a pending dirty node images it too, so writing
    /// dirty nodes back for the images' sake would drain the cache into
    /// images. And the allocator's overhead is mostly freed pages that
    /// decay within a quarter second: written back for them, dirty nodes
    /// put device writes in front of every fsync (copy_file_range of
    /// small files + fsync went from 0.2-0.8 to 1.3-3 ms in an A/B,
    /// docs/benchmarks/shared-reads.md).
    pub(super) fn evict(&mut self, write_dirty: bool) -> EngineResult<()> {
        let dirty = if write_dirty {
            DirtyNodes::WriteAll
        } else {
            DirtyNodes::Keep
        };
        self.evict_within(dirty, false, 0, DirtyBudget::Cache)
            .map(|_| ())
    }

    /// One step of a writer's eviction: [`Tree::evict`] as far as dropping
    /// clean nodes takes it, then, if a dirty node must go too, a copy of
    /// it, for the caller to encode with the lock let go, give an extent
    /// ([`Tree::place_write_back`]), write with the lock let go and hand
    /// back to [`Tree::finish_write_back`] (each write-back is a device
    /// write of up to a node, and an eviction may need several: under the
    /// lock they held up every request for as long; encoding a 4 MiB leaf
    /// took up to 14 ms under load). `None`: the cache is within its
    /// budget. A step `continuing`
    /// an eviction writes back down to the target the first step aimed
    /// at, as one eviction would, though the cache is under budget by
    /// then.
    ///
    /// `headroom`: the step works as if the budget were that much
    /// smaller (the write-back thread starts before writers would);
    /// `dirty_budget`: the budget past which dirty nodes are written back.
    pub fn evict_step(
        &mut self,
        continuing: bool,
        headroom: usize,
        dirty_budget: DirtyBudget,
    ) -> EngineResult<Option<WriteBackCopy>> {
        let victim = self.evict_within(
            if self.read_only {
                DirtyNodes::Keep
            } else {
                DirtyNodes::HandOut
            },
            continuing,
            headroom,
            dirty_budget,
        )?;
        victim.map(|num| self.copy_for_write_back(num)).transpose()
    }

    /// A write-back of [`Tree::evict_step`] is back from the device, with
    /// `written` its outcome ([`Tree::end_write_back`]): taken for the
    /// node's copy, the node leaves the cache (unless it became a root);
    /// dropped, the next step picks the node again if the cache still
    /// needs the room.
    pub fn finish_write_back(
        &mut self,
        wb: WriteBack,
        written: std::io::Result<()>,
    ) -> EngineResult<()> {
        let num = wb.num;
        if self.end_write_back(wb, written)? && !self.roots.contains(&num) {
            drop(self.take(num));
            add(&self.stats.evictions, 1);
        }
        Ok(())
    }

    /// [`Tree::evict`], dirty nodes written back (`WriteAll`), kept, or
    /// the first one due handed out to be written back (`HandOut`: it
    /// stays cached and dirty, and the eviction stops there).
    fn evict_within(
        &mut self,
        dirty: DirtyNodes,
        continuing: bool,
        headroom: usize,
        dirty_budget: DirtyBudget,
    ) -> EngineResult<Option<u64>> {
        let clean_budget = self.clean_budget();
        let budget = self
            .dirty_budget_bytes(dirty_budget)
            .saturating_sub(headroom);
        let (clean_target, dirty_target) = (clean_budget / 10 * 9, budget / 10 * 9);
        let over = if continuing { dirty_target } else { budget };
        if self.cache_bytes <= clean_budget.min(over) {
            return Ok(None);
        }
        let write_dirty = dirty != DirtyNodes::Keep && self.cache_bytes > over;
        let mut order: Vec<(bool, bool, u64, u64)> = self
            .cache
            .iter()
            .filter(|(num, n)| {
                let may_go = if n.dirty {
                    write_dirty && !self.imaged_for_checkpoint(**num)
                } else {
                    !self.unwritten.contains(num)
                };
                may_go && !self.writing_back.contains_key(num)
            })
            .map(|(num, n)| (n.dirty, n.height() > 0, n.last_used.get(), *num))
            .collect();
        order.sort_unstable();
        for (is_dirty, _, _, num) in order {
            let target = if is_dirty { dirty_target } else { clean_target };
            if self.cache_bytes <= target {
                // Clean nodes come first: past them, only dirty ones.
                if is_dirty {
                    break;
                }
                continue;
            }
            if self.roots.contains(&num) {
                continue;
            }
            if is_dirty {
                if dirty == DirtyNodes::HandOut {
                    return Ok(Some(num));
                }
                self.write_node(num)?;
            }
            drop(self.take(num));
            add(&self.stats.evictions, 1);
        }
        Ok(None)
    }

    /// Begins a checkpoint of the tree as it is now, under the tree lock:
    /// which nodes are dirty, the roots, the sequence number and the block
    /// table are noted (the table cloned), and the allocator holds every
    /// block in use. Nothing is encoded yet: [`Tree::encode_checkpoint_nodes`]
    /// does that a bounded amount at a time, and a node about to change
    /// before it got there is encoded first ([`Tree::take`]), so every image
    /// shows the node as it was when the checkpoint began (TokuDB's
    /// "pending" nodes, with an encoded image for their clone).
    /// [`Tree::seal_checkpoint`] then gives the images their extents.
    /// `log_head` is where replay must start for what comes after; `clean`
    /// marks the final checkpoint of a close (no record follows).
    /// See docs/design.md, "Checkpoints that do not stop the world".
    pub fn begin_checkpoint(
        &mut self,
        log_head: u64,
        log_epoch: u32,
        clean: bool,
    ) -> EngineResult<()> {
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
        // Popped from the end: leaves first, as they were written before.
        dirty.sort_unstable_by(|a, b| b.cmp(a));
        self.alloc.begin_checkpoint();
        self.checkpoint = Some(CheckpointInProgress {
            pending: dirty.iter().map(|&(_, num)| num).collect(),
            order: dirty.into_iter().map(|(_, num)| num).collect(),
            images: Vec::new(),
            snapshots: Vec::new(),
            placed: Vec::new(),
            unchanged: HashSet::new(),
            from_write_backs: Vec::new(),
            btt: self.btt.clone(),
            superblock: Superblock {
                generation: self.generation + 1,
                layout: self.layout,
                checkpoint_seq: self.next_seq - 1,
                log_head,
                log_epoch,
                btt: Extent { block: 0, len: 0 },
                btt_crc: 0,
                roots: self.roots.to_vec(),
                clean,
            },
        });
        Ok(())
    }

    /// One turn of the checkpoint in flight, all of it under the lock:
    /// encodes nodes until `budget` bytes of images are made (and what
    /// requests copied since the last turn), and gives every image made
    /// so far an extent (held for the checkpoint). Returns whether no node
    /// is left to encode, and the images' bytes, for the caller to write
    /// without the lock (so no more than a turn's images are ever in
    /// memory). If space runs out the checkpoint is cancelled
    /// ([`Tree::cancel_checkpoint`]).
    pub fn encode_checkpoint_nodes(&mut self, budget: usize) -> EngineResult<(bool, NodeWrites)> {
        self.checkpoint_turn_with(budget, SnapshotImages::none(), false)
            .map(|(done, writes, _)| (done, writes))
    }

    /// [`Tree::encode_checkpoint_nodes`] with the encoding of interior
    /// nodes left to the caller, without the lock: the turn copies them
    /// ([`NodeSnapshot`]) and hands over those copies and the ones
    /// requests made since the last turn; `encoded` are the images of
    /// what the last turn handed over, placed by this one. The turn's
    /// budget counts a copy by its buffers' bytes.
    pub fn checkpoint_turn(
        &mut self,
        budget: usize,
        encoded: SnapshotImages,
    ) -> EngineResult<(bool, NodeWrites, Vec<NodeSnapshot>)> {
        self.checkpoint_turn_with(budget, encoded, true)
    }

    fn checkpoint_turn_with(
        &mut self,
        budget: usize,
        encoded: SnapshotImages,
        copy_nodes: bool,
    ) -> EngineResult<(bool, NodeWrites, Vec<NodeSnapshot>)> {
        let Some(mut cp) = self.checkpoint.take() else {
            return Ok((true, Vec::new(), Vec::new()));
        };
        cp.images.extend(encoded.0);
        // Copies waiting for the checkpoint's thread count: a turn with a
        // budget of them copies no more.
        let mut bytes: usize = if copy_nodes {
            cp.snapshots.iter().map(|s| s.node.content_bytes()).sum()
        } else {
            0
        };
        if !copy_nodes {
            for snap in std::mem::take(&mut cp.snapshots) {
                let img = snap.encode();
                add(&self.stats.checkpoint_images_locked, 1);
                bytes += img.buf.len();
                cp.images.push((snap.num, snap.height, img));
            }
        }
        // A node being written back is left for later turns: its
        // write-back, if the node stays as it is, is the image this
        // checkpoint needs ([`Tree::take_for_checkpoint`]). Unless the
        // turn has nothing else to take (it would only turn again).
        let mut being_written_back = Vec::new();
        let mut taken_any = false;
        while bytes < budget {
            let Some(num) = cp.order.pop() else { break };
            if !cp.pending.contains(&num) {
                continue; // imaged or copied when it was about to change
            }
            if copy_nodes && self.writing_back.contains_key(&num) {
                being_written_back.push(num);
                continue;
            }
            bytes += self.image_for_checkpoint(&mut cp, num, copy_nodes);
            taken_any = true;
        }
        if taken_any || bytes >= budget {
            // Popped last: after every other node of the checkpoint.
            cp.order.splice(0..0, being_written_back);
        } else {
            // Past the budget or not, the turn's last take.
            for num in being_written_back {
                self.image_for_checkpoint(&mut cp, num, copy_nodes);
            }
        }
        // At most a budget of copies handed over (at least one): the
        // images the checkpoint's thread makes of them are in memory
        // until the next turn's are written, and requests copy every
        // pending node they change — during a large write, tens of
        // megabytes of leaves between two turns, all encoded at once
        // before (docs/benchmarks/visits-and-copies.md).
        let (snapshots, handed) = cp.take_snapshots(budget);
        note_max(
            &self.stats.checkpoint_copies_handed_bytes_max,
            handed as u64,
        );
        let done = cp.order.is_empty() && cp.snapshots.is_empty();
        let mut writes = Vec::with_capacity(cp.images.len());
        for (num, height, img) in std::mem::take(&mut cp.images) {
            let Some(extent) = self.allocate_extent(img.len) else {
                let e = self.no_extent(&format!("node {num}"), img.len);
                self.checkpoint = Some(cp);
                self.cancel_checkpoint();
                return Err(e);
            };
            self.alloc.hold_for_checkpoint(extent);
            writes.push((self.layout.extent_offset(extent), img.buf));
            cp.placed.push(PlacedImage {
                num,
                height,
                extent,
                crc: img.crc,
                bytes: img.len as usize,
                basement_locs: img.basement_locs,
            });
        }
        self.checkpoint = Some(cp);
        Ok((done, writes, snapshots))
    }

    /// Whether the checkpoint in flight has an image (or a copy to
    /// encode) of node `num` as it is now: it is writing the node, which
    /// its seal makes clean — written back too, it went to the device
    /// twice.
    fn imaged_for_checkpoint(&self, num: u64) -> bool {
        self.checkpoint
            .as_ref()
            .is_some_and(|cp| cp.unchanged.contains(&num))
    }

    /// Takes pending node `num` into checkpoint `cp`: a copy for its
    /// thread to encode (`copy_nodes`), else an image made here; the bytes
    /// it counts against the turn's budget.
    fn image_for_checkpoint(
        &self,
        cp: &mut CheckpointInProgress,
        num: u64,
        copy_nodes: bool,
    ) -> usize {
        cp.pending.remove(&num);
        cp.unchanged.insert(num);
        let node = self.node(num);
        if copy_nodes {
            cp.copy_node(num, node, &self.stats);
            node.content_bytes()
        } else {
            let img = encode_image(node, num);
            add(&self.stats.checkpoint_images_locked, 1);
            let bytes = img.buf.len();
            cp.images.push((num, node.height(), img));
            bytes
        }
    }

    /// Copies node `num` for the checkpoint in flight now, if it still
    /// waits for its image, as a turn does, leaving it unchanged: an
    /// interior node's buffers are then shared with the copy, and a writer about to
    /// change some of them copies those with the tree lock let go
    /// ([`Tree::shared_root_buffers`]) rather than in
    /// [`CheckpointInProgress::before_change`]'s hold.
    pub(super) fn copy_for_checkpoint_now(&mut self, num: u64) {
        let (Some(cp), Some(node)) = (&mut self.checkpoint, self.cache.get(&num)) else {
            return;
        };
        if cp.pending.remove(&num) {
            cp.copy_node(num, node, &self.stats);
            cp.unchanged.insert(num);
        }
    }

    /// Ends the encoding part of the checkpoint in flight, under the tree
    /// lock: encodes and places what is left, and encodes the block table
    /// naming every image. Nodes still as their image shows become clean,
    /// at their new extents (kept in the cache until the checkpoint is
    /// durable, `unwritten`); the others stay dirty, their image the
    /// checkpoint's alone. Returns what is left to write without the lock.
    /// If space runs out the checkpoint is cancelled and no node changed.
    /// `encoded`: images of what the last [`Tree::checkpoint_turn`]
    /// handed out.
    pub fn seal_checkpoint(&mut self, encoded: SnapshotImages) -> EngineResult<CheckpointWrites> {
        let (_, nodes, _) = self.checkpoint_turn_with(usize::MAX, encoded, false)?;
        let Some(mut cp) = self.checkpoint.take() else {
            panic!("tree invariant: no checkpoint in flight to seal");
        };
        for p in &cp.placed {
            cp.btt.set(p.num, p.extent, p.crc);
        }
        for &(num, extent, crc) in &cp.from_write_backs {
            cp.btt.set(num, extent, crc);
        }
        let table = cp.btt.encode();
        let Some(table_extent) = self.allocate_extent(table.len() as u32) else {
            let e = self.no_extent("the block table", table.len() as u32);
            self.checkpoint = Some(cp);
            self.cancel_checkpoint();
            return Err(e);
        };
        // Nothing fails from here on.
        for p in std::mem::take(&mut cp.placed) {
            self.count_node_written(p.height, p.bytes);
            if cp.unchanged.contains(&p.num) {
                if let Slot::OnDisk { extent: old, .. } = self.btt.get(p.num) {
                    // Named by neither this checkpoint nor the live tree.
                    self.alloc.release_from_checkpoint(old);
                }
                self.mark_written(p.num, p.extent, p.crc, p.basement_locs);
                self.unwritten.insert(p.num);
            } else {
                // Changed since: the image is the checkpoint's alone.
                self.alloc.free(p.extent);
            }
        }
        self.alloc.hold_for_checkpoint(table_extent);
        // The newest durable checkpoint still holds the old table's
        // blocks; freed now, they stay held for two more checkpoints.
        if let Some(old) = self.btt_extent.replace(table_extent) {
            self.alloc.free(old);
        }
        let mut superblock = cp.superblock;
        superblock.btt = table_extent;
        superblock.btt_crc = crc32c_of(&[&table]);
        Ok(CheckpointWrites {
            nodes,
            table: (
                self.layout.extent_offset(table_extent),
                AlignedBuf::from_slice(&table),
            ),
            superblock,
        })
    }

    /// Gives up the checkpoint in flight before it was sealed (no space,
    /// or a turn's writes failed): the extents its images were given are
    /// freed (no superblock names them) and its nodes stay dirty.
    pub fn cancel_checkpoint(&mut self) {
        if let Some(cp) = self.checkpoint.take() {
            for p in cp.placed {
                self.alloc.free(p.extent);
            }
        }
        self.alloc.cancel_pending_checkpoint();
    }

    /// Whether a checkpoint has begun and not ended: the allocator holds
    /// its pending generation from begin to commit, abort or cancel (the
    /// encoding part, `self.checkpoint`, lies within).
    pub fn checkpoint_in_flight(&self) -> bool {
        debug_assert!(self.checkpoint.is_none() || self.alloc.checkpoint_in_flight());
        self.alloc.checkpoint_in_flight()
    }

    /// The second half of a checkpoint, under the tree lock again: its
    /// superblock (generation `generation`) is durable.
    pub fn finish_checkpoint(&mut self, generation: u64) {
        self.generation = generation;
        self.alloc.commit_pending_checkpoint();
        self.unwritten.clear();
        self.count_image_sized_runs();
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
    /// space). Its nodes are still encoded and written `turn_bytes` at a
    /// time, so no more than a turn's images are in memory beside the
    /// cache (a close after a long run may have all of it dirty).
    pub fn write_checkpoint(
        &mut self,
        log_head: u64,
        log_epoch: u32,
        clean: bool,
        turn_bytes: usize,
        before_superblock: impl FnOnce() -> EngineResult<()>,
    ) -> EngineResult<()> {
        self.begin_checkpoint(log_head, log_epoch, clean)?;
        loop {
            let (done, images) = self.encode_checkpoint_nodes(turn_bytes)?;
            if let Err(e) = write_nodes(self.device.as_ref(), &images) {
                self.cancel_checkpoint();
                return Err(e);
            }
            if done {
                break;
            }
        }
        let writes = self.seal_checkpoint(SnapshotImages::none())?;
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

    /// Whether the device has room enough to let settling wait
    /// (background flushing, or a writer's settling in steps): a quarter
    /// of the node region free after what is used, dirty and promised,
    /// and as much in runs long enough for any image. The flusher's work
    /// is not admitted as a write is ([`Tree::space_low`]): the dirty
    /// nodes it makes, and the copies they leave until two checkpoints
    /// free them, must find room without that check; and a node left
    /// fuller than a node between two steps may be written (a checkpoint,
    /// an eviction) as an image past a node's size.
    pub fn room_to_defer_settling(&self, promised: u64) -> bool {
        let capacity = self.layout.nodes_bytes;
        self.claimed_bytes(promised).saturating_mul(4) <= capacity.saturating_mul(3)
            && self.image_sized_run_bytes() >= capacity / 4
    }

    /// Bytes of the node region in use, promised, or to be taken by the
    /// dirty nodes when they are written.
    fn claimed_bytes(&self, promised: u64) -> u64 {
        promised + self.alloc.used_blocks() * BLOCK_SIZE as u64 + self.dirty_bytes as u64
    }

    /// Bytes free in runs long enough for the largest image the store may
    /// make ([`Tree::image_blocks_max`]): as last counted, less every
    /// block allocated since (which may have come out of those runs). The
    /// count is made at every checkpoint and again whenever a quarter of
    /// it has been allocated ([`Tree::allocate_extent`]).
    ///
    /// An image can be larger than a node: a leaf's basements each begin
    /// on a block (with basements of a few kilobytes, a full leaf's image
    /// came to more than twice a node), and a root between two settling
    /// steps holds more than a node. Counted in node-sized runs, and only
    /// at checkpoints, a full and fragmented device showed room for the
    /// dirty nodes that no run could take: the reclaim after deletes could
    /// place none of its leaves, and the space the deletes freed never
    /// came back (docs/design.md, "A full device").
    pub(super) fn image_sized_run_bytes(&self) -> u64 {
        let consumed = self.blocks_allocated_since_count;
        self.image_sized_free_blocks
            .saturating_sub(consumed)
            .saturating_mul(BLOCK_SIZE as u64)
    }

    /// The most a write can dirty of nodes that were clean: a path from
    /// each root to a leaf, and a node more for a split on each, each at
    /// the largest image a node may take ([`Tree::image_blocks_max`]: the
    /// dirty nodes are counted at their images' size too).
    fn write_path_bytes(&self) -> u64 {
        let nodes: u64 = self.root_heights().map(|h| u64::from(h) + 2).sum();
        nodes * self.image_blocks_max() * BLOCK_SIZE as u64
    }

    /// Whether writes that add data should be refused: the node region
    /// could not absorb the dirty nodes plus a reserve for copy-on-write.
    ///
    /// Nodes are written as contiguous extents, so free space counts only
    /// where it comes in runs long enough for an image: on a nearly full,
    /// fragmented device the dirty nodes (and the nodes a checkpoint after
    /// deletes rewrites) must still find room, or no checkpoint could ever
    /// run.
    ///
    /// `promised` is the space held for writes already allowed (see
    /// [`crate::Reservation`]): it counts as used, and for writes that
    /// do not draw on it, it must be there in such runs as the dirty nodes
    /// must. A write that draws on
    /// its own promise (`drawing`) may use half of the copy-on-write
    /// reserve as well: the promise was checked against the full reserve
    /// when it was made, so the space is there, and what the write costs
    /// beyond its own bytes (dirty copies of nodes) is what the reserve is
    /// for. In runs, the reserve is counted in write paths
    /// ([`Tree::write_path_bytes`]): other writes stop with the promises
    /// and two paths free, and a drawing write needs one path beyond the
    /// dirty nodes, the promises not counted. With a margin of four nodes
    /// between the two, what the last fill writes dirtied (a path in each
    /// tree) took the margin and more, and a 128 MiB mount refused the
    /// write into its preallocated range. With the promises counted for a
    /// drawing write too, image-sized runs on a fragmented device shrank
    /// faster than the promises as they were drawn on (each checkpoint
    /// cuts runs with new images, and the copies it frees are scattered),
    /// and a write into preallocated blocks was refused with two fifths of
    /// the node region's blocks free (`crates/fs/tests/preallocation.rs`).
    /// Counted without them, a drawing write is refused only when what is
    /// dirty could not be checkpointed.
    pub fn space_low(&self, promised: u64, drawing: bool) -> bool {
        let capacity = self.layout.nodes_bytes;
        let node = self.opts.node_size as u64;
        let path = self.write_path_bytes();
        // The reserve, and what image-sized runs must hold beyond the
        // dirty nodes.
        let (reserve, runs_needed) = if drawing {
            ((capacity / 16).max(4 * node), path)
        } else {
            ((capacity / 8).max(8 * node), promised + 2 * path)
        };
        let used = self.claimed_bytes(promised)
            + (self.btt.live_count() as u64 * 16).next_multiple_of(BLOCK_SIZE as u64);
        used + reserve > capacity
            || self.dirty_bytes as u64 + runs_needed > self.image_sized_run_bytes()
    }
}

/// What a checkpoint writes, encoded by [`Tree::seal_checkpoint`]: dirty
/// nodes with their offsets (in allocation order, so mostly sequential),
/// the block table, and the superblock naming them.
pub(crate) struct CheckpointWrites {
    nodes: NodeWrites,
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
        write_nodes(device, &self.nodes)?;
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

/// A checkpoint between [`Tree::begin_checkpoint`] and
/// [`Tree::seal_checkpoint`].
pub(super) struct CheckpointInProgress {
    /// Nodes dirty when it began whose image is not made yet.
    pending: HashSet<u64>,
    /// The same, in the order the encoder takes them (popped from the end).
    order: Vec<u64>,
    /// Images not yet given an extent: node number, height, image. Made
    /// by requests between the checkpoint's turns (as many as the pending
    /// nodes they change), they count against the cache's budget until
    /// the next turn takes them.
    images: Vec<(u64, u32, NodeImage)>,
    /// Nodes as the checkpoint must have them, copied rather than
    /// encoded (a copy shares an interior node's buffers copy-on-write and
    /// a leaf's basements, so it costs a pointer per child or basement):
    /// a request that changes one, or a turn, holds
    /// the lock for the copy only, and the checkpoint's thread encodes it
    /// without the lock ([`Tree::checkpoint_turn`]), a turn's budget of
    /// them at a time, oldest first. What is left here at the seal (copies
    /// made since the last turn) is encoded there.
    snapshots: Vec<NodeSnapshot>,
    /// Images given an extent (their bytes written, or being written).
    placed: Vec<PlacedImage>,
    /// Imaged nodes not taken out to change since.
    unchanged: HashSet<u64>,
    /// Nodes it waited to image that a write-back wrote as they were
    /// when it began: node number, the write-back's extent and checksum
    /// ([`Tree::take_for_checkpoint`]).
    from_write_backs: Vec<(u64, Extent, u32)>,
    /// The block table when it began.
    btt: BlockTable,
    /// The superblock to write; its table extent and checksum come last.
    superblock: Superblock,
}

impl CheckpointInProgress {
    /// Node `num` (`node`) is about to change, or to be dropped: copied
    /// first if it still waits for its image ([`Tree::take`], and
    /// [`Tree::change_dirty_in_place`] for a node changed where it lies).
    pub(super) fn before_change(&mut self, num: u64, node: &Node, stats: &Stats) {
        if self.pending.remove(&num) {
            let started = std::time::Instant::now();
            // A copy sharing the buffers or basements: the change that
            // follows copies only a buffer it changes (a basement is
            // replaced, not changed).
            self.copy_node(num, node, stats);
            record_max(&stats.checkpoint_image_micros_max, started.elapsed());
        }
        self.unchanged.remove(&num);
    }

    /// Copies node `num` (`node`) for the checkpoint's thread to encode.
    fn copy_node(&mut self, num: u64, node: &Node, stats: &Stats) {
        add(&stats.checkpoint_node_copies, 1);
        self.snapshots.push(NodeSnapshot::of(num, node));
    }

    /// The oldest copies, as many as `budget` bytes of their nodes' content
    /// (at least one, if there is any), for the checkpoint's thread, and
    /// their bytes.
    fn take_snapshots(&mut self, budget: usize) -> (Vec<NodeSnapshot>, usize) {
        let (mut count, mut bytes) = (0, 0);
        for snap in &self.snapshots {
            let size = snap.node.content_bytes();
            if count > 0 && bytes + size > budget {
                break;
            }
            count += 1;
            bytes += size;
        }
        (self.snapshots.drain(..count).collect(), bytes)
    }
}

/// An image of the checkpoint in flight with its extent: what the block
/// table and, if the node has not changed since, the cached node must say.
pub(super) struct PlacedImage {
    num: u64,
    height: u32,
    extent: Extent,
    crc: u32,
    bytes: usize,
    basement_locs: Vec<PlacedBasement>,
}

/// Node images to write: (device offset, bytes).
pub(crate) type NodeWrites = Vec<(u64, AlignedBuf)>;

/// A copy of an interior node for the checkpoint in flight, to encode
/// without the tree lock ([`Tree::checkpoint_turn`]).
pub(crate) struct NodeSnapshot {
    num: u64,
    height: u32,
    node: Node,
}

impl NodeSnapshot {
    /// A copy of node `num` (cheap for an interior node: its buffers are
    /// shared).
    fn of(num: u64, node: &Node) -> NodeSnapshot {
        NodeSnapshot {
            num,
            height: node.height(),
            node: node.clone(),
        }
    }

    /// The copy's image (no lock needed).
    fn encode(&self) -> NodeImage {
        encode_image(&self.node, self.num)
    }

    /// The memory the copy holds beyond the cached node: the buffers the
    /// node has changed since (copied, so now the snapshot's alone).
    fn held_bytes(&self) -> usize {
        match &self.node.body {
            NodeBody::Interior(int) => int
                .buffers
                .iter()
                .filter(|b| Arc::strong_count(b) == 1)
                .map(|b| crate::node::buffer_mem_bytes(b))
                .sum(),
            NodeBody::Leaf(leaf) => leaf
                .basements
                .iter()
                .filter_map(|b| b.entries.as_ref())
                .filter(|e| Arc::strong_count(e) == 1)
                .map(|e| e.mem_bytes())
                .sum(),
        }
    }
}

/// Images of [`NodeSnapshot`]s, encoded without the lock, for the
/// checkpoint's next turn to place ([`Tree::checkpoint_turn`]).
pub(crate) struct SnapshotImages(Vec<(u64, u32, NodeImage)>);

impl SnapshotImages {
    pub fn none() -> SnapshotImages {
        SnapshotImages(Vec::new())
    }
}

/// Encodes the snapshots a checkpoint turn handed out (no lock needed).
pub(crate) fn encode_snapshots(snapshots: Vec<NodeSnapshot>) -> SnapshotImages {
    SnapshotImages(
        snapshots
            .into_iter()
            .map(|s| (s.num, s.height, s.encode()))
            .collect(),
    )
}

/// Writes node images (no tree lock needed).
pub(crate) fn write_nodes(device: &dyn Device, nodes: &NodeWrites) -> EngineResult<()> {
    for (offset, buf) in nodes {
        device
            .write_at(buf, *offset)
            .map_err(|e| EngineError::from(betreefs_store::StoreError::io("writing node", e)))?;
    }
    Ok(())
}

/// A dirty node's image, for a checkpoint or write-back (dirty leaves are
/// always whole).
fn encode_image(node: &Node, num: u64) -> NodeImage {
    if let NodeBody::Leaf(leaf) = &node.body {
        assert!(
            leaf.is_fully_loaded(),
            "tree invariant: dirty leaf {num} must be fully loaded"
        );
    }
    encode_node(node, num)
}
