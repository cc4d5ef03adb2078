//! From a parsed request to its reply: INIT negotiation, and every other
//! opcode mapped onto one call of [`Operations`] through the
//! [`RequestGuard`], counted in [`RequestStats`]. Both transports
//! (`/dev/fuse` and io_uring) hand requests here and send back what it
//! returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use betreefs_fs::record::{Attr, Timespec};
use betreefs_fs::{
    Caller, Errno, FsResult, Operations, RenameFlags, SetAttr, SetTime, XATTR_ACL_KILL_SGID,
};

use crate::abi::{self, fattr, fopen, init, opcode, Reader, Ttl, Writer};
use crate::after_reply::{self, AfterReply};
use crate::request::{InitIn, Op, Request, SetattrIn};
use crate::stats::Via;
use crate::{MountConfig, RequestGuard, RequestStats, ENTRY_TTL, MAX_REQUEST, TTL};

/// What to send back for one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// Nothing (FORGET, BATCH_FORGET).
    None,
    /// An error number (positive, as errno).
    Error(i32),
    /// Success with this body (possibly empty).
    Ok(Vec<u8>),
}

/// Room a request's reply starts with: the largest of the common fixed
/// replies, CREATE's `fuse_entry_out` and `fuse_open_out` (128 + 16
/// bytes). Grown from empty, a LOOKUP's entry took four reallocations.
/// Larger replies (STATX, READ, GETXATTR) grow from there; READDIR makes
/// room for the size it was asked for.
const FIXED_REPLY_MAX: usize = 144;
/// Room made for a readdir reply up front, at most (the kernel asks for
/// a page of entries, or a few with readdirplus).
const READDIR_RESERVE_MAX: usize = 64 << 10;

impl Reply {
    fn from_result(result: FsResult<Vec<u8>>) -> Reply {
        match result {
            Ok(body) => Reply::Ok(body),
            Err(e) => Reply::Error(e.0),
        }
    }

    /// The `fuse_out_header` for this reply to request `unique`.
    pub fn header(&self, unique: u64) -> [u8; abi::OUT_HEADER_BYTES] {
        let (error, len) = match self {
            Reply::None => (0, 0),
            Reply::Error(e) => (-e, 0),
            Reply::Ok(body) => (0, body.len()),
        };
        abi::out_header((abi::OUT_HEADER_BYTES + len) as u32, error, unique)
    }

    /// The body after the header.
    pub fn body(&self) -> &[u8] {
        match self {
            Reply::Ok(body) => body,
            _ => &[],
        }
    }
}

/// What INIT settled with the kernel.
#[derive(Clone, Copy, Debug)]
pub struct Negotiated {
    pub minor: u32,
    /// The flags granted (ours, limited to what the kernel offered).
    pub flags: u64,
    pub max_write: u32,
}

impl Negotiated {
    pub fn has(&self, flag: u64) -> bool {
        self.flags & flag != 0
    }
}

/// Serves requests for one mount.
pub struct Dispatcher<F> {
    fs: Arc<F>,
    config: MountConfig,
    guard: Arc<RequestGuard>,
    stats: Arc<RequestStats>,
    negotiated: OnceLock<Negotiated>,
    /// Set once the kernel said DESTROY (or the connection ended).
    destroyed: AtomicBool,
    /// The connection's number (its directory under fusectl), once mounted.
    connection: OnceLock<u64>,
    /// Set once the io_uring queues carry the requests: `/dev/fuse` then
    /// carries only FORGET and INTERRUPT, and its readers gather forgets
    /// ([`Dispatcher::gathers_forgets`]).
    requests_on_queues: AtomicBool,
    /// Work requests left for after their replies, on its way from the
    /// serving threads to the after-reply worker.
    after_reply: AfterReply,
}

/// The flags this front end asks for (module documentation of the crate
/// says why each).
fn wanted_flags(config: &MountConfig) -> u64 {
    let mut flags = init::ASYNC_READ
        | init::BIG_WRITES
        | init::DO_READDIRPLUS
        | init::READDIRPLUS_AUTO
        | init::PARALLEL_DIROPS
        | init::ATOMIC_O_TRUNC
        | init::CACHE_SYMLINKS
        | init::MAX_PAGES
        | init::INIT_EXT
        | init::SETXATTR_EXT
        | init::HANDLE_KILLPRIV_V2
        | init::POSIX_ACL
        | init::DONT_MASK
        // File handles (name_to_handle_at, NFS export): LOOKUP of "." and
        // ".." by inode number.
        | init::EXPORT_SUPPORT;
    if config.writeback_cache {
        flags |= init::WRITEBACK_CACHE;
    }
    flags
}

