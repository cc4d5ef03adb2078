//! Extended attributes: one key each in the data key space, after the
//! file's data blocks.

use betreefs_engine::{KeySpace, WriteBatch};

use super::planned::Planned;
use super::{FileSystem, Ino, State, CAPABILITY_XATTR, XATTR_SIZE_MAX};
use crate::acl::{self, Acl};
use crate::error::{Errno, FsResult};
use crate::record::Timespec;
use crate::schema;

/// A setxattr flag of our own beside `XATTR_CREATE`/`XATTR_REPLACE`: the
/// caller may not keep the set-group-ID bit when an access ACL sets the
/// mode (the kernel's `FUSE_SETXATTR_ACL_KILL_SGID`: not in the file's
/// group and without CAP_FSETID).
pub const XATTR_ACL_KILL_SGID: i32 = 0x4000_0000;

impl FileSystem {
    pub(super) fn set_xattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: i32,
    ) -> FsResult<()> {
        if name.is_empty() || name.len() > 255 || name.contains(&0) {
            return Err(Errno::ERANGE);
        }
        if value.len() > XATTR_SIZE_MAX {
            return Err(Errno::E2BIG);
        }
        let mut st = self.writer();
        st.check_attributes_change(ino)?;
        let key = schema::xattr_key(&st.file_key(ino)?, name);
        // ACLs (the kernel enforces them) keep the mode in step; an access
        // ACL the mode says exactly is not stored (`posix_acl_update_mode`).
        // The kernel ignores the create/replace flags for them.
        let mut keep = true;
        let mut new_mode = None;
        if name == acl::ACCESS_XATTR || name == acl::DEFAULT_XATTR {
            let parsed = Acl::decode(value)?;
            let attr = &st.node(ino)?.attr;
            if name == acl::DEFAULT_XATTR && !attr.is_dir() {
                return Err(Errno::EACCES);
            }
            if name == acl::ACCESS_XATTR {
                let (bits, equivalent) = parsed.mode_bits();
                let mut mode = (attr.mode & !0o777) | bits;
                if flags & XATTR_ACL_KILL_SGID != 0 {
                    mode &= !libc::S_ISGID;
                }
                new_mode = Some(mode);
                keep = !equivalent;
            }
        } else if flags & (libc::XATTR_CREATE | libc::XATTR_REPLACE) != 0 {
            let exists = self.store.get(KeySpace::Data, &key)?.is_some();
            if exists && flags & libc::XATTR_CREATE != 0 {
                return Err(Errno::EEXIST);
            }
            if !exists && flags & libc::XATTR_REPLACE != 0 {
                return Err(Errno::ENODATA);
            }
        }
        let mut plan = Planned::new();
        let attr = plan.attr_mut(&st, ino)?;
        attr.ctime = Timespec::now();
        if let Some(mode) = new_mode {
            attr.mode = mode;
        }
        let mut batch = WriteBatch::new();
        if keep {
            batch.put(KeySpace::Data, &key, value);
        } else {
            batch.delete(KeySpace::Data, &key);
        }
        plan.put_record(&st, &mut batch, ino)?;
        // Not known until the batch is in (or not).
        if name == CAPABILITY_XATTR {
            st.node_mut(ino)?.has_capability = None;
        }
        st.write(&batch)?;
        st.commit(plan);
        if keep {
            st.node_mut(ino)?.has_xattrs = Some(true);
        }
        Ok(())
    }

    /// The value of `name` on `ino`, if it has one. Learns, on a miss,
    /// whether the file has any extended attribute, so later misses (the
    /// kernel asks for `security.capability` before writes, and for ACLs
    /// on permission checks and creates) cost no query.
    pub(super) fn stored_xattr(
        &self,
        st: &mut State,
        ino: Ino,
        name: &[u8],
    ) -> FsResult<Option<Vec<u8>>> {
        if st.node(ino)?.has_xattrs == Some(false) {
            return Ok(None);
        }
        let file = st.file_key(ino)?;
        if let Some(v) = self
            .store
            .get(KeySpace::Data, &schema::xattr_key(&file, name))?
        {
            return Ok(Some(v));
        }
        if st.node(ino)?.has_xattrs.is_none() {
            let (lo, hi) = schema::xattr_range(&file);
            let any = self
                .store
                .range(KeySpace::Data, &lo, Some(&hi))
                .next()
                .is_some();
            st.node_mut(ino)?.has_xattrs = Some(any);
        }
        Ok(None)
    }

    /// The table alone answers for a file known to have no extended
    /// attribute (the `security.capability` asked before a new file's
    /// first write, the ACLs asked on its first permission checks).
    pub(super) fn get_xattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        let st = self.lock_table();
        if st.node(ino)?.has_xattrs == Some(false) {
            return Err(Errno::ENODATA);
        }
        let mut st = self.settle(st);
        self.stored_xattr(&mut st, ino, name)?.ok_or(Errno::ENODATA)
    }

    /// The names, each followed by a NUL (as listxattr(2) returns them).
    pub(super) fn list_xattrs(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let st = self.lock();
        let file = st.file_key(ino)?;
        let (lo, hi) = schema::xattr_range(&file);
        let mut out = Vec::new();
        for item in self.store.range(KeySpace::Data, &lo, Some(&hi)) {
            let (k, _) = item?;
            out.extend_from_slice(k.get(file.len() + 1..).unwrap_or_default());
            out.push(0);
        }
        Ok(out)
    }

    pub(super) fn remove_xattr(&self, ino: Ino, name: &[u8]) -> FsResult<()> {
        let mut st = self.writer();
        st.check_attributes_change(ino)?;
        let key = schema::xattr_key(&st.file_key(ino)?, name);
        if self.store.get(KeySpace::Data, &key)?.is_none() {
            return Err(Errno::ENODATA);
        }
        let mut plan = Planned::new();
        plan.attr_mut(&st, ino)?.ctime = Timespec::now();
        if name == CAPABILITY_XATTR {
            st.node_mut(ino)?.has_capability = None;
        }
        let mut batch = WriteBatch::new();
        batch.delete(KeySpace::Data, &key);
        plan.put_record(&st, &mut batch, ino)?;
        st.write(&batch)?;
        st.commit(plan);
        Ok(())
    }
}
