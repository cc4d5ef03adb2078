//! Attributes: setattr (modes, owners, sizes, times) and access times.

use betreefs_engine::{KeySpace, WriteBatch};

use super::locking::Table;
use super::planned::Planned;
use super::reservations::ReservedBlocks;
use super::state::Home;
use super::state::State;
use super::{
    blocks_to, AtimePolicy, Caller, FileSystem, Ino, SetAttr, SetTime, BLOCK_SIZE, FILE_SIZE_MAX,
    RELATIME_SECS,
};
use crate::acl::{self, Acl};
use crate::error::{Errno, FsResult};
use crate::plan::truncate_blocks;
use crate::record::{
    Attr, Timespec, FS_NOATIME_FL, INODE_FLAGS, INTERNAL_FLAGS, PREALLOC_FL, S_IFDIR, S_IFMT,
};
use crate::schema;

/// The extended attribute holding a file's capabilities, which a change
/// by an unprivileged caller drops with the set-ID bits.
pub const CAPABILITY_XATTR: &[u8] = b"security.capability";

/// The mode after the set-ID bits a change by `caller` drops, as Linux
/// does on write, truncate, fallocate and chown by a caller without
/// CAP_FSETID (`setattr_should_drop_suidgid`): set-user-ID always;
/// set-group-ID when the group may execute the file, or when the caller
/// is not in the file's group. Only the caller's primary group reaches a
/// FUSE daemon (supplementary groups do not), and root counts as a member
/// of every group. Directories keep theirs.
pub fn mode_without_privileges(mode: u32, file_gid: u32, caller: Caller) -> u32 {
    if mode & S_IFMT == S_IFDIR {
        return mode;
    }
    let mut mode = mode & !libc::S_ISUID;
    let in_group = caller.uid == 0 || caller.gid == file_gid;
    if mode & libc::S_ISGID != 0 && (mode & libc::S_IXGRP != 0 || !in_group) {
        mode &= !libc::S_ISGID;
    }
    mode
}

impl FileSystem {
    pub(super) fn set_attributes(&self, ino: Ino, set: &SetAttr) -> FsResult<Attr> {
        let mut st = self.writer();
        let now = Timespec::now();
        let before = st.node(ino)?.attr.clone();
        // Immutable: nothing changes. Append-only: times may be set to
        // now (touch), nothing else (Linux's notify_change, do_truncate).
        let explicit_time = |t: Option<SetTime>| matches!(t, Some(SetTime::At(_)));
        let changes_more_than_now = set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || set.size.is_some()
            || explicit_time(set.atime)
            || explicit_time(set.mtime);
        if before.is_immutable() || (before.is_append_only() && changes_more_than_now) {
            return Err(Errno::EPERM);
        }
        // A removed file (still known to the kernel) has nothing stored.
        let key = match st.node(ino)?.home {
            Home::Gone => None,
            _ => Some(st.file_key(ino)?),
        };
        let mut batch = WriteBatch::new();
        let mut plan = Planned::new();
        let mut released = 0;
        let dropped = match (set.kill_privileges, &key) {
            (Some(caller), Some(key)) => {
                self.drop_privileges(&mut st, &mut plan, &mut batch, ino, key, caller)?
            }
            _ => false,
        };
        if let Some(size) = set.size {
            if before.is_dir() {
                return Err(Errno::EISDIR);
            }
            if size > FILE_SIZE_MAX {
                return Err(Errno::EFBIG);
            }
            let key = key.as_deref().ok_or(Errno::ENOENT)?;
            truncate_blocks(&mut batch, key, before.size, size);
            // Preallocated blocks past the new end go with it (as on ext4,
            // also those a KEEP_SIZE fallocate put past the old end); so
            // does the last one when cut short (it is stored from now on).
            if size <= before.size && before.flags & PREALLOC_FL != 0 {
                let cut_short = size < before.size && !size.is_multiple_of(BLOCK_SIZE);
                let from = if cut_short {
                    size / BLOCK_SIZE
                } else {
                    blocks_to(size)
                };
                released = self.carve_reservations(&mut batch, key, from, u64::MAX)?;
            }
            // Growing past the last stored block leaves a hole.
            plan.note_data_change(&st, ino, blocks_to(size) > blocks_to(before.size))?;
        }
        // chmod rewrites the access ACL's owner, mask and other entries
        // (`posix_acl_chmod`), so the two never disagree.
        if let (Some(mode), Some(key)) = (set.mode, &key) {
            if let Some(stored) = self.stored_xattr(&mut st, ino, acl::ACCESS_XATTR)? {
                let mut access = Acl::decode(&stored).map_err(|_| Errno::EIO)?;
                access.chmod(mode);
                let at = schema::xattr_key(key, acl::ACCESS_XATTR);
                batch.put(KeySpace::Data, &at, &access.encode());
            }
        }
        let a = plan.attr_mut(&st, ino)?;
        if let Some(mode) = set.mode {
            a.mode = (a.mode & S_IFMT) | (mode & 0o7777);
        }
        if let Some(uid) = set.uid {
            a.uid = uid;
        }
        if let Some(gid) = set.gid {
            a.gid = gid;
        }
        // Linux's rules: a size change marks mtime and ctime; truncate(2)
        // to the same size changes nothing, while ftruncate and O_TRUNC
        // (which name an open file) mark both anyway; any other change
        // marks ctime.
        let data_changed = set
            .size
            .is_some_and(|size| size != a.size || set.through_open_file);
        if let Some(size) = set.size {
            a.size = size;
            if size == 0 {
                a.flags &= !PREALLOC_FL;
            }
        }
        if data_changed {
            a.mtime = now;
        }
        let pick = |t: SetTime| match t {
            SetTime::Now => now,
            SetTime::At(t) => t,
        };
        if let Some(t) = set.atime {
            a.atime = pick(t);
        }
        if let Some(t) = set.mtime {
            a.mtime = pick(t);
        }
        let attributes_changed = dropped
            || set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || set.atime.is_some()
            || set.mtime.is_some()
            || set.ctime.is_some();
        if data_changed || attributes_changed {
            a.ctime = set.ctime.unwrap_or(now);
        }
        let after = a.clone();
        if after == before && released == 0 {
            return Ok(after);
        }
        if let Some(key) = &key {
            plan.put_record_at(&st, &mut batch, key, ino)?;
        }
        let reservation = ReservedBlocks::released(released).reservation();
        st.write_reserving(&batch, reservation)?;
        st.commit(plan);
        Ok(after)
    }

