//! The FUSE front end: each kernel request becomes one call on
//! [`betreefs_fs::FileSystem`], and the mount is tuned to remove round
//! trips (docs/design.md, "The FUSE front end"):
//! - readdirplus, so a directory scan fills the kernel's dentry and inode
//!   caches from the same range scan (0.6 §3.3);
//! - 1 MiB requests (`max_pages`), several dispatch threads each reading
//!   the device on a cloned fd;
//! - long entry and attribute timeouts, negative entries cached too: the
//!   daemon is the only writer of its image, and every change goes through
//!   the kernel, which invalidates what a change affects;
//! - `keep_cache` on open for the same reason;
//! - no kernel writeback cache by default (`-o writeback` turns it on):
//!   measured on the untar of linux-source-6.1 it changed nothing (83.1 s
//!   with, 82.7 s without: per-file requests, not write requests, set the
//!   pace), while it turns a partial-page write into a read of that page
//!   first — what a write-optimized file system exists to avoid, small
//!   writes being blind upserts here — and reads served from its pages
//!   never reach the daemon, so access times would not be kept;
//! - `default_permissions`: the kernel checks modes against the caller.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use betreefs_fs::record::{Attr, Timespec};
use betreefs_fs::{Caller, Errno, FsResult, Operations, RenameFlags, SetAttr, SetTime};
use fuser::{
    FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig,
    LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
    Request, TimeOrNow, WriteFlags,
};

/// How long the kernel may cache entries and attributes.
const TTL: Duration = Duration::from_secs(10);
/// Largest read or write request.
pub const MAX_REQUEST: u32 = 1 << 20;

/// Mount settings.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Shown as the mount's source (e.g. the image path).
    pub fs_name: String,
    /// Threads reading and answering kernel requests.
    pub threads: usize,
    /// Let other users in (as root, the default).
    pub allow_other: bool,
    /// Extra kernel mount flags (ro, nosuid, nodev, noexec, noatime...).
    pub flags: Vec<MountOption>,
    /// Let the kernel cache writes and send them in large requests (see the
    /// module documentation for why this is off by default).
    pub writeback_cache: bool,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            fs_name: "betreefs".into(),
            threads: 2,
            allow_other: unsafe_is_root(),
            flags: Vec::new(),
            writeback_cache: false,
        }
    }
}

fn unsafe_is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

pub mod abi;
pub mod guard;
pub mod nullfuse;
pub mod request;
pub mod stats;

use abi::opcode;
pub use guard::RequestGuard;
pub use stats::RequestStats;

/// Mounts `fs` on `mountpoint` as file-system type `fuse.<subtype>`;
/// requests are served by background threads until the file system is
/// unmounted (the returned session then ends).
pub fn mount<F: Operations>(
    fs: Arc<F>,
    mountpoint: &Path,
    config: &MountConfig,
    subtype: &str,
    guard: Arc<RequestGuard>,
    stats: Arc<RequestStats>,
) -> std::io::Result<fuser::BackgroundSession> {
    let fs = Fuse {
        fs,
        writeback_cache: config.writeback_cache,
        guard,
        stats,
    };
    let mut options = vec![
        MountOption::FSName(config.fs_name.clone()),
        // As a kernel option (fuser's direct mount drops `Subtype`), so that
        // the mount shows as fuse.<subtype> to mount(8), findmnt and umount.
        MountOption::CUSTOM(format!("subtype={subtype}")),
        MountOption::DefaultPermissions,
    ];
    options.extend(config.flags.iter().cloned());
    let mut fuse_config = fuser::Config::default();
    fuse_config.mount_options = options;
    fuse_config.acl = if config.allow_other {
        fuser::SessionACL::All
    } else {
        fuser::SessionACL::Owner
    };
    fuse_config.n_threads = Some(config.threads.max(1));
    fuse_config.clone_fd = true;
    fuser::Session::new(fs, mountpoint, &fuse_config)?.spawn()
}

/// The protocol features asked of the kernel (module documentation);
/// returns whether the writeback cache was granted.
fn tune_kernel(config: &mut KernelConfig, writeback_cache: bool) -> bool {
    for flag in [
        InitFlags::FUSE_DO_READDIRPLUS,
        InitFlags::FUSE_READDIRPLUS_AUTO,
        InitFlags::FUSE_PARALLEL_DIROPS,
        InitFlags::FUSE_ATOMIC_O_TRUNC,
        InitFlags::FUSE_CACHE_SYMLINKS,
        InitFlags::FUSE_ASYNC_DIO,
    ] {
        if config.add_capabilities(flag).is_err() {
            tracing::debug!("kernel lacks {flag:?}");
        }
    }
    let granted = writeback_cache
        && match config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE) {
            Ok(()) => true,
            Err(_) => {
                tracing::warn!("kernel lacks the FUSE writeback cache");
                false
            }
        };
    let _ = config.set_max_write(MAX_REQUEST);
    let _ = config.set_max_readahead(MAX_REQUEST);
    let _ = config.set_max_background(64);
    granted
}

