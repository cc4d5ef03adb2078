//! The kernel's FUSE ABI (protocol 7.x), written from
//! `include/uapi/linux/fuse.h`: opcodes, flags, and the wire layout of
//! every request argument and reply this front end uses. All integers are
//! in the machine's byte order (little-endian here); every structure is
//! padded to 8 bytes. Requests are parsed with a bounds-checked [`Reader`]
//! (a short request is an error, never a panic); replies are built into a
//! byte vector with [`Writer`].

/// The protocol version this front end speaks.
pub const KERNEL_VERSION: u32 = 7;
/// The newest minor version it knows (io_uring arrived in 7.42).
pub const KERNEL_MINOR_VERSION: u32 = 43;
/// The oldest minor version it accepts: readdirplus, RENAME2, the
/// writeback cache and ctime in setattr are all at least 7.23; 7.31 adds
/// the kill-suid flags this front end relies on.
pub const MIN_MINOR_VERSION: u32 = 31;

/// The page size the kernel's FUSE requests are counted in (x86-64).
pub const PAGE_BYTES: u64 = 4096;

/// The node id of the root.
pub const ROOT_ID: u64 = 1;

pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const GETLK: u32 = 31;
    pub const SETLK: u32 = 32;
    pub const SETLKW: u32 = 33;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const BMAP: u32 = 37;
    pub const DESTROY: u32 = 38;
    pub const IOCTL: u32 = 39;
    pub const POLL: u32 = 40;
    pub const NOTIFY_REPLY: u32 = 41;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const COPY_FILE_RANGE: u32 = 47;
    pub const SETUPMAPPING: u32 = 48;
    pub const REMOVEMAPPING: u32 = 49;
    pub const SYNCFS: u32 = 50;
    pub const TMPFILE: u32 = 51;
    pub const STATX: u32 = 52;
    /// One past the largest opcode counted per opcode.
    pub const COUNT: usize = 53;

    /// A short name for the per-opcode counters.
    pub fn name(op: u32) -> &'static str {
        match op {
            LOOKUP => "lookup",
            FORGET => "forget",
            GETATTR => "getattr",
            SETATTR => "setattr",
            READLINK => "readlink",
            SYMLINK => "symlink",
            MKNOD => "mknod",
            MKDIR => "mkdir",
            UNLINK => "unlink",
            RMDIR => "rmdir",
            RENAME => "rename",
            LINK => "link",
            OPEN => "open",
            READ => "read",
            WRITE => "write",
            STATFS => "statfs",
            RELEASE => "release",
            FSYNC => "fsync",
            SETXATTR => "setxattr",
            GETXATTR => "getxattr",
            LISTXATTR => "listxattr",
            REMOVEXATTR => "removexattr",
            FLUSH => "flush",
            INIT => "init",
            OPENDIR => "opendir",
            READDIR => "readdir",
            RELEASEDIR => "releasedir",
            FSYNCDIR => "fsyncdir",
            GETLK => "getlk",
            SETLK => "setlk",
            SETLKW => "setlkw",
            ACCESS => "access",
            CREATE => "create",
            INTERRUPT => "interrupt",
            BMAP => "bmap",
            DESTROY => "destroy",
            IOCTL => "ioctl",
            POLL => "poll",
            NOTIFY_REPLY => "notify_reply",
            BATCH_FORGET => "batch_forget",
            FALLOCATE => "fallocate",
            READDIRPLUS => "readdirplus",
            RENAME2 => "rename2",
            LSEEK => "lseek",
            COPY_FILE_RANGE => "copy_file_range",
            SETUPMAPPING => "setupmapping",
            REMOVEMAPPING => "removemapping",
            SYNCFS => "syncfs",
            TMPFILE => "tmpfile",
            STATX => "statx",
            _ => "other",
        }
    }
}

