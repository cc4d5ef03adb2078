//! The write path: a batch's admission (space, promises), its sequence
//! number and log record, its application to the trees, and the settling
//! and eviction that follow it in steps.

use std::cell::Cell;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use super::staging;
use super::*;
use crate::buffer::MessageBuffer;
use betreefs_store::Room;

thread_local! {
    /// Whether writes on this thread leave their work for after the
    /// reply ([`Store::work_after_replies_on_this_thread`]).
    static WORKS_AFTER_REPLY: Cell<bool> = const { Cell::new(false) };
}

pub(super) fn work_after_replies_on_this_thread() {
    WORKS_AFTER_REPLY.with(|w| w.set(true));
}

thread_local! {
    /// Whether this thread hands work flagged long to a thread of its own
    /// ([`Store::hand_long_work_on_from_this_thread`]).
    static HANDS_LONG_WORK_ON: Cell<bool> = const { Cell::new(false) };
}

pub(super) fn hand_long_work_on_from_this_thread() {
    HANDS_LONG_WORK_ON.with(|h| h.set(true));
}

/// Bytes a batch that deletes may also add (a file system's unlink rewrites
/// its parent directory's record) and still be let into the reserve when
/// space is low: deleting must stay possible on a full device.
const REMOVAL_BATCH_ALLOWANCE: u64 = 64 << 10;

/// What a write needs to know of its batch before it takes the tree lock.
struct Admission {
    /// The batch must be refused when space is low.
    needs_space: bool,
    /// Key and value bytes (write amplification's denominator).
    user_bytes: u64,
    /// The messages, decoded, of a batch that may be staged (at most
    /// [`STAGED_BATCH_MAX_BYTES`]): what the staged batches' map takes,
    /// so a staged batch is decoded once on its way in.
    stageable: Option<Vec<(KeySpace, Message)>>,
}

/// Checks a caller's batch ([`check_message`]) and works out its
/// [`Admission`] in the same pass: each pass decodes every message.
fn admit(batch: &WriteBatch, merges: &MergeRegistry) -> EngineResult<Admission> {
    let mut removes = false;
    let mut added = 0;
    let mut user_bytes = 0;
    let mut stageable =
        (batch.body_len() <= STAGED_BATCH_MAX_BYTES).then(|| Vec::with_capacity(batch.len()));
    for (ks, m) in batch.messages() {
        check_message(&m, merges)?;
        user_bytes += m.user_bytes();
        // A range rename moves subtrees (surgery) or copies at most a
        // leaf of pairs, and deletes its source: admitted like a delete.
        if m.is_removal() || matches!(m, Message::RangeRename(_)) {
            removes = true;
        } else {
            added += m.user_bytes();
        }
        // A clone adds what it copies (a small range's pairs), far past
        // its own bytes, which is all the staged bytes count and the
        // space a staged write may skip a check for: it takes the tree
        // lock and the space check. A rename's copy is freed at its
        // source: it was admitted like a delete before it was staged.
        if matches!(m, Message::RangeClone(_)) {
            stageable = None;
        }
        if let Some(messages) = &mut stageable {
            messages.push((ks, m));
        }
    }
    Ok(Admission {
        needs_space: added > 0 && !(removes && added <= REMOVAL_BATCH_ALLOWANCE),
        user_bytes,
        stageable,
    })
}

/// Whether the settling and eviction after a write have work to do: a
/// node that holds more than it may, or a cache over its budget (else
/// they only take note of the space, which is not worth leaving for after
/// the reply).
fn settling_due(tree: &mut Tree, flushing: Flushing) -> bool {
    (flushing == Flushing::Stepwise && tree.settle_target().is_some())
        || tree.cache_excess(0, DirtyBudget::Cache) > 0
}

/// The largest batch staged: a bigger one (a file's data in a write of
/// many blocks) is applied at once under the tree lock rather than copied
/// into the staged batches and their key map first.
const STAGED_BATCH_MAX_BYTES: usize = 64 << 10;

/// The most a root's buffers may hold when a turn of an application of
/// staged writes begins ([`Inner::apply_staged_in_turns`]); past it
/// whoever applies settles in steps first. Past twice a node an application
/// settles the root whole, under the lock (`Tree::apply_messages`): with
/// the applier and the writers applying turns beside each other's
/// settling, WS3's roots got there, and such an application held the
/// lock 10-21 ms (docs/benchmarks/applier.md). A node and a half leaves
/// room for the turn (a quarter of the staging bound).
fn most_root_bytes_before_a_turn(node_size: usize) -> usize {
    node_size + node_size / 2
}

/// How long a thread that hands long work on
/// ([`Store::hand_long_work_on_from_this_thread`]) settles before it leaves
/// the rest of the settling to the thread it hands such work to: the next
/// request of its queue waits for this and a step at most. After the micro
/// suite's deleted 2 GiB file, a queue's thread settled 21-26 steps in a
/// piece, 39-55 ms, none reading from the device. Not less: at 2 ms a
/// fresh mount's tokubench handed settlings on in every run, and lost
/// rounds to the third thread (docs/benchmarks/settles-handed-on.md).
const SETTLING_BEFORE_HANDING_ON: Duration = Duration::from_millis(5);

/// Who runs an eviction ([`Inner::evict_in_steps`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Evictor {
    /// A writer whose batch took the cache over budget, in its request.
    Writer,
    /// The write-back thread ([`Options::background_write_back`]).
    WriteBackThread,
}

