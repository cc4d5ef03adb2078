//! FUSE over io_uring (Linux 6.14+, `FUSE_OVER_IO_URING`): one queue per
//! possible CPU, each an io_uring of its own served by a thread pinned to
//! that CPU (except while data streams: see [`QueueAffinity`]). A request
//! issued on CPU n is delivered into a buffer of queue n's ring, and its
//! reply goes back with the command that also fetches the next request
//! (`COMMIT_AND_FETCH`): one system call per request on the CPU that
//! issued it, where `/dev/fuse` needs a read, a write and a cross-CPU
//! wake-up. A queue that stops while the mount lives gives the mount up
//! ([`Dispatcher::abandon`]). FORGET, INTERRUPT and INIT still come through
//! `/dev/fuse`, which keeps its readers.
//!
//! Written from the kernel's `include/uapi/linux/fuse.h` (7.42+). Each
//! ring entry is a pair of buffers registered with the kernel:
//!
//! ```text
//! header buffer (struct fuse_uring_req_header, 288 bytes):
//!   0    in_out[128]   fuse_in_header of a request / fuse_out_header of its reply
//!   128  op_in[128]    the opcode's argument struct (fuse_*_in)
//!   256  ent_in_out    u64 flags, u64 commit_id, u32 payload_sz, u32 pad, u64 reserved
//! payload buffer: names and data of a request / the body of its reply,
//!   at least max(8 KiB, max_write, max_pages * page size) bytes
//! ```
//!
//! The command area of each 128-byte SQE (`IORING_OP_URING_CMD` on the
//! `/dev/fuse` descriptor) holds `struct fuse_uring_cmd_req`: u64 flags,
//! u64 commit_id, u16 qid. REGISTER passes the two buffers as an iovec
//! array (`addr`, `len` = 2); its completion is the first request.
//!
//! Every queue must register before the kernel uses any (until then new
//! requests wait), so the rings are made before INIT is answered and the
//! flag is only granted when they all exist; a queue that fails to
//! register afterwards makes the kernel fall back to `/dev/fuse` (a
//! REGISTER that fails turns io_uring off for the connection: the failing
//! queue sends one with an invalid queue id on purpose).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use betreefs_fs::Operations;
use io_uring::{opcode as uring_op, squeue, types, IoUring};

use crate::abi::{self, Reader};
use crate::after_reply::QueueClients;
use crate::dispatch::{Dispatcher, Reply};
use crate::request::Request;
use crate::session::serve_one;
use crate::stats::Via;
use crate::MAX_REQUEST;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `sizeof(struct fuse_uring_req_header)`.
const HEADER_BYTES: usize = 288;
const OP_IN_OFFSET: usize = 128;
const COMMIT_ID_OFFSET: usize = 264;
const PAYLOAD_SZ_OFFSET: usize = 272;
/// Memory the queues' payload buffers may take together.
const PAYLOAD_BUDGET: usize = 64 << 20;
/// Entries per queue at most.
const MAX_DEPTH: usize = 4;

/// One registered pair of buffers. They stay allocated, at the same
/// address, for as long as the ring that registered them exists: the
/// kernel keeps their addresses.
struct RingEntry {
    header: Box<[u8]>,
    payload: Box<[u8]>,
    iov: Box<[libc::iovec; 2]>,
    registered: bool,
}

// SAFETY: the iovec pointers point into the entry's own boxed buffers;
// the entry moves between threads only together with them.
unsafe impl Send for RingEntry {}

impl RingEntry {
    fn new(payload_bytes: usize) -> RingEntry {
        let mut header = vec![0u8; HEADER_BYTES].into_boxed_slice();
        let mut payload = vec![0u8; payload_bytes].into_boxed_slice();
        let iov = Box::new([
            libc::iovec {
                iov_base: header.as_mut_ptr().cast(),
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: payload.as_mut_ptr().cast(),
                iov_len: payload.len(),
            },
        ]);
        RingEntry {
            header,
            payload,
            iov,
            registered: false,
        }
    }