    /// Sets the chattr flags. The kernel has checked ownership and
    /// CAP_LINUX_IMMUTABLE (`fileattr_set_prepare`); flags betreefs does not
    /// keep are refused, as ext4 refuses its unknown ones.
    pub(super) fn set_inode_flags_to(&self, ino: Ino, flags: u32) -> FsResult<()> {
        if flags & !INODE_FLAGS != 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        let mut st = self.writer();
        let node = st.node(ino)?;
        if node.attr.flags & INODE_FLAGS == flags {
            return Ok(());
        }
        let key = match node.home {
            Home::Gone => None,
            _ => Some(st.file_key(ino)?),
        };
        let mut plan = Planned::new();
        let a = plan.attr_mut(&st, ino)?;
        a.flags = flags | (a.flags & INTERNAL_FLAGS);
        a.ctime = Timespec::now();
        if let Some(key) = key {
            let mut batch = WriteBatch::new();
            plan.put_record_at(&st, &mut batch, &key, ino)?;
            st.write(&batch)?;
        }
        st.commit(plan);
        Ok(())
    }

    /// Drops the set-ID bits and the capabilities of `ino` before a change
    /// by `caller` ([`mode_without_privileges`]): the mode goes into `plan`,
    /// the capability's delete into `batch`. Says whether anything was
    /// dropped.
    pub(super) fn drop_privileges(
        &self,
        st: &mut State,
        plan: &mut Planned,
        batch: &mut WriteBatch,
        ino: Ino,
        file_key: &[u8],
        caller: Caller,
    ) -> FsResult<bool> {
        let attr = plan.attr(st, ino)?;
        let mode = mode_without_privileges(attr.mode, attr.gid, caller);
        let mut dropped = mode != attr.mode;
        if mode & S_IFMT != S_IFDIR && self.has_capability(st, ino, file_key)? {
            batch.delete(
                KeySpace::Data,
                &schema::xattr_key(file_key, CAPABILITY_XATTR),
            );
            // Known again once the batch is in (or not).
            st.node_mut(ino)?.has_capability = None;
            dropped = true;
        }
        plan.attr_mut(st, ino)?.mode = mode;
        Ok(dropped)
    }

    /// Whether the file has capabilities, asked of the store at most once
    /// while the inode is in the table.
    fn has_capability(&self, st: &mut State, ino: Ino, file_key: &[u8]) -> FsResult<bool> {
        let node = st.node(ino)?;
        if node.has_xattrs == Some(false) {
            return Ok(false);
        }
        if let Some(known) = node.has_capability {
            return Ok(known);
        }
        let key = schema::xattr_key(file_key, CAPABILITY_XATTR);
        let present = self.store.get(KeySpace::Data, &key)?.is_some();
        st.node_mut(ino)?.has_capability = Some(present);
        Ok(present)
    }

    /// Marks the access of a read or a listing of `ino`, if its access
    /// time is due (`self.atime`). Takes the table the read held and lets
    /// it go: an update is a write, made in the write order.
    pub(super) fn note_access(&self, st: Table<'_>, ino: Ino) -> FsResult<()> {
        if !self.access_due(&st, ino)? {
            return Ok(());
        }
        drop(st);
        let mut st = self.writer();
        // Again: another read may have marked it meanwhile.
        if !self.access_due(&st, ino)? {
            return Ok(());
        }
        let mut plan = Planned::new();
        plan.attr_mut(&st, ino)?.atime = Timespec::now();
        let mut batch = WriteBatch::new();
        plan.put_record(&st, &mut batch, ino)?;
        // An access time that cannot be stored (a full device) must not
        // fail the read that caused it.
        match st.write(&batch) {
            Ok(_) => st.commit(plan),
            Err(e) => tracing::debug!("access time of {ino} not updated: {e}"),
        }
        Ok(())
    }

    /// Whether an access of `ino` now updates its access time.
    fn access_due(&self, st: &State, ino: Ino) -> FsResult<bool> {
        let now = Timespec::now();
        let node = st.node(ino)?;
        let a = &node.attr;
        let due = match self.atime {
            _ if a.flags & FS_NOATIME_FL != 0 => false,
            AtimePolicy::Noatime => false,
            AtimePolicy::Strictatime => true,
            AtimePolicy::Relatime => {
                a.atime <= a.mtime || a.atime <= a.ctime || now.sec - a.atime.sec >= RELATIME_SECS
            }
        };
        Ok(due && node.home != Home::Gone)
    }
}
