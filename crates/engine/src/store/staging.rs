//! Staged writes: batches that are logged, numbered and visible to point
//! queries, but not yet applied to the trees.
//!
//! A batch of point messages (puts, deletes, upserts), range deletes and
//! range renames or clones is logged and staged
//! under the staging lock alone — the tree lock is not taken — and the
//! staged batches are applied together, in sequence order, under one
//! exclusive hold of the tree lock once they pass a bound, or as soon as
//! anything needs the trees to hold them: a write of any other kind, a
//! checkpoint, a query that meets upserts onto the trees' values. A point
//! query reads the staged batches before the trees: a key's newest staged
//! message, or a staged range delete over it that is newer, decides it. A
//! range visit merges what is staged in its range over the trees' pairs
//! ([`StagedOverlay`]; before, every visit applied the staged batches
//! first, in the request: an `rmdir`'s emptiness check or a `readdir`
//! after writes paid for the writes' application). Without staging every write held the tree lock
//! exclusively, so a query never ran beside a write; with it, queries run
//! beside the writes and wait only for the applications (docs/design.md,
//! "Staged writes").
//!
//! A staged range rename or clone ([`StagedTransplant`]) is not read
//! through: a query of a key in its source or destination range, or a
//! visit that reaches into one, has the staged batches applied first. A
//! writer that stages one leaves their application for after its reply
//! (or applies at once where nothing works after replies): a rename's
//! surgery, tens of milliseconds for a large tree, no longer holds its
//! client (docs/design.md, "Renames staged"). The store stages renames,
//! not clones (a clone takes the tree's space check).
//!
//! Ordering: the staging lock is taken inside the tree lock, never the
//! other way round. A batch is staged and logged in the same hold of the
//! staging lock, and whoever applies the staged batches takes them and
//! reads the log's append position in one hold too, with the tree lock
//! held exclusively until they are applied: every batch the log holds up
//! to that position is in the trees, no later one is, and a query — which
//! reads the staged batches and then the trees under one hold of the tree
//! lock — never sees a batch twice or not at all.

use std::collections::{BTreeSet, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::ops::{Bound, ControlFlow};

use hashbrown::hash_table::{Entry, HashTable};

use crate::merge::MergeRegistry;
use crate::message::{KeySpace, Message, RangeRename, KEY_SPACES};
use crate::tree::PairVisitor;

/// A staged batch: its messages, decoded once, when the writer's
/// admission checked them, and kept so for the trees. Before, the
/// staged map took the decoded keys and values and the batch was kept
/// encoded beside it, to be decoded again when applied: a second decode
/// and allocation of every message (a quarter of an application's CPU
/// in tokubench) and the staged bytes held twice.
#[derive(Debug)]
pub(super) struct StagedBatch {
    pub seq: u64,
    /// The bytes of its encoded messages (its log record's payload
    /// without the count).
    pub body_len: usize,
    pub messages: Vec<(KeySpace, Message)>,
}

/// What the staged batches leave of one key.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Staged {
    /// The value of the put that is the key's newest message (held in
    /// that message, [`KeyEntry::at`]).
    Put,
    /// Its value, whatever the trees hold (upserts on a put or a delete).
    Value(Vec<u8>),
    /// Deleted, whatever the trees hold.
    Deleted,
    /// Upserts onto whatever the trees hold: the answer needs the trees
    /// with the staged batches applied.
    OnTrees,
}

/// What the staged batches leave of a key, for an answer.
enum StagedView<'a> {
    Value(&'a [u8]),
    Deleted,
    OnTrees,
}

/// A point query's answer from the staged batches.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum StagedAnswer {
    /// The staged batches decide it: the value, or none.
    Found(Option<Vec<u8>>),
    /// No staged batch touches the key: the trees answer.
    NotStaged,
    /// Upserts onto the trees' value are staged: apply the staged batches,
    /// then ask the trees.
    NeedsTrees,
}

/// What the staged batches leave of one key, and the newest of them that
/// touches it. The key itself is not copied: it is read from the newest
/// message to it, message `at` of batch `seq` ([`key_at`]).
#[derive(Clone, Debug)]
struct KeyEntry {
    /// The key's hash: the table's probes compare it before reading the
    /// key from its message (a walk through the batches to a long full
    /// path), and growing the table rehashes nothing.
    hash: u64,
    staged: Staged,
    /// The sequence number of the newest staged batch that touches the
    /// key: once the batches up to it are applied, the trees answer.
    seq: u64,
    /// The newest message to the key in that batch (its index).
    at: usize,
    /// Where the newest message to the key stands among every staged
    /// message (a range delete in the same batch before or after it
    /// decides against or for it).
    order: u64,
    /// What it counts towards the staging bound ([`Staging::bytes`]).
    counted: usize,
}

/// A staged range delete: every key in [`start`, `end`).
#[derive(Clone, Debug)]
struct StagedRange {
    start: Vec<u8>,
    end: Vec<u8>,
    seq: u64,
    order: u64,
}

/// A staged range rename or clone: the keys of its source range and of
/// its destination range are the trees' to answer, once the staged
/// batches are applied (what it moves where cannot be read from the
/// staged batches).
#[derive(Clone, Debug)]
struct StagedTransplant {
    /// [start, end) of the source, then of the destination.
    ranges: [(Vec<u8>, Vec<u8>); 2],
    seq: u64,
}

impl StagedTransplant {
    fn new(r: &RangeRename, seq: u64) -> StagedTransplant {
        StagedTransplant {
            ranges: [(r.start.clone(), r.end.clone()), r.destination_range()],
            seq,
        }
    }

    /// Whether `key` is in its source or its destination.
    fn touches(&self, key: &[u8]) -> bool {
        self.ranges.iter().any(|(s, e)| holds(s, e, key))
    }

    /// Whether its source or its destination meets [from, end) (`end`
    /// None: unbounded).
    fn meets(&self, from: &[u8], end: Option<&[u8]>) -> bool {
        self.ranges.iter().any(|(s, e)| meets(s, e, from, end))
    }