    fn u64_at(&self, at: usize) -> u64 {
        let mut r = Reader::new(self.header.get(at..).unwrap_or_default());
        r.u64().unwrap_or(0)
    }

    fn u32_at(&self, at: usize) -> u32 {
        let mut r = Reader::new(self.header.get(at..).unwrap_or_default());
        r.u32().unwrap_or(0)
    }

    /// The reply's `fuse_out_header` and payload size, for a body of
    /// `body_len` bytes already in the payload buffer; `error` negative or 0.
    fn set_out_header(&mut self, unique: u64, error: i32, body_len: usize) {
        let header = abi::out_header((abi::OUT_HEADER_BYTES + body_len) as u32, error, unique);
        if let Some(dst) = self.header.get_mut(..abi::OUT_HEADER_BYTES) {
            dst.copy_from_slice(&header);
        }
        if let Some(dst) = self
            .header
            .get_mut(PAYLOAD_SZ_OFFSET..PAYLOAD_SZ_OFFSET + 4)
        {
            dst.copy_from_slice(&(body_len as u32).to_le_bytes());
        }
    }

    /// The reply to a READ whose data is already in the payload buffer
    /// (`Ok(len)`), or its error number.
    fn set_reply_in_place(&mut self, unique: u64, result: Result<usize, i32>) {
        match result {
            Ok(len) => self.set_out_header(unique, 0, len.min(self.payload.len())),
            Err(e) => self.set_out_header(unique, -e, 0),
        }
    }

    /// Puts a reply into the buffers for COMMIT_AND_FETCH. The ring has no
    /// reply-less requests: "no reply" commits an empty success.
    fn set_reply(&mut self, unique: u64, reply: &Reply) {
        match reply {
            Reply::Ok(body) => match self.payload.get_mut(..body.len()) {
                Some(dst) => {
                    dst.copy_from_slice(body);
                    self.set_out_header(unique, 0, body.len());
                }
                // Cannot happen with the negotiated sizes; never truncate.
                None => self.set_out_header(unique, -libc::EIO, 0),
            },
            Reply::Error(e) => self.set_out_header(unique, -e, 0),
            Reply::None => self.set_out_header(unique, 0, 0),
        }
    }
}

/// One queue: its ring and entries (the ring is dropped first: that
/// cancels the commands before the buffers go).
struct Queue {
    ring: IoUring<squeue::Entry128>,
    entries: Vec<RingEntry>,
    qid: u16,
}

/// The rings, made before INIT is answered.
pub(crate) struct PreparedQueues {
    queues: Vec<Queue>,
}

/// How many queues the kernel expects: one per possible CPU.
pub(crate) fn queue_count() -> usize {
    if let Ok(list) = std::fs::read_to_string("/sys/devices/system/cpu/possible") {
        let count: usize = list
            .trim()
            .split(',')
            .filter_map(|part| match part.split_once('-') {
                Some((a, b)) => Some(b.parse::<usize>().ok()? + 1 - a.parse::<usize>().ok()?),
                None => part.parse::<usize>().ok().map(|_| 1),
            })
            .sum();
        if count > 0 {
            return count;
        }
    }
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(1)
}

/// The payload buffer the kernel requires: at least the largest request
/// (`max(FUSE_MIN_READ_BUFFER, max_write, max_pages * page)`).
fn payload_bytes() -> usize {
    (MAX_REQUEST as usize).max(abi::MIN_READ_BUFFER)
}

