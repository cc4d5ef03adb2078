//! In-memory tree nodes.
//!
//! Keys are held whole in memory; on disk a node stores only what follows
//! its lifted prefix (see [`crate::format`]). A leaf may be partly loaded:
//! its basement table is always present, each basement's entries only once
//! read. An interior node may be partly loaded too, for queries: its
//! pivots, children and range deletes always, the point messages of its
//! buffers a segment at a time ([`PartialPoints`]).

use betreefs_store::BLOCK_SIZE;
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::buffer::{Base, BufferPart, MessageBuffer, PartCut, PointMsg};
use crate::chunks::{ChunkDirLoc, ReadBelow};
use crate::entries::{Entries, ENTRY_OVERHEAD_BYTES};
use crate::merge::MergeRegistry;
use crate::message::with_prefix_replaced;

/// Rough heap overhead per buffered message (map node, allocation
/// headers), so the cache budget tracks real memory.
const MESSAGE_MEM_OVERHEAD: usize = 112;

/// The key range a node covers: [lo, hi), `hi == None` meaning unbounded.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Bounds {
    pub lo: Vec<u8>,
    pub hi: Option<Vec<u8>>,
}

impl Bounds {
    pub fn full() -> Bounds {
        Bounds::default()
    }

    /// The prefix every key in [lo, hi) shares: the longest common prefix
    /// of the bounds (empty when unbounded). Key lifting strips it.
    pub fn lifted_prefix(&self) -> Vec<u8> {
        match &self.hi {
            None => Vec::new(),
            Some(hi) => {
                let n = self
                    .lo
                    .iter()
                    .zip(hi.iter())
                    .take_while(|(a, b)| a == b)
                    .count();
                self.lo.get(..n).unwrap_or_default().to_vec()
            }
        }
    }

    /// What a node's header records of its bounds: the length of the low
    /// bound after the lifted prefix, and a crc32c of both bounds after it
    /// (`lo suffix ‖ u8 has_hi ‖ hi suffix`). Moving a subtree to a new
    /// prefix (a range rename) changes only what the lifted prefixes of its
    /// nodes begin with, never what follows them, so a moved node still
    /// matches; a node read under a parent that gives it other bounds does
    /// not.
    pub fn relative_check(&self) -> (u32, u32) {
        let lifted = self.lifted_prefix().len();
        let lo = self.lo.get(lifted..).unwrap_or_default();
        let hi = self
            .hi
            .as_deref()
            .and_then(|h| h.get(lifted..))
            .unwrap_or_default();
        let flag = [u8::from(self.hi.is_some())];
        (lo.len() as u32, betreefs_store::crc32c_of(&[lo, &flag, hi]))
    }

    /// Whether every key of these bounds lies in [start, end).
    pub fn within(&self, start: &[u8], end: &[u8]) -> bool {
        self.lo.as_slice() >= start && self.hi.as_deref().is_some_and(|hi| hi <= end)
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        key >= self.lo.as_slice() && self.hi.as_deref().is_none_or(|hi| key < hi)
    }
}

/// The nearer of two exclusive ends, `None` meaning unbounded.
pub fn min_end<'a>(a: Option<&'a [u8]>, b: Option<&'a [u8]>) -> Option<&'a [u8]> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// Where a basement (leaves) or a segment of a buffer's point messages
/// (interior nodes) lies inside the node's current extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BasementLoc {
    pub offset: u32,
    pub len: u32,
    pub crc: u32,
}

#[derive(Clone, Debug, Default)]
pub struct Basement {
    /// Sorted entries, or `None` while only on disk. Shared: a copy of
    /// the leaf for the checkpoint in flight costs a pointer per basement
    /// and is encoded without the tree lock; a basement that changes is
    /// replaced (merged into a new one), not changed in place.
    pub entries: Option<Arc<Entries>>,
    /// Location in the node's on-disk image (valid while the node is clean).
    pub loc: Option<BasementLoc>,
    /// Where its chunk directory lies in that image, if it has one: it can
    /// be read below (`chunks.rs`).
    pub dir: Option<ChunkDirLoc>,
    /// While `entries` is `None`: the directory and the chunks read below
    /// it, for queries of the keys they hold.
    pub below: Option<Arc<ReadBelow>>,
    /// Serialised size of the entries.
    pub bytes: usize,
    pub count: usize,
}

impl Basement {
    /// This basement's place and size, without its entries (but with
    /// what is read below it).
    fn clone_place(&self) -> Basement {
        Basement {
            entries: None,
            loc: self.loc,
            dir: self.dir,
            below: self.below.clone(),
            bytes: self.bytes,
            count: self.count,
        }
    }

    /// Takes the basement's entries, read whole: what was read below it
    /// is not needed any more.
    pub fn set_entries(&mut self, entries: Arc<Entries>) {
        self.entries = Some(entries);
        self.below = None;
    }

    /// The runs of entries (the whole basement's, or the chunks read
    /// below it) that hold every key of [lo, hi) in this basement, in key
    /// order; `None` if some are still on the device.
    pub fn runs_for(&self, lo: &[u8], hi: Option<&[u8]>) -> Option<Runs<'_>> {
        match (&self.entries, &self.below) {
            (Some(entries), _) => Some(Runs::Whole(Some(entries))),
            (None, Some(below)) => Some(Runs::Chunks(below, below.span_read(lo, hi)?)),
            (None, None) => None,
        }
    }

    /// Whether what holds `key` is loaded (no search of it).
    pub fn holds_key(&self, key: &[u8]) -> bool {
        self.entries.is_some() || self.below.as_ref().is_some_and(|b| b.holds_key(key))
    }

    /// Whether what holds every key of [lo, hi) is loaded.
    pub fn holds_range(&self, lo: &[u8], hi: Option<&[u8]>) -> bool {
        self.entries.is_some()
            || self
                .below
                .as_ref()
                .is_some_and(|b| b.span_read(lo, hi).is_some())
    }

    /// The value at `key` (`Some(None)` if absent), if what holds it is
    /// loaded.
    pub fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        match (&self.entries, &self.below) {
            (Some(entries), _) => Some(entries.get(key)),
            (None, Some(below)) => below.get(key),
            (None, None) => None,
        }
    }

    pub fn from_entries(entries: Entries) -> Basement {
        Basement::from_shared(Arc::new(entries))
    }

    pub fn from_shared(entries: Arc<Entries>) -> Basement {
        Basement {
            count: entries.len(),
            bytes: entries.bytes(),
            entries: Some(entries),
            loc: None,
            dir: None,
            below: None,
        }
    }
}

/// Walks sorted, disjoint range deletes alongside increasing keys.
struct RangeCursor<'a> {
    ranges: &'a [(&'a [u8], &'a [u8])],
    at: usize,
}

impl<'a> RangeCursor<'a> {
    /// The first range not ended at `key` (it may begin past it); keys
    /// must be asked in increasing order.
    fn first_not_ended(&mut self, key: &[u8]) -> Option<(&'a [u8], &'a [u8])> {
        while self.ranges.get(self.at).is_some_and(|r| r.1 <= key) {
            self.at += 1;
        }
        self.ranges.get(self.at).copied()
    }

    /// Whether `key` is deleted; keys must be asked in increasing order.
    fn covers(&mut self, key: &[u8]) -> bool {
        self.first_not_ended(key).is_some_and(|r| r.0 <= key)
    }

    /// Copies the entries [from, to) of `old` that no range covers to
    /// `out`, in runs: the entries between two deleted ranges, or between
    /// two messages, are one copy ([`Entries::extend_from`]), found by
    /// binary search — a merge of a few messages into a basement of
    /// thousands of entries copied and compared every one of them.
    fn copy_live(&mut self, out: &mut Entries, old: &Entries, mut from: usize, to: usize) {
        while from < to {
            let Some((start, end)) = self.first_not_ended(old.key(from)) else {
                out.extend_from(old, from, to);
                return;
            };
            let live_end = old.lower_bound_in(from, to, start);
            out.extend_from(old, from, live_end);
            from = old.lower_bound_in(live_end, to, end);
        }
    }
}

