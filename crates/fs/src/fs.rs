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
//!   for files with several names).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};

use betreefs_engine::merge::patch_arg;
use betreefs_engine::{KeySpace, Store, WriteBatch, MERGE_PATCH};

use crate::error::{Errno, FsResult};
use crate::ops::Operations;
use crate::plan::{
    count_update, dir_record_key, inode_record, move_file_data, move_subtree, purge_file,
    truncate_blocks,
};
use crate::record::{Attr, FsInfo, Record, Timespec, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG};
use crate::schema::{self, NameError};

pub type Ino = u64;
pub const ROOT_INO: Ino = 1;
/// File data is stored in blocks of this size, one key each.
pub const BLOCK_SIZE: u64 = 4096;
/// Longest extended attribute value (as Linux's XATTR_SIZE_MAX).
pub const XATTR_SIZE_MAX: usize = 65536;
/// Longest symlink target.
pub const SYMLINK_MAX: usize = schema::PATH_MAX - 1;
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

/// Who is asking (for ownership of new files).
#[derive(Clone, Copy, Debug)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// A time to set: now, or a given one.
#[derive(Clone, Copy, Debug)]
pub enum SetTime {
    Now,
    At(Timespec),
}

/// A setattr request; `None` leaves a field alone.
#[derive(Clone, Debug, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SetTime>,
    pub mtime: Option<SetTime>,
    pub ctime: Option<Timespec>,
    /// The request comes through an open file (ftruncate, open with
    /// O_TRUNC): a truncation marks the times even when the size stays.
    pub through_open_file: bool,
}

/// rename(2) flags.
#[derive(Clone, Copy, Debug, Default)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
}

/// One directory entry handed to a readdir callback.
pub struct DirEntry<'a> {
    pub ino: Ino,
    /// The offset to continue after this entry.
    pub offset: u64,
    /// `st_mode & S_IFMT`.
    pub file_type: u32,
    pub name: &'a [u8],
    /// Attributes (readdirplus only; `None` for "." and "..").
    pub attr: Option<&'a Attr>,
}

/// File-system figures for statfs.
#[derive(Clone, Copy, Debug)]
pub struct FsStats {
    pub block_size: u64,
    pub blocks: u64,
    pub blocks_free: u64,
    pub files: u64,
    pub files_free: u64,
    /// Inodes in use (files, directories, symlinks, special files).
    pub inodes: u64,
    pub name_max: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Home {
    /// Attributes at the entry key of (parent, name) (or the root key).
    Path,
    /// Attributes and data under the inode key.
    Inode,
    /// Removed; nothing stored.
    Gone,
}

struct Node {
    parent: Ino,
    name: Vec<u8>,
    attr: Attr,
    target: Vec<u8>,
    home: Home,
    /// Kernel references (lookup replies not yet forgotten).
    lookups: u64,
    opens: u32,
    /// Table entries whose parent this is (they need this one for paths).
    children: u32,
    /// Bumped on every change of a directory's entries.
    dir_version: u64,
    /// Whether the file has extended attributes, once known.
    has_xattrs: Option<bool>,
}

struct DirHandle {
    ino: Ino,
    /// Escaped names returned so far, in order: offset `i + 3` resumes
    /// after `returned[i]` (1 and 2 are "." and "..").
    returned: Vec<Vec<u8>>,
    /// Entries scanned but not yet returned (key, value), valid while the
    /// directory's version is `version`.
    pending: VecDeque<(Vec<u8>, Vec<u8>)>,
    /// Where the scan continues after `pending` (None: the end).
    scan_from: Option<Vec<u8>>,
    version: u64,
    /// The directory's key when `pending` was scanned (a rename of the
    /// directory itself moves its entries to another prefix).
    dir_key: Vec<u8>,
}

enum Handle {
    File { ino: Ino, append: bool },
    Dir(Box<DirHandle>),
}

struct State {
    nodes: HashMap<Ino, Node>,
    /// (parent, name) pairs a lookup found absent and nothing created since.
    absent: HashSet<(Ino, Vec<u8>)>,
    handles: HashMap<u64, Handle>,
    next_handle: u64,
    next_ino: Ino,
    ino_reserved: Ino,
    created: i64,
}

/// A mounted betreefs: the engine plus the inode table.
pub struct FileSystem {
    store: Store,
    state: Mutex<State>,
    atime: AtimePolicy,
    /// The kernel caches writes and places O_APPEND writes itself (FUSE
    /// writeback cache): offsets of writes are then final.
    kernel_places_appends: std::sync::atomic::AtomicBool,
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

impl State {
    fn node(&self, ino: Ino) -> FsResult<&Node> {
        self.nodes.get(&ino).ok_or(Errno::ESTALE)
    }

    fn node_mut(&mut self, ino: Ino) -> FsResult<&mut Node> {
        self.nodes.get_mut(&ino).ok_or(Errno::ESTALE)
    }

    /// The encoded path of a directory.
    fn dir_key(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let mut names: Vec<&[u8]> = Vec::new();
        let mut cur = ino;
        while cur != ROOT_INO {
            let node = self.node(cur)?;
            if node.home != Home::Path || !node.attr.is_dir() {
                return Err(if node.home == Home::Gone {
                    Errno::ENOENT
                } else {
                    Errno::ENOTDIR
                });
            }
            names.push(&node.name);
            cur = node.parent;
            if names.len() > schema::PATH_MAX {
                tracing::error!("inode table has a parent cycle at {ino}");
                return Err(Errno::EIO);
            }
        }
        Ok(schema::dir_key(names.into_iter().rev()))
    }

    /// Where a file's record lives and the prefix of its data.
    fn file_key(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let node = self.node(ino)?;
        match node.home {
            Home::Inode => Ok(schema::inode_key(ino)),
            Home::Gone => Err(Errno::ENOENT),
            Home::Path if ino == ROOT_INO => Ok(schema::ROOT_KEY.to_vec()),
            Home::Path => Ok(schema::entry_key(&self.dir_key(node.parent)?, &node.name)),
        }
    }

