//! The work requests leave for after their replies
//! ([`Operations::work_after_reply`](betreefs_fs::Operations::work_after_reply):
//! a write's application of what is staged, the settling and eviction
//! that follow), and who does it.
//!
//! A serving thread does it once its replies are sent, so its client goes
//! on meanwhile. But an io_uring queue's thread is pinned to its CPU and
//! serves every request issued there, and a lone client (rm -rf, tar)
//! woken by the reply mostly stays on that CPU: its next request waited
//! in the queue for the whole of the work while the other CPU idled. So
//! while one client alone issues requests ([`QueueClients::one_client`]),
//! the queue's thread hands the work to a thread of its own that serves
//! no request and runs wherever the scheduler finds room, and serves on.
//! With a client on every CPU (tokubench's two) handing off only adds a
//! third thread to two busy CPUs — tokubench lost 10-15% when every
//! queue handed off — so there the queue's thread does the work itself
//! (docs/benchmarks/after-reply-worker.md). Threads
//! reading `/dev/fuse` are not pinned, and several: one doing the work
//! leaves the next request to another, as before.
//!
//! The worker runs a little below the serving threads and their clients
//! ([`WORKER_NICE`]): a long piece of work (a rename's surgery) otherwise
//! shared a CPU with the client's next requests for a scheduler's slice
//! — 2-3 ms of a hard link's 3 ms (docs/benchmarks/renames-staged.md).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The after-reply worker's nice value. Lower in priority than the
/// serving threads and their clients, it is preempted when they wake
/// rather than holding their CPU for the rest of its slice: the median
/// first hard link of a just-written 4 MiB file (link + fsync of the
/// directory, the link's surgery left to the worker) took 1.7-3.1 ms at
/// nice 0 and 0.44-1.2 ms at 5 (0.36-1.0 at 10), untar the same
/// (docs/benchmarks/renames-staged.md). Only a little lower: the worker
/// holds the tree lock while it works, and on CPUs saturated by other
/// processes a lower share stretches those holds (at 5 it gets a quarter
/// of a CPU beside one busy process at 0, against half).
pub(crate) const WORKER_NICE: i32 = 5;