/// Makes every queue's ring and buffers; an error means io_uring cannot
/// be used here (the caller then does not ask for it).
pub(crate) fn prepare() -> io::Result<PreparedQueues> {
    let count = queue_count();
    let qids = u16::try_from(count).map_err(|_| io::Error::other("too many CPUs"))?;
    let depth = (PAYLOAD_BUDGET / payload_bytes() / count).clamp(1, MAX_DEPTH);
    let mut queues = Vec::with_capacity(count);
    for qid in 0..qids {
        let ring = IoUring::<squeue::Entry128>::builder()
            .setup_cqsize(2 * depth as u32)
            .setup_r_disabled()
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_defer_taskrun()
            .build(depth as u32)?;
        let entries = (0..depth)
            .map(|_| RingEntry::new(payload_bytes()))
            .collect();
        queues.push(Queue { ring, entries, qid });
    }
    Ok(PreparedQueues { queues })
}

/// A URING_CMD SQE for the FUSE device.
fn fuse_cmd(
    fd: RawFd,
    cmd_op: u32,
    commit_id: u64,
    qid: u16,
    iov: Option<&[libc::iovec; 2]>,
) -> squeue::Entry128 {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_le_bytes());
    cmd[16..18].copy_from_slice(&qid.to_le_bytes());
    let mut op = uring_op::UringCmd80::new(types::Fd(fd), cmd_op).cmd(cmd);
    if let Some(iov) = iov {
        op = op.addr(Some(iov.as_ptr() as u64));
    }
    let entry = op.build();
    if iov.is_none() {
        return entry;
    }
    // The crate has no setter for the SQE's `len` (the iovec count
    // REGISTER needs): set the 4 bytes at offset 24 of the 128-byte SQE.
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is repr(C): a 64-byte io_uring_sqe followed by 64
    // command bytes, plain integers with no invalid bit patterns and no
    // Drop; the size is asserted above.
    let mut bytes: [u8; 128] = unsafe { std::mem::transmute(entry) };
    bytes[24..28].copy_from_slice(&2u32.to_le_bytes());
    // SAFETY: as above, any 128 bytes are a valid Entry128.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(bytes) }
}

/// Starts one thread per queue: each registers its entries and serves
/// requests until unmount. Returns the number of queues serving, or an
/// error when some queue could not register: the kernel has then been
/// told to fall back to `/dev/fuse` (whose readers serve everything), and
/// the error says why.
pub(crate) fn start<F: Operations>(
    prepared: PreparedQueues,
    fd: &Arc<OwnedFd>,
    dispatcher: &Arc<Dispatcher<F>>,
    workers: &mut Vec<JoinHandle<()>>,
) -> io::Result<usize> {
    let count = prepared.queues.len();
    let (ready_tx, ready_rx) = mpsc::channel();
    let mut failed = None;
    let clients = Arc::new(QueueClients::new(count));
    for queue in prepared.queues {
        let (fd, dispatcher, ready) = (fd.clone(), dispatcher.clone(), ready_tx.clone());
        let clients = clients.clone();
        let qid = queue.qid;
        let spawned = std::thread::Builder::new()
            .name(format!("fuse-uring-{qid}"))
            .spawn(move || serve_queue(queue, &fd, &dispatcher, &clients, ready));
        match spawned {
            Ok(worker) => workers.push(worker),
            Err(e) => failed = Some(e),
        }
    }
    drop(ready_tx);
    // Every spawned thread reports once (its sender is dropped otherwise).
    for report in ready_rx.iter() {
        if let Err(e) = report {
            failed = Some(e);
        }
    }
    match failed {
        None => Ok(count),
        Some(e) => {
            fall_back(fd.as_raw_fd())
                .map_err(|f| io::Error::other(format!("{e}; and then {f}")))?;
            Err(e)
        }
    }
}

