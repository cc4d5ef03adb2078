//! What a FUSE front end needs of a file system: the operations, named by
//! inode number, with POSIX error numbers. [`crate::FileSystem`] is the
//! real one; the front end's `nullfuse` (no data, names in memory) is the
//! other, so that both are served by exactly the same adapter code. The
//! types of the interface live here too, not inside its implementation.

use crate::error::FsResult;
use crate::record::{Attr, Timespec};

/// Inodes are named by number (the FUSE node id).
pub type Ino = u64;

/// Who is asking (for ownership of new files, and which set-ID bits a
/// change by them drops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// The caller's umask, applied to new inodes unless their directory
    /// has a default ACL (then the ACL masks instead: [`crate::acl`]).
    pub umask: u32,
}

impl Caller {
    /// A caller with no umask.
    pub const fn new(uid: u32, gid: u32) -> Caller {
        Caller { uid, gid, umask: 0 }
    }

    /// The same caller with the umask of its request.
    pub const fn with_umask(self, umask: u32) -> Caller {
        Caller { umask, ..self }
    }
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
    /// Drop set-ID bits and capabilities first, as for a change by this
    /// caller (truncate or chown; see [`mode_without_privileges`]).
    pub kill_privileges: Option<Caller>,
}

/// rename(2) flags.
#[derive(Clone, Copy, Debug, Default)]
pub struct RenameFlags {
    pub noreplace: bool,
    pub exchange: bool,
    /// `RENAME_WHITEOUT`: leave a whiteout (a 0/0 character device owned
    /// by this caller) at the old name.
    pub whiteout: Option<Caller>,
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

pub trait Operations: Send + Sync + 'static {
    /// Finds `name` in `parent`; the kernel holds a reference until forget.
    fn lookup(&self, parent: Ino, name: &[u8]) -> FsResult<Attr>;
    /// The kernel drops `count` references to `ino` (FORGET).
    fn forget(&self, ino: Ino, count: u64) {
        self.forget_many(&[(ino, count)]);
    }
    /// [`Operations::forget`] of each (inode, count) of a BATCH_FORGET,
    /// with the implementation's locks taken once for all of them.
    fn forget_many(&self, forgets: &[(Ino, u64)]);
    /// Finds an inode by number alone (a file handle being decoded: the
    /// kernel's LOOKUP of "." in it); the kernel holds a reference after.
    /// `ESTALE` when it is gone.
    fn lookup_by_number(&self, _ino: Ino) -> FsResult<Attr> {
        Err(crate::error::Errno::ESTALE)
    }
    /// The parent of directory `ino` (LOOKUP of ".." in it).
    fn lookup_parent(&self, _ino: Ino) -> FsResult<Attr> {
        Err(crate::error::Errno::ESTALE)
    }
    fn getattr(&self, ino: Ino) -> FsResult<Attr>;
    fn setattr(&self, ino: Ino, set: &SetAttr) -> FsResult<Attr>;
    fn readlink(&self, ino: Ino) -> FsResult<Vec<u8>>;
    fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> FsResult<Attr>;
    fn mkdir(&self, parent: Ino, name: &[u8], mode: u32, caller: Caller) -> FsResult<Attr>;
    fn symlink(&self, parent: Ino, name: &[u8], target: &[u8], caller: Caller) -> FsResult<Attr>;
    fn unlink(&self, parent: Ino, name: &[u8]) -> FsResult<()>;
    fn rmdir(&self, parent: Ino, name: &[u8]) -> FsResult<()>;
    fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameFlags,
    ) -> FsResult<()>;
    fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Attr>;
    /// create(2) with O_CREAT: makes the file and opens it.
    fn create(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> FsResult<(Attr, u64)>;
    /// Opens a file; with O_TRUNC it is truncated, and `kill` asks to drop
    /// set-ID bits and capabilities first (the kernel's
    /// `FUSE_OPEN_KILL_SUIDGID`).
    fn open(&self, ino: Ino, flags: i32, kill: Option<Caller>) -> FsResult<u64>;
    /// Reads from `offset` into `buf` (up to its length, less at the end
    /// of the file); returns the bytes read. Holes read as zeros, whatever
    /// `buf` held before.
    fn read(&self, ino: Ino, offset: u64, buf: &mut [u8]) -> FsResult<usize>;

    /// [`Operations::read`] into a new vector of at most `size` bytes.
    fn read_to_vec(&self, ino: Ino, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let left = self.getattr(ino)?.size.saturating_sub(offset);
        let mut buf = vec![0; left.min(u64::from(size)) as usize];
        let n = self.read(ino, offset, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }
    /// Writes; `kill` asks to drop set-ID bits and capabilities first (the
    /// writer lacks CAP_FSETID: `FUSE_WRITE_KILL_SUIDGID`).
    fn write(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        data: &[u8],
        kill: Option<Caller>,
    ) -> FsResult<u32>;
    fn release(&self, fh: u64) -> FsResult<()>;
    /// Makes everything written so far durable.
    fn fsync(&self) -> FsResult<()>;
    /// fallocate(2); `kill` as for [`Operations::write`].
    fn fallocate(
        &self,
        ino: Ino,
        offset: u64,
        length: u64,
        mode: i32,
        kill: Option<Caller>,
    ) -> FsResult<()>;
    /// Lists from `offset` (0, or an entry's offset: resume after it),
    /// calling `add` until it returns `true` (full). Offsets are stateless
    /// cookies: any one returned earlier is valid later, from any open of
    /// the directory (the front end keeps no directory handles).
    fn readdir(
        &self,
        ino: Ino,
        offset: u64,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<()>;
    /// lseek(2) with `SEEK_DATA` or `SEEK_HOLE` (the kernel serves the
    /// other kinds itself). `ENOSYS` makes the kernel treat the whole file
    /// as data from then on.
    fn seek_data_or_hole(&self, _ino: Ino, _offset: u64, _whence: i32) -> FsResult<u64> {
        Err(crate::error::Errno(libc::ENOSYS))
    }
    /// The chattr flags (`FS_IOC_GETFLAGS`, `crate::record::INODE_FLAGS`).
    fn inode_flags(&self, _ino: Ino) -> FsResult<u32> {
        Err(crate::error::Errno(libc::ENOTTY))
    }
    /// Sets them; the kernel has checked the caller's right to (owner,
    /// CAP_LINUX_IMMUTABLE for immutable and append-only).
    fn set_inode_flags(&self, _ino: Ino, _flags: u32) -> FsResult<()> {
        Err(crate::error::Errno(libc::ENOTTY))
    }
    /// open(2) with `O_TMPFILE`: an unnamed file in directory `parent`,
    /// open, with no links; `link` may give it a name later.
    fn tmpfile(
        &self,
        _parent: Ino,
        _mode: u32,
        _flags: i32,
        _caller: Caller,
    ) -> FsResult<(Attr, u64)> {
        Err(crate::error::Errno(libc::EOPNOTSUPP))
    }
    /// copy_file_range(2) of `len` bytes from `ino_in` at `off_in` to
    /// `ino_out` at `off_out`, inside the file system; returns the bytes
    /// copied (fewer at the end of the source). `kill` as for write.
    #[allow(clippy::too_many_arguments)]
    fn copy_range(
        &self,
        _ino_in: Ino,
        _off_in: u64,
        _ino_out: Ino,
        _fh_out: u64,
        _off_out: u64,
        _len: u64,
        _kill: Option<Caller>,
    ) -> FsResult<u64> {
        Err(crate::error::Errno(libc::ENOSYS))
    }
    /// Makes the empty directory `dst` a copy of the tree of directory
    /// `src` (`betreefs clone`, the `BETREEFS_IOC_CLONE_TREE` ioctl):
    /// atomically, data shared copy-on-write. Returns `dst`'s attributes.
    fn clone_tree_into(&self, _src: Ino, _dst: Ino, _caller: Caller) -> FsResult<Attr> {
        Err(crate::error::Errno(libc::ENOTTY))
    }
    fn statfs(&self) -> FsStats;
    fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], flags: i32) -> FsResult<()>;
    fn getxattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>>;
    /// The names, each followed by a NUL.
    fn listxattr(&self, ino: Ino) -> FsResult<Vec<u8>>;
    fn removexattr(&self, ino: Ino, name: &[u8]) -> FsResult<()>;
    /// The kernel's writeback cache is on: it places O_APPEND writes itself.
    fn set_kernel_places_appends(&self, _on: bool) {}
    /// Called once on each thread of a transport before it serves:
    /// whenever [`Operations::has_work_after_reply`] says so, once the
    /// replies to the requests the thread served are sent, the transport
    /// has [`Operations::work_after_reply`] called (by that thread, or by
    /// one of its own that serves no request), so requests served on it
    /// may leave work for then. `hands_long_work_on`: the transport hands
    /// work flagged long ([`Operations::work_after_reply_is_long`]) to a
    /// thread of its own, so the thread may leave such work (a device
    /// read) flagged for it.
    fn serving_thread_started(&self, _hands_long_work_on: bool) {}
    /// Entries (parent, name) the kernel should drop, for the transport to
    /// tell it (FUSE_NOTIFY_INVAL_ENTRY, from a thread that serves no
    /// request: the kernel takes the parent's lock for it). With memory
    /// to spare the kernel holds every name it has looked up, and so an
    /// implementation holds an entry for each; this is how it bounds
    /// them. Asked every few tens of milliseconds; none by default.
    fn entries_to_release(&self) -> Vec<(Ino, Vec<u8>)> {
        Vec::new()
    }
    /// Whether a request left work for after its reply.
    fn has_work_after_reply(&self) -> bool {
        false
    }
    /// Whether the work left for after replies is long (a rename's tree
    /// surgery): a transport hands it to a thread that serves no request
    /// rather than holding the requests behind it.
    fn work_after_reply_is_long(&self) -> bool {
        false
    }
    /// Does the work requests left for after their replies (a write's
    /// application of what is staged, settling, eviction: its client goes
    /// on meanwhile).
    fn work_after_reply(&self) {}
}
