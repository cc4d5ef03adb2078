//! The point messages of a [`MessageBuffer`](crate::buffer::MessageBuffer):
//! a sorted map kept in chunks of at most [`CHUNK_POINTS`] messages, each
//! chunk shared copy-on-write.
//!
//! A checkpoint in flight keeps a copy of each interior node it has not
//! written yet, sharing the node's buffers, and the next change to a
//! shared buffer copies it. Copied whole, a root buffer of 20-36K small
//! metadata messages took 20-40 ms of a writer's request during an untar
//! (docs/design.md, "Buffers shared with a checkpoint"). A copy of a
//! `PointMap` copies its list of chunks; a change then copies the one
//! chunk it touches, a few hundred messages.
//!
//! Chunk `i` holds the keys in `[lo_i, lo_{i+1})`; the first chunk's `lo`
//! is empty (below every key), no chunk is empty, and `len` is the sum of
//! the chunks' lengths.

use std::collections::{btree_map, BTreeMap};
use std::fmt;
use std::ops::Bound;
use std::sync::Arc;

use crate::buffer::PointMsg;

/// The most messages a chunk holds: copying one on a change costs tens of
/// microseconds, and a buffer of 36K messages has ~100 of them to search
/// and to copy the list of.
pub const CHUNK_POINTS: usize = 512;

/// A chunk below this is merged into a neighbour where both fit in one.
const CHUNK_MERGE_BELOW: usize = CHUNK_POINTS / 4;

/// A range removal takes a chunk's keys out one by one while they are
/// fewer than 1/16 of the chunk's, and by splitting it beyond.
const REMOVE_ONE_BY_ONE_RATIO: usize = 16;

type Map = BTreeMap<Vec<u8>, PointMsg>;

#[derive(Clone)]
struct Chunk {
    /// The lowest key the chunk may hold (its first key, or less).
    lo: Vec<u8>,
    map: Arc<Map>,
}

/// A sorted map from key to [`PointMsg`] whose copies share chunks.
#[derive(Clone, Default)]
pub struct PointMap {
    chunks: Vec<Chunk>,
    len: usize,
}

impl PointMap {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunk whose range holds `key` (0 if there are none).
    fn chunk_index(&self, key: &[u8]) -> usize {
        self.chunks
            .partition_point(|c| c.lo.as_slice() <= key)
            .saturating_sub(1)
    }

    pub fn get(&self, key: &[u8]) -> Option<&PointMsg> {
        self.chunks.get(self.chunk_index(key))?.map.get(key)
    }

    pub fn contains_key(&self, key: &[u8]) -> bool {
        self.get(key).is_some()
    }

    pub fn first_key(&self) -> Option<&Vec<u8>> {
        self.chunks.first()?.map.keys().next()
    }

    pub fn last_key(&self) -> Option<&Vec<u8>> {
        self.chunks.last()?.map.keys().next_back()
    }