    /// What it counts towards the staging bound ([`Staging::bytes`]).
    fn bytes(&self) -> usize {
        self.ranges
            .iter()
            .map(|(s, e)| s.len() + e.len())
            .sum::<usize>()
            + KEY_OVERHEAD_BYTES
    }
}

impl StagedRange {
    fn covers(&self, key: &[u8]) -> bool {
        holds(&self.start, &self.end, key)
    }

    /// What it counts towards the staging bound ([`Staging::bytes`]).
    fn bytes(&self) -> usize {
        self.start.len() + self.end.len() + KEY_OVERHEAD_BYTES
    }
}

/// The most range deletes, renames and clones staged at once: a point
/// query compares its key with each of them. A batch that would pass it
/// is applied under the tree lock instead.
pub(super) const STAGED_RANGES_MAX: usize = 64;

/// The staged batches, guarded by the store's staging lock.
#[derive(Debug)]
pub(super) struct Staging {
    /// The sequence number of the next batch logged (the trees' own
    /// `next_seq` is the next one they apply).
    pub next_seq: u64,
    /// Logged batches not yet applied, in sequence order: consecutive
    /// numbers (a batch written under the tree lock takes every staged
    /// batch with it), so batch `seq` is at `seq` less the first's.
    batches: VecDeque<StagedBatch>,
    /// Per key space, what the staged batches leave of each key they
    /// touch, found by the hash of the key its entry reads from its
    /// newest message.
    keys: [HashTable<KeyEntry>; KEY_SPACES],
    /// Hashes the keys: SipHash with keys of its own, as a `HashMap`'s —
    /// file names are the users' to choose.
    hasher: RandomState,
    /// Per key space, the keys of `keys` in order, for range visits
    /// ([`Staging::overlay`]): made by the first visit that needs them and
    /// kept by the pushes after it, dropped when batches are taken. Point
    /// queries and pushes are the hot path (a create stages three or four
    /// keys, a visit after writes is rarer): a map in key order instead of
    /// the hash map cost tokubench 4-8% (docs/benchmarks/visits-and-copies.md).
    ordered: [Option<BTreeSet<Vec<u8>>>; KEY_SPACES],
    /// Per key space, the staged range deletes, oldest first.
    ranges: [Vec<StagedRange>; KEY_SPACES],
    /// Per key space, the staged range renames and clones, oldest first.
    transplants: [Vec<StagedTransplant>; KEY_SPACES],
    /// The order of the next staged message ([`KeyEntry::order`]).
    next_order: u64,
    /// What the staging bound measures ([`Staging::bytes`]).
    bytes: usize,
    /// The staged batches' payloads alone.
    batch_bytes: usize,
}

/// Per staged key: its entry and the table's slot.
const KEY_OVERHEAD_BYTES: usize = 64;

/// Whether [`start`, `end`) holds `key`.
fn holds(start: &[u8], end: &[u8], key: &[u8]) -> bool {
    start <= key && key < end
}

/// Whether [`start`, `end`) meets [`from`, `to`) (`to` None: unbounded).
fn meets(start: &[u8], end: &[u8], from: &[u8], to: Option<&[u8]>) -> bool {
    end > from && to.is_none_or(|to| start < to)
}

/// The staged message `at` of batch `seq`.
fn message_at(batches: &VecDeque<StagedBatch>, seq: u64, at: usize) -> &Message {
    let first = batches.front().map_or(seq, |b| b.seq);
    let found = usize::try_from(seq.wrapping_sub(first))
        .ok()
        .and_then(|i| batches.get(i))
        .filter(|b| b.seq == seq)
        .and_then(|b| b.messages.get(at));
    match found {
        Some((_, message)) => message,
        None => panic!("staging invariant: an entry names staged message {at} of batch {seq}"),
    }
}

/// The key an entry stands for, read from its newest message.
fn key_at<'a>(batches: &'a VecDeque<StagedBatch>, entry: &KeyEntry) -> &'a [u8] {
    match message_at(batches, entry.seq, entry.at).point_key() {
        Some(key) => key,
        None => panic!("staging invariant: an entry names a range message"),
    }
}

