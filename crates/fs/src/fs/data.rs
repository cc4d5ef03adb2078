//! File data: open and release, read, write (a put per whole block, an
//! upsert per partial block: never a read) and fallocate.

use betreefs_engine::merge::patch_arg;
use betreefs_engine::{KeySpace, WriteBatch, MERGE_PATCH};

use super::state::{Home, OpenFile, State};
use super::{Caller, FileSystem, Ino, SetAttr, BLOCKS_PER_BATCH, BLOCK_SIZE, FILE_SIZE_MAX};
use crate::error::{Errno, FsResult};
use crate::ops::Operations;
use crate::plan::{count_update, purge_file};
use crate::record::{Timespec, S_IFREG};
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
        if node.attr.is_dir() && flags & libc::O_ACCMODE != libc::O_RDONLY {
            return Err(Errno::EISDIR);
        }
        // POSIX marks mtime and ctime for update on O_TRUNC of an existing
        // file even when it is empty already (Linux does too).
        if flags & libc::O_TRUNC != 0 && node.attr.file_type() == S_IFREG {
            drop(st);
            self.setattr(
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

    /// The last close of an unlinked file frees it.
    pub(super) fn release_file(&self, fh: u64) -> FsResult<()> {
        let mut st = self.lock();
        let Some(OpenFile { ino, .. }) = st.handles.remove(&fh) else {
            return Err(Errno::EBADF);
        };
        let node = st.node_mut(ino)?;
        node.opens = node.opens.saturating_sub(1);
        if node.opens == 0 && node.attr.nlink == 0 && node.home == Home::Inode {
            let mut batch = WriteBatch::new();
            purge_file(&mut batch, &schema::inode_key(ino));
            batch.delete(KeySpace::Meta, &schema::orphan_key(ino));
            count_update(&mut batch, -1);
            self.store.write(&batch)?;
            st.node_mut(ino)?.home = Home::Gone;
        }
        st.drop_if_unused(ino);
        Ok(())
    }

    pub(super) fn read_data(&self, ino: Ino, offset: u64, out: &mut [u8]) -> FsResult<usize> {
        let mut st = self.lock();
        let node = st.node(ino)?;
        if node.attr.is_dir() {
            return Err(Errno::EISDIR);
        }
        let file_size = node.attr.size;
        let end = file_size.min(offset.saturating_add(out.len() as u64));
        let len = end.saturating_sub(offset) as usize;
        if offset < end {
            let key = st.file_key(ino)?;
            let (first, last) = (offset / BLOCK_SIZE, (end - 1) / BLOCK_SIZE);
            let lo = schema::data_key(&key, first);
            let hi = schema::data_key(&key, last + 1);
            // Blocks are copied straight from the leaves into the reply;
            // what lies between them (holes) is zeroed as it is passed.
            let mut filled = 0usize;
            self.store
                .visit_range(KeySpace::Data, &lo, &hi, &mut |k, v| {
                    let Some(block) = schema::data_block(&key, k) else {
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
        }
        self.note_access(&mut st, ino)?;
        Ok(len)
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
        let mut st = self.lock();
        let append = matches!(st.handles.get(&fh), Some(OpenFile { append: true, .. }))
            && !self
                .kernel_places_appends
                .load(std::sync::atomic::Ordering::Relaxed);
        let node = st.node(ino)?;
        if node.attr.file_type() != S_IFREG {
            return Err(Errno::EINVAL);
        }
        let offset = if append { node.attr.size } else { offset };
        if offset.saturating_add(data.len() as u64) > FILE_SIZE_MAX {
            return Err(Errno::EFBIG);
        }
        let key = st.file_key(ino)?;
        let mut written = 0usize;
        while written < data.len() {
            let old_size = st.node(ino)?.attr.size;
            let mut batch = WriteBatch::new();
            let chunk_start = written;
            let mut pos = offset + written as u64;
            let mut blocks = 0;
            while written < data.len() && blocks < BLOCKS_PER_BATCH {
                let block = pos / BLOCK_SIZE;
                let in_block = (pos % BLOCK_SIZE) as usize;
                let n = (BLOCK_SIZE as usize - in_block).min(data.len() - written);
                let bytes = data.get(written..written + n).unwrap_or_default();
                let dkey = schema::data_key(&key, block);
                let block_start = block * BLOCK_SIZE;
                if in_block == 0 && (n == BLOCK_SIZE as usize || block_start >= old_size) {
                    // A whole block, or the start of a block nothing is stored in.
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
                blocks += 1;
            }
            let now = Timespec::now();
            let before = st.node(ino)?.attr.clone();
            if let (0, Some(caller)) = (chunk_start, kill) {
                self.drop_privileges(&mut st, &mut batch, ino, &key, caller)?;
            }
            let node = st.node_mut(ino)?;
            node.attr.size = node.attr.size.max(pos);
            node.attr.mtime = now;
            node.attr.ctime = now;
            st.put_record_at(&mut batch, &key, ino)?;
            if let Err(e) = self.store.write(&batch) {
                st.node_mut(ino)?.attr = before;
                if chunk_start > 0 && e.is_no_space() {
                    return Ok(chunk_start as u32);
                }
                return Err(e.into());
            }
        }
        Ok(written as u32)
    }

    /// fallocate mode 0: extends the size; blocks are not written ahead
    /// (a B^ε-tree has no extents to reserve), so only free space is checked.
    pub(super) fn allocate(
        &self,
        ino: Ino,
        offset: u64,
        length: u64,
        mode: i32,
        kill: Option<Caller>,
    ) -> FsResult<()> {
        if mode != 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        if length == 0 {
            return Err(Errno::EINVAL);
        }
        let end = offset.checked_add(length).ok_or(Errno::EFBIG)?;
        if end > FILE_SIZE_MAX {
            return Err(Errno::EFBIG);
        }
        let size = self.getattr(ino)?.size;
        if end > size && self.statfs().blocks_free * BLOCK_SIZE < end - size {
            return Err(Errno::ENOSPC);
        }
        // Like a write: times are marked (Linux's file_modified) and set-ID
        // bits dropped even when the size stays.
        let mut st = self.lock();
        let now = Timespec::now();
        let key = st.file_key(ino)?;
        let before = st.node(ino)?.attr.clone();
        let mut batch = WriteBatch::new();
        if let Some(caller) = kill {
            self.drop_privileges(&mut st, &mut batch, ino, &key, caller)?;
        }
        let node = st.node_mut(ino)?;
        node.attr.size = node.attr.size.max(end);
        node.attr.ctime = now;
        node.attr.mtime = now;
        st.put_record_at(&mut batch, &key, ino)?;
        if let Err(e) = self.store.write(&batch) {
            st.node_mut(ino)?.attr = before;
            return Err(e.into());
        }
        Ok(())
    }
}