/// Merges one basement's entries with the messages that concern it, in one
/// pass. `Err(id)` names an unknown merge function.
fn merge_basement(
    old: &Entries,
    ranges: &[(&[u8], &[u8])],
    points: &[(&Vec<u8>, &PointMsg)],
    merges: &MergeRegistry,
) -> Result<Entries, u8> {
    let extra: usize = points.iter().map(|(k, m)| m.bytes(k.len())).sum();
    let mut out = Entries::with_capacity(old.len() + points.len(), old.bytes() + extra);
    let mut deleted = RangeCursor { ranges, at: 0 };
    let mut i = 0;
    for (key, msg) in points {
        let key = key.as_slice();
        let below = old.lower_bound_in(i, old.len(), key);
        deleted.copy_live(&mut out, old, i, below);
        i = below;
        let covered = deleted.covers(key);
        let base = if i < old.len() && old.key(i) == key {
            i += 1;
            (!covered).then(|| old.value(i - 1))
        } else {
            None
        };
        if let Some(value) = value_after(msg, base, merges)? {
            out.push(key, &value);
        }
    }
    deleted.copy_live(&mut out, old, i, old.len());
    Ok(out)
}

/// The value a key has after `msg` over `base` (None: deleted): a put's
/// own bytes, not a copy, when no upsert follows it.
pub(crate) fn value_after<'m>(
    msg: &'m PointMsg,
    base: Option<&[u8]>,
    merges: &MergeRegistry,
) -> Result<Option<std::borrow::Cow<'m, [u8]>>, u8> {
    Ok(match (&msg.base, msg.upserts.is_empty()) {
        (Some(Base::Put { value, .. }), true) => Some(std::borrow::Cow::Borrowed(&value[..])),
        (Some(Base::Delete { .. }), true) => None,
        _ => msg.apply(base, merges)?.map(std::borrow::Cow::Owned),
    })
}

/// What a merge makes of one basement: the pieces that replace it, in
/// key order (the first keeps the basement's lower pivot, each further
/// one begins at its first key).
pub type MergedBasement = (usize, Vec<Arc<Entries>>);

/// Merges one basement with the messages that concern it
/// ([`merge_basement`]), except when they all lie past its last key and
/// no range delete touches it (a file written in order, names made in
/// order): then a basement the new entries would take past `size` stays
/// as it is, shared, and they begin pieces of their own, of about `size`
/// each. Merged in, each step copied the whole basement to append to it,
/// and the basement grown past twice `size` was copied again to be cut
/// (`Leaf::rebalance_basements`): with the page faults of the fresh
/// copies, a quarter of the daemon's CPU writing a file sequentially.
fn merge_into_pieces(
    old: &Arc<Entries>,
    ranges: &[(&[u8], &[u8])],
    points: &[(&Vec<u8>, &PointMsg)],
    merges: &MergeRegistry,
    size: usize,
) -> Result<Vec<Arc<Entries>>, u8> {
    let appends = ranges.is_empty()
        && points
            .first()
            .is_some_and(|(k, _)| old.last_key().is_none_or(|last| k.as_slice() > last));
    let extra: usize = points.iter().map(|(k, m)| m.bytes(k.len())).sum();
    if !appends || old.bytes() + extra <= size {
        return Ok(vec![Arc::new(merge_basement(old, ranges, points, merges)?)]);
    }
    let mut pieces = PieceBuilder::new(size);
    let mut kept = Vec::new();
    if old.bytes() >= size / 2 {
        kept.push(old.clone());
    } else {
        pieces.extend_from(old);
    }
    for (key, msg) in points {
        if let Some(value) = value_after(msg, None, merges)? {
            pieces.push(key, &value);
        }
    }
    kept.extend(pieces.finish().into_iter().map(Arc::new));
    if kept.is_empty() {
        // Every message deleted a key the basement did not have.
        kept.push(Arc::new(Entries::default()));
    }
    Ok(kept)
}

/// Entries in key order cut into pieces of at most about `size` bytes as
/// they come (one copy each).
struct PieceBuilder {
    size: usize,
    pieces: Vec<Entries>,
    current: Entries,
}

impl PieceBuilder {
    fn new(size: usize) -> PieceBuilder {
        PieceBuilder {
            size,
            pieces: Vec::new(),
            current: Entries::with_capacity(0, size),
        }
    }

    fn push(&mut self, key: &[u8], value: &[u8]) {
        let bytes = key.len() + value.len() + ENTRY_OVERHEAD_BYTES;
        if !self.current.is_empty() && self.current.bytes() + bytes > self.size {
            let full = std::mem::replace(&mut self.current, Entries::with_capacity(0, self.size));
            self.pieces.push(full);
        }
        self.current.push(key, value);
    }

    fn extend_from(&mut self, entries: &Entries) {
        for (key, value) in entries.iter() {
            self.push(key, value);
        }
    }

    /// The pieces, none empty (none if nothing was pushed).
    fn finish(mut self) -> Vec<Entries> {
        if !self.current.is_empty() {
            self.pieces.push(self.current);
        }
        self.pieces
    }
}

