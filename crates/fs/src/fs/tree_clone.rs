//! Clone of a directory tree (`betreefs clone SRC DST`, issue 12): the
//! data of every file below the source — blocks, extended attributes,
//! reservations — is one range clone of the subtree's data-space range,
//! shared copy-on-write by the engine in O(tree height); only the metadata
//! records are written again, because each names its inode number and the
//! clone's inodes need numbers of their own (docs/design.md, "Clone of a
//! directory tree").
//!
//! The clone fills an empty directory the caller made (the command
//! `mkdir`s it first): that directory's inode is already known to the
//! kernel, so no cached entry or listing of its parent goes stale, and
//! everything new is below a directory the kernel has never listed.

use std::collections::HashMap;

use betreefs_engine::{KeySpace, WriteBatch};

use super::planned::Planned;
use super::state::State;
use super::{decode, Caller, FileSystem, Ino, ENTRY_KEY_MAX};
use crate::error::{Errno, FsResult};
use crate::plan::{
    clone_file_data, clone_subtree_data, count_update, inode_record, put_back_pointer,
};
use crate::record::{Attr, Record, Timespec, PREALLOC_FL, SPARSE_FL};
use crate::schema;

/// A hard-linked inode met below the source: its clone's number, how
/// many of its names lie inside the tree, and the record naming it.
struct LinkedInode {
    clone: Ino,
    names: u32,
    record: Record,
}

impl FileSystem {
    /// Makes the empty directory `dst` a copy of directory `src`: its
    /// attributes and extended attributes, and a clone of everything
    /// below it, with new inode numbers, in one atomic batch. Hard links
    /// inside the tree stay linked to each other (not to the originals);
    /// preallocated extents are not copied (they read as zeros, as holes
    /// do). Root only, as snapshots are: nothing else checks the caller's
    /// right to read every file of the tree.
    pub(super) fn clone_tree_into(&self, src: Ino, dst: Ino, caller: Caller) -> FsResult<Attr> {
        if caller.uid != 0 {
            return Err(Errno::EPERM);
        }
        let mut st = self.writer();
        self.load_by_number(&mut st, src)?;
        if !st.node(src)?.attr.is_dir() || !st.node(dst)?.attr.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        // Into itself, or below itself: the tree would contain its copy.
        if src == dst || st.is_within(dst, src) {
            return Err(Errno::EINVAL);
        }
        st.check_dir_change(dst, false)?;
        let (src_dir, dst_dir) = (st.dir_key(src)?, st.dir_key(dst)?);
        if !self.dir_is_empty_known(&st, dst, &dst_dir)? {
            return Err(Errno::ENOTEMPTY);
        }
        let (src_key, dst_key) = (st.file_key(src)?, st.file_key(dst)?);
        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        // The new inodes' numbers, taken when the batch is in.
        let mut plan = Planned::new();
        // The directory's own xattrs (the clone clears what dst had, such
        // as a default ACL inherited at its mkdir), then everything below.
        clone_file_data(&mut batch, &src_key, &dst_key);
        clone_subtree_data(&mut batch, &src_dir, &dst_dir);
        let made =
            self.clone_records(&mut st, &mut plan, &mut batch, &src_dir, &dst_dir, dst, now)?;
        let attr = {
            let from = &st.node(src)?.attr;
            let to = &st.node(dst)?.attr;
            Attr {
                ino: to.ino,
                crtime: to.crtime,
                ctime: now,
                stored_blocks: None,
                ..from.clone()
            }
        };
        batch.put(KeySpace::Meta, &dst_key, &inode_record(&attr, &[]));
        count_update(&mut batch, made as i64);
        // A tree whose records exceed one log record is refused here
        // (EFBIG), before anything is written.
        st.write(&batch)?;
        st.commit(plan);
        st.resize_node(dst, |node| {
            node.attr = attr.clone();
            node.dir_version += 1;
            node.has_xattrs = None;
            node.has_capability = None;
            node.child_names = None;
            node.entries = None;
        })
        .ok_or(Errno::ESTALE)?;
        Ok(attr)
    }

