//! The store's background threads: the checkpointer (which also flushes
//! the log on its interval), the log flusher, the tree flusher
//! (background flushing, when configured), the write-back thread and the
//! applier (when configured).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::write::Evictor;
use super::*;

/// Starts the thread that moves messages down the trees in turns and
/// tells the tree to leave them in the roots' buffers for it.
pub(super) fn start_tree_flusher(inner: &Arc<Inner>) -> Option<JoinHandle<()>> {
    start_on_demand(
        inner,
        OnDemand::TreeFlusher,
        "betreefs-tree-flush",
        Inner::run_tree_flusher,
    )
}

/// Starts the thread that writes dirty nodes back when the node cache
/// goes over its budget ([`Options::background_write_back`]).
pub(super) fn start_write_back(inner: &Arc<Inner>) -> Option<JoinHandle<()>> {
    start_on_demand(
        inner,
        OnDemand::WriteBack,
        "betreefs-write-back",
        Inner::run_write_back,
    )
}

/// Starts the thread that applies the staged writes once a writer took
/// them past their bound ([`Options::background_apply`]).
pub(super) fn start_applier(inner: &Arc<Inner>) -> Option<JoinHandle<()>> {
    start_on_demand(
        inner,
        OnDemand::Applier,
        "betreefs-applier",
        Inner::run_applier,
    )
}

/// Starts the thread that flushes the log when writers have buffered
/// enough of it ([`log_flush_eager_bytes`]).
pub(super) fn start_log_flusher(inner: &Arc<Inner>) -> Option<JoinHandle<()>> {
    start_on_demand(
        inner,
        OnDemand::LogFlusher,
        "betreefs-log-flush",
        Inner::run_log_flusher,
    )
}

/// The threads that writers wake when there is work for them, and do the
/// work themselves while the thread does not run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnDemand {
    TreeFlusher,
    WriteBack,
    Applier,
    LogFlusher,
}

/// Starts `thread` (named `name`, running `run`), marked as running first
/// (writers leave it work from then on); None, and unmarked, if it could
/// not start.
fn start_on_demand(
    inner: &Arc<Inner>,
    thread: OnDemand,
    name: &str,
    run: fn(&Inner),
) -> Option<JoinHandle<()>> {
    inner.running(thread).store(true, Ordering::SeqCst);
    let worker = inner.clone();
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || run(&worker));
    match spawned {
        Ok(handle) => Some(handle),
        Err(e) => {
            inner.running(thread).store(false, Ordering::SeqCst);
            tracing::warn!("could not start {name}: {e}; writers do its work");
            None
        }
    }
}

impl Inner {
    /// Whether `thread` runs (writers leave it work).
    fn running(&self, thread: OnDemand) -> &std::sync::atomic::AtomicBool {
        match thread {
            OnDemand::TreeFlusher => &self.tree_flusher_running,
            OnDemand::WriteBack => &self.write_back_running,
            OnDemand::Applier => &self.applier_running,
            OnDemand::LogFlusher => &self.log_flusher_running,
        }
    }

    /// What wakes `thread`.
    fn wake_of(&self, thread: OnDemand) -> &Condvar {
        match thread {
            OnDemand::TreeFlusher => &self.tree_flush_wake,
            OnDemand::WriteBack => &self.write_back_wake,
            OnDemand::Applier => &self.applier_wake,
            OnDemand::LogFlusher => &self.log_flush_wake,
        }
    }

    /// The flag that says `thread` has work.
    fn wanted(state: &mut BackgroundState, thread: OnDemand) -> &mut bool {
        match thread {
            OnDemand::TreeFlusher => &mut state.tree_flush_wanted,
            OnDemand::WriteBack => &mut state.write_back_wanted,
            OnDemand::Applier => &mut state.apply_wanted,
            OnDemand::LogFlusher => &mut state.log_flush_wanted,
        }
    }

