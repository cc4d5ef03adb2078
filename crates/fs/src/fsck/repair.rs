//! Repairs: each [`Fix`] as a batch on a store opened read-write.

use betreefs_engine::merge::record_arg;
use betreefs_engine::{KeySpace, RecordOp, Store, WriteBatch, MERGE_RECORD};

use super::{Fix, Report};
use crate::fs::key_bound::put_key_bound;
use crate::fs::{INO_BATCH, ROOT_INO};
use crate::plan::{
    count_update, inode_record, purge_file, put_back_pointer, INODES_SLOT, RESERVED_SLOT,
};
use crate::record::{Attr, FsInfo, Record, Timespec, S_IFDIR};
use crate::schema;

/// Applies every fix the report calls for; returns how many were applied.
/// Run [`super::check`] again afterwards: a fix can expose the next
/// inconsistency (a recreated directory changes its parent's link count).
pub fn repair(store: &Store, report: &Report) -> Result<usize, String> {
    let mut applied = 0;
    for fix in report.fixes() {
        let mut batch = WriteBatch::new();
        plan_fix(store, fix, &mut batch)?;
        if !batch.is_empty() {
            store
                .write(&batch)
                .map_err(|e| format!("repairing ({fix:?}): {e}"))?;
        }
        applied += 1;
    }
    store.sync().map_err(|e| format!("syncing repairs: {e}"))?;
    Ok(applied)
}

fn read_record(store: &Store, key: &[u8]) -> Result<Option<Record>, String> {
    match store.get(KeySpace::Meta, key) {
        Ok(Some(v)) => Record::decode(&v)
            .map(Some)
            .map_err(|e| format!("record at {}: {}", key.escape_ascii(), e.0)),
        Ok(None) => Ok(None),
        Err(e) => Err(format!("reading {}: {e}", key.escape_ascii())),
    }
}

/// A fresh inode number: the identity record's reserve moves past it.
fn allocate_ino(store: &Store, batch: &mut WriteBatch) -> Result<u64, String> {
    let info = match store.get(KeySpace::Meta, schema::INFO_KEY) {
        Ok(Some(v)) => FsInfo::decode(&v).map_err(|e| format!("identity record: {}", e.0))?,
        Ok(None) => return Err("no identity record to allocate an inode from".into()),
        Err(e) => return Err(format!("reading the identity record: {e}")),
    };
    let ino = info.ino_reserved;
    let next = FsInfo {
        ino_reserved: ino + 1,
        ..info
    };
    batch.put(KeySpace::Meta, schema::INFO_KEY, &next.encode());
    Ok(ino)
}

/// Sets one slot of the counts record, keeping the others.
fn set_count(batch: &mut WriteBatch, slot: usize, count: u64) {
    let arg = record_arg(&[RecordOp::Set(slot, count)]);
    batch.upsert(KeySpace::Meta, schema::COUNTS_KEY, MERGE_RECORD, &arg);
}

fn plan_fix(store: &Store, fix: &Fix, batch: &mut WriteBatch) -> Result<(), String> {
    match fix {
        Fix::DeleteKey(ks, key) => {
            batch.delete(*ks, key);
        }
        Fix::SetLinkCount { key, nlink } => {
            if let Some(Record::Inode { mut attr, target }) = read_record(store, key)? {
                attr.nlink = *nlink;
                batch.put(KeySpace::Meta, key, &inode_record(&attr, &target));
            }
        }
        Fix::SetInodeCount(count) => set_count(batch, INODES_SLOT, *count),
        Fix::SetReservedCount(count) => set_count(batch, RESERVED_SLOT, *count),
        Fix::RecreateDirectory { key } => {
            if read_record(store, key)?.is_none() {
                let ino = allocate_ino(store, batch)?;
                let attr = Attr::new(ino, S_IFDIR | 0o700, 0, 0, Timespec::now());
                batch.put(KeySpace::Meta, key, &inode_record(&attr, &[]));
                count_update(batch, 1);
            }
        }
        Fix::RecreateIdentity { highest_ino } => {
            let info = FsInfo {
                ino_reserved: highest_ino.max(&ROOT_INO) + 1 + INO_BATCH,
                created: Timespec::now().sec,
            };
            batch.put(KeySpace::Meta, schema::INFO_KEY, &info.encode());
        }
        Fix::PurgeInode(ino) => {
            purge_file(batch, &schema::inode_key(*ino));
            count_update(batch, -1);
        }
        Fix::SetKeyBound(bound) => put_key_bound(batch, *bound),
        Fix::SetBackPointer { ino, parent, name } => {
            put_back_pointer(batch, *ino, *parent, name);
        }
    }
    Ok(())
}