/// The kernel-facing adapter, the same for every file system.
struct Fuse<F> {
    fs: Arc<F>,
    writeback_cache: bool,
    guard: Arc<RequestGuard>,
    stats: Arc<RequestStats>,
}

impl<F: Operations> Fuse<F> {
    /// Serves one request through the guard (see [`guard`]), counting it.
    fn run<T>(&self, op: u32, ino: u64, request: impl FnOnce(&F) -> FsResult<T>) -> FsResult<T> {
        let started = Instant::now();
        let result = self.guard.run(
            || format!("{} (inode {ino})", opcode::name(op)),
            || request(&self.fs),
        );
        self.stats.record(op, started);
        result
    }
}

fn errno(e: Errno) -> fuser::Errno {
    fuser::Errno::from_i32(e.0)
}

fn file_type(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks(),
        atime: a.atime.to_system(),
        mtime: a.mtime.to_system(),
        ctime: a.ctime.to_system(),
        crtime: a.crtime.to_system(),
        kind: file_type(a.mode),
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: betreefs_fs::fs::BLOCK_SIZE as u32,
        flags: 0,
    }
}

/// An entry reply for "no such name" (inode 0): the kernel caches the
/// absence for the TTL, so a create right after needs no lookup at all.
fn negative_entry(reply: ReplyEntry) {
    let absent = Attr::new(0, 0, 0, 0, Timespec::default());
    reply.entry(&TTL, &file_attr(&absent), Generation(0));
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(t) => SetTime::At(Timespec::from_system(t)),
    }
}

fn reply_entry(reply: ReplyEntry, result: FsResult<Attr>) {
    match result {
        Ok(a) => reply.entry(&TTL, &file_attr(&a), Generation(0)),
        Err(e) => reply.error(errno(e)),
    }
}

fn reply_empty(reply: ReplyEmpty, result: FsResult<()>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    }
}

/// getxattr/listxattr: the size when asked for it, else the bytes, or
/// ERANGE when they do not fit.
fn reply_xattr(reply: ReplyXattr, size: u32, result: FsResult<Vec<u8>>) {
    match result {
        Ok(v) if size == 0 => reply.size(v.len() as u32),
        Ok(v) if v.len() > size as usize => reply.error(fuser::Errno::from_i32(libc::ERANGE)),
        Ok(v) => reply.data(&v),
        Err(e) => reply.error(errno(e)),
    }
}

fn open_flags() -> FopenFlags {
    FopenFlags::FOPEN_KEEP_CACHE
}