/// INIT flags (the first 32 in `flags`, the next in `flags2`).
pub mod init {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const POSIX_LOCKS: u64 = 1 << 1;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const EXPORT_SUPPORT: u64 = 1 << 4;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const DONT_MASK: u64 = 1 << 6;
    pub const FLOCK_LOCKS: u64 = 1 << 10;
    pub const AUTO_INVAL_DATA: u64 = 1 << 12;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const WRITEBACK_CACHE: u64 = 1 << 16;
    pub const NO_OPEN_SUPPORT: u64 = 1 << 17;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const HANDLE_KILLPRIV: u64 = 1 << 19;
    pub const POSIX_ACL: u64 = 1 << 20;
    pub const ABORT_ERROR: u64 = 1 << 21;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const NO_OPENDIR_SUPPORT: u64 = 1 << 24;
    pub const EXPLICIT_INVAL_DATA: u64 = 1 << 25;
    pub const HANDLE_KILLPRIV_V2: u64 = 1 << 28;
    pub const SETXATTR_EXT: u64 = 1 << 29;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const SECURITY_CTX: u64 = 1 << 32;
    pub const CREATE_SUPP_GROUP: u64 = 1 << 34;
    pub const HAS_EXPIRE_ONLY: u64 = 1 << 35;
    pub const NO_EXPORT_SUPPORT: u64 = 1 << 38;
    pub const HAS_RESEND: u64 = 1 << 39;
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// `fuse_setattr_in.valid` bits.
pub mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
    pub const CTIME: u32 = 1 << 10;
    pub const KILL_SUIDGID: u32 = 1 << 11;
}

/// Flags of an OPEN, OPENDIR or CREATE reply.
pub mod fopen {
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const CACHE_DIR: u32 = 1 << 3;
    pub const NOFLUSH: u32 = 1 << 5;
    pub const PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
}

/// `fuse_write_in.write_flags`.
pub const WRITE_KILL_SUIDGID: u32 = 1 << 2;
/// `fuse_open_in.open_flags` / `fuse_create_in.open_flags`.
pub const OPEN_KILL_SUIDGID: u32 = 1 << 0;
/// `fuse_getattr_in.getattr_flags`: `fh` is valid.
pub const GETATTR_FH: u32 = 1 << 0;
/// `fuse_fsync_in.fsync_flags`.
pub const FSYNC_FDATASYNC: u32 = 1 << 0;
/// `fuse_setxattr_in.setxattr_flags`.
pub const SETXATTR_ACL_KILL_SGID: u32 = 1 << 0;

/// Notification codes (written with `unique == 0`).
pub mod notify {
    pub const INVAL_INODE: i32 = 2;
    pub const INVAL_ENTRY: i32 = 3;
    pub const DELETE: i32 = 6;
}

pub const IN_HEADER_BYTES: usize = 40;
pub const OUT_HEADER_BYTES: usize = 16;
/// A read buffer must hold at least this much besides the payload.
pub const MIN_READ_BUFFER: usize = 8192;

/// A request too short for what its opcode needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncated;

/// Reads little-endian fields from a request, never past its end.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], Truncated> {
        let out = self
            .buf
            .get(self.pos..self.pos.checked_add(n).ok_or(Truncated)?)
            .ok_or(Truncated)?;
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Truncated> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    pub fn u16(&mut self) -> Result<u16, Truncated> {
        self.array().map(u16::from_le_bytes)
    }

    pub fn u32(&mut self) -> Result<u32, Truncated> {
        self.array().map(u32::from_le_bytes)
    }

    pub fn u64(&mut self) -> Result<u64, Truncated> {
        self.array().map(u64::from_le_bytes)
    }

    pub fn skip(&mut self, n: usize) -> Result<(), Truncated> {
        self.bytes(n).map(|_| ())
    }

    /// A NUL-terminated name (the NUL is consumed, not returned).
    pub fn name(&mut self) -> Result<&'a [u8], Truncated> {
        let rest = self.buf.get(self.pos..).ok_or(Truncated)?;
        let len = rest.iter().position(|&b| b == 0).ok_or(Truncated)?;
        let name = self.bytes(len)?;
        self.pos += 1;
        Ok(name)
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        let out = self.buf.get(self.pos..).unwrap_or_default();
        self.pos = self.buf.len();
        out
    }
}

/// Builds a reply's bytes.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    /// A writer with room for `bytes` before it grows.
    pub fn with_capacity(bytes: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(bytes),
        }
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
    /// Zero bytes up to the next multiple of 8.
    pub fn pad8(&mut self) -> &mut Self {
        let n = self.buf.len().next_multiple_of(8) - self.buf.len();
        self.buf.extend(std::iter::repeat_n(0, n));
        self
    }
}

/// `struct fuse_in_header`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    /// Length of request extensions, in units of 8 bytes.
    pub total_extlen: u16,
}

impl InHeader {
    pub fn parse(r: &mut Reader<'_>) -> Result<InHeader, Truncated> {
        let h = InHeader {
            len: r.u32()?,
            opcode: r.u32()?,
            unique: r.u64()?,
            nodeid: r.u64()?,
            uid: r.u32()?,
            gid: r.u32()?,
            pid: r.u32()?,
            total_extlen: r.u16()?,
        };
        r.skip(2)?;
        Ok(h)
    }
}

