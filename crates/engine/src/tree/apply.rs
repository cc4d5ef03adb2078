//! Applying a logged batch: each message goes into the root's buffers
//! (range renames are carried out here), then the roots settle.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::cache::Grown;
use super::surgery::Transplant;
use super::*;

impl Tree {
    /// Applies one batch (already logged) with sequence number `seq`.
    /// With [`Flushing::Background`] the roots' buffers take the batch and
    /// the flusher thread moves it down (the store makes writers wait for
    /// it past the backlog bound); with [`Flushing::Stepwise`] the writer
    /// moves it down after, in steps ([`Tree::settle_step`]). A range
    /// rename or clone settles here all the same, as surgery leaves nodes
    /// with more children than a node may keep.
    pub fn apply_batch(
        &mut self,
        seq: u64,
        batch: &WriteBatch,
        flushing: Flushing,
    ) -> EngineResult<()> {
        self.apply_messages(seq, batch.messages(), flushing)
    }

    /// [`Tree::apply_batch`] of a batch's messages, decoded already (a
    /// staged batch's).
    pub fn apply_messages(
        &mut self,
        seq: u64,
        messages: impl IntoIterator<Item = (KeySpace, Message)>,
        flushing: Flushing,
    ) -> EngineResult<()> {
        // A batch of many messages (a tree's clone writes a record for
        // every inode in it) settles as it goes past this: the root's
        // buffers would otherwise take all of it before the first flush,
        // far past the cache's budget. With background flushing, twice the
        // backlog bound — the store lets a write in at the bound, so only
        // a batch that alone could fill the backlog gets there; settling
        // in steps, twice a node — a root holds no more than a node
        // between writes, so only a batch of about a node gets there.
        let settle_above = match flushing {
            Flushing::Inline => self.opts.node_size,
            Flushing::Stepwise => 2 * self.opts.node_size,
            Flushing::Background => 2 * self.flush_backlog_bound(),
        };
        let mut must_settle = [false; KEY_SPACES];
        // What each root buffers, carried from message to message while
        // only its own inserts change it (summed over a root's buffers
        // for every message, this was a pass over all of its children).
        let mut root_bytes: [Option<usize>; KEY_SPACES] = [None; KEY_SPACES];
        for (ks, msg) in messages {
            let transplant = match &msg {
                Message::RangeRename(r) => Some((r, Transplant::Move)),
                Message::RangeClone(r) => Some((r, Transplant::Share)),
                _ => None,
            };
            let (transplanted, removal) = (transplant.is_some(), msg.is_removal());
            let grown = match transplant {
                Some((r, how)) => {
                    self.apply_transplant(ks, seq, r, how)?;
                    None
                }
                // The decoded message is moved into the root's buffer: a
                // data block is not copied once more on its way there.
                None => self.apply_message(ks, seq, msg)?,
            };
            must_settle[ks.index()] |= flushing == Flushing::Inline || transplanted;
            if removal {
                self.removals_since_reclaim += 1;
            }
            let known = &mut root_bytes[ks.index()];
            let bytes = match (*known, grown) {
                (Some(bytes), Some(grown)) => bytes.checked_add_signed(grown),
                _ => None,
            }
            .unwrap_or_else(|| self.root_buffer_bytes(ks));
            debug_assert_eq!(bytes, self.root_buffer_bytes(ks), "a root's bytes carried");
            *known = Some(bytes);
            // Messages flushed early stay below the later ones of the same
            // batch, so later still wins.
            if bytes > settle_above {
                add(&self.stats.roots_settled_in_applications, 1);
                self.settle_root(ks)?;
                self.evict_within_write()?;
                root_bytes[ks.index()] = None;
            }
        }
        for ks in KeySpace::ALL {
            if must_settle[ks.index()] {
                self.settle_root(ks)?;
            }
        }
        Ok(())
    }

