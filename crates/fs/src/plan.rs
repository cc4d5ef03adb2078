//! Pure builders from the schema to messages: what a file-system change
//! writes, as a batch, without touching the store or the inode table.
//! Operations plan their batch with these, then commit it; fsck's repairs
//! use the same pieces.

use betreefs_engine::merge::{record_arg, truncate_arg};
use betreefs_engine::{KeySpace, RecordOp, WriteBatch, MERGE_RECORD, MERGE_TRUNCATE};

use crate::fs::BLOCK_SIZE;
use crate::record::{Attr, Record};
use crate::schema;

pub(crate) fn inode_record(attr: &Attr, target: &[u8]) -> Vec<u8> {
    Record::Inode {
        attr: attr.clone(),
        target: target.to_vec(),
    }
    .encode()
}

/// Slots of the counts record (see [`crate::record`]).
pub(crate) const INODES_SLOT: usize = 0;
pub(crate) const RESERVED_SLOT: usize = 1;

/// Inodes in use change by `delta`.
pub(crate) fn count_update(batch: &mut WriteBatch, delta: i64) {
    counts_update(batch, INODES_SLOT, delta);
}

/// Blocks reserved (preallocated, not written) change by `delta`.
pub(crate) fn reserved_count_update(batch: &mut WriteBatch, delta: i64) {
    if delta != 0 {
        counts_update(batch, RESERVED_SLOT, delta);
    }
}

fn counts_update(batch: &mut WriteBatch, slot: usize, delta: i64) {
    let op = if delta >= 0 {
        RecordOp::Add(slot, delta as u64)
    } else {
        RecordOp::Sub(slot, delta.unsigned_abs())
    };
    batch.upsert(
        KeySpace::Meta,
        schema::COUNTS_KEY,
        MERGE_RECORD,
        &record_arg(&[op]),
    );
}

/// Removes everything a file owns: its record and its data range.
pub(crate) fn purge_file(batch: &mut WriteBatch, file_key: &[u8]) {
    batch.delete(KeySpace::Meta, file_key);
    let (lo, hi) = schema::file_range(file_key);
    batch.range_delete(KeySpace::Data, &lo, &hi);
}

/// Moves everything a file owns in the data space from one file key to
/// another.
pub(crate) fn move_file_data(batch: &mut WriteBatch, from: &[u8], to: &[u8]) {
    let (lo, hi) = schema::file_range(from);
    batch.range_rename(KeySpace::Data, &lo, &hi, from.len(), to);
}

/// Moves a directory's subtree (both key spaces) from one dir key to another.
pub(crate) fn move_subtree(batch: &mut WriteBatch, from: &[u8], to: &[u8]) {
    let (lo, hi) = schema::subtree_range(from);
    for ks in KeySpace::ALL {
        batch.range_rename(ks, &lo, &hi, from.len(), to);
    }
}

/// Copies everything a file owns in the data space to another file key
/// (one range clone: shared subtrees when it is large).
pub(crate) fn clone_file_data(batch: &mut WriteBatch, from: &[u8], to: &[u8]) {
    let (lo, hi) = schema::file_range(from);
    batch.range_clone(KeySpace::Data, &lo, &hi, from.len(), to);
}

/// Copies the data space of a directory's subtree (blocks, xattrs and
/// reservations of everything below it) to another dir key.
pub(crate) fn clone_subtree_data(batch: &mut WriteBatch, from: &[u8], to: &[u8]) {
    let (lo, hi) = schema::subtree_range(from);
    batch.range_clone(KeySpace::Data, &lo, &hi, from.len(), to);
}

/// The record key of the directory whose directory key is `dir`.
pub(crate) fn dir_record_key(dir: &[u8]) -> Vec<u8> {
    schema::dir_entry_key(dir).unwrap_or_else(|| schema::ROOT_KEY.to_vec())
}

/// Truncate from `old` to `new` bytes: drop whole blocks past the end and
/// cut the last partial one, so that no stale bytes lie beyond the end.
pub(crate) fn truncate_blocks(batch: &mut WriteBatch, file: &[u8], old: u64, new: u64) {
    if new >= old {
        return;
    }
    let keep_blocks = new.div_ceil(BLOCK_SIZE);
    let (lo, hi) = schema::data_range_from(file, keep_blocks);
    batch.range_delete(KeySpace::Data, &lo, &hi);
    let tail = new % BLOCK_SIZE;
    if tail != 0 {
        batch.upsert(
            KeySpace::Data,
            &schema::data_key(file, new / BLOCK_SIZE),
            MERGE_TRUNCATE,
            &truncate_arg(tail),
        );
    }
}

/// Records where inode `ino` is named (a directory, or a file with one
/// name): `name` in directory `parent`.
pub(crate) fn put_back_pointer(batch: &mut WriteBatch, ino: u64, parent: u64, name: &[u8]) {
    let bp = crate::record::BackPointer {
        parent,
        name: name.to_vec(),
    };
    batch.put(KeySpace::Meta, &schema::back_pointer_key(ino), &bp.encode());
}

/// Forgets where `ino` was named (removed, or now kept by inode number).
pub(crate) fn delete_back_pointer(batch: &mut WriteBatch, ino: u64) {
    batch.delete(KeySpace::Meta, &schema::back_pointer_key(ino));
}