/// The runs of entries a basement answers a range from
/// ([`Basement::runs_for`]): its own, or the chunks read below it.
pub enum Runs<'a> {
    Whole(Option<&'a Arc<Entries>>),
    Chunks(&'a ReadBelow, std::ops::RangeInclusive<usize>),
}

impl<'a> Iterator for Runs<'a> {
    type Item = &'a Entries;

    fn next(&mut self) -> Option<&'a Entries> {
        match self {
            Runs::Whole(entries) => entries.take().map(|e| &**e),
            Runs::Chunks(below, span) => span.next().and_then(|j| below.chunk(j)).map(|e| &**e),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Leaf {
    /// `pivots[i]` is the smallest key of basement `i + 1`.
    pub pivots: Vec<Vec<u8>>,
    pub basements: Vec<Basement>,
    /// Whether the last messages applied to this leaf that moved its last
    /// key took it further and reached only its last basement: it grows
    /// by appends (a file written sequentially). A hint kept in memory
    /// only (a leaf read from its image starts without it, and the next
    /// application sets it again): such a leaf splits with its first
    /// pieces full, not in halves, and its growing tail is not merged
    /// back as underfull (docs/design.md, "Leaves that grow at their
    /// end").
    pub grows_at_end: bool,
}

impl Default for Leaf {
    fn default() -> Self {
        Leaf {
            pivots: Vec::new(),
            basements: vec![Basement::from_entries(Entries::default())],
            grows_at_end: false,
        }
    }
}

impl Leaf {
    pub fn basement_for(&self, key: &[u8]) -> usize {
        self.pivots.partition_point(|p| p.as_slice() <= key)
    }

    /// The last basement holding keys below `end` (exclusive), but never
    /// before `first`: a range ending where a basement begins does not
    /// reach into it.
    pub fn last_basement_before(&self, end: &[u8], first: usize) -> usize {
        self.pivots
            .partition_point(|p| p.as_slice() < end)
            .max(first)
    }

    pub fn is_fully_loaded(&self) -> bool {
        self.basements.iter().all(|b| b.entries.is_some())
    }

    pub fn bytes(&self) -> usize {
        self.basements.iter().map(|b| b.bytes).sum()
    }

    pub fn entry_count(&self) -> usize {
        self.basements.iter().map(|b| b.count).sum()
    }

    pub fn mem_bytes(&self) -> usize {
        self.basements
            .iter()
            .filter_map(|b| b.entries.as_deref())
            .map(Entries::mem_bytes)
            .sum::<usize>()
            + self
                .basements
                .iter()
                .filter_map(|b| b.below.as_deref())
                .map(ReadBelow::mem_bytes)
                .sum::<usize>()
            + self.basements.len() * 64
            + self.pivots.iter().map(|p| p.len() + 32).sum::<usize>()
            + 128
    }

    /// Looks a key up in a loaded basement (`None` if that basement is not loaded).
    // Reviewed exception (indexing): a leaf has one pivot fewer than
    // basements and an interior node as many buffers as children, checked
    // on every load (validate::check_leaf, check_interior) and kept by
    // split, merge and rebalance; indices come from basement_for,
    // child_index or a loop over those counts.
    #[allow(clippy::indexing_slicing)]
    pub fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        self.basements[self.basement_for(key)].get(key)
    }

    /// Applies a flushed buffer, rewriting only the basements it touches;
    /// returns how many it rewrote. Requires every basement loaded.
    /// `Err(id)` names an unknown merge function.
    pub fn apply_buffer(
        &mut self,
        buffer: MessageBuffer,
        merges: &MergeRegistry,
        basement_size: usize,
    ) -> Result<usize, u8> {
        let cut = PartCut::Whole;
        let merged = self.merged_basements(&buffer.part(&cut), merges, basement_size)?;
        Ok(self.install_basements(merged))
    }

    /// The basements that the messages of `part` rewrite, merged with
    /// them, by index; the leaf is left as it is ([`Leaf::install_basements`]
    /// puts them in place). Reads the leaf only: a writer's step works
    /// this out while queries read the leaf beside it. Requires every
    /// basement loaded. `Err(id)` names an unknown merge function.
    // Reviewed exception (indexing): a leaf has one pivot fewer than
    // basements, checked on every load (validate::check_leaf) and kept by
    // split, merge and rebalance; `bi` loops over the basements.
    #[allow(clippy::indexing_slicing)]
    pub fn merged_basements(
        &self,
        part: &BufferPart<'_>,
        merges: &MergeRegistry,
        basement_size: usize,
    ) -> Result<Vec<MergedBasement>, u8> {
        assert!(
            self.is_fully_loaded(),
            "messages applied to a partly loaded leaf"
        );
        let mut merged = Vec::new();
        for bi in 0..self.basements.len() {
            let lo = if bi == 0 {
                None
            } else {
                Some(self.pivots[bi - 1].as_slice())
            };
            let hi = min_end(self.pivots.get(bi).map(|p| p.as_slice()), part.below);
            let lower = lo.map_or(Bound::Unbounded, Bound::Included);
            let upper = hi.map_or(Bound::Unbounded, Bound::Excluded);
            let pts: Vec<(&Vec<u8>, &PointMsg)> = part.points.range((lower, upper)).collect();
            let rs: Vec<(&[u8], &[u8])> = part
                .ranges
                .iter()
                .filter(|(s, e)| lo.is_none_or(|lo| *e > lo) && hi.is_none_or(|hi| *s < hi))
                .copied()
                .collect();
            if pts.is_empty() && rs.is_empty() {
                continue;
            }
            let Some(old) = self.basements[bi].entries.as_ref() else {
                unreachable!("checked fully loaded")
            };
            merged.push((
                bi,
                merge_into_pieces(old, &rs, &pts, merges, basement_size)?,
            ));
        }
        Ok(merged)
    }

    /// Puts basements merged by [`Leaf::merged_basements`] from this leaf
    /// as it is in place; returns how many it rewrote.
    pub fn install_basements(&mut self, merged: Vec<MergedBasement>) -> usize {
        let count = merged.len();
        // Appends reach only the last basement and end past its last key.
        let last = self.basements.len().saturating_sub(1);
        let tail_before = (count > 0 && merged.iter().all(|(bi, _)| *bi == last))
            .then(|| self.last_key().map(<[u8]>::to_vec));
        // From the last: a basement cut in pieces moves those after it.
        for (bi, pieces) in merged.into_iter().rev() {
            let mut pieces = pieces.into_iter();
            match (self.basements.get_mut(bi), pieces.next()) {
                (Some(b), Some(first)) => *b = Basement::from_shared(first),
                _ => panic!(
                    "tree invariant: merged basement {bi} lies past the leaf's {} or has no piece",
                    self.basements.len()
                ),
            }
            for (at, piece) in (bi + 1..).zip(pieces) {
                let Some(first_key) = piece.first_key() else {
                    panic!("tree invariant: an empty piece past the first of basement {bi}");
                };
                self.pivots.insert(at - 1, first_key.to_vec());
                self.basements.insert(at, Basement::from_shared(piece));
            }
        }
        // After the pieces are in: the first piece of a basement may be
        // that basement as it was, read.
        if count > 0 {
            self.own_read_values();
            // Changes at the end that leave the last key where it was
            // (a file's last block written again) keep the mark as it is.
            self.grows_at_end = match (tail_before, self.last_key()) {
                (Some(None), Some(_)) => true,
                (Some(Some(before)), Some(now)) => match now.cmp(before.as_slice()) {
                    std::cmp::Ordering::Greater => true,
                    std::cmp::Ordering::Equal => self.grows_at_end,
                    std::cmp::Ordering::Less => false,
                },
                _ => false,
            };
        }
        count
    }

    /// Whether the leaf is small enough to be merged with a neighbour:
    /// under a quarter of a node, and not growing at its end — such a
    /// leaf fills up by itself (it is what is left of a split made with
    /// its first pieces full), and merged into the full leaf before it
    /// would only split off again, rewriting that leaf each time.
    pub fn is_underfull(&self, node_size: usize) -> bool {
        !self.grows_at_end && self.bytes() < node_size / 4
    }

    /// The leaf's largest key, None when it is empty. Requires its last
    /// non-empty basement loaded (as applying messages does).
    fn last_key(&self) -> Option<&[u8]> {
        let last = self.basements.iter().rev().find(|b| b.count > 0)?;
        last.entries.as_deref()?.last_key()
    }

    /// Makes every loaded basement own its values if they lie in the
    /// bytes the leaf was read into (`Entries::in_image`): before a change
    /// replaces or cuts one of them, which would leave the bytes it read
    /// held by the others but counted by none. A leaf read and then
    /// changed copies its values once, as every read did before.
    pub fn own_read_values(&mut self) {
        for b in &mut self.basements {
            if let Some(entries) = &mut b.entries {
                if entries.in_read_image() {
                    Arc::make_mut(entries).make_owned();
                }
            }
        }
    }

    /// Splits oversized basements, drops empty ones and joins neighbours
    /// that together fit in one basement (or one block, for basements
    /// smaller than that), leaving the rest.
    ///
    /// Joining keeps the basement count within twice the leaf's bytes over
    /// [`basement_join_bytes`], plus one (no two neighbours fit in one):
    /// each basement begins on a block of the node's image, so a leaf
    /// whose basements only shrank (deletes, splits between basements)
    /// grew an image of several times its bytes, and on a full device no
    /// free run could take it (docs/design.md, "A full device").
    // Reviewed exception (indexing): a leaf has one pivot fewer than
    // basements and an interior node as many buffers as children, checked
    // on every load (validate::check_leaf, check_interior) and kept by
    // split, merge and rebalance; indices come from basement_for,
    // child_index or a loop over those counts.
    #[allow(clippy::indexing_slicing)]
    pub fn rebalance_basements(&mut self, basement_size: usize) {
        debug_assert!(self.is_fully_loaded());
        let oversized = |b: &Basement| b.bytes > 2 * basement_size;
        let join_within = basement_join_bytes(basement_size);
        let joinable = self
            .basements
            .windows(2)
            .any(|pair| pair[0].bytes + pair[1].bytes <= join_within);
        let needs = joinable
            || self.basements.iter().any(oversized)
            || (self.basements.len() > 1 && self.basements.iter().any(|b| b.count == 0));
        if !needs {
            return;
        }
        let old_pivots = std::mem::take(&mut self.pivots);
        let old = std::mem::take(&mut self.basements);
        // The pieces in key order, each with the pivot it begins at (none
        // for the leaf's first, and for a split's later pieces, which
        // begin at their first key).
        let mut pieces: Vec<(Option<Vec<u8>>, Arc<Entries>)> = Vec::with_capacity(old.len());
        for (bi, b) in old.into_iter().enumerate() {
            if b.count == 0 {
                continue;
            }
            let Some(entries) = b.entries else {
                unreachable!("checked fully loaded")
            };
            let lower_pivot = if bi == 0 {
                None
            } else {
                Some(old_pivots[bi - 1].clone())
            };
            if b.bytes > 2 * basement_size {
                for (pi, piece) in chunk(&entries, basement_size).into_iter().enumerate() {
                    let pivot = if pi == 0 { lower_pivot.clone() } else { None };
                    pieces.push((pivot, Arc::new(piece)));
                }
            } else {
                pieces.push((lower_pivot, entries));
            }
        }
        // Neighbours joined while they fit in one basement. A piece that
        // stays alone is kept as it is (shared with the checkpoint's copy
        // of the leaf, if it has one).
        let mut group: Vec<(Option<Vec<u8>>, Arc<Entries>)> = Vec::new();
        let mut group_bytes = 0;
        for (pivot, entries) in pieces {
            if !group.is_empty() && group_bytes + entries.bytes() > join_within {
                self.push_joined(std::mem::take(&mut group));
                group_bytes = 0;
            }
            group_bytes += entries.bytes();
            group.push((pivot, entries));
        }
        if !group.is_empty() {
            self.push_joined(group);
        }
        if self.basements.is_empty() {
            *self = Leaf::default();
        }
        debug_assert!(self
            .basements
            .windows(2)
            .all(|pair| pair[0].bytes + pair[1].bytes > join_within));
    }

    /// Appends a basement of `pieces` joined (consecutive, in key order),
    /// beginning at the first one's pivot (or, with none, its first key).
    fn push_joined(&mut self, pieces: Vec<(Option<Vec<u8>>, Arc<Entries>)>) {
        let mut pieces = pieces.into_iter();
        let Some((pivot, first)) = pieces.next() else {
            return;
        };
        let rest: Vec<Arc<Entries>> = pieces.map(|(_, entries)| entries).collect();
        let entries = if rest.is_empty() {
            first
        } else {
            let all = || std::iter::once(&first).chain(&rest);
            let mut joined = Entries::with_capacity(
                all().map(|e| e.len()).sum(),
                all().map(|e| e.bytes()).sum(),
            );
            for part in all() {
                joined.extend_from(part, 0, part.len());
            }
            Arc::new(joined)
        };
        if !self.basements.is_empty() {
            self.pivots
                .push(pivot.unwrap_or_else(|| entries.key(0).to_vec()));
        }
        self.basements.push(Basement::from_shared(entries));
    }

    /// All entries in order (consumes the basements' contents).
    pub fn take_entries(&mut self) -> Entries {
        let mut all = Entries::with_capacity(self.entry_count(), self.bytes());
        for b in &mut self.basements {
            if let Some(e) = b.entries.take() {
                all.extend_from(&e, 0, e.len());
            }
        }
        all
    }

    /// Splits a fully loaded leaf at `key`: it keeps the keys below, the
    /// returned leaf takes the rest. Whole basements move as they are; only
    /// the one holding `key` is cut (a copy of one basement, not of the
    /// leaf: range renames and clones cut boundary leaves this way).
    // Reviewed exception (indexing): `b` comes from basement_for, below the
    // basement count; a leaf has one pivot fewer than basements.
    #[allow(clippy::indexing_slicing)]
    pub fn split_off(&mut self, key: &[u8]) -> Leaf {
        debug_assert!(self.is_fully_loaded());
        self.own_read_values();
        let b = self.basement_for(key);
        let mut right_basements = self.basements.split_off(b + 1);
        let mut right_pivots = self.pivots.split_off(b);
        let entries = self.basements[b].entries.take().unwrap_or_default();
        let cut = entries.lower_bound(key);
        let piece = |from: usize, to: usize| {
            let mut e = Entries::with_capacity(to - from, 0);
            e.extend_from(&entries, from, to);
            Basement::from_entries(e)
        };
        self.basements[b] = piece(0, cut);
        right_basements.insert(0, piece(cut, entries.len()));
        if self.basements.len() > 1 && self.basements[b].count == 0 {
            self.basements.pop();
            self.pivots.pop();
        }
        if right_basements.len() > 1 && right_basements[0].count == 0 {
            right_basements.remove(0);
            right_pivots.remove(0);
        }
        let mut right = Leaf {
            pivots: right_pivots,
            basements: right_basements,
            grows_at_end: false,
        };
        right.forget_locations();
        right
    }

    /// The leaf's pivots and its basements' places and counts, with no
    /// entries: what reading its missing basements needs.
    pub fn skeleton(&self) -> Leaf {
        Leaf {
            pivots: self.pivots.clone(),
            basements: self.basements.iter().map(Basement::clone_place).collect(),
            grows_at_end: false,
        }
    }

    /// Drops the basements' locations in the image the leaf was read
    /// from: a leaf split off, merged or copied is a new image, written
    /// whole (and its basements stay loaded until then).
    pub fn forget_locations(&mut self) {
        for basement in &mut self.basements {
            basement.loc = None;
            basement.dir = None;
            basement.below = None;
        }
    }

    /// Appends the basements of `right`, the leaf after this one whose
    /// keys all lie at or above `separator` (a merge of two neighbours:
    /// no entry is copied).
    pub fn append(&mut self, mut right: Leaf, separator: Vec<u8>) {
        debug_assert!(self.is_fully_loaded() && right.is_fully_loaded());
        right.forget_locations();
        if right.entry_count() == 0 {
            return;
        }
        if self.entry_count() == 0 {
            *self = right;
            return;
        }
        self.pivots.push(separator);
        self.pivots.append(&mut right.pivots);
        self.basements.append(&mut right.basements);
        // The merged leaf ends where `right` did, and grows there if it did.
        self.grows_at_end = right.grows_at_end;
    }

    /// A fully loaded leaf chunked into basements of about `basement_size`.
    pub fn from_sorted(entries: &Entries, basement_size: usize) -> Leaf {
        let pieces = chunk(entries, basement_size);
        let mut leaf = Leaf {
            pivots: Vec::new(),
            basements: Vec::with_capacity(pieces.len()),
            grows_at_end: false,
        };
        for piece in pieces {
            if !leaf.basements.is_empty() {
                leaf.pivots.push(piece.key(0).to_vec());
            }
            leaf.basements.push(Basement::from_entries(piece));
        }
        if leaf.basements.is_empty() {
            return Leaf::default();
        }
        leaf
    }
}

/// The bytes neighbouring basements are joined within
/// ([`Leaf::rebalance_basements`]): a basement's, or a block's if that is
/// more (each basement begins on a block of the image, so two smaller than
/// a block apart cost a block each).
pub fn basement_join_bytes(basement_size: usize) -> usize {
    basement_size.max(BLOCK_SIZE)
}

/// Cuts sorted entries into pieces of about `size` serialised bytes.
fn chunk(entries: &Entries, size: usize) -> Vec<Entries> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for i in 0..entries.len() {
        let eb = entries.entry_bytes(i);
        if bytes + eb > size && i > start {
            let mut piece = Entries::with_capacity(i - start, bytes);
            piece.extend_from(entries, start, i);
            pieces.push(piece);
            start = i;
            bytes = 0;
        }
        bytes += eb;
    }
    if start < entries.len() || pieces.is_empty() {
        let mut piece = Entries::with_capacity(entries.len() - start, bytes);
        piece.extend_from(entries, start, entries.len());
        pieces.push(piece);
    }
    pieces
}

/// The memory a message buffer holds, about: its messages' bytes and a
/// map entry's overhead apiece.
pub fn buffer_mem_bytes(buffer: &MessageBuffer) -> usize {
    buffer.bytes() + buffer.message_count() * MESSAGE_MEM_OVERHEAD
}

/// What [`Interior::insert_point_counted`] did.
#[derive(Clone, Copy, Debug)]
pub struct PointInserted {
    /// Messages the new one made obsolete.
    pub eaten: usize,
    /// The buffer was shared (with a checkpoint's copy of the node) and
    /// copied first.
    pub copied: bool,
    /// Change of the buffer's bytes ([`MessageBuffer::bytes`]), and so of
    /// the node's content.
    pub bytes: isize,
    /// Change of the buffer's memory ([`buffer_mem_bytes`]), and so of the
    /// node's.
    pub mem: isize,
}

/// `after - before` as a signed count (sizes in memory fit an `isize`).
fn signed_change(before: usize, after: usize) -> isize {
    after as isize - before as isize
}

#[derive(Clone, Debug)]
pub struct Interior {
    /// Distance from the leaves (children of a height-1 node are leaves).
    pub height: u32,
    /// `pivots[i]` is the smallest key of child `i + 1`.
    pub pivots: Vec<Vec<u8>>,
    pub children: Vec<u64>,
    /// Shared copy-on-write (`Arc::make_mut`): a snapshot of the node for
    /// the checkpoint in flight costs a pointer per buffer, and a change
    /// afterwards copies only the buffer it changes. In a node read in
    /// part (`partial`), only the range deletes.
    pub buffers: Vec<Arc<MessageBuffer>>,
    /// `Some` while the node is read in part, for queries: the point
    /// messages of its buffers are then in `partial`'s segments, each
    /// loaded when a query needs it. Such a node is clean and never
    /// changed; whatever changes a node reads it whole first
    /// (`Tree::load`).
    pub partial: Option<Box<PartialPoints>>,
}

/// The point messages of a partly loaded interior node's buffers, per
/// child, as they lie on disk: in segments of about
/// [`crate::format::SEGMENT_BYTES`] in key order, so that a cold point
/// query reads the node's meta and one segment per buffer on its way, not
/// the whole node (up to 4 MiB of messages).
#[derive(Clone, Debug, Default)]
pub struct PartialPoints {
    pub children: Vec<Segments>,
}

/// One child's segments: `pivots[j]` is the first key of segment `j + 1`.
#[derive(Clone, Debug, Default)]
pub struct Segments {
    pub pivots: Vec<Vec<u8>>,
    pub segments: Vec<Segment>,
}

#[derive(Clone, Debug)]
pub struct Segment {
    pub loc: BasementLoc,
    /// How many point messages it holds.
    pub count: usize,
    /// Its point messages (in a buffer of no range deletes), once read.
    pub points: Option<MessageBuffer>,
}

impl Segments {
    /// The segment that holds `key`'s message, if there is one.
    pub fn segment_for(&self, key: &[u8]) -> usize {
        self.pivots.partition_point(|p| p.as_slice() <= key)
    }

    /// The key range of segment `j` within a child's `bounds`.
    pub fn segment_bounds(&self, j: usize, child: &Bounds) -> Bounds {
        Bounds {
            lo: match j.checked_sub(1) {
                None => child.lo.clone(),
                Some(p) => self.pivots.get(p).cloned().unwrap_or_default(),
            },
            hi: self.pivots.get(j).cloned().or_else(|| child.hi.clone()),
        }
    }
}

impl PartialPoints {
    /// Every segment, as (child, segment) pairs in order.
    pub fn all_segments(&self) -> Vec<(usize, usize)> {
        self.children
            .iter()
            .enumerate()
            .flat_map(|(i, c)| (0..c.segments.len()).map(move |j| (i, j)))
            .collect()
    }

    /// How many segments are loaded.
    pub fn loaded_segments(&self) -> usize {
        self.children
            .iter()
            .flat_map(|c| &c.segments)
            .filter(|s| s.points.is_some())
            .count()
    }

    fn mem_bytes(&self) -> usize {
        self.children
            .iter()
            .flat_map(|c| {
                c.pivots.iter().map(|p| p.len() + 32).chain(
                    c.segments
                        .iter()
                        .map(|s| 64 + s.points.as_ref().map_or(0, buffer_mem_bytes)),
                )
            })
            .sum()
    }
}

impl Interior {
    pub fn is_partial(&self) -> bool {
        self.partial.is_some()
    }

    /// The point message for `key` pending in buffer `i`: `None` when the
    /// node is read in part and the segment that would hold it is not
    /// loaded yet, `Some(None)` when there is none.
    pub fn point(&self, i: usize, key: &[u8]) -> Option<Option<&PointMsg>> {
        let Some(partial) = &self.partial else {
            return Some(self.buffers.get(i)?.points().get(key));
        };
        let segments = partial.children.get(i)?;
        match segments.segments.get(segments.segment_for(key)) {
            // A buffer without point messages has no segment.
            None => Some(None),
            Some(segment) => Some(segment.points.as_ref()?.points().get(key)),
        }
    }

    /// Whether a point query for `key` finds what it needs of this node
    /// loaded.
    pub fn has_point_loaded(&self, key: &[u8]) -> bool {
        self.point(self.child_index(key), key).is_some()
    }

    /// The child a range visit from `lo` steps to, and the segments of
    /// its buffer holding point messages for [lo, hi) (`hi` already within
    /// the node's bounds; cut here to the child's): none when the node is
    /// whole or the buffer has no point messages.
    pub fn segment_span(&self, lo: &[u8], hi: Option<&[u8]>) -> (usize, std::ops::Range<usize>) {
        let i = self.child_index(lo);
        let Some(segments) = self.partial.as_ref().and_then(|p| p.children.get(i)) else {
            return (i, 0..0);
        };
        if segments.segments.is_empty() {
            return (i, 0..0);
        }
        let first = segments.segment_for(lo);
        // Segment j > 0 begins at pivots[j - 1]: those beginning before
        // the end (and the child's) concern the range.
        let end = min_end(hi, self.pivots.get(i).map(|p| p.as_slice()));
        let last = end.map_or(segments.segments.len() - 1, |e| {
            segments.pivots.partition_point(|p| p.as_slice() < e)
        });
        (i, first..last.max(first) + 1)
    }

    /// Whether a range visit of [lo, hi) finds what it needs of this
    /// node loaded.
    pub fn has_range_loaded(&self, lo: &[u8], hi: Option<&[u8]>) -> bool {
        let (i, span) = self.segment_span(lo, hi);
        let Some(segments) = self.partial.as_ref().and_then(|p| p.children.get(i)) else {
            return true;
        };
        segments
            .segments
            .get(span)
            .is_some_and(|s| s.iter().all(|s| s.points.is_some()))
    }

    /// The loaded point messages of child `i`'s segments in `span`.
    pub fn segment_points(
        &self,
        i: usize,
        span: std::ops::Range<usize>,
    ) -> impl Iterator<Item = &MessageBuffer> {
        self.partial
            .as_ref()
            .and_then(|p| p.children.get(i))
            .and_then(|c| c.segments.get(span))
            .unwrap_or_default()
            .iter()
            .filter_map(|s| s.points.as_ref())
    }

    /// Puts the point messages of each child's segments (all loaded) into
    /// its buffer: the node is whole.
    pub fn make_whole(&mut self) -> Result<(), String> {
        let Some(partial) = &self.partial else {
            return Ok(());
        };
        if partial.children.len() != self.buffers.len() {
            return Err("segment directory and buffer counts disagree".into());
        }
        if partial
            .children
            .iter()
            .flat_map(|c| &c.segments)
            .any(|s| s.points.is_none())
        {
            return Err("a segment was not loaded".into());
        }
        let Some(partial) = self.partial.take() else {
            return Ok(());
        };
        for (buffer, child) in self.buffers.iter_mut().zip(partial.children) {
            for points in child.segments.into_iter().filter_map(|s| s.points) {
                Arc::make_mut(buffer).absorb_disjoint(points);
            }
        }
        Ok(())
    }

    pub fn child_index(&self, key: &[u8]) -> usize {
        self.pivots.partition_point(|p| p.as_slice() <= key)
    }

    // Reviewed exception (indexing): a leaf has one pivot fewer than
    // basements and an interior node as many buffers as children, checked
    // on every load (validate::check_leaf, check_interior) and kept by
    // split, merge and rebalance; indices come from basement_for,
    // child_index or a loop over those counts.
    #[allow(clippy::indexing_slicing)]
    pub fn child_bounds(&self, i: usize, own: &Bounds) -> Bounds {
        Bounds {
            lo: if i == 0 {
                own.lo.clone()
            } else {
                self.pivots[i - 1].clone()
            },
            hi: if i == self.pivots.len() {
                own.hi.clone()
            } else {
                Some(self.pivots[i].clone())
            },
        }
    }

    pub fn buffer_bytes(&self) -> usize {
        self.buffers.iter().map(|b| b.bytes()).sum()
    }

    pub fn mem_bytes(&self) -> usize {
        self.buffers
            .iter()
            .map(|b| buffer_mem_bytes(b))
            .sum::<usize>()
            + self.pivots.iter().map(|p| p.len() + 32).sum::<usize>()
            + self.children.len() * 16
            + self.partial.as_ref().map_or(0, |p| p.mem_bytes())
            + 128
    }

    /// Puts a message into the buffer(s) of the child(ren) it concerns,
    /// clamping range deletes to each child's range. Returns messages eaten.
    // Reviewed exception (indexing): a leaf has one pivot fewer than
    // basements and an interior node as many buffers as children, checked
    // on every load (validate::check_leaf, check_interior) and kept by
    // split, merge and rebalance; indices come from basement_for,
    // child_index or a loop over those counts.
    #[allow(clippy::indexing_slicing)]
    pub fn insert_range_delete(
        &mut self,
        start: &[u8],
        end: &[u8],
        seq: u64,
        own: &Bounds,
    ) -> usize {
        if start >= end {
            return 0;
        }
        let first = self.child_index(start);
        let mut eaten = 0;
        for i in first..self.children.len() {
            let b = self.child_bounds(i, own);
            if b.lo.as_slice() >= end {
                break;
            }
            let s = start.max(b.lo.as_slice()).to_vec();
            let e = match &b.hi {
                Some(hi) => end.min(hi.as_slice()).to_vec(),
                None => end.to_vec(),
            };
            eaten += Arc::make_mut(&mut self.buffers[i]).insert_range_delete(s, e, seq);
        }
        eaten
    }

    /// Returns how many older messages the new one ate, and whether the
    /// buffer it went to was shared (with the checkpoint in flight's copy
    /// of this node), so copied first.
    pub fn insert_point(
        &mut self,
        key: Vec<u8>,
        msg: PointMsg,
        merges: &MergeRegistry,
    ) -> (usize, bool) {
        let inserted = self.insert_point_counted(key, msg, merges);
        (inserted.eaten, inserted.copied)
    }

    /// [`Interior::insert_point`], telling also how the one buffer it
    /// changed grew: the node's content and memory change by as much, so
    /// a caller changing a node where it lies in the cache can count it
    /// without summing over every buffer.
    // Reviewed exception (indexing), as for insert_range_delete: as many
    // buffers as children, and child_index names one of them.
    #[allow(clippy::indexing_slicing)]
    pub fn insert_point_counted(
        &mut self,
        key: Vec<u8>,
        msg: PointMsg,
        merges: &MergeRegistry,
    ) -> PointInserted {
        let i = self.child_index(&key);
        let buffer = &mut self.buffers[i];
        let copied = Arc::strong_count(buffer) > 1;
        let (bytes, mem) = (buffer.bytes(), buffer_mem_bytes(buffer));
        let buffer = Arc::make_mut(buffer);
        let eaten = buffer.insert_point(key, msg, merges);
        PointInserted {
            eaten,
            copied,
            bytes: signed_change(bytes, buffer.bytes()),
            mem: signed_change(mem, buffer_mem_bytes(buffer)),
        }
    }

    /// Distributes a batch flushed from the parent into our children's
    /// buffers. Returns messages eaten.
    pub fn absorb_batch(
        &mut self,
        batch: MessageBuffer,
        own: &Bounds,
        merges: &MergeRegistry,
    ) -> usize {
        let (ranges, points) = batch.into_parts();
        let mut eaten = 0;
        for (start, r) in ranges {
            eaten += self.insert_range_delete(&start, &r.end, r.seq, own);
        }
        for (key, msg) in points {
            eaten += self.insert_point(key, msg, merges).0;
        }
        eaten
    }
}

#[derive(Clone, Debug)]
pub enum NodeBody {
    Leaf(Leaf),
    Interior(Interior),
}

/// A cached node.
#[derive(Clone, Debug)]
pub struct Node {
    pub body: NodeBody,
    /// The key range the parent's pivots give this node: every key here
    /// lies inside it, and its lifted prefix is what the node's image omits.
    /// A load checks that a cached node is reached under the same bounds.
    pub bounds: Bounds,
    /// The key space (tree) the node belongs to.
    pub tree: u8,
    pub dirty: bool,
    pub last_used: LastUse,
}

/// When a cached node was last used, on the tree's clock of uses: the
/// node cache evicts the least recently used first. Atomic because queries
/// stamp it holding the tree lock only shared (the store's read path).
#[derive(Debug, Default)]
pub struct LastUse(AtomicU64);

impl LastUse {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    pub fn set(&self, tick: u64) {
        self.0.store(tick, Ordering::Relaxed);
    }
}

impl Clone for LastUse {
    fn clone(&self) -> Self {
        LastUse(AtomicU64::new(self.get()))
    }
}

impl Node {
    /// Re-keys a cached node for the place `to` it is reached at now:
    /// after a range rename moved its subtree, or through another parent
    /// of a shared subtree (a range clone). The caller has checked that
    /// `to` agrees with the node's bounds after the lifted prefixes
    /// ([`Bounds::relative_check`]), so only what every key begins with
    /// changes — exactly what the node's image omits, which is why it can
    /// stay clean (docs/design.md, "Range rename by surgery": lazy
    /// re-keying). Basements still on disk are decoded under `to` later.
    pub fn move_to(&mut self, to: Bounds) {
        let old = self.bounds.lifted_prefix();
        let new = to.lifted_prefix();
        self.bounds = to;
        if old == new {
            return;
        }
        let rekey = |k: Vec<u8>| with_prefix_replaced(k, old.len(), &new);
        match &mut self.body {
            NodeBody::Leaf(leaf) => {
                for pivot in &mut leaf.pivots {
                    *pivot = rekey(std::mem::take(pivot));
                }
                for basement in &mut leaf.basements {
                    // Read again under the new prefix when needed.
                    basement.below = None;
                    if let Some(entries) = &mut basement.entries {
                        let entries = Arc::make_mut(entries);
                        entries.replace_prefix(old.len(), &new);
                        basement.bytes = entries.bytes();
                    }
                }
            }
            NodeBody::Interior(int) => {
                for pivot in &mut int.pivots {
                    *pivot = rekey(std::mem::take(pivot));
                }
                for buffer in &mut int.buffers {
                    *buffer = Arc::new(Arc::make_mut(buffer).take().rekeyed(rekey));
                }
            }
        }
    }

    /// Whether the node is an interior node read in part.
    pub fn is_partial(&self) -> bool {
        matches!(&self.body, NodeBody::Interior(int) if int.is_partial())
    }

    pub fn height(&self) -> u32 {
        match &self.body {
            NodeBody::Leaf(_) => 0,
            NodeBody::Interior(i) => i.height,
        }
    }

    pub fn mem_bytes(&self) -> usize {
        match &self.body {
            NodeBody::Leaf(l) => l.mem_bytes(),
            NodeBody::Interior(i) => i.mem_bytes(),
        }
    }

    /// Bytes this node's contents amount to (what the node-size limit measures).
    pub fn content_bytes(&self) -> usize {
        match &self.body {
            NodeBody::Leaf(l) => l.bytes(),
            NodeBody::Interior(i) => {
                i.buffer_bytes() + i.pivots.iter().map(|p| p.len() + 12).sum::<usize>()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::PartLimit;

    use proptest::collection::{btree_map, btree_set, vec};
    use proptest::prelude::*;

    /// Keys over a small alphabet, so that messages, ranges and entries
    /// meet.
    fn small_key() -> impl Strategy<Value = Vec<u8>> {
        vec(0u8..4, 1..4)
    }

    /// The entries of a map, in its (key) order.
    fn entries_of(map: &std::collections::BTreeMap<Vec<u8>, Vec<u8>>) -> Entries {
        let mut entries = Entries::default();
        for (k, v) in map {
            entries.push(k, v);
        }
        entries
    }

    fn small_value() -> impl Strategy<Value = Vec<u8>> {
        vec(any::<u8>(), 0..6)
    }

    proptest! {
        /// A basement merged with range deletes and point messages holds
        /// what a map does after the same deletes and writes (runs of
        /// untouched entries are copied whole: their bytes and slots must
        /// land right between the messages and around the ranges).
        #[test]
        fn a_merged_basement_is_the_map_after_its_messages(
            old in btree_map(small_key(), small_value(), 0..40),
            cuts in btree_set(small_key(), 0..8),
            points in btree_map(small_key(), proptest::option::of(small_value()), 0..12),
        ) {
            let entries = entries_of(&old);
            // Disjoint ranges: every other pair of consecutive cuts.
            let cuts: Vec<Vec<u8>> = cuts.into_iter().collect();
            let ranges: Vec<(&[u8], &[u8])> = cuts
                .chunks_exact(2)
                .map(|pair| (pair[0].as_slice(), pair[1].as_slice()))
                .collect();
            let message = |v: &Option<Vec<u8>>| PointMsg {
                base: Some(match v {
                    Some(v) => Base::Put { seq: 1, value: bytes::Bytes::from(v.clone()) },
                    None => Base::Delete { seq: 1 },
                }),
                upserts: Vec::new(),
            };
            let msgs: Vec<(Vec<u8>, PointMsg)> =
                points.iter().map(|(k, v)| (k.clone(), message(v))).collect();
            let refs: Vec<(&Vec<u8>, &PointMsg)> = msgs.iter().map(|(k, m)| (k, m)).collect();
            let merged =
                merge_basement(&entries, &ranges, &refs, &MergeRegistry::default()).unwrap();
            let mut model = old.clone();
            model.retain(|k, _| !ranges.iter().any(|(s, e)| *s <= k.as_slice() && k.as_slice() < *e));
            for (k, v) in points {
                match v {
                    Some(v) => model.insert(k, v),
                    None => model.remove(&k),
                };
            }
            let got: Vec<(Vec<u8>, Vec<u8>)> =
                merged.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
            prop_assert_eq!(got, model.into_iter().collect::<Vec<_>>());
            let counted: usize = merged
                .iter()
                .map(|(k, v)| k.len() + v.len() + crate::entries::ENTRY_OVERHEAD_BYTES)
                .sum();
            prop_assert_eq!(merged.bytes(), counted);
        }
    }

    proptest! {
        /// What `insert_point_counted` says a buffer grew by is what the
        /// node's memory and content grew by: a root changed where it lies
        /// in the cache is counted from it alone (`Tree::apply_message`).
        /// Small keys, so messages meet and eat each other; some buffers
        /// shared, as with a checkpoint's copy of the node.
        #[test]
        fn a_point_insert_counts_what_the_node_grew_by(
            messages in vec((vec(0u8..8, 1..3), 0u8..3, vec(any::<u8>(), 0..40), any::<bool>()), 1..60),
        ) {
            let merges = MergeRegistry::default();
            let mut int = Interior {
                height: 1,
                pivots: vec![vec![2], vec![5]],
                children: vec![1, 2, 3],
                buffers: vec![Default::default(), Default::default(), Default::default()],
                partial: None,
            };
            let content = |int: &Interior| Node {
                body: NodeBody::Interior(int.clone()),
                bounds: Bounds::full(),
                tree: 0,
                dirty: true,
                last_used: Default::default(),
            }
            .content_bytes();
            for (seq, (key, kind, value, share)) in messages.into_iter().enumerate() {
                let seq = seq as u64 + 1;
                // A copy holding every buffer while the message goes in.
                let held = share.then(|| int.clone());
                let msg = match kind {
                    0 => PointMsg::put(seq, value),
                    1 => PointMsg::delete(seq),
                    _ => PointMsg::upsert(seq, crate::merge::MERGE_PATCH, crate::merge::patch_arg(0, &value)),
                };
                let before = (int.mem_bytes(), content(&int));
                let inserted = int.insert_point_counted(key, msg, &merges);
                let after = (int.mem_bytes(), content(&int));
                prop_assert_eq!(after.0 as isize - before.0 as isize, inserted.mem);
                prop_assert_eq!(after.1 as isize - before.1 as isize, inserted.bytes);
                prop_assert_eq!(inserted.copied, share);
                drop(held);
            }
        }
    }

    proptest! {
        /// Messages past a basement's last key (appends) go in pieces of
        /// their own once the basement would outgrow its size; whatever the
        /// order of the writes, the leaf holds what a map does and its
        /// pivots bound its basements.
        #[test]
        fn appended_entries_begin_basements_of_their_own(
            writes in vec(vec((vec(0u8..8, 1..5), proptest::option::of(vec(any::<u8>(), 0..12))), 1..24), 1..8),
            basement_size in 16usize..96,
        ) {
            let merges = MergeRegistry::default();
            let mut leaf = Leaf::default();
            let mut model = std::collections::BTreeMap::new();
            let mut seq = 1;
            for step in writes {
                let mut buffer = MessageBuffer::default();
                for (k, v) in step {
                    seq += 1;
                    let msg = match &v {
                        Some(v) => PointMsg::put(seq, v.clone()),
                        None => PointMsg::delete(seq),
                    };
                    match v {
                        Some(v) => model.insert(k.clone(), v),
                        None => model.remove(&k),
                    };
                    buffer.insert_point(k, msg, &merges);
                }
                leaf.apply_buffer(buffer, &merges, basement_size).unwrap();
                leaf.rebalance_basements(basement_size);
                crate::validate::check_leaf(&leaf, &Bounds::full()).map_err(TestCaseError::fail)?;
                for (i, b) in leaf.basements.iter().enumerate() {
                    let range = crate::validate::basement_bounds(&leaf, i, &Bounds::full());
                    let entries = b.entries.as_deref().unwrap();
                    crate::validate::check_basement(entries, &range).map_err(TestCaseError::fail)?;
                    prop_assert!(i == 0 || !entries.is_empty(), "an empty basement past the first");
                }
                let pairs: Vec<(Vec<u8>, Vec<u8>)> = leaf
                    .basements
                    .iter()
                    .flat_map(|b| b.entries.as_deref().into_iter().flat_map(Entries::iter))
                    .map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .collect();
                prop_assert_eq!(pairs, model.clone().into_iter().collect::<Vec<_>>());
            }
        }
    }

    proptest! {
        /// A merge worked out from part of a buffer as it stands
        /// (`merged_basements` of `MessageBuffer::part`), put in place,
        /// leaves the leaf as applying the same part taken out does: a
        /// writer's step prepares the one and takes the other out.
        #[test]
        fn a_merge_prepared_from_a_part_is_the_part_applied(
            old in btree_map(small_key(), small_value(), 0..60),
            ranges in btree_set(small_key(), 0..6),
            points in btree_map(small_key(), proptest::option::of(small_value()), 1..20),
            part_points in 1usize..20,
            before in proptest::option::of(small_key()),
            basement_size in 16usize..64,
        ) {
            let merges = MergeRegistry::default();
            let entries = entries_of(&old);
            // Basements of a few entries each.
            let leaf = Leaf::from_sorted(&entries, 24);
            let mut buffer = MessageBuffer::default();
            let ranges: Vec<Vec<u8>> = ranges.into_iter().collect();
            for pair in ranges.chunks_exact(2) {
                buffer.insert_range_delete(pair[0].clone(), pair[1].clone(), 1);
            }
            for (seq, (k, v)) in (2..).zip(points) {
                let msg = match v {
                    Some(v) => PointMsg::put(seq, v),
                    None => PointMsg::delete(seq),
                };
                buffer.insert_point(k, msg, &merges);
            }
            let limit = PartLimit {
                bytes: usize::MAX,
                points: part_points,
                before: before.as_deref(),
            };
            let mut prepared = leaf.clone();
            let cut = buffer.part_cut(limit);
            let merged = leaf
                .merged_basements(&buffer.part(&cut), &merges, basement_size)
                .unwrap();
            prepared.install_basements(merged);
            let mut applied = leaf.clone();
            applied
                .apply_buffer(buffer.clone().take_first(limit), &merges, basement_size)
                .unwrap();
            let pairs = |leaf: &Leaf| -> Vec<(Vec<u8>, Vec<u8>)> {
                leaf.basements
                    .iter()
                    .flat_map(|b| b.entries.as_deref().into_iter().flat_map(Entries::iter))
                    .map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .collect()
            };
            prop_assert_eq!(pairs(&prepared), pairs(&applied));
        }
    }

    #[test]
    fn lifted_prefix_of_bounds() {
        let b = Bounds {
            lo: b"a\x01b\x00c".to_vec(),
            hi: Some(b"a\x01b\x00q".to_vec()),
        };
        assert_eq!(b.lifted_prefix(), b"a\x01b\x00");
        assert!(b.contains(b"a\x01b\x00d"));
        assert!(!b.contains(b"a\x01b\x00q"));
        assert!(Bounds::full().lifted_prefix().is_empty());
    }

    #[test]
    fn leaves_split_and_append_by_basements() {
        let mut e = Entries::default();
        for i in 0..1000u32 {
            e.push(format!("k{i:04}").as_bytes(), &[i as u8; 30]);
        }
        let whole = Leaf::from_sorted(&e, 2000);
        assert!(whole.basements.len() > 10);
        let keys = |l: &Leaf| -> Vec<Vec<u8>> {
            l.basements
                .iter()
                .flat_map(|b| b.entries.as_ref().unwrap().iter().map(|(k, _)| k.to_vec()))
                .collect()
        };
        let all = keys(&whole);
        // At a pivot, inside a basement, before everything, after everything.
        let at_pivot = whole.pivots[3].clone();
        for cut in [at_pivot, b"k0500x".to_vec(), b"a".to_vec(), b"z".to_vec()] {
            let mut left = whole.clone();
            let right = left.split_off(&cut);
            let (l, r) = (keys(&left), keys(&right));
            assert!(l.iter().all(|k| *k < cut) && r.iter().all(|k| *k >= cut));
            assert_eq!([l.clone(), r.clone()].concat(), all);
            for (leaf, lo, hi) in [(&left, &b""[..], Some(&cut)), (&right, &cut[..], None)] {
                let own = Bounds {
                    lo: lo.to_vec(),
                    hi: hi.cloned(),
                };
                assert!(
                    crate::validate::check_leaf(leaf, &own).is_ok(),
                    "cut {cut:?}"
                );
                for i in 0..leaf.basements.len() {
                    let range = crate::validate::basement_bounds(leaf, i, &own);
                    let entries = leaf.basements[i].entries.as_ref().unwrap();
                    assert!(crate::validate::check_basement(entries, &range).is_ok());
                }
                assert_eq!(leaf.pivots.len() + 1, leaf.basements.len());
            }
            let mut joined = left;
            joined.append(right, cut.clone());
            assert_eq!(keys(&joined), all);
            assert!(crate::validate::check_leaf(&joined, &Bounds::full()).is_ok());
        }
    }

    /// A buffer of puts of 100 bytes of `fill` under keys `keys` (big-endian).
    fn puts(
        keys: std::ops::Range<u32>,
        seq: u64,
        fill: u8,
        merges: &MergeRegistry,
    ) -> MessageBuffer {
        let mut buf = MessageBuffer::default();
        for i in keys {
            buf.insert_point(
                i.to_be_bytes().to_vec(),
                PointMsg::put(seq, vec![fill; 100]),
                merges,
            );
        }
        buf
    }

    #[test]
    fn leaf_apply_and_rebalance() {
        let merges = MergeRegistry::default();
        let mut leaf = Leaf::default();
        leaf.apply_buffer(puts(0..100, 1, 7, &merges), &merges, 1000)
            .unwrap();
        leaf.rebalance_basements(1000);
        // Basements smaller than a block are joined up to one.
        assert!(leaf.basements.len() >= 3);
        assert_eq!(leaf.pivots.len() + 1, leaf.basements.len());
        assert_eq!(leaf.entry_count(), 100);
        let mut del = MessageBuffer::default();
        del.insert_range_delete(
            10u32.to_be_bytes().to_vec(),
            90u32.to_be_bytes().to_vec(),
            2,
        );
        leaf.apply_buffer(del, &merges, 1000).unwrap();
        leaf.rebalance_basements(1000);
        assert_eq!(leaf.entry_count(), 20);
        assert_eq!(leaf.get(&5u32.to_be_bytes()), Some(Some(&[7u8; 100][..])));
        assert_eq!(leaf.get(&50u32.to_be_bytes()), Some(None));
    }

    /// Only messages that reach the last basement alone and take the
    /// leaf's last key further mark it as growing at its end; an insert
    /// anywhere before, or a delete of its tail, clear the mark, and
    /// overwrites at its end leave it as it was. A leaf so marked is not
    /// underfull, however small.
    #[test]
    fn appends_mark_a_leaf_as_growing_at_its_end() {
        let merges = MergeRegistry::default();
        let basement_size = 4096;
        let mut leaf = Leaf::default();
        let apply = |leaf: &mut Leaf, buffer: MessageBuffer| {
            leaf.apply_buffer(buffer, &merges, basement_size).unwrap();
            leaf.rebalance_basements(basement_size);
        };
        // An empty leaf taking its first keys grows at its end.
        apply(&mut leaf, puts(100..110, 1, 7, &merges));
        assert!(leaf.grows_at_end);
        assert!(
            !leaf.is_underfull(1 << 20),
            "a growing leaf is not underfull"
        );
        apply(&mut leaf, puts(110..400, 2, 7, &merges));
        assert!(leaf.grows_at_end && leaf.basements.len() >= 5);
        // An overwrite of the last key alone leaves the mark as it was.
        apply(&mut leaf, puts(399..400, 3, 8, &merges));
        assert!(leaf.grows_at_end);
        apply(&mut leaf, puts(400..420, 4, 7, &merges));
        assert!(leaf.grows_at_end);
        // Appends with an insert into an earlier basement: not appends.
        let mut mixed = puts(420..430, 5, 7, &merges);
        mixed.insert_point(
            50u32.to_be_bytes().to_vec(),
            PointMsg::put(5, vec![1; 100]),
            &merges,
        );
        apply(&mut leaf, mixed);
        assert!(!leaf.grows_at_end);
        assert!(leaf.is_underfull(1 << 20));
        apply(&mut leaf, puts(429..430, 6, 9, &merges));
        assert!(
            !leaf.grows_at_end,
            "overwrites at the end keep the mark off"
        );
        apply(&mut leaf, puts(430..440, 6, 7, &merges));
        assert!(leaf.grows_at_end);
        // A delete of the tail takes the end back.
        let mut del = MessageBuffer::default();
        del.insert_range_delete(
            435u32.to_be_bytes().to_vec(),
            440u32.to_be_bytes().to_vec(),
            7,
        );
        apply(&mut leaf, del);
        assert!(!leaf.grows_at_end);
        // Keys 100..435 and 50.
        assert_eq!(leaf.entry_count(), 336);
        crate::validate::check_leaf(&leaf, &Bounds::full()).unwrap();
    }

    /// Basements that shrank are joined with their neighbours: deletes
    /// that leave ten basements with a twentieth of their entries each
    /// leave one basement (each basement begins on a block of the image,
    /// so kept apart they made it ten blocks for one of entries).
    #[test]
    fn shrunken_basements_are_joined() {
        let merges = MergeRegistry::default();
        let mut leaf = Leaf::default();
        let basement_size = 4096;
        leaf.apply_buffer(puts(0..400, 1, 7, &merges), &merges, basement_size)
            .unwrap();
        leaf.rebalance_basements(basement_size);
        assert!(leaf.basements.len() >= 10, "{}", leaf.basements.len());
        let mut del = MessageBuffer::default();
        for i in (0..400u32).filter(|i| i % 20 != 0) {
            del.insert_point(i.to_be_bytes().to_vec(), PointMsg::delete(2), &merges);
        }
        leaf.apply_buffer(del, &merges, basement_size).unwrap();
        leaf.rebalance_basements(basement_size);
        assert_eq!(leaf.entry_count(), 20);
        assert_eq!(leaf.basements.len(), 1);
        assert!(leaf.pivots.is_empty());
        for i in 0..400u32 {
            let want = (i % 20 == 0).then_some(&[7u8; 100][..]);
            assert_eq!(leaf.get(&i.to_be_bytes()), Some(want), "key {i}");
        }
        // Joined within a basement: two basements' worth stays two or more.
        leaf.apply_buffer(puts(1000..1080, 3, 8, &merges), &merges, basement_size)
            .unwrap();
        leaf.rebalance_basements(basement_size);
        assert!(leaf.basements.len() >= 2);
        assert!(leaf
            .basements
            .windows(2)
            .all(|pair| pair[0].bytes + pair[1].bytes > basement_size));
        crate::validate::check_leaf(&leaf, &Bounds::full()).unwrap();
    }

    /// A range whose exclusive end is where a basement begins stays out
    /// of that basement (a 4 KiB block read must not read the next one,
    /// nor, being then "more than one basement", the rest of the leaf).
    #[test]
    fn ranges_ending_at_a_basement_stay_out_of_it() {
        let leaf = Leaf {
            pivots: vec![b"k".to_vec(), b"t".to_vec()],
            basements: (0..3)
                .map(|_| Basement::from_entries(Entries::default()))
                .collect(),
            grows_at_end: false,
        };
        assert_eq!(leaf.basement_for(b"k"), 1);
        assert_eq!(leaf.last_basement_before(b"k", 0), 0);
        assert_eq!(leaf.last_basement_before(b"ka", 0), 1);
        assert_eq!(leaf.last_basement_before(b"t", 1), 1);
        assert_eq!(leaf.last_basement_before(b"z", 0), 2);
        // An end at or before the start's basement never goes below it.
        assert_eq!(leaf.last_basement_before(b"k", 1), 1);
        assert_eq!(leaf.last_basement_before(b"a", 2), 2);
    }
}
