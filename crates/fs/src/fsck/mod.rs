//! The offline checker: every key of both key spaces must be one the
//! schema can produce, and the records must agree with each other.
//!
//! [`check`] scans a store (usually opened read-only: it writes nothing)
//! and returns a [`Report`] of [`Problem`]s; each problem carries the
//! [`Fix`] that repairs it, or none when no repair can be trusted (a
//! damaged record, a broken tree). [`repair`] applies the fixes to a store
//! opened read-write; fixes can expose the next layer (a recreated
//! directory changes its parent's link count), so a caller repeats
//! check-and-repair until nothing fixable is left. Tree-level checks
//! (checksums, order, bounds) are the engine's [`Store::verify`].
//!
//! [`Store::verify`]: betreefs_engine::Store::verify

mod repair;
mod scan;

pub use repair::repair;
pub use scan::check;

use betreefs_engine::KeySpace;

/// What fsck found.
#[derive(Debug, Default)]
pub struct Report {
    pub entries: u64,
    pub directories: u64,
    pub data_keys: u64,
    pub xattrs: u64,
    /// The first [`PROBLEMS_SHOWN`] problems, with their details.
    pub problems: Vec<Problem>,
    /// How many more there were (their fixes are kept in `more_fixes`).
    pub problems_not_shown: u64,
    pub more_fixes: Vec<Fix>,
}

/// At most this many problems are kept with their details.
pub const PROBLEMS_SHOWN: usize = 1000;

/// One inconsistency.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub what: String,
    /// How to repair it; `None` when it cannot be repaired safely.
    pub fix: Option<Fix>,
}

/// A repair, applied by [`repair`] to a store opened read-write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fix {
    /// Remove a key nothing can own (a stray block, a dangling link, an
    /// orphan marker without its inode, a key the schema cannot produce).
    DeleteKey(KeySpace, Vec<u8>),
    /// Rewrite the record at `key` with this link count.
    SetLinkCount { key: Vec<u8>, nlink: u32 },
    /// Rewrite the inode count.
    SetInodeCount(u64),
    /// Rewrite the count of reserved blocks.
    SetReservedCount(u64),
    /// Recreate a missing directory record (its entries are kept): mode
    /// 0700, owned by root, a fresh inode number.
    RecreateDirectory { key: Vec<u8> },
    /// Recreate the missing identity record, reserving inode numbers above
    /// every one in use.
    RecreateIdentity { highest_ino: u64 },
    /// Remove an inode that no name and no orphan marker refers to.
    PurgeInode(u64),
    /// Write the key bound record with this bound (no metadata key is
    /// longer).
    SetKeyBound(usize),
    /// Write the back pointer of an inode named by a path.
    SetBackPointer {
        ino: u64,
        parent: u64,
        name: Vec<u8>,
    },
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }

    /// Every problem found, shown or not.
    pub fn problem_count(&self) -> u64 {
        self.problems.len() as u64 + self.problems_not_shown
    }

    /// Every fix the problems call for.
    pub fn fixes(&self) -> impl Iterator<Item = &Fix> {
        self.problems
            .iter()
            .filter_map(|p| p.fix.as_ref())
            .chain(&self.more_fixes)
    }

    /// Problems a repair can fix.
    pub fn fixable(&self) -> usize {
        self.fixes().count()
    }

    fn problem(&mut self, what: String, fix: Option<Fix>) {
        if self.problems.len() < PROBLEMS_SHOWN {
            self.problems.push(Problem { what, fix });
        } else {
            self.problems_not_shown += 1;
            self.more_fixes.extend(fix);
        }
    }
}