/// Makes the kernel give up io_uring for this connection: a REGISTER
/// with an invalid queue id fails, and a failed REGISTER turns io_uring
/// off and releases the requests waiting for the queues.
fn fall_back(fd: RawFd) -> io::Result<()> {
    let mut ring = IoUring::<squeue::Entry128>::builder().build(2)?;
    let entry = RingEntry::new(payload_bytes());
    let sqe = fuse_cmd(fd, CMD_REGISTER, 0, u16::MAX, Some(&entry.iov));
    // SAFETY: the SQE's iovecs and buffers live until the ring is dropped
    // below, after its completion has been waited for.
    unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("ring full"))?;
    ring.submit_and_wait(1)?;
    let result = ring.completion().next().map(|c| c.result());
    drop(ring);
    drop(entry);
    match result {
        Some(r) if r < 0 => Ok(()),
        other => Err(io::Error::other(format!(
            "could not turn FUSE io_uring off (REGISTER gave {other:?})"
        ))),
    }
}

/// Where a queue's thread may run.
///
/// A queue serves the requests issued on its CPU, so its thread is pinned
/// there: a metadata request then costs a same-CPU switch and no
/// migration (tokubench through io_uring: 26K files/s pinned, 19K free).
/// Streaming data is the exception: the issuer keeps its CPU busy copying
/// (and read-ahead keeps several requests in flight), so a pinned queue
/// serialises behind it while the other CPUs idle (a 4 GiB cold read
/// through nullfuse: 1.3-1.8 GB/s pinned, 2.6-3.5 free). So a queue lets
/// its thread roam while large READs and WRITEs arrive, and pins it again
/// after a run of other requests. Transitions are rare: one
/// `sched_setaffinity` each, never one per request.
struct QueueAffinity {
    cpu: usize,
    pinned: bool,
    /// Requests since the last large transfer, while roaming.
    calm: u32,
}

impl QueueAffinity {
    /// A transfer at least this large (read-ahead windows, large writes)
    /// marks streaming.
    const STREAMING_BYTES: u32 = 128 << 10;
    /// Other requests in a row that end a stream.
    const CALM_REQUESTS: u32 = 64;

    fn pinned(cpu: usize) -> QueueAffinity {
        let mut a = QueueAffinity {
            cpu,
            pinned: false,
            calm: 0,
        };
        a.set(true);
        a
    }

    /// Notes one request of `opcode` moving `bytes` of file data.
    fn note(&mut self, opcode: u32, bytes: u32) {
        let streaming = (opcode == abi::opcode::READ || opcode == abi::opcode::WRITE)
            && bytes >= Self::STREAMING_BYTES;
        if streaming {
            self.calm = 0;
            if self.pinned {
                self.set(false);
            }
        } else if !self.pinned {
            self.calm += 1;
            if self.calm >= Self::CALM_REQUESTS {
                self.set(true);
            }
        }
    }

    /// Pins the thread to its CPU, or lets it run on any (best effort:
    /// the queue works from any CPU, only slower).
    fn set(&mut self, pinned: bool) {
        // SAFETY: the set is zeroed and then filled with CPU_SET; the call
        // only changes this thread's affinity.
        let done = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if pinned {
                libc::CPU_SET(self.cpu, &mut set);
            } else {
                for cpu in 0..queue_count().min(libc::CPU_SETSIZE as usize) {
                    libc::CPU_SET(cpu, &mut set);
                }
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        };
        if done {
            self.pinned = pinned;
            self.calm = 0;
        } else {
            tracing::debug!(
                "fuse-uring-{}: affinity unchanged: {}",
                self.cpu,
                io::Error::last_os_error()
            );
        }
    }
}

/// Test hook (debug builds): the queue with this id fails to register,
/// as a queue would whose setup went wrong.
fn injected_register_failure(qid: u16) -> bool {
    cfg!(debug_assertions)
        && std::env::var("BETREEFS_TEST_URING_FAIL_QUEUE")
            .ok()
            .as_deref()
            == Some(qid.to_string().as_str())
}

