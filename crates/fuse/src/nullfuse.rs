//! `nullfuse`: a file system that keeps names, attributes and sizes in
//! memory and drops all data (reads return zeros). It implements the same
//! [`Operations`] as betreefs and is served by the same adapter, mount
//! options and tuning, so it is the ceiling no FUSE file system can pass on
//! a machine: the difference between it and betreefs is the engine's cost,
//! the difference between it and a kernel file system is FUSE's.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use betreefs_fs::fs::{Caller, DirEntry, FsStats, Ino, RenameFlags, SetAttr, SetTime, ROOT_INO};
use betreefs_fs::record::{Attr, Timespec};
use betreefs_fs::{dir_cookie, mode_without_privileges, Errno, FsResult, Operations};

use crate::MountConfig;

struct NullNode {
    attr: Attr,
    parent: Ino,
    target: Vec<u8>,
    children: BTreeMap<Vec<u8>, Ino>,
    /// The readdir cookie of each child, to resume after it.
    cookies: HashMap<u64, Vec<u8>>,
    /// Kernel references (an unlinked inode stays until they are gone:
    /// the kernel may still write back its times).
    lookups: u64,
}

impl NullNode {
    fn insert_child(&mut self, name: &[u8], ino: Ino) {
        self.children.insert(name.to_vec(), ino);
        self.cookies.insert(dir_cookie(name), name.to_vec());
    }

    fn remove_child(&mut self, name: &[u8]) {
        self.children.remove(name);
        self.cookies.remove(&dir_cookie(name));
    }
}

struct NullState {
    nodes: HashMap<Ino, NullNode>,
    next_ino: Ino,
}

/// The no-op file system.
pub struct NullFs {
    state: Mutex<NullState>,
}

impl Default for NullFs {
    fn default() -> Self {
        let root = NullNode {
            attr: Attr::new(ROOT_INO, libc::S_IFDIR | 0o755, 0, 0, Timespec::now()),
            parent: ROOT_INO,
            target: Vec::new(),
            children: BTreeMap::new(),
            cookies: HashMap::new(),
            lookups: 1,
        };
        NullFs {
            state: Mutex::new(NullState {
                nodes: HashMap::from([(ROOT_INO, root)]),
                next_ino: ROOT_INO + 1,
            }),
        }
    }
}

impl NullFs {
    fn lock(&self) -> MutexGuard<'_, NullState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl NullState {
    fn node(&mut self, ino: Ino) -> FsResult<&mut NullNode> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn child(&self, parent: Ino, name: &[u8]) -> Option<Ino> {
        self.nodes.get(&parent)?.children.get(name).copied()
    }

    fn make(
        &mut self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        target: &[u8],
        caller: Caller,
    ) -> FsResult<Attr> {
        if self.child(parent, name).is_some() {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        // The kernel leaves the umask to the file system (DONT_MASK);
        // nullfuse keeps no ACLs, so it is a directory without a default one.
        let mode = betreefs_fs::acl::inherit(None, mode, caller.umask)?.mode;
        let attr = Attr {
            size: target.len() as u64,
            ..Attr::new(ino, mode, caller.uid, caller.gid, Timespec::now())
        };
        let p = self.node(parent)?;
        p.insert_child(name, ino);
        p.attr.nlink += u32::from(attr.is_dir());
        let node = NullNode {
            attr: attr.clone(),
            parent,
            target: target.to_vec(),
            children: BTreeMap::new(),
            cookies: HashMap::new(),
            lookups: 1,
        };
        self.nodes.insert(ino, node);
        Ok(attr)
    }

    /// Takes entry `name` out of `parent`; the inode goes with its last link.
    fn remove(&mut self, parent: Ino, name: &[u8], dir: bool) -> FsResult<()> {
        let ino = self.child(parent, name).ok_or(Errno::ENOENT)?;
        let node = self.node(ino)?;
        let is_dir = node.attr.is_dir();
        if dir != is_dir {
            return Err(if dir { Errno::ENOTDIR } else { Errno::EISDIR });
        }
        if is_dir && !node.children.is_empty() {
            return Err(Errno::ENOTEMPTY);
        }
        node.attr.nlink = node.attr.nlink.saturating_sub(if is_dir { 2 } else { 1 });
        if node.attr.nlink == 0 && node.lookups == 0 {
            self.nodes.remove(&ino);
        }
        let p = self.node(parent)?;
        p.remove_child(name);
        p.attr.nlink -= u32::from(is_dir);
        Ok(())
    }
}

impl Operations for NullFs {
    fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        let mut st = self.lock();
        let ino = st.child(parent, name).ok_or(Errno::ENOENT)?;
        let node = st.node(ino)?;
        node.lookups += 1;
        Ok(node.attr.clone())
    }

