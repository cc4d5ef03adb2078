//! Who may hold the inode table, and when (docs/design.md, "The table's
//! lock and the write order").
//!
//! Two locks, always taken in this order:
//!
//! - the **write order** (`FileSystem::writes`): held by every operation
//!   that writes a batch, from its plan to its table update. Writers go
//!   one at a time, so what a writer planned from the table and the store
//!   is still true when its batch is in and it installs the plan.
//! - the **table's lock** (`FileSystem::state`): held for reads and
//!   changes of the table. A writer lets it go while the store takes its
//!   batch ([`Writer::write`]): the engine call — logging, staging, at
//!   times applying what is staged, or waiting for the flusher — is most
//!   of a write's time, and requests that need only the table (a
//!   `getattr`, a `release`, a negative lookup the table answers) no
//!   longer wait for it.
//!
//! While a writer's batch is going in, the store is ahead of the table:
//! `State::write_in_flight` says so. Whoever reads the store and the
//! table together takes the table with [`FileSystem::lock`], which waits
//! until no write is in flight (a rename's batch moves keys the table
//! still has at their old paths); the reads that let the lock go while
//! the store reads (`lookup_entry`, `list_dir`, `read_data`) check their
//! counts under it afterwards as before. [`FileSystem::lock_table`] is for
//! what uses the table alone, and may see it as it was before a write
//! that has not returned yet — which a request racing that write may.

use std::ops::{Deref, DerefMut};
use std::panic::AssertUnwindSafe;

use betreefs_engine::{EngineResult, Reservation, WriteBatch};
use parking_lot::MutexGuard;

use super::key_bound;
use super::state::State;
use super::FileSystem;

/// The table, locked.
pub(super) type Table<'a> = MutexGuard<'a, State>;

/// The write order and the table, held by an operation that writes.
pub(super) struct Writer<'a> {
    fs: &'a FileSystem,
    st: Table<'a>,
    /// Dropped after `st` (fields drop in order): the table's lock goes
    /// first, as it is always the inner one.
    _order: MutexGuard<'a, ()>,
}

impl Deref for Writer<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        &self.st
    }
}

impl DerefMut for Writer<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.st
    }
}

impl Writer<'_> {
    /// Writes `batch` with the table's lock let go meanwhile; the table
    /// is held again when this returns, with the write no longer in
    /// flight, for the caller to install its plan (or not, on an error).
    pub(super) fn write(&mut self, batch: &WriteBatch) -> EngineResult<u64> {
        self.write_reserving(batch, Reservation::default())
    }

    /// [`Writer::write`] with space promised or given back.
    pub(super) fn write_reserving(
        &mut self,
        batch: &WriteBatch,
        reservation: Reservation,
    ) -> EngineResult<u64> {
        debug_assert!(!self.st.write_in_flight, "writers go one at a time");
        // The key bound goes into the batch that passes it (the record
        // and the keys it covers are durable together).
        let bound = self.st.key_bound.after(batch);
        let with_bound;
        let batch = match bound {
            Some(b) => {
                with_bound = key_bound::with_bound(batch, b);
                &with_bound
            }
            None => batch,
        };
        self.st.write_in_flight = true;
        let store = &self.fs.store;
        // A panic in the store (a bug the request guard reports) must not
        // leave the flag set: every later reader would wait for it.
        let written = std::panic::catch_unwind(AssertUnwindSafe(|| {
            MutexGuard::unlocked(&mut self.st, || store.write_reserving(batch, reservation))
        }));
        self.st.write_in_flight = false;
        self.fs.settled.notify_all();
        match written {
            Ok(written) => {
                if let (Ok(_), Some(b)) = (&written, bound) {
                    self.st.key_bound = key_bound::Bound::stored_as(b);
                }
                written
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl FileSystem {
    /// The table with no write in flight: for reading it together with
    /// the store.
    pub(super) fn lock(&self) -> Table<'_> {
        self.settle(self.lock_table())
    }

    /// The table as it is, a write perhaps in flight: for requests that
    /// use the table alone.
    pub(super) fn lock_table(&self) -> Table<'_> {
        self.state.lock()
    }

    /// Waits, the lock let go meanwhile, until no write is in flight.
    pub(super) fn settle<'a>(&self, mut st: Table<'a>) -> Table<'a> {
        while st.write_in_flight {
            self.settled.wait(&mut st);
        }
        st
    }

    /// The write order, then the table: for an operation that may write.
    pub(super) fn writer(&self) -> Writer<'_> {
        let order = self.writes.lock();
        let st = self.state.lock();
        debug_assert!(!st.write_in_flight, "only the write order's holder writes");
        Writer {
            fs: self,
            st,
            _order: order,
        }
    }
}