fn serve_queue<F: Operations>(
    mut q: Queue,
    fd: &OwnedFd,
    dispatcher: &Dispatcher<F>,
    clients: &QueueClients,
    ready: mpsc::Sender<io::Result<()>>,
) {
    let raw = fd.as_raw_fd();
    let mut affinity = QueueAffinity::pinned(q.qid as usize);
    if injected_register_failure(q.qid) {
        let _ = ready.send(Err(io::Error::other(format!(
            "queue {} failed to register (injected)",
            q.qid
        ))));
        return;
    }
    let registered = q
        .ring
        .submitter()
        .register_enable_rings()
        .and_then(|()| register_all(&mut q, raw));
    let failed = registered.is_err();
    let _ = ready.send(registered);
    // start() waits until every queue has reported and let go of its sender.
    drop(ready);
    if failed {
        return;
    }
    dispatcher.serving_thread_started(true);
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        serve_entries(&mut q, raw, dispatcher, clients, &mut affinity)
    }));
    // A queue that stops while the connection lives leaves its CPU's
    // requests waiting forever: give the mount up instead. Entries that
    // the kernel ended with ENOTCONN are no proof of an unmount: it ends
    // them so too when io_uring cancels them (`fuse_uring_cancel`, on a
    // ring or task going away) and the connection may live on.
    let stopped = match served {
        Ok(Some(why)) => Some(why),
        Ok(None) if dispatcher.destroyed() || connection_ended(raw) => None,
        Ok(None) => Some("the kernel ended its entries while the connection lives".into()),
        Err(panic) => Some(format!(
            "panicked: {}",
            crate::guard::panic_message(&*panic)
        )),
    };
    if let Some(why) = stopped {
        dispatcher.abandon(&format!("io_uring queue {} stopped: {why}", q.qid));
    }
}

/// Serves the requests delivered into the queue's entries until none is
/// left with the kernel; returns why entries were lost if not by an end
/// of the connection.
fn serve_entries<F: Operations>(
    q: &mut Queue,
    raw: RawFd,
    dispatcher: &Dispatcher<F>,
    clients: &QueueClients,
    affinity: &mut QueueAffinity,
) -> Option<String> {
    let mut live = q.entries.len();
    let mut done = Vec::new();
    let mut broken: Option<String> = None;
    let mut injected = InjectedStop::from_env(q.qid);
    while live > 0 {
        if let Err(e) = q.ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Some(e.to_string());
        }
        if let Some(how) = injected.as_ref().and_then(InjectedStop::due) {
            match how {
                StopHow::Broken => return Some("stopped (injected)".into()),
                // As if the kernel had ended every entry with ENOTCONN.
                StopHow::Cancelled => return None,
                StopHow::Panic => panic!("injected fault: io_uring queue {}", q.qid),
            }
        }
        done.clear();
        done.extend(
            q.ring
                .completion()
                .map(|c| (c.user_data() as usize, c.result())),
        );
        for &(index, result) in &done {
            match result {
                0 => {
                    if let Some(e) = q.entries.get_mut(index) {
                        e.registered = true;
                    }
                    if let Err(e) = answer(q, index, raw, dispatcher, affinity, clients) {
                        tracing::error!("fuse-uring-{}: {e}", q.qid);
                        broken = Some(e.to_string());
                        live -= 1;
                    }
                    if let Some(stop) = injected.as_mut() {
                        stop.served_one();
                    }
                }
                r if r == -libc::EAGAIN || r == -libc::EINTR => {
                    if let Err(e) = resubmit(q, index, raw) {
                        tracing::error!("fuse-uring-{}: {e}", q.qid);
                        broken = Some(e.to_string());
                        live -= 1;
                    }
                }
                // Unmounted, aborted, cancelled by io_uring, or the ring is
                // going away (the caller tells an unmount from the rest).
                r if r == -libc::ENOTCONN || r == -libc::ECONNABORTED || r == -libc::ECANCELED => {
                    live -= 1
                }
                r => {
                    let e = io::Error::from_raw_os_error(-r);
                    tracing::error!("fuse-uring-{}: entry {index}: {e}", q.qid);
                    broken = Some(e.to_string());
                    live -= 1;
                }
            }
        }
        // Work the requests left for after their replies: the replies go
        // now (the commits were pushed, not submitted), their clients go
        // on while this thread does it — or, while one client alone
        // issues requests, or when the work is long (a rename's surgery:
        // the requests on this queue would wait for it), while the
        // after-reply worker does it and this thread serves on
        // (`crate::after_reply`).
        if broken.is_none() && dispatcher.has_work_after_reply() {
            if let Err(e) = q.ring.submit() {
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Some(e.to_string());
                }
            }
            if clients.one_client(usize::from(q.qid)) || dispatcher.work_after_reply_is_long() {
                dispatcher.hand_off_work_after_replies();
            } else {
                dispatcher.work_after_replies();
                // What it left flagged long (a settling step that reads
                // its leaf from the device) goes to the worker now.
                if dispatcher.work_after_reply_is_long() {
                    dispatcher.hand_off_work_after_replies();
                }
            }
        }
    }
    broken
}

