//! Preallocation: blocks fallocate promised and nothing has written yet
//! (docs/design.md "Preallocation").
//!
//! A B^ε-tree has no extents to allocate ahead, and every write needs new
//! space anyway (nodes are copied on write), so a reservation is a promise
//! of space rather than a place: each extent is a key under the file
//! (`schema::reservation_key`), the total is slot 1 of the counts record,
//! and the store holds that much space back from every other write
//! ([`betreefs_engine::Reservation`]). A write into reserved blocks gives
//! their share back in the same batch and is checked against a smaller
//! reserve, so it cannot run out of room where the promise was made.

use std::collections::HashSet;

use betreefs_engine::{KeySpace, Reservation, WriteBatch};

use super::{blocks_to, FileSystem, BLOCK_SIZE};
use crate::error::{Errno, FsResult};
use crate::plan::reserved_count_update;
use crate::record::{decode_reservation, encode_reservation, Attr, PREALLOC_FL, SPARSE_FL};
use crate::schema;

/// The space one reserved block holds back: what a block written costs
/// the tree at worst — its bytes and room for its key and message header,
/// twice over, since a leaf that splits leaves two halves that may each
/// stay half full (a file written from start to end fills its leaves that
/// way: measured 2.1 bytes of nodes per byte of a sequentially written
/// file on a 64 KiB-node image).
pub(crate) const RESERVED_BLOCK_BYTES: u64 = 2 * (BLOCK_SIZE + 512);

/// How a batch changes the blocks reserved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ReservedBlocks {
    pub taken: u64,
    pub released: u64,
}

impl ReservedBlocks {
    pub(super) fn released(blocks: u64) -> Self {
        ReservedBlocks {
            taken: 0,
            released: blocks,
        }
    }

    /// What the store is told with the batch.
    pub(super) fn reservation(self) -> Reservation {
        Reservation {
            take: self.taken * RESERVED_BLOCK_BYTES,
            release: self.released * RESERVED_BLOCK_BYTES,
        }
    }
}

/// Sorted, disjoint half-open block runs.
type Runs = Vec<(u64, u64)>;

/// [`a`, `b`) less the blocks of every run in `minus` (each sorted and
/// disjoint; the result is too).
fn subtract(a: u64, b: u64, minus: &[&[(u64, u64)]]) -> Runs {
    let mut cut: Runs = minus.iter().flat_map(|r| r.iter().copied()).collect();
    cut.sort_unstable();
    let mut out = Vec::new();
    let mut at = a;
    for (s, e) in cut {
        if e <= at || s >= e {
            continue;
        }
        if s >= b {
            break;
        }
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
    }
    if at < b {
        out.push((at, b));
    }
    out
}