impl<F: Operations> Dispatcher<F> {
    pub fn new(
        fs: Arc<F>,
        config: MountConfig,
        guard: Arc<RequestGuard>,
        stats: Arc<RequestStats>,
    ) -> Self {
        Dispatcher {
            fs,
            config,
            guard,
            stats,
            negotiated: OnceLock::new(),
            destroyed: AtomicBool::new(false),
            connection: OnceLock::new(),
            requests_on_queues: AtomicBool::new(false),
            after_reply: AfterReply::default(),
        }
    }

    /// The mount's counters.
    pub fn stats(&self) -> &RequestStats {
        &self.stats
    }

    /// Called by each serving thread before it serves: the requests it
    /// serves may leave work for after their replies, which it does
    /// itself ([`Dispatcher::work_after_replies`]) or hands to the
    /// after-reply worker ([`Dispatcher::hand_off_work_after_replies`]).
    /// `hands_long_work_on`: the thread hands work flagged long
    /// ([`Dispatcher::work_after_reply_is_long`]) to that worker.
    pub fn serving_thread_started(&self, hands_long_work_on: bool) {
        self.fs.serving_thread_started(hands_long_work_on);
    }

    /// Whether a request left work for after its reply.
    pub fn has_work_after_reply(&self) -> bool {
        !self.guard.failed() && self.fs.has_work_after_reply()
    }

    /// Whether the work left for after replies is long (see
    /// [`Operations::work_after_reply_is_long`]): better handed off.
    pub fn work_after_reply_is_long(&self) -> bool {
        self.fs.work_after_reply_is_long()
    }

    /// Does the work requests left for after their replies, once these
    /// are sent, on the calling thread; a panic in it fails the mount as
    /// one in a request does.
    pub fn work_after_replies(&self) {
        if self.has_work_after_reply() {
            after_reply::injected_hold();
            let _ = self.guard.run(
                || "the work after replies".to_string(),
                || {
                    self.fs.work_after_reply();
                    Ok(())
                },
            );
        }
    }

    /// Hands the work requests left for after their replies, if any, to
    /// the after-reply worker (by a serving thread, once the replies are
    /// on their way).
    pub fn hand_off_work_after_replies(&self) {
        if self.has_work_after_reply() {
            self.after_reply.hand_off();
        }
    }

    /// The after-reply worker (a thread of its own, `crate::after_reply`):
    /// does the work handed off until [`Dispatcher::connection_ended`].
    pub fn work_after_replies_until_ended(&self) {
        while self.after_reply.wait() {
            self.work_after_replies();
        }
    }

    /// The connection ended (a `/dev/fuse` reader read its end): the
    /// after-reply worker stops, and so does the releaser
    /// ([`Dispatcher::has_connection_ended`]).
    pub(crate) fn connection_ended(&self) {
        self.after_reply.end();
    }

    /// Whether [`Dispatcher::connection_ended`] was called.
    pub(crate) fn has_connection_ended(&self) -> bool {
        self.after_reply.ended()
    }

    /// What INIT settled, once it has been answered.
    pub fn negotiated(&self) -> Option<Negotiated> {
        self.negotiated.get().copied()
    }

