//! POSIX operations over the engine: every metadata change and data write
//! is a batch of messages (BetrFS 0.4 §3, docs/design.md).
//!
//! Inode numbers are stored in the records and stay the same across rename
//! and remount. The kernel names files by inode number, so the file system
//! keeps a table of the inodes the kernel holds (from lookup until forget),
//! each with its parent and name: a path is found by walking up, so a
//! directory rename changes one table entry, never its descendants'.
//!
//! How operations map to messages:
//! - create, mkdir, mknod, symlink: one put of the record, a put of the
//!   parent's record (times, link count) and an upsert of the inode count;
//!   no query when an earlier lookup already found the name absent;
//! - write: a put per whole block, an upsert (`MERGE_PATCH`) per partial
//!   block — never a read — and a put of the file's record;
//! - truncate: a range delete of the blocks past the end, an upsert
//!   (`MERGE_TRUNCATE`) of the last partial block;
//! - unlink: a delete and a range delete of the file's data and xattrs;
//!   rmdir: a delete and range deletes over the directory's whole subtree;
//! - rename: range renames of the file's or directory's ranges in both
//!   key spaces (copied inside the engine for now; tree surgery is later);
//! - hard link: the file moves to its inode key (one range rename), each
//!   name then holds a small link record (the 0.2 "zone" idea, used only
//!   for files with several names);
//! - fallocate: keys for the preallocated extents and an upsert of the
//!   count of reserved blocks, the store told how much space to hold back
//!   ([`reservations`]).
//!
//! Where things are: [`state`] holds the inode table; [`names`] finds,
//! makes, removes, links and renames entries; [`attrs`] is setattr and
//! access times; [`data`] open files, reads and writes;
//! [`reservations`] preallocated blocks; [`listing`]
//! readdir; [`xattr`] extended attributes. This module has the types the
//! front end sees and the [`Operations`] implementation, which calls into
//! the others.

mod attrs;
mod data;
pub(crate) mod key_bound;
mod listing;
mod locking;
mod names;
mod planned;
mod reservations;
mod state;
mod tree_clone;
mod xattr;

use betreefs_engine::{KeySpace, Store, WriteBatch};
use parking_lot::{Condvar, Mutex};

use crate::error::{Errno, FsResult};
use crate::ops::Operations;
pub use crate::ops::{Caller, DirEntry, FsStats, Ino, RenameFlags, SetAttr, SetTime};
use crate::plan::{count_update, inode_record, purge_file, RESERVED_SLOT};
use crate::record::{
    Attr, FsInfo, KeyBound, Record, Timespec, FS_VERSION, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG,
};
use crate::schema::{self, NameError};
pub use attrs::{mode_without_privileges, CAPABILITY_XATTR};
use betreefs_engine::merge::record_slot;
pub use listing::dir_cookie;
use reservations::RESERVED_BLOCK_BYTES;
use state::{Home, Node, State, TableMemory};
pub use xattr::XATTR_ACL_KILL_SGID;

pub const ROOT_INO: Ino = 1;
/// File data is stored in blocks of this size, one key each.
pub const BLOCK_SIZE: u64 = 4096;
/// Longest extended attribute value (as Linux's XATTR_SIZE_MAX).
pub const XATTR_SIZE_MAX: usize = 65536;
/// Longest symlink target.
pub const SYMLINK_MAX: usize = schema::PATH_MAX - 1;
/// The blocks a file of `size` bytes spans (every one stored unless the
/// file may have holes).
pub(crate) fn blocks_to(size: u64) -> u64 {
    size.div_ceil(BLOCK_SIZE)
}
/// Largest file (the block number must fit a u64 key; keep well inside).
pub const FILE_SIZE_MAX: u64 = 1 << 50;
/// Longest entry key a path may have: room is left for the data or
/// xattr suffix within the engine's key limit.
const ENTRY_KEY_MAX: usize = betreefs_engine::MAX_KEY_BYTES - 300;
/// Inode numbers are reserved in the identity record this many at a time.
pub(crate) const INO_BATCH: u64 = 4096;
/// Data blocks per write batch: bounds a log record (small images have a
/// 1 MiB log).
const BLOCKS_PER_BATCH: usize = 64;
/// Names remembered as absent (cleared when full).
const NEGATIVE_CACHE_MAX: usize = 1 << 16;
/// A relatime update happens at least this often.
const RELATIME_SECS: i64 = 24 * 3600;

