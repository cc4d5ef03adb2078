//! `nullfuse`: a FUSE file system that keeps names, attributes and sizes in
//! memory and drops all data (reads return zeros). Mounted with the same
//! crate, options and tuning as betreefs, it is the ceiling no FUSE file
//! system can pass on a machine: the difference between it and betreefs
//! is the engine's cost, the difference between it and a kernel file
//! system is FUSE's.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use betreefs_fs::record::{Attr, Timespec};
use betreefs_fs::Errno;
use fuser::{
    FileHandle, FileType, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner, OpenFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::{errno, file_attr, file_type, negative_entry, MountConfig, TTL};

struct NullNode {
    attr: Attr,
    parent: u64,
    target: Vec<u8>,
    children: BTreeMap<Vec<u8>, u64>,
}

struct NullState {
    nodes: HashMap<u64, NullNode>,
    next_ino: u64,
}

/// The no-op file system.
pub struct NullFs {
    state: Mutex<NullState>,
    config: MountConfig,
}

type NullResult<T> = Result<T, Errno>;

impl NullFs {
    pub fn new(config: MountConfig) -> NullFs {
        let now = Timespec::now();
        let mut nodes = HashMap::new();
        nodes.insert(
            1,
            NullNode {
                attr: Attr {
                    ino: 1,
                    mode: libc::S_IFDIR | 0o755,
                    uid: 0,
                    gid: 0,
                    nlink: 2,
                    rdev: 0,
                    size: 0,
                    atime: now,
                    mtime: now,
                    ctime: now,
                    crtime: now,
                },
                parent: 1,
                target: Vec::new(),
                children: BTreeMap::new(),
            },
        );
        NullFs {
            state: Mutex::new(NullState { nodes, next_ino: 2 }),
            config,
        }
    }

    fn lock(&self) -> MutexGuard<'_, NullState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl NullState {
    fn node(&mut self, ino: u64) -> NullResult<&mut NullNode> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn child(&self, parent: u64, name: &[u8]) -> Option<u64> {
        self.nodes.get(&parent)?.children.get(name).copied()
    }

    fn make(
        &mut self,
        req: &Request,
        parent: u64,
        name: &[u8],
        mode: u32,
        target: &[u8],
    ) -> NullResult<Attr> {
        if self.child(parent, name).is_some() {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let now = Timespec::now();
        let is_dir = mode & libc::S_IFMT == libc::S_IFDIR;
        let attr = Attr {
            ino,
            mode,
            uid: req.uid(),
            gid: req.gid(),
            nlink: if is_dir { 2 } else { 1 },
            rdev: 0,
            size: target.len() as u64,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
        };
        let p = self.node(parent)?;
        p.children.insert(name.to_vec(), ino);
        p.attr.nlink += u32::from(is_dir);
        p.attr.mtime = now;
        self.nodes.insert(
            ino,
            NullNode {
                attr: attr.clone(),
                parent,
                target: target.to_vec(),
                children: BTreeMap::new(),
            },
        );
        Ok(attr)
    }

    fn remove(&mut self, parent: u64, name: &[u8], dir: bool) -> NullResult<()> {
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
        if node.attr.nlink == 0 {
            self.nodes.remove(&ino);
        }
        let p = self.node(parent)?;
        p.children.remove(name);
        p.attr.nlink -= u32::from(is_dir);
        Ok(())
    }
}

fn reply_entry(reply: ReplyEntry, r: NullResult<Attr>) {
    match r {
        Ok(a) => reply.entry(&TTL, &file_attr(&a), Generation(0)),
        Err(e) => reply.error(errno(e)),
    }
}

fn set_time(t: TimeOrNow) -> Timespec {
    match t {
        TimeOrNow::Now => Timespec::now(),
        TimeOrNow::SpecificTime(t) => Timespec::from_system(t),
    }
}

impl fuser::Filesystem for NullFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        crate::tune_kernel(config, self.config.writeback_cache);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let st = self.lock();
        match st
            .child(parent.0, name.as_bytes())
            .and_then(|i| st.nodes.get(&i))
        {
            Some(n) => reply.entry(&TTL, &file_attr(&n.attr), Generation(0)),
            None => negative_entry(reply),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.lock().node(ino.0) {
            Ok(n) => reply.attr(&TTL, &file_attr(&n.attr)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut st = self.lock();
        let Ok(n) = st.node(ino.0) else {
            return reply.error(errno(Errno::ENOENT));
        };
        let a = &mut n.attr;
        if let Some(m) = mode {
            a.mode = (a.mode & libc::S_IFMT) | (m & 0o7777);
        }
        a.uid = uid.unwrap_or(a.uid);
        a.gid = gid.unwrap_or(a.gid);
        a.size = size.unwrap_or(a.size);
        if let Some(t) = atime {
            a.atime = set_time(t);
        }
        if let Some(t) = mtime {
            a.mtime = set_time(t);
        }
        a.ctime = Timespec::now();
        reply.attr(&TTL, &file_attr(a));
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.lock().node(ino.0) {
            Ok(n) => reply.data(&n.target),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        let r = self.lock().make(req, parent.0, name.as_bytes(), mode, &[]);
        reply_entry(reply, r);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let mode = libc::S_IFDIR | (mode & 0o7777);
        let r = self.lock().make(req, parent.0, name.as_bytes(), mode, &[]);
        reply_entry(reply, r);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.lock().remove(parent.0, name.as_bytes(), false) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.lock().remove(parent.0, name.as_bytes(), true) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let target = target.as_os_str().as_bytes();
        let r = self.lock().make(
            req,
            parent.0,
            link_name.as_bytes(),
            libc::S_IFLNK | 0o777,
            target,
        );
        reply_entry(reply, r);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut st = self.lock();
        let Some(ino) = st.child(parent.0, name.as_bytes()) else {
            return reply.error(errno(Errno::ENOENT));
        };
        if let Some(old) = st.child(newparent.0, newname.as_bytes()) {
            let dir = st.nodes.get(&old).is_some_and(|n| n.attr.is_dir());
            if let Err(e) = st.remove(newparent.0, newname.as_bytes(), dir) {
                return reply.error(errno(e));
            }
        }
        let is_dir = st.nodes.get(&ino).is_some_and(|n| n.attr.is_dir());
        if let Ok(p) = st.node(parent.0) {
            p.children.remove(name.as_bytes());
            p.attr.nlink -= u32::from(is_dir);
        }
        if let Ok(p) = st.node(newparent.0) {
            p.children.insert(newname.as_bytes().to_vec(), ino);
            p.attr.nlink += u32::from(is_dir);
        }
        if let Ok(n) = st.node(ino) {
            n.parent = newparent.0;
        }
        reply.ok();
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut st = self.lock();
        if st.child(newparent.0, newname.as_bytes()).is_some() {
            return reply.error(errno(Errno::EEXIST));
        }
        let attr = match st.node(ino.0) {
            Ok(n) => {
                n.attr.nlink += 1;
                n.attr.clone()
            }
            Err(e) => return reply.error(errno(e)),
        };
        if let Ok(p) = st.node(newparent.0) {
            p.children.insert(newname.as_bytes().to_vec(), ino.0);
        }
        reply.entry(&TTL, &file_attr(&attr), Generation(0));
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let file_size = self.lock().node(ino.0).map_or(0, |n| n.attr.size);
        let n = file_size.saturating_sub(offset).min(size as u64) as usize;
        reply.data(&vec![0u8; n]);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if let Ok(n) = self.lock().node(ino.0) {
            n.attr.size = n.attr.size.max(offset + data.len() as u64);
            n.attr.mtime = Timespec::now();
        }
        reply.written(data.len() as u32);
    }

    fn flush(&self, _: &Request, _: INodeNo, _: FileHandle, _: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fsync(&self, _: &Request, _: INodeNo, _: FileHandle, _: bool, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fsyncdir(&self, _: &Request, _: INodeNo, _: FileHandle, _: bool, reply: ReplyEmpty) {
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let st = self.lock();
        let Some(dir) = st.nodes.get(&ino.0) else {
            return reply.error(errno(Errno::ENOENT));
        };
        // Offsets are positions in the (sorted) child list.
        let entries = [(ino.0, b".".to_vec()), (dir.parent, b"..".to_vec())]
            .into_iter()
            .chain(dir.children.iter().map(|(n, &i)| (i, n.clone())));
        for (i, (child, name)) in entries.enumerate().skip(offset as usize) {
            let kind = st
                .nodes
                .get(&child)
                .map_or(FileType::Directory, |n| file_type(n.attr.mode));
            if reply.add(INodeNo(child), i as u64 + 1, kind, OsStr::from_bytes(&name)) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let st = self.lock();
        let Some(dir) = st.nodes.get(&ino.0) else {
            return reply.error(errno(Errno::ENOENT));
        };
        let entries = [(ino.0, b".".to_vec()), (dir.parent, b"..".to_vec())]
            .into_iter()
            .chain(dir.children.iter().map(|(n, &i)| (i, n.clone())));
        for (i, (child, name)) in entries.enumerate().skip(offset as usize) {
            let Some(n) = st.nodes.get(&child) else {
                continue;
            };
            let ttl = if i < 2 { Duration::ZERO } else { TTL };
            let attr = file_attr(&n.attr);
            if reply.add(
                INodeNo(child),
                i as u64 + 1,
                OsStr::from_bytes(&name),
                &ttl,
                &attr,
                Generation(0),
            ) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let files = self.lock().nodes.len() as u64;
        reply.statfs(
            1 << 30,
            1 << 30,
            1 << 30,
            files + (1 << 20),
            1 << 20,
            4096,
            255,
            4096,
        );
    }

    fn setxattr(
        &self,
        _: &Request,
        _: INodeNo,
        _: &OsStr,
        _: &[u8],
        _: i32,
        _: u32,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn getxattr(&self, _: &Request, _: INodeNo, _: &OsStr, _: u32, reply: ReplyXattr) {
        reply.error(errno(Errno::ENODATA));
    }

    fn listxattr(&self, _: &Request, _: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let mode = libc::S_IFREG | (mode & 0o7777);
        match self.lock().make(req, parent.0, name.as_bytes(), mode, &[]) {
            Ok(a) => reply.created(
                &TTL,
                &file_attr(&a),
                Generation(0),
                FileHandle(0),
                FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }
}

/// Mounts a fresh nullfuse on `mountpoint` with the settings betreefs uses.
pub fn mount(mountpoint: &Path, config: &MountConfig) -> std::io::Result<fuser::BackgroundSession> {
    let fs = NullFs::new(MountConfig {
        fs_name: "nullfuse".into(),
        ..config.clone()
    });
    crate::spawn_session(fs, mountpoint, config, "nullfuse")
}
