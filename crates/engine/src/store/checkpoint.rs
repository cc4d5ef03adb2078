//! Checkpoints: in turns beside requests (the background thread's), or
//! with the tree lock held throughout (a full log, reclaiming space,
//! close).

use std::time::{Duration, Instant};

use super::*;
use crate::tree::{encode_snapshots, SnapshotImages};

/// A checkpoint writes its nodes in pieces while a sync began within this
/// long (see `Inner::write_checkpoint_turn`).
const URGENT_FLUSH_WINDOW: Duration = Duration::from_secs(1);

/// The turns a checkpoint held the tree lock.
#[derive(Default)]
struct LockTurns {
    total: Duration,
    longest: Duration,
}

impl LockTurns {
    fn add(&mut self, turn: Duration) {
        self.total += turn;
        self.longest = self.longest.max(turn);
    }
}

impl Inner {
    /// A checkpoint written while requests go on: the tree lock is held
    /// only in short turns — to note what is dirty, to encode a bounded
    /// part of it, to give the images their places — and to record that
    /// it is durable (docs/design.md, "Checkpoints that do not stop the
    /// world").
    pub(super) fn checkpoint(&self) -> EngineResult<()> {
        self.check_image_writable()?;
        let mut tree = self.lock_tree();
        // Most of what is staged in turns first: the checkpoint's first
        // turn applies the rest.
        self.apply_staged_in_turns(&mut tree)?;
        self.wait_for_checkpoint(&mut tree);
        // After the wait: the checkpoint waited for may have failed.
        self.check_failed()?;
        let mut turn = Instant::now();
        let mut locked = LockTurns::default();
        let head = self.apply_staged_now(&mut tree)?;
        tree.begin_checkpoint(head, self.log.epoch(), false)
            .map_err(|e| self.poison(e))?;
        let mut io = Duration::ZERO;
        // Turns: encode a bounded part under the lock (copy interior
        // nodes), write it and encode the copies without.
        let mut encoded = SnapshotImages::none();
        loop {
            let budget = self.options.checkpoint_turn_bytes;
            let turn_result = tree.checkpoint_turn(budget, encoded);
            locked.add(turn.elapsed());
            drop(tree);
            let (done, images, snapshots) = match turn_result {
                Ok(turn) => turn,
                Err(e) => {
                    self.checkpoint_ended.notify_all();
                    return Err(self.poison(e));
                }
            };
            let writing = Instant::now();
            let written = self.write_checkpoint_turn(&images);
            io += writing.elapsed();
            if let Err(e) = written {
                self.lock_tree().cancel_checkpoint();
                self.checkpoint_ended.notify_all();
                return Err(self.poison(e));
            }
            encoded = encode_snapshots(snapshots);
            if !done {
                if let Some(hook) = &self.options.checkpoint_turn_hook {
                    (hook.0)();
                }
            }
            tree = self.lock_tree();
            turn = Instant::now();
            if done {
                break;
            }
        }
        let sealed = tree.seal_checkpoint(encoded);
        locked.add(turn.elapsed());
        drop(tree);
        let writes = match sealed {
            Ok(writes) => writes,
            Err(e) => {
                self.checkpoint_ended.notify_all();
                return Err(self.poison(e));
            }
        };
        let io_started = Instant::now();
        let written = writes.write(self.device.as_ref(), &self.stats, || {
            self.flush_log(false).map_err(EngineError::from)
        });
        io += io_started.elapsed();
        let mut tree = self.lock_tree();
        let relocked = Instant::now();
        let result = match written {
            Ok(()) => {
                tree.finish_checkpoint(writes.generation());
                self.log.set_head(head);
                Ok(())
            }
            Err(e) => {
                tree.abort_checkpoint();
                Err(e)
            }
        };
        locked.add(relocked.elapsed());
        drop(tree);
        self.checkpoint_ended.notify_all();
        self.record_checkpoint_times(locked, io);
        result.map_err(|e| self.poison(e))
    }

    /// Writes one turn of a background checkpoint's node images, each
    /// leaving gaps for syncs ([`Inner::write_node_beside_syncs`]).
    fn write_checkpoint_turn(&self, images: &crate::tree::NodeWrites) -> EngineResult<()> {
        for (offset, image) in images {
            self.write_node_beside_syncs(image, *offset)
                .map_err(|e| EngineError::from(StoreError::io("writing node", e)))?;
        }
        Ok(())
    }