/// `struct fuse_out_header`; `len` counts the header too. An array, not
/// a `Writer`: every reply has one, and a vector grown for it was an
/// allocation and two reallocations per request.
pub fn out_header(len: u32, error: i32, unique: u64) -> [u8; OUT_HEADER_BYTES] {
    let mut out = [0u8; OUT_HEADER_BYTES];
    let fields = len
        .to_le_bytes()
        .into_iter()
        .chain(error.to_le_bytes())
        .chain(unique.to_le_bytes());
    for (dst, src) in out.iter_mut().zip(fields) {
        *dst = src;
    }
    out
}

/// A FUSE_NOTIFY_INVAL_ENTRY message: the out header (`unique` 0, the
/// code in `error`), then `struct fuse_notify_inval_entry_out` (`parent`
/// u64, `namelen` u32, `flags` u32: 0, the entry dropped, not only
/// expired) and the name with a NUL after it, which the kernel requires.
pub fn inval_entry_notification(parent: u64, name: &[u8]) -> Vec<u8> {
    let len = OUT_HEADER_BYTES + 16 + name.len() + 1;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&out_header(len as u32, notify::INVAL_ENTRY, 0));
    out.extend_from_slice(&parent.to_le_bytes());
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(name);
    out.push(0);
    out
}

/// `struct fuse_attr`, what the kernel caches about an inode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
}

impl Attr {
    pub fn write(&self, w: &mut Writer) {
        w.u64(self.ino)
            .u64(self.size)
            .u64(self.blocks)
            .i64(self.atime.0)
            .i64(self.mtime.0)
            .i64(self.ctime.0)
            .u32(self.atime.1)
            .u32(self.mtime.1)
            .u32(self.ctime.1)
            .u32(self.mode)
            .u32(self.nlink)
            .u32(self.uid)
            .u32(self.gid)
            .u32(self.rdev)
            .u32(self.blksize)
            .u32(0);
    }
}

/// `struct fuse_entry_out`: how long the name (`entry`) and the
/// attributes (`attr`) may be cached.
pub fn entry_out(
    w: &mut Writer,
    nodeid: u64,
    generation: u64,
    entry: Ttl,
    attr_ttl: Ttl,
    attr: &Attr,
) {
    w.u64(nodeid)
        .u64(generation)
        .u64(entry.secs)
        .u64(attr_ttl.secs)
        .u32(entry.nanos)
        .u32(attr_ttl.nanos);
    attr.write(w);
}

/// `struct fuse_attr_out`.
pub fn attr_out(w: &mut Writer, ttl: Ttl, attr: &Attr) {
    w.u64(ttl.secs).u32(ttl.nanos).u32(0);
    attr.write(w);
}

/// `struct fuse_statx_out` (7.39): the attributes with the birth time.
/// `attributes` are `STATX_ATTR_*` bits (the chattr flags that have one).
pub fn statx_out(w: &mut Writer, ttl: Ttl, a: &Attr, btime: (i64, u32), attributes: u64) {
    const STATX_BASIC_STATS: u32 = 0x7ff;
    const STATX_BTIME: u32 = 0x800;
    // STATX_ATTR_IMMUTABLE | APPEND | NODUMP: what betreefs can report.
    const ATTRIBUTES_MASK: u64 = 0x10 | 0x20 | 0x40;
    w.u64(ttl.secs).u32(ttl.nanos).u32(0).u64(0).u64(0);
    // struct fuse_statx
    w.u32(STATX_BASIC_STATS | STATX_BTIME)
        .u32(a.blksize)
        .u64(attributes & ATTRIBUTES_MASK)
        .u32(a.nlink)
        .u32(a.uid)
        .u32(a.gid)
        .u16(a.mode as u16)
        .u16(0)
        .u64(a.ino)
        .u64(a.size)
        .u64(a.blocks)
        .u64(ATTRIBUTES_MASK);
    for (sec, nsec) in [a.atime, btime, a.ctime, a.mtime] {
        w.i64(sec).u32(nsec).i32(0);
    }
    let (major, minor) = (libc::major(a.rdev as u64), libc::minor(a.rdev as u64));
    w.u32(major).u32(minor).u32(0).u32(0);
    w.bytes(&[0; 14 * 8]);
}

/// `struct fuse_ioctl_out` followed by the data the caller gets back.
pub fn ioctl_out(w: &mut Writer, result: i32, data: &[u8]) {
    w.i32(result).u32(0).u32(0).u32(0).bytes(data);
}

