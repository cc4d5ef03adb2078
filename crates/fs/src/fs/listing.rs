//! Directory listings: handles, and readdir over the directory's range
//! of entry keys (one leaf's worth scanned at a time).

use std::collections::VecDeque;

use betreefs_engine::KeySpace;

use super::state::{Handle, State};
use super::{decode, DirEntry, FileSystem, Ino};
use crate::error::{Errno, FsResult};
use crate::record::{S_IFDIR, S_IFMT};
use crate::schema;

pub(super) struct DirHandle {
    pub(super) ino: Ino,
    /// Escaped names returned so far, in order: offset `i + 3` resumes
    /// after `returned[i]` (1 and 2 are "." and "..").
    pub(super) returned: Vec<Vec<u8>>,
    /// Entries scanned but not yet returned (key, value), valid while the
    /// directory's version is `version`.
    pub(super) pending: VecDeque<(Vec<u8>, Vec<u8>)>,
    /// Where the scan continues after `pending` (None: the end).
    pub(super) scan_from: Option<Vec<u8>>,
    pub(super) version: u64,
    /// The directory's key when `pending` was scanned (a rename of the
    /// directory itself moves its entries to another prefix).
    pub(super) dir_key: Vec<u8>,
}

impl FileSystem {
    pub(super) fn open_dir(&self, ino: Ino) -> FsResult<u64> {
        let mut st = self.lock();
        let node = st.node(ino)?;
        if !node.attr.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        let version = node.dir_version;
        let dir_key = st.dir_key(ino)?;
        let (start, _) = schema::children_range(&dir_key);
        let fh = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(
            fh,
            Handle::Dir(Box::new(DirHandle {
                ino,
                returned: Vec::new(),
                pending: VecDeque::new(),
                scan_from: Some(start),
                version,
                dir_key,
            })),
        );
        Ok(fh)
    }

    pub(super) fn release_dir(&self, fh: u64) {
        self.lock().handles.remove(&fh);
    }

    /// Lists a directory from `offset`, calling `add` for each entry until
    /// it returns `true` (buffer full). With `plus`, entries carry their
    /// attributes and count as lookups (readdirplus fills the kernel's
    /// caches from the same scan).
    pub(super) fn list_dir(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<()> {
        let mut st = self.lock();
        let dir = st.dir_key(ino)?;
        let node = st.node(ino)?;
        let (parent, version) = (node.parent, node.dir_version);
        let Some(Handle::Dir(mut h)) = st.handles.remove(&fh) else {
            return Err(Errno::EBADF);
        };
        let result = self.fill_dir(
            &mut st, &mut h, &dir, ino, parent, version, offset, plus, add,
        );
        st.handles.insert(fh, Handle::Dir(h));
        result?;
        self.note_access(&mut st, ino)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn fill_dir(
        &self,
        st: &mut State,
        h: &mut DirHandle,
        dir: &[u8],
        ino: Ino,
        parent: Ino,
        version: u64,
        offset: u64,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<()> {
        debug_assert_eq!(h.ino, ino);
        if offset == 0
            && add(DirEntry {
                ino,
                offset: 1,
                file_type: S_IFDIR,
                name: b".",
                attr: None,
            })
        {
            return Ok(());
        }
        if offset <= 1
            && add(DirEntry {
                ino: parent,
                offset: 2,
                file_type: S_IFDIR,
                name: b"..",
                attr: None,
            })
        {
            return Ok(());
        }
        let index = offset.saturating_sub(2) as usize;
        if index > h.returned.len() {
            return Ok(()); // past the end (or an offset we never gave)
        }
        let continuing = index == h.returned.len() && h.version == version && h.dir_key == dir;
        if !continuing {
            h.returned.truncate(index);
            h.pending.clear();
            let (lo, _) = schema::children_range(dir);
            h.scan_from = Some(match h.returned.last() {
                None => lo,
                Some(esc) => [lo.as_slice(), esc, &[0]].concat(),
            });
            h.version = version;
            h.dir_key = dir.to_vec();
        }
        let (_, hi) = schema::children_range(dir);
        loop {
            if h.pending.is_empty() {
                let Some(from) = h.scan_from.take() else {
                    return Ok(());
                };
                // One leaf's worth at a time; the rest waits in the handle.
                let mut iter = self.store.range(KeySpace::Meta, &from, Some(&hi));
                let mut last = None;
                for item in iter.by_ref() {
                    let (k, v) = item?;
                    last = Some(k.clone());
                    h.pending.push_back((k, v));
                    if h.pending.len() >= 1024 {
                        break;
                    }
                }
                if h.pending.len() >= 1024 {
                    h.scan_from = last.map(|mut k| {
                        k.push(0);
                        k
                    });
                }
                if h.pending.is_empty() {
                    return Ok(());
                }
            }
            let Some((key, value)) = h.pending.front() else {
                continue;
            };
            let esc = key.get(dir.len() + 1..).unwrap_or_default().to_vec();
            let Some(name) = schema::child_name(dir, key) else {
                h.pending.pop_front();
                continue;
            };
            let record = decode(value)?;
            let next_offset = h.returned.len() as u64 + 3;
            let full = if plus {
                let (attr, target, home) = self.resolve(st, record)?;
                let attr = st.nodes.get(&attr.ino).map_or(attr, |n| n.attr.clone());
                let full = add(DirEntry {
                    ino: attr.ino,
                    offset: next_offset,
                    file_type: attr.file_type(),
                    name: &name,
                    attr: Some(&attr),
                });
                if !full {
                    st.add_lookup(ino, &name, attr, target, home);
                }
                full
            } else {
                add(DirEntry {
                    ino: record.ino(),
                    offset: next_offset,
                    file_type: record.mode() & S_IFMT,
                    name: &name,
                    attr: None,
                })
            };
            if full {
                return Ok(());
            }
            h.pending.pop_front();
            h.returned.push(esc);
        }
    }
}
