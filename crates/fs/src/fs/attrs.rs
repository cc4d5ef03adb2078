//! Attributes: setattr (modes, owners, sizes, times) and access times.

use betreefs_engine::WriteBatch;

use super::state::Home;
use super::state::State;
use super::{AtimePolicy, FileSystem, Ino, SetAttr, SetTime, FILE_SIZE_MAX, RELATIME_SECS};
use crate::error::{Errno, FsResult};
use crate::plan::truncate_blocks;
use crate::record::{Attr, Timespec, S_IFMT};

impl FileSystem {
    pub(super) fn set_attributes(&self, ino: Ino, set: &SetAttr) -> FsResult<Attr> {
        let mut st = self.lock();
        let now = Timespec::now();
        let before = st.node(ino)?.attr.clone();
        // A removed file (still known to the kernel) has nothing stored.
        let key = match st.node(ino)?.home {
            Home::Gone => None,
            _ => Some(st.file_key(ino)?),
        };
        let mut batch = WriteBatch::new();
        if let Some(size) = set.size {
            if before.is_dir() {
                return Err(Errno::EISDIR);
            }
            if size > FILE_SIZE_MAX {
                return Err(Errno::EFBIG);
            }
            let key = key.as_deref().ok_or(Errno::ENOENT)?;
            truncate_blocks(&mut batch, key, before.size, size);
        }
        let node = st.node_mut(ino)?;
        let a = &mut node.attr;
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
        let attributes_changed = set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || set.atime.is_some()
            || set.mtime.is_some()
            || set.ctime.is_some();
        if data_changed || attributes_changed {
            a.ctime = set.ctime.unwrap_or(now);
        }
        let after = a.clone();
        if after == before {
            return Ok(after);
        }
        if let Some(key) = &key {
            st.put_record_at(&mut batch, key, ino)?;
        }
        if let Err(e) = self.store.write(&batch) {
            st.node_mut(ino)?.attr = before;
            return Err(e.into());
        }
        Ok(after)
    }

    pub(super) fn note_access(&self, st: &mut State, ino: Ino) -> FsResult<()> {
        let now = Timespec::now();
        let a = &st.node(ino)?.attr;
        let due = match self.atime {
            AtimePolicy::Noatime => false,
            AtimePolicy::Strictatime => true,
            AtimePolicy::Relatime => {
                a.atime <= a.mtime || a.atime <= a.ctime || now.sec - a.atime.sec >= RELATIME_SECS
            }
        };
        if !due || st.node(ino)?.home == Home::Gone {
            return Ok(());
        }
        let before = st.node(ino)?.attr.atime;
        st.node_mut(ino)?.attr.atime = now;
        let mut batch = WriteBatch::new();
        st.put_record(&mut batch, ino)?;
        // An access time that cannot be stored (a full device) must not
        // fail the read that caused it.
        if let Err(e) = self.store.write(&batch) {
            tracing::debug!("access time of {ino} not updated: {e}");
            st.node_mut(ino)?.attr.atime = before;
        }
        Ok(())
    }
}