/// Whether the FUSE connection behind `fd` has ended (unmounted or
/// aborted): the kernel then reports an error condition on the device
/// (`fuse_dev_poll`). It clears the connection's flag before it tears the
/// io_uring queues down, so a queue whose entries ended because of the
/// end of the connection always sees it.
fn connection_ended(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: pfd is one valid pollfd; a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n < 0 {
        // Cannot tell: say it lives, so that the mount is given up rather
        // than left with a queue nobody serves.
        tracing::error!("poll of the FUSE device: {}", io::Error::last_os_error());
        return false;
    }
    pfd.revents & (libc::POLLERR | libc::POLLNVAL) != 0
}

/// How an injected stop ends a queue (see [`InjectedStop`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum StopHow {
    /// Its ring broke (an error from the kernel).
    Broken,
    /// The kernel ended every entry with ENOTCONN, as it does when
    /// io_uring cancels them, while the connection lives.
    Cancelled,
    /// Its thread panicked outside any request.
    Panic,
}

/// Test hook (debug builds): `BETREEFS_TEST_URING_STOP_QUEUE=<qid>:<n>[:how]`
/// makes that queue stop after serving n requests, `how` being `broken`
/// (the default), `cancelled` or `panic` ([`StopHow`]).
struct InjectedStop {
    after: u32,
    how: StopHow,
}

impl InjectedStop {
    fn from_env(qid: u16) -> Option<InjectedStop> {
        if !cfg!(debug_assertions) {
            return None;
        }
        let spec = std::env::var("BETREEFS_TEST_URING_STOP_QUEUE").ok()?;
        InjectedStop::parse(&spec, qid)
    }

    fn parse(spec: &str, qid: u16) -> Option<InjectedStop> {
        let mut parts = spec.split(':');
        let q: u16 = parts.next()?.parse().ok()?;
        let after = parts.next()?.parse().ok()?;
        let how = match parts.next() {
            None | Some("broken") => StopHow::Broken,
            Some("cancelled") => StopHow::Cancelled,
            Some("panic") => StopHow::Panic,
            Some(_) => return None,
        };
        (q == qid && parts.next().is_none()).then_some(InjectedStop { after, how })
    }

    fn served_one(&mut self) {
        self.after = self.after.saturating_sub(1);
    }

    /// How the queue stops now, if it is time.
    fn due(&self) -> Option<StopHow> {
        (self.after == 0).then_some(self.how)
    }
}

/// Submits a REGISTER for every entry of the queue.
fn register_all(q: &mut Queue, fd: RawFd) -> io::Result<()> {
    for index in 0..q.entries.len() {
        push_register(q, index, fd)?;
    }
    q.ring.submit()?;
    Ok(())
}

