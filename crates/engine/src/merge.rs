//! Upsert merge functions: blind read-modify-write applied where the
//! message meets the value (in a flush, or on the fly in a query).
//!
//! A merge function is `f(old: Option<&[u8]>, arg: &[u8]) -> Vec<u8>`, must be
//! deterministic (it runs again during log replay) and is named by a one-byte
//! id stored in the log and in nodes. Ids below 128 are built in.

use std::collections::HashMap;
use std::sync::Arc;

use crate::codec::{Decoder, Encoder, Sink};
use crate::message::MAX_VALUE_BYTES;

/// "Write these bytes at this offset of the value, zero-filling any gap."
/// Argument: varint offset, then the bytes.
pub const MERGE_PATCH: u8 = 1;
/// "Update fields of a record of little-endian u64 slots."
/// Argument: a sequence of (u8 op, varint slot, u64 operand) with op
/// 0 = set, 1 = max, 2 = add (wrapping), 3 = sub (saturating). The record is
/// zero-extended to cover the highest slot touched.
pub const MERGE_RECORD: u8 = 2;

/// "Cut the value to at most this many bytes" (a file's last block on
/// truncate). Argument: varint length. A missing value becomes empty.
pub const MERGE_TRUNCATE: u8 = 3;

pub type MergeFn = dyn Fn(Option<&[u8]>, &[u8]) -> Vec<u8> + Send + Sync;

/// Checks an argument before it enters the engine (from a caller, the log
/// or a node): a built-in function's result must stay within the engine's
/// value limit whatever value it meets.
type ArgCheck = fn(&[u8]) -> Result<(), String>;

#[derive(Clone)]
struct MergeFunction {
    apply: Arc<MergeFn>,
    check: Option<ArgCheck>,
}

/// The functions an engine knows; ids must be registered before a store
/// whose log or nodes use them is opened.
#[derive(Clone)]
pub struct MergeRegistry {
    functions: HashMap<u8, MergeFunction>,
}

impl Default for MergeRegistry {
    fn default() -> Self {
        let mut functions = HashMap::new();
        let builtin = |apply: fn(Option<&[u8]>, &[u8]) -> Vec<u8>, check: ArgCheck| MergeFunction {
            apply: Arc::new(apply),
            check: Some(check),
        };
        functions.insert(MERGE_PATCH, builtin(merge_patch, check_patch));
        functions.insert(MERGE_RECORD, builtin(merge_record, check_record));
        functions.insert(MERGE_TRUNCATE, builtin(merge_truncate, check_truncate));
        MergeRegistry { functions }
    }
}

impl std::fmt::Debug for MergeRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids: Vec<_> = self.functions.keys().collect();
        ids.sort();
        f.debug_struct("MergeRegistry").field("ids", &ids).finish()
    }
}

impl MergeRegistry {
    /// Registers a user function under an id of 128 or more.
    /// A user function must keep its results within [`MAX_VALUE_BYTES`].
    pub fn register(&mut self, id: u8, f: Arc<MergeFn>) -> Result<(), String> {
        if id < 128 {
            return Err(format!(
                "merge function ids below 128 are reserved (got {id})"
            ));
        }
        self.functions.insert(
            id,
            MergeFunction {
                apply: f,
                check: None,
            },
        );
        Ok(())
    }

    pub fn knows(&self, id: u8) -> bool {
        self.functions.contains_key(&id)
    }

    /// Whether `arg` is a well-formed argument of function `id`, whose
    /// result stays within the engine's limits.
    pub fn check(&self, id: u8, arg: &[u8]) -> Result<(), String> {
        match self.functions.get(&id) {
            None => Err(format!("unknown merge function {id}")),
            Some(MergeFunction { check: None, .. }) => Ok(()),
            Some(MergeFunction {
                check: Some(check), ..
            }) => check(arg),
        }
    }

    /// Applies function `id`; callers check [`MergeRegistry::check`] when the
    /// message enters the engine, so an unknown id here means a corrupt node.
    pub fn apply(&self, id: u8, old: Option<&[u8]>, arg: &[u8]) -> Option<Vec<u8>> {
        self.functions.get(&id).map(|f| (f.apply)(old, arg))
    }
}

/// Encodes a [`MERGE_PATCH`] argument.
pub fn patch_arg(offset: u64, bytes: &[u8]) -> Vec<u8> {
    let mut e = Encoder::with_capacity(bytes.len() + 10);
    e.varint(offset);
    e.buf.extend_from_slice(bytes);
    e.buf
}