    pub fn iter(&self) -> Range<'_> {
        self.range((Bound::Unbounded, Bound::Unbounded))
    }

    pub fn keys(&self) -> impl Iterator<Item = &Vec<u8>> + '_ {
        self.iter().map(|(k, _)| k)
    }

    /// The messages with keys within the bounds, in key order.
    pub fn range(&self, (lower, upper): (Bound<&[u8]>, Bound<&[u8]>)) -> Range<'_> {
        if self.chunks.is_empty() || bounds_are_empty(lower, upper) {
            return Range::default();
        }
        let first = match lower {
            Bound::Included(k) | Bound::Excluded(k) => self.chunk_index(k),
            Bound::Unbounded => 0,
        };
        let last = match upper {
            Bound::Included(k) | Bound::Excluded(k) => self.chunk_index(k),
            Bound::Unbounded => self.chunks.len() - 1,
        };
        match (self.chunks.get(first), self.chunks.get(last)) {
            (Some(only), _) if first == last => Range {
                current: only.map.range::<[u8], _>((lower, upper)),
                middle: [].iter(),
                tail: None,
            },
            (Some(head), Some(tail)) if first < last => Range {
                current: head.map.range::<[u8], _>((lower, Bound::Unbounded)),
                middle: self.chunks.get(first + 1..last).unwrap_or_default().iter(),
                tail: Some(tail.map.range::<[u8], _>((Bound::Unbounded, upper))),
            },
            _ => Range::default(),
        }
    }

    /// Runs `f` on the map's entry for `key` (one search), the chunk
    /// holding it copied first if it is shared; chunks are split, merged
    /// or dropped after as their new size asks.
    pub fn update<R>(
        &mut self,
        key: Vec<u8>,
        f: impl FnOnce(btree_map::Entry<'_, Vec<u8>, PointMsg>) -> R,
    ) -> R {
        if self.chunks.is_empty() {
            self.chunks.push(Chunk {
                lo: Vec::new(),
                map: Arc::default(),
            });
        }
        let i = self.chunk_index(&key);
        let is_last = i + 1 == self.chunks.len();
        let Some(chunk) = self.chunks.get_mut(i) else {
            unreachable!("point map invariant: chunk_index names a chunk")
        };
        // Looked at only when the chunk may overflow.
        let appending = is_last
            && chunk.map.len() >= CHUNK_POINTS
            && chunk.map.keys().next_back().is_none_or(|last| *last < key);
        let map = Arc::make_mut(&mut chunk.map);
        let before = map.len();
        let result = f(map.entry(key));
        let after = map.len();
        self.len = self.len + after - before;
        if appending && after > CHUNK_POINTS {
            // Keys arriving in order (a node decoded, a buffer filled
            // sequentially): chunks stay full rather than half.
            self.split_chunk(i, CHUNK_POINTS);
        } else {
            self.settle_chunk(i);
        }
        result
    }

    /// The chunks that keys would go to, each once, in order.
    pub fn chunks_of<'k>(&self, keys: impl IntoIterator<Item = &'k [u8]>) -> Vec<usize> {
        let mut chunks: Vec<usize> = keys.into_iter().map(|k| self.chunk_index(k)).collect();
        chunks.sort_unstable();
        chunks.dedup();
        chunks
    }

    /// Copies the chunks named (from [`PointMap::chunks_of`] on this map
    /// as it is) that another copy shares, so that changing them later
    /// copies nothing.
    pub fn unshare_chunks(&mut self, chunks: &[usize]) {
        for &i in chunks {
            if let Some(chunk) = self.chunks.get_mut(i) {
                Arc::make_mut(&mut chunk.map);
            }
        }
    }

    /// The map of `messages`, which must be given in increasing key order
    /// (each key once), built a chunk at a time: a range rename re-keys every message
    /// of the buffers it moves, and inserting them one by one searched
    /// each chunk with compares of whole keys — most of the time of a `mv`
    /// of a source tree's root after an untar.
    pub fn from_sorted(messages: impl IntoIterator<Item = (Vec<u8>, PointMsg)>) -> PointMap {
        let mut map = PointMap::default();
        let mut run = Vec::with_capacity(CHUNK_POINTS);
        for message in messages {
            run.push(message);
            if run.len() == CHUNK_POINTS {
                map.push_chunk(std::mem::replace(
                    &mut run,
                    Vec::with_capacity(CHUNK_POINTS),
                ));
            }
        }
        map.push_chunk(run);
        map
    }

    /// The same messages under the keys `rekey` gives (called once per
    /// message with its key, to change in place), which must keep them
    /// distinct and in order — a range rename's change of one prefix for
    /// another does. Each chunk is rebuilt from its own messages: no
    /// list of them all, no key copied. A re-keying that reordered keys
    /// across chunks (a caller's bug, which debug builds refuse) is put
    /// right by taking the messages one by one.
    pub fn rekeyed(self, rekey: &mut dyn FnMut(Vec<u8>, &PointMsg) -> Vec<u8>) -> PointMap {
        let mut out = PointMap {
            chunks: Vec::with_capacity(self.chunks.len()),
            len: 0,
        };
        let mut in_order = true;
        for chunk in self.chunks {
            let old = Arc::unwrap_or_clone(chunk.map);
            let count = old.len();
            // Sorted within the chunk by the map itself whatever `rekey`
            // does; a collision would lose a message.
            let map: Map = old
                .into_iter()
                .map(|(key, msg)| (rekey(key, &msg), msg))
                .collect();
            assert_eq!(map.len(), count, "a re-keying made two keys one");
            if let (Some(last), Some(first)) = (out.last_key(), map.keys().next()) {
                in_order &= last < first;
            }
            out.push_chunk_map(map);
        }
        debug_assert!(in_order, "a re-keying reordered keys");
        if !in_order {
            let mut again = PointMap::default();
            for (key, msg) in out {
                again.insert(key, msg);
            }
            return again;
        }
        out
    }

    /// Appends a chunk of messages in increasing key order, all after
    /// this map's (at most [`CHUNK_POINTS`]).
    fn push_chunk(&mut self, run: Vec<(Vec<u8>, PointMsg)>) {
        let Some((first, _)) = run.first() else {
            return;
        };
        assert!(
            self.last_key().is_none_or(|last| last < first) && run.len() <= CHUNK_POINTS,
            "point map invariant: a chunk built from messages out of order or too many"
        );
        // Callers give keys in order: not compared again here but in
        // debug builds.
        debug_assert!(run.iter().zip(run.iter().skip(1)).all(|(a, b)| a.0 < b.0));
        self.push_chunk_map(run.into_iter().collect());
    }

    /// Appends `map` as the last chunk (nothing if it is empty); the
    /// caller sees to the order.
    fn push_chunk_map(&mut self, map: Map) {
        let Some(first) = map.keys().next() else {
            return;
        };
        let lo = if self.chunks.is_empty() {
            Vec::new()
        } else {
            first.clone()
        };
        self.len += map.len();
        self.chunks.push(Chunk {
            lo,
            map: Arc::new(map),
        });
    }

    /// Inserts a message, returning the one it replaced.
    pub fn insert(&mut self, key: Vec<u8>, msg: PointMsg) -> Option<PointMsg> {
        self.update(key, |entry| match entry {
            btree_map::Entry::Occupied(mut slot) => Some(std::mem::replace(slot.get_mut(), msg)),
            btree_map::Entry::Vacant(slot) => {
                slot.insert(msg);
                None
            }
        })
    }

    /// Removes the messages with keys in `[start, end)`, showing each to
    /// `removed` first. A chunk wholly inside goes without a copy; one cut
    /// loses its keys one by one when they are few, by splitting beyond.
    pub fn remove_range(
        &mut self,
        start: &[u8],
        end: &[u8],
        mut removed: impl FnMut(&[u8], &PointMsg),
    ) {
        if start >= end || self.chunks.is_empty() {
            return;
        }
        let inside = (Bound::Included(start), Bound::Excluded(end));
        let first = self.chunk_index(start);
        let mut i = first;
        // Forward, so that `removed` sees keys in order; a chunk dropped
        // leaves `i` on the next one.
        while let Some(chunk) = self.chunks.get_mut(i) {
            if chunk.lo.as_slice() >= end {
                break;
            }
            let mut count = 0;
            for (k, m) in chunk.map.range::<[u8], _>(inside) {
                removed(k, m);
                count += 1;
            }
            self.len -= count;
            if count == chunk.map.len() {
                self.chunks.remove(i);
                continue;
            }
            if count > 0 {
                let map = Arc::make_mut(&mut chunk.map);
                if count * REMOVE_ONE_BY_ONE_RATIO < map.len() {
                    let doomed: Vec<Vec<u8>> = map
                        .range::<[u8], _>(inside)
                        .map(|(k, _)| k.clone())
                        .collect();
                    for k in doomed {
                        map.remove(&k);
                    }
                } else {
                    let mut inside = map.split_off(start);
                    let mut after = inside.split_off(end);
                    map.append(&mut after);
                }
            }
            i += 1;
        }
        if let Some(c) = self.chunks.first_mut() {
            c.lo.clear();
        }
        // The chunks cut at either end may now be small.
        let at = first.min(self.chunks.len().saturating_sub(1));
        self.settle_chunk(at + 1);
        self.settle_chunk(at);
    }

    /// Splits off the messages at or after `pivot`.
    pub fn split_off(&mut self, pivot: &[u8]) -> PointMap {
        if self.chunks.is_empty() {
            return PointMap::default();
        }
        let i = self.chunk_index(pivot);
        let mut right = self.chunks.split_off(i + 1);
        if let Some(chunk) = self.chunks.last_mut() {
            if chunk
                .map
                .keys()
                .next()
                .is_some_and(|k| k.as_slice() >= pivot)
            {
                if let Some(whole) = self.chunks.pop() {
                    right.insert(0, whole);
                }
            } else if chunk
                .map
                .keys()
                .next_back()
                .is_some_and(|k| k.as_slice() >= pivot)
            {
                let part = Arc::make_mut(&mut chunk.map).split_off(pivot);
                right.insert(
                    0,
                    Chunk {
                        lo: pivot.to_vec(),
                        map: Arc::new(part),
                    },
                );
            }
        }
        if let Some(c) = right.first_mut() {
            c.lo.clear();
        }
        let right_len = right.iter().map(|c| c.map.len()).sum();
        self.len -= right_len;
        let mut right = PointMap {
            chunks: right,
            len: right_len,
        };
        // The chunk cut may now be small on either side.
        self.settle_chunk(self.chunks.len().saturating_sub(1));
        right.settle_chunk(0);
        right
    }

    /// Moves every message of `other`, a map over a key range disjoint
    /// from this one's (a sibling's buffer, a segment of a buffer read in
    /// part), into this map: cut where `other` begins, the three joined
    /// in key order.
    pub fn append(&mut self, other: PointMap) {
        let Some(first) = other.first_key() else {
            return;
        };
        if self.last_key().is_some_and(|last| last >= first) {
            let right = self.split_off(first);
            debug_assert!(
                right.first_key().is_none_or(|r| other.last_key() < Some(r)),
                "point map invariant: appended key ranges overlap"
            );
            self.append_after(other);
            self.append_after(right);
        } else {
            self.append_after(other);
        }
    }

    /// [`PointMap::append`] of a map whose keys all follow this one's: its
    /// chunks go after these.
    fn append_after(&mut self, mut other: PointMap) {
        let Some(first) = other.first_key().cloned() else {
            return;
        };
        if self.is_empty() {
            *self = other;
            return;
        }
        let joint = self.chunks.len();
        if let Some(c) = other.chunks.first_mut() {
            c.lo = first;
        }
        self.len += other.len;
        self.chunks.append(&mut other.chunks);
        self.settle_chunk(joint);
        self.settle_chunk(joint.saturating_sub(1));
    }

    /// Drops chunk `i` if empty, splits it if over [`CHUNK_POINTS`], merges
    /// it into a neighbour if small and both fit in one.
    fn settle_chunk(&mut self, i: usize) {
        let Some(len) = self.chunks.get(i).map(|c| c.map.len()) else {
            return;
        };
        if len == 0 {
            self.chunks.remove(i);
            if let Some(c) = self.chunks.first_mut() {
                c.lo.clear();
            }
        } else if len > CHUNK_POINTS {
            self.split_chunk(i, len / 2);
        } else if len < CHUNK_MERGE_BELOW {
            let neighbour_len = |j: usize| self.chunks.get(j).map(|c| c.map.len());
            if i > 0 && neighbour_len(i - 1).is_some_and(|n| n + len <= CHUNK_POINTS) {
                self.merge_into_previous(i);
            } else if neighbour_len(i + 1).is_some_and(|n| n + len <= CHUNK_POINTS) {
                self.merge_into_previous(i + 1);
            }
        }
    }

    /// Splits chunk `i` so that its first `keep` messages stay in it.
    fn split_chunk(&mut self, i: usize, keep: usize) {
        let Some(chunk) = self.chunks.get_mut(i) else {
            return;
        };
        let Some(pivot) = chunk.map.keys().nth(keep).cloned() else {
            return;
        };
        let right = Arc::make_mut(&mut chunk.map).split_off(&pivot);
        self.chunks.insert(
            i + 1,
            Chunk {
                lo: pivot,
                map: Arc::new(right),
            },
        );
    }

    /// Moves chunk `i`'s messages to chunk `i - 1` and drops chunk `i`.
    fn merge_into_previous(&mut self, i: usize) {
        if i == 0 || i >= self.chunks.len() {
            return;
        }
        let chunk = self.chunks.remove(i);
        let Some(previous) = self.chunks.get_mut(i - 1) else {
            return;
        };
        let mut moved = Arc::unwrap_or_clone(chunk.map);
        Arc::make_mut(&mut previous.map).append(&mut moved);
    }

    /// The chunks' sizes (tests check the invariants through it).
    #[cfg(test)]
    fn chunk_lens(&self) -> Vec<usize> {
        self.chunks.iter().map(|c| c.map.len()).collect()
    }

    /// Checks the invariants in the module comment.
    #[cfg(test)]
    pub(crate) fn check(&self) {
        assert_eq!(self.len, self.chunk_lens().iter().sum::<usize>());
        assert!(self.chunks.first().is_none_or(|c| c.lo.is_empty()));
        for (i, c) in self.chunks.iter().enumerate() {
            assert!(!c.map.is_empty(), "chunk {i} empty");
            assert!(c.map.len() <= CHUNK_POINTS, "chunk {i} over the bound");
            assert!(c.map.keys().all(|k| *k >= c.lo), "chunk {i} below its lo");
            if let Some(next) = self.chunks.get(i + 1) {
                assert!(c.lo < next.lo, "chunks {i} and {} out of order", i + 1);
                assert!(c.map.keys().all(|k| *k < next.lo), "chunk {i} past its end");
            }
        }
    }
}