impl Staging {
    pub fn new(next_seq: u64) -> Staging {
        Staging {
            next_seq,
            batches: VecDeque::new(),
            keys: Default::default(),
            hasher: RandomState::new(),
            ordered: Default::default(),
            ranges: Default::default(),
            transplants: Default::default(),
            next_order: 0,
            bytes: 0,
            batch_bytes: 0,
        }
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// What the staging bound measures: the staged batches' payloads, and
    /// for each staged key its key, its value (a put's, or upserts'
    /// merged) and its entry — a key staged again counted once, for its
    /// newest message. The bound, and the headroom for what may be staged
    /// that a write's space check leaves (`Inner::note_space`), were set
    /// when the map held a copy of each key and value beside the encoded
    /// batches, and are counted so still: applications stay the size they
    /// were measured at (counted by what is held now, about half, they
    /// would come smaller and more often than measured), and so does the
    /// state a full device's reclaim meets.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many range deletes, renames and clones are staged (at most
    /// [`STAGED_RANGES_MAX`]).
    pub fn range_count(&self) -> usize {
        self.ranges.iter().map(Vec::len).sum::<usize>()
            + self.transplants.iter().map(Vec::len).sum::<usize>()
    }

    /// Stages a batch of `body_len` bytes encoded, logged with sequence
    /// number `seq`; `messages` are its messages, decoded (the writer's
    /// admission decoded them), kept for the trees. No more than
    /// [`STAGED_RANGES_MAX`] range messages are staged (the caller checks).
    pub fn push(
        &mut self,
        seq: u64,
        body_len: usize,
        messages: Vec<(KeySpace, Message)>,
        merges: &MergeRegistry,
    ) {
        assert_eq!(seq, self.next_seq, "staging invariant: batches in order");
        self.next_seq = seq + 1;
        self.batch_bytes += body_len;
        self.bytes += body_len;
        // In first: the entries read their keys from its messages.
        self.batches.push_back(StagedBatch {
            seq,
            body_len,
            messages,
        });
        let Staging {
            batches,
            keys,
            hasher,
            ordered,
            ranges,
            transplants,
            next_order,
            bytes,
            ..
        } = self;
        let Some(batch) = batches.back() else {
            unreachable!("staging invariant: the batch was just pushed")
        };
        for (at, (ks, msg)) in batch.messages.iter().enumerate() {
            let order = *next_order;
            *next_order += 1;
            // Reviewed exception (indexing): a key space's index is
            // below KEY_SPACES by construction.
            #[allow(clippy::indexing_slicing)]
            let (table, ranges, transplants, ordered) = (
                &mut keys[ks.index()],
                &mut ranges[ks.index()],
                &mut transplants[ks.index()],
                &mut ordered[ks.index()],
            );
            let Some(key) = msg.point_key() else {
                match msg {
                    Message::RangeDelete { start, end } => {
                        let range = StagedRange {
                            start: start.clone(),
                            end: end.clone(),
                            seq,
                            order,
                        };
                        *bytes += range.bytes();
                        ranges.push(range);
                    }
                    Message::RangeRename(r) | Message::RangeClone(r) => {
                        let transplant = StagedTransplant::new(r, seq);
                        *bytes += transplant.bytes();
                        transplants.push(transplant);
                    }
                    other => unreachable!("point_key named no point message: {other:?}"),
                }
                continue;
            };
            if let Some(ordered) = ordered {
                if !ordered.contains(key) {
                    ordered.insert(key.to_vec());
                }
            }
            // One search of the table for the key: an upsert merges onto
            // what its entry leaves, and a key staged again keeps one
            // entry (the old value goes).
            let hash = hasher.hash_one(key);
            let slot = table.entry(
                hash,
                |e| e.hash == hash && key_at(batches, e) == key,
                |e| e.hash,
            );
            let (staged, value_len) = match msg {
                Message::Put { value, .. } => (Staged::Put, value.len()),
                Message::Delete { .. } => (Staged::Deleted, 0),
                Message::Upsert { func, arg, .. } => {
                    let old = match &slot {
                        Entry::Occupied(e) => Some(e.get()),
                        Entry::Vacant(_) => None,
                    };
                    // Under a staged rename or clone the key's value is
                    // what the trees make of it once that is applied.
                    let view = if transplants.iter().any(|t| t.touches(key)) {
                        None
                    } else {
                        staged_view(batches, old, ranges, key)
                    };
                    let staged = match view {
                        Some(StagedView::Value(old)) => merged(merges, *func, Some(old), arg),
                        Some(StagedView::Deleted) => merged(merges, *func, None, arg),
                        Some(StagedView::OnTrees) | None => Staged::OnTrees,
                    };
                    let merged_len = match &staged {
                        Staged::Value(v) => v.len(),
                        Staged::Put | Staged::Deleted | Staged::OnTrees => 0,
                    };
                    (staged, merged_len)
                }
                other => unreachable!("point_key named a point message, not {other:?}"),
            };
            let entry = KeyEntry::new(key, hash, staged, value_len, seq, at, order);
            *bytes += entry.counted;
            match slot {
                Entry::Occupied(mut slot) => {
                    *bytes -= slot.get().counted;
                    *slot.get_mut() = entry;
                }
                Entry::Vacant(slot) => {
                    slot.insert(entry);
                }
            }
        }
    }

    /// The keys of `ks` the staged batches touch, where their range
    /// deletes begin, and where the ranges of their renames and clones
    /// begin and end (a surgery cuts there).
    pub fn keys(&self, ks: KeySpace) -> impl Iterator<Item = &[u8]> {
        let starts = self.ranges_of(ks).iter().map(|r| r.start.as_slice());
        let cuts = self.transplants_of(ks).iter().flat_map(|t| {
            t.ranges
                .iter()
                .flat_map(|(s, e)| [s.as_slice(), e.as_slice()])
        });
        let batches = &self.batches;
        self.keys_of(ks)
            .iter()
            .map(move |e| key_at(batches, e))
            .chain(starts)
            .chain(cuts)
    }

    /// What the staged batches say of `key`.
    pub fn lookup(&self, ks: KeySpace, key: &[u8]) -> StagedAnswer {
        match self.newest_staged(ks, key) {
            None => StagedAnswer::NotStaged,
            Some(StagedView::Value(v)) => StagedAnswer::Found(Some(v.to_vec())),
            Some(StagedView::Deleted) => StagedAnswer::Found(None),
            Some(StagedView::OnTrees) => StagedAnswer::NeedsTrees,
        }
    }

    /// What the staged batches leave of [`from`, `end`) of `ks`, for a
    /// range visit that merges it over the trees ([`StagedOverlay`]); None
    /// when upserts onto the trees' values are staged there (the visit
    /// needs the staged batches applied). The keys must be ordered
    /// ([`Staging::keys_ordered`]). The caller holds the tree lock: the
    /// trees hold no batch staged here, and none is applied until the
    /// visit is over.
    pub fn overlay(&self, ks: KeySpace, from: &[u8], end: Option<&[u8]>) -> Option<StagedOverlay> {
        debug_assert!(
            self.keys_ordered(ks),
            "staging invariant: keys ordered for a visit"
        );
        if self.transplants_of(ks).iter().any(|t| t.meets(from, end)) {
            return None;
        }
        let upper = end.map_or(Bound::Unbounded, Bound::Excluded);
        let mut points = Vec::new();
        let ordered = self.ordered_of(ks);
        for key in ordered
            .into_iter()
            .flat_map(|o| o.range::<[u8], _>((Bound::Included(from), upper)))
        {
            match self.newest_staged(ks, key) {
                Some(StagedView::Value(v)) => points.push((key.clone(), Some(v.to_vec()))),
                Some(StagedView::Deleted) => points.push((key.clone(), None)),
                Some(StagedView::OnTrees) => return None,
                None => unreachable!("staging invariant: an ordered key is staged"),
            }
        }
        let deletes = self
            .ranges_of(ks)
            .iter()
            .filter(|r| meets(&r.start, &r.end, from, end))
            .map(|r| (r.start.clone(), r.end.clone()))
            .collect();
        Some(StagedOverlay { points, deletes })
    }

    /// What the newest staged message to `key` leaves of it: its entry,
    /// or a delete when a staged range delete over it is newer — or the
    /// trees' answer once every staged batch is applied, when a staged
    /// rename or clone touches it.
    fn newest_staged(&self, ks: KeySpace, key: &[u8]) -> Option<StagedView<'_>> {
        if self.transplants_of(ks).iter().any(|t| t.touches(key)) {
            return Some(StagedView::OnTrees);
        }
        let batches = &self.batches;
        let hash = self.hasher.hash_one(key);
        let entry = self
            .keys_of(ks)
            .find(hash, |e| e.hash == hash && key_at(batches, e) == key);
        staged_view(batches, entry, self.ranges_of(ks), key)
    }