/// Lowers the calling thread's priority to [`WORKER_NICE`] (best effort:
/// the work is done either way).
pub(crate) fn lower_worker_priority() {
    // SAFETY: setpriority takes no pointers; on Linux, PRIO_PROCESS with
    // who = 0 changes the calling thread's nice value alone.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, WORKER_NICE) };
    if r != 0 {
        tracing::debug!(
            "after-reply worker: priority unchanged: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// How long a queue must have seen requests of one client alone for its
/// thread to hand its work after replies off: a client's requests come
/// every 10-40 µs, so a millisecond of them is a few dozen.
pub(crate) const ONE_CLIENT_FOR: Duration = Duration::from_millis(1);

/// Which client (the thread of the `pid` in the request header) each
/// io_uring queue served last, since when, and when it last served
/// anything: whether one client alone issues requests. Each queue's
/// thread writes only its own slot (no cache line bounces between the
/// queues per request); the slots are read at a hand-off.
pub(crate) struct QueueClients {
    epoch: Instant,
    slots: Box<[ClientSlot]>,
}

#[derive(Default)]
#[repr(align(64))]
struct ClientSlot {
    last_pid: AtomicU32,
    /// Microseconds since the epoch: the last request served, and the
    /// last one from a client other than the one before it.
    last_served: AtomicU64,
    pid_changed: AtomicU64,
}

impl QueueClients {
    pub(crate) fn new(queues: usize) -> QueueClients {
        QueueClients {
            epoch: Instant::now(),
            slots: (0..queues).map(|_| ClientSlot::default()).collect(),
        }
    }

    fn now_micros(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Queue `qid` serves a request of client `pid` now. Pid 0 is the
    /// kernel's own (a RELEASE sent in the background after a close), not
    /// a client: left out, or every file an untar writes would count as a
    /// second client.
    pub(crate) fn note_request(&self, qid: usize, pid: u32) {
        if pid == 0 {
            return;
        }
        self.note_request_at(qid, pid, self.now_micros());
    }

    /// Whether queue `qid` has served one client alone for
    /// [`ONE_CLIENT_FOR`], and every other queue either nothing or that
    /// same client alone for as long: the CPUs of the other queues have
    /// no other client of this mount to run.
    pub(crate) fn one_client(&self, qid: usize) -> bool {
        self.one_client_at(qid, self.now_micros())
    }

    fn note_request_at(&self, qid: usize, pid: u32, now: u64) {
        let Some(slot) = self.slots.get(qid) else {
            return;
        };
        slot.last_served.store(now, Ordering::Relaxed);
        if slot.last_pid.load(Ordering::Relaxed) != pid {
            slot.last_pid.store(pid, Ordering::Relaxed);
            slot.pid_changed.store(now, Ordering::Relaxed);
        }
    }

    fn one_client_at(&self, qid: usize, now: u64) -> bool {
        let Some(own) = self.slots.get(qid) else {
            return false;
        };
        let window = ONE_CLIENT_FOR.as_micros() as u64;
        let within = |t: &AtomicU64| now.saturating_sub(t.load(Ordering::Relaxed)) < window;
        let pid = own.last_pid.load(Ordering::Relaxed);
        if within(&own.pid_changed) {
            return false;
        }
        self.slots.iter().enumerate().all(|(q, slot)| {
            q == qid
                || !within(&slot.last_served)
                || (slot.last_pid.load(Ordering::Relaxed) == pid && !within(&slot.pid_changed))
        })
    }
}

/// The serving threads' hand-off to the worker.
#[derive(Default)]
pub(crate) struct AfterReply {
    state: Mutex<HandOff>,
    wake: Condvar,
}

#[derive(Default)]
struct HandOff {
    /// Work was handed off since the worker last took it.
    wanted: bool,
    /// The connection ended: the worker stops.
    ended: bool,
}

impl AfterReply {
    fn state(&self) -> std::sync::MutexGuard<'_, HandOff> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the worker (by a serving thread, once the replies to the
    /// requests that left the work are on their way). A hand-off while
    /// one is still untaken wakes nobody again.
    pub(crate) fn hand_off(&self) {
        let mut state = self.state();
        if !state.wanted {
            state.wanted = true;
            self.wake.notify_one();
        }
    }

    /// Stops the worker: the connection ended (work still untaken goes
    /// with it, as the store's close applies what is staged).
    pub(crate) fn end(&self) {
        self.state().ended = true;
        self.wake.notify_one();
    }

    /// Whether [`AfterReply::end`] was called.
    pub(crate) fn ended(&self) -> bool {
        self.state().ended
    }

    /// The worker's wait for work: true once some was handed off (and
    /// takes it), false once [`AfterReply::end`] was called. No timed
    /// wake-ups: an idle mount's worker sleeps until told.
    pub(crate) fn wait(&self) -> bool {
        let mut state = self.state();
        loop {
            if state.ended {
                return false;
            }
            if state.wanted {
                state.wanted = false;
                return true;
            }
            state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Test hook (debug builds): with `BETREEFS_TEST_HOLD_AFTER_REPLY=<path>`
/// the worker, before each piece of work, writes `<path>.held` and waits
/// while `<path>` exists, so a test can show requests served while the
/// work is pending.
pub(crate) fn injected_hold() {
    if !cfg!(debug_assertions) {
        return;
    }
    static FLAG: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    let flag = FLAG.get_or_init(|| {
        std::env::var_os("BETREEFS_TEST_HOLD_AFTER_REPLY").map(std::path::PathBuf::from)
    });
    let Some(flag) = flag else {
        return;
    };
    if !flag.exists() {
        return;
    }
    let mut held = flag.clone().into_os_string();
    held.push(".held");
    if let Err(e) = std::fs::write(&held, b"") {
        tracing::warn!("test hook: writing {}: {e}", held.to_string_lossy());
    }
    while flag.exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_client_is_a_single_pid_on_every_queue_for_a_while() {
        const MS: u64 = 1000;
        assert_eq!(ONE_CLIENT_FOR.as_micros() as u64, MS);
        let clients = QueueClients::new(3);
        let (note, one) = (
            |q, pid, t| clients.note_request_at(q, pid, t),
            |q, t| clients.one_client_at(q, t),
        );
        note(0, 100, 10 * MS);
        assert!(!one(0, 10 * MS + 999), "a new client: not yet");
        assert!(one(0, 11 * MS), "one client, the other queues idle");
        note(1, 100, 11 * MS);
        assert!(
            !one(0, 11 * MS),
            "queue 1 has just changed clients (from none)"
        );
        note(1, 100, 12 * MS);
        note(0, 100, 12 * MS);
        assert!(one(0, 12 * MS), "the same client on both queues");
        assert!(one(1, 12 * MS));
        note(2, 200, 12 * MS);
        assert!(!one(0, 12 * MS), "a second client on queue 2");
        note(2, 200, 14 * MS);
        assert!(!one(0, 14 * MS), "still there");
        note(0, 200, 14 * MS);
        assert!(!one(0, 14 * MS), "and on queue 0 now, just changed");
        note(0, 200, 15 * MS);
        assert!(
            one(0, 15 * MS),
            "client 200 alone on queue 0 for a while, the same on queue 2"
        );
        note(1, 100, 15 * MS);
        assert!(!one(0, 15 * MS), "client 100 on queue 1");
        assert!(one(0, 16 * MS), "queue 1 quiet again");
        // The kernel's own requests (pid 0) are no client.
        clients.note_request(0, 0);
        assert!(one(0, 16 * MS), "pid 0 left out");
        // A queue id past the last is a no-op, not a panic.
        note(7, 1, 16 * MS);
        assert!(!one(7, 16 * MS));
    }

    /// The worker's thread alone is lowered: the serving threads (here,
    /// the test's own) keep their priority.
    #[test]
    fn the_worker_alone_runs_below_the_serving_threads() {
        // SAFETY (both): getpriority takes no pointers; PRIO_PROCESS with
        // who = 0 reads the calling thread's nice value on Linux.
        let nice = || unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let before = nice();
        let worker = std::thread::spawn(move || {
            lower_worker_priority();
            nice()
        })
        .join()
        .unwrap();
        if before <= WORKER_NICE {
            assert_eq!(worker, WORKER_NICE);
        }
        assert_eq!(nice(), before, "the spawning thread kept its priority");
    }

    #[test]
    fn a_hand_off_wakes_the_worker_once_and_an_ended_connection_stops_it() {
        let handoff = Arc::new(AfterReply::default());
        handoff.hand_off();
        handoff.hand_off();
        assert!(handoff.wait(), "the work handed off is taken");
        let h = handoff.clone();
        let worker = std::thread::spawn(move || {
            let mut taken = 0;
            while h.wait() {
                taken += 1;
            }
            taken
        });
        handoff.hand_off();
        // The worker takes it (or sees it still wanted when it ends).
        while handoff.state().wanted {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!handoff.ended());
        handoff.end();
        assert!(handoff.ended(), "the releaser sees the end too");
        assert_eq!(worker.join().unwrap(), 1);
    }
}