    pub fn destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Relaxed)
    }

    /// Notes that the io_uring queues took over the requests.
    pub(crate) fn set_requests_on_queues(&self) {
        self.requests_on_queues.store(true, Ordering::Relaxed);
    }

    /// Whether a `/dev/fuse` reader that served a forget should wait
    /// before reading again ([`crate::session::FORGET_GATHERING`]): only
    /// when nothing but FORGET and INTERRUPT comes that way, so that no
    /// other request waits for it.
    pub(crate) fn gathers_forgets(&self) -> bool {
        self.requests_on_queues.load(Ordering::Relaxed)
    }

    /// Entries the file system wants the kernel to drop (none once the
    /// mount is given up or destroyed).
    pub(crate) fn entries_to_release(&self) -> Vec<(u64, Vec<u8>)> {
        if self.destroyed() || self.guard.failed() {
            return Vec::new();
        }
        self.fs.entries_to_release()
    }

    /// Notes the connection's number, for [`Dispatcher::abandon`].
    pub(crate) fn set_connection(&self, id: u64) {
        let _ = self.connection.set(id);
    }

    /// Gives the mount up after a transport broke under it (an io_uring
    /// queue that stopped: the kernel keeps routing that CPU's requests to
    /// it, so they would wait forever). The guard fails every later
    /// request and tells the owner, who unmounts and exits non-zero after
    /// flushing the log; the connection is aborted (fusectl), so requests
    /// already waiting end with an error instead of hanging.
    pub(crate) fn abandon(&self, why: &str) {
        if self.destroyed() {
            return;
        }
        self.guard.fail(why);
        match self.connection.get() {
            Some(&id) => {
                if let Err(e) = crate::mount::abort_connection(id) {
                    tracing::error!("aborting FUSE connection {id}: {e}");
                }
            }
            None => tracing::error!("the FUSE connection's number is unknown: cannot abort it"),
        }
    }

    /// Answers INIT; `Err` with a message when the kernel's protocol is
    /// too old. A kernel with a newer major version gets ours and sends
    /// INIT again.
    /// `uring`: the io_uring queues are ready, so `OVER_IO_URING` may be
    /// granted.
    pub fn init(&self, init_in: &InitIn, uring: bool) -> Result<Reply, String> {
        let mut w = Writer::default();
        if init_in.major > abi::KERNEL_VERSION {
            w.u32(abi::KERNEL_VERSION).u32(abi::KERNEL_MINOR_VERSION);
            w.bytes(&[0; 56]);
            return Ok(Reply::Ok(w.buf));
        }
        if init_in.major < abi::KERNEL_VERSION || init_in.minor < abi::MIN_MINOR_VERSION {
            return Err(format!(
                "the kernel speaks FUSE {}.{}; betreefs needs {}.{} or newer",
                init_in.major,
                init_in.minor,
                abi::KERNEL_VERSION,
                abi::MIN_MINOR_VERSION
            ));
        }
        let mut wanted = wanted_flags(&self.config);
        if uring {
            wanted |= init::OVER_IO_URING;
        }
        let flags = wanted & init_in.flags;
        let negotiated = Negotiated {
            minor: init_in.minor.min(abi::KERNEL_MINOR_VERSION),
            flags,
            max_write: MAX_REQUEST,
        };
        if negotiated.has(init::WRITEBACK_CACHE) {
            self.fs.set_kernel_places_appends(true);
        } else if self.config.writeback_cache {
            tracing::warn!("the kernel does not offer the FUSE writeback cache");
        }
        let _ = self.negotiated.set(negotiated);
        let max_pages = (MAX_REQUEST as usize / page_size()) as u16;
        w.u32(abi::KERNEL_VERSION)
            .u32(negotiated.minor)
            .u32(init_in.max_readahead.min(MAX_REQUEST))
            .u32(flags as u32)
            .u16(MAX_BACKGROUND)
            .u16(MAX_BACKGROUND * 3 / 4)
            .u32(negotiated.max_write)
            // time_gran: timestamps are kept to the nanosecond.
            .u32(1)
            .u16(max_pages)
            .u16(0)
            .u32((flags >> 32) as u32)
            .u32(0)
            .u16(0);
        w.bytes(&[0; 22]);
        Ok(Reply::Ok(w.buf))
    }

    /// Serves one request (INIT aside) and says what to reply.
    pub fn dispatch(&self, req: &Request<'_>, via: Via) -> Reply {
        let started = Instant::now();
        let h = &req.header;
        let reply = match &req.op {
            Op::Forget { nlookup } => {
                self.stats.forgotten(1);
                self.guarded(h.nodeid, opcode::FORGET, |fs| {
                    fs.forget(h.nodeid, *nlookup);
                    Ok(())
                })
                .ok();
                Reply::None
            }
            Op::BatchForget { forgets } => {
                self.stats.forgotten(forgets.len() as u64);
                let first = forgets.first().map_or(0, |&(ino, _)| ino);
                self.guarded(first, opcode::BATCH_FORGET, |fs| {
                    fs.forget_many(forgets);
                    Ok(())
                })
                .ok();
                Reply::None
            }
            Op::Interrupt { .. } => {
                // Requests are short and not interruptible; ENOSYS tells
                // the kernel to stop sending interrupts.
                Reply::Error(libc::ENOSYS)
            }
            Op::Destroy => {
                self.destroyed.store(true, Ordering::Relaxed);
                Reply::Ok(Vec::new())
            }
            op => Reply::from_result(self.guarded(h.nodeid, h.opcode, |fs| {
                let body = self.serve(fs, h, op)?;
                if self.synchronous(h.opcode) {
                    fs.fsync()?;
                }
                Ok(body)
            })),
        };
        self.stats.record(h.opcode, via, started);
        reply
    }

    /// Serves a READ into `buf` (an io_uring payload buffer: no copy of
    /// the data on the way); the bytes read, or the error number.
    pub fn read_into(&self, req: &Request<'_>, buf: &mut [u8], via: Via) -> Result<usize, i32> {
        let started = Instant::now();
        let h = &req.header;
        let Op::Read { offset, size, .. } = req.op else {
            return Err(libc::EINVAL);
        };
        let len = (size as usize).min(buf.len());
        let buf = buf.get_mut(..len).ok_or(libc::EINVAL)?;
        let result = self.guarded(h.nodeid, h.opcode, |fs| {
            crate::guard::injected_delay(h.opcode);
            fs.read(h.nodeid, offset, buf)
        });
        self.stats.record(h.opcode, via, started);
        result.map_err(|e| e.0)
    }

    /// Runs `body`, a request of `op` on `ino`, through the panic guard
    /// (see [`crate::guard`]); the request is named only if it panics.
    fn guarded<T>(&self, ino: u64, op: u32, body: impl FnOnce(&F) -> FsResult<T>) -> FsResult<T> {
        let describe = || format!("{} (inode {ino})", opcode::name(op));
        self.guard.run(describe, || body(&self.fs))
    }

    fn serve(&self, fs: &F, h: &abi::InHeader, op: &Op<'_>) -> FsResult<Vec<u8>> {
        crate::guard::injected_delay(h.opcode);
        let ino = h.nodeid;
        let caller = Caller::new(h.uid, h.gid);
        let mut w = Writer::with_capacity(FIXED_REPLY_MAX);
        match *op {
            // A file handle being decoded: the inode by number, and the
            // parents of a directory up to the root.
            Op::Lookup { name: b"." } => entry(&mut w, &fs.lookup_by_number(ino)?),
            Op::Lookup { name: b".." } => entry(&mut w, &fs.lookup_parent(ino)?),
            Op::Lookup { name } => {
                crate::guard::injected_panic(name);
                match fs.lookup(ino, name) {
                    Ok(a) => entry(&mut w, &a),
                    // A negative entry: the kernel caches the absence for
                    // the TTL, so a create right after needs no lookup.
                    Err(Errno::ENOENT) => {
                        abi::entry_out(&mut w, 0, 0, entry_ttl(), ttl(), &abi::Attr::default());
                    }
                    Err(e) => return Err(e),
                }
            }
            Op::Getattr { .. } => abi::attr_out(&mut w, ttl(), &kernel_attr(&fs.getattr(ino)?)),
            Op::Setattr(ref s) => {
                let a = fs.setattr(ino, &set_attr(s, caller))?;
                abi::attr_out(&mut w, ttl(), &kernel_attr(&a));
            }
            Op::Readlink => return fs.readlink(ino),
            Op::Symlink { name, target } => entry(&mut w, &fs.symlink(ino, name, target, caller)?),
            Op::Mknod {
                mode,
                rdev,
                umask,
                name,
            } => entry(&mut w, &fs.mknod(ino, name, mode, rdev, caller.with_umask(umask))?),
            Op::Mkdir { mode, umask, name } => {
                entry(&mut w, &fs.mkdir(ino, name, mode, caller.with_umask(umask))?)
            }
            Op::Unlink { name } => fs.unlink(ino, name)?,
            Op::Rmdir { name } => fs.rmdir(ino, name)?,
            Op::Rename {
                newdir,
                flags,
                name,
                newname,
            } => {
                let known = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE | libc::RENAME_WHITEOUT;
                if flags & !known != 0 {
                    return Err(Errno::EINVAL);
                }
                let flags = RenameFlags {
                    noreplace: flags & libc::RENAME_NOREPLACE != 0,
                    exchange: flags & libc::RENAME_EXCHANGE != 0,
                    whiteout: (flags & libc::RENAME_WHITEOUT != 0).then_some(caller),
                };
                fs.rename(ino, name, newdir, newname, flags)?
            }
            Op::Link { oldnodeid, name } => entry(&mut w, &fs.link(oldnodeid, ino, name)?),
            Op::Open { flags, open_flags } => {
                let kill = (open_flags & abi::OPEN_KILL_SUIDGID != 0).then_some(caller);
                let fh = fs.open(ino, flags as i32, kill)?;
                abi::open_out(&mut w, fh, fopen::KEEP_CACHE);
            }
            Op::Create {
                flags,
                mode,
                umask,
                name,
                ..
            } => {
                let (a, fh) = fs.create(ino, name, mode, flags as i32, caller.with_umask(umask))?;
                entry(&mut w, &a);
                abi::open_out(&mut w, fh, fopen::KEEP_CACHE);
            }
            Op::Read { offset, size, .. } => {
                let mut buf = vec![0; size as usize];
                let n = fs.read(ino, offset, &mut buf)?;
                buf.truncate(n);
                return Ok(buf);
            }
            Op::Write {
                fh,
                offset,
                data,
                write_flags,
            } => {
                let kill = (write_flags & abi::WRITE_KILL_SUIDGID != 0).then_some(caller);
                let n = fs.write(ino, fh, offset, data, kill)?;
                w.u32(n).u32(0);
            }
            Op::Statfs => {
                let s = fs.statfs();
                abi::Kstatfs {
                    blocks: s.blocks,
                    bfree: s.blocks_free,
                    bavail: s.blocks_free,
                    files: s.files,
                    ffree: s.files_free,
                    bsize: s.block_size as u32,
                    namelen: s.name_max as u32,
                    frsize: s.block_size as u32,
                }
                .write(&mut w);
            }
            Op::Release { fh } => fs.release(fh)?,
            Op::Fsync { .. } | Op::Fsyncdir { .. } | Op::Syncfs => fs.fsync()?,
            Op::Setxattr {
                flags,
                setxattr_flags,
                name,
                value,
            } => {
                let mut flags = flags as i32 & !XATTR_ACL_KILL_SGID;
                if setxattr_flags & abi::SETXATTR_ACL_KILL_SGID != 0 {
                    flags |= XATTR_ACL_KILL_SGID;
                }
                fs.setxattr(ino, name, value, flags)?
            }
            Op::Getxattr { size, name } => return xattr_reply(size, fs.getxattr(ino, name)?),
            Op::Listxattr { size } => return xattr_reply(size, fs.listxattr(ino)?),
            Op::Removexattr { name } => fs.removexattr(ino, name)?,
            Op::Readdir {
                offset, size, plus, ..
            } => {
                let max = size as usize;
                // The reply is filled to about `max`: room for it at once
                // (growing from the fixed replies' size copied it up to
                // six times, 4% of listing a tree).
                w.buf.reserve(max.min(READDIR_RESERVE_MAX));
                fs.readdir(ino, offset, plus, &mut |e| {
                    let d = abi::Dirent {
                        ino: e.ino,
                        off: e.offset,
                        kind: abi::dirent_type(e.file_type),
                        name: e.name,
                    };
                    let fits = if plus {
                        // "." and ".." come without attributes, as node
                        // id 0: the kernel takes no reference for them.
                        let attr = e.attr.map(kernel_attr).unwrap_or_default();
                        let entry = abi::EntryOut {
                            nodeid: if e.attr.is_some() { e.ino } else { 0 },
                            generation: 0,
                            entry_ttl: if e.attr.is_some() { entry_ttl() } else { Ttl::ZERO },
                            attr_ttl: if e.attr.is_some() { ttl() } else { Ttl::ZERO },
                            attr: &attr,
                        };
                        abi::direntplus(&mut w, max, &entry, &d)
                    } else {
                        abi::dirent(&mut w, max, &d)
                    };
                    !fits
                })?;
            }
            // Never sent once OPENDIR said ENOSYS.
            Op::Releasedir { .. } => {}
            Op::Fallocate {
                offset,
                length,
                mode,
                ..
            } => {
                fs.fallocate(ino, offset, length, mode as i32, self.kill_without_flag(caller))?
            }
            Op::CopyFileRange {
                off_in,
                nodeid_out,
                fh_out,
                off_out,
                len,
                flags,
                ..
            } => {
                if flags != 0 {
                    return Err(Errno::EINVAL);
                }
                // The reply's count is 32 bits; the kernel asks again for
                // the rest.
                let len = len.min(u64::from(u32::MAX) & !(abi::PAGE_BYTES - 1));
                let kill = self.kill_without_flag(caller);
                let n = fs.copy_range(ino, off_in, nodeid_out, fh_out, off_out, len, kill)?;
                w.u32(n as u32).u32(0);
            }
            Op::Tmpfile { flags, mode, umask } => {
                let (a, fh) = fs.tmpfile(ino, mode, flags as i32, caller.with_umask(umask))?;
                entry(&mut w, &a);
                abi::open_out(&mut w, fh, fopen::KEEP_CACHE);
            }
            Op::Ioctl { cmd, input, .. } if cmd == abi::ioctl::BETREEFS_IOC_CLONE_TREE => {
                let src = Reader::new(input).u64().map_err(|_| Errno::EINVAL)?;
                fs.clone_tree_into(src, ino, caller)?;
                abi::ioctl_out(&mut w, 0, &[]);
            }
            Op::Ioctl {
                cmd,
                out_size,
                input,
                ..
            } => inode_flag_ioctl(fs, ino, cmd, out_size, input, &mut w)?,
            Op::Statx { .. } => {
                let a = fs.getattr(ino)?;
                let btime = (a.crtime.sec, a.crtime.nsec);
                let attributes = u64::from(a.flags);
                abi::statx_out(&mut w, ttl(), &kernel_attr(&a), btime, attributes);
            }
            Op::Lseek { offset, whence, .. } => {
                let at = fs.seek_data_or_hole(ino, offset, whence as i32)?;
                w.u64(at);
            }
            Op::Init(_)
            | Op::Destroy
            | Op::Forget { .. }
            | Op::BatchForget { .. }
            | Op::Interrupt { .. }
            | Op::Access { .. }
            // Nothing to do at close: everything is written through, and
            // ENOSYS stops the kernel sending FLUSH on every close.
            | Op::Flush { .. }
            // Directories need no handle (offsets are stateless cookies):
            // ENOSYS makes the kernel stop sending OPENDIR and RELEASEDIR,
            // and cache listings across opens (FOPEN_CACHE_DIR, its
            // default then).
            | Op::Opendir { .. }
            | Op::Unsupported(_) => return Err(Errno(libc::ENOSYS)),
        }
        Ok(w.buf)
    }

    /// Whether a successful request of this opcode must be durable before
    /// its reply: every change with `-o sync`, changes of directories
    /// with `-o dirsync` (the kernel itself only asks for an fsync after
    /// writes of a `sync` mount).
    fn synchronous(&self, op: u32) -> bool {
        use opcode::*;
        let flags = &self.config.flags;
        let namespace = matches!(
            op,
            MKNOD | MKDIR | SYMLINK | UNLINK | RMDIR | RENAME | RENAME2 | LINK | CREATE
        );
        let other_change = matches!(
            op,
            SETATTR
                | WRITE
                | SETXATTR
                | REMOVEXATTR
                | FALLOCATE
                | COPY_FILE_RANGE
                | TMPFILE
                | IOCTL
        );
        (flags.sync && (namespace || other_change)) || (flags.dirsync && namespace)
    }

    /// Who loses set-ID bits for a change whose request carries no kill
    /// flag (FALLOCATE, COPY_FILE_RANGE): with killpriv_v2 the kernel
    /// leaves it to us, for any caller but root (CAP_FSETID is not
    /// visible from here).
    fn kill_without_flag(&self, caller: Caller) -> Option<Caller> {
        let killpriv = self
            .negotiated()
            .is_some_and(|n| n.has(init::HANDLE_KILLPRIV_V2));
        (killpriv && caller.uid != 0).then_some(caller)
    }
}