/// Whether no key lies within the bounds; `BTreeMap::range` panics on
/// bounds like these.
fn bounds_are_empty(lower: Bound<&[u8]>, upper: Bound<&[u8]>) -> bool {
    match (lower, upper) {
        (Bound::Included(l), Bound::Included(u)) => l > u,
        (Bound::Included(l) | Bound::Excluded(l), Bound::Excluded(u))
        | (Bound::Excluded(l), Bound::Included(u)) => l >= u,
        _ => false,
    }
}

/// The messages of a [`PointMap`] within bounds, in key order.
pub struct Range<'a> {
    current: btree_map::Range<'a, Vec<u8>, PointMsg>,
    middle: std::slice::Iter<'a, Chunk>,
    tail: Option<btree_map::Range<'a, Vec<u8>, PointMsg>>,
}

impl Default for Range<'_> {
    fn default() -> Self {
        Range {
            current: btree_map::Range::default(),
            middle: [].iter(),
            tail: None,
        }
    }
}

impl<'a> Iterator for Range<'a> {
    type Item = (&'a Vec<u8>, &'a PointMsg);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(item) = self.current.next() {
                return Some(item);
            }
            self.current = match self.middle.next() {
                Some(chunk) => chunk.map.range::<[u8], _>(..),
                None => self.tail.take()?,
            };
        }
    }
}