/// The byte range a patch argument writes, if it stays within the value
/// limit.
fn patch_span(arg: &[u8]) -> Result<(usize, &[u8]), String> {
    let mut d = Decoder::new(arg);
    let offset = d.varint().map_err(|e| format!("patch offset: {e}"))?;
    let bytes = d.take(d.remaining()).unwrap_or_default();
    match offset.checked_add(bytes.len() as u64) {
        Some(end) if end <= MAX_VALUE_BYTES as u64 => Ok((offset as usize, bytes)),
        _ => Err(format!(
            "patch of {} bytes at offset {offset} passes the {MAX_VALUE_BYTES}-byte value limit",
            bytes.len()
        )),
    }
}

fn check_patch(arg: &[u8]) -> Result<(), String> {
    patch_span(arg).map(|_| ())
}

/// The old value with `arg`'s bytes written over it at its offset, zeros
/// filling any gap: built in one allocation of its final size, copying
/// each byte once (a staged data block takes one patch per partial write
/// into it; growing a copy of the old value to fit was half their cost).
fn merge_patch(old: Option<&[u8]>, arg: &[u8]) -> Vec<u8> {
    let old = old.unwrap_or_default();
    // Arguments are checked where they enter the engine; one that was not
    // (it cannot happen) leaves the value as it was rather than grow it
    // past the limit.
    let Ok((offset, bytes)) = patch_span(arg) else {
        return old.to_vec();
    };
    let end = offset + bytes.len();
    let mut value = Vec::with_capacity(old.len().max(end));
    value.extend_from_slice(old.get(..offset).unwrap_or(old));
    value.resize(offset, 0);
    value.extend_from_slice(bytes);
    if let Some(tail) = old.get(end..) {
        value.extend_from_slice(tail);
    }
    value
}

/// Encodes a [`MERGE_TRUNCATE`] argument.
pub fn truncate_arg(len: u64) -> Vec<u8> {
    let mut e = Encoder::with_capacity(10);
    e.varint(len);
    e.buf
}

fn check_truncate(arg: &[u8]) -> Result<(), String> {
    let mut d = Decoder::new(arg);
    d.varint().map_err(|e| format!("truncate length: {e}"))?;
    if !d.is_empty() {
        return Err("trailing bytes after a truncate length".into());
    }
    Ok(())
}

fn merge_truncate(old: Option<&[u8]>, arg: &[u8]) -> Vec<u8> {
    let value = old.unwrap_or_default();
    let keep = Decoder::new(arg)
        .varint()
        .map_or(value.len(), |len| value.len().min(len as usize));
    value.get(..keep).unwrap_or(value).to_vec()
}

/// One field update of a [`MERGE_RECORD`] upsert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordOp {
    Set(usize, u64),
    Max(usize, u64),
    Add(usize, u64),
    Sub(usize, u64),
}

/// Encodes a [`MERGE_RECORD`] argument.
pub fn record_arg(ops: &[RecordOp]) -> Vec<u8> {
    let mut e = Encoder::with_capacity(ops.len() * 12);
    for op in ops {
        let (code, slot, operand) = match *op {
            RecordOp::Set(s, v) => (0, s, v),
            RecordOp::Max(s, v) => (1, s, v),
            RecordOp::Add(s, v) => (2, s, v),
            RecordOp::Sub(s, v) => (3, s, v),
        };
        e.u8(code);
        e.varint(slot as u64);
        e.u64(operand);
    }
    e.buf
}

/// Largest slot index a record update may touch (bounds value growth).
const RECORD_SLOTS_MAX: u64 = 4096;

fn check_record(arg: &[u8]) -> Result<(), String> {
    let mut d = Decoder::new(arg);
    while !d.is_empty() {
        let (code, slot) = match (d.u8(), d.varint(), d.u64()) {
            (Ok(code), Ok(slot), Ok(_)) => (code, slot),
            _ => return Err("truncated record update".into()),
        };
        if code > 3 {
            return Err(format!("unknown record operation {code}"));
        }
        if slot >= RECORD_SLOTS_MAX {
            return Err(format!("record slot {slot} past the limit"));
        }
    }
    Ok(())
}

fn merge_record(old: Option<&[u8]>, arg: &[u8]) -> Vec<u8> {
    let mut value = old.unwrap_or_default().to_vec();
    let mut d = Decoder::new(arg);
    while !d.is_empty() {
        let (Ok(code), Ok(slot), Ok(operand)) = (d.u8(), d.varint(), d.u64()) else {
            break;
        };
        if slot >= RECORD_SLOTS_MAX {
            break;
        }
        let at = slot as usize * 8;
        if value.len() < at + 8 {
            value.resize(at + 8, 0);
        }
        let current = record_slot(&value, slot as usize);
        let updated = match code {
            0 => operand,
            1 => current.max(operand),
            2 => current.wrapping_add(operand),
            3 => current.saturating_sub(operand),
            _ => break,
        };
        if let Some(dst) = value.get_mut(at..at + 8) {
            dst.copy_from_slice(&updated.to_le_bytes());
        }
    }
    value
}

