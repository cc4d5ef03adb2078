//! Extended attributes: one key each in the data key space, after the
//! file's data blocks.

use betreefs_engine::{KeySpace, WriteBatch};

use super::{FileSystem, Ino, CAPABILITY_XATTR, XATTR_SIZE_MAX};
use crate::error::{Errno, FsResult};
use crate::record::Timespec;
use crate::schema;

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
        // An ACL the kernel does not enforce would be a lie to the user who
        // set it (and a hole, if it was meant to shut someone out).
        if name.starts_with(b"system.posix_acl_") {
            return Err(Errno::EOPNOTSUPP);
        }
        let mut st = self.lock();
        let key = schema::xattr_key(&st.file_key(ino)?, name);
        if flags & (libc::XATTR_CREATE | libc::XATTR_REPLACE) != 0 {
            let exists = self.store.get(KeySpace::Data, &key)?.is_some();
            if exists && flags & libc::XATTR_CREATE != 0 {
                return Err(Errno::EEXIST);
            }
            if !exists && flags & libc::XATTR_REPLACE != 0 {
                return Err(Errno::ENODATA);
            }
        }
        let now = Timespec::now();
        let node = st.node_mut(ino)?;
        node.attr.ctime = now;
        node.has_xattrs = Some(true);
        if name == CAPABILITY_XATTR {
            node.has_capability = None;
        }
        let mut batch = WriteBatch::new();
        batch.put(KeySpace::Data, &key, value);
        st.put_record(&mut batch, ino)?;
        self.store.write(&batch)?;
        Ok(())
    }

    pub(super) fn get_xattr(&self, ino: Ino, name: &[u8]) -> FsResult<Vec<u8>> {
        let mut st = self.lock();
        if st.node(ino)?.has_xattrs == Some(false) {
            return Err(Errno::ENODATA);
        }
        let file = st.file_key(ino)?;
        match self
            .store
            .get(KeySpace::Data, &schema::xattr_key(&file, name))?
        {
            Some(v) => Ok(v),
            None => {
                // Learn whether there are any, so later misses (the kernel
                // asks for security.capability on every write) cost nothing.
                if st.node(ino)?.has_xattrs.is_none() {
                    let (lo, hi) = schema::xattr_range(&file);
                    let any = self
                        .store
                        .range(KeySpace::Data, &lo, Some(&hi))
                        .next()
                        .is_some();
                    st.node_mut(ino)?.has_xattrs = Some(any);
                }
                Err(Errno::ENODATA)
            }
        }
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
        let mut st = self.lock();
        let key = schema::xattr_key(&st.file_key(ino)?, name);
        if self.store.get(KeySpace::Data, &key)?.is_none() {
            return Err(Errno::ENODATA);
        }
        let node = st.node_mut(ino)?;
        node.attr.ctime = Timespec::now();
        if name == CAPABILITY_XATTR {
            node.has_capability = None;
        }
        let mut batch = WriteBatch::new();
        batch.delete(KeySpace::Data, &key);
        st.put_record(&mut batch, ino)?;
        self.store.write(&batch)?;
        Ok(())
    }
}