    /// A range rename (`Transplant::Move`) or clone (`Transplant::Share`):
    /// by tree surgery when the source is large enough
    /// ([`surgery`](super::surgery)), by copying otherwise. Log replay
    /// makes the same choice on the same state, and either way the pairs
    /// end up the same.
    pub(super) fn apply_transplant(
        &mut self,
        ks: KeySpace,
        seq: u64,
        r: &RangeRename,
        how: Transplant,
    ) -> EngineResult<()> {
        let by_surgery =
            self.worth_surgery(ks, &r.start, &r.end)? && self.transplant_by_surgery(ks, r, how)?;
        if !by_surgery {
            self.copy_range(ks, seq, r)?;
            if how == Transplant::Move {
                let (start, end) = (r.start.clone(), r.end.clone());
                self.apply_message(ks, seq, Message::RangeDelete { start, end })?;
            }
        }
        let stats = &self.stats;
        let counter = match (how, by_surgery) {
            (Transplant::Move, true) => &stats.range_renames_by_surgery,
            (Transplant::Move, false) => &stats.range_renames_copied,
            (Transplant::Share, true) => &stats.range_clones_by_surgery,
            (Transplant::Share, false) => &stats.range_clones_copied,
        };
        add(counter, 1);
        if how == Transplant::Move {
            self.removals_since_reclaim += 1;
        }
        Ok(())
    }

    /// The copying half of a small range rename or clone: clear the
    /// destination, then put a copy of every source pair there, one leaf at
    /// a time with the tree settled in between. Every message carries the
    /// batch's sequence number; they are applied in this order exactly as
    /// if the batch had listed them (a rename range-deletes the source
    /// after).
    fn copy_range(&mut self, ks: KeySpace, seq: u64, r: &RangeRename) -> EngineResult<()> {
        let (start, end) = r.destination_range();
        self.apply_message(ks, seq, Message::RangeDelete { start, end })?;
        let mut next: Option<Vec<u8>> = Some(r.start.clone());
        while let Some(from) = next {
            let (items, after) = self.scan_leaf(ks, &from, Some(&r.end))?;
            for (key, value) in items {
                let key = r.moved(key);
                self.apply_message(ks, seq, Message::Put { key, value })?;
            }
            self.settle_root(ks)?;
            self.evict_within_write()?;
            next = after;
        }
        Ok(())
    }

    /// Evicts in the middle of applying a batch (the store evicts again
    /// after it); no space to write dirty nodes back is not an error here:
    /// the cache stays over budget until the write's own eviction says so.
    fn evict_within_write(&mut self) -> EngineResult<()> {
        match self.evict_if_needed() {
            Err(e) if !e.is_no_space() => Err(e),
            _ => Ok(()),
        }
    }

    /// Bytes buffered in the root of `ks` (none if it is a leaf, or not
    /// cached: a root written back and dropped holds nothing new).
    pub(super) fn root_buffer_bytes(&self, ks: KeySpace) -> usize {
        match self.cache.get(&self.roots[ks.index()]).map(|n| &n.body) {
            Some(NodeBody::Interior(int)) => int.buffer_bytes(),
            _ => 0,
        }
    }

    /// Whether some root's buffers hold more than `bytes`.
    pub(crate) fn a_root_holds_more_than(&self, bytes: usize) -> bool {
        KeySpace::ALL
            .into_iter()
            .any(|ks| self.root_buffer_bytes(ks) > bytes)
    }

    /// The root, loaded, with a buffer put above it if it is a leaf.
    /// Applied to a leaf, every message would rebuild a packed basement (a
    /// copy of up to `basement_size` bytes); a buffer takes it in O(log n)
    /// and flushes in batches, as everywhere else in the tree. Small trees
    /// (a fresh file system's metadata) are exactly where single messages
    /// arrive one at a time. `settle_root` keeps a root over a single leaf.
    pub(super) fn interior_root(&mut self, ks: KeySpace) -> EngineResult<u64> {
        let root = self.roots[ks.index()];
        self.load(ks, root, &Bounds::full(), Want::Whole, None)?;
        if self.node(root).height() == 0 {
            let int = Interior {
                height: 1,
                pivots: Vec::new(),
                children: vec![root],
                buffers: vec![Default::default()],
                partial: None,
            };
            self.roots[ks.index()] = self.new_node(ks, NodeBody::Interior(int), Bounds::full());
        }
        Ok(self.roots[ks.index()])
    }

