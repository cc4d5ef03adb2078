//! The message buffer an interior node keeps for each child.
//!
//! Every message in a child's buffer is newer than everything below that
//! child, and a batch flushed in from the parent is newer than everything
//! already here. That makes PacMan (BetrFS 0.6 §4) exact and cheap:
//! - a put or delete replaces any older message for its key;
//! - a range delete eats every older point message in its range and
//!   coalesces with overlapping or adjacent range deletes (they commute);
//! - an upsert meeting a put, a delete or a covering range delete is folded
//!   into a put at once.
//!
//! So for each key a buffer holds at most one [`PointMsg`], and any point
//! message in a range delete's range is newer than that range delete: the
//! buffer applies its range deletes first, then its point messages.

use std::collections::{btree_map, BTreeMap};
use std::ops::Bound;
use std::sync::Arc;

use bytes::Bytes;

use crate::merge::MergeRegistry;
use crate::point_map::PointMap;

/// A put or delete, the "base" that hides everything older for its key.
///
/// Values and upsert arguments are shared bytes ([`Bytes`]): a buffer
/// shared copy-on-write with a checkpoint's copy of its node is copied
/// when it next changes, and the copy then takes its keys and the map's
/// nodes, not its values (a 2 MiB buffer of 4 KiB blocks copied its
/// values in 10-17 ms under the tree lock during an untar).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Base {
    Put { seq: u64, value: Bytes },
    Delete { seq: u64 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upsert {
    pub seq: u64,
    pub func: u8,
    pub arg: Bytes,
}

/// All pending messages for one key: an optional base, then upserts in
/// sequence order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PointMsg {
    pub base: Option<Base>,
    pub upserts: Vec<Upsert>,
}

/// A pending range delete of [start, end); `start` is its map key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeDel {
    pub end: Vec<u8>,
    pub seq: u64,
}

/// How much one flush of part of a buffer moves
/// ([`MessageBuffer::take_first`]): about `bytes` bytes, no more than
/// `points` point messages, and nothing at or past `before`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartLimit<'a> {
    pub bytes: usize,
    pub points: usize,
    pub before: Option<&'a [u8]>,
}

impl PartLimit<'static> {
    /// The whole buffer.
    pub const ALL: PartLimit<'static> = PartLimit::bytes(usize::MAX);

    /// About `bytes` bytes, however many messages that is.
    pub const fn bytes(bytes: usize) -> PartLimit<'static> {
        PartLimit {
            bytes,
            points: usize::MAX,
            before: None,
        }
    }
}

/// Where a part of a buffer ends ([`MessageBuffer::part_cut`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartCut {
    /// The part is the whole buffer.
    Whole,
    /// The part is the messages below `key`; its point messages make
    /// `point_bytes`.
    Below { key: Vec<u8>, point_bytes: usize },
}

/// A part of a buffer, borrowed ([`MessageBuffer::part`]): its range
/// deletes, sorted and disjoint, as (start, end), and its point messages,
/// those of `points` below `below` (all of them when None).
pub struct BufferPart<'a> {
    pub ranges: Vec<(&'a [u8], &'a [u8])>,
    pub points: &'a PointMap,
    pub below: Option<&'a [u8]>,
}

impl BufferPart<'_> {
    /// Its point messages and range deletes, counted as
    /// [`MessageBuffer::message_count`] counts them.
    pub fn message_count(&self) -> usize {
        let upper = self.below.map_or(Bound::Unbounded, Bound::Excluded);
        self.points.range((Bound::Unbounded, upper)).count() + self.ranges.len()
    }
}

/// Per-message overhead counted in buffer sizes (tag, lengths, sequence
/// number), close to what the message takes on disk.
pub const MESSAGE_OVERHEAD_BYTES: usize = 16;

impl PointMsg {
    pub fn put(seq: u64, value: Vec<u8>) -> PointMsg {
        PointMsg {
            base: Some(Base::Put {
                seq,
                value: value.into(),
            }),
            upserts: Vec::new(),
        }
    }
    pub fn delete(seq: u64) -> PointMsg {
        PointMsg {
            base: Some(Base::Delete { seq }),
            upserts: Vec::new(),
        }
    }
    pub fn upsert(seq: u64, func: u8, arg: Vec<u8>) -> PointMsg {
        PointMsg {
            base: None,
            upserts: vec![Upsert {
                seq,
                func,
                arg: arg.into(),
            }],
        }
    }