    // Reviewed exception (indexing): a key space's index is below
    // KEY_SPACES by construction.
    #[allow(clippy::indexing_slicing)]
    fn keys_of(&self, ks: KeySpace) -> &HashTable<KeyEntry> {
        &self.keys[ks.index()]
    }

    /// Whether a visit of `ks` can read the staged keys in order without
    /// ordering them first ([`Staging::order_keys`]): they are ordered, or
    /// there are none.
    pub fn keys_ordered(&self, ks: KeySpace) -> bool {
        self.ordered_of(ks).is_some() || self.keys_of(ks).is_empty()
    }

    /// Makes `ks`'s ordered keys if there are none.
    // Reviewed exception (indexing): as in `keys_of`.
    #[allow(clippy::indexing_slicing)]
    pub fn order_keys(&mut self, ks: KeySpace) {
        let (keys, ordered) = (&self.keys[ks.index()], &mut self.ordered[ks.index()]);
        if ordered.is_none() {
            let batches = &self.batches;
            *ordered = Some(keys.iter().map(|e| key_at(batches, e).to_vec()).collect());
        }
    }

    // Reviewed exception (indexing): as in `keys_of`.
    #[allow(clippy::indexing_slicing)]
    fn ordered_of(&self, ks: KeySpace) -> Option<&BTreeSet<Vec<u8>>> {
        self.ordered[ks.index()].as_ref()
    }

    // Reviewed exception (indexing): as in `keys_of`.
    #[allow(clippy::indexing_slicing)]
    fn ranges_of(&self, ks: KeySpace) -> &[StagedRange] {
        &self.ranges[ks.index()]
    }

    // Reviewed exception (indexing): as in `keys_of`.
    #[allow(clippy::indexing_slicing)]
    fn transplants_of(&self, ks: KeySpace) -> &[StagedTransplant] {
        &self.transplants[ks.index()]
    }

    /// Takes every staged batch, in sequence order, for the trees.
    pub fn take(&mut self) -> Vec<StagedBatch> {
        for keys in &mut self.keys {
            keys.clear();
        }
        self.ordered = Default::default();
        for ranges in &mut self.ranges {
            ranges.clear();
        }
        for transplants in &mut self.transplants {
            transplants.clear();
        }
        self.bytes = 0;
        self.batch_bytes = 0;
        std::mem::take(&mut self.batches).into()
    }

    /// Takes the oldest staged batches, in sequence order, as many as fit
    /// in `max_bytes` of payload (at least one), for the trees — or
    /// nothing when all of them fit: the caller takes those in the hold
    /// that needs them all applied ([`Staging::take`]).
    ///
    /// A key whose newest staged batch is taken leaves the map, and a
    /// range delete taken leaves the list: the trees answer for them once
    /// they hold the batches taken. A key staged again later keeps its
    /// entry, which still answers rightly: a value or a delete decides the
    /// key whatever the trees hold (the taken batches included), and
    /// upserts onto the trees' value send the query to the trees with
    /// every staged batch applied; a range delete left is newer than
    /// everything taken.
    pub fn take_oldest(&mut self, max_bytes: usize) -> Vec<StagedBatch> {
        if self.batch_bytes <= max_bytes {
            return Vec::new();
        }
        let (mut count, mut taken_bytes) = (0, 0);
        for batch in &self.batches {
            if count > 0 && taken_bytes + batch.body_len > max_bytes {
                break;
            }
            taken_bytes += batch.body_len;
            count += 1;
        }
        let taken: Vec<_> = self.batches.drain(..count).collect();
        let Some(newest_taken) = taken.last().map(|b| b.seq) else {
            return taken;
        };
        let mut freed = taken_bytes;
        // Rebuilt by the next visit that needs them.
        self.ordered = Default::default();
        // Whether what batch `seq` staged stays (it is newer than every
        // batch taken), counting what goes as freed.
        let mut stays = |seq: u64, counted: usize| {
            let keep = seq > newest_taken;
            if !keep {
                freed += counted;
            }
            keep
        };
        // The entries left name messages of the batches left: their
        // newest message is newer than every batch taken.
        for keys in &mut self.keys {
            keys.retain(|entry| stays(entry.seq, entry.counted));
        }
        for ranges in &mut self.ranges {
            ranges.retain(|r| stays(r.seq, r.bytes()));
        }
        for transplants in &mut self.transplants {
            transplants.retain(|t| stays(t.seq, t.bytes()));
        }
        self.batch_bytes -= taken_bytes;
        self.bytes -= freed;
        taken
    }
}

/// What the newest staged message to `key` leaves of it, given its entry
/// if it has one ([`Staging::newest_staged`]; a push reads it from the
/// entry it found to replace).
fn staged_view<'a>(
    batches: &'a VecDeque<StagedBatch>,
    entry: Option<&'a KeyEntry>,
    ranges: &[StagedRange],
    key: &[u8],
) -> Option<StagedView<'a>> {
    let newest_range = ranges.iter().rev().find(|r| r.covers(key)).map(|r| r.order);
    let entry = match (entry, newest_range) {
        (Some(e), Some(range)) if range > e.order => return Some(StagedView::Deleted),
        (None, Some(_)) => return Some(StagedView::Deleted),
        (entry, _) => entry?,
    };
    Some(match &entry.staged {
        Staged::Put => match message_at(batches, entry.seq, entry.at) {
            Message::Put { value, .. } => StagedView::Value(value),
            other => panic!("staging invariant: a put's entry names {other:?}"),
        },
        Staged::Value(v) => StagedView::Value(v),
        Staged::Deleted => StagedView::Deleted,
        Staged::OnTrees => StagedView::OnTrees,
    })
}

