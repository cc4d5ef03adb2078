//! A mounted file system being served: the connection, INIT, and the
//! threads that answer requests until the file system is unmounted.
//!
//! INIT is answered before [`mount`] returns, so a mount that cannot be
//! served fails there with a message. Requests then go to worker threads,
//! each reading its own clone of the connection (a reply must be written
//! to the descriptor its request was read from), and, when the kernel and
//! the configuration allow it, to io_uring queues (see [`crate::uring`]).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use betreefs_fs::Operations;

use crate::abi::{self, init, opcode};
use crate::dispatch::{Dispatcher, Reply};
use crate::mount::{self, MountRequest};
use crate::request::{Op, Request};
use crate::stats::Via;
use crate::uring::{self, PreparedQueues};
use crate::{MountConfig, RequestGuard, RequestStats, Transport, MAX_REQUEST};

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// The read buffer: the largest write with its headers, and never less
/// than the kernel's minimum.
pub(crate) const READ_BUFFER: usize = MAX_REQUEST as usize + 4096;

/// How long a `/dev/fuse` reader waits after serving a forget, when the
/// io_uring queues carry every other request. The kernel queues a
/// forget for each inode it evicts and hands a reader everything queued
/// as one BATCH_FORGET; read at once, each comes alone, a wake-up, a
/// read and a turn of the table's lock apiece. `rm -rf` of the kernel
/// tree (78K files) made 78K such reads, a third of the daemon's CPU
/// (docs/benchmarks/forget-gathering.md). A forget frees memory only,
/// and nothing else waits on this thread then, so a short wait costs
/// nothing.
pub(crate) const FORGET_GATHERING: Duration = Duration::from_millis(2);

/// How often the releaser asks the file system for entries the kernel
/// should drop ([`release_entries`]): a table past its limit stays there
/// this long at most, plus the FORGETs' way back.
const RELEASE_INTERVAL: Duration = Duration::from_millis(50);

/// A served mount; [`Session::join`] returns once it is unmounted.
pub struct Session {
    mountpoint: PathBuf,
    workers: Vec<JoinHandle<()>>,
    /// Which transport carries the requests (for logs and tests).
    pub transport: ActiveTransport,
}

/// The transport a session ended up with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ActiveTransport {
    DevFuse,
    /// io_uring, with this many queues.
    Uring {
        queues: usize,
    },
}

impl Session {
    /// Waits until the file system is unmounted and every request thread
    /// has finished.
    pub fn join(self) -> io::Result<()> {
        let mut panicked = false;
        for worker in self.workers {
            panicked |= worker.join().is_err();
        }
        if panicked {
            return Err(io::Error::other(format!(
                "a request thread of {} panicked",
                self.mountpoint.display()
            )));
        }
        Ok(())
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }
}

/// Mounts `fs` on `mountpoint` as `fuse.<subtype>`, answers INIT, and
/// starts serving requests in the background.
pub fn mount<F: Operations>(
    fs: Arc<F>,
    mountpoint: &Path,
    config: &MountConfig,
    subtype: &str,
    guard: Arc<RequestGuard>,
    stats: Arc<RequestStats>,
) -> io::Result<Session> {
    let fd = mount::mount(&MountRequest {
        mountpoint,
        fs_name: &config.fs_name,
        subtype,
        allow_other: config.allow_other,
        flags: config.flags,
    })?;
    let dispatcher = Arc::new(Dispatcher::new(fs, config.clone(), guard, stats));
    let started = answer_init(&fd, &dispatcher, config)
        .and_then(|queues| start_workers(fd, &dispatcher, config, mountpoint, queues));
    match started {
        Ok(session) => Ok(session),
        Err(e) => {
            let _ = mount::unmount(mountpoint);
            Err(e)
        }
    }
}

/// Reads requests until INIT has been answered with our version. The
/// io_uring queues are made first when the kernel offers them (and the
/// configuration wants them), so that the flag is granted only when they
/// exist.
fn answer_init<F: Operations>(
    fd: &OwnedFd,
    dispatcher: &Dispatcher<F>,
    config: &MountConfig,
) -> io::Result<Option<PreparedQueues>> {
    let mut buf = vec![0u8; READ_BUFFER];
    let mut queues = None;
    while dispatcher.negotiated().is_none() {
        let n = match read_request(fd.as_raw_fd(), &mut buf)? {
            Some(n) => n,
            None => return Err(io::Error::other("unmounted before INIT")),
        };
        let data = buf.get(..n).unwrap_or_default();
        let req = Request::parse(data).map_err(|_| io::Error::other("a malformed INIT"))?;
        let reply = match &req.op {
            Op::Init(init_in) => {
                queues = uring_queues(init_in.flags & init::OVER_IO_URING != 0, config)?;
                dispatcher
                    .init(init_in, queues.is_some())
                    .map_err(io::Error::other)?
            }
            // Nothing else can come first; answer it anyway.
            _ => Reply::Error(libc::EIO),
        };
        write_reply(fd.as_raw_fd(), req.header.unique, &reply)?;
    }
    Ok(queues)
}