    /// One hold of the lock for a whole batch, as betreefs does.
    fn forget_many(&self, forgets: &[(Ino, u64)]) {
        let mut st = self.lock();
        for &(ino, count) in forgets {
            if let Some(node) = st.nodes.get_mut(&ino) {
                node.lookups = node.lookups.saturating_sub(count);
                if node.lookups == 0 && node.attr.nlink == 0 {
                    st.nodes.remove(&ino);
                }
            }
        }
    }

    fn getattr(&self, ino: Ino) -> FsResult<Attr> {
        Ok(self.lock().node(ino)?.attr.clone())
    }

    fn setattr(&self, ino: Ino, set: &SetAttr) -> FsResult<Attr> {
        let mut st = self.lock();
        let a = &mut st.node(ino)?.attr;
        let pick = |t: SetTime| match t {
            SetTime::Now => Timespec::now(),
            SetTime::At(t) => t,
        };
        if let Some(caller) = set.kill_privileges {
            a.mode = mode_without_privileges(a.mode, a.gid, caller);
        }
        if let Some(m) = set.mode {
            a.mode = (a.mode & libc::S_IFMT) | (m & 0o7777);
        }
        a.uid = set.uid.unwrap_or(a.uid);
        a.gid = set.gid.unwrap_or(a.gid);
        a.size = set.size.unwrap_or(a.size);
        a.atime = set.atime.map_or(a.atime, pick);
        a.mtime = set.mtime.map_or(a.mtime, pick);
        a.ctime = set.ctime.unwrap_or_else(Timespec::now);
        Ok(a.clone())
    }

    fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>> {
        Ok(self.lock().node(ino)?.target.clone())
    }

    fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        _rdev: u32,
        caller: Caller,
    ) -> FsResult<Attr> {
        self.lock().make(parent, name, mode, &[], caller)
    }

    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> FsResult<Attr> {
        self.lock()
            .make(parent, name, libc::S_IFDIR | (mode & 0o7777), &[], caller)
    }

    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], caller: Caller) -> FsResult<Attr> {
        self.lock()
            .make(parent, name, libc::S_IFLNK | 0o777, target, caller)
    }

    fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        self.lock().remove(parent, name, false)
    }

    fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<()> {
        self.lock().remove(parent, name, true)
    }

    /// Plain rename (replacing the target); the flags are not modelled.
    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        _flags: RenameFlags,
    ) -> FsResult<()> {
        let mut st = self.lock();
        let ino = st.child(parent, name).ok_or(Errno::ENOENT)?;
        if let Some(old) = st.child(new_parent, new_name) {
            let dir = st.nodes.get(&old).is_some_and(|n| n.attr.is_dir());
            st.remove(new_parent, new_name, dir)?;
        }
        let is_dir = st.node(ino)?.attr.is_dir();
        let p = st.node(parent)?;
        p.remove_child(name);
        p.attr.nlink -= u32::from(is_dir);
        let p = st.node(new_parent)?;
        p.insert_child(new_name, ino);
        p.attr.nlink += u32::from(is_dir);
        st.node(ino)?.parent = new_parent;
        Ok(())
    }

    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Attr> {
        let mut st = self.lock();
        if st.child(new_parent, new_name).is_some() {
            return Err(Errno::EEXIST);
        }
        let node = st.node(ino)?;
        node.attr.nlink += 1;
        node.lookups += 1;
        let attr = node.attr.clone();
        st.node(new_parent)?.insert_child(new_name, ino);
        Ok(attr)
    }

    fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        _flags: i32,
        caller: Caller,
    ) -> FsResult<(Attr, u64)> {
        let attr = self
            .lock()
            .make(parent, name, libc::S_IFREG | (mode & 0o7777), &[], caller)?;
        Ok((attr, 0))
    }

    fn open(&self, ino: Ino, flags: i32, kill: Option<Caller>) -> FsResult<u64> {
        if flags & libc::O_TRUNC != 0 {
            let set = SetAttr {
                size: Some(0),
                through_open_file: true,
                kill_privileges: kill,
                ..SetAttr::default()
            };
            self.setattr(ino, &set)?;
        }
        Ok(0)
    }

    fn read(&self, ino: Ino, offset: u64, buf: &mut [u8]) -> FsResult<usize> {
        let file_size = self.lock().node(ino)?.attr.size;
        let n = file_size.saturating_sub(offset).min(buf.len() as u64) as usize;
        if let Some(data) = buf.get_mut(..n) {
            data.fill(0);
        }
        Ok(n)
    }

    fn write(
        &self,
        ino: Ino,
        _fh: u64,
        offset: u64,
        data: &[u8],
        kill: Option<Caller>,
    ) -> FsResult<u32> {
        let mut st = self.lock();
        let a = &mut st.node(ino)?.attr;
        if let Some(caller) = kill {
            a.mode = mode_without_privileges(a.mode, a.gid, caller);
        }
        a.size = a.size.max(offset + data.len() as u64);
        a.mtime = Timespec::now();
        Ok(data.len() as u32)
    }

    fn release(&self, _fh: u64) -> FsResult<()> {
        Ok(())
    }

    fn fsync(&self) -> FsResult<()> {
        Ok(())
    }

    fn fallocate(
        &self,
        ino: Ino,
        offset: u64,
        length: u64,
        _mode: i32,
        kill: Option<Caller>,
    ) -> FsResult<()> {
        let mut st = self.lock();
        let a = &mut st.node(ino)?.attr;
        if let Some(caller) = kill {
            a.mode = mode_without_privileges(a.mode, a.gid, caller);
        }
        a.size = a.size.max(offset.saturating_add(length));
        Ok(())
    }

    /// Offsets are the cookies of the names (see [`dir_cookie`]).
    fn readdir(
        &self,
        ino: Ino,
        offset: u64,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<()> {
        let mut st = self.lock();
        let st = &mut *st;
        let dir = st.nodes.get(&ino).ok_or(Errno::ENOENT)?;
        for (cookie, dot_ino, name) in [(1, ino, &b"."[..]), (2, dir.parent, &b".."[..])] {
            let entry = DirEntry {
                ino: dot_ino,
                offset: cookie,
                file_type: libc::S_IFDIR,
                name,
                attr: None,
            };
            if offset < cookie && add(entry) {
                return Ok(());
            }
        }
        let start = match offset {
            0..=2 => Bound::Unbounded,
            cookie => match dir.cookies.get(&cookie) {
                Some(name) => Bound::Excluded(name.clone()),
                None => Bound::Unbounded,
            },
        };
        let mut start = start;
        loop {
            // A batch at a time: the entries are updated while listed.
            let batch: Vec<(Vec<u8>, Ino)> = st
                .nodes
                .get(&ino)
                .ok_or(Errno::ENOENT)?
                .children
                .range((start, Bound::Unbounded))
                .take(256)
                .map(|(n, &i)| (n.clone(), i))
                .collect();
            let Some((last, _)) = batch.last() else {
                return Ok(());
            };
            start = Bound::Excluded(last.clone());
            for (name, child) in batch {
                let Some(node) = st.nodes.get_mut(&child) else {
                    continue;
                };
                let entry = DirEntry {
                    ino: child,
                    offset: dir_cookie(&name),
                    file_type: node.attr.file_type(),
                    name: &name,
                    attr: plus.then_some(&node.attr),
                };
                if add(entry) {
                    return Ok(());
                }
                // readdirplus entries are references the kernel will forget.
                node.lookups += u64::from(plus);
            }
        }
    }

    fn statfs(&self) -> FsStats {
        let inodes = self.lock().nodes.len() as u64;
        FsStats {
            block_size: 4096,
            blocks: 1 << 30,
            blocks_free: 1 << 30,
            files: inodes + (1 << 20),
            files_free: 1 << 20,
            inodes,
            name_max: 255,
        }
    }

    fn setxattr(&self, _ino: Ino, name: &[u8], _value: &[u8], _flags: i32) -> FsResult<()> {
        // Values are dropped like data; an ACL dropped would be one the
        // kernel cannot enforce, so it is refused instead.
        if name.starts_with(b"system.posix_acl_") {
            return Err(Errno::EOPNOTSUPP);
        }
        Ok(())
    }

    fn getxattr(&self, _ino: Ino, _name: &[u8]) -> FsResult<Vec<u8>> {
        Err(Errno::ENODATA)
    }

    fn listxattr(&self, _ino: Ino) -> FsResult<Vec<u8>> {
        Ok(Vec::new())
    }

    fn removexattr(&self, _ino: Ino, _name: &[u8]) -> FsResult<()> {
        Err(Errno::ENODATA)
    }
}

/// Mounts a fresh nullfuse on `mountpoint` with the settings betreefs uses.
pub fn mount(
    mountpoint: &Path,
    config: &MountConfig,
    guard: Arc<crate::RequestGuard>,
    stats: Arc<crate::RequestStats>,
) -> std::io::Result<crate::Session> {
    let config = MountConfig {
        fs_name: "nullfuse".into(),
        ..config.clone()
    };
    crate::mount(
        Arc::new(NullFs::default()),
        mountpoint,
        &config,
        "nullfuse",
        guard,
        stats,
    )
}