/// The inode-flag ioctls (`chattr`, `lsattr`, `xfs_io chattr`): the
/// kernel's fileattr_get/set send them, having checked ownership and
/// CAP_LINUX_IMMUTABLE. Any other command is not ours (`ENOTTY`).
fn inode_flag_ioctl<F: Operations>(
    fs: &F,
    ino: u64,
    cmd: u32,
    out_size: u32,
    input: &[u8],
    w: &mut Writer,
) -> FsResult<()> {
    use abi::ioctl::*;
    let reply = |w: &mut Writer, data: &[u8]| {
        let mut data = data.to_vec();
        data.resize(out_size as usize, 0);
        abi::ioctl_out(w, 0, &data);
    };
    let first_u32 = || Reader::new(input).u32().map_err(|_| Errno::EINVAL);
    match cmd {
        FS_IOC_GETFLAGS | FS_IOC32_GETFLAGS => reply(w, &fs.inode_flags(ino)?.to_le_bytes()),
        FS_IOC_SETFLAGS | FS_IOC32_SETFLAGS => {
            fs.set_inode_flags(ino, first_u32()?)?;
            reply(w, &[]);
        }
        FS_IOC_FSGETXATTR => reply(w, &xflags_of(fs.inode_flags(ino)?).to_le_bytes()),
        FS_IOC_FSSETXATTR => {
            let xflags = first_u32()?;
            // No extent sizes or project ids here.
            let rest = input.get(4..FSXATTR_BYTES).ok_or(Errno::EINVAL)?;
            let (extsize, projid_and_cow) = (rest.get(..4), rest.get(8..16));
            let zero = |b: Option<&[u8]>| b.is_some_and(|b| b.iter().all(|&x| x == 0));
            let flags = flags_of(xflags)
                .filter(|_| zero(extsize) && zero(projid_and_cow))
                .ok_or(Errno::EOPNOTSUPP)?;
            fs.set_inode_flags(ino, flags)?;
            reply(w, &[]);
        }
        _ => return Err(Errno(libc::ENOTTY)),
    }
    Ok(())
}