/// The io_uring queues to offer the kernel, if any.
fn uring_queues(offered: bool, config: &MountConfig) -> io::Result<Option<PreparedQueues>> {
    match (config.transport, offered) {
        (Transport::DevFuse, _) | (Transport::Auto, false) => Ok(None),
        (Transport::Uring, false) => Err(io::Error::other(
            "transport=uring: the kernel does not offer FUSE over io_uring (it needs Linux \
             6.14 or newer with CONFIG_FUSE_IO_URING and the fuse module parameter \
             enable_uring=1: echo 1 > /sys/module/fuse/parameters/enable_uring)",
        )),
        (transport, true) => match uring::prepare() {
            Ok(queues) => Ok(Some(queues)),
            Err(e) if transport == Transport::Uring => Err(io::Error::other(format!(
                "transport=uring: cannot set up the io_uring queues: {e}"
            ))),
            Err(e) => {
                tracing::warn!("FUSE over io_uring not used: cannot set up its queues: {e}");
                Ok(None)
            }
        },
    }
}

fn start_workers<F: Operations>(
    fd: OwnedFd,
    dispatcher: &Arc<Dispatcher<F>>,
    config: &MountConfig,
    mountpoint: &Path,
    queues: Option<PreparedQueues>,
) -> io::Result<Session> {
    let fd = Arc::new(fd);
    let mut workers = Vec::new();
    // The /dev/fuse readers first: they carry FORGET and INTERRUPT in any
    // case, and everything if the queues fail to register.
    for i in 0..config.threads.max(1) {
        let conn = if i == 0 {
            fd.clone()
        } else {
            Arc::new(clone_connection(&fd)?)
        };
        let dispatcher = dispatcher.clone();
        let worker = std::thread::Builder::new()
            .name(format!("fuse-dev-{i}"))
            .spawn(move || {
                serve_device(&conn, &dispatcher);
                // The after-reply worker and the releaser stop.
                dispatcher.connection_ended();
            })?;
        workers.push(worker);
    }
    if queues.is_some() {
        // Only io_uring queues hand their work after replies off
        // (`crate::after_reply`); `/dev/fuse` readers do it themselves.
        let dispatcher = dispatcher.clone();
        let worker = std::thread::Builder::new()
            .name("fuse-after-reply".into())
            .spawn(move || {
                crate::after_reply::lower_worker_priority();
                dispatcher.work_after_replies_until_ended()
            })?;
        workers.push(worker);
    }
    {
        let (conn, dispatcher) = (fd.clone(), dispatcher.clone());
        let worker = std::thread::Builder::new()
            .name("fuse-release".into())
            .spawn(move || release_entries(&conn, &dispatcher))?;
        workers.push(worker);
    }
    let transport = match queues {
        None => ActiveTransport::DevFuse,
        Some(queues) => match uring::start(queues, &fd, dispatcher, &mut workers) {
            Ok(queues) => {
                dispatcher.set_requests_on_queues();
                ActiveTransport::Uring { queues }
            }
            Err(e) if config.transport == Transport::Uring => {
                return Err(io::Error::other(format!(
                    "transport=uring: the io_uring queues did not register: {e}"
                )))
            }
            Err(e) => {
                tracing::warn!("FUSE over io_uring: {e}; serving through /dev/fuse");
                ActiveTransport::DevFuse
            }
        },
    };
    let name = match &transport {
        ActiveTransport::DevFuse => "devfuse".to_string(),
        ActiveTransport::Uring { queues } => format!("uring ({queues} queues)"),
    };
    tracing::info!("serving {} through {name}", mountpoint.display());
    dispatcher.stats().set_transport(name);
    match mount::connection_id(mountpoint) {
        Some(id) => dispatcher.set_connection(id),
        None => tracing::warn!("{}: no FUSE connection number found", mountpoint.display()),
    }
    Ok(Session {
        mountpoint: mountpoint.to_path_buf(),
        workers,
        transport,
    })
}