fn push_register(q: &mut Queue, index: usize, fd: RawFd) -> io::Result<()> {
    let entry = q
        .entries
        .get(index)
        .ok_or_else(|| io::Error::other("no such entry"))?;
    let sqe = fuse_cmd(fd, CMD_REGISTER, 0, q.qid, Some(&entry.iov)).user_data(index as u64);
    // SAFETY: the iovecs and the buffers they point to belong to the
    // queue's entries, which outlive the ring (Queue drops it first).
    unsafe { q.ring.submission().push(&sqe) }.map_err(|_| io::Error::other("ring full"))
}

fn push_commit(q: &mut Queue, index: usize, fd: RawFd) -> io::Result<()> {
    let entry = q
        .entries
        .get(index)
        .ok_or_else(|| io::Error::other("no such entry"))?;
    let commit_id = entry.u64_at(COMMIT_ID_OFFSET);
    let sqe = fuse_cmd(fd, CMD_COMMIT_AND_FETCH, commit_id, q.qid, None).user_data(index as u64);
    // SAFETY: COMMIT_AND_FETCH uses the buffers registered for the entry,
    // which outlive the ring.
    unsafe { q.ring.submission().push(&sqe) }.map_err(|_| io::Error::other("ring full"))
}

/// Sends again the command of an entry the kernel asked to retry.
fn resubmit(q: &mut Queue, index: usize, fd: RawFd) -> io::Result<()> {
    let registered = q.entries.get(index).is_some_and(|e| e.registered);
    if registered {
        push_commit(q, index, fd)
    } else {
        push_register(q, index, fd)
    }
}