    /// Writes a node image that no sync waits for (a background
    /// checkpoint's, the write-back thread's) so that an fsync
    /// meanwhile waits for little of it. While syncs are coming (one
    /// began within [`URGENT_FLUSH_WINDOW`]), the image goes in pieces
    /// of at most [`Options::write_piece_bytes`], each after the log
    /// flushes that syncs wait on have finished. A device sync waits
    /// for what was written before it: a checkpoint's hundreds of
    /// megabytes queued in front of every log write (an unlink + fsync
    /// took 5-15 ms while one ran on the reference machine's loop
    /// device, 1 ms in pieces, 0.15 ms with none running), and so did a
    /// write-back's leaf of 4 MiB (a 4 KiB write + fsync during an
    /// untar took 10-15 ms ten times a second, as leaves were written
    /// back). Otherwise whole: the device takes big writes faster, and
    /// a burst of writes with no sync waits for checkpoints to free the
    /// log (docs/design.md, "Checkpoints that do not stop the world").
    pub(super) fn write_node_beside_syncs(&self, image: &[u8], offset: u64) -> std::io::Result<()> {
        let piece_bytes = if self.log.urgent_flush_within(URGENT_FLUSH_WINDOW) {
            self.options.write_piece_bytes
        } else {
            image.len().max(1)
        };
        for (i, piece) in image.chunks(piece_bytes).enumerate() {
            self.log.wait_for_urgent_flushes();
            let at = offset + (i * piece_bytes) as u64;
            self.device.write_at(piece, at)?;
        }
        Ok(())
    }

    /// A write's wait for the checkpoint in flight (counted: it is
    /// back-pressure a writer felt).
    pub(super) fn wait_for_checkpoint_to_admit(&self, tree: &mut TreeGuard<'_>) {
        add(&self.stats.writes_waited_for_checkpoint, 1);
        self.wait_for_checkpoint(tree);
    }

    /// Waits (giving up the tree lock meanwhile) until no checkpoint is
    /// being written: one is in flight at a time.
    pub(super) fn wait_for_checkpoint(&self, tree: &mut TreeGuard<'_>) {
        while tree.checkpoint_in_flight() {
            self.checkpoint_ended.wait(tree, None);
        }
    }

    /// The checkpoint of a close, marked clean: nothing follows it in the log.
    pub(super) fn final_checkpoint(&self) -> EngineResult<()> {
        self.check_image_writable()?;
        let mut tree = self.lock_tree();
        self.check_failed()?;
        self.settle_before_close(&mut tree)?;
        self.write_checkpoint(&mut tree, true)
    }

    pub(super) fn checkpoint_locked(&self, tree: &mut TreeGuard<'_>) -> EngineResult<()> {
        self.write_checkpoint(tree, false)
    }

    /// A checkpoint with the tree lock held throughout, for the paths that
    /// cannot go on without one (a full log, reclaiming space, close).
    pub(super) fn write_checkpoint(
        &self,
        tree: &mut TreeGuard<'_>,
        clean: bool,
    ) -> EngineResult<()> {
        self.wait_for_checkpoint(tree);
        let started = Instant::now();
        let head = self.apply_staged_now(tree)?;
        // Every record before the new head reaches the log before the
        // superblock, although the checkpoint contains it: recovery from
        // the previous superblock copy (should this one be lost) replays
        // it from there.
        let turn_bytes = self.options.checkpoint_turn_bytes;
        tree.write_checkpoint(head, self.log.epoch(), clean, turn_bytes, || {
            self.flush_log(false).map_err(EngineError::from)
        })
        .map_err(|e| self.poison(e))?;
        self.log.set_head(head);
        let mut locked = LockTurns::default();
        locked.add(started.elapsed());
        self.record_checkpoint_times(locked, Duration::ZERO);
        Ok(())
    }

    /// `locked`: the checkpoint's turns with the tree lock held (a request
    /// may have waited as long as the longest); `io`: how long it wrote
    /// without it.
    fn record_checkpoint_times(&self, locked: LockTurns, io: Duration) {
        let stats = &self.stats;
        add(
            &stats.checkpoint_micros_total,
            locked.total.as_micros() as u64,
        );
        record_max(&stats.checkpoint_micros_max, locked.longest);
        add(&stats.checkpoint_io_micros_total, io.as_micros() as u64);
        record_max(&stats.checkpoint_io_micros_max, io);
    }
}