    /// Wakes `thread` for work.
    fn want(&self, thread: OnDemand) {
        let mut state = self.lock_background();
        let wanted = Inner::wanted(&mut state, thread);
        if !*wanted {
            *wanted = true;
            self.wake_of(thread).notify_all();
        }
    }

    /// What `thread` does between two pieces of work: sleeps until it is
    /// wanted (and takes the want), false once the store shuts down.
    fn wait_until_wanted(&self, thread: OnDemand) -> bool {
        let mut state = self.lock_background();
        while !state.shutdown && !*Inner::wanted(&mut state, thread) {
            state = self
                .wake_of(thread)
                .wait_timeout(state, Duration::from_secs(1))
                .map(|(s, _)| s)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        if state.shutdown {
            return false;
        }
        *Inner::wanted(&mut state, thread) = false;
        true
    }

    /// Wakes the write-back thread.
    pub(super) fn want_write_back(&self) {
        self.want(OnDemand::WriteBack);
    }

    /// The write-back thread: woken by a writer that took the node cache
    /// near its budget, it writes dirty nodes back a step at a time as a
    /// writer's eviction does ([`Inner::evict_in_steps`]: the encoding and
    /// the device write with the tree lock let go), down to 90% of the
    /// budget less the headroom, while the writers' requests go on.
    fn run_write_back(&self) {
        // Writers write back for themselves once it stops.
        self.serve_on_demand(OnDemand::WriteBack, |inner| {
            let mut tree = inner.lock_tree();
            if let Err(e) = inner.evict_in_steps(&mut tree, Evictor::WriteBackThread) {
                // Poisoned by the step that failed: writes report it.
                tracing::error!("background write-back failed: {e}");
            }
        });
    }

    /// Whether the applier runs (a writer past the staging bound leaves it
    /// the application).
    pub(super) fn applier_runs(&self) -> bool {
        self.applier_running.load(Ordering::SeqCst)
    }

    /// Wakes the applier.
    pub(super) fn want_apply(&self) {
        self.want(OnDemand::Applier);
    }

    /// The applier: woken by a writer that took the staged writes past
    /// their bound, it does the work that writer left — the application,
    /// the settling and the eviction after it, as a FUSE serving thread
    /// does after its replies ([`Inner::work_after_reply`]) — while the
    /// writers go on staging. Once it stops, writers apply for themselves.
    fn run_applier(&self) {
        self.serve_on_demand(OnDemand::Applier, |inner| {
            if let Err(e) = inner.work_after_reply() {
                // The store failed (poisoned by what failed): writes
                // report it.
                tracing::error!("background application failed: {e}");
            }
        });
    }

    /// Asks for the log's buffered bytes to be written: by the log
    /// flusher if it runs, else by the background thread (between its
    /// checkpoints).
    pub(super) fn want_log_flush(&self) {
        if self.log_flusher_running.load(Ordering::SeqCst) {
            self.want(OnDemand::LogFlusher);
        } else {
            self.lock_background().flush_wanted = true;
            self.wake.notify_all();
        }
    }

    /// The log flusher: woken by a writer that buffered more of the log
    /// than [`log_flush_eager_bytes`], it writes it. A thread of its own,
    /// not the background thread's: that one spends seconds in a
    /// checkpoint, and the writers meanwhile reached the bound at which
    /// they flush the log themselves ([`log_flush_writer_bytes`]) —
    /// writes of an untar that waited 28-78 ms in their request for a
    /// log write queued behind the checkpoint's (docs/benchmarks/log-flusher.md).
    fn run_log_flusher(&self) {
        self.serve_on_demand(OnDemand::LogFlusher, Inner::write_unflushed_log);
    }

    /// Writes what the log holds unwritten, nobody waiting for it (a
    /// background thread's flush); a failure poisons the store.
    fn write_unflushed_log(&self) {
        if self.log.has_unflushed() {
            if let Err(e) = self.flush_log(false) {
                tracing::error!("background log flush failed: {e}");
                self.poison(e.into());
            }
        }
    }

    /// The life of `thread`: `work` each time it is wanted (not on a store
    /// that failed), until the store shuts down; then it no longer runs —
    /// nor after a panic in `work`, so that writers do its work (and none
    /// waits for room only it would make) rather than leave it to no one.
    fn serve_on_demand(&self, thread: OnDemand, work: impl Fn(&Inner)) {
        struct Stops<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stops<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _stops = Stops(self.running(thread));
        while self.wait_until_wanted(thread) {
            if self.check_failed().is_ok() {
                work(self);
            }
        }
    }

    /// Wakes the tree flusher.
    pub(super) fn want_tree_flush(&self) {
        self.want(OnDemand::TreeFlusher);
    }

    /// The tree flusher: woken when a root's buffers hold more than a
    /// node's worth, it moves messages down in turns of
    /// `Options::flush_turn_bytes` with the tree lock held, handing the
    /// lock on fairly in between so that requests go on (docs/design.md,
    /// "Background flushing").
    fn run_tree_flusher(&self) {
        self.serve_on_demand(OnDemand::TreeFlusher, |inner| while inner.flush_turn() {});
        // Writers waiting for it settle in their own thread from now on.
        let _guard = self.lock_tree();
        self.flush_progress.notify_all();
    }

    /// One turn of the tree flusher; whether there is more to do (and no
    /// reason to stop).
    pub(super) fn flush_turn(&self) -> bool {
        if let Some(hook) = &self.options.flush_turn_hook {
            (hook.0)();
        }
        let mut tree = self.lock_tree();
        if !self.background_flush_now(&tree) {
            // Space is getting low: writers settle for themselves.
            return false;
        }
        let started = Instant::now();
        let turn = tree
            .flush_turn(self.options.flush_turn_bytes)
            .and_then(|more| {
                // A write's eviction, as for the nodes a writer's own settling
                // would have loaded and dirtied.
                match tree.evict_if_needed() {
                    Err(e) if !e.is_no_space() => Err(e),
                    _ => Ok(more),
                }
            });
        record_max(&self.stats.flush_turn_micros_max, started.elapsed());
        add(&self.stats.flush_turns, 1);
        let more = turn.unwrap_or_else(|e| {
            tracing::error!("background flushing failed: {e}");
            self.poison(e);
            false
        });
        self.flush_progress.notify_all();
        parking_lot::RwLockWriteGuard::unlock_fair(tree);
        more && !self.lock_background().shutdown
    }

    pub(super) fn run_background(&self) {
        let tick = Duration::from_millis(50);
        let mut last_flush = Instant::now();
        let mut last_checkpoint = Instant::now();
        loop {
            let (checkpoint_wanted, flush_wanted) = {
                let mut state = self.lock_background();
                if !state.shutdown && !state.checkpoint_wanted && !state.flush_wanted {
                    state = self
                        .wake
                        .wait_timeout(state, tick)
                        .map(|(s, _)| s)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                if state.shutdown {
                    return;
                }
                (
                    std::mem::take(&mut state.checkpoint_wanted),
                    std::mem::take(&mut state.flush_wanted),
                )
            };
            if self.check_failed().is_err() {
                continue;
            }
            let interval_due = self
                .options
                .log_flush_interval
                .is_some_and(|i| last_flush.elapsed() >= i);
            if flush_wanted || interval_due {
                self.write_unflushed_log();
                last_flush = Instant::now();
            }
            if interval_due {
                // Spare chunks of the log's buffer go back once no record
                // came for a whole interval.
                self.log.release_spares_if_idle();
                self.note_log_buffer();
            }
            let due = self
                .options
                .checkpoint_interval
                .is_some_and(|i| last_checkpoint.elapsed() >= i);
            if checkpoint_wanted || due {
                if let Err(e) = self.checkpoint() {
                    tracing::error!("background checkpoint failed: {e}");
                }
                last_checkpoint = Instant::now();
            }
        }
    }
}
