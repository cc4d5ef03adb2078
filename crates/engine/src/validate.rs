//! What the engine accepts. Everything that enters the trees — a caller's
//! batch, a log record being replayed, a node read from disk — is checked
//! here against the engine's limits and the tree's invariants before it is
//! used, so a damaged or crafted image gives a typed error naming the node
//! and the reason, never a panic, a huge allocation or silently wrong data.
//!
//! These are the checks cheap enough for every load (each is linear in what
//! was just decoded). [`crate::tree`]'s `verify` (fsck) adds the ones that
//! need more than one node at a time.

use crate::buffer::{Base, MessageBuffer, PointMsg};
use crate::entries::Entries;
use crate::error::{EngineError, EngineResult};
use crate::merge::MergeRegistry;
use crate::message::{Message, WriteBatch, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use crate::node::{Bounds, Interior, Leaf};

/// Checks a batch from a caller or from the log: key and value sizes,
/// range bounds in order, merge functions known and their arguments valid.
pub fn check_batch(batch: &WriteBatch, merges: &MergeRegistry) -> EngineResult<()> {
    for (_, m) in batch.messages() {
        check_message(&m, merges)?;
    }
    Ok(())
}

fn key_size(key: &[u8]) -> EngineResult<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(EngineError::KeyTooLarge(key.len()));
    }
    Ok(())
}

fn value_size(value: &[u8]) -> EngineResult<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(EngineError::ValueTooLarge(value.len()));
    }
    Ok(())
}

pub(crate) fn check_message(m: &Message, merges: &MergeRegistry) -> EngineResult<()> {
    match m {
        Message::Put { key, value } => {
            key_size(key)?;
            value_size(value)
        }
        Message::Delete { key } => key_size(key),
        Message::Upsert { key, func, arg } => {
            key_size(key)?;
            if !merges.knows(*func) {
                return Err(EngineError::UnknownMergeFunction(*func));
            }
            value_size(arg)?;
            merges
                .check(*func, arg)
                .map_err(EngineError::InvalidMessage)
        }
        Message::RangeDelete { start, end } => {
            key_size(start)?;
            key_size(end)?;
            // An empty range is a harmless no-op; a reversed one is a bug
            // or damage.
            if start > end {
                return Err(EngineError::InvalidMessage(format!(
                    "range delete ends at {end:?} before its start {start:?}"
                )));
            }
            Ok(())
        }
        Message::RangeRename(r) | Message::RangeClone(r) => {
            r.check().map_err(EngineError::InvalidMessage)?;
            for k in [&r.start, &r.end, &r.new_prefix] {
                key_size(k)?;
            }
            let (_, dest_end) = r.destination_range();
            key_size(&dest_end)
        }
    }
}

/// Checks a point message read from a node's buffer.
fn check_point(
    key: &[u8],
    msg: &PointMsg,
    merges: &MergeRegistry,
    max_seq: u64,
) -> Result<(), String> {
    if key.len() > MAX_KEY_BYTES {
        return Err(format!("key of {} bytes", key.len()));
    }
    // A coalesced range delete carries the newest number of its parts, and
    // a put folded from it can carry that number too: only upserts among
    // themselves are strictly ordered.
    let mut newest = match &msg.base {
        Some(Base::Put { seq, value }) => {
            if value.len() > MAX_VALUE_BYTES {
                return Err(format!("value of {} bytes", value.len()));
            }
            *seq
        }
        Some(Base::Delete { seq }) => *seq,
        None => 0,
    };
    let mut previous_upsert = 0;
    for u in &msg.upserts {
        merges
            .check(u.func, &u.arg)
            .map_err(|e| format!("upsert of {key:?}: {e}"))?;
        if u.seq < previous_upsert {
            return Err(format!("upserts of {key:?} out of sequence order"));
        }
        previous_upsert = u.seq;
        newest = newest.max(u.seq);
    }
    if newest > max_seq {
        return Err(format!(
            "message for {key:?} has sequence number {newest}, newer than the store's {max_seq}"
        ));
    }
    Ok(())
}

/// Checks one child buffer of an interior node: every message lies within
/// the child's bounds, range deletes are non-empty, sorted and disjoint,
/// and nothing is newer than the store itself.
pub(crate) fn check_buffer(
    buffer: &MessageBuffer,
    child: &Bounds,
    merges: &MergeRegistry,
    max_seq: u64,
) -> Result<(), String> {
    let mut previous_end: Option<&[u8]> = None;
    for (start, r) in buffer.ranges() {
        if start.as_slice() >= r.end.as_slice() {
            return Err(format!("empty or reversed range delete at {start:?}"));
        }
        if !child.contains(start) || child.hi.as_ref().is_some_and(|hi| r.end > *hi) {
            return Err(format!(
                "range delete [{start:?}, {:?}) outside its child's {child:?}",
                r.end
            ));
        }
        if previous_end.is_some_and(|e| e > start.as_slice()) {
            return Err(format!("range deletes overlap at {start:?}"));
        }
        if r.seq > max_seq {
            return Err(format!(
                "range delete with sequence number {} newer than the store's {max_seq}",
                r.seq
            ));
        }
        previous_end = Some(&r.end);
    }
    for (key, msg) in buffer.points() {
        if !child.contains(key) {
            return Err(format!("message for {key:?} outside its child's {child:?}"));
        }
        check_point(key, msg, merges, max_seq)?;
    }
    Ok(())
}