/// What the staged batches leave of a key range, merged over the trees'
/// pairs by a range visit ([`Staging::overlay`]): the staged keys in the
/// range, in key order, each with its value or deleted, and the staged
/// range deletes over it. Every staged batch is newer than the trees: a
/// staged key decides itself, and a tree key under a staged range delete
/// is gone.
#[derive(Debug)]
pub(super) struct StagedOverlay {
    points: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    deletes: Vec<(Vec<u8>, Vec<u8>)>,
}

impl StagedOverlay {
    /// A visitor that hands `visit` the trees' pairs with this overlay
    /// merged in, in key order; [`OverlayMerge::finish`] hands it the
    /// staged pairs after the trees' last one. Each call says whether
    /// `visit` broke.
    pub fn merge<'a>(&'a self, visit: &'a mut PairVisitor<'_>) -> OverlayMerge<'a> {
        OverlayMerge {
            overlay: self,
            next_point: 0,
            visit,
            stopped: false,
        }
    }
}

/// A range visit's pairs from the trees with a [`StagedOverlay`] merged
/// in.
pub(super) struct OverlayMerge<'a> {
    overlay: &'a StagedOverlay,
    /// The first staged key not yet handed on or passed.
    next_point: usize,
    visit: &'a mut PairVisitor<'a>,
    /// `visit` broke: nothing more is handed on.
    stopped: bool,
}

impl OverlayMerge<'_> {
    /// The trees' next pair (keys come in order): the staged pairs before
    /// it go first, then it unless a staged message decides its key.
    pub fn tree_pair(&mut self, key: &[u8], value: &[u8]) -> ControlFlow<()> {
        self.staged_before(Some(key))?;
        if let Some((staged_key, staged)) = self.overlay.points.get(self.next_point) {
            if staged_key.as_slice() == key {
                self.next_point += 1;
                return match staged {
                    Some(staged) => self.hand_on(key, staged),
                    None => ControlFlow::Continue(()),
                };
            }
        }
        let deleted = self
            .overlay
            .deletes
            .iter()
            .any(|(start, end)| start.as_slice() <= key && key < end.as_slice());
        if deleted {
            return ControlFlow::Continue(());
        }
        self.hand_on(key, value)
    }

    /// After the trees' last pair of the visit, which reached to `next`
    /// (None: to the end of the range): the staged pairs before it,
    /// unless the visit broke.
    pub fn finish(mut self, next: Option<&[u8]>) -> ControlFlow<()> {
        if self.stopped {
            return ControlFlow::Break(());
        }
        self.staged_before(next)
    }

    fn hand_on(&mut self, key: &[u8], value: &[u8]) -> ControlFlow<()> {
        let flow = (self.visit)(key, value);
        self.stopped |= flow.is_break();
        flow
    }

    /// Hands on the staged values of the keys before `bound` (None: all).
    fn staged_before(&mut self, bound: Option<&[u8]>) -> ControlFlow<()> {
        while let Some((staged_key, staged)) = self.overlay.points.get(self.next_point) {
            if bound.is_some_and(|b| staged_key.as_slice() >= b) {
                break;
            }
            self.next_point += 1;
            if let Some(staged) = staged {
                self.hand_on(staged_key, staged)?;
            }
        }
        ControlFlow::Continue(())
    }
}

impl KeyEntry {
    /// The entry of a key whose newest message is `at` of batch `seq`
    /// and leaves it `staged`, with a value of `value_len` bytes (a put's
    /// or upserts' merged), counted towards the bound.
    fn new(
        key: &[u8],
        hash: u64,
        staged: Staged,
        value_len: usize,
        seq: u64,
        at: usize,
        order: u64,
    ) -> KeyEntry {
        KeyEntry {
            hash,
            staged,
            seq,
            at,
            order,
            counted: key.len() + value_len + KEY_OVERHEAD_BYTES,
        }
    }
}

