//! The key bound: no metadata key is longer than it (`record::KeyBound`,
//! docs/design.md "The key bound"). A rename that moves a directory
//! under a longer prefix must refuse to push any key below it past the
//! key limit; the bound answers that for most renames without a walk of
//! every key below the directory, which was half of a `mv` of a source
//! tree. Every batch raises the stored bound as it writes (the write
//! order's holder, `super::locking::Writer`), so the bound and the keys
//! it covers are durable together.

use betreefs_engine::{KeySpace, WriteBatch};

use super::{FileSystem, ENTRY_KEY_MAX};
use crate::error::FsResult;
use crate::record::KeyBound;
use crate::schema;

/// The least bound stored: paths of a few directories' depth stay below
/// it, so that most file systems never raise it.
pub(crate) const KEY_BOUND_MIN: usize = 256;
/// A raised bound is rounded up to a multiple of this, so that a tree of
/// ever deeper paths raises it once per step rather than once per key.
const KEY_BOUND_STEP: usize = 64;
/// A bound this high no longer spares walks (renames lengthening keys by
/// more than what is left walk): it is found again by a walk of every
/// metadata key at the next rename that walks.
const KEY_BOUND_RESET: usize = ENTRY_KEY_MAX / 2;

/// The bound as the table keeps it.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Bound {
    /// No metadata key is longer than this; None while unknown (a
    /// read-only mount of an image made before format 4).
    pub(super) known: Option<usize>,
    /// What the store's record says (a walk can find a lower bound than
    /// the record's, written with the next batch).
    pub(super) stored: usize,
}

impl Bound {
    /// The bound the store's record holds (and so known).
    pub(super) fn stored_as(bound: usize) -> Bound {
        Bound {
            known: Some(bound),
            stored: bound,
        }
    }

    /// Whether keys `growth` bytes longer than any now stay within the
    /// key limit, without a walk.
    pub(super) fn admits_growth(&self, growth: usize) -> bool {
        self.known
            .is_some_and(|b| b.saturating_add(growth) <= ENTRY_KEY_MAX)
    }

    /// Whether the bound is high enough that it should be found again.
    pub(super) fn worth_finding_again(&self) -> bool {
        self.known.is_none_or(|b| b >= KEY_BOUND_RESET)
    }

    /// The bound once `batch` is written, if the record must change: the
    /// longest key it writes, and every key its range renames move grown
    /// by what they lengthen keys by.
    pub(super) fn after(&self, batch: &WriteBatch) -> Option<usize> {
        let known = self.known?;
        let growth = batch.key_growth(KeySpace::Meta);
        let needed = batch
            .longest_key_written(KeySpace::Meta)
            .max(if growth > 0 {
                known.saturating_add(growth)
            } else {
                0
            });
        let next = if needed > known {
            rounded(needed)
        } else {
            known
        };
        (next != self.stored).then_some(next)
    }
}

/// `longest` rounded up to a bound as stored.
pub(crate) fn rounded(longest: usize) -> usize {
    longest
        .max(KEY_BOUND_MIN)
        .div_ceil(KEY_BOUND_STEP)
        .saturating_mul(KEY_BOUND_STEP)
}

/// Sets the key bound record to `bound` in `batch`.
pub(crate) fn put_key_bound(batch: &mut WriteBatch, bound: usize) {
    batch.put(
        KeySpace::Meta,
        schema::KEY_BOUND_KEY,
        &KeyBound(bound).encode(),
    );
}

/// `batch` with the key bound record set to `bound`.
pub(super) fn with_bound(batch: &WriteBatch, bound: usize) -> WriteBatch {
    let mut raised = batch.clone();
    put_key_bound(&mut raised, bound);
    raised
}

impl FileSystem {
    /// The longest metadata key in [lo, hi): a visit, which copies no
    /// pair (rename's key limit below a directory; every key, for an
    /// older image's upgrade and a bound found again).
    pub(super) fn longest_key_in(&self, lo: &[u8], hi: &[u8]) -> FsResult<usize> {
        let mut longest = 0;
        self.store
            .visit_range(KeySpace::Meta, lo, hi, &mut |k, _| {
                longest = longest.max(k.len());
            })?;
        Ok(longest)
    }

    /// The longest metadata key of all.
    pub(super) fn longest_meta_key(&self) -> FsResult<usize> {
        self.longest_key_in(b"", &[0xff])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(known: usize) -> Bound {
        Bound::stored_as(known)
    }

    #[test]
    fn a_batch_raises_the_bound_past_what_it_writes() {
        let mut b = WriteBatch::new();
        b.put(KeySpace::Meta, &[b'k'; 200], b"v");
        assert_eq!(bound(256).after(&b), None, "within the bound");
        b.put(KeySpace::Data, &[b'k'; 5000], b"v");
        assert_eq!(bound(256).after(&b), None, "data keys do not count");
        b.put(KeySpace::Meta, &[b'k'; 300], b"v");
        assert_eq!(bound(256).after(&b), Some(320), "rounded up");
        let mut r = WriteBatch::new();
        r.range_rename(KeySpace::Meta, b"a\0", b"a\x02", 1, b"abc");
        assert_eq!(bound(256).after(&r), Some(320), "256 + 2, rounded");
        r.range_rename(KeySpace::Meta, b"b\0", b"b\x02", 1, &[b'b'; 100]);
        assert_eq!(bound(256).after(&r), Some(384), "both lengthenings");
        let mut shorter = WriteBatch::new();
        shorter.range_rename(KeySpace::Meta, b"abc\0", b"abc\x02", 3, b"a");
        assert_eq!(bound(256).after(&shorter), None);
        // A bound found lower than the record's is written with the next
        // batch, whatever it holds.
        let found = Bound {
            known: Some(256),
            stored: 4096,
        };
        assert_eq!(found.after(&WriteBatch::new()), Some(256));
        let unknown = Bound {
            known: None,
            stored: 0,
        };
        assert_eq!(unknown.after(&b), None);
        assert!(!unknown.admits_growth(0));
    }

    #[test]
    fn growth_is_admitted_up_to_the_key_limit() {
        let b = bound(rounded(ENTRY_KEY_MAX - 100));
        assert!(b.admits_growth(0));
        assert!(!b.admits_growth(200));
        assert!(b.worth_finding_again());
        assert!(!bound(KEY_BOUND_MIN).worth_finding_again());
        assert_eq!(rounded(0), KEY_BOUND_MIN);
        assert_eq!(rounded(257), 320);
    }
}