    pub fn bytes(&self, key_len: usize) -> usize {
        let base = match &self.base {
            Some(Base::Put { value, .. }) => value.len(),
            _ => 0,
        };
        let upserts: usize = self.upserts.iter().map(|u| u.arg.len() + 10).sum();
        key_len + base + upserts + MESSAGE_OVERHEAD_BYTES
    }

    /// Applies this message to the value below it. `Err(id)` names a merge
    /// function the registry does not know.
    pub fn apply(&self, old: Option<&[u8]>, merges: &MergeRegistry) -> Result<Option<Vec<u8>>, u8> {
        let start = match &self.base {
            Some(Base::Put { value, .. }) => Some(value.to_vec()),
            Some(Base::Delete { .. }) => None,
            None => old.map(|v| v.to_vec()),
        };
        fold_upserts(&self.upserts, start, merges)
    }

    /// [`PointMsg::apply`] for a message the caller owns: the put's value is
    /// moved, not copied.
    pub fn into_value(
        self,
        old: Option<Vec<u8>>,
        merges: &MergeRegistry,
    ) -> Result<Option<Vec<u8>>, u8> {
        let start = match self.base {
            // Without a copy when the buffer held the only reference.
            Some(Base::Put { value, .. }) => Some(Vec::from(value)),
            Some(Base::Delete { .. }) => None,
            None => old,
        };
        fold_upserts(&self.upserts, start, merges)
    }

    /// Whether the value below this message is irrelevant.
    pub fn hides_older(&self) -> bool {
        self.base.is_some()
    }

    fn newest_seq(&self) -> u64 {
        let base = match &self.base {
            Some(Base::Put { seq, .. }) | Some(Base::Delete { seq }) => *seq,
            None => 0,
        };
        self.upserts.last().map_or(base, |u| u.seq.max(base))
    }

    /// Folds upserts into the base when every merge function is known.
    fn collapse(&mut self, merges: &MergeRegistry) {
        if self.base.is_none() || self.upserts.is_empty() {
            return;
        }
        let seq = self.newest_seq();
        if let Ok(Some(value)) = self.apply(None, merges) {
            self.base = Some(Base::Put {
                seq,
                value: value.into(),
            });
            self.upserts.clear();
        }
    }
}

/// Applies upserts, oldest first, to a value.
fn fold_upserts(
    upserts: &[Upsert],
    mut value: Option<Vec<u8>>,
    merges: &MergeRegistry,
) -> Result<Option<Vec<u8>>, u8> {
    for u in upserts {
        value = Some(
            merges
                .apply(u.func, value.as_deref(), &u.arg)
                .ok_or(u.func)?,
        );
    }
    Ok(value)
}

/// The bytes of point messages, as buffers count them.
fn points_bytes<'a>(points: impl Iterator<Item = (&'a Vec<u8>, &'a PointMsg)>) -> usize {
    points.map(|(k, m)| m.bytes(k.len())).sum()
}