/// The inode-flag ioctls the kernel forwards for `chattr`/`lsattr` (its
/// `fileattr_get`/`fileattr_set`), and `struct fsxattr`'s size.
pub mod ioctl {
    pub const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
    pub const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
    pub const FS_IOC32_GETFLAGS: u32 = 0x8004_6601;
    pub const FS_IOC32_SETFLAGS: u32 = 0x4004_6602;
    pub const FS_IOC_FSGETXATTR: u32 = 0x801c_581f;
    pub const FS_IOC_FSSETXATTR: u32 = 0x401c_5820;
    pub const FSXATTR_BYTES: usize = 28;
    /// betreefs's own: `_IOW(0xbe, 1, u64)` on an empty directory, with
    /// the inode number of a directory on the same mount, makes the
    /// directory a clone of that one's tree (`betreefs clone`).
    pub const BETREEFS_IOC_CLONE_TREE: u32 = 0x4008_be01;
    /// `FS_XFLAG_*` and the `FS_*_FL` flag each stands for.
    const XFLAGS: [(u32, u32); 4] = [(0x8, 0x10), (0x10, 0x20), (0x40, 0x80), (0x80, 0x40)];

    /// The `FS_XFLAG_*` bits of inode flags `flags`.
    pub fn xflags_of(flags: u32) -> u32 {
        XFLAGS
            .iter()
            .filter(|&&(_, fl)| flags & fl != 0)
            .fold(0, |x, &(xf, _)| x | xf)
    }

    /// The inode flags `xflags` stand for; `None` when one has no
    /// counterpart.
    pub fn flags_of(xflags: u32) -> Option<u32> {
        let known = XFLAGS.iter().fold(0, |x, &(xf, _)| x | xf);
        (xflags & !known == 0).then(|| {
            XFLAGS
                .iter()
                .filter(|&&(xf, _)| xflags & xf != 0)
                .fold(0, |f, &(_, fl)| f | fl)
        })
    }
}

/// How long the kernel may cache an entry or attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ttl {
    pub secs: u64,
    pub nanos: u32,
}

impl Ttl {
    pub const ZERO: Ttl = Ttl { secs: 0, nanos: 0 };

    pub const fn of(d: std::time::Duration) -> Ttl {
        Ttl {
            secs: d.as_secs(),
            nanos: d.subsec_nanos(),
        }
    }
}

/// `struct fuse_open_out`.
pub fn open_out(w: &mut Writer, fh: u64, open_flags: u32) {
    w.u64(fh).u32(open_flags).i32(0);
}

/// `struct fuse_kstatfs` inside `fuse_statfs_out`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Kstatfs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

impl Kstatfs {
    pub fn write(&self, w: &mut Writer) {
        w.u64(self.blocks)
            .u64(self.bfree)
            .u64(self.bavail)
            .u64(self.files)
            .u64(self.ffree)
            .u32(self.bsize)
            .u32(self.namelen)
            .u32(self.frsize)
            .u32(0);
        for _ in 0..6 {
            w.u32(0);
        }
    }
}

/// One directory entry of a READDIR or READDIRPLUS reply.
#[derive(Clone, Copy, Debug)]
pub struct Dirent<'a> {
    pub ino: u64,
    /// The offset to continue after this entry.
    pub off: u64,
    /// `DT_*` (see [`dirent_type`]).
    pub kind: u32,
    pub name: &'a [u8],
}

impl Dirent<'_> {
    /// Bytes of its `struct fuse_dirent`, padded to 8.
    fn size(&self) -> usize {
        (24 + self.name.len()).next_multiple_of(8)
    }

    fn write(&self, w: &mut Writer) {
        w.u64(self.ino)
            .u64(self.off)
            .u32(self.name.len() as u32)
            .u32(self.kind)
            .bytes(self.name)
            .pad8();
    }
}

/// Appends one `struct fuse_dirent`; `false` when it would not fit in
/// `max` bytes.
pub fn dirent(w: &mut Writer, max: usize, d: &Dirent<'_>) -> bool {
    if w.buf.len() + d.size() > max {
        return false;
    }
    d.write(w);
    true
}

/// What a `struct fuse_direntplus` adds to its dirent: the entry (node
/// id 0 for none: the kernel then takes no reference).
#[derive(Clone, Copy, Debug)]
pub struct EntryOut<'a> {
    pub nodeid: u64,
    pub generation: u64,
    pub entry_ttl: Ttl,
    pub attr_ttl: Ttl,
    pub attr: &'a Attr,
}

/// Appends one `struct fuse_direntplus`; `false` when it would not fit.
pub fn direntplus(w: &mut Writer, max: usize, e: &EntryOut<'_>, d: &Dirent<'_>) -> bool {
    if w.buf.len() + 128 + d.size() > max {
        return false;
    }
    entry_out(w, e.nodeid, e.generation, e.entry_ttl, e.attr_ttl, e.attr);
    d.write(w);
    true
}