/// A writer's claim on the one merge into a leaf that may be worked out
/// with the tree lock let go ([`Inner::settle_in_steps`]); given back when
/// dropped. Taken and given back under the exclusive tree lock — which
/// orders it with the writes that find it taken — so the flag itself
/// needs no ordering of its own.
struct StepMergeClaim<'a>(&'a AtomicBool);

impl<'a> StepMergeClaim<'a> {
    /// The claim, unless another writer holds it.
    fn take(flag: &'a AtomicBool) -> Option<StepMergeClaim<'a>> {
        (!flag.swap(true, Ordering::Relaxed)).then_some(StepMergeClaim(flag))
    }
}

impl Drop for StepMergeClaim<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

impl Inner {
    pub(super) fn write(&self, batch: &WriteBatch, reservation: Reservation) -> EngineResult<u64> {
        self.check_writable()?;
        let Admission {
            needs_space,
            user_bytes,
            stageable,
        } = admit(batch, &self.merges)?;
        if batch.is_empty() {
            // A promise is kept by what the batch writes (see Reservation).
            if reservation != Reservation::default() {
                return Err(EngineError::InvalidMessage(
                    "space promised or given back by an empty batch".into(),
                ));
            }
            return Ok(0);
        }
        let staged = match stageable {
            Some(messages) if reservation == Reservation::default() => {
                self.stage(batch, messages)?
            }
            _ => None,
        };
        let (seq, wants_tree_flush) = match staged {
            Some(staged) => staged,
            None => self.write_locked(batch, reservation, needs_space)?,
        };
        add(&self.stats.user_bytes_written, user_bytes);
        add(&self.stats.user_messages, batch.len() as u64);
        self.after_write(wants_tree_flush);
        Ok(seq)
    }