/// Checks an interior node as decoded: pivots inside its bounds (decoding
/// already checked their order), children distinct and not itself, and
/// every buffered message valid and in its child's range.
pub fn check_interior(
    int: &Interior,
    own: &Bounds,
    num: u64,
    merges: &MergeRegistry,
    max_seq: u64,
) -> Result<(), String> {
    if int.children.len() != int.pivots.len() + 1 || int.buffers.len() != int.children.len() {
        return Err("pivot, child and buffer counts disagree".into());
    }
    if let Some(p) = int.pivots.iter().find(|p| !own.contains(p)) {
        return Err(format!("pivot {p:?} outside the node's {own:?}"));
    }
    // A child may be named twice (a range clone within one node's
    // children shares it); the block table's reference counts say how
    // often, and verify checks them.
    if int.children.contains(&num) {
        return Err("the node is its own child".into());
    }
    for (i, buffer) in int.buffers.iter().enumerate() {
        check_buffer(buffer, &int.child_bounds(i, own), merges, max_seq)
            .map_err(|e| format!("buffer of child {i}: {e}"))?;
    }
    Ok(())
}

/// Checks a leaf's basement table as decoded: pivots inside its bounds.
pub fn check_leaf(leaf: &Leaf, own: &Bounds) -> Result<(), String> {
    if leaf.pivots.len() + 1 != leaf.basements.len() {
        return Err("basement and pivot counts disagree".into());
    }
    match leaf.pivots.iter().find(|p| !own.contains(p)) {
        Some(p) => Err(format!("basement pivot {p:?} outside the node's {own:?}")),
        None => Ok(()),
    }
}

/// The key range of basement `i` of a leaf with bounds `own`.
pub fn basement_bounds(leaf: &Leaf, i: usize, own: &Bounds) -> Bounds {
    Bounds {
        lo: match i {
            0 => own.lo.clone(),
            _ => leaf.pivots.get(i - 1).cloned().unwrap_or_default(),
        },
        hi: leaf.pivots.get(i).cloned().or_else(|| own.hi.clone()),
    }
}

/// Checks a decoded basement (decoding checked the order): its keys lie in
/// its range and no value passes the limit.
pub fn check_basement(entries: &Entries, range: &Bounds) -> Result<(), String> {
    if let (Some(first), Some(last)) = (entries.first_key(), entries.last_key()) {
        if !range.contains(first) || !range.contains(last) {
            return Err(format!(
                "basement keys {first:?}..{last:?} outside its range {range:?}"
            ));
        }
    }
    match entries.iter().find(|(_, v)| v.len() > MAX_VALUE_BYTES) {
        Some((k, v)) => Err(format!("value of {} bytes at {k:?}", v.len())),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge::{patch_arg, MERGE_PATCH};
    use crate::message::KeySpace;

    fn bounds(lo: &str, hi: &str) -> Bounds {
        Bounds {
            lo: lo.as_bytes().to_vec(),
            hi: Some(hi.as_bytes().to_vec()),
        }
    }

    #[test]
    fn batches_past_the_limits_are_refused() {
        let merges = MergeRegistry::default();
        let ok = |b: &WriteBatch| check_batch(b, &merges);
        assert!(ok(WriteBatch::new().range_delete(KeySpace::Meta, b"a", b"a")).is_ok());
        assert!(ok(WriteBatch::new().range_delete(KeySpace::Meta, b"b", b"a")).is_err());
        let big_patch = patch_arg(1 << 31, b"x");
        assert!(
            ok(WriteBatch::new().upsert(KeySpace::Data, b"k", MERGE_PATCH, &big_patch)).is_err()
        );
        assert!(ok(WriteBatch::new().upsert(KeySpace::Data, b"k", 99, b"")).is_err());
        let long = vec![b'k'; MAX_KEY_BYTES + 1];
        assert!(ok(WriteBatch::new().delete(KeySpace::Data, &long)).is_err());
        let value = vec![0; MAX_VALUE_BYTES + 1];
        assert!(ok(WriteBatch::new().put(KeySpace::Data, b"k", &value)).is_err());
    }

    #[test]
    fn interior_invariants() {
        let merges = MergeRegistry::default();
        let own = bounds("a", "z");
        let mut int = Interior {
            height: 1,
            pivots: vec![b"m".to_vec()],
            children: vec![4, 5],
            buffers: vec![Default::default(), Default::default()],
            partial: None,
        };
        int.insert_point(b"c".to_vec(), PointMsg::put(3, b"v".to_vec()), &merges);
        assert!(check_interior(&int, &own, 9, &merges, 10).is_ok());
        // Messages newer than the store, the node its own child, pivots
        // outside.
        assert!(check_interior(&int, &own, 9, &merges, 2).is_err());
        assert!(check_interior(&int, &own, 4, &merges, 10).is_err());
        // A child named twice is a shared one (a range clone inside one
        // node): the reference counts, which verify checks, say so.
        let mut twice = int.clone();
        twice.children[1] = 4;
        assert!(check_interior(&twice, &own, 9, &merges, 10).is_ok());
        assert!(check_interior(&int, &bounds("n", "z"), 9, &merges, 10).is_err());
        // A message in the wrong child's buffer.
        let mut misplaced = int.clone();
        misplaced.buffers.swap(0, 1);
        assert!(check_interior(&misplaced, &own, 9, &merges, 10).is_err());
    }

    #[test]
    fn basements_outside_their_range() {
        let mut e = Entries::default();
        e.push(b"c", b"1");
        e.push(b"f", b"2");
        assert!(check_basement(&e, &bounds("b", "g")).is_ok());
        assert!(check_basement(&e, &bounds("d", "g")).is_err());
        assert!(check_basement(&e, &bounds("b", "f")).is_err());
        assert!(check_basement(&Entries::default(), &bounds("x", "y")).is_ok());
    }
}