/// Background requests the kernel may have outstanding (readahead,
/// asynchronous direct IO); congestion starts at three quarters of it.
const MAX_BACKGROUND: u16 = 64;

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

fn ttl() -> Ttl {
    Ttl::of(TTL)
}

fn entry_ttl() -> Ttl {
    Ttl::of(ENTRY_TTL)
}

fn entry(w: &mut Writer, a: &Attr) {
    abi::entry_out(w, a.ino, 0, entry_ttl(), ttl(), &kernel_attr(a));
}

/// The kernel's view of an inode's attributes.
pub fn kernel_attr(a: &Attr) -> abi::Attr {
    abi::Attr {
        ino: a.ino,
        size: a.size,
        blocks: a.blocks(),
        atime: (a.atime.sec, a.atime.nsec),
        mtime: (a.mtime.sec, a.mtime.nsec),
        ctime: (a.ctime.sec, a.ctime.nsec),
        mode: a.mode,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: betreefs_fs::fs::BLOCK_SIZE as u32,
    }
}

/// A SETATTR request as the file system's [`SetAttr`].
fn set_attr(s: &SetattrIn, caller: Caller) -> SetAttr {
    let has = |bit: u32| s.valid & bit != 0;
    let time = |set: u32, now: u32, (sec, nsec): (i64, u32)| {
        if has(now) {
            Some(SetTime::Now)
        } else if has(set) {
            Some(SetTime::At(Timespec { sec, nsec }))
        } else {
            None
        }
    };
    SetAttr {
        mode: has(fattr::MODE).then_some(s.mode),
        uid: has(fattr::UID).then_some(s.uid),
        gid: has(fattr::GID).then_some(s.gid),
        size: has(fattr::SIZE).then_some(s.size),
        atime: time(fattr::ATIME, fattr::ATIME_NOW, s.atime),
        mtime: time(fattr::MTIME, fattr::MTIME_NOW, s.mtime),
        ctime: has(fattr::CTIME).then_some(Timespec {
            sec: s.ctime.0,
            nsec: s.ctime.1,
        }),
        through_open_file: has(fattr::FH),
        kill_privileges: has(fattr::KILL_SUIDGID).then_some(caller),
    }
}

/// getxattr/listxattr: the size when asked for it (`fuse_getxattr_out`),
/// else the bytes, or ERANGE when they do not fit.
fn xattr_reply(size: u32, value: Vec<u8>) -> FsResult<Vec<u8>> {
    if size == 0 {
        let mut w = Writer::default();
        w.u32(value.len() as u32).u32(0);
        Ok(w.buf)
    } else if value.len() > size as usize {
        Err(Errno(libc::ERANGE))
    } else {
        Ok(value)
    }
}

/// Reads the `unique` of a reply header (for tests and transports).
pub fn reply_unique(header: &[u8]) -> Option<u64> {
    let mut r = Reader::new(header);
    r.skip(8).ok()?;
    r.u64().ok()
}