    /// The buffers of the root of `ks` that messages for `keys` would
    /// change and that another holder shares: the checkpoint in flight's
    /// copy of the root (the root is copied for it here if it waits for
    /// its image). Changed under the tree lock, each would be copied there
    /// first (`Arc::make_mut`), and with it each chunk of point messages
    /// the change reaches ([`crate::point_map`]): one chunk for keys that
    /// arrive together, every chunk for keys spread over the buffer. The
    /// caller makes those copies with the lock let go
    /// ([`SharedBuffer::copy`]) and puts them in place
    /// ([`Tree::adopt_buffer_copies`]).
    pub fn shared_root_buffers<'k>(
        &mut self,
        ks: KeySpace,
        keys: impl IntoIterator<Item = &'k [u8]>,
    ) -> Vec<SharedBuffer> {
        let root = self.roots[ks.index()];
        let mut keys = keys.into_iter().peekable();
        let whole_interior = |tree: &Tree| match tree.cache.get(&root).map(|n| &n.body) {
            Some(NodeBody::Interior(int)) => int.partial.is_none(),
            _ => false,
        };
        if keys.peek().is_none() || !whole_interior(self) {
            return Vec::new();
        }
        self.copy_for_checkpoint_now(root);
        let int = self.interior(root);
        // Copied already (each turn of an application asks again): no
        // key need be placed.
        if int.buffers.iter().all(|b| Arc::strong_count(b) == 1) {
            return Vec::new();
        }
        let mut touched: Vec<Vec<&[u8]>> = vec![Vec::new(); int.children.len()];
        for key in keys {
            if let Some(keys) = touched.get_mut(int.child_index(key)) {
                keys.push(key);
            }
        }
        touched
            .into_iter()
            .zip(&int.buffers)
            .enumerate()
            .filter(|(_, (keys, buffer))| !keys.is_empty() && Arc::strong_count(buffer) > 1)
            .map(|(child, (keys, buffer))| SharedBuffer {
                ks,
                child,
                chunks: buffer.points().chunks_of(keys),
                buffer: buffer.clone(),
            })
            .collect()
    }

    /// Puts each copy made of a [`SharedBuffer`] in place of the buffer it
    /// was made from, where a root still holds that buffer unchanged (a
    /// buffer changed meanwhile was copied by whoever changed it). Returns
    /// how many were put in place.
    pub fn adopt_buffer_copies(&mut self, copies: Vec<(SharedBuffer, MessageBuffer)>) -> u64 {
        let mut adopted = 0;
        for (shared, copy) in copies {
            let root = self.roots[shared.ks.index()];
            let Some(NodeBody::Interior(int)) = self.cache.get_mut(&root).map(|n| &mut n.body)
            else {
                continue;
            };
            // The same buffer, never changed while shared: the copy holds
            // what it holds, so the node's image, dirtiness and counted
            // memory stay as they are.
            if let Some(buffer) = int.buffers.get_mut(shared.child) {
                if Arc::ptr_eq(buffer, &shared.buffer) {
                    *buffer = Arc::new(copy);
                    adopted += 1;
                }
            }
        }
        adopted
    }

    /// Puts one message into the root's buffers. Returns by how much the
    /// root's buffered bytes grew when that is known without summing
    /// them (a point message into a root dirty already).
    pub(super) fn apply_message(
        &mut self,
        ks: KeySpace,
        seq: u64,
        msg: Message,
    ) -> EngineResult<Option<isize>> {
        let root = self.interior_root(ks)?;
        let (eaten, grown) = match msg {
            Message::RangeDelete { start, end } => {
                let eaten = self.with_interior(root, |int| {
                    int.insert_range_delete(&start, &end, seq, &Bounds::full())
                });
                (eaten, None)
            }
            msg => match point_msg(seq, msg) {
                Some((key, m)) => self.insert_point_into_root(root, key, m),
                None => (0, None),
            },
        };
        add(&self.stats.messages_obviated, eaten as u64);
        add(&self.stats.messages_inserted, 1);
        Ok(grown)
    }

    /// A point message into root `root` (cached whole, interior). Most go
    /// into a root that is dirty already, changed where it lies in the
    /// cache and counted by what the one buffer it went into changed.
    /// Taken out and put back, every message summed the root's buffers and
    /// pivots four times, a pass over each of its children (the
    /// applications of staged writes are the serial part of a store with
    /// several writers; docs/design.md, "Staged writes"). Returns messages
    /// eaten, and the growth of the root's buffered bytes when changed in
    /// place.
    fn insert_point_into_root(
        &mut self,
        root: u64,
        key: Vec<u8>,
        m: PointMsg,
    ) -> (usize, Option<isize>) {
        let in_place = self.change_dirty_in_place(root, (key, m), |node, merges, (key, m)| {
            let NodeBody::Interior(int) = &mut node.body else {
                unreachable!("interior_root returns an interior node")
            };
            let inserted = int.insert_point_counted(key, m, merges);
            let grown = Grown {
                mem: inserted.mem,
                content: inserted.bytes,
            };
            (inserted, grown)
        });
        let (inserted, grown) = match in_place {
            Ok(inserted) => (inserted, Some(inserted.bytes)),
            // A clean root becomes dirty: counted whole, once.
            Err((key, m)) => {
                let merges = Arc::clone(&self.merges);
                let inserted =
                    self.with_interior(root, |int| int.insert_point_counted(key, m, &merges));
                (inserted, None)
            }
        };
        if inserted.copied {
            // Shared with the checkpoint in flight's copy of the root, the
            // buffer was copied under the tree lock.
            add(&self.stats.root_buffers_copied_locked, 1);
        }
        (inserted.eaten, grown)
    }

    /// Flushes, splits and collapses at the root until it is within bounds.
    pub(super) fn settle_root(&mut self, ks: KeySpace) -> EngineResult<()> {
        self.settle_root_within(ks, usize::MAX)
    }

    /// [`Tree::settle_root`] moving about `budget` bytes out of the root at
    /// most (a turn of background flushing): the root may still hold more
    /// than a node's worth after.
    pub(super) fn settle_root_within(&mut self, ks: KeySpace, budget: usize) -> EngineResult<()> {
        let root = self.roots[ks.index()];
        self.flush_heaviest(ks, root, &Bounds::full(), budget)?;
        self.settle_root_shape(ks)
    }

    /// After flushing out of the root of `ks`: splits it if it has too
    /// many children (the tree grows a level), and drops a root left
    /// with one interior child.
    pub(super) fn settle_root_shape(&mut self, ks: KeySpace) -> EngineResult<()> {
        let root = self.roots[ks.index()];
        let full = Bounds::full();
        let splits = self.split_if_needed(ks, root, &full)?;
        if !splits.is_empty() {
            let height = self.node(root).height() + 1;
            let mut int = Interior {
                height,
                pivots: Vec::new(),
                children: vec![root],
                buffers: vec![Default::default()],
                partial: None,
            };
            for (pivot, num) in splits {
                int.pivots.push(pivot);
                int.children.push(num);
                int.buffers.push(Default::default());
            }
            self.roots[ks.index()] = self.new_node(ks, NodeBody::Interior(int), Bounds::full());
        }
        // A root with one interior child is only a detour: empty its buffer
        // and drop it. Over a single leaf it stays: its buffer is what
        // batches small writes for that leaf (see `grow_leaf_root`).
        loop {
            let root = self.roots[ks.index()];
            let NodeBody::Interior(int) = &self.node(root).body else {
                break;
            };
            if int.children.len() != 1 || int.height < 2 {
                break;
            }
            if !int.buffers[0].is_empty() {
                self.flush_child(ks, root, 0, &Bounds::full())?;
                continue;
            }
            let child = int.children[0];
            self.load(
                ks,
                child,
                &Bounds::full(),
                Want::Whole,
                Some(int.height - 1),
            )?;
            self.free_node(root);
            self.roots[ks.index()] = child;
        }
        Ok(())
    }
}

/// A root buffer shared with another holder that the batches about to be
/// applied will change ([`Tree::shared_root_buffers`]), and the chunks of
/// its point messages they will change.
pub struct SharedBuffer {
    ks: KeySpace,
    child: usize,
    chunks: Vec<usize>,
    buffer: Arc<MessageBuffer>,
}

impl SharedBuffer {
    /// A copy of the buffer, made without the tree lock, that shares
    /// every chunk but those the batches will change.
    pub fn copy(&self) -> MessageBuffer {
        let mut copy = MessageBuffer::clone(&self.buffer);
        copy.unshare_point_chunks(&self.chunks);
        copy
    }
}