    /// Whether `ino` is `ancestor` or lies below it.
    fn is_within(&self, mut ino: Ino, ancestor: Ino) -> bool {
        for _ in 0..=schema::PATH_MAX {
            if ino == ancestor {
                return true;
            }
            if ino == ROOT_INO {
                return false;
            }
            match self.nodes.get(&ino) {
                Some(n) => ino = n.parent,
                None => return false,
            }
        }
        false
    }

    fn allocate_ino(&mut self, batch: &mut WriteBatch) -> Ino {
        let ino = self.next_ino;
        self.next_ino += 1;
        if self.next_ino > self.ino_reserved {
            self.ino_reserved = self.next_ino + INO_BATCH;
            let info = FsInfo {
                ino_reserved: self.ino_reserved,
                created: self.created,
            };
            batch.put(KeySpace::Meta, schema::INFO_KEY, &info.encode());
        }
        ino
    }

    fn forget_absent(&mut self, parent: Ino, name: &[u8]) {
        self.absent.remove(&(parent, name.to_vec()));
    }

    fn remember_absent(&mut self, parent: Ino, name: &[u8]) {
        if self.absent.len() >= NEGATIVE_CACHE_MAX {
            self.absent.clear();
        }
        self.absent.insert((parent, name.to_vec()));
    }

    /// Records a kernel reference to `ino`, known as `name` in `parent`.
    fn add_lookup(&mut self, parent: Ino, name: &[u8], attr: Attr, target: Vec<u8>, home: Home) {
        let ino = attr.ino;
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.lookups += 1;
            if home == Home::Path || node.parent == parent {
                let old_parent = node.parent;
                node.parent = parent;
                node.name = name.to_vec();
                self.move_pin(old_parent, parent);
            }
            return;
        }
        self.nodes.insert(
            ino,
            Node {
                parent,
                name: name.to_vec(),
                attr,
                target,
                home,
                lookups: 1,
                opens: 0,
                children: 0,
                dir_version: 0,
                has_xattrs: None,
            },
        );
        if let Some(p) = self.nodes.get_mut(&parent) {
            p.children += 1;
        }
    }

    fn move_pin(&mut self, from: Ino, to: Ino) {
        if from == to {
            return;
        }
        if let Some(p) = self.nodes.get_mut(&to) {
            p.children += 1;
        }
        if let Some(p) = self.nodes.get_mut(&from) {
            p.children = p.children.saturating_sub(1);
        }
        self.drop_if_unused(from);
    }

    /// Drops table entries nothing refers to any more (walking up).
    fn drop_if_unused(&mut self, mut ino: Ino) {
        while ino != ROOT_INO {
            let Some(node) = self.nodes.get(&ino) else {
                return;
            };
            if node.lookups > 0 || node.opens > 0 || node.children > 0 {
                return;
            }
            let parent = node.parent;
            self.nodes.remove(&ino);
            match self.nodes.get_mut(&parent) {
                Some(p) => p.children = p.children.saturating_sub(1),
                None => return,
            }
            ino = parent;
        }
    }

    fn touch_dir(&mut self, dir: Ino, now: Timespec, nlink_delta: i32) -> FsResult<()> {
        let node = self.node_mut(dir)?;
        node.attr.mtime = now;
        node.attr.ctime = now;
        node.attr.nlink = node.attr.nlink.saturating_add_signed(nlink_delta);
        node.dir_version += 1;
        Ok(())
    }

    /// The table's view of an inode whose last name went away: `home`
    /// says whether it still lives under its inode key (open) or is gone.
    fn mark_unlinked(&mut self, ino: Ino, home: Home, now: Timespec) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.home = home;
            n.attr.nlink = 0;
            n.attr.ctime = now;
            n.dir_version += 1;
        }
    }

    fn put_record(&self, batch: &mut WriteBatch, ino: Ino) -> FsResult<()> {
        self.put_record_at(batch, &self.file_key(ino)?, ino)
    }

    /// [`State::put_record`] when the caller already has the file key (a
    /// key is a walk up the path to build).
    fn put_record_at(&self, batch: &mut WriteBatch, key: &[u8], ino: Ino) -> FsResult<()> {
        let node = self.node(ino)?;
        batch.put(KeySpace::Meta, key, &inode_record(&node.attr, &node.target));
        Ok(())
    }
}

/// What an entry key resolved to.
struct Found {
    /// The directory key of the parent the entry was found in.
    dir: Vec<u8>,
    key: Vec<u8>,
    record: Record,
}