/// Reads slot `i` of a record value (0 when absent).
pub fn record_slot(value: &[u8], i: usize) -> u64 {
    let mut raw = [0u8; 8];
    if let Some(src) = value.get(i * 8..i * 8 + 8) {
        raw.copy_from_slice(src);
    }
    u64::from_le_bytes(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A patch is the old value, zero-filled to the patch's end if
        /// shorter, with the patch's bytes written over it.
        #[test]
        fn a_patch_writes_over_a_copy_grown_to_fit(
            old in proptest::option::of(proptest::collection::vec(proptest::num::u8::ANY, 0..64)),
            offset in 0u64..80,
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..48),
        ) {
            let mut expected = old.clone().unwrap_or_default();
            let end = offset as usize + bytes.len();
            if expected.len() < end {
                expected.resize(end, 0);
            }
            expected[offset as usize..end].copy_from_slice(&bytes);
            let got = merge_patch(old.as_deref(), &patch_arg(offset, &bytes));
            proptest::prop_assert_eq!(got, expected);
        }
    }

    #[test]
    fn patch_zero_fills_and_overwrites() {
        let r = MergeRegistry::default();
        let v = r.apply(MERGE_PATCH, None, &patch_arg(3, b"ab")).unwrap();
        assert_eq!(v, b"\0\0\0ab");
        let v = r
            .apply(MERGE_PATCH, Some(b"xyzxyz"), &patch_arg(1, b"Q"))
            .unwrap();
        assert_eq!(v, b"xQzxyz");
    }

    #[test]
    fn arguments_past_the_limits_are_refused() {
        let r = MergeRegistry::default();
        assert!(r.check(MERGE_PATCH, &patch_arg(10, b"abc")).is_ok());
        let at_limit = MAX_VALUE_BYTES as u64 - 3;
        assert!(r.check(MERGE_PATCH, &patch_arg(at_limit, b"abc")).is_ok());
        for offset in [at_limit + 1, 1 << 31, (1 << 63) - 1, u64::MAX] {
            assert!(r.check(MERGE_PATCH, &patch_arg(offset, b"abc")).is_err());
            // Even unchecked, applying one never allocates past the limit.
            let v = r
                .apply(MERGE_PATCH, Some(b"old"), &patch_arg(offset, b"abc"))
                .unwrap();
            assert_eq!(v, b"old");
        }
        assert!(r.check(MERGE_PATCH, &[0xff; 11]).is_err());
        assert!(r.check(MERGE_TRUNCATE, &truncate_arg(5)).is_ok());
        assert!(r.check(MERGE_TRUNCATE, b"").is_err());
        assert!(r.check(MERGE_TRUNCATE, &[5, 1]).is_err());
        assert!(r
            .check(MERGE_RECORD, &record_arg(&[RecordOp::Set(3, 1)]))
            .is_ok());
        assert!(r
            .check(MERGE_RECORD, &record_arg(&[RecordOp::Set(4096, 1)]))
            .is_err());
        assert!(r
            .check(MERGE_RECORD, &[9, 0, 0, 0, 0, 0, 0, 0, 0, 0])
            .is_err());
        assert!(r.check(MERGE_RECORD, &[0, 0, 0]).is_err());
        assert!(r.check(77, b"").is_err());
    }

    #[test]
    fn truncate_cuts_and_never_grows() {
        let r = MergeRegistry::default();
        let cut =
            |old: Option<&[u8]>, len| r.apply(MERGE_TRUNCATE, old, &truncate_arg(len)).unwrap();
        assert_eq!(cut(Some(b"abcdef"), 2), b"ab");
        assert_eq!(cut(Some(b"ab"), 10), b"ab");
        assert_eq!(cut(None, 3), b"");
        assert_eq!(r.apply(MERGE_TRUNCATE, Some(b"ab"), b"").unwrap(), b"ab");
    }

    #[test]
    fn record_updates() {
        let r = MergeRegistry::default();
        let v = r
            .apply(
                MERGE_RECORD,
                None,
                &record_arg(&[RecordOp::Set(2, 7), RecordOp::Add(0, 5)]),
            )
            .unwrap();
        assert_eq!(v.len(), 24);
        assert_eq!((record_slot(&v, 0), record_slot(&v, 2)), (5, 7));
        let v = r
            .apply(
                MERGE_RECORD,
                Some(&v),
                &record_arg(&[RecordOp::Max(2, 3), RecordOp::Sub(0, 9)]),
            )
            .unwrap();
        assert_eq!((record_slot(&v, 0), record_slot(&v, 2)), (0, 7));
        assert!(r.apply(99, None, b"").is_none());
        let mut r2 = r.clone();
        assert!(r2.register(5, Arc::new(|_, _| Vec::new())).is_err());
        r2.register(200, Arc::new(|_, a| a.to_vec())).unwrap();
        assert_eq!(r2.apply(200, None, b"z").unwrap(), b"z");
    }
}