/// The bytes of range deletes, as buffers count them.
fn range_bytes(ranges: &BTreeMap<Vec<u8>, RangeDel>) -> usize {
    ranges
        .iter()
        .map(|(s, r)| s.len() + r.end.len() + MESSAGE_OVERHEAD_BYTES)
        .sum()
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MessageBuffer {
    /// Chunks shared copy-on-write with copies of the buffer.
    points: PointMap,
    /// Shared with copies of the buffer until one of them changes it.
    ranges: Arc<BTreeMap<Vec<u8>, RangeDel>>,
    bytes: usize,
}

impl MessageBuffer {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.points.is_empty() && self.ranges.is_empty()
    }
    pub fn message_count(&self) -> usize {
        self.points.len() + self.ranges.len()
    }
    /// The lowest key a message of the buffer concerns (a point's, or
    /// where a range delete begins).
    pub fn first_key(&self) -> Option<&[u8]> {
        let point = self.points.first_key().map(Vec::as_slice);
        let range = self.ranges.keys().next().map(Vec::as_slice);
        match (point, range) {
            (Some(p), Some(r)) => Some(p.min(r)),
            (p, r) => p.or(r),
        }
    }

    pub fn points(&self) -> &PointMap {
        &self.points
    }
    /// Copies the chunks of point messages named that another copy of the
    /// buffer shares ([`PointMap::unshare_chunks`]).
    pub fn unshare_point_chunks(&mut self, chunks: &[usize]) {
        self.points.unshare_chunks(chunks)
    }
    pub fn ranges(&self) -> &BTreeMap<Vec<u8>, RangeDel> {
        &self.ranges
    }

    /// Bytes of the point messages for keys in [lo, hi).
    pub fn point_bytes_in(&self, lo: &[u8], hi: &[u8]) -> usize {
        if lo >= hi {
            return 0;
        }
        self.points
            .range((Bound::Included(lo), Bound::Excluded(hi)))
            .map(|(k, m)| m.bytes(k.len()))
            .sum()
    }

    /// The range delete covering `key`, if any.
    pub fn covering(&self, key: &[u8]) -> Option<(&Vec<u8>, &RangeDel)> {
        self.ranges
            .range::<[u8], _>((Bound::Unbounded, Bound::Included(key)))
            .next_back()
            .filter(|(_, r)| r.end.as_slice() > key)
    }

    /// Adds a range delete newer than everything in the buffer. Returns how
    /// many older messages it ate.
    pub fn insert_range_delete(&mut self, start: Vec<u8>, end: Vec<u8>, seq: u64) -> usize {
        if start >= end {
            return 0;
        }
        let mut eaten = 0;
        let mut freed = 0;
        self.points.remove_range(&start, &end, |k, m| {
            eaten += 1;
            freed += m.bytes(k.len());
        });
        self.bytes -= freed;
        let (mut new_start, mut new_end, mut new_seq) = (start, end, seq);
        let touching: Vec<Vec<u8>> = self
            .ranges
            .range::<[u8], _>((Bound::Unbounded, Bound::Included(new_end.as_slice())))
            .rev()
            .take_while(|(_, r)| r.end >= new_start)
            .map(|(s, _)| s.clone())
            .collect();
        for s in touching {
            if let Some(r) = Arc::make_mut(&mut self.ranges).remove(&s) {
                self.bytes -= s.len() + r.end.len() + MESSAGE_OVERHEAD_BYTES;
                eaten += 1;
                if s < new_start {
                    new_start = s;
                }
                if r.end > new_end {
                    new_end = r.end;
                }
                new_seq = new_seq.max(r.seq);
            }
        }
        self.bytes += new_start.len() + new_end.len() + MESSAGE_OVERHEAD_BYTES;
        Arc::make_mut(&mut self.ranges).insert(
            new_start,
            RangeDel {
                end: new_end,
                seq: new_seq,
            },
        );
        eaten
    }

    /// Adds a point message newer than everything in the buffer. Returns how
    /// many older messages it made obsolete.
    pub fn insert_point(&mut self, key: Vec<u8>, msg: PointMsg, merges: &MergeRegistry) -> usize {
        let key_len = key.len();
        let covering_seq = self.covering(&key).map(|(_, r)| r.seq);
        // One search of the map, whatever the case: this runs for every
        // message a write or a flush puts in a buffer.
        let bytes = &mut self.bytes;
        self.points.update(key, |entry| match entry {
            btree_map::Entry::Occupied(mut slot) => {
                let old = slot.get_mut();
                if !msg.hides_older() && old.base.is_none() {
                    // Upserts piling up on a key with nothing below them in
                    // this buffer (a hot counter): append, and account only
                    // for what was added, so that each insert stays O(1)
                    // however long the chain grows.
                    *bytes += msg.upserts.iter().map(|u| u.arg.len() + 10).sum::<usize>();
                    old.upserts.extend(msg.upserts);
                    return 1;
                }
                *bytes -= old.bytes(key_len);
                let mut entry = if msg.hides_older() {
                    msg
                } else {
                    let mut merged = std::mem::take(old);
                    merged.upserts.extend(msg.upserts);
                    merged
                };
                entry.collapse(merges);
                *bytes += entry.bytes(key_len);
                *old = entry;
                1
            }
            btree_map::Entry::Vacant(slot) => {
                let mut fresh = msg;
                if let (None, Some(seq)) = (&fresh.base, covering_seq) {
                    // Everything below is deleted: the upserts start from nothing.
                    fresh.base = Some(Base::Delete { seq });
                }
                fresh.collapse(merges);
                *bytes += fresh.bytes(key_len);
                slot.insert(fresh);
                0
            }
        })
    }

    /// Adds the messages of a buffer over a disjoint key range (a sibling's).
    pub fn absorb_disjoint(&mut self, other: MessageBuffer) {
        debug_assert!(other.points.keys().all(|k| !self.points.contains_key(k)));
        self.bytes += other.bytes;
        self.points.append(other.points);
        let mut ranges = Arc::unwrap_or_clone(other.ranges);
        Arc::make_mut(&mut self.ranges).append(&mut ranges);
    }

    /// Takes the messages below a key chosen so that about `limit.bytes`
    /// bytes, and at most `limit.points` point messages, go, and none at
    /// or past `limit.before`, leaving the rest (a range delete straddling
    /// the key is cut in two); the whole buffer when it is within all
    /// three or no point lies past the cut. Background flushing moves a
    /// large buffer down in such parts, one per turn of the tree lock, and
    /// a writer's settling one per step.
    pub fn take_first(&mut self, limit: PartLimit<'_>) -> MessageBuffer {
        let cut = self.part_cut(limit);
        self.take_part(cut)
    }

    /// Takes the part `cut` ends ([`MessageBuffer::part_cut`] on this
    /// buffer as it is) out of the buffer.
    pub fn take_part(&mut self, cut: PartCut) -> MessageBuffer {
        match cut {
            PartCut::Whole => std::mem::take(self),
            PartCut::Below { key, point_bytes } => {
                let rest = self.split_counted(&key, Some(point_bytes));
                std::mem::replace(self, rest)
            }
        }
    }

    /// Where [`MessageBuffer::take_first`] with `limit` cuts this buffer,
    /// without taking anything: a step's merge into a leaf is worked out
    /// from the buffer as it stands ([`MessageBuffer::part`]) before the
    /// step takes the same part out.
    pub fn part_cut(&self, limit: PartLimit<'_>) -> PartCut {
        assert!(limit.points > 0, "a part of no point messages");
        let before = limit.before;
        // Range deletes coalesce: the last one ends past every other.
        let within_before = before.is_none_or(|b| {
            self.points.last_key().is_none_or(|k| k.as_slice() < b)
                && self
                    .ranges
                    .values()
                    .next_back()
                    .is_none_or(|r| r.end.as_slice() <= b)
        });
        if self.bytes <= limit.bytes && self.points.len() <= limit.points && within_before {
            return PartCut::Whole;
        }
        let (mut taken, mut count) = (0, 0);
        let cut = self.points.iter().find_map(|(key, msg)| {
            let past = before.is_some_and(|b| key.as_slice() >= b);
            if taken >= limit.bytes || count >= limit.points || past {
                return Some(key.clone());
            }
            taken += msg.bytes(key.len());
            count += 1;
            None
        });
        // Every point below `before`, a range delete past it: cut there.
        let cut = cut.or_else(|| before.filter(|_| !within_before).map(<[u8]>::to_vec));
        match cut {
            Some(key) => PartCut::Below {
                key,
                point_bytes: taken,
            },
            None => PartCut::Whole,
        }
    }

    /// The messages of the part `cut` marks ([`MessageBuffer::part_cut`]),
    /// borrowed: the range deletes as (start, end) with the one straddling
    /// the cut ended there, as [`MessageBuffer::take_first`] would leave
    /// them, and the bound below which the part's point messages lie.
    pub fn part<'a>(&'a self, cut: &'a PartCut) -> BufferPart<'a> {
        let below = match cut {
            PartCut::Whole => None,
            PartCut::Below { key, .. } => Some(key.as_slice()),
        };
        let upper = below.map_or(Bound::Unbounded, Bound::Excluded);
        let ranges = self
            .ranges
            .range::<[u8], _>((Bound::Unbounded, upper))
            .map(|(start, r)| {
                let end = match below {
                    Some(cut) if r.end.as_slice() > cut => cut,
                    _ => r.end.as_slice(),
                };
                (start.as_slice(), end)
            })
            .collect();
        BufferPart {
            ranges,
            points: &self.points,
            below,
        }
    }

    /// Splits off the messages at or after `pivot` (range deletes straddling
    /// it are cut in two).
    pub fn split_off(&mut self, pivot: &[u8]) -> MessageBuffer {
        self.split_counted(pivot, None)
    }

    /// [`MessageBuffer::split_off`], given the bytes of the points below
    /// `pivot` if the caller counted them; otherwise the side with fewer
    /// points is counted and the other is the rest. Counting every message
    /// of both sides again took milliseconds of a flush's hold of the tree
    /// lock (a quarter node taken from a buffer of 30K messages).
    fn split_counted(&mut self, pivot: &[u8], left_points: Option<usize>) -> MessageBuffer {
        let all_points = self.point_bytes();
        let mut right = MessageBuffer {
            points: self.points.split_off(pivot),
            ranges: Arc::new(Arc::make_mut(&mut self.ranges).split_off(pivot)),
            bytes: 0,
        };
        if let Some((start, r)) = Arc::make_mut(&mut self.ranges).iter_mut().next_back() {
            if r.end.as_slice() > pivot {
                let right_end = std::mem::replace(&mut r.end, pivot.to_vec());
                let seq = r.seq;
                debug_assert!(start.as_slice() < pivot);
                Arc::make_mut(&mut right.ranges).insert(
                    pivot.to_vec(),
                    RangeDel {
                        end: right_end,
                        seq,
                    },
                );
            }
        }
        let left_points = left_points.unwrap_or_else(|| {
            if self.points.len() <= right.points.len() {
                points_bytes(self.points.iter())
            } else {
                all_points - points_bytes(right.points.iter())
            }
        });
        self.bytes = left_points + range_bytes(&self.ranges);
        right.bytes = all_points - left_points + range_bytes(&right.ranges);
        debug_assert_eq!(self.bytes, self.counted_bytes());
        debug_assert_eq!(right.bytes, right.counted_bytes());
        right
    }

    /// The bytes of the point messages (the buffer's less its range
    /// deletes', which are few).
    fn point_bytes(&self) -> usize {
        self.bytes - range_bytes(&self.ranges)
    }

    /// The buffer's bytes counted message by message.
    fn counted_bytes(&self) -> usize {
        points_bytes(self.points.iter()) + range_bytes(&self.ranges)
    }

    /// Whether any message concerns a key of [lo, hi).
    pub fn touches(&self, lo: &[u8], hi: &[u8]) -> bool {
        let inside = (Bound::Included(lo), Bound::Excluded(hi));
        self.points.range(inside).next().is_some()
            || self.covering(lo).is_some()
            || self.ranges.range::<[u8], _>(inside).next().is_some()
    }

    /// The same messages under other keys, each changed in place by
    /// `rekey`, which must keep them distinct and in order (a range
    /// rename's mapping of one prefix to another does).
    pub fn rekeyed(self, rekey: impl Fn(Vec<u8>) -> Vec<u8>) -> MessageBuffer {
        let mut out = MessageBuffer::default();
        for (start, r) in Arc::unwrap_or_clone(self.ranges) {
            let end = rekey(r.end);
            out.push_decoded_range(rekey(start), RangeDel { end, seq: r.seq });
        }
        let mut point_bytes = 0;
        out.points = self.points.rekeyed(&mut |key, msg| {
            let key = rekey(key);
            point_bytes += msg.bytes(key.len());
            key
        });
        out.bytes += point_bytes;
        out
    }

    /// Puts point messages given in increasing key order (each key once)
    /// into this buffer, which has none: its chunks built a chunk at a
    /// time (`PointMap::from_sorted`), not with a search of whole-key
    /// compares per message. A node's segments are decoded this way
    /// (a range rename's moved buffers are re-keyed chunk by chunk,
    /// `PointMap::rekeyed`). Messages out of order
    /// (which debug builds refuse) are inserted one by one.
    pub(crate) fn put_points_in_order(&mut self, points: Vec<(Vec<u8>, PointMsg)>) {
        debug_assert!(
            self.points.is_empty(),
            "points put in order into a buffer that has some"
        );
        let in_order = points
            .iter()
            .zip(points.iter().skip(1))
            .all(|(a, b)| a.0 < b.0);
        debug_assert!(in_order, "point messages out of order");
        if !in_order || !self.points.is_empty() {
            for (key, msg) in points {
                self.push_decoded_point(key, msg);
            }
            return;
        }
        self.bytes += points.iter().map(|(k, m)| m.bytes(k.len())).sum::<usize>();
        self.points = PointMap::from_sorted(points);
    }

    /// Takes every message out, leaving the buffer empty.
    pub fn take(&mut self) -> MessageBuffer {
        std::mem::take(self)
    }

    /// Whether a range delete in this buffer covers all of [lo, hi)
    /// (`hi == None` means unbounded, which no range delete covers).
    pub fn covers_whole(&self, lo: &[u8], hi: Option<&[u8]>) -> bool {
        let Some(hi) = hi else { return false };
        self.covering(lo)
            .is_some_and(|(_, r)| r.end.as_slice() >= hi)
    }

    /// Inserts decoded messages (node deserialisation) without PacMan.
    pub(crate) fn push_decoded_point(&mut self, key: Vec<u8>, msg: PointMsg) {
        self.bytes += msg.bytes(key.len());
        self.points.insert(key, msg);
    }

    pub(crate) fn push_decoded_range(&mut self, start: Vec<u8>, r: RangeDel) {
        self.bytes += start.len() + r.end.len() + MESSAGE_OVERHEAD_BYTES;
        Arc::make_mut(&mut self.ranges).insert(start, r);
    }

    /// Consumes the buffer into its ranges and points.
    pub fn into_parts(self) -> (BTreeMap<Vec<u8>, RangeDel>, PointMap) {
        (Arc::unwrap_or_clone(self.ranges), self.points)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge::{patch_arg, MERGE_PATCH};

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    /// A re-keyed buffer holds the same messages under the new keys, in
    /// chunks built in order, and counts the bytes a buffer that took them
    /// one by one does.
    #[test]
    fn a_rekeyed_buffer_is_the_messages_under_their_new_keys() {
        let merges = crate::merge::MergeRegistry::default();
        let mut old = MessageBuffer::default();
        for i in 0..1500u64 {
            old.insert_point(
                k(&format!("a/{i:05}")),
                PointMsg::put(i + 10, vec![i as u8; 3]),
                &merges,
            );
        }
        old.insert_range_delete(k("a/00100"), k("a/00200"), 5);
        let rekey = |key: &[u8]| [&b"bb/"[..], key.get(2..).unwrap_or_default()].concat();
        let mut want = MessageBuffer::default();
        for (key, msg) in old.points().iter() {
            want.push_decoded_point(rekey(key), msg.clone());
        }
        for (start, r) in old.ranges() {
            want.push_decoded_range(
                rekey(start),
                RangeDel {
                    end: rekey(&r.end),
                    seq: r.seq,
                },
            );
        }
        let got = old.rekeyed(|key| rekey(&key));
        got.points().check();
        assert!(got.points().iter().eq(want.points().iter()));
        assert_eq!(got.ranges(), want.ranges());
        assert_eq!(got.bytes(), want.bytes());
        // The range delete took the hundred points it covers.
        assert_eq!(got.points().len(), 1400);
    }

    /// A copy of a buffer (what a change makes of a buffer a checkpoint's
    /// copy of the node shares) shares its values and upsert arguments.
    #[test]
    fn a_copied_buffer_shares_its_values() {
        let merges = MergeRegistry::default();
        let mut buf = MessageBuffer::default();
        buf.insert_point(k("a"), PointMsg::put(1, vec![7; 4096]), &merges);
        buf.insert_point(
            k("b"),
            PointMsg::upsert(2, MERGE_PATCH, patch_arg(0, b"xy")),
            &merges,
        );
        let copy = buf.clone();
        let shared = |key: &str| {
            let (a, b) = (
                buf.points().get(&k(key)).unwrap(),
                copy.points().get(&k(key)).unwrap(),
            );
            match (&a.base, &b.base) {
                (Some(Base::Put { value: x, .. }), Some(Base::Put { value: y, .. })) => {
                    x.as_ptr() == y.as_ptr()
                }
                _ => a.upserts[0].arg.as_ptr() == b.upserts[0].arg.as_ptr(),
            }
        };
        assert!(shared("a") && shared("b"));
    }

    /// What [`MessageBuffer::part`] describes of the cut `limit` makes is
    /// what [`MessageBuffer::take_first`] with it takes: the same range
    /// deletes, ends cut alike, and the same point messages.
    fn assert_part_is_what_is_taken(b: &MessageBuffer, limit: PartLimit<'_>) {
        let cut = b.part_cut(limit);
        let part = b.part(&cut);
        let taken = b.clone().take_first(limit);
        let described: Vec<_> = part
            .ranges
            .iter()
            .map(|(s, e)| (s.to_vec(), e.to_vec()))
            .collect();
        let ranges: Vec<_> = taken
            .ranges()
            .iter()
            .map(|(s, r)| (s.clone(), r.end.clone()))
            .collect();
        assert_eq!(described, ranges);
        let upper = part.below.map_or(Bound::Unbounded, Bound::Excluded);
        let described: Vec<_> = part.points.range((Bound::Unbounded, upper)).collect();
        let points: Vec<_> = taken.points().iter().collect();
        assert_eq!(described, points);
        assert_eq!(part.message_count(), taken.message_count());
    }

    /// A part taken from the front holds the lowest keys, about the bytes
    /// asked for; the parts together are the buffer, a range delete
    /// straddling a cut is cut in two, and a small buffer goes whole.
    #[test]
    fn parts_taken_from_the_front_split_the_buffer_by_key() {
        let merges = MergeRegistry::default();
        let mut b = MessageBuffer::default();
        let put = |b: &mut MessageBuffer, i: u32, seq: u64| {
            let key = format!("k{i:04}").into_bytes();
            b.insert_point(key, PointMsg::put(seq, vec![1; 100]), &merges);
        };
        for i in 0..100 {
            put(&mut b, i, u64::from(i));
        }
        // Deletes k0040..k0059; k0045..k0049 are written again after it.
        b.insert_range_delete(k("k0040"), k("k0060"), 200);
        for i in 45..50 {
            put(&mut b, i, 300 + u64::from(i));
        }
        let whole = b.clone();
        let mut few = b.clone();
        let seven_limit = PartLimit {
            points: 7,
            ..PartLimit::ALL
        };
        assert_part_is_what_is_taken(&few, seven_limit);
        let seven = few.take_first(seven_limit);
        assert_eq!(seven.points().len(), 7);
        assert_eq!(seven.bytes() + few.bytes(), whole.bytes());
        let per_point = PointMsg::put(0, vec![1; 100]).bytes(5);
        assert_part_is_what_is_taken(&b, PartLimit::bytes(30 * per_point));
        let first = b.take_first(PartLimit::bytes(30 * per_point));
        let keys = |b: &MessageBuffer| b.points().keys().cloned().collect::<Vec<_>>();
        assert_eq!(
            keys(&first),
            (0..30)
                .map(|i| format!("k{i:04}").into_bytes())
                .collect::<Vec<_>>()
        );
        assert!(first.ranges().is_empty());
        // k0030..k0039, k0045, k0046: the cut falls at k0047, inside the
        // range delete.
        assert_part_is_what_is_taken(&b, PartLimit::bytes(12 * per_point));
        let second = b.take_first(PartLimit::bytes(12 * per_point));
        assert_eq!(second.points().len(), 12);
        let range = |b: &MessageBuffer| {
            b.ranges()
                .iter()
                .map(|(s, r)| (s.clone(), r.end.clone(), r.seq))
                .collect::<Vec<_>>()
        };
        assert_eq!(range(&second), vec![(k("k0040"), k("k0047"), 200)]);
        assert_eq!(range(&b), vec![(k("k0047"), k("k0060"), 200)]);
        assert_eq!(keys(&b).first(), Some(&k("k0047")));
        assert_part_is_what_is_taken(&b, PartLimit::ALL);
        let rest = b.take_first(PartLimit::ALL);
        assert!(b.is_empty() && b.bytes() == 0);
        for part in [&first, &second, &rest] {
            assert_eq!(part.bytes(), part.counted_bytes());
        }
        let mut rejoined = first;
        rejoined.absorb_disjoint(second);
        rejoined.absorb_disjoint(rest);
        assert_eq!(rejoined.points(), whole.points());
        // No message at or past `before`: the cut falls there, inside the
        // range delete.
        let mut above = whole.clone();
        let before_k0047 = PartLimit {
            before: Some(&k("k0047")),
            ..PartLimit::ALL
        };
        assert_part_is_what_is_taken(&above, before_k0047);
        let below = above.take_first(before_k0047);
        assert_eq!(keys(&below).last(), Some(&k("k0046")));
        assert_eq!(keys(&above).first(), Some(&k("k0047")));
        assert_eq!(range(&below), vec![(k("k0040"), k("k0047"), 200)]);
        assert_eq!(range(&above), vec![(k("k0047"), k("k0060"), 200)]);
        for part in [&below, &above] {
            assert_eq!(part.bytes(), part.counted_bytes());
        }
        // Every point below it, a range delete past it: cut all the same.
        let mut ranged = MessageBuffer::default();
        ranged.insert_range_delete(k("a"), k("z"), 1);
        let before_m = PartLimit {
            before: Some(&k("m")),
            ..PartLimit::ALL
        };
        assert_part_is_what_is_taken(&ranged, before_m);
        let part = ranged.take_first(before_m);
        assert_eq!(range(&part), vec![(k("a"), k("m"), 1)]);
        assert_eq!(range(&ranged), vec![(k("m"), k("z"), 1)]);
    }

    /// A range delete eats the points it covers, whether few (removed one
    /// by one) or many (the map split): same messages, same byte count.
    #[test]
    fn range_deletes_of_few_and_many_points() {
        let merges = MergeRegistry::default();
        let mut b = MessageBuffer::default();
        for i in 0..200u32 {
            let key = format!("k{i:04}").into_bytes();
            b.insert_point(
                key,
                PointMsg::put(u64::from(i), vec![7; (i % 13) as usize]),
                &merges,
            );
        }
        // 3 of 200: one by one.
        assert_eq!(b.insert_range_delete(k("k0010"), k("k0013"), 300), 3);
        // 150 of 197: by splitting.
        assert_eq!(b.insert_range_delete(k("k0050"), k("k0200"), 301), 150);
        assert_eq!(b.bytes(), b.counted_bytes());
        let left: Vec<_> = b.points().keys().cloned().collect();
        let expect: Vec<_> = (0..50u32)
            .filter(|i| !(10..13).contains(i))
            .map(|i| format!("k{i:04}").into_bytes())
            .collect();
        assert_eq!(left, expect);
        assert_eq!(b.ranges().len(), 2);
    }

    #[test]
    fn pacman_rules() {
        let merges = MergeRegistry::default();
        let mut b = MessageBuffer::default();
        b.insert_point(k("a"), PointMsg::put(1, k("x")), &merges);
        b.insert_point(k("b"), PointMsg::put(2, k("y")), &merges);
        b.insert_point(
            k("d"),
            PointMsg::upsert(3, MERGE_PATCH, patch_arg(0, b"u")),
            &merges,
        );
        assert_eq!(b.insert_range_delete(k("a"), k("c"), 4), 2);
        assert_eq!(b.message_count(), 2);
        // Adjacent and overlapping range deletes coalesce.
        b.insert_range_delete(k("c"), k("e"), 5);
        assert_eq!(b.ranges().len(), 1);
        assert_eq!(b.covering(b"dz").unwrap().1.end, k("e"));
        // An upsert under a covering range delete becomes a put.
        b.insert_point(
            k("b"),
            PointMsg::upsert(6, MERGE_PATCH, patch_arg(1, b"z")),
            &merges,
        );
        assert_eq!(
            *b.points().get(&k("b")).unwrap(),
            PointMsg::put(6, k("\0z"))
        );
        // A put hides an older upsert chain.
        b.insert_point(
            k("q"),
            PointMsg::upsert(7, MERGE_PATCH, patch_arg(0, b"1")),
            &merges,
        );
        b.insert_point(
            k("q"),
            PointMsg::upsert(8, MERGE_PATCH, patch_arg(1, b"2")),
            &merges,
        );
        assert_eq!(b.points().get(&k("q")).unwrap().upserts.len(), 2);
        b.insert_point(k("q"), PointMsg::delete(9), &merges);
        assert_eq!(*b.points().get(&k("q")).unwrap(), PointMsg::delete(9));
        let bytes = b.bytes();
        assert_eq!(b.counted_bytes(), bytes);
    }

    #[test]
    fn split_cuts_straddling_ranges() {
        let merges = MergeRegistry::default();
        let mut b = MessageBuffer::default();
        b.insert_range_delete(k("b"), k("m"), 1);
        b.insert_point(k("c"), PointMsg::put(2, k("v")), &merges);
        b.insert_point(k("x"), PointMsg::put(3, k("v")), &merges);
        let right = b.split_off(b"f");
        assert_eq!(b.ranges()[&k("b")].end, k("f"));
        assert_eq!(right.ranges()[&k("f")].end, k("m"));
        assert!(right.points().contains_key(&k("x")));
        assert!(b.covers_whole(b"c", Some(b"f")));
        assert!(!b.covers_whole(b"a", Some(b"f")));
        let mut joined = b.clone();
        joined.absorb_disjoint(right);
        assert_eq!(joined.message_count(), 4);
    }
}