/// Serves the request delivered into entry `index` and queues its reply
/// with the fetch of the next one.
fn answer<F: Operations>(
    q: &mut Queue,
    index: usize,
    fd: RawFd,
    dispatcher: &Dispatcher<F>,
    affinity: &mut QueueAffinity,
    clients: &QueueClients,
) -> io::Result<()> {
    let entry = q
        .entries
        .get_mut(index)
        .ok_or_else(|| io::Error::other("a completion for no entry"))?;
    let payload_len = entry.u32_at(PAYLOAD_SZ_OFFSET) as usize;
    let header = entry.header.get(..abi::IN_HEADER_BYTES).unwrap_or_default();
    let op_in = entry
        .header
        .get(OP_IN_OFFSET..OP_IN_OFFSET + 128)
        .unwrap_or_default();
    let h = abi::InHeader::parse(&mut Reader::new(header))
        .map_err(|_| io::Error::other("a request without a header"))?;
    clients.note_request(usize::from(q.qid), h.pid);
    if h.opcode == abi::opcode::READ {
        // A READ has no payload: its data goes straight into the payload
        // buffer, no copy on the way.
        if let Ok(req) = Request::parse_parts(header, op_in, &[]) {
            if let crate::request::Op::Read { size, .. } = req.op {
                affinity.note(h.opcode, size);
            }
            let result = dispatcher.read_into(&req, &mut entry.payload, Via::Uring);
            entry.set_reply_in_place(h.unique, result);
            return push_commit(q, index, fd);
        }
    }
    let payload = entry.payload.get(..payload_len).unwrap_or_default();
    let reply = match Request::parse_parts(header, op_in, payload) {
        Ok(req) => {
            affinity.note(h.opcode, payload_len as u32);
            serve_one(dispatcher, &req, Via::Uring)
        }
        Err(_) => {
            tracing::warn!("malformed {} request", abi::opcode::name(h.opcode));
            Reply::Error(libc::EIO)
        }
    };
    entry.set_reply(h.unique, &reply);
    push_commit(q, index, fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed_cpus() -> usize {
        // SAFETY: the set is written by sched_getaffinity for this thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            libc::CPU_COUNT(&set) as usize
        }
    }

    #[test]
    fn a_queue_roams_while_data_streams_and_pins_again_after() {
        // Runs on its own thread: the test changes its thread's affinity.
        std::thread::spawn(|| {
            let mut a = QueueAffinity::pinned(0);
            assert!(a.pinned);
            assert_eq!(allowed_cpus(), 1);
            a.note(abi::opcode::READ, 4096);
            a.note(abi::opcode::WRITE, 64 << 10);
            assert!(a.pinned, "small transfers keep the queue pinned");
            a.note(abi::opcode::READ, QueueAffinity::STREAMING_BYTES);
            assert!(!a.pinned);
            assert_eq!(
                allowed_cpus(),
                queue_count().min(libc::CPU_SETSIZE as usize)
            );
            for _ in 1..QueueAffinity::CALM_REQUESTS {
                a.note(abi::opcode::LOOKUP, 0);
            }
            a.note(abi::opcode::WRITE, 1 << 20);
            for _ in 1..QueueAffinity::CALM_REQUESTS {
                a.note(abi::opcode::GETATTR, 0);
            }
            assert!(!a.pinned, "a stream resets the count");
            a.note(abi::opcode::GETATTR, 0);
            assert!(a.pinned);
            assert_eq!(allowed_cpus(), 1);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn register_sqe_carries_the_iovec_count_and_queue() {
        let mut e = RingEntry::new(8192);
        let sqe = fuse_cmd(5, CMD_REGISTER, 0, 3, Some(&e.iov));
        // SAFETY: as in fuse_cmd.
        let bytes: [u8; 128] = unsafe { std::mem::transmute(sqe) };
        assert_eq!(bytes[0], io_uring::opcode::UringCmd80::CODE);
        assert_eq!(i32::from_le_bytes(bytes[4..8].try_into().unwrap()), 5);
        assert_eq!(
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
            CMD_REGISTER
        );
        assert_eq!(u32::from_le_bytes(bytes[24..28].try_into().unwrap()), 2);
        let addr = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
        assert_eq!(addr, e.iov.as_ptr() as u64);
        // The command area starts at byte 48: commit_id at 8, qid at 16.
        assert_eq!(u16::from_le_bytes(bytes[64..66].try_into().unwrap()), 3);
        e.set_reply(77, &Reply::Ok(vec![1, 2, 3]));
        assert_eq!(e.u32_at(PAYLOAD_SZ_OFFSET), 3);
        assert_eq!(&e.payload[..3], &[1, 2, 3]);
        assert_eq!(crate::dispatch::reply_unique(&e.header[..16]), Some(77));
    }

    #[test]
    fn an_injected_stop_names_its_queue_count_and_way() {
        let stop = InjectedStop::parse("1:200", 1).unwrap();
        assert_eq!((stop.after, stop.how), (200, StopHow::Broken));
        assert!(InjectedStop::parse("1:200", 0).is_none());
        let mut stop = InjectedStop::parse("0:2:cancelled", 0).unwrap();
        assert_eq!(stop.due(), None);
        stop.served_one();
        stop.served_one();
        assert_eq!(stop.due(), Some(StopHow::Cancelled));
        assert_eq!(
            InjectedStop::parse("0:0:panic", 0).unwrap().due(),
            Some(StopHow::Panic)
        );
        assert!(InjectedStop::parse("0:1:sideways", 0).is_none());
        assert!(InjectedStop::parse("0:1:panic:x", 0).is_none());
        assert!(InjectedStop::parse("0", 0).is_none());
    }

    #[test]
    fn a_device_without_a_connection_reads_as_ended() {
        // An open /dev/fuse that never mounted has no connection: the
        // kernel reports the same error condition as for an ended one.
        let Ok(dev) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
        else {
            return;
        };
        assert!(connection_ended(dev.as_raw_fd()));
        // A pipe with nothing in it is no ended connection.
        let mut fds = [0; 2];
        // SAFETY: fds has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        assert!(!connection_ended(fds[0]));
        // SAFETY: both descriptors are ours and closed once.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }

    #[test]
    fn counts_possible_cpus() {
        assert!(queue_count() >= 1);
    }
}