/// An upsert onto a value the staged batches know.
fn merged(merges: &MergeRegistry, func: u8, old: Option<&[u8]>, arg: &[u8]) -> Staged {
    match merges.apply(func, old, arg) {
        Some(value) => Staged::Value(value),
        // Checked when the batch entered the store; the trees would
        // report it.
        None => Staged::OnTrees,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge::{patch_arg, MERGE_PATCH};
    use crate::message::WriteBatch;
    use std::collections::BTreeMap;

    fn registry() -> MergeRegistry {
        MergeRegistry::default()
    }

    /// Stages `batch` with its messages decoded, as a writer does.
    fn stage(staging: &mut Staging, seq: u64, batch: WriteBatch, merges: &MergeRegistry) {
        let messages: Vec<_> = batch.messages().collect();
        staging.push(seq, batch.body_len(), messages, merges);
    }

    #[test]
    fn the_newest_message_of_a_key_answers() {
        let merges = registry();
        let mut staging = Staging::new(7);
        let ks = KeySpace::Meta;
        stage(
            &mut staging,
            7,
            WriteBatch::new().put(ks, b"a", b"1").clone(),
            &merges,
        );
        stage(
            &mut staging,
            8,
            WriteBatch::new()
                .delete(ks, b"a")
                .put(ks, b"b", b"2")
                .clone(),
            &merges,
        );
        stage(
            &mut staging,
            9,
            WriteBatch::new().put(ks, b"a", b"3").clone(),
            &merges,
        );
        assert_eq!(
            staging.lookup(ks, b"a"),
            StagedAnswer::Found(Some(b"3".to_vec()))
        );
        assert_eq!(
            staging.lookup(ks, b"b"),
            StagedAnswer::Found(Some(b"2".to_vec()))
        );
        assert_eq!(
            staging.lookup(KeySpace::Data, b"b"),
            StagedAnswer::NotStaged
        );
        assert_eq!(staging.next_seq, 10);
        let taken = staging.take();
        assert_eq!(taken.iter().map(|b| b.seq).collect::<Vec<_>>(), [7, 8, 9]);
        assert!(staging.is_empty());
        assert_eq!(staging.bytes(), 0);
        assert_eq!(staging.lookup(ks, b"a"), StagedAnswer::NotStaged);
    }

    #[test]
    fn a_key_staged_again_is_counted_once() {
        let merges = registry();
        let mut staging = Staging::new(1);
        let ks = KeySpace::Meta;
        stage(
            &mut staging,
            1,
            WriteBatch::new().put(ks, b"k", b"12345678").clone(),
            &merges,
        );
        let once = staging.bytes();
        stage(
            &mut staging,
            2,
            WriteBatch::new().put(ks, b"k", b"12345678").clone(),
            &merges,
        );
        // The second batch's payload is counted; its key's entry replaced
        // the first one's.
        let payload = WriteBatch::new().put(ks, b"k", b"12345678").body_len();
        assert_eq!(staging.bytes(), once + payload);
        assert_eq!(once, payload + b"k12345678".len() + KEY_OVERHEAD_BYTES);
    }

    #[test]
    fn upserts_merge_onto_a_staged_value_and_need_the_trees_otherwise() {
        let merges = registry();
        let mut staging = Staging::new(1);
        let ks = KeySpace::Data;
        let patch = patch_arg(2, b"xy");
        let mut batch = WriteBatch::new();
        batch.put(ks, b"k", b"abcd");
        batch.upsert(ks, b"k", MERGE_PATCH, &patch);
        batch.upsert(ks, b"u", MERGE_PATCH, &patch);
        batch.delete(ks, b"d");
        batch.upsert(ks, b"d", MERGE_PATCH, &patch);
        stage(&mut staging, 1, batch, &merges);
        let expected = merges.apply(MERGE_PATCH, Some(b"abcd"), &patch);
        assert_eq!(staging.lookup(ks, b"k"), StagedAnswer::Found(expected));
        assert_eq!(staging.lookup(ks, b"u"), StagedAnswer::NeedsTrees);
        let on_nothing = merges.apply(MERGE_PATCH, None, &patch);
        assert_eq!(staging.lookup(ks, b"d"), StagedAnswer::Found(on_nothing));
        // A put after upserts onto the trees decides the key again.
        stage(
            &mut staging,
            2,
            WriteBatch::new().put(ks, b"u", b"v").clone(),
            &merges,
        );
        assert_eq!(
            staging.lookup(ks, b"u"),
            StagedAnswer::Found(Some(b"v".to_vec()))
        );
    }

    /// A staged rename sends the keys of its source and destination to
    /// the trees (and visits that reach into either), whatever else is
    /// staged for them, before or after it; an upsert staged after it
    /// onto a key there does not merge onto what was staged before it.
    /// Keys elsewhere are answered as before, and once the rename's batch
    /// is taken, by the batches left.
    #[test]
    fn a_staged_rename_leaves_its_ranges_to_the_trees() {
        let merges = registry();
        let mut staging = Staging::new(1);
        let ks = KeySpace::Meta;
        // "a/x" (source a/..) moves to "b/x"; "b/" held "b/y" before.
        stage(
            &mut staging,
            1,
            WriteBatch::new()
                .put(ks, b"a/x", b"1")
                .put(ks, b"b/y", b"2")
                .put(ks, b"c", b"3")
                .clone(),
            &merges,
        );
        stage(
            &mut staging,
            2,
            WriteBatch::new()
                .range_rename(ks, b"a/", b"a0", 1, b"b")
                .clone(),
            &merges,
        );
        assert_eq!(staging.range_count(), 1);
        for key in [&b"a/x"[..], b"b/y", b"b/x", b"a/"] {
            assert_eq!(staging.lookup(ks, key), StagedAnswer::NeedsTrees, "{key:?}");
        }
        assert_eq!(staging.lookup(ks, b"a0"), StagedAnswer::NotStaged);
        assert_eq!(
            staging.lookup(ks, b"c"),
            StagedAnswer::Found(Some(b"3".to_vec()))
        );
        assert_eq!(
            staging.lookup(KeySpace::Data, b"a/x"),
            StagedAnswer::NotStaged
        );
        staging.order_keys(ks);
        assert!(
            staging.overlay(ks, b"b/z", None).is_none(),
            "reaches into b/"
        );
        assert!(
            staging.overlay(ks, b"", Some(b"a/")).is_some(),
            "ends before a/"
        );
        assert!(staging.overlay(ks, b"b0", None).is_some(), "after both");
        let cuts: Vec<&[u8]> = staging
            .keys(ks)
            .filter(|k| !k.ends_with(b"x") && !k.ends_with(b"y"))
            .collect();
        assert!(
            cuts.contains(&&b"a/"[..]) && cuts.contains(&&b"b0"[..]),
            "{cuts:?}"
        );
        // An upsert after the rename onto "b/y", which a put staged
        // before it set: the rename emptied "b/" first.
        let patch = patch_arg(0, b"z");
        stage(
            &mut staging,
            3,
            WriteBatch::new()
                .upsert(ks, b"b/y", MERGE_PATCH, &patch)
                .put(ks, b"c", b"4")
                .clone(),
            &merges,
        );
        // The batches up to the rename's taken: the trees hold it, and
        // the upsert after it is still the trees' to combine.
        let taken = staging.take_oldest(1);
        assert_eq!(taken.len(), 1);
        let taken = staging.take_oldest(1);
        assert_eq!(taken.iter().map(|b| b.seq).collect::<Vec<_>>(), [2]);
        assert_eq!(staging.range_count(), 0);
        assert_eq!(staging.lookup(ks, b"b/y"), StagedAnswer::NeedsTrees);
        assert_eq!(staging.lookup(ks, b"b/x"), StagedAnswer::NotStaged);
        assert_eq!(
            staging.lookup(ks, b"c"),
            StagedAnswer::Found(Some(b"4".to_vec()))
        );
        staging.take();
        assert_eq!(staging.bytes(), 0);
    }

    /// A range delete decides the keys it covers against older messages in
    /// the staged batches and for newer ones — in one batch too, where
    /// the order of its messages decides — and an upsert after it merges
    /// onto nothing; the trees answer again once it is taken.
    #[test]
    fn a_staged_range_delete_decides_the_keys_it_covers() {
        let merges = registry();
        let mut staging = Staging::new(1);
        let ks = KeySpace::Data;
        let mut batch = WriteBatch::new();
        batch.put(ks, b"b", b"old");
        batch.range_delete(ks, b"a", b"m");
        batch.put(ks, b"c", b"new");
        stage(&mut staging, 1, batch, &merges);
        let patch = patch_arg(0, b"xy");
        stage(
            &mut staging,
            2,
            WriteBatch::new()
                .upsert(ks, b"d", MERGE_PATCH, &patch)
                .clone(),
            &merges,
        );
        assert_eq!(staging.lookup(ks, b"b"), StagedAnswer::Found(None));
        assert_eq!(staging.lookup(ks, b"a"), StagedAnswer::Found(None));
        assert_eq!(staging.lookup(ks, b"l"), StagedAnswer::Found(None));
        assert_eq!(
            staging.lookup(ks, b"c"),
            StagedAnswer::Found(Some(b"new".to_vec()))
        );
        let on_nothing = merges.apply(MERGE_PATCH, None, &patch);
        assert_eq!(staging.lookup(ks, b"d"), StagedAnswer::Found(on_nothing));
        // The end is not covered, nor the other key space.
        assert_eq!(staging.lookup(ks, b"m"), StagedAnswer::NotStaged);
        assert_eq!(
            staging.lookup(KeySpace::Meta, b"b"),
            StagedAnswer::NotStaged
        );
        assert_eq!(staging.range_count(), 1);
        let taken = staging.take_oldest(1);
        assert_eq!(taken.len(), 1);
        assert_eq!(staging.range_count(), 0);
        assert_eq!(staging.lookup(ks, b"b"), StagedAnswer::NotStaged);
        assert!(staging.keys(ks).eq([&b"d"[..]]));
    }

    #[test]
    fn the_oldest_batches_are_taken_up_to_a_size() {
        let merges = registry();
        let mut staging = Staging::new(1);
        let ks = KeySpace::Meta;
        let batch = |key: &[u8], value: &[u8]| WriteBatch::new().put(ks, key, value).clone();
        let size = batch(b"a", b"1").body_len();
        stage(&mut staging, 1, batch(b"a", b"1"), &merges);
        stage(&mut staging, 2, batch(b"b", b"1"), &merges);
        stage(&mut staging, 3, batch(b"a", b"2"), &merges);
        // All of them fit: nothing taken, the caller takes them all.
        assert!(staging.take_oldest(3 * size).is_empty());
        let taken = staging.take_oldest(2 * size);
        assert_eq!(taken.iter().map(|b| b.seq).collect::<Vec<_>>(), [1, 2]);
        // "b" is the trees' now; "a" is still decided by batch 3.
        assert_eq!(staging.lookup(ks, b"b"), StagedAnswer::NotStaged);
        assert_eq!(
            staging.lookup(ks, b"a"),
            StagedAnswer::Found(Some(b"2".to_vec()))
        );
        // A batch bigger than the size is taken alone.
        stage(&mut staging, 4, batch(b"c", b"1"), &merges);
        assert_eq!(staging.take_oldest(1).len(), 1);
        assert_eq!(staging.take().len(), 1);
        assert_eq!((staging.bytes(), staging.batch_bytes), (0, 0));
    }

    proptest::proptest! {
        /// Staged batches taken oldest first, some at a time, and applied
        /// to a map standing for the trees: every key's answer from the
        /// staged batches agrees with a map that took everything (a
        /// value or delete they decide; a key they leave alone, the
        /// trees'), and the bytes counted are those of what is left.
        #[test]
        fn the_oldest_batches_taken_leave_the_rest_answering(
            ops in proptest::collection::vec(
                (0u8..12, 0u8..8, 0u8..255, 0usize..4),
                1..150,
            ),
        ) {
            let merges = registry();
            let mut staging = Staging::new(1);
            let mut trees: BTreeMap<u8, Vec<u8>> = BTreeMap::new();
            let mut everything = trees.clone();
            let mut staged_sizes = VecDeque::new();
            fn transplant(map: &mut BTreeMap<u8, Vec<u8>>, r: &RangeRename, moves: bool) {
                let (from, to) = (r.start[0], r.new_prefix[0]);
                let value = map.get(&from).cloned();
                map.remove(&to);
                if let Some(value) = value {
                    map.insert(to, value);
                }
                if moves {
                    map.remove(&from);
                }
            }
            let apply = |map: &mut BTreeMap<u8, Vec<u8>>, messages: &[(KeySpace, Message)]| {
                for (_, m) in messages.iter().cloned() {
                    match m {
                        Message::Put { key, value } => { map.insert(key[0], value); }
                        Message::Delete { key } => { map.remove(&key[0]); }
                        Message::Upsert { key, func, arg } => {
                            match merges.apply(func, map.get(&key[0]).map(|v| &v[..]), &arg) {
                                Some(v) => map.insert(key[0], v),
                                None => map.remove(&key[0]),
                            };
                        }
                        Message::RangeDelete { start, end } => {
                            map.retain(|k, _| !(start[0]..end[0]).contains(k));
                        }
                        // Single-byte keys: the source range holds one
                        // key, the destination one.
                        Message::RangeRename(r) => transplant(map, &r, true),
                        Message::RangeClone(r) => transplant(map, &r, false),
                    }
                }
            };
            for (seq, &(k, kind, v, take)) in (1u64..).zip(&ops) {
                let mut batch = WriteBatch::new();
                let span = [k, k.saturating_add(1 + v % 4)];
                match kind {
                    0 => batch.put(KeySpace::Meta, &[k], &[v]),
                    1 => batch.delete(KeySpace::Meta, &[k]),
                    2 => batch.upsert(KeySpace::Meta, &[k], MERGE_PATCH, &patch_arg(0, &[v])),
                    3 => batch.range_delete(KeySpace::Meta, &span[..1], &span[1..]),
                    // A range delete and a message to a key it covers, in
                    // either order within one batch.
                    4 => batch
                        .range_delete(KeySpace::Meta, &span[..1], &span[1..])
                        .put(KeySpace::Meta, &[k], &[v]),
                    // Key k renamed or cloned to another (its range [k],
                    // [k, ff) holds only it among single-byte keys), with
                    // an upsert onto the destination after it.
                    6 | 7 => {
                        let to = (k + 1 + v % 11) % 12;
                        if kind == 6 {
                            batch.range_rename(KeySpace::Meta, &[k], &[k, 0xff], 1, &[to]);
                        } else {
                            batch.range_clone(KeySpace::Meta, &[k], &[k, 0xff], 1, &[to]);
                        }
                        batch.upsert(KeySpace::Meta, &[to], MERGE_PATCH, &patch_arg(0, &[v]))
                    }
                    _ => batch
                        .upsert(KeySpace::Meta, &[k], MERGE_PATCH, &patch_arg(0, &[v]))
                        .range_delete(KeySpace::Meta, &span[..1], &span[1..])
                        .upsert(KeySpace::Meta, &[k.wrapping_add(1)], MERGE_PATCH, &patch_arg(0, &[v])),
                };
                apply(&mut everything, &batch.messages().collect::<Vec<_>>());
                staged_sizes.push_back(batch.body_len());
                stage(&mut staging, seq, batch, &merges);
                if take > 0 {
                    let limit = take * staged_sizes[0];
                    let left: usize = staged_sizes.iter().sum();
                    let taken = staging.take_oldest(limit);
                    proptest::prop_assert_eq!(taken.is_empty(), left <= limit);
                    for batch in &taken {
                        apply(&mut trees, &batch.messages);
                        staged_sizes.pop_front();
                    }
                }
                proptest::prop_assert_eq!(staging.batch_bytes, staged_sizes.iter().sum::<usize>());
                for key in 0u8..12 {
                    let want = everything.get(&key).cloned();
                    match staging.lookup(KeySpace::Meta, &[key]) {
                        StagedAnswer::Found(v) => proptest::prop_assert_eq!(v, want),
                        StagedAnswer::NotStaged => {
                            proptest::prop_assert_eq!(trees.get(&key).cloned(), want)
                        }
                        StagedAnswer::NeedsTrees => {}
                    }
                }
                // A range visit over the trees, in two leaves split at
                // `split`, with what is staged merged in: the keys of a
                // map that took everything.
                let (lo, hi) = (k.min(v % 13), k.max(v % 13));
                let split = lo + (hi - lo) / 2;
                let mut visited = Vec::new();
                let mut whole = true;
                for (from, end) in [(lo, split), (split, hi)] {
                    staging.order_keys(KeySpace::Meta);
                    let Some(overlay) = staging.overlay(KeySpace::Meta, &[from], Some(&[hi])) else {
                        whole = false;
                        break;
                    };
                    let mut visit = |k: &[u8], v: &[u8]| {
                        visited.push((k[0], v.to_vec()));
                        ControlFlow::Continue(())
                    };
                    let mut merge = overlay.merge(&mut visit);
                    for (key, value) in trees.range(from..end) {
                        let _ = merge.tree_pair(&[*key], value);
                    }
                    let _ = merge.finish((end < hi).then_some(&[end][..]));
                }
                if whole {
                    let want: Vec<_> = everything.range(lo..hi).map(|(k, v)| (*k, v.clone())).collect();
                    proptest::prop_assert_eq!(&visited, &want);
                    // A visit that breaks after `stop` pairs sees those
                    // and no more, staged or not, and says it stopped.
                    let stop = usize::from(v % 4) + 1;
                    staging.order_keys(KeySpace::Meta);
                    if let Some(overlay) = staging.overlay(KeySpace::Meta, &[lo], Some(&[hi])) {
                        let mut first = Vec::new();
                        let mut visit = |k: &[u8], v: &[u8]| {
                            first.push((k[0], v.to_vec()));
                            if first.len() == stop {
                                ControlFlow::Break(())
                            } else {
                                ControlFlow::Continue(())
                            }
                        };
                        let mut merge = overlay.merge(&mut visit);
                        let mut broke = false;
                        for (key, value) in trees.range(lo..hi) {
                            if merge.tree_pair(&[*key], value).is_break() {
                                broke = true;
                                break;
                            }
                        }
                        let finished = merge.finish(None);
                        proptest::prop_assert_eq!(finished.is_break(), want.len() >= stop);
                        proptest::prop_assert!(!broke || finished.is_break());
                        proptest::prop_assert_eq!(&first[..], &want[..stop.min(want.len())]);
                    }
                }
            }
            for batch in staging.take() {
                apply(&mut trees, &batch.messages);
            }
            proptest::prop_assert_eq!(trees, everything);
            proptest::prop_assert_eq!(staging.bytes(), 0);
        }

        /// Staged batches answer every key as a map that took the same
        /// puts and deletes does (keys the batches leave alone: not staged).
        #[test]
        fn staged_batches_answer_as_a_map(
            ops in proptest::collection::vec((0u8..16, proptest::option::of(0u8..255)), 1..200),
            per_batch in 1usize..8,
        ) {
            let merges = registry();
            let mut staging = Staging::new(1);
            let mut model: BTreeMap<u8, Option<u8>> = BTreeMap::new();
            for (i, chunk) in ops.chunks(per_batch).enumerate() {
                let mut batch = WriteBatch::new();
                for &(k, v) in chunk {
                    match v {
                        Some(v) => batch.put(KeySpace::Meta, &[k], &[v]),
                        None => batch.delete(KeySpace::Meta, &[k]),
                    };
                    model.insert(k, v);
                }
                stage(&mut staging, i as u64 + 1, batch, &merges);
            }
            for k in 0u8..16 {
                let expected = match model.get(&k) {
                    None => StagedAnswer::NotStaged,
                    Some(v) => StagedAnswer::Found(v.map(|v| vec![v])),
                };
                proptest::prop_assert_eq!(staging.lookup(KeySpace::Meta, &[k]), expected);
            }
        }
    }
}
