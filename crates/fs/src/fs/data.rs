//! File data: open and release, read, write (a put per whole block, an
//! upsert per partial block: never a read) and fallocate.

use betreefs_engine::merge::patch_arg;
use betreefs_engine::{KeySpace, WriteBatch, MERGE_PATCH};

use super::locking::Writer;
use super::planned::Planned;
use super::reservations::{self, ReservedBlocks};
use super::state::{Home, OpenFile, State};
use super::{
    blocks_to, Caller, FileSystem, Ino, SetAttr, BLOCKS_PER_BATCH, BLOCK_SIZE, FILE_SIZE_MAX,
};
use crate::error::{Errno, FsResult};
use crate::plan::{count_update, purge_file};
use crate::record::{Attr, Timespec, PREALLOC_FL, SPARSE_FL, S_IFREG};
use crate::schema;

impl FileSystem {
    pub(super) fn add_file_handle(st: &mut State, ino: Ino, flags: i32) -> FsResult<u64> {
        let node = st.node_mut(ino)?;
        node.opens += 1;
        let fh = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(
            fh,
            OpenFile {
                ino,
                append: flags & libc::O_APPEND != 0,
            },
        );
        Ok(fh)
    }

    pub(super) fn open_file(&self, ino: Ino, flags: i32, kill: Option<Caller>) -> FsResult<u64> {
        let mut st = self.lock();
        let node = st.node(ino)?;
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        if node.attr.is_dir() && writes {
            return Err(Errno::EISDIR);
        }
        // Linux's may_open: an immutable file opens only for reading, an
        // append-only one only for appending; neither is truncated.
        let truncates = flags & libc::O_TRUNC != 0;
        if (node.attr.is_immutable() && (writes || truncates))
            || (node.attr.is_append_only()
                && ((writes && flags & libc::O_APPEND == 0) || truncates))
        {
            return Err(Errno::EPERM);
        }
        // POSIX marks mtime and ctime for update on O_TRUNC of an existing
        // file even when it is empty already (Linux does too).
        if flags & libc::O_TRUNC != 0 && node.attr.file_type() == S_IFREG {
            drop(st);
            self.set_attributes(
                ino,
                &SetAttr {
                    size: Some(0),
                    through_open_file: true,
                    kill_privileges: kill,
                    ..SetAttr::default()
                },
            )?;
            st = self.lock();
        }
        Self::add_file_handle(&mut st, ino, flags)
    }

    /// The last close of an unlinked file frees it. The table alone
    /// otherwise: an unlink of the file in flight, planned while it was
    /// open, finds it closed once its batch is in and frees it itself
    /// ([`FileSystem::free_if_closed`]).
    pub(super) fn release_file(&self, fh: u64) -> FsResult<()> {
        let mut st = self.lock_table();
        let Some(OpenFile { ino, .. }) = st.handles.remove(&fh) else {
            return Err(Errno::EBADF);
        };
        let node = st.node_mut(ino)?;
        node.opens = node.opens.saturating_sub(1);
        if !Self::unlinked_and_closed(&st, ino) {
            st.drop_if_unused(ino);
            return Ok(());
        }
        drop(st);
        let mut st = self.writer();
        self.free_if_closed(&mut st, ino)?;
        st.drop_if_unused(ino);
        Ok(())
    }

    /// Frees `ino` if it has no name left and no open handle, its data
    /// still under its inode key: at its last close, or at the end of an
    /// unlink that a last close raced with.
    pub(super) fn free_if_closed(&self, st: &mut Writer<'_>, ino: Ino) -> FsResult<()> {
        if !Self::unlinked_and_closed(st, ino) {
            return Ok(());
        }
        let attr = st.node(ino)?.attr.clone();
        let mut batch = WriteBatch::new();
        let file = schema::inode_key(ino);
        let released = self.release_all_reservations(&mut batch, Some(&attr), &file)?;
        purge_file(&mut batch, &file);
        batch.delete(KeySpace::Meta, &schema::orphan_key(ino));
        count_update(&mut batch, -1);
        st.write_reserving(&batch, released.reservation())?;
        st.node_mut(ino)?.home = Home::Gone;
        st.note_key_move(ino);
        Ok(())
    }