impl Found {
    fn ino(&self) -> Ino {
        self.record.ino()
    }
    fn is_dir(&self) -> bool {
        self.record.mode() & S_IFMT == S_IFDIR
    }
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
        store.write(&batch)?;
        store.sync()?;
        Ok(())
    }

    /// Opens the file system in `store`: checks its identity, and removes
    /// files a crash left unlinked but open.
    pub fn mount(store: Store, atime: AtimePolicy) -> Result<FileSystem, String> {
        let info = match store.get(KeySpace::Meta, schema::INFO_KEY) {
            Ok(Some(v)) => FsInfo::decode(&v).map_err(|e| e.0)?,
            Ok(None) => return Err("not a betreefs file system (no identity record)".into()),
            Err(e) => return Err(format!("reading the identity record: {e}")),
        };
        let root = match store.get(KeySpace::Meta, schema::ROOT_KEY) {
            Ok(Some(v)) => match Record::decode(&v) {
                Ok(Record::Inode { attr, .. }) if attr.is_dir() => attr,
                _ => return Err("the root directory's record is corrupt".into()),
            },
            Ok(None) => return Err("the root directory's record is missing".into()),
            Err(e) => return Err(format!("reading the root directory: {e}")),
        };
        let mut nodes = HashMap::new();
        nodes.insert(
            ROOT_INO,
            Node {
                parent: ROOT_INO,
                name: Vec::new(),
                attr: root,
                target: Vec::new(),
                home: Home::Path,
                lookups: 1,
                opens: 0,
                children: 0,
                dir_version: 0,
                has_xattrs: None,
            },
        );
        let fs = FileSystem {
            store,
            state: Mutex::new(State {
                nodes,
                absent: HashSet::new(),
                handles: HashMap::new(),
                next_handle: 1,
                next_ino: info.ino_reserved,
                ino_reserved: info.ino_reserved,
                created: info.created,
            }),
            atime,
            kernel_places_appends: std::sync::atomic::AtomicBool::new(false),
        };
        // Read-only, orphans stay until a read-write mount removes them.
        if !fs.store.is_read_only() {
            fs.purge_orphans()
                .map_err(|e| format!("removing orphaned files: {e}"))?;
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
            purge_file(&mut batch, &schema::inode_key(ino));
            batch.delete(KeySpace::Meta, &key);
            count_update(&mut batch, -1);
            self.store.write(&batch)?;
            tracing::info!("removed orphaned inode {ino}");
        }
        Ok(())
    }

    /// The engine underneath (stats, checkpoints).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Final checkpoint.
    pub fn close(self) -> Result<(), betreefs_engine::EngineError> {
        self.store.close()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The entry `name` of directory `parent`, if any.
    fn find(&self, st: &State, parent: Ino, name: &[u8]) -> FsResult<Option<Found>> {
        name_check(name)?;
        if st.absent.contains(&(parent, name.to_vec())) {
            return Ok(None);
        }
        self.find_in(st, parent, st.dir_key(parent)?, name)
    }

    /// [`FileSystem::find`] when the caller already has the parent's key.
    fn find_in(
        &self,
        st: &State,
        parent: Ino,
        dir: Vec<u8>,
        name: &[u8],
    ) -> FsResult<Option<Found>> {
        name_check(name)?;
        if st.absent.contains(&(parent, name.to_vec())) {
            return Ok(None);
        }
        let key = schema::entry_key(&dir, name);
        match self.store.get(KeySpace::Meta, &key)? {
            None => Ok(None),
            Some(v) => Ok(Some(Found {
                dir,
                key,
                record: decode(&v)?,
            })),
        }
    }

    /// The attributes behind a record (following a hard link).
    fn resolve(&self, st: &State, record: Record) -> FsResult<(Attr, Vec<u8>, Home)> {
        match record {
            Record::Inode { attr, target } => Ok((attr, target, Home::Path)),
            Record::Link { ino, .. } => {
                if let Some(n) = st.nodes.get(&ino) {
                    return Ok((n.attr.clone(), n.target.clone(), Home::Inode));
                }
                match self.store.get(KeySpace::Meta, &schema::inode_key(ino))? {
                    Some(v) => match decode(&v)? {
                        Record::Inode { attr, target } => Ok((attr, target, Home::Inode)),
                        Record::Link { .. } => Err(Errno::EIO),
                    },
                    None => {
                        tracing::error!("hard link to missing inode {ino}");
                        Err(Errno::EIO)
                    }
                }
            }
        }
    }

    // ---- names -----------------------------------------------------------

    /// Creates a new inode named `name` in `parent`.
    #[allow(clippy::too_many_arguments)]
    fn make_node(
        &self,
        st: &mut State,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u32,
        target: &[u8],
        caller: Caller,
    ) -> FsResult<Attr> {
        let dir = st.dir_key(parent)?;
        name_check(name)?;
        let key = schema::entry_key(&dir, name);
        if key.len() > ENTRY_KEY_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        let parent_key = dir_record_key(&dir);
        if self.find_in(st, parent, dir, name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        let parent_attr = &st.node(parent)?.attr;
        let is_dir = mode & S_IFMT == S_IFDIR;
        let mut mode = mode;
        // BSD group semantics under a setgid directory.
        let gid = if parent_attr.mode & libc::S_ISGID != 0 {
            if is_dir {
                mode |= libc::S_ISGID;
            }
            parent_attr.gid
        } else {
            caller.gid
        };
        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let ino = st.allocate_ino(&mut batch);
        let attr = Attr {
            rdev,
            size: target.len() as u64,
            ..Attr::new(ino, mode, caller.uid, gid, now)
        };
        batch.put(KeySpace::Meta, &key, &inode_record(&attr, target));
        st.touch_dir(parent, now, if is_dir { 1 } else { 0 })?;
        st.put_record_at(&mut batch, &parent_key, parent)?;
        count_update(&mut batch, 1);
        if let Err(e) = self.store.write(&batch) {
            st.touch_dir(parent, now, if is_dir { -1 } else { 0 })?;
            return Err(e.into());
        }
        st.forget_absent(parent, name);
        st.add_lookup(parent, name, attr.clone(), target.to_vec(), Home::Path);
        if let Some(n) = st.nodes.get_mut(&ino) {
            n.has_xattrs = Some(false);
        }
        Ok(attr)
    }

    /// Removes what an entry names, for unlink, rmdir and rename over it.
    /// `delete_entry` is false when the caller overwrites the entry key.
    /// `sub` is the directory key the entry would have as a directory.
    fn remove_entry(
        &self,
        st: &mut State,
        batch: &mut WriteBatch,
        found: &Found,
        sub: &[u8],
        now: Timespec,
        delete_entry: bool,
    ) -> FsResult<()> {
        let ino = found.ino();
        if delete_entry {
            batch.delete(KeySpace::Meta, &found.key);
        }
        if found.is_dir() {
            let (lo, hi) = schema::subtree_range(sub);
            for ks in KeySpace::ALL {
                batch.range_delete(ks, &lo, &hi);
            }
            let (lo, hi) = schema::file_range(&found.key);
            batch.range_delete(KeySpace::Data, &lo, &hi);
            count_update(batch, -1);
            st.mark_unlinked(ino, Home::Gone, now);
            return Ok(());
        }
        let open = st.nodes.get(&ino).is_some_and(|n| n.opens > 0);
        let inode_key = schema::inode_key(ino);
        match &found.record {
            Record::Inode { attr, target } => {
                if open {
                    // Keep the data readable until the last close.
                    move_file_data(batch, &found.key, &inode_key);
                    let mut attr = attr.clone();
                    attr.nlink = 0;
                    attr.ctime = now;
                    batch.put(KeySpace::Meta, &inode_key, &inode_record(&attr, target));
                    batch.put(KeySpace::Meta, &schema::orphan_key(ino), &[]);
                    st.mark_unlinked(ino, Home::Inode, now);
                } else {
                    let (lo, hi) = schema::file_range(&found.key);
                    batch.range_delete(KeySpace::Data, &lo, &hi);
                    count_update(batch, -1);
                    st.mark_unlinked(ino, Home::Gone, now);
                }
            }
            Record::Link { .. } => {
                let (mut attr, target, _) = self.resolve(st, found.record.clone())?;
                attr.nlink = attr.nlink.saturating_sub(1);
                attr.ctime = now;
                if attr.nlink > 0 {
                    batch.put(KeySpace::Meta, &inode_key, &inode_record(&attr, &target));
                } else if open {
                    batch.put(KeySpace::Meta, &inode_key, &inode_record(&attr, &target));
                    batch.put(KeySpace::Meta, &schema::orphan_key(ino), &[]);
                } else {
                    purge_file(batch, &inode_key);
                    count_update(batch, -1);
                }
                if let Some(n) = st.nodes.get_mut(&ino) {
                    n.attr = attr.clone();
                    if attr.nlink == 0 && !open {
                        n.home = Home::Gone;
                    }
                }
            }
        }
        Ok(())
    }

    fn remove_and_commit(
        &self,
        st: &mut State,
        parent: Ino,
        name: &[u8],
        found: Found,
    ) -> FsResult<()> {
        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let is_dir = found.is_dir();
        let saved = st.nodes.get(&found.ino()).map(|n| (n.home, n.attr.clone()));
        let sub = schema::child_dir_key(&found.dir, name);
        self.remove_entry(st, &mut batch, &found, &sub, now, true)?;
        st.touch_dir(parent, now, if is_dir { -1 } else { 0 })?;
        st.put_record_at(&mut batch, &dir_record_key(&found.dir), parent)?;
        if let Err(e) = self.store.write(&batch) {
            if let (Some((home, attr)), Some(n)) = (saved, st.nodes.get_mut(&found.ino())) {
                n.home = home;
                n.attr = attr;
            }
            st.touch_dir(parent, now, if is_dir { 1 } else { 0 })?;
            return Err(e.into());
        }
        st.remember_absent(parent, name);
        Ok(())
    }

    fn dir_is_empty(&self, dir: &[u8]) -> FsResult<bool> {
        let (lo, hi) = schema::children_range(dir);
        match self.store.range(KeySpace::Meta, &lo, Some(&hi)).next() {
            None => Ok(true),
            Some(Ok(_)) => Ok(false),
            Some(Err(e)) => Err(e.into()),
        }
    }

    /// The longest metadata key below a directory (for rename's key limit).
    fn longest_key_below(&self, dir: &[u8]) -> FsResult<usize> {
        let (lo, hi) = schema::subtree_range(dir);
        let mut longest = 0;
        for item in self.store.range(KeySpace::Meta, &lo, Some(&hi)) {
            longest = longest.max(item?.0.len());
        }
        Ok(longest)
    }

    fn rename_in_table(&self, st: &mut State, ino: Ino, new_parent: Ino, new_name: &[u8]) {
        let Some(n) = st.nodes.get_mut(&ino) else {
            return;
        };
        if n.home == Home::Inode {
            return;
        }
        let old_parent = n.parent;
        n.parent = new_parent;
        n.name = new_name.to_vec();
        st.move_pin(old_parent, new_parent);
    }

    // ---- attributes ------------------------------------------------------

    // ---- files -------------------------------------------------------------

    fn add_file_handle(st: &mut State, ino: Ino, flags: i32) -> FsResult<u64> {
        let node = st.node_mut(ino)?;
        node.opens += 1;
        let fh = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(
            fh,
            Handle::File {
                ino,
                append: flags & libc::O_APPEND != 0,
            },
        );
        Ok(fh)
    }

    fn note_access(&self, st: &mut State, ino: Ino) -> FsResult<()> {
        let now = Timespec::now();
        let a = &st.node(ino)?.attr;
        let due = match self.atime {
            AtimePolicy::Noatime => false,
            AtimePolicy::Strictatime => true,
            AtimePolicy::Relatime => {
                a.atime <= a.mtime || a.atime <= a.ctime || now.sec - a.atime.sec >= RELATIME_SECS
            }
        };
        if !due || st.node(ino)?.home == Home::Gone {
            return Ok(());
        }
        let before = st.node(ino)?.attr.atime;
        st.node_mut(ino)?.attr.atime = now;
        let mut batch = WriteBatch::new();
        st.put_record(&mut batch, ino)?;
        // An access time that cannot be stored (a full device) must not
        // fail the read that caused it.
        if let Err(e) = self.store.write(&batch) {
            tracing::debug!("access time of {ino} not updated: {e}");
            st.node_mut(ino)?.attr.atime = before;
        }
        Ok(())
    }

    // ---- directories ---------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    fn fill_dir(
        &self,
        st: &mut State,
        h: &mut DirHandle,
        dir: &[u8],
        ino: Ino,
        parent: Ino,
        version: u64,
        offset: u64,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<()> {
        debug_assert_eq!(h.ino, ino);
        if offset == 0
            && add(DirEntry {
                ino,
                offset: 1,
                file_type: S_IFDIR,
                name: b".",
                attr: None,
            })
        {
            return Ok(());
        }
        if offset <= 1
            && add(DirEntry {
                ino: parent,
                offset: 2,
                file_type: S_IFDIR,
                name: b"..",
                attr: None,
            })
        {
            return Ok(());
        }
        let index = offset.saturating_sub(2) as usize;
        if index > h.returned.len() {
            return Ok(()); // past the end (or an offset we never gave)
        }
        let continuing = index == h.returned.len() && h.version == version && h.dir_key == dir;
        if !continuing {
            h.returned.truncate(index);
            h.pending.clear();
            let (lo, _) = schema::children_range(dir);
            h.scan_from = Some(match h.returned.last() {
                None => lo,
                Some(esc) => [lo.as_slice(), esc, &[0]].concat(),
            });
            h.version = version;
            h.dir_key = dir.to_vec();
        }
        let (_, hi) = schema::children_range(dir);
        loop {
            if h.pending.is_empty() {
                let Some(from) = h.scan_from.take() else {
                    return Ok(());
                };
                // One leaf's worth at a time; the rest waits in the handle.
                let mut iter = self.store.range(KeySpace::Meta, &from, Some(&hi));
                let mut last = None;
                for item in iter.by_ref() {
                    let (k, v) = item?;
                    last = Some(k.clone());
                    h.pending.push_back((k, v));
                    if h.pending.len() >= 1024 {
                        break;
                    }
                }
                if h.pending.len() >= 1024 {
                    h.scan_from = last.map(|mut k| {
                        k.push(0);
                        k
                    });
                }
                if h.pending.is_empty() {
                    return Ok(());
                }
            }
            let Some((key, value)) = h.pending.front() else {
                continue;
            };
            let esc = key.get(dir.len() + 1..).unwrap_or_default().to_vec();
            let Some(name) = schema::child_name(dir, key) else {
                h.pending.pop_front();
                continue;
            };
            let record = decode(value)?;
            let next_offset = h.returned.len() as u64 + 3;
            let full = if plus {
                let (attr, target, home) = self.resolve(st, record)?;
                let attr = st.nodes.get(&attr.ino).map_or(attr, |n| n.attr.clone());
                let full = add(DirEntry {
                    ino: attr.ino,
                    offset: next_offset,
                    file_type: attr.file_type(),
                    name: &name,
                    attr: Some(&attr),
                });
                if !full {
                    st.add_lookup(ino, &name, attr, target, home);
                }
                full
            } else {
                add(DirEntry {
                    ino: record.ino(),
                    offset: next_offset,
                    file_type: record.mode() & S_IFMT,
                    name: &name,
                    attr: None,
                })
            };
            if full {
                return Ok(());
            }
            h.pending.pop_front();
            h.returned.push(esc);
        }
    }

    // ---- extended attributes ---------------------------------------------------

    // ---- the whole file system -------------------------------------------------
}

impl Operations for FileSystem {
    fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        let mut st = self.lock();
        let Some(found) = self.find(&st, parent, name)? else {
            st.remember_absent(parent, name);
            return Err(Errno::ENOENT);
        };
        let ino = found.ino();
        let (attr, target, home) = self.resolve(&st, found.record)?;
        st.add_lookup(parent, name, attr, target, home);
        Ok(st.node(ino)?.attr.clone())
    }

    fn forget(&self, ino: Ino, count: u64) {
        let mut st = self.lock();
        if let Some(node) = st.nodes.get_mut(&ino) {
            node.lookups = node.lookups.saturating_sub(count);
            st.drop_if_unused(ino);
        }
    }

    fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        Ok(self.lock().node(ino)?.attr.clone())
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
        self.make_node(&mut self.lock(), parent, name, mode, rdev, &[], caller)
    }

    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> FsResult<Attr> {
        let mode = S_IFDIR | (mode & 0o7777);
        self.make_node(&mut self.lock(), parent, name, mode, 0, &[], caller)
    }

    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], caller: Caller) -> FsResult<Attr> {
        if target.is_empty() {
            return Err(Errno::ENOENT);
        }
        if target.len() > SYMLINK_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        self.make_node(
            &mut self.lock(),
            parent,
            name,
            S_IFLNK | 0o777,
            0,
            target,
            caller,
        )
    }

    fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let st = self.lock();
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
        let mut st = self.lock();
        let mode = S_IFREG | (mode & 0o7777);
        let attr = self.make_node(&mut st, parent, name, mode, 0, &[], caller)?;
        let fh = Self::add_file_handle(&mut st, attr.ino, flags)?;
        Ok((attr, fh))
    }

    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Attr> {
        let mut st = self.lock();
        let node = st.node(ino)?;
        if node.attr.is_dir() {
            return Err(Errno::EPERM);
        }
        if node.attr.nlink >= u32::MAX - 1 {
            return Err(Errno::EMLINK);
        }
        let dir = st.dir_key(new_parent)?;
        name_check(new_name)?;
        let new_key = schema::entry_key(&dir, new_name);
        if new_key.len() > ENTRY_KEY_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        let parent_key = dir_record_key(&dir);
        if self.find_in(&st, new_parent, dir, new_name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let was_home = st.node(ino)?.home;
        let inode_key = schema::inode_key(ino);
        if was_home == Home::Path {
            // First extra name: the file moves under its inode number.
            let old_key = st.file_key(ino)?;
            move_file_data(&mut batch, &old_key, &inode_key);
            let mode = st.node(ino)?.attr.mode;
            batch.put(
                KeySpace::Meta,
                &old_key,
                &Record::Link { ino, mode }.encode(),
            );
        }
        let node = st.node_mut(ino)?;
        node.attr.nlink += 1;
        node.attr.ctime = now;
        node.home = Home::Inode;
        let mode = node.attr.mode;
        st.put_record_at(&mut batch, &inode_key, ino)?;
        batch.put(
            KeySpace::Meta,
            &new_key,
            &Record::Link { ino, mode }.encode(),
        );
        st.touch_dir(new_parent, now, 0)?;
        st.put_record_at(&mut batch, &parent_key, new_parent)?;
        if let Err(e) = self.store.write(&batch) {
            let node = st.node_mut(ino)?;
            node.attr.nlink -= 1;
            node.home = was_home;
            return Err(e.into());
        }
        st.forget_absent(new_parent, new_name);
        let node = st.node(ino)?;
        let (attr, target) = (node.attr.clone(), node.target.clone());
        st.add_lookup(new_parent, new_name, attr.clone(), target, Home::Inode);
        Ok(attr)
    }

    fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        let mut st = self.lock();
        let found = self.find(&st, parent, name)?.ok_or(Errno::ENOENT)?;
        if found.is_dir() {
            return Err(Errno::EISDIR);
        }
        self.remove_and_commit(&mut st, parent, name, found)
    }

    fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        let mut st = self.lock();
        let found = self.find(&st, parent, name)?.ok_or(Errno::ENOENT)?;
        if !found.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        if !self.dir_is_empty(&schema::child_dir_key(&found.dir, name))? {
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
        let mut st = self.lock();
        if flags.noreplace && flags.exchange {
            return Err(Errno::EINVAL);
        }
        let src = self.find(&st, parent, name)?.ok_or(Errno::ENOENT)?;
        name_check(new_name)?;
        let dst_dir = st.dir_key(new_parent)?;
        let src_dir = src.dir.clone();
        let dst_key = schema::entry_key(&dst_dir, new_name);
        if dst_key.len() > ENTRY_KEY_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        if dst_key == src.key {
            return Ok(());
        }
        let dst = self.find_in(&st, new_parent, dst_dir.clone(), new_name)?;
        if flags.noreplace && dst.is_some() {
            return Err(Errno::EEXIST);
        }
        if flags.exchange && dst.is_none() {
            return Err(Errno::ENOENT);
        }
        // A directory cannot move into its own subtree.
        if src.is_dir() && st.is_within(new_parent, src.ino()) {
            return Err(Errno::EINVAL);
        }
        if let Some(d) = &dst {
            if flags.exchange {
                if d.is_dir() && st.is_within(parent, d.ino()) {
                    return Err(Errno::EINVAL);
                }
            } else {
                if d.ino() == src.ino() {
                    return Ok(()); // two names of one file: nothing to do
                }
                match (src.is_dir(), d.is_dir()) {
                    (true, false) => return Err(Errno::ENOTDIR),
                    (false, true) => return Err(Errno::EISDIR),
                    (true, true) => {
                        let d_dir = schema::child_dir_key(&dst_dir, new_name);
                        if !self.dir_is_empty(&d_dir)? {
                            return Err(Errno::ENOTEMPTY);
                        }
                    }
                    (false, false) => {}
                }
            }
        }
        let src_sub = schema::child_dir_key(&src_dir, name);
        let dst_sub = schema::child_dir_key(&dst_dir, new_name);
        // Keys below a moved directory grow by the difference in prefix.
        let longest = |fs: &Self, is_dir: bool, from: &[u8], to: &[u8]| -> FsResult<()> {
            if is_dir && to.len() > from.len() {
                let longest = fs.longest_key_below(from)?;
                if longest + (to.len() - from.len()) > ENTRY_KEY_MAX {
                    return Err(Errno::ENAMETOOLONG);
                }
            }
            Ok(())
        };
        longest(self, src.is_dir(), &src_sub, &dst_sub)?;
        if flags.exchange {
            if let Some(d) = &dst {
                longest(self, d.is_dir(), &dst_sub, &src_sub)?;
            }
        }

        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let src_ino = src.ino();
        let mut restore: Vec<(Ino, Home, Attr)> = Vec::new();
        for ino in [Some(src_ino), dst.as_ref().map(Found::ino)]
            .into_iter()
            .flatten()
        {
            if let Some(n) = st.nodes.get(&ino) {
                restore.push((ino, n.home, n.attr.clone()));
            }
        }
        let saved_parents: Vec<(Ino, Attr)> = [parent, new_parent]
            .iter()
            .filter_map(|&p| st.nodes.get(&p).map(|n| (p, n.attr.clone())))
            .collect();

        let mut src_record = src.record.clone();
        if let Record::Inode { attr, .. } = &mut src_record {
            attr.ctime = now;
        }
        if let Some(n) = st.nodes.get_mut(&src_ino) {
            n.attr.ctime = now;
        }
        if flags.exchange {
            let Some(d) = &dst else {
                return Err(Errno::ENOENT);
            };
            let mut dst_record = d.record.clone();
            if let Record::Inode { attr, .. } = &mut dst_record {
                attr.ctime = now;
            }
            if let Some(n) = st.nodes.get_mut(&d.ino()) {
                n.attr.ctime = now;
            }
            // Park both in scratch space, then move each into the other's place.
            let [a, b] = schema::SCRATCH_KEYS;
            stage_move(&mut batch, &src, &src_sub, a);
            stage_move(&mut batch, d, &dst_sub, b);
            finish_move(&mut batch, &src, a, &dst_key, &dst_sub, &src_record);
            finish_move(&mut batch, d, b, &src.key, &src_sub, &dst_record);
            if parent != new_parent && src.is_dir() != d.is_dir() {
                let delta = if src.is_dir() { 1 } else { -1 };
                st.touch_dir(parent, now, -delta)?;
                st.touch_dir(new_parent, now, delta)?;
            } else {
                st.touch_dir(parent, now, 0)?;
                st.touch_dir(new_parent, now, 0)?;
            }
        } else {
            if let Some(d) = &dst {
                self.remove_entry(&mut st, &mut batch, d, &dst_sub, now, false)?;
            }
            batch.delete(KeySpace::Meta, &src.key);
            batch.put(KeySpace::Meta, &dst_key, &src_record.encode());
            if matches!(src.record, Record::Inode { .. }) {
                move_file_data(&mut batch, &src.key, &dst_key);
            }
            if src.is_dir() {
                move_subtree(&mut batch, &src_sub, &dst_sub);
            }
            let replaced_dir = dst.as_ref().is_some_and(Found::is_dir);
            if src.is_dir() && parent != new_parent {
                st.touch_dir(parent, now, -1)?;
                st.touch_dir(new_parent, now, if replaced_dir { 0 } else { 1 })?;
            } else {
                st.touch_dir(parent, now, 0)?;
                st.touch_dir(new_parent, now, if replaced_dir { -1 } else { 0 })?;
            }
        }
        st.put_record_at(&mut batch, &dir_record_key(&src_dir), parent)?;
        if new_parent != parent {
            st.put_record_at(&mut batch, &dir_record_key(&dst_dir), new_parent)?;
        }
        if let Err(e) = self.store.write(&batch) {
            for (ino, home, attr) in restore {
                if let Some(n) = st.nodes.get_mut(&ino) {
                    n.home = home;
                    n.attr = attr;
                }
            }
            for (p, attr) in saved_parents {
                if let Some(n) = st.nodes.get_mut(&p) {
                    n.attr = attr;
                }
            }
            return Err(e.into());
        }
        // The table follows: names move, a replaced node is gone.
        let dst_ino = dst.as_ref().map(Found::ino);
        self.rename_in_table(&mut st, src_ino, new_parent, new_name);
        if flags.exchange {
            if let Some(d) = dst_ino {
                self.rename_in_table(&mut st, d, parent, name);
            }
        } else {
            st.remember_absent(parent, name);
        }
        st.forget_absent(new_parent, new_name);
        Ok(())
    }

    fn setattr(&self, ino: Ino, set: &SetAttr) -> FsResult<Attr> {
        let mut st = self.lock();
        let now = Timespec::now();
        let before = st.node(ino)?.attr.clone();
        // A removed file (still known to the kernel) has nothing stored.
        let key = match st.node(ino)?.home {
            Home::Gone => None,
            _ => Some(st.file_key(ino)?),
        };
        let mut batch = WriteBatch::new();
        if let Some(size) = set.size {
            if before.is_dir() {
                return Err(Errno::EISDIR);
            }
            if size > FILE_SIZE_MAX {
                return Err(Errno::EFBIG);
            }
            let key = key.as_deref().ok_or(Errno::ENOENT)?;
            truncate_blocks(&mut batch, key, before.size, size);
        }
        let node = st.node_mut(ino)?;
        let a = &mut node.attr;
        if let Some(mode) = set.mode {
            a.mode = (a.mode & S_IFMT) | (mode & 0o7777);
        }
        if let Some(uid) = set.uid {
            a.uid = uid;
        }
        if let Some(gid) = set.gid {
            a.gid = gid;
        }
        // Linux's rules: a size change marks mtime and ctime; truncate(2)
        // to the same size changes nothing, while ftruncate and O_TRUNC
        // (which name an open file) mark both anyway; any other change
        // marks ctime.
        let data_changed = set
            .size
            .is_some_and(|size| size != a.size || set.through_open_file);
        if let Some(size) = set.size {
            a.size = size;
        }
        if data_changed {
            a.mtime = now;
        }
        let pick = |t: SetTime| match t {
            SetTime::Now => now,
            SetTime::At(t) => t,
        };
        if let Some(t) = set.atime {
            a.atime = pick(t);
        }
        if let Some(t) = set.mtime {
            a.mtime = pick(t);
        }
        let attributes_changed = set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || set.atime.is_some()
            || set.mtime.is_some()
            || set.ctime.is_some();
        if data_changed || attributes_changed {
            a.ctime = set.ctime.unwrap_or(now);
        }
        let after = a.clone();
        if after == before {
            return Ok(after);
        }
        if let Some(key) = &key {
            st.put_record_at(&mut batch, key, ino)?;
        }
        if let Err(e) = self.store.write(&batch) {
            st.node_mut(ino)?.attr = before;
            return Err(e.into());
        }
        Ok(after)
    }

    fn open(&self, ino: Ino, flags: i32) -> FsResult<u64> {
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
                    ..SetAttr::default()
                },
            )?;
            st = self.lock();
        }
        Self::add_file_handle(&mut st, ino, flags)
    }

    /// The last close of an unlinked file frees it.
    fn release(&self, fh: u64) -> FsResult<()> {
        let mut st = self.lock();
        let Some(Handle::File { ino, .. }) = st.handles.remove(&fh) else {
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

    fn read(&self, ino: Ino, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let mut st = self.lock();
        let node = st.node(ino)?;
        if node.attr.is_dir() {
            return Err(Errno::EISDIR);
        }
        let file_size = node.attr.size;
        let end = file_size.min(offset.saturating_add(size as u64));
        let mut out = Vec::new();
        if offset < end {
            out.resize((end - offset) as usize, 0);
            let key = st.file_key(ino)?;
            let (first, last) = (offset / BLOCK_SIZE, (end - 1) / BLOCK_SIZE);
            let lo = schema::data_key(&key, first);
            let hi = schema::data_key(&key, last + 1);
            // Blocks are copied straight from the leaves into the reply.
            self.store
                .visit_range(KeySpace::Data, &lo, &hi, &mut |k, v| {
                    let Some(block) = schema::data_block(&key, k) else {
                        return;
                    };
                    let block_start = block * BLOCK_SIZE;
                    // The overlap of [block_start, block_start + v.len()) and [offset, end).
                    let from = block_start.max(offset);
                    let to = (block_start + v.len() as u64).min(end);
                    let dst = out.get_mut((from - offset) as usize..(to - offset) as usize);
                    let src = v.get((from - block_start) as usize..(to - block_start) as usize);
                    if let (true, Some(dst), Some(src)) = (from < to, dst, src) {
                        dst.copy_from_slice(src);
                    }
                })?;
        }
        self.note_access(&mut st, ino)?;
        Ok(out)
    }

    /// Writes `data` at `offset` (at the end for O_APPEND handles); returns
    /// the bytes written (fewer than asked only when space ran out).
    fn write(&self, ino: Ino, fh: u64, offset: u64, data: &[u8]) -> FsResult<u32> {
        let mut st = self.lock();
        let append = matches!(st.handles.get(&fh), Some(Handle::File { append: true, .. }))
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
            let node = st.node_mut(ino)?;
            let before = node.attr.clone();
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

    /// Makes everything written so far durable (one log for all files: an
    /// fsync of one file is an fsync of every earlier operation).
    fn fsync(&self) -> FsResult<()> {
        self.store.sync()?;
        Ok(())
    }

    /// fallocate mode 0: extends the size; blocks are not written ahead
    /// (a B^ε-tree has no extents to reserve), so only free space is checked.
    fn fallocate(&self, ino: Ino, offset: u64, length: u64, mode: i32) -> FsResult<()> {
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
        if end <= size {
            return Ok(());
        }
        if self.statfs().blocks_free * BLOCK_SIZE < end - size {
            return Err(Errno::ENOSPC);
        }
        let mut st = self.lock();
        let now = Timespec::now();
        let node = st.node_mut(ino)?;
        let before = node.attr.clone();
        node.attr.size = end;
        node.attr.ctime = now;
        node.attr.mtime = now;
        let mut batch = WriteBatch::new();
        st.put_record(&mut batch, ino)?;
        if let Err(e) = self.store.write(&batch) {
            st.node_mut(ino)?.attr = before;
            return Err(e.into());
        }
        Ok(())
    }

    fn opendir(&self, ino: Ino) -> FsResult<u64> {
        let mut st = self.lock();
        let node = st.node(ino)?;
        if !node.attr.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        let version = node.dir_version;
        let dir_key = st.dir_key(ino)?;
        let (start, _) = schema::children_range(&dir_key);
        let fh = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(
            fh,
            Handle::Dir(Box::new(DirHandle {
                ino,
                returned: Vec::new(),
                pending: VecDeque::new(),
                scan_from: Some(start),
                version,
                dir_key,
            })),
        );
        Ok(fh)
    }

    fn releasedir(&self, fh: u64) {
        self.lock().handles.remove(&fh);
    }

    /// Lists a directory from `offset`, calling `add` for each entry until
    /// it returns `true` (buffer full). With `plus`, entries carry their
    /// attributes and count as lookups (readdirplus fills the kernel's
    /// caches from the same scan).
    fn readdir(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<()> {
        let mut st = self.lock();
        let dir = st.dir_key(ino)?;
        let node = st.node(ino)?;
        let (parent, version) = (node.parent, node.dir_version);
        let Some(Handle::Dir(mut h)) = st.handles.remove(&fh) else {
            return Err(Errno::EBADF);
        };
        let result = self.fill_dir(
            &mut st, &mut h, &dir, ino, parent, version, offset, plus, add,
        );
        st.handles.insert(fh, Handle::Dir(h));
        result?;
        self.note_access(&mut st, ino)
    }

    fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], flags: i32) -> FsResult<()> {
        if name.is_empty() || name.len() > 255 || name.contains(&0) {
            return Err(Errno::ERANGE);
        }
        if value.len() > XATTR_SIZE_MAX {
            return Err(Errno::E2BIG);
        }
        // An ACL the kernel does not enforce would be a lie to the user who
        // set it (and a hole, if it was meant to shut someone out).
        if name.starts_with(b"system.posix_acl_") {
            return Err(Errno::EOPNOTSUPP);
        }
        let mut st = self.lock();
        let key = schema::xattr_key(&st.file_key(ino)?, name);
        if flags & (libc::XATTR_CREATE | libc::XATTR_REPLACE) != 0 {
            let exists = self.store.get(KeySpace::Data, &key)?.is_some();
            if exists && flags & libc::XATTR_CREATE != 0 {
                return Err(Errno::EEXIST);
            }
            if !exists && flags & libc::XATTR_REPLACE != 0 {
                return Err(Errno::ENODATA);
            }
        }
        let now = Timespec::now();
        let node = st.node_mut(ino)?;
        node.attr.ctime = now;
        node.has_xattrs = Some(true);
        let mut batch = WriteBatch::new();
        batch.put(KeySpace::Data, &key, value);
        st.put_record(&mut batch, ino)?;
        self.store.write(&batch)?;
        Ok(())
    }

    fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        let mut st = self.lock();
        if st.node(ino)?.has_xattrs == Some(false) {
            return Err(Errno::ENODATA);
        }
        let file = st.file_key(ino)?;
        match self
            .store
            .get(KeySpace::Data, &schema::xattr_key(&file, name))?
        {
            Some(v) => Ok(v),
            None => {
                // Learn whether there are any, so later misses (the kernel
                // asks for security.capability on every write) cost nothing.
                if st.node(ino)?.has_xattrs.is_none() {
                    let (lo, hi) = schema::xattr_range(&file);
                    let any = self
                        .store
                        .range(KeySpace::Data, &lo, Some(&hi))
                        .next()
                        .is_some();
                    st.node_mut(ino)?.has_xattrs = Some(any);
                }
                Err(Errno::ENODATA)
            }
        }
    }

    /// The names, each followed by a NUL (as listxattr(2) returns them).
    fn listxattr(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let st = self.lock();
        let file = st.file_key(ino)?;
        let (lo, hi) = schema::xattr_range(&file);
        let mut out = Vec::new();
        for item in self.store.range(KeySpace::Data, &lo, Some(&hi)) {
            let (k, _) = item?;
            out.extend_from_slice(k.get(file.len() + 1..).unwrap_or_default());
            out.push(0);
        }
        Ok(out)
    }

    fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        let mut st = self.lock();
        let key = schema::xattr_key(&st.file_key(ino)?, name);
        if self.store.get(KeySpace::Data, &key)?.is_none() {
            return Err(Errno::ENODATA);
        }
        st.node_mut(ino)?.attr.ctime = Timespec::now();
        let mut batch = WriteBatch::new();
        batch.delete(KeySpace::Data, &key);
        st.put_record(&mut batch, ino)?;
        self.store.write(&batch)?;
        Ok(())
    }

    fn statfs(&self) -> FsStats {
        let s = self.store.stats();
        let blocks = s.node_region_bytes / BLOCK_SIZE;
        let used = s.node_region_used_bytes / BLOCK_SIZE;
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

    /// Called when the kernel's writeback cache is on: it then computes
    /// O_APPEND offsets itself, and a write's offset is final.
    fn set_kernel_places_appends(&self, on: bool) {
        self.kernel_places_appends
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

/// First half of an exchange: everything of `f` moves to the scratch pair
/// `(file prefix, subtree prefix)`.
fn stage_move(batch: &mut WriteBatch, f: &Found, sub: &[u8], scratch: [&[u8]; 2]) {
    if matches!(f.record, Record::Inode { .. }) {
        move_file_data(batch, &f.key, scratch[0]);
    }
    if f.is_dir() {
        move_subtree(batch, sub, scratch[1]);
    }
    batch.delete(KeySpace::Meta, &f.key);
}

/// Second half: from the scratch pair to its new entry key and subtree.
fn finish_move(
    batch: &mut WriteBatch,
    f: &Found,
    scratch: [&[u8]; 2],
    key: &[u8],
    sub: &[u8],
    record: &Record,
) {
    batch.put(KeySpace::Meta, key, &record.encode());
    if matches!(f.record, Record::Inode { .. }) {
        move_file_data(batch, scratch[0], key);
    }
    if f.is_dir() {
        move_subtree(batch, scratch[1], sub);
    }
}