/// When reads update access times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtimePolicy {
    /// Only when atime is older than mtime or ctime, or a day old (default).
    Relatime,
    /// Never.
    Noatime,
    /// On every read.
    Strictatime,
}

/// A mounted betreefs: the engine plus the inode table.
pub struct FileSystem {
    store: Store,
    /// The inode table ([`locking`] says who holds it when).
    state: Mutex<State>,
    /// The write order: held by an operation that writes, from its plan
    /// to its table update.
    writes: Mutex<()>,
    /// Told when a write in flight is in (`State::write_in_flight`).
    settled: Condvar,
    atime: AtimePolicy,
    /// The kernel caches writes and places O_APPEND writes itself (FUSE
    /// writeback cache): offsets of writes are then final.
    kernel_places_appends: std::sync::atomic::AtomicBool,
    /// The inode table's share of the memory budget, past which the
    /// kernel is asked to drop entries ([`Operations::entries_to_release`];
    /// 0: no limit).
    table_limit: std::sync::atomic::AtomicUsize,
}

fn name_check(name: &[u8]) -> FsResult<()> {
    match schema::check_name(name) {
        Ok(()) => Ok(()),
        Err(NameError::TooLong(_)) => Err(Errno::ENAMETOOLONG),
        Err(NameError::Empty) => Err(Errno::ENOENT),
        Err(NameError::Invalid) => Err(Errno::EINVAL),
    }
}

fn decode(value: &[u8]) -> FsResult<Record> {
    Record::decode(value).map_err(|e| {
        tracing::error!("corrupt record: {}", e.0);
        Errno::EIO
    })
}

impl FileSystem {
    /// Writes a new, empty file system into a freshly created store.
    pub fn format(store: &Store, caller: Caller) -> FsResult<()> {
        let now = Timespec::now();
        let info = FsInfo {
            ino_reserved: ROOT_INO + 1 + INO_BATCH,
            created: now.sec,
        };
        let root = Attr::new(ROOT_INO, S_IFDIR | 0o755, caller.uid, caller.gid, now);
        let mut batch = WriteBatch::new();
        batch
            .put(KeySpace::Meta, schema::INFO_KEY, &info.encode())
            .put(KeySpace::Meta, schema::ROOT_KEY, &inode_record(&root, &[]))
            .put(KeySpace::Meta, schema::COUNTS_KEY, &1u64.to_le_bytes());
        key_bound::put_key_bound(&mut batch, key_bound::KEY_BOUND_MIN);
        store.write(&batch)?;
        store.sync()?;
        Ok(())
    }