    /// Puts a record with a new inode number at the destination for every
    /// entry below `src_dir`, with back pointers, and the inode records
    /// of hard-linked files (whose data is cloned under their new inode
    /// key). Returns how many inodes it made.
    #[allow(clippy::too_many_arguments)]
    fn clone_records(
        &self,
        st: &mut State,
        plan: &mut Planned,
        batch: &mut WriteBatch,
        src_dir: &[u8],
        dst_dir: &[u8],
        dst: Ino,
        now: Timespec,
    ) -> FsResult<u64> {
        let (lo, hi) = schema::subtree_range(src_dir);
        // New number of each directory below the source, by its old dir
        // key; entries come in key order, a directory's record before
        // everything below it.
        let mut dirs: HashMap<Vec<u8>, Ino> = HashMap::from([(src_dir.to_vec(), dst)]);
        let mut linked: HashMap<u64, LinkedInode> = HashMap::new();
        let mut made = 0;
        for item in self.store.range(KeySpace::Meta, &lo, Some(&hi)) {
            let (key, value) = item?;
            let (dir, name) = schema::parse_entry_key(&key).ok_or_else(|| {
                tracing::error!("clone: a key below {src_dir:02x?} is no entry: {key:02x?}");
                Errno::EIO
            })?;
            let parent = *dirs.get(dir).ok_or_else(|| {
                tracing::error!("clone: entry {key:02x?} has no directory record above it");
                Errno::EIO
            })?;
            let rest = key.get(src_dir.len()..).ok_or(Errno::EIO)?;
            let new_key = [dst_dir, rest].concat();
            if new_key.len() > ENTRY_KEY_MAX {
                return Err(Errno::ENAMETOOLONG);
            }
            match decode(&value)? {
                Record::Inode { attr, target } => {
                    // The table's attributes are the newest (the record
                    // is written with them, but a file open here may
                    // have counted its blocks since).
                    let current = st.nodes.get(&attr.ino).map(|n| n.attr.clone());
                    let attr = current.unwrap_or(attr);
                    let ino = plan.allocate_ino(st, batch);
                    put_cloned_inode(batch, &new_key, &attr, ino, attr.nlink, &target, now);
                    put_back_pointer(batch, ino, parent, &name);
                    if attr.is_dir() {
                        dirs.insert(schema::child_dir_key(dir, &name), ino);
                    }
                    made += 1;
                }
                record @ Record::Link { ino, mode } => {
                    let link = linked.entry(ino).or_insert_with(|| {
                        made += 1;
                        LinkedInode {
                            clone: plan.allocate_ino(st, batch),
                            names: 0,
                            record,
                        }
                    });
                    link.names += 1;
                    let record = Record::Link {
                        ino: link.clone,
                        mode,
                    };
                    batch.put(KeySpace::Meta, &new_key, &record.encode());
                }
            }
        }
        for (ino, link) in linked {
            let (attr, target, _) = self.resolve(st, link.record)?;
            let new_key = schema::inode_key(link.clone);
            clone_file_data(batch, &schema::inode_key(ino), &new_key);
            put_cloned_inode(batch, &new_key, &attr, link.clone, link.names, &target, now);
        }
        Ok(made)
    }
}

/// Puts the record of inode `ino`, the clone of `attr` with `nlink`
/// names, at `key`; its copied reservations are dropped (a clone promises
/// no space for writes into them: they stay holes).
fn put_cloned_inode(
    batch: &mut WriteBatch,
    key: &[u8],
    attr: &Attr,
    ino: Ino,
    nlink: u32,
    target: &[u8],
    now: Timespec,
) {
    if attr.flags & PREALLOC_FL != 0 {
        let (lo, hi) = schema::reservations_ending_after(key, 0);
        batch.range_delete(KeySpace::Data, &lo, &hi);
    }
    let clone = Attr {
        nlink,
        ..cloned_attr(attr, ino, now)
    };
    batch.put(KeySpace::Meta, key, &inode_record(&clone, target));
}

/// The attributes of the clone of `attr`: the same but for its number, a
/// change and birth time of now (it is a new inode), and no reservations
/// (where they were, the clone has holes).
fn cloned_attr(attr: &Attr, ino: Ino, now: Timespec) -> Attr {
    let flags = if attr.flags & PREALLOC_FL != 0 {
        (attr.flags & !PREALLOC_FL) | SPARSE_FL
    } else {
        attr.flags
    };
    Attr {
        ino,
        ctime: now,
        crtime: now,
        flags,
        stored_blocks: None,
        ..attr.clone()
    }
}