/// A second descriptor on the same connection, read by its own thread.
fn clone_connection(fd: &OwnedFd) -> io::Result<OwnedFd> {
    let dev = c"/dev/fuse";
    // SAFETY: dev is a valid NUL-terminated path.
    let raw = unsafe { libc::open(dev.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw was just opened and is owned only here.
    let clone = unsafe { OwnedFd::from_raw_fd(raw) };
    let session_fd: u32 = fd.as_raw_fd() as u32;
    // SAFETY: FUSE_DEV_IOC_CLONE reads one u32 (the descriptor to clone)
    // from the pointer, which points to a live local.
    let r = unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE, &session_fd) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(clone)
}

/// Reads one request; `None` once the file system is unmounted.
pub(crate) fn read_request(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            // Interrupted, or a request the kernel took back before it
            // was read: read again.
            Some(libc::EINTR | libc::EAGAIN | libc::ENOENT) => continue,
            Some(libc::ENODEV) => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Writes the reply to request `unique` (nothing for [`Reply::None`]).
pub(crate) fn write_reply(fd: RawFd, unique: u64, reply: &Reply) -> io::Result<()> {
    if *reply == Reply::None {
        return Ok(());
    }
    match write_message(fd, &reply.header(unique), reply.body()) {
        // The request was interrupted and is gone: nothing to answer.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        written => written,
    }
}

/// Writes one message to the kernel, `header` then `body`, in one
/// `writev` (a reply, or a notification whole in `header`).
fn write_message(fd: RawFd, header: &[u8], body: &[u8]) -> io::Result<()> {
    let iov = [
        libc::iovec {
            iov_base: header.as_ptr() as *mut libc::c_void,
            iov_len: header.len(),
        },
        libc::iovec {
            iov_base: body.as_ptr() as *mut libc::c_void,
            iov_len: body.len(),
        },
    ];
    let count = if body.is_empty() { 1 } else { 2 };
    // SAFETY: both iovecs point to live buffers of the given lengths.
    let n = unsafe { libc::writev(fd, iov.as_ptr(), count) };
    if n >= 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The releaser: tells the kernel to drop the entries the file system
/// asks it to ([`Operations::entries_to_release`]), until the connection
/// ends. A thread of its own, serving no request: the kernel takes the
/// parent directory's lock for each, which a request in that directory
/// may hold while it waits for its reply.
fn release_entries<F: Operations>(fd: &OwnedFd, dispatcher: &Dispatcher<F>) {
    while !dispatcher.has_connection_ended() {
        std::thread::sleep(RELEASE_INTERVAL);
        for (parent, name) in dispatcher.entries_to_release() {
            let message = abi::inval_entry_notification(parent, &name);
            let Err(e) = write_message(fd.as_raw_fd(), &message, &[]) else {
                dispatcher.stats().released(1);
                continue;
            };
            match e.raw_os_error() {
                // The kernel no longer has the directory: nothing to drop.
                Some(libc::ENOENT) => {}
                Some(libc::ENODEV) => return,
                _ => {
                    tracing::warn!("telling the kernel to drop an entry: {e}");
                    return;
                }
            }
        }
    }
}

/// One worker: read a request, serve it, write the reply, until unmount.
fn serve_device<F: Operations>(fd: &OwnedFd, dispatcher: &Dispatcher<F>) {
    let raw = fd.as_raw_fd();
    let mut buf = vec![0u8; READ_BUFFER];
    // Several readers, unpinned: the next request goes to another, and
    // this one does the work itself however long.
    dispatcher.serving_thread_started(false);
    loop {
        let n = match read_request(raw, &mut buf) {
            Ok(Some(n)) => n,
            Ok(None) => return,
            Err(e) => {
                tracing::error!("reading /dev/fuse: {e}");
                return;
            }
        };
        let data = buf.get(..n).unwrap_or_default();
        let mut forgets = false;
        let (unique, reply) = match Request::parse(data) {
            Ok(req) => {
                forgets = matches!(req.op, Op::Forget { .. } | Op::BatchForget { .. });
                (req.header.unique, serve_one(dispatcher, &req, Via::Device))
            }
            Err(_) => match abi::InHeader::parse(&mut abi::Reader::new(data)) {
                Ok(h) => {
                    tracing::warn!("malformed {} request", opcode::name(h.opcode));
                    (h.unique, Reply::Error(libc::EIO))
                }
                Err(_) => {
                    tracing::error!("a request of {n} bytes without a header");
                    continue;
                }
            },
        };
        if let Err(e) = write_reply(raw, unique, &reply) {
            tracing::warn!("replying to the kernel: {e}");
        }
        dispatcher.work_after_replies();
        if forgets && dispatcher.gathers_forgets() {
            std::thread::sleep(FORGET_GATHERING);
        }
    }
}

/// Serves a request read after INIT (a repeated INIT is refused).
pub(crate) fn serve_one<F: Operations>(
    dispatcher: &Dispatcher<F>,
    req: &Request<'_>,
    via: Via,
) -> Reply {
    match req.op {
        Op::Init(_) => Reply::Error(libc::EPROTO),
        _ => dispatcher.dispatch(req, via),
    }
}