    /// Opens the file system in `store`: checks its identity, and removes
    /// files a crash left unlinked but open.
    pub fn mount(store: Store, atime: AtimePolicy) -> Result<FileSystem, String> {
        let (info, older_format) = match store.get(KeySpace::Meta, schema::INFO_KEY) {
            Ok(Some(v)) => {
                let (info, version) = FsInfo::decode_versioned(&v).map_err(|e| e.0)?;
                (info, version < FS_VERSION)
            }
            Ok(None) => return Err("not a betreefs file system (no identity record)".into()),
            Err(e) => return Err(format!("reading the identity record: {e}")),
        };
        let reserved_blocks = match store.get(KeySpace::Meta, schema::COUNTS_KEY) {
            Ok(v) => v.map_or(0, |v| record_slot(&v, RESERVED_SLOT)),
            Err(e) => return Err(format!("reading the counts record: {e}")),
        };
        store.set_promised_bytes(reserved_blocks.saturating_mul(RESERVED_BLOCK_BYTES));
        let root = match store.get(KeySpace::Meta, schema::ROOT_KEY) {
            Ok(Some(v)) => match Record::decode(&v) {
                Ok(Record::Inode { attr, .. }) if attr.is_dir() => attr,
                _ => return Err("the root directory's record is corrupt".into()),
            },
            Ok(None) => return Err("the root directory's record is missing".into()),
            Err(e) => return Err(format!("reading the root directory: {e}")),
        };
        let mut key_bound = match store.get(KeySpace::Meta, schema::KEY_BOUND_KEY) {
            Ok(Some(v)) => Some(
                KeyBound::decode(&v)
                    .map_err(|e| format!("{} (betreefs fsck --repair writes it again)", e.0))?
                    .0,
            ),
            Ok(None) => None,
            Err(e) => return Err(format!("reading the key bound: {e}")),
        };
        let memory = TableMemory::new(store.memory_beside_cache());
        let fs = FileSystem {
            store,
            state: Mutex::new(State::new(memory, info.ino_reserved, info.created)),
            writes: Mutex::new(()),
            settled: Condvar::new(),
            atime,
            kernel_places_appends: std::sync::atomic::AtomicBool::new(false),
            table_limit: std::sync::atomic::AtomicUsize::new(0),
        };
        fs.lock().insert_node(
            ROOT_INO,
            Box::new(Node::new(
                ROOT_INO,
                Vec::new(),
                root,
                Vec::new(),
                Home::Path,
            )),
        );
        // Read-only, orphans stay until a read-write mount removes them,
        // and the format is not upgraded (nor the key bound found: renames
        // walk the keys they lengthen, as before format 4).
        if !fs.store.is_read_only() {
            if older_format || key_bound.is_none() {
                if !older_format {
                    tracing::warn!("the key bound record is missing: finding it again");
                }
                // Format 4's key bound, from every metadata key.
                let bound = fs
                    .longest_meta_key()
                    .map_err(|e| format!("finding the longest key: {e}"))
                    .map(key_bound::rounded)?;
                let mut batch = WriteBatch::new();
                batch.put(KeySpace::Meta, schema::INFO_KEY, &info.encode());
                key_bound::put_key_bound(&mut batch, bound);
                fs.store
                    .write(&batch)
                    .map_err(|e| format!("upgrading the identity record: {e}"))?;
                key_bound = Some(bound);
                if older_format {
                    tracing::info!("file-system format upgraded to version {FS_VERSION}");
                }
            }
            fs.purge_orphans()
                .map_err(|e| format!("removing orphaned files: {e}"))?;
        }
        if let Some(bound) = key_bound {
            fs.lock().key_bound = key_bound::Bound::stored_as(bound);
        }
        Ok(fs)
    }

    fn purge_orphans(&self) -> FsResult<()> {
        let (lo, hi) = schema::orphan_range();
        let orphans: Vec<Vec<u8>> = self
            .store
            .range(KeySpace::Meta, &lo, Some(&hi))
            .map(|r| r.map(|(k, _)| k))
            .collect::<Result<_, _>>()?;
        for key in orphans {
            let Some(ino) = schema::orphan_ino(&key) else {
                continue;
            };
            let mut batch = WriteBatch::new();
            let file = schema::inode_key(ino);
            let released = self.release_all_reservations(&mut batch, None, &file)?;
            purge_file(&mut batch, &file);
            batch.delete(KeySpace::Meta, &key);
            count_update(&mut batch, -1);
            self.store.write_reserving(&batch, released.reservation())?;
            tracing::info!("removed orphaned inode {ino}");
        }
        Ok(())
    }

    /// Sets the bytes the inode table may hold before the kernel is asked
    /// to drop entries ([`Operations::entries_to_release`]; 0: no limit,
    /// the default).
    pub fn set_table_limit(&self, bytes: usize) {
        self.table_limit
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many entries directory `ino` has, if the inode table knows
    /// without a query (it counts them from a directory's making or from
    /// a whole listing on): what rmdir answers from.
    pub fn entries_known(&self, ino: Ino) -> Option<u64> {
        self.lock_table().nodes.get(&ino).and_then(|n| n.entries)
    }

    /// The engine underneath (stats, checkpoints).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Final checkpoint.
    pub fn close(self) -> Result<(), betreefs_engine::EngineError> {
        self.store.close()
    }
}

impl Operations for FileSystem {
    fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        self.lookup_entry(parent, name)
    }

    fn lookup_by_number(&self, ino: Ino) -> FsResult<Attr> {
        FileSystem::lookup_by_number(self, ino)
    }

    fn lookup_parent(&self, ino: Ino) -> FsResult<Attr> {
        FileSystem::lookup_parent(self, ino)
    }