/// Joins runs that touch.
fn coalesce(mut runs: Runs) -> Runs {
    runs.sort_unstable();
    let mut out: Runs = Vec::with_capacity(runs.len());
    for (s, e) in runs {
        match out.last_mut() {
            Some(last) if last.1 >= s => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// `runs` less every block of `cut` (both sorted, disjoint).
pub(super) fn runs_without(runs: &[(u64, u64)], cut: &[(u64, u64)]) -> Runs {
    runs.iter()
        .flat_map(|&(s, e)| subtract(s, e, &[cut]))
        .collect()
}

/// The blocks of either, as sorted, disjoint runs.
pub(super) fn join_runs(mut a: Runs, b: &[(u64, u64)]) -> Runs {
    a.extend_from_slice(b);
    coalesce(a)
}

fn total(runs: &[(u64, u64)]) -> u64 {
    runs.iter().map(|(s, e)| e - s).sum()
}

impl FileSystem {
    /// The reservations of `file` that overlap blocks [`a`, `b`), in
    /// order; with `touching`, also those that end at `a` or begin at `b`.
    fn reservations_near(&self, file: &[u8], a: u64, b: u64, touching: bool) -> FsResult<Runs> {
        let after = if touching { a.saturating_sub(1) } else { a };
        let (lo, hi) = schema::reservations_ending_after(file, after);
        let mut out = Vec::new();
        for item in self.store.range(KeySpace::Data, &lo, Some(&hi)) {
            let (key, value) = item?;
            let (start, end) = decode_extent(file, &key, &value)?;
            if start > b || (start == b && !touching) {
                break;
            }
            out.push((start, end));
        }
        Ok(out)
    }

    /// Every reservation of `file`.
    pub(super) fn reservations_of(&self, file: &[u8]) -> FsResult<Runs> {
        self.reservations_near(file, 0, u64::MAX, true)
    }

    /// The blocks reserved for a file whose record is `attr`, at `file`.
    pub(super) fn reserved_blocks_of(&self, attr: &Attr, file: &[u8]) -> FsResult<u64> {
        if attr.flags & PREALLOC_FL == 0 {
            return Ok(0);
        }
        Ok(total(&self.reservations_of(file)?))
    }

    /// Before a file is dropped with everything it owns: counts its
    /// reservations out of the total (the range delete of the file takes
    /// their keys). `attr` is its record when known; without it the
    /// reservations are looked for.
    pub(super) fn release_all_reservations(
        &self,
        batch: &mut WriteBatch,
        attr: Option<&Attr>,
        file: &[u8],
    ) -> FsResult<ReservedBlocks> {
        let blocks = match attr {
            Some(attr) => self.reserved_blocks_of(attr, file)?,
            None => total(&self.reservations_of(file)?),
        };
        reserved_count_update(batch, -(blocks as i64));
        Ok(ReservedBlocks::released(blocks))
    }

    /// Takes blocks [`a`, `b`) out of `file`'s reservations (they were
    /// written or cut off); the blocks released.
    pub(super) fn carve_reservations(
        &self,
        batch: &mut WriteBatch,
        file: &[u8],
        a: u64,
        b: u64,
    ) -> FsResult<u64> {
        Ok(self
            .update_reservations(batch, file, (a, b), &[], &[(a, b)])?
            .released)
    }

    /// Changes `file`'s reservations within the `window` of blocks: the
    /// blocks of `add` become reserved (unless reserved already), then
    /// those of `remove` stop being so (both sorted, disjoint runs inside
    /// the window). Extents that come to touch are joined; the counts
    /// record follows. Returns the blocks taken or released.
    pub(super) fn update_reservations(
        &self,
        batch: &mut WriteBatch,
        file: &[u8],
        window: (u64, u64),
        add: &[(u64, u64)],
        remove: &[(u64, u64)],
    ) -> FsResult<ReservedBlocks> {
        let (a, b) = window;
        if a >= b {
            return Ok(ReservedBlocks::default());
        }
        let old = self.reservations_near(file, a, b, true)?;
        let joined = coalesce(old.iter().chain(add).copied().collect());
        let new = runs_without(&joined, remove);
        let new_ends: HashSet<u64> = new.iter().map(|&(_, e)| e).collect();
        let unchanged: HashSet<(u64, u64)> = old.iter().copied().collect();
        for (_, end) in &old {
            if !new_ends.contains(end) {
                batch.delete(KeySpace::Data, &schema::reservation_key(file, *end));
            }
        }
        for run @ (start, end) in &new {
            if !unchanged.contains(run) {
                let key = schema::reservation_key(file, *end);
                batch.put(KeySpace::Data, &key, &encode_reservation(*start));
            }
        }
        let (before, after) = (total(&old), total(&new));
        reserved_count_update(batch, after as i64 - before as i64);
        Ok(ReservedBlocks {
            taken: after.saturating_sub(before),
            released: before.saturating_sub(after),
        })
    }

    /// The runs of blocks in [`a`, `b`) a file stores: all blocks below
    /// its size for a file without holes, else those its data keys say.
    pub(super) fn stored_runs(&self, attr: &Attr, file: &[u8], a: u64, b: u64) -> FsResult<Runs> {
        if attr.flags & SPARSE_FL == 0 {
            let end = blocks_to(attr.size).min(b);
            return Ok(if a < end { vec![(a, end)] } else { Vec::new() });
        }
        let (lo, hi) = (schema::data_key(file, a), schema::data_key(file, b));
        let mut runs: Runs = Vec::new();
        self.store
            .visit_range(KeySpace::Data, &lo, &hi, &mut |k, _| {
                if let Some(block) = schema::data_block(file, k) {
                    match runs.last_mut() {
                        Some(last) if last.1 == block => last.1 += 1,
                        _ => runs.push((block, block + 1)),
                    }
                }
            })?;
        Ok(runs)
    }
}

/// The extent a reservation key and value name; `EIO` (logged) when they
/// are not one.
fn decode_extent(file: &[u8], key: &[u8], value: &[u8]) -> FsResult<(u64, u64)> {
    let extent = schema::reservation_end(file, key)
        .and_then(|end| Some((decode_reservation(value, end)?, end)));
    extent.ok_or_else(|| {
        tracing::error!("corrupt reservation record at {key:?}");
        Errno::EIO
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subtracting_and_joining_runs() {
        assert_eq!(subtract(0, 10, &[]), vec![(0, 10)]);
        assert_eq!(
            subtract(0, 10, &[&[(2, 4)], &[(3, 5), (8, 12)]]),
            vec![(0, 2), (5, 8)]
        );
        assert_eq!(subtract(5, 6, &[&[(0, 100)]]), vec![]);
        assert_eq!(subtract(5, 9, &[&[(0, 5), (9, 10)]]), vec![(5, 9)]);
        assert_eq!(
            coalesce(vec![(5, 8), (0, 2), (2, 3), (8, 9)]),
            vec![(0, 3), (5, 9)]
        );
        assert_eq!(total(&[(0, 3), (5, 9)]), 7);
    }
}