    /// Whether `ino` has no name left and no open handle, its data still
    /// under its inode key: the last close frees it.
    fn unlinked_and_closed(st: &State, ino: Ino) -> bool {
        st.nodes
            .get(&ino)
            .is_some_and(|n| n.opens == 0 && n.attr.nlink == 0 && n.home == Home::Inode)
    }

    /// Reads into `out` from `offset`; returns the bytes read (fewer at the
    /// end of the file).
    ///
    /// The table's lock is not held while the store reads: the file's
    /// size, key and `data_version` and the table's `key_moves` are taken
    /// under it, the blocks read without it, and the read stands if
    /// neither count moved meanwhile — the key was the file's and its data
    /// unchanged throughout (both are taken with no write in flight, and
    /// a write moves them when it updates the table: `super::locking`).
    /// Otherwise (a write, truncate or rename raced with it) it is made
    /// again with the lock held, as every read was before: a cached
    /// `getattr` or a read of another file no longer waits for this one's
    /// device reads.
    pub(super) fn read_data(&self, ino: Ino, offset: u64, out: &mut [u8]) -> FsResult<usize> {
        let (span, seen) = {
            let st = self.lock();
            let span = ReadSpan::of(&st, ino, offset, out.len())?;
            (span, (st.node(ino)?.data_version, st.key_moves))
        };
        self.copy_span(&span, offset, out)?;
        let st = self.lock();
        let now = st.nodes.get(&ino).map(|n| (n.data_version, st.key_moves));
        let len = if now == Some(seen) {
            span.len
        } else {
            let span = ReadSpan::of(&st, ino, offset, out.len())?;
            self.copy_span(&span, offset, out)?;
            span.len
        };
        self.note_access(st, ino)?;
        Ok(len)
    }

    fn copy_span(&self, span: &ReadSpan, offset: u64, out: &mut [u8]) -> FsResult<()> {
        match &span.blocks {
            Some((key, end)) => self.copy_blocks(key, offset, *end, out),
            None => Ok(()),
        }
    }

    /// Copies the file's bytes [offset, end) into the start of `out`:
    /// blocks straight from the leaves into the reply, what lies between
    /// them (holes) zeroed as it is passed.
    fn copy_blocks(&self, key: &[u8], offset: u64, end: u64, out: &mut [u8]) -> FsResult<()> {
        let len = (end - offset) as usize;
        let (first, last) = (offset / BLOCK_SIZE, (end - 1) / BLOCK_SIZE);
        let lo = schema::data_key(key, first);
        let hi = schema::data_key(key, last + 1);
        let mut filled = 0usize;
        self.store
            .visit_range(KeySpace::Data, &lo, &hi, &mut |k, v| {
                let Some(block) = schema::data_block(key, k) else {
                    return;
                };
                let block_start = block * BLOCK_SIZE;
                // The overlap of [block_start, block_start + v.len()) and [offset, end).
                let from = block_start.max(offset);
                let to = (block_start + v.len() as u64).min(end);
                if from >= to {
                    return;
                }
                let (at, until) = ((from - offset) as usize, (to - offset) as usize);
                if let Some(gap) = out.get_mut(filled..at) {
                    gap.fill(0);
                }
                let dst = out.get_mut(at..until);
                let src = v.get((from - block_start) as usize..(to - block_start) as usize);
                if let (Some(dst), Some(src)) = (dst, src) {
                    dst.copy_from_slice(src);
                }
                filled = filled.max(until);
            })?;
        if let Some(rest) = out.get_mut(filled..len) {
            rest.fill(0);
        }
        Ok(())
    }