    /// Logs and stages `batch` (`messages`, its messages decoded) holding
    /// the staging lock alone, if it may be (`store/staging.rs`): a batch
    /// small beside the bound, no more than twice the bound staged
    /// already, space ample, room in the log. Past the bound, or with a
    /// range rename among its messages, the writer applies what
    /// is staged — after its reply where that is done. Returns the
    /// sequence number and whether the tree flusher is wanted; None: the
    /// caller writes under the tree lock.
    fn stage(
        &self,
        batch: &WriteBatch,
        messages: Vec<(KeySpace, Message)>,
    ) -> EngineResult<Option<(u64, bool)>> {
        let bound = self.options.staging_bound();
        if bound == 0 || batch.body_len() > bound / 4 || !self.space_ample.load(Ordering::Acquire) {
            return Ok(None);
        }
        let ranges = messages
            .iter()
            .filter(|(_, m)| m.point_key().is_none())
            .count();
        // A rename is applied soon (until then, every query of its ranges
        // applies everything staged in its request), after the reply where
        // that is done. (Clones are not staged: `admit`.)
        let transplants = messages
            .iter()
            .any(|(_, m)| matches!(m, Message::RangeRename(_)));
        let (seq, past_bound) = loop {
            let mut staging = self.staging.write();
            if staging.range_count() + ranges > staging::STAGED_RANGES_MAX {
                return Ok(None);
            }
            if staging.bytes() > 2 * bound {
                if !self.waits_for_staging_room() {
                    return Ok(None);
                }
                drop(staging);
                self.wait_for_staging_room();
                // It also ends on a failure, which the next look would
                // only meet again.
                self.check_failed()?;
                continue;
            }
            // Under the staging lock: the checkpoint of a remount
            // read-only takes the staged batches in a hold of it, so a
            // write that checked before is in that checkpoint.
            self.check_writable()?;
            let seq = staging.next_seq;
            let (count, body) = batch.payload_parts();
            match self.log.append(seq, &[&count, body]) {
                Ok(_) => {}
                // Freeing the log takes a checkpoint: under the tree lock.
                Err(StoreError::LogFull { .. }) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
            staging.push(seq, batch.body_len(), messages, &self.merges);
            // Counted in the same hold: a query ordered after this write
            // finds it staged and reads the count moved.
            self.batches_applied.fetch_add(1, Ordering::Release);
            // Half the range deletes allowed count as the bound too: the
            // writers that would pass the most apply in their requests,
            // and one that passes half of it can leave the work for after
            // its reply (a file system's unlinks stage one each).
            let past_bound = staging.bytes() > bound
                || staging.range_count() > staging::STAGED_RANGES_MAX / 2
                || transplants;
            break (seq, past_bound);
        };
        add(&self.stats.writes_staged, 1);
        // Left for after the reply, the staging lock's bounds (twice these)
        // still hold the writers back if the work is not done soon.
        let wants_tree_flush = if past_bound && !self.staged_left_for_after_reply() {
            self.apply_staged_past_bound()?
        } else {
            if transplants {
                self.work_after_reply_is_long.store(true, Ordering::Release);
            }
            false
        };
        Ok(Some((seq, wants_tree_flush)))
    }

    /// Applies what is staged for a writer that took it past the bound
    /// (in its request, or after its reply); returns whether the tree
    /// flusher is wanted. A store that failed since keeps what is staged
    /// for the queries (and the log for recovery); the write was taken
    /// before the failure, which the next sync reports.
    fn apply_staged_past_bound(&self) -> EngineResult<bool> {
        let mut tree = self.lock_tree();
        self.wait_for_flush_backlog(&mut tree);
        if self.check_failed().is_err() {
            return Ok(false);
        }
        self.apply_staged(&mut tree)
    }

    /// A write under the tree lock: a batch that cannot be staged (a
    /// range clone, a reservation, a large batch, too many range messages
    /// staged, space or the log running short). The
    /// staged batches are applied before it, in the same hold.
    fn write_locked(
        &self,
        batch: &WriteBatch,
        reservation: Reservation,
        needs_space: bool,
    ) -> EngineResult<(u64, bool)> {
        let (count, body) = batch.payload_parts();
        let mut tree = self.lock_tree();
        self.wait_for_flush_backlog(&mut tree);
        // Most of what is staged goes in turns first: this hold takes the
        // rest with the batch.
        self.apply_staged_in_turns(&mut tree)?;
        // Everything from here to the log append is decided under one hold
        // of the lock: the sequence number, the promised space. A step that
        // needs a checkpoint while one is in flight waits for it — which
        // lets the lock go, so the decisions are made again from the start.
        let (seq, promised_after, staged) = 'admit: loop {
            // Again under the lock: a checkpoint for a remount read-only
            // must not be followed by a write that checked before it began.
            self.check_writable()?;
            let promised = self.promised_bytes.load(Ordering::Relaxed);
            let promised_after = promised
                .saturating_add(reservation.take)
                .saturating_sub(reservation.release);
            if reservation.take > 0 || needs_space {
                // A write drawing on a promise is checked with the promise
                // already given back; one making a promise, with it taken.
                let drawing = reservation.release > 0 && reservation.take == 0;
                let counted = if drawing {
                    promised_after
                } else {
                    promised.saturating_add(reservation.take)
                };
                if tree.space_low(counted, drawing) {
                    if tree.checkpoint_in_flight() {
                        self.wait_for_checkpoint_to_admit(&mut tree);
                        continue 'admit;
                    }
                    self.reclaim_space(&mut tree)?;
                    if tree.space_low(counted, drawing) {
                        return Err(EngineError::NoSpace);
                    }
                }
            }
            let mut attempts = 0;
            loop {
                // The sequence number, the log record and the staged
                // batches before it in one hold of the staging lock.
                let mut staging = self.staging.write();
                let seq = staging.next_seq;
                match self.log.append(seq, &[&count, body]) {
                    Ok(_) => {
                        staging.next_seq = seq + 1;
                        break 'admit (seq, promised_after, staging.take());
                    }
                    Err(StoreError::LogFull { .. }) if tree.checkpoint_in_flight() => {
                        drop(staging);
                        self.wait_for_checkpoint_to_admit(&mut tree);
                        continue 'admit;
                    }
                    // The log keeps the previous checkpoint's records too,
                    // so freeing it may take two checkpoints.
                    Err(StoreError::LogFull { .. }) if attempts < 2 => {
                        drop(staging);
                        attempts += 1;
                        match self.checkpoint_locked(&mut tree) {
                            // A full device cannot take the checkpoint that
                            // would free the log: push pending deletes down
                            // and free their space first (a delete must
                            // never be refused for lack of room).
                            Err(e) if e.is_no_space() => {
                                self.reclaim_space(&mut tree)?;
                                self.checkpoint_locked(&mut tree)?;
                            }
                            other => other?,
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        self.promised_bytes.store(promised_after, Ordering::Relaxed);
        let flushing = self.flushing_now(&tree);
        self.apply_taken(&mut tree, staged, Some((seq, batch)), flushing)?;
        // Counted before the locks go: whoever is ordered after this write
        // (through the tree lock, or a lock the caller held across it)
        // reads the count moved.
        self.batches_applied.fetch_add(1, Ordering::Release);
        let wants_tree_flush =
            if settling_due(&mut tree, flushing) && self.leave_work_for_after_reply() {
                // What settle_and_evict would have told the stagers.
                self.note_space(&tree);
                false
            } else {
                self.settle_and_evict(&mut tree, flushing)?
            };
        Ok((seq, wants_tree_flush))
    }

    /// Whether this writer leaves the work that follows its write for
    /// after its reply: on a thread that works after its replies, when no
    /// work is left pending already (so one write's worth at most waits).
    fn leave_work_for_after_reply(&self) -> bool {
        WORKS_AFTER_REPLY.with(Cell::get) && !self.work_after_reply.swap(true, Ordering::AcqRel)
    }

    /// Whether this writer, past the staging bound, leaves the
    /// application of what is staged for after a reply: on a thread that
    /// works after its replies, always — work already pending applies
    /// everything staged when it runs, this batch included (or, begun
    /// already, leaves it staged for the pending flag set here). Applying
    /// in the request instead, the second client's writer waited for the
    /// first's application to let the tree lock go, then applied,
    /// holding the file system's write order all the while: tokubench's
    /// longest requests (10-14 ms). What is staged stays bounded: past
    /// twice the bound a writer takes the tree lock and applies
    /// ([`Inner::stage`] refuses it).
    ///
    /// Elsewhere, with the applier running ([`Options::background_apply`]),
    /// the writer leaves the work to it, woken by the writer that finds
    /// none pending (the applier takes the pending work before it starts,
    /// so a writer past the bound during an application wakes it again).
    fn staged_left_for_after_reply(&self) -> bool {
        if WORKS_AFTER_REPLY.with(Cell::get) {
            self.work_after_reply.store(true, Ordering::Release);
            return true;
        }
        if !self.applier_runs() {
            return false;
        }
        if !self.work_after_reply.swap(true, Ordering::AcqRel) {
            self.want_apply();
        }
        true
    }

    /// The work writes left for after their replies: the staged batches
    /// applied, the buffers settled and the cache evicted, as the writer
    /// would have in its request.
    pub(super) fn work_after_reply(&self) -> EngineResult<()> {
        if !self.work_after_reply.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        self.work_after_reply_is_long
            .store(false, Ordering::Release);
        add(&self.stats.work_after_reply, 1);
        let working = Instant::now();
        let wants_tree_flush = self.apply_staged_past_bound()?;
        self.after_write(wants_tree_flush);
        record_max(&self.stats.work_after_reply_micros_max, working.elapsed());
        Ok(())
    }

    /// Applies the staged batches `staged` (in sequence order, taken from
    /// the staging lock), then `last` if given (a batch logged after
    /// them), to the trees. One hold of the lock for all of them: it is
    /// counted as one application (`apply_micros_max`).
    fn apply_taken(
        &self,
        tree: &mut TreeGuard<'_>,
        staged: Vec<StagedBatch>,
        last: Option<(u64, &WriteBatch)>,
        flushing: Flushing,
    ) -> EngineResult<()> {
        if staged.is_empty() && last.is_none() {
            return Ok(());
        }
        if !staged.is_empty() {
            self.note_staging_room();
            add(&self.stats.staged_applications, 1);
            let bytes: usize = staged.iter().map(|b| b.body_len).sum();
            note_max(&self.stats.staged_application_bytes_max, bytes as u64);
        }
        let applying = Instant::now();
        let in_order = |tree: &mut TreeGuard<'_>, seq: u64| {
            assert_eq!(
                seq, tree.next_seq,
                "store invariant: batches reach the trees in sequence order"
            );
            tree.next_seq = seq + 1;
        };
        // The staged batches' messages were decoded when they came in:
        // they go to the trees as they are.
        for batch in staged {
            in_order(tree, batch.seq);
            if let Err(e) = tree.apply_messages(batch.seq, batch.messages, flushing) {
                return Err(self.poison(e));
            }
        }
        if let Some((seq, batch)) = last {
            in_order(tree, seq);
            if let Err(e) = tree.apply_batch(seq, batch, flushing) {
                return Err(self.poison(e));
            }
        }
        record_max(&self.stats.apply_micros_max, applying.elapsed());
        Ok(())
    }

    /// Applies every staged batch to the trees now, without letting the
    /// lock go (a query that needs them there, a checkpoint, a range
    /// visit); returns the log's append position as of them: every record
    /// before it is in the trees, none after. Also on a store that
    /// failed: reads go on there, and see what was written before, as
    /// when every write reached the trees at once.
    pub(super) fn apply_staged_now(&self, tree: &mut TreeGuard<'_>) -> EngineResult<u64> {
        let (staged, head) = {
            let mut staging = self.staging.write();
            (staging.take(), self.log.append_pos())
        };
        let flushing = self.flushing_now(tree);
        self.apply_taken(tree, staged, None, flushing)?;
        Ok(head)
    }

    /// Applies every staged batch to the trees and settles them as a
    /// writer does, letting the lock go between steps (a writer past the
    /// staging bound, a query that needs the trees' value); returns
    /// whether the tree flusher is wanted.
    pub(super) fn apply_staged(&self, tree: &mut TreeGuard<'_>) -> EngineResult<bool> {
        self.apply_staged_in_turns(tree)?;
        let staged = self.staging.write().take();
        let flushing = self.flushing_now(tree);
        self.apply_taken(tree, staged, None, flushing)?;
        self.settle_and_evict(tree, flushing)
    }

    /// Applies the oldest staged batches, a quarter of the staging bound
    /// per hold of the tree lock, handing it on between holds, until no
    /// more than that is staged: the caller applies the rest in the hold
    /// that needs every staged batch applied: a hold's work is bounded by
    /// a quarter bound (256 KiB at the default) rather than twice the
    /// bound. Before each turn, and before the rest, the root buffers the
    /// staged batches will change that a checkpoint in flight shares are
    /// copied with the lock let go ([`Inner::copy_shared_root_buffers`]):
    /// a checkpoint may begin at any hand-on, and what was staged since
    /// the last copies may reach other buffers. Copied once before the
    /// first turn alone, the applier's turns (which writers stage beside)
    /// copied 32 root buffers under the lock in a WS3 run, single
    /// messages' applications of 10-23 ms (docs/benchmarks/applier.md).
    /// Stops on a store that failed, as a writer past the bound does (the
    /// caller decides).
    pub(super) fn apply_staged_in_turns(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        while self.check_failed().is_ok() {
            if !self.roots_have_room_for_a_turn(tree)
                && self.flushing_now(tree) == Flushing::Stepwise
            {
                self.settle_in_steps(tree)?;
            }
            if !self.apply_one_turn(tree)? {
                break;
            }
            parking_lot::RwLockWriteGuard::bump(tree);
        }
        Ok(())
    }

    /// Whether every root holds few enough messages for a turn of an
    /// application ([`most_root_bytes_before_a_turn`]).
    fn roots_have_room_for_a_turn(&self, tree: &Tree) -> bool {
        !tree.a_root_holds_more_than(most_root_bytes_before_a_turn(self.options.node_size))
    }

    /// One turn of [`Inner::apply_staged_in_turns`]: the oldest staged
    /// batches, a quarter of the staging bound, applied (the shared root
    /// buffers they change copied first); false when no more than that
    /// is staged (nothing taken).
    fn apply_one_turn(&self, tree: &mut TreeGuard<'_>) -> EngineResult<bool> {
        self.copy_shared_root_buffers(tree);
        let staged = self
            .staging
            .write()
            .take_oldest(self.options.staging_bound() / 4);
        if staged.is_empty() {
            return Ok(false);
        }
        let flushing = self.flushing_now(tree);
        self.apply_taken(tree, staged, None, flushing)?;
        add(&self.stats.staged_application_turns, 1);
        Ok(true)
    }

    /// Whether a writer that finds twice the staging bound staged waits
    /// for room ([`Inner::wait_for_staging_room`]) rather than apply under
    /// the tree lock: where the applier runs ([`Options::background_apply`]),
    /// except on threads that work after their replies (they apply, as
    /// without the applier).
    fn waits_for_staging_room(&self) -> bool {
        !WORKS_AFTER_REPLY.with(Cell::get) && self.applier_runs()
    }

    /// Back-pressure where the applier runs: a writer that found twice the
    /// staging bound staged waits until the applier takes some, rather
    /// than apply all of it in its call. Counted: the waits and the
    /// longest.
    fn wait_for_staging_room(&self) {
        let bound = self.options.staging_bound();
        let full = || self.staging.read().bytes() > 2 * bound;
        let waiting = Instant::now();
        // The work may have been taken before these bytes were staged.
        self.work_after_reply.store(true, Ordering::Release);
        self.want_apply();
        self.staging_room_waiters.fetch_add(1, Ordering::SeqCst);
        {
            let mut room = self
                .staging_room_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            while full() && self.applier_runs() && self.check_failed().is_ok() {
                room = self
                    .staging_room
                    .wait_timeout(room, Duration::from_millis(5))
                    .map(|(room, _)| room)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        self.staging_room_waiters.fetch_sub(1, Ordering::SeqCst);
        add(&self.stats.staging_room_waits, 1);
        let waited = waiting.elapsed();
        add(
            &self.stats.staging_room_wait_micros_total,
            waited.as_micros() as u64,
        );
        record_max(&self.stats.staging_room_wait_micros_max, waited);
    }

    /// Tells the writers waiting for room in the staged batches
    /// ([`Inner::wait_for_staging_room`]) that some were taken.
    fn note_staging_room(&self) {
        if self.staging_room_waiters.load(Ordering::SeqCst) > 0 {
            let _room = self
                .staging_room_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.staging_room.notify_all();
        }
    }

    /// While a checkpoint is in flight: copies the root buffers that the
    /// staged batches will change and that the checkpoint's copy of a root
    /// shares with the tree lock let go (fairly), then puts the copies in
    /// place, where nothing changed those buffers meanwhile. Left to the
    /// application, each would be copied under the lock: the copies of
    /// metadata buffers of 30K messages made the longest holds of an
    /// untar (20-33 ms; docs/benchmarks/unlocked-buffer-copies.md).
    fn copy_shared_root_buffers(&self, tree: &mut TreeGuard<'_>) {
        if !tree.checkpoint_in_flight() {
            return;
        }
        let shared: Vec<SharedBuffer> = {
            let staging = self.staging.read();
            KeySpace::ALL
                .into_iter()
                .flat_map(|ks| tree.shared_root_buffers(ks, staging.keys(ks)))
                .collect()
        };
        if shared.is_empty() {
            return;
        }
        let copies = parking_lot::RwLockWriteGuard::unlocked_fair(tree, || {
            shared
                .into_iter()
                .map(|s| {
                    let copy = s.copy();
                    (s, copy)
                })
                .collect()
        });
        let adopted = tree.adopt_buffer_copies(copies);
        add(&self.stats.root_buffers_copied_unlocked, adopted);
    }

    /// What follows the application of batches with the tree lock held:
    /// the writer's settling in steps, its eviction, and whether space is
    /// ample for staging. Returns whether the tree flusher is wanted.
    fn settle_and_evict(&self, tree: &mut TreeGuard<'_>, flushing: Flushing) -> EngineResult<bool> {
        if flushing == Flushing::Stepwise {
            self.settle_in_steps(tree)?;
        }
        if self.write_back_running.load(Ordering::SeqCst) {
            // Clean nodes go at once (no IO); dirty ones to the write-back
            // thread, unless the cache is already well past its budget
            // (with memory short, past the clean nodes' budget too: only
            // the thread writes back for that).
            tree.evict_clean_if_needed();
            let headroom = self.write_back_headroom();
            if tree.cache_excess(0, DirtyBudget::Cache) > headroom {
                self.evict_in_steps(tree, Evictor::Writer)?;
            } else if tree.cache_excess(headroom, self.dirty_budget()) > 0 {
                self.want_write_back();
            }
        } else {
            self.evict_in_steps(tree, Evictor::Writer)?;
        }
        self.note_space(tree);
        Ok(flushing == Flushing::Background && tree.flush_backlog() > tree.flush_low_water())
    }

    /// Whether a write may be staged without the tree's space check: the
    /// space is not low with three staging bounds' worth more dirty (what
    /// may be staged before the next application looks again, a batch
    /// included) and settling need not be inline. Judged by whoever
    /// applies, and when the store opens and its promises are set
    /// (`Store::set_promised_bytes`): before, a mount's first write always
    /// took the tree lock, and when that was a rename (`mv` after a
    /// remount and reads that wrote nothing) its surgery ran in the
    /// request (docs/benchmarks/renames-staged.md).
    pub(super) fn note_space(&self, tree: &Tree) {
        let promised = self.promised_bytes.load(Ordering::Relaxed);
        let headroom = 3 * self.options.staging_bound() as u64;
        let ample = !tree.space_low(promised.saturating_add(headroom), false)
            && tree.room_to_defer_settling(promised.saturating_add(headroom));
        self.space_ample.store(ample, Ordering::Release);
    }

    /// After a write, holding no tree lock: the background thread is
    /// asked for a checkpoint or a log flush when due, the tree flusher
    /// when wanted, and a writer far ahead of the log's device writes
    /// waits for them (back-pressure).
    fn after_write(&self, wants_tree_flush: bool) {
        let buffer = self.note_log_buffer();
        // A third of the log: the writer keeps the records of the previous
        // checkpoint's head on as well, so two of these fit in the region
        // with room to spare while the checkpoint runs.
        let wants_checkpoint = self.log.used() > self.log.capacity() / 3;
        let wants_flush = buffer.unflushed > log_flush_eager_bytes(self.options.cache_bytes);
        if wants_checkpoint {
            self.lock_background().checkpoint_wanted = true;
            self.wake.notify_all();
        }
        if wants_flush {
            self.want_log_flush();
        }
        if wants_tree_flush {
            self.want_tree_flush();
        }
        let bound = log_flush_writer_bytes(self.options.cache_bytes);
        if buffer.buffered > bound {
            self.wait_for_log_room(bound);
        }
    }

    /// Back-pressure, without the tree lock: a writer whose records fill
    /// the log's buffer past `bound` waits until the log's device writes
    /// take it back under (`LogWriter::make_room`), as a synchronous
    /// writer would wait for the device.
    fn wait_for_log_room(&self, bound: u64) {
        let waiting = Instant::now();
        let room = match self.log.make_room(bound) {
            Ok(room) => room,
            // The batch is applied, as any write not yet synced; what
            // failed is its durability, which the next sync reports (the
            // store refuses writes from here on).
            Err(e) => {
                let _ = self.poison(e.into());
                return;
            }
        };
        if room == Room::Ample {
            // A flush under way wrote enough of it meanwhile.
            return;
        }
        self.note_log_buffer();
        let waited = waiting.elapsed();
        add(&self.stats.writes_waited_for_log, 1);
        if room == Room::Flushed {
            add(&self.stats.writes_flushed_log, 1);
        }
        record_max(&self.stats.log_wait_micros_max, waited);
        add(&self.stats.log_wait_micros_total, waited.as_micros() as u64);
    }

    /// Before refusing a write for lack of space: push pending deletes down
    /// to the leaves and checkpoint, which frees what they deleted — and,
    /// with nothing deleted, checkpoint anyway: the copies of nodes that
    /// writes replaced stay allocated until two checkpoints no longer need
    /// them (once per batch written: refusing again with nothing written
    /// in between frees nothing more).
    fn reclaim_space(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        // Staged deletes count too.
        self.apply_staged_now(tree)?;
        if tree.removals_since_reclaim == 0 {
            if tree.reclaimed_at_seq == tree.next_seq {
                return Ok(());
            }
            tree.reclaimed_at_seq = tree.next_seq;
            for _ in 0..2 {
                match self.checkpoint_locked(tree) {
                    Err(e) if e.is_no_space() => return Ok(()),
                    other => other?,
                }
            }
            return Ok(());
        }
        tree.removals_since_reclaim = 0;
        tree.reclaimed_at_seq = tree.next_seq;
        // Step by step: each step rewrites no more than the free space can
        // take; blocks the previous checkpoint freed become reusable only
        // once a second one no longer needs the first's copy (two
        // generations), so each step ends with two checkpoints.
        loop {
            let budget = tree.reclaim_budget();
            let done = match tree.flush_some(budget) {
                Ok(done) => done,
                Err(e) => return Err(self.poison(e)),
            };
            for _ in 0..2 {
                match self.checkpoint_locked(tree) {
                    Err(e) if e.is_no_space() => return Ok(()),
                    Err(e) => return Err(e),
                    Ok(()) => {}
                }
            }
            if done {
                return Ok(());
            }
        }
    }

    /// Before the final checkpoint: what is staged is applied and the
    /// roots settled, so that the image is closed with every root's
    /// buffers within a node's worth. Left over it (a checkpoint applies
    /// what is staged and settles nothing), the first write after the
    /// next mount settled it, whatever it wrote: a read's atime update
    /// flushed the data tree's root into a leaf it read first, and one
    /// cold 4 KiB read right after mounting cost 2 MiB of device reads.
    /// Only while space is ample: a settle makes nodes dirty (and splits
    /// make new ones) that the checkpoint then has to place, and the log
    /// holds everything anyway.
    pub(super) fn settle_before_close(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        self.apply_staged_now(tree)?;
        self.note_space(tree);
        if self.space_ample.load(Ordering::Acquire) {
            self.settle_in_steps(tree)?;
        }
        Ok(())
    }

    /// A writer's settling ([`Flushing::Stepwise`]): what its batch left
    /// over a node's worth in the roots' buffers is flushed down a step
    /// at a time (`Tree::settle_step`: one flush, or one split), and
    /// between steps the lock goes fairly to whoever waits for it, so that
    /// no request waits for more than one step of someone else's cascade.
    /// The leaf a step flushes into is read beforehand with the lock let
    /// go. Each step leaves the tree whole. Counted: the steps that let
    /// others in, the longest step, and the leaves read for steps.
    fn settle_in_steps(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        let settling = Instant::now();
        loop {
            let mut stepping = Instant::now();
            let mut target = tree.settle_target();
            if let Some(place) = target.as_ref().and_then(|t| tree.settle_step_leaf(t)) {
                // A thread whose queue of requests would wait for the read
                // leaves the settling to the thread it hands long work to.
                if HANDS_LONG_WORK_ON.with(Cell::get) {
                    self.hand_settling_on();
                    return Ok(());
                }
                // The leaf the step flushes into is read with the lock
                // let go (fairly): a device read under it would shut out
                // every request for its whole length. If the tree changed
                // meanwhile, the step reads what it needs under the lock.
                let read = parking_lot::RwLockWriteGuard::unlocked_fair(tree, || {
                    read_leaf(&place, self.device.as_ref(), Want::Whole, &self.stats)
                });
                self.adopt_read(tree, &place, read, ReadFor::Flush);
                stepping = Instant::now();
                target = tree.settle_target();
            }
            let Some(mut target) = target else {
                return Ok(());
            };
            // The step's merge into a leaf, most of its work, is made with
            // the lock let go: queries and other writers go on beside it.
            // One merge at a time: a writer that finds another's in flight
            // leaves the settling to it, which goes on until nothing is
            // left to settle, this writer's messages included (its claim
            // is taken and given back under the lock, so it sees them).
            let mut prepared = None;
            if let Some(input) = tree.step_merge_input(&target) {
                let Some(claim) = StepMergeClaim::take(&self.step_merge_in_flight) else {
                    add(&self.stats.settling_left_to_a_merging_writer, 1);
                    return Ok(());
                };
                let merging = Instant::now();
                let merged = parking_lot::RwLockWriteGuard::unlocked_fair(tree, || {
                    if let Some(hook) = &self.options.step_merge_hook {
                        (hook.0)();
                    }
                    input.merge()
                });
                drop(claim);
                record_max(&self.stats.step_merge_micros_max, merging.elapsed());
                // The trees may have changed meanwhile: the step is chosen
                // again, and takes the merge only if it was made from the
                // leaf and the buffer as they are now.
                stepping = Instant::now();
                target = match tree.settle_target() {
                    Some(target) => target,
                    None => return Ok(()),
                };
                prepared = merged;
            }
            let nodes_read = self.stats.nodes_read.load(Ordering::Relaxed);
            tree.settle_step(target, prepared)
                .map_err(|e| self.poison(e))?;
            record_max(&self.stats.settle_step_micros_max, stepping.elapsed());
            add(&self.stats.settle_steps, 1);
            let freed = tree.take_freed_later();
            self.hand_on(tree, &self.options.settle_step_hook, freed);
            // A step also reads under the lock what its leaf's read does
            // not cover (a child below an interior target, the neighbour a
            // merge takes in): the steps after one that read are likely to,
            // and are left as above; so is a settling past its budget.
            if HANDS_LONG_WORK_ON.with(Cell::get)
                && (self.stats.nodes_read.load(Ordering::Relaxed) != nodes_read
                    || settling.elapsed() > SETTLING_BEFORE_HANDING_ON)
            {
                self.hand_settling_on();
                return Ok(());
            }
            // With the applier running, the writers stage beside its
            // settling: a turn between its steps keeps their waits for
            // room to a step's length (else a turn after the last step),
            // while the roots have room for it.
            if self.applier_runs()
                && self.staging.read().bytes() > self.options.staging_bound()
                && self.roots_have_room_for_a_turn(tree)
            {
                self.apply_one_turn(tree)?;
            }
        }
    }

    /// Leaves the settling to the thread this one hands long work to
    /// ([`Store::hand_long_work_on_from_this_thread`]): flagged pending and
    /// long, it goes there once this thread's replies are sent.
    fn hand_settling_on(&self) {
        add(&self.stats.settles_handed_on, 1);
        self.work_after_reply_is_long.store(true, Ordering::Release);
        self.work_after_reply.store(true, Ordering::Release);
    }

    /// A writer's eviction when its batch took the cache over budget: a
    /// dirty node written back per step ([`Tree::evict_step`]), its device
    /// write made with the lock let go and handed on fairly meanwhile.
    /// Counted: the steps that let others in, and the longest hold of the
    /// lock (`evict_micros_max`: choosing and encoding, or taking the
    /// written node in).
    pub(super) fn evict_in_steps(
        &self,
        tree: &mut TreeGuard<'_>,
        evictor: Evictor,
    ) -> EngineResult<()> {
        // The thread works as if the budget were a headroom smaller, and
        // with memory short writes dirty nodes back for the memory beside
        // the cache as well.
        let (headroom, dirty_budget) = match evictor {
            Evictor::Writer => (0, DirtyBudget::Cache),
            Evictor::WriteBackThread => (self.write_back_headroom(), self.dirty_budget()),
        };
        let mut continuing = false;
        loop {
            let evicting = Instant::now();
            // Choosing and copying allocates nothing: no space is not an
            // error of this part.
            let copy = tree
                .evict_step(continuing, headroom, dirty_budget)
                .map_err(|e| self.poison(e))?;
            record_max(&self.stats.evict_micros_max, evicting.elapsed());
            let Some(copy) = copy else {
                return Ok(());
            };
            add(&self.stats.eviction_steps, 1);
            if evictor == Evictor::WriteBackThread {
                add(&self.stats.background_eviction_steps, 1);
            }
            continuing = true;
            // The image is encoded with the lock let go (fairly), as it is
            // written: a leaf of a few MiB took up to 14 ms to encode.
            let encoded = parking_lot::RwLockWriteGuard::unlocked_fair(tree, || {
                if let Some(hook) = &self.options.evict_encode_hook {
                    (hook.0)();
                }
                copy.encode()
            });
            let placing = Instant::now();
            let write_back = match tree.place_write_back(encoded) {
                Ok(Some(write_back)) => write_back,
                // The node changed meanwhile: the next step picks again.
                Ok(None) => continue,
                Err(e) if e.is_no_space() => {
                    tracing::warn!("cache over budget: no space to write back dirty nodes");
                    return Ok(());
                }
                Err(e) => return Err(self.poison(e)),
            };
            record_max(&self.stats.evict_micros_max, placing.elapsed());
            // The device write, of up to a node, with the lock let go
            // (fairly: whoever waits goes first). The write-back thread's
            // leaves gaps for syncs. A writer's (the cache past its budget)
            // and any made while memory is short go whole: they are what
            // makes room, and waiting for syncs there let the daemon's
            // resident size grow by 20-30 MiB in the micro suite's
            // fsync-heavy phases (docs/benchmarks/write-back-pieces.md).
            let beside_syncs =
                evictor == Evictor::WriteBackThread && !self.memory_short.load(Ordering::Relaxed);
            let written = parking_lot::RwLockWriteGuard::unlocked_fair(tree, || {
                if let Some(hook) = &self.options.evict_step_hook {
                    (hook.0)();
                }
                if beside_syncs {
                    self.write_node_beside_syncs(write_back.image(), write_back.offset())
                } else {
                    write_back.write(self.device.as_ref())
                }
            });
            let finishing = Instant::now();
            if let Err(e) = tree.finish_write_back(write_back, written) {
                return Err(self.poison(e));
            }
            record_max(&self.stats.evict_micros_max, finishing.elapsed());
        }
    }

    /// The budget past which the write-back thread writes dirty nodes
    /// back ([`Store::set_memory_short`]).
    fn dirty_budget(&self) -> DirtyBudget {
        if self.memory_short.load(Ordering::Relaxed) {
            DirtyBudget::Clean
        } else {
            DirtyBudget::Cache
        }
    }

    /// How far below its budget the write-back thread keeps the node
    /// cache, and how far past it a writer lets it go before it writes
    /// back itself ([`WRITE_BACK_HEADROOM_NODES`]).
    fn write_back_headroom(&self) -> usize {
        WRITE_BACK_HEADROOM_NODES * self.options.node_size
    }

    /// Between two steps of a writer's work: the lock goes fairly to
    /// whoever waits for it (or, in tests, to the hook's requests), and
    /// what the step took out of the trees is freed meanwhile.
    fn hand_on(
        &self,
        tree: &mut TreeGuard<'_>,
        hook: &Option<TurnHook>,
        freed: Vec<MessageBuffer>,
    ) {
        if hook.is_none() && freed.is_empty() {
            parking_lot::RwLockWriteGuard::bump(tree);
            return;
        }
        parking_lot::RwLockWriteGuard::unlocked_fair(tree, || {
            drop(freed);
            if let Some(hook) = hook {
                (hook.0)();
            }
        });
    }

    /// Back-pressure: while a root's buffers hold more than the backlog
    /// bound, a writer waits (giving up the tree lock) for the tree
    /// flusher's turns to bring them down. Counted: how many writes
    /// waited, and how long.
    fn wait_for_flush_backlog(&self, tree: &mut TreeGuard<'_>) {
        let flushing = |tree: &Tree| self.background_flush_now(tree);
        let over = |tree: &Tree| tree.flush_backlog() > tree.flush_backlog_bound();
        if !flushing(tree) || !over(tree) {
            return;
        }
        add(&self.stats.writes_waited_for_flush, 1);
        let waiting = Instant::now();
        self.want_tree_flush();
        while over(tree) && flushing(tree) && self.check_failed().is_ok() {
            // Every turn signals; the flusher is wanted again after each
            // wait: it may have stopped while writers had to settle for
            // themselves (space short) and gone to sleep before they
            // could leave the work to it again (a test's writers once
            // waited here for good).
            self.flush_progress
                .wait(tree, Some(Duration::from_millis(100)));
            self.want_tree_flush();
        }
        let waited = waiting.elapsed();
        record_max(&self.stats.flush_wait_micros_max, waited);
        add(
            &self.stats.flush_wait_micros_total,
            waited.as_micros() as u64,
        );
    }

    /// Who settles what a write leaves in the roots: the flusher thread
    /// if it runs, else the writer in steps — both only with room to
    /// spare (`Tree::room_to_defer_settling`): a write's admission checks
    /// that the space its own settling dirties will fit, which the
    /// flusher's later work would escape, and either lets a checkpoint or
    /// an eviction write an interior node fuller than a node (an image
    /// past the allocator's node-sized runs). Short of room, the writer
    /// settles inline, as before.
    fn flushing_now(&self, tree: &Tree) -> Flushing {
        if !tree.room_to_defer_settling(self.promised_bytes.load(Ordering::Relaxed)) {
            Flushing::Inline
        } else if self.tree_flusher_running.load(Ordering::SeqCst) {
            Flushing::Background
        } else {
            Flushing::Stepwise
        }
    }

    /// Whether messages are left to the tree flusher now.
    pub(super) fn background_flush_now(&self, tree: &Tree) -> bool {
        self.flushing_now(tree) == Flushing::Background
    }
}