impl<'a> IntoIterator for &'a PointMap {
    type Item = (&'a Vec<u8>, &'a PointMsg);
    type IntoIter = Range<'a>;

    fn into_iter(self) -> Range<'a> {
        self.iter()
    }
}

/// The messages of a [`PointMap`], moved out in key order (a chunk still
/// shared is copied).
pub struct IntoIter {
    current: btree_map::IntoIter<Vec<u8>, PointMsg>,
    rest: std::vec::IntoIter<Chunk>,
}

impl Iterator for IntoIter {
    type Item = (Vec<u8>, PointMsg);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(item) = self.current.next() {
                return Some(item);
            }
            self.current = Arc::unwrap_or_clone(self.rest.next()?.map).into_iter();
        }
    }
}

impl IntoIterator for PointMap {
    type Item = (Vec<u8>, PointMsg);
    type IntoIter = IntoIter;

    fn into_iter(self) -> IntoIter {
        IntoIter {
            current: btree_map::IntoIter::default(),
            rest: self.chunks.into_iter(),
        }
    }
}

impl PartialEq for PointMap {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for PointMap {}

impl fmt::Debug for PointMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u16),
        Remove(u16),
        RemoveRange(u16, u16),
        /// Split at a key, then put the two halves back together (in
        /// either order).
        SplitAndAppend(u16, bool),
        /// Cut out the keys in [a, a + n), put the rest back together,
        /// then the middle (a segment of a buffer read in part, loaded
        /// after its neighbours).
        AppendMiddleLast(u16, u16),
        /// Copy the map (sharing its chunks), change the copy, and check
        /// that the original is as it was.
        CopyAndChange(u16),
        /// Re-key a copy under a shorter or a longer prefix (a range
        /// rename's), check it and the original, then key it back.
        RekeyAndBack(bool),
    }

    fn key(k: u16) -> Vec<u8> {
        format!("key{k:05}").into_bytes()
    }

    fn msg(seq: u64) -> PointMsg {
        PointMsg::put(seq, seq.to_le_bytes().to_vec())
    }

    fn op() -> impl Strategy<Value = Op> {
        let k = 0u16..4000;
        prop_oneof![
            8 => k.clone().prop_map(Op::Insert),
            3 => k.clone().prop_map(Op::Remove),
            1 => (k.clone(), 0u16..800).prop_map(|(s, n)| Op::RemoveRange(s, s.saturating_add(n))),
            1 => (k.clone(), any::<bool>()).prop_map(|(p, b)| Op::SplitAndAppend(p, b)),
            1 => (k.clone(), 1u16..800).prop_map(|(a, n)| Op::AppendMiddleLast(a, n)),
            1 => k.prop_map(Op::CopyAndChange),
            1 => any::<bool>().prop_map(Op::RekeyAndBack),
        ]
    }

    /// A removal as a buffer's change makes it: through the entry.
    fn remove(map: &mut PointMap, key: &[u8]) -> Option<PointMsg> {
        map.update(key.to_vec(), |entry| match entry {
            btree_map::Entry::Occupied(slot) => Some(slot.remove()),
            btree_map::Entry::Vacant(_) => None,
        })
    }

    fn same(map: &PointMap, model: &BTreeMap<Vec<u8>, PointMsg>) {
        map.check();
        assert_eq!(map.len(), model.len());
        assert!(map.iter().eq(model.iter()));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The chunked map is the `BTreeMap` after the same operations,
        /// its invariants hold after each, ranges read the same, and a
        /// copy changed leaves the original as it was.
        #[test]
        fn a_point_map_is_the_btree_map_after_the_same_operations(
            ops in proptest::collection::vec(op(), 1..400),
            fill in 0u16..3000,
            fill_in_bulk in any::<bool>(),
        ) {
            let mut map = PointMap::default();
            let mut model = BTreeMap::new();
            // A sequential fill first: the appending path, or a map built
            // from messages in order (`from_sorted`, a range rename's).
            for k in 0..fill {
                if !fill_in_bulk {
                    map.insert(key(k * 2), msg(u64::from(k)));
                }
                model.insert(key(k * 2), msg(u64::from(k)));
            }
            if fill_in_bulk {
                map = PointMap::from_sorted(model.iter().map(|(k, m)| (k.clone(), m.clone())));
            }
            same(&map, &model);
            for (seq, op) in ops.into_iter().enumerate() {
                let seq = seq as u64 + 10_000;
                match op {
                    Op::Insert(k) => {
                        assert_eq!(map.insert(key(k), msg(seq)), model.insert(key(k), msg(seq)));
                    }
                    Op::Remove(k) => assert_eq!(remove(&mut map, &key(k)), model.remove(&key(k))),
                    Op::RemoveRange(s, e) => {
                        let (s, e) = (key(s), key(e));
                        let mut seen = Vec::new();
                        map.remove_range(&s, &e, |k, _| seen.push(k.to_vec()));
                        let mut gone = model.split_off(&s);
                        let mut kept = gone.split_off(&e);
                        model.append(&mut kept);
                        assert_eq!(seen, gone.into_keys().collect::<Vec<_>>());
                    }
                    Op::SplitAndAppend(p, right_first) => {
                        let mut right = map.split_off(&key(p));
                        let model_right = model.split_off(&key(p));
                        same(&right, &model_right);
                        same(&map, &model);
                        if right_first {
                            std::mem::swap(&mut map, &mut right);
                        }
                        map.append(right);
                        let mut model_right = model_right;
                        model.append(&mut model_right);
                    }
                    Op::AppendMiddleLast(a, n) => {
                        let mut middle = map.split_off(&key(a));
                        let right = middle.split_off(&key(a.saturating_add(n)));
                        map.append(right);
                        map.append(middle);
                    }
                    Op::CopyAndChange(k) => {
                        let original = model.clone();
                        let mut copy = map.clone();
                        copy.insert(key(k), msg(seq));
                        copy.remove_range(&key(k.saturating_add(1)), &key(k.saturating_add(300)), |_, _| ());
                        let _ = copy.split_off(&key(k.saturating_add(600)));
                        same(&map, &original);
                        // The copy goes on as the map.
                        let mut expected = original;
                        expected.insert(key(k), msg(seq));
                        let mut gone = expected.split_off(&key(k.saturating_add(1)));
                        let mut kept = gone.split_off(&key(k.saturating_add(300)));
                        expected.append(&mut kept);
                        let _ = expected.split_off(&key(k.saturating_add(600)));
                        same(&copy, &expected);
                        map = copy;
                        model = expected;
                    }
                    Op::RekeyAndBack(longer) => {
                        let prefix: &[u8] = if longer { b"a-longer-key" } else { b"k" };
                        let moved = map.clone().rekeyed(&mut |k, _| {
                            crate::message::with_prefix_replaced(k, 3, prefix)
                        });
                        moved.check();
                        same(&map, &model);
                        let expected: BTreeMap<Vec<u8>, PointMsg> = model
                            .iter()
                            .map(|(k, m)| ([prefix, &k[3..]].concat(), m.clone()))
                            .collect();
                        same(&moved, &expected);
                        map = moved.rekeyed(&mut |k, _| {
                            crate::message::with_prefix_replaced(k, prefix.len(), b"key")
                        });
                        map.check();
                    }
                }
                same(&map, &model);
                let (lo, hi) = (key(seq as u16 % 4000), key((seq as u16 % 4000).saturating_add(700)));
                let bounds = (Bound::Included(lo.as_slice()), Bound::Excluded(hi.as_slice()));
                assert!(map.range(bounds).eq(model.range::<[u8], _>(bounds)));
                let bounds = (Bound::Excluded(lo.as_slice()), Bound::Included(hi.as_slice()));
                assert!(map.range(bounds).eq(model.range::<[u8], _>(bounds)));
                assert_eq!(map.first_key(), model.keys().next());
                assert_eq!(map.last_key(), model.keys().next_back());
            }
            assert!(map.into_iter().eq(model));
        }
    }

    /// A change to a copy copies one chunk, not the map: the copy and the
    /// original go on sharing every other chunk.
    #[test]
    fn a_change_to_a_copy_copies_one_chunk() {
        let mut map = PointMap::default();
        for k in 0..4000 {
            map.insert(key(k), msg(u64::from(k)));
        }
        let mut copy = map.clone();
        copy.insert(key(1234), msg(1));
        let shared = map
            .chunks
            .iter()
            .zip(&copy.chunks)
            .filter(|(a, b)| Arc::ptr_eq(&a.map, &b.map))
            .count();
        assert_eq!(map.chunk_lens().len(), copy.chunk_lens().len());
        assert_eq!(
            shared,
            map.chunks.len() - 1,
            "chunks {:?}",
            map.chunk_lens()
        );
        // Filled in order: full chunks.
        assert!(map
            .chunk_lens()
            .iter()
            .rev()
            .skip(1)
            .all(|&n| n == CHUNK_POINTS));
    }
}