impl<F: Operations> fuser::Filesystem for Fuse<F> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if tune_kernel(config, self.writeback_cache) {
            self.fs.set_kernel_places_appends(true);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.run(opcode::LOOKUP, parent.0, |fs| {
            guard::injected_panic(name.as_bytes());
            fs.lookup(parent.0, name.as_bytes())
        }) {
            Err(Errno::ENOENT) => negative_entry(reply),
            other => reply_entry(reply, other),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        // Nothing to reply; a refused forget only keeps an entry longer.
        let _ = self.run(opcode::FORGET, ino.0, |fs| {
            fs.forget(ino.0, nlookup);
            Ok(())
        });
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.run(opcode::GETATTR, ino.0, |fs| fs.getattr(ino.0)) {
            Ok(a) => reply.attr(&TTL, &file_attr(&a)),
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
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
            ctime: ctime.map(Timespec::from_system),
            through_open_file: fh.is_some(),
        };
        match self.run(opcode::SETATTR, ino.0, |fs| fs.setattr(ino.0, &set)) {
            Ok(a) => reply.attr(&TTL, &file_attr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.run(opcode::READLINK, ino.0, |fs| fs.readlink(ino.0)) {
            Ok(t) => reply.data(&t),
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
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let r = self.run(opcode::MKNOD, parent.0, |fs| {
            fs.mknod(parent.0, name.as_bytes(), mode, rdev, caller(req))
        });
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
        reply_entry(
            reply,
            self.run(opcode::MKDIR, parent.0, |fs| {
                fs.mkdir(parent.0, name.as_bytes(), mode, caller(req))
            }),
        );
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(
            reply,
            self.run(opcode::UNLINK, parent.0, |fs| {
                fs.unlink(parent.0, name.as_bytes())
            }),
        );
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(
            reply,
            self.run(opcode::RMDIR, parent.0, |fs| {
                fs.rmdir(parent.0, name.as_bytes())
            }),
        );
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let r = self.run(opcode::SYMLINK, parent.0, |fs| {
            fs.symlink(
                parent.0,
                link_name.as_bytes(),
                target.as_os_str().as_bytes(),
                caller(req),
            )
        });
        reply_entry(reply, r);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let known = fuser::RenameFlags::RENAME_NOREPLACE | fuser::RenameFlags::RENAME_EXCHANGE;
        if !(flags - known).is_empty() {
            return reply.error(fuser::Errno::from_i32(libc::EINVAL));
        }
        let flags = RenameFlags {
            noreplace: flags.contains(fuser::RenameFlags::RENAME_NOREPLACE),
            exchange: flags.contains(fuser::RenameFlags::RENAME_EXCHANGE),
        };
        let r = self.run(opcode::RENAME2, parent.0, |fs| {
            fs.rename(
                parent.0,
                name.as_bytes(),
                newparent.0,
                newname.as_bytes(),
                flags,
            )
        });
        reply_empty(reply, r);
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply_entry(
            reply,
            self.run(opcode::LINK, ino.0, |fs| {
                fs.link(ino.0, newparent.0, newname.as_bytes())
            }),
        );
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.run(opcode::OPEN, ino.0, |fs| fs.open(ino.0, flags.0)) {
            Ok(fh) => reply.opened(FileHandle(fh), open_flags()),
            Err(e) => reply.error(errno(e)),
        }
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
        match self.run(opcode::READ, ino.0, |fs| fs.read(ino.0, offset, size)) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.run(opcode::WRITE, ino.0, |fs| {
            fs.write(ino.0, fh.0, offset, data)
        }) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, self.run(opcode::FLUSH, ino.0, |_| Ok(())));
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(
            reply,
            self.run(opcode::RELEASE, fh.0, |fs| fs.release(fh.0)),
        );
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, self.run(opcode::FSYNC, 0, |fs| fs.fsync()));
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.run(opcode::OPENDIR, ino.0, |fs| fs.opendir(ino.0)) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let r = self.run(opcode::READDIR, ino.0, |fs| {
            fs.readdir(ino.0, fh.0, offset, false, &mut |e| {
                reply.add(
                    INodeNo(e.ino),
                    e.offset,
                    file_type(e.file_type),
                    OsStr::from_bytes(e.name),
                )
            })
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let r = self.run(opcode::READDIRPLUS, ino.0, |fs| {
            fs.readdir(ino.0, fh.0, offset, true, &mut |e| {
                // "." and ".." come without attributes: the kernel takes no
                // reference for them, so nothing is cached.
                let (ttl, attr) = match e.attr {
                    Some(a) => (TTL, file_attr(a)),
                    None => (Duration::ZERO, file_attr(&dot_attr(e.ino))),
                };
                let name = OsStr::from_bytes(e.name);
                reply.add(INodeNo(e.ino), e.offset, name, &ttl, &attr, Generation(0))
            })
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        let _ = self.run(opcode::RELEASEDIR, fh.0, |fs| {
            fs.releasedir(fh.0);
            Ok(())
        });
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, self.run(opcode::FSYNCDIR, 0, |fs| fs.fsync()));
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = match self.run(opcode::STATFS, 0, |fs| Ok(fs.statfs())) {
            Ok(s) => s,
            Err(e) => return reply.error(errno(e)),
        };
        reply.statfs(
            s.blocks,
            s.blocks_free,
            s.blocks_free,
            s.files,
            s.files_free,
            s.block_size as u32,
            s.name_max as u32,
            s.block_size as u32,
        );
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        position: u32,
        reply: ReplyEmpty,
    ) {
        if position != 0 {
            return reply.error(fuser::Errno::from_i32(libc::EINVAL));
        }
        reply_empty(
            reply,
            self.run(opcode::SETXATTR, ino.0, |fs| {
                fs.setxattr(ino.0, name.as_bytes(), value, flags)
            }),
        );
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        reply_xattr(
            reply,
            size,
            self.run(opcode::GETXATTR, ino.0, |fs| {
                fs.getxattr(ino.0, name.as_bytes())
            }),
        );
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        reply_xattr(
            reply,
            size,
            self.run(opcode::LISTXATTR, ino.0, |fs| fs.listxattr(ino.0)),
        );
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(
            reply,
            self.run(opcode::REMOVEXATTR, ino.0, |fs| {
                fs.removexattr(ino.0, name.as_bytes())
            }),
        );
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        match self.run(opcode::CREATE, parent.0, |fs| {
            fs.create(parent.0, name.as_bytes(), mode, flags, caller(req))
        }) {
            Ok((a, fh)) => reply.created(
                &TTL,
                &file_attr(&a),
                Generation(0),
                FileHandle(fh),
                open_flags(),
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        reply_empty(
            reply,
            self.run(opcode::FALLOCATE, ino.0, |fs| {
                fs.fallocate(ino.0, offset, length, mode)
            }),
        );
    }
}

/// Placeholder attributes for "." and ".." in readdirplus (not cached).
fn dot_attr(ino: u64) -> Attr {
    Attr::new(ino, libc::S_IFDIR, 0, 0, Timespec::default())
}