    /// Writes `data` at `offset` (at the end for O_APPEND handles); returns
    /// the bytes written (fewer than asked only when space ran out).
    pub(super) fn write_data(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        data: &[u8],
        kill: Option<Caller>,
    ) -> FsResult<u32> {
        let mut st = self.writer();
        let kernel_places = self
            .kernel_places_appends
            .load(std::sync::atomic::Ordering::Relaxed);
        let append = matches!(st.handles.get(&fh), Some(OpenFile { append: true, .. }));
        let node = st.node(ino)?;
        if node.attr.file_type() != S_IFREG {
            return Err(Errno::EINVAL);
        }
        // A file made immutable after it was opened takes no more writes
        // (as ext4); an append-only one takes them only at its end, whatever
        // the handle's flags became since (fcntl cannot reach us), unless
        // the kernel's writeback cache places writes itself.
        if node.attr.is_immutable() {
            return Err(Errno::EPERM);
        }
        let append = (append || node.attr.is_append_only()) && !kernel_places;
        let size_before = node.attr.size;
        let offset = if append { size_before } else { offset };
        if offset.saturating_add(data.len() as u64) > FILE_SIZE_MAX {
            return Err(Errno::EFBIG);
        }
        let key = st.file_key(ino)?;
        let preallocated = node.attr.flags & PREALLOC_FL != 0;
        // A write starting past the last stored block leaves a hole.
        let leaves_holes = offset / BLOCK_SIZE > blocks_to(size_before);
        let mut written = 0usize;
        while written < data.len() {
            let old_size = st.node(ino)?.attr.size;
            let mut batch =
                WriteBatch::with_capacity(data_batch_bytes(data.len() - written, key.len()));
            let mut plan = Planned::new();
            plan.note_data_change(&st, ino, leaves_holes)?;
            let chunk_start = written;
            let rest = data.get(written..).unwrap_or_default();
            written += put_data_blocks(&mut batch, &key, rest, offset + written as u64, old_size);
            let pos = offset + written as u64;
            // Reserved blocks written give their promise back.
            let released = if preallocated {
                let first = (offset + chunk_start as u64) / BLOCK_SIZE;
                self.carve_reservations(&mut batch, &key, first, blocks_to(pos))?
            } else {
                0
            };
            let now = Timespec::now();
            if let (0, Some(caller)) = (chunk_start, kill) {
                self.drop_privileges(&mut st, &mut plan, &mut batch, ino, &key, caller)?;
            }
            let attr = plan.attr_mut(&st, ino)?;
            attr.size = attr.size.max(pos);
            attr.mtime = now;
            attr.ctime = now;
            plan.put_record_at(&st, &mut batch, &key, ino)?;
            let reservation = ReservedBlocks::released(released).reservation();
            match st.write_reserving(&batch, reservation) {
                Ok(_) => st.commit(plan),
                // What went in before stays: a short write.
                Err(e) if chunk_start > 0 && e.is_no_space() => return Ok(chunk_start as u32),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(written as u32)
    }

    /// fallocate(2). Mode 0 and `KEEP_SIZE` preallocate: every block of
    /// the range that stores nothing becomes a reservation (it reads as
    /// zeros, and the space a write into it needs is held back from every
    /// other write: see [`super::reservations`]); the size grows to the
    /// end unless `KEEP_SIZE`. `PUNCH_HOLE | KEEP_SIZE` makes the range
    /// read as zeros and frees it: a range delete of the whole blocks
    /// inside it (their reservations too) and a patch of zeros over the
    /// partial ones at its edges, clipped to the size (past it nothing is
    /// stored). `ZERO_RANGE` (with or without `KEEP_SIZE`) zeroes the
    /// same way and leaves the range preallocated, as Linux does.
    /// Collapse and insert never reach a FUSE file system (the kernel
    /// refuses them); any other mode is `EOPNOTSUPP`.
    pub(super) fn allocate(
        &self,
        ino: Ino,
        offset: u64,
        length: u64,
        mode: i32,
        kill: Option<Caller>,
    ) -> FsResult<()> {
        const KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE;
        const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE;
        let (zeroes, preallocates) = match mode {
            0 | KEEP_SIZE => (false, true),
            m if m == PUNCH_HOLE | KEEP_SIZE => (true, false),
            m if m == ZERO_RANGE || m == ZERO_RANGE | KEEP_SIZE => (true, true),
            _ => return Err(Errno::EOPNOTSUPP),
        };
        let keep_size = mode & KEEP_SIZE != 0;
        if length == 0 {
            return Err(Errno::EINVAL);
        }
        let end = offset.checked_add(length).ok_or(Errno::EFBIG)?;
        if end > FILE_SIZE_MAX {
            return Err(Errno::EFBIG);
        }
        let mut st = self.writer();
        let before = st.node(ino)?.attr.clone();
        if before.is_dir() {
            return Err(Errno::EISDIR);
        }
        // Linux's vfs_fallocate: nothing on an immutable file, only
        // KEEP_SIZE reservations on an append-only one.
        if before.is_immutable() || (before.is_append_only() && mode & !KEEP_SIZE != 0) {
            return Err(Errno::EPERM);
        }
        // Like a write: times are marked (Linux's file_modified) and set-ID
        // bits dropped even when the size stays.
        let now = Timespec::now();
        let key = st.file_key(ino)?;
        let mut batch = WriteBatch::new();
        let mut plan = Planned::new();
        if let Some(caller) = kill {
            self.drop_privileges(&mut st, &mut plan, &mut batch, ino, &key, caller)?;
        }
        let span = (offset / BLOCK_SIZE, blocks_to(end));
        let patched = if zeroes {
            zero_blocks(&mut batch, &key, offset, end.min(before.size))
        } else {
            Vec::new()
        };
        let changed = if zeroes && !preallocates {
            // Punched: whole blocks are freed, patched edges store data.
            let whole = (offset.div_ceil(BLOCK_SIZE), end / BLOCK_SIZE);
            let mut freed: Vec<(u64, u64)> = patched.clone();
            if whole.0 < whole.1 {
                freed.push(whole);
            }
            freed.sort_unstable();
            self.update_reservations(&mut batch, &key, span, &[], &freed)?
        } else {
            // Preallocated: what stores nothing afterwards is reserved.
            let mut stored = self.stored_runs(&before, &key, span.0, span.1)?;
            if zeroes {
                let deleted = (
                    offset.div_ceil(BLOCK_SIZE),
                    end.min(before.size) / BLOCK_SIZE,
                );
                stored = reservations::join_runs(
                    reservations::runs_without(&stored, &[deleted]),
                    &patched,
                );
            }
            self.update_reservations(&mut batch, &key, span, &[span], &stored)?
        };
        // Zeroed ranges become holes; so does growing past the last block;
        // reserved blocks are counted like holes' neighbours (st_blocks).
        let grows = !keep_size && blocks_to(end) > blocks_to(before.size);
        plan.note_data_change(&st, ino, zeroes || grows || changed.taken > 0)?;
        let attr = plan.attr_mut(&st, ino)?;
        if changed.taken > 0 {
            attr.flags |= PREALLOC_FL;
        }
        if !keep_size {
            attr.size = attr.size.max(end);
        }
        attr.ctime = now;
        attr.mtime = now;
        plan.put_record_at(&st, &mut batch, &key, ino)?;
        st.write_reserving(&batch, changed.reservation())?;
        st.commit(plan);
        Ok(())
    }

    /// copy_file_range(2) inside the file system: the source's data
    /// extents are read and written to the destination a chunk at a time
    /// (nothing goes through the caller), its holes stay holes (a range
    /// of the destination they cover is zeroed, whole blocks punched).
    /// Overlapping ranges of one file are refused (`EINVAL`) as Linux does.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_data(
        &self,
        ino_in: Ino,
        off_in: u64,
        ino_out: Ino,
        fh_out: u64,
        off_out: u64,
        len: u64,
        kill: Option<Caller>,
    ) -> FsResult<u64> {
        const CHUNK: u64 = 1 << 20;
        let source = self.table_attr(ino_in)?;
        let target = self.table_attr(ino_out)?;
        if source.is_dir() || target.is_dir() {
            return Err(Errno::EISDIR);
        }
        if source.file_type() != S_IFREG || target.file_type() != S_IFREG {
            return Err(Errno::EINVAL);
        }
        let len = len.min(source.size.saturating_sub(off_in));
        if len == 0 {
            return Ok(0);
        }
        let end_out = off_out.checked_add(len).ok_or(Errno::EFBIG)?;
        if end_out > FILE_SIZE_MAX {
            return Err(Errno::EFBIG);
        }
        if ino_in == ino_out && off_in < end_out && off_out < off_in + len {
            return Err(Errno::EINVAL);
        }
        if self.clone_blocks(ino_in, off_in, ino_out, off_out, len, kill)? {
            return Ok(len);
        }
        let mut buf = vec![0u8; CHUNK as usize];
        let (mut pos, end) = (off_in, off_in + len);
        let mut kill = kill;
        while pos < end {
            let data = match self.seek_in_blocks(ino_in, pos, libc::SEEK_DATA) {
                Ok(at) => at.min(end),
                Err(Errno::ENXIO) => end,
                Err(e) => return Err(e),
            };
            if data > pos {
                // A hole: what the destination holds there becomes zeros.
                let to = off_out + (pos - off_in);
                let dest_size = self.table_attr(ino_out)?.size;
                if to < dest_size {
                    let n = (data - pos).min(dest_size - to);
                    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                    self.allocate(ino_out, to, n, mode, kill.take())?;
                }
            }
            if data >= end {
                break;
            }
            let hole = self.seek_in_blocks(ino_in, data, libc::SEEK_HOLE)?.min(end);
            let mut at = data;
            while at < hole {
                let n = (hole - at).min(CHUNK) as usize;
                let chunk = buf.get_mut(..n).ok_or(Errno::EINVAL)?;
                let got = self.read_data(ino_in, at, chunk)?;
                let chunk = chunk.get(..got).ok_or(Errno::EIO)?;
                if chunk.is_empty() {
                    break;
                }
                let to = off_out + (at - off_in);
                let wrote = self.write_data(ino_out, fh_out, to, chunk, kill.take())?;
                at += u64::from(wrote);
                if (wrote as usize) < chunk.len() {
                    return Ok(at - off_in);
                }
            }
            pos = hole;
        }
        // A hole at the end still extends the destination.
        if self.table_attr(ino_out)?.size < end_out {
            self.set_attributes(
                ino_out,
                &SetAttr {
                    size: Some(end_out),
                    ..SetAttr::default()
                },
            )?;
        }
        Ok(len)
    }

    /// copy_file_range(2) as a range clone (docs/design.md, "Range
    /// clone"): the destination's blocks [off/B, end/B) become the
    /// source's, shared copy-on-write in the engine — one logged message,
    /// O(tree height) however long the range. Only where that is exactly
    /// a copy: the same block-aligned offset in both files (block `b`
    /// stays block `b`), a range ending at a block boundary or at the
    /// source's end with nothing of the destination after it, and no
    /// preallocated blocks in the destination (its reservations would
    /// disagree with what it stores). `Ok(false)`: copy instead.
    fn clone_blocks(
        &self,
        ino_in: Ino,
        off_in: u64,
        ino_out: Ino,
        off_out: u64,
        len: u64,
        kill: Option<Caller>,
    ) -> FsResult<bool> {
        let mut st = self.writer();
        let source = st.node(ino_in)?.attr.clone();
        let before = st.node(ino_out)?.attr.clone();
        let end = off_in + len;
        let whole_blocks =
            end.is_multiple_of(BLOCK_SIZE) || (end == source.size && before.size <= end);
        if ino_in == ino_out
            || off_in != off_out
            || !off_in.is_multiple_of(BLOCK_SIZE)
            || !whole_blocks
            || before.flags & PREALLOC_FL != 0
            || before.is_immutable()
            || before.is_append_only()
        {
            return Ok(false);
        }
        let (key_in, key_out) = (st.file_key(ino_in)?, st.file_key(ino_out)?);
        let mut batch = WriteBatch::new();
        let mut plan = Planned::new();
        if let Some(caller) = kill {
            self.drop_privileges(&mut st, &mut plan, &mut batch, ino_out, &key_out, caller)?;
        }
        let (first, past) = (off_in / BLOCK_SIZE, blocks_to(end));
        let from = schema::data_prefix(&key_in);
        batch.range_clone(
            KeySpace::Data,
            &schema::data_key(&key_in, first),
            &schema::data_key(&key_in, past),
            from.len(),
            &schema::data_prefix(&key_out),
        );
        // The source's holes come along; so does one before `off_out`
        // when the destination was shorter.
        let leaves_holes = source.flags & SPARSE_FL != 0 || first > blocks_to(before.size);
        plan.note_data_change(&st, ino_out, leaves_holes)?;
        let now = Timespec::now();
        let attr = plan.attr_mut(&st, ino_out)?;
        attr.size = attr.size.max(end);
        attr.mtime = now;
        attr.ctime = now;
        plan.put_record_at(&st, &mut batch, &key_out, ino_out)?;
        st.write(&batch)?;
        st.commit(plan);
        Ok(true)
    }

    /// The attributes of table inode `ino` as the table has them (no
    /// blocks counted): for the file system's own checks.
    pub(super) fn table_attr(&self, ino: Ino) -> FsResult<Attr> {
        Ok(self.lock().node(ino)?.attr.clone())
    }

    /// The attributes of table inode `ino` as the kernel is shown them:
    /// with the blocks a file that may have holes stores, counted at most
    /// once per change of its data.
    pub(super) fn attr_for_kernel(&self, st: &mut State, ino: Ino) -> FsResult<Attr> {
        if let Some(attr) = Self::attr_in_table(st, ino)? {
            return Ok(attr);
        }
        let node = st.node(ino)?;
        let mut attr = node.attr.clone();
        let version = node.data_version;
        let counted = self.count_stored_blocks(&attr, &st.file_key(ino)?)?;
        if let Some(blocks) = counted {
            st.node_mut(ino)?.stored_blocks = Some((version, blocks));
        }
        attr.stored_blocks = counted;
        Ok(attr)
    }

    /// [`FileSystem::attr_for_kernel`] when the table alone has it: for
    /// every inode but a file that may have holes whose stored blocks
    /// were not counted since its data last changed.
    pub(super) fn attr_in_table(st: &State, ino: Ino) -> FsResult<Option<Attr>> {
        let node = st.node(ino)?;
        let mut attr = node.attr.clone();
        let may_have_holes = attr.flags & SPARSE_FL != 0 && attr.file_type() == S_IFREG;
        if !may_have_holes || node.home == Home::Gone {
            return Ok(Some(attr));
        }
        match node.stored_blocks {
            Some((version, blocks)) if version == node.data_version => {
                attr.stored_blocks = Some(blocks);
                Ok(Some(attr))
            }
            _ => Ok(None),
        }
    }

    /// The data blocks stored of a file that may have holes (a scan of
    /// its data keys up to its size), and its reserved ones (preallocated
    /// blocks count as the file's, as on ext4); `None` for any other
    /// inode, whose blocks follow from its size.
    pub(super) fn count_stored_blocks(
        &self,
        attr: &Attr,
        file_key: &[u8],
    ) -> FsResult<Option<u64>> {
        if attr.flags & SPARSE_FL == 0 || attr.file_type() != S_IFREG {
            return Ok(None);
        }
        let lo = schema::data_key(file_key, 0);
        let hi = schema::data_key(file_key, blocks_to(attr.size));
        let mut blocks = self.reserved_blocks_of(attr, file_key)?;
        self.store
            .visit_range(KeySpace::Data, &lo, &hi, &mut |_, _| blocks += 1)?;
        Ok(Some(blocks))
    }

    /// lseek(2) `SEEK_DATA` / `SEEK_HOLE` from the blocks stored: data is
    /// any stored block (a block written with zeros is data, as on ext4),
    /// a hole any block never written or punched out; the end of the file
    /// counts as a hole. `ENXIO` at or past the end, or when no data
    /// follows.
    pub(super) fn seek_in_blocks(&self, ino: Ino, offset: u64, whence: i32) -> FsResult<u64> {
        let st = self.lock();
        let attr = &st.node(ino)?.attr;
        if attr.is_dir() {
            return Err(Errno::EISDIR);
        }
        let size = attr.size;
        if offset >= size {
            return Err(Errno::ENXIO);
        }
        if attr.flags & (SPARSE_FL | PREALLOC_FL) == 0 {
            // Every block up to the size is stored: data everywhere, the
            // one hole at the end. GNU grep asks every file it reads for
            // its first hole, and scanning the file's blocks to answer
            // was a fifth of the daemon's time in grep -r of a source tree.
            return match whence {
                libc::SEEK_DATA => Ok(offset),
                libc::SEEK_HOLE => Ok(size),
                _ => Err(Errno::EINVAL),
            };
        }
        let key = st.file_key(ino)?;
        let first = offset / BLOCK_SIZE;
        let lo = schema::data_key(&key, first);
        let hi = schema::data_key(&key, size.div_ceil(BLOCK_SIZE));
        let mut blocks = self.store.range(KeySpace::Data, &lo, Some(&hi));
        match whence {
            libc::SEEK_DATA => {
                for item in blocks {
                    let (k, _) = item?;
                    if let Some(block) = schema::data_block(&key, &k) {
                        return Ok((block * BLOCK_SIZE).max(offset));
                    }
                }
                Err(Errno::ENXIO)
            }
            libc::SEEK_HOLE => {
                // The first block at or after `first` that is not stored.
                let mut next = first;
                for item in blocks.by_ref() {
                    let (k, _) = item?;
                    match schema::data_block(&key, &k) {
                        Some(block) if block == next => next += 1,
                        _ => break,
                    }
                }
                Ok((next * BLOCK_SIZE).clamp(offset, size))
            }
            _ => Err(Errno::EINVAL),
        }
    }
}

/// Makes [`start`, `end`) of a file read as zeros: whole blocks are range
/// deleted (holes), the partial blocks at either edge patched with zeros.
/// Returns the blocks patched (they store data afterwards), as runs.
fn zero_blocks(batch: &mut WriteBatch, file: &[u8], start: u64, end: u64) -> Vec<(u64, u64)> {
    let mut patched = Vec::new();
    if start >= end {
        return patched;
    }
    let (first_whole, end_whole) = (start.div_ceil(BLOCK_SIZE), end / BLOCK_SIZE);
    if first_whole < end_whole {
        batch.range_delete(
            KeySpace::Data,
            &schema::data_key(file, first_whole),
            &schema::data_key(file, end_whole),
        );
    }
    let mut patch = |block: u64, from: u64, to: u64| {
        let zeros = vec![0u8; (to - from) as usize];
        batch.upsert(
            KeySpace::Data,
            &schema::data_key(file, block),
            MERGE_PATCH,
            &patch_arg(from, &zeros),
        );
        patched.push((block, block + 1));
    };
    let (head, tail) = (start / BLOCK_SIZE, end / BLOCK_SIZE);
    if !start.is_multiple_of(BLOCK_SIZE) {
        let to = if head == tail {
            end % BLOCK_SIZE
        } else {
            BLOCK_SIZE
        };
        patch(head, start % BLOCK_SIZE, to);
    }
    if !end.is_multiple_of(BLOCK_SIZE) && (tail != head || start.is_multiple_of(BLOCK_SIZE)) {
        patch(tail, 0, end % BLOCK_SIZE);
    }
    patched
}

/// What a read covers, as the inode table says when it begins.
struct ReadSpan {
    /// The bytes it returns (fewer than asked at the end of the file).
    len: usize,
    /// The file's key and where its bytes end, unless it returns none.
    blocks: Option<(Vec<u8>, u64)>,
}

impl ReadSpan {
    /// The span of a read of `want` bytes of `ino` at `offset`.
    fn of(st: &State, ino: Ino, offset: u64, want: usize) -> FsResult<ReadSpan> {
        let node = st.node(ino)?;
        if node.attr.is_dir() {
            return Err(Errno::EISDIR);
        }
        let end = node.attr.size.min(offset.saturating_add(want as u64));
        let len = end.saturating_sub(offset) as usize;
        let blocks = if offset < end {
            Some((st.file_key(ino)?, end))
        } else {
            None
        };
        Ok(ReadSpan { len, blocks })
    }
}

/// Puts the first [`BLOCKS_PER_BATCH`] blocks' worth of `data`, written
/// at `pos` into the file of key `file_key` (whose size is `old_size`),
/// into `batch`: whole blocks, and the start of a block nothing is stored
/// in, as puts; the rest as patches of what the block holds. Returns the
/// bytes put.
fn put_data_blocks(
    batch: &mut WriteBatch,
    file_key: &[u8],
    data: &[u8],
    pos: u64,
    old_size: u64,
) -> usize {
    let (mut written, mut pos) = (0usize, pos);
    for _ in 0..BLOCKS_PER_BATCH {
        if written == data.len() {
            break;
        }
        let block = pos / BLOCK_SIZE;
        let in_block = (pos % BLOCK_SIZE) as usize;
        let n = (BLOCK_SIZE as usize - in_block).min(data.len() - written);
        let bytes = data.get(written..written + n).unwrap_or_default();
        let dkey = schema::data_key(file_key, block);
        if in_block == 0 && (n == BLOCK_SIZE as usize || block * BLOCK_SIZE >= old_size) {
            batch.put(KeySpace::Data, &dkey, bytes);
        } else {
            batch.upsert(
                KeySpace::Data,
                &dkey,
                MERGE_PATCH,
                &patch_arg(in_block as u64, bytes),
            );
        }
        written += n;
        pos += n as u64;
    }
    written
}

/// The room a write's batch of data blocks starts with: the data it will
/// carry (`left` bytes still to write, at most [`BLOCKS_PER_BATCH`]
/// blocks), each block's key (`file_key_len` and the block number) and
/// encoding, and the inode record (under the file's key) with room for
/// the rest.
fn data_batch_bytes(left: usize, file_key_len: usize) -> usize {
    let most = BLOCKS_PER_BATCH * BLOCK_SIZE as usize;
    // A write that starts inside a block reaches one more.
    let blocks = (left.div_ceil(BLOCK_SIZE as usize) + 1).min(BLOCKS_PER_BATCH);
    const PER_BLOCK: usize = 8 + 24; // the block number, tags and lengths
    left.min(most) + (blocks + 1) * (file_key_len + PER_BLOCK) + 512
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write's batch of data blocks fits the room it starts with (no
    /// reallocation copies its data again), whole blocks or a write that
    /// starts inside one, for short and long file keys.
    #[test]
    fn a_data_batch_fits_the_room_it_starts_with() {
        let block = BLOCK_SIZE as usize;
        for key_len in [8, 100, 4096] {
            let file_key = vec![b'k'; key_len];
            for (in_block, len) in [
                (0, 1),
                (0, block),
                (100, 3 * block),
                (0, 64 * block),
                (17, 64 * block + 5),
            ] {
                let room = data_batch_bytes(len, file_key.len());
                // Patches of stored blocks (the file's size past the
                // write) and puts into blocks nothing is stored in.
                for old_size in [u64::MAX, 0] {
                    let mut batch = WriteBatch::with_capacity(room);
                    let data = vec![7; len];
                    put_data_blocks(&mut batch, &file_key, &data, in_block as u64, old_size);
                    // The inode record, as write_data adds.
                    batch.put(KeySpace::Meta, &file_key, &[0; 160]);
                    assert!(
                        batch.body_len() <= room,
                        "key {key_len}, start {in_block}, {len} bytes, size {old_size}: {} bytes in a batch given room for {room}",
                        batch.body_len()
                    );
                }
            }
        }
    }
}