/// The `d_type` of a mode (`DT_*`: the mode's type bits shifted down).
pub fn dirent_type(mode: u32) -> u32 {
    (mode & libc::S_IFMT) >> 12
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inval_entry_notification_is_laid_out_as_the_kernel_reads_it() {
        let m = inval_entry_notification(0x0102_0304_0506_0708, b"name");
        // Header: len, error (the notification code), unique 0.
        assert_eq!(m.len(), 16 + 16 + 4 + 1);
        assert_eq!(m[0..4], (m.len() as u32).to_le_bytes());
        assert_eq!(m[4..8], notify::INVAL_ENTRY.to_le_bytes());
        assert_eq!(m[8..16], [0; 8]);
        // fuse_notify_inval_entry_out: parent, namelen, flags.
        assert_eq!(m[16..24], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(m[24..28], 4u32.to_le_bytes());
        assert_eq!(m[28..32], [0; 4]);
        // The name and its NUL.
        assert_eq!(&m[32..], b"name\0");
    }

    #[test]
    fn reader_refuses_short_input() {
        let mut r = Reader::new(&[1, 0, 0, 0, 2]);
        assert_eq!(r.u32(), Ok(1));
        assert_eq!(r.u32(), Err(Truncated));
        let mut r = Reader::new(b"abc\0def");
        assert_eq!(r.name(), Ok(&b"abc"[..]));
        assert_eq!(r.name(), Err(Truncated));
        assert_eq!(r.rest(), b"def");
    }

    #[test]
    fn xflags_and_inode_flags_map_both_ways() {
        use ioctl::{flags_of, xflags_of};
        // immutable, append-only, noatime, nodump
        let all = 0x10 | 0x20 | 0x80 | 0x40;
        assert_eq!(xflags_of(all), 0x8 | 0x10 | 0x40 | 0x80);
        assert_eq!(flags_of(xflags_of(all)), Some(all));
        assert_eq!(flags_of(0), Some(0));
        assert_eq!(flags_of(0x1), None, "FS_XFLAG_REALTIME has no counterpart");
    }

    #[test]
    fn layouts_have_the_kernel_sizes() {
        let mut w = Writer::default();
        Attr::default().write(&mut w);
        assert_eq!(w.buf.len(), 88, "fuse_attr");
        let mut w = Writer::default();
        entry_out(&mut w, 1, 0, Ttl::ZERO, Ttl::ZERO, &Attr::default());
        assert_eq!(w.buf.len(), 128, "fuse_entry_out");
        let mut w = Writer::default();
        attr_out(&mut w, Ttl::ZERO, &Attr::default());
        assert_eq!(w.buf.len(), 104, "fuse_attr_out");
        let mut w = Writer::default();
        statx_out(&mut w, Ttl::ZERO, &Attr::default(), (0, 0), 0);
        assert_eq!(w.buf.len(), 288, "fuse_statx_out");
        let mut w = Writer::default();
        open_out(&mut w, 1, 0);
        assert_eq!(w.buf.len(), 16, "fuse_open_out");
        let mut w = Writer::default();
        Kstatfs::default().write(&mut w);
        assert_eq!(w.buf.len(), 80, "fuse_kstatfs");
        let mut w = Writer::default();
        let d = Dirent {
            ino: 1,
            off: 1,
            kind: 4,
            name: b"abc",
        };
        assert!(dirent(&mut w, 4096, &d));
        assert_eq!(w.buf.len(), 32);
        assert!(!dirent(&mut w, 40, &d));
        let mut w = Writer::default();
        let e = EntryOut {
            nodeid: 1,
            generation: 0,
            entry_ttl: Ttl::ZERO,
            attr_ttl: Ttl::ZERO,
            attr: &Attr::default(),
        };
        assert!(direntplus(&mut w, 4096, &e, &Dirent { name: b"a", ..d }));
        assert_eq!(w.buf.len(), 160);
        assert_eq!(dirent_type(libc::S_IFDIR), 4);
        assert_eq!(dirent_type(libc::S_IFREG | 0o644), 8);
        let header = out_header(24, -libc::ENOENT, 0x0102_0304_0506_0708);
        let mut r = Reader::new(&header);
        assert_eq!(r.u32(), Ok(24), "len");
        assert_eq!(r.u32(), Ok((-libc::ENOENT) as u32), "error");
        assert_eq!(r.u64(), Ok(0x0102_0304_0506_0708), "unique");
    }
}