    /// One hold of the table for a whole batch (gathered forgets come
    /// dozens at a time: `FORGET_GATHERING` in the FUSE front end). The
    /// table alone: a node a request in flight names is one the kernel
    /// holds, never forgotten meanwhile.
    fn forget_many(&self, forgets: &[(Ino, u64)]) {
        let mut st = self.lock_table();
        for &(ino, count) in forgets {
            if let Some(node) = st.nodes.get_mut(&ino) {
                if count > node.lookups {
                    // The kernel and the table disagree on the count: the
                    // node goes while the kernel may still hold it.
                    tracing::warn!(
                        "FORGET of {count} references to inode {ino}, {} counted",
                        node.lookups
                    );
                }
                node.lookups = node.lookups.saturating_sub(count);
                st.drop_if_unused(ino);
            }
        }
    }

    fn entries_to_release(&self) -> Vec<(Ino, Vec<u8>)> {
        match self.table_limit.load(std::sync::atomic::Ordering::Relaxed) {
            0 => Vec::new(),
            limit => self.lock_table().entries_to_release(limit),
        }
    }

    fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        let st = self.lock_table();
        if let Some(attr) = Self::attr_in_table(&st, ino)? {
            return Ok(attr);
        }
        self.attr_for_kernel(&mut self.settle(st), ino)
    }

    fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Attr> {
        let kind = mode & S_IFMT;
        let mode = if kind == 0 { mode | S_IFREG } else { mode };
        if mode & S_IFMT == S_IFDIR || mode & S_IFMT == S_IFLNK {
            return Err(Errno::EINVAL);
        }
        self.make_node(&mut self.writer(), parent, name, mode, rdev, &[], caller)
    }

    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> FsResult<Attr> {
        let mode = S_IFDIR | (mode & 0o7777);
        self.make_node(&mut self.writer(), parent, name, mode, 0, &[], caller)
    }

    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], caller: Caller) -> FsResult<Attr> {
        if target.is_empty() {
            return Err(Errno::ENOENT);
        }
        if target.len() > SYMLINK_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        self.make_node(
            &mut self.writer(),
            parent,
            name,
            S_IFLNK | 0o777,
            0,
            target,
            caller,
        )
    }

    fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let st = self.lock_table();
        let node = st.node(ino)?;
        if node.attr.file_type() != S_IFLNK {
            return Err(Errno::EINVAL);
        }
        Ok(node.target.clone())
    }

    /// create(2) with O_CREAT: makes the file and opens it.
    fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> FsResult<(Attr, u64)> {
        let mut st = self.writer();
        let mode = S_IFREG | (mode & 0o7777);
        let attr = self.make_node(&mut st, parent, name, mode, 0, &[], caller)?;
        let fh = Self::add_file_handle(&mut st, attr.ino, flags)?;
        Ok((attr, fh))
    }

    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Attr> {
        self.link_entry(ino, new_parent, new_name)
    }

    fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        let mut st = self.writer();
        let found = self.find(&st, parent, name)?.ok_or(Errno::ENOENT)?;
        if found.is_dir() {
            return Err(Errno::EISDIR);
        }
        self.remove_and_commit(&mut st, parent, name, found)
    }

    fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        let mut st = self.writer();
        let found = self.find(&st, parent, name)?.ok_or(Errno::ENOENT)?;
        if !found.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        let dir = schema::child_dir_key(&found.dir, name);
        if !self.dir_is_empty_known(&st, found.ino(), &dir)? {
            return Err(Errno::ENOTEMPTY);
        }
        self.remove_and_commit(&mut st, parent, name, found)
    }

    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameFlags,
    ) -> FsResult<()> {
        self.rename_entry(parent, name, new_parent, new_name, flags)
    }

    fn setattr(&self, ino: Ino, set: &SetAttr) -> FsResult<Attr> {
        self.set_attributes(ino, set)?;
        self.getattr(ino)
    }

    fn open(&self, ino: Ino, flags: i32, kill: Option<Caller>) -> FsResult<u64> {
        self.open_file(ino, flags, kill)
    }

    fn release(&self, fh: u64) -> FsResult<()> {
        self.release_file(fh)
    }

    fn read(&self, ino: Ino, offset: u64, buf: &mut [u8]) -> FsResult<usize> {
        self.read_data(ino, offset, buf)
    }

    fn write(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        data: &[u8],
        kill: Option<Caller>,
    ) -> FsResult<u32> {
        self.write_data(ino, fh, offset, data, kill)
    }

    /// Makes everything written so far durable (one log for all files: an
    /// fsync of one file is an fsync of every earlier operation).
    fn fsync(&self) -> FsResult<()> {
        self.store.sync()?;
        Ok(())
    }

    fn fallocate(
        &self,
        ino: Ino,
        offset: u64,
        length: u64,
        mode: i32,
        kill: Option<Caller>,
    ) -> FsResult<()> {
        self.allocate(ino, offset, length, mode, kill)
    }

    fn inode_flags(&self, ino: Ino) -> FsResult<u32> {
        Ok(self.lock_table().node(ino)?.attr.flags & crate::record::INODE_FLAGS)
    }

    fn set_inode_flags(&self, ino: Ino, flags: u32) -> FsResult<()> {
        self.set_inode_flags_to(ino, flags)
    }

    fn tmpfile(&self, parent: Ino, mode: u32, flags: i32, caller: Caller) -> FsResult<(Attr, u64)> {
        self.make_tmpfile(parent, mode, flags, caller)
    }

    fn copy_range(
        &self,
        ino_in: Ino,
        off_in: u64,
        ino_out: Ino,
        fh_out: u64,
        off_out: u64,
        len: u64,
        kill: Option<Caller>,
    ) -> FsResult<u64> {
        self.copy_data(ino_in, off_in, ino_out, fh_out, off_out, len, kill)
    }

    fn clone_tree_into(&self, src: Ino, dst: Ino, caller: Caller) -> FsResult<Attr> {
        self.clone_tree_into(src, dst, caller)
    }

    fn seek_data_or_hole(&self, ino: Ino, offset: u64, whence: i32) -> FsResult<u64> {
        self.seek_in_blocks(ino, offset, whence)
    }

    fn readdir(
        &self,
        ino: Ino,
        offset: u64,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<()> {
        self.list_dir(ino, offset, plus, add)
    }

    fn statfs(&self) -> FsStats {
        let s = self.store.stats();
        let blocks = s.node_region_bytes / BLOCK_SIZE;
        // Space promised to preallocated blocks counts as used (df shows
        // it taken, as on ext4).
        let used = (s.node_region_used_bytes + s.promised_bytes).div_ceil(BLOCK_SIZE);
        let free = blocks.saturating_sub(used);
        let files = self
            .store
            .get(KeySpace::Meta, schema::COUNTS_KEY)
            .ok()
            .flatten()
            .map_or(0, |v| betreefs_engine::merge::record_slot(&v, 0));
        FsStats {
            block_size: BLOCK_SIZE,
            blocks,
            blocks_free: free,
            files: files + free,
            files_free: free,
            inodes: files,
            name_max: schema::NAME_MAX as u64,
        }
    }

    fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], flags: i32) -> FsResult<()> {
        self.set_xattr(ino, name, value, flags)
    }

    fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        self.get_xattr(ino, name)
    }

    fn listxattr(&self, ino: Ino) -> FsResult<Vec<u8>> {
        self.list_xattrs(ino)
    }

    fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        self.remove_xattr(ino, name)
    }

    /// Called when the kernel's writeback cache is on: it then computes
    /// O_APPEND offsets itself, and a write's offset is final.
    fn set_kernel_places_appends(&self, on: bool) {
        self.kernel_places_appends
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn serving_thread_started(&self, hands_long_work_on: bool) {
        self.store.work_after_replies_on_this_thread();
        if hands_long_work_on {
            self.store.hand_long_work_on_from_this_thread();
        }
    }

    fn has_work_after_reply(&self) -> bool {
        self.store.has_work_after_reply()
    }

    fn work_after_reply_is_long(&self) -> bool {
        self.store.work_after_reply_is_long()
    }

    fn work_after_reply(&self) {
        // A failure here is the store's: it refuses writes from now on and
        // the next sync reports it to the client.
        if let Err(e) = self.store.work_after_reply() {
            tracing::error!("applying writes after their replies: {e}");
        }
    }
}
