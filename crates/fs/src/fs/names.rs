//! Names: finding entries, making and removing them, hard links and
//! rename (range renames of a file's or a directory's key ranges).

use std::ops::ControlFlow;

use betreefs_engine::{KeySpace, WriteBatch};

use super::key_bound;
use super::locking::Writer;
use super::planned::Planned;
use super::reservations::ReservedBlocks;
use super::state::{Home, State};
use super::{decode, name_check, Caller, FileSystem, Ino, RenameFlags, ENTRY_KEY_MAX, ROOT_INO};
use crate::acl;
use crate::error::{Errno, FsResult};
use crate::plan::{
    count_update, delete_back_pointer, dir_record_key, inode_record, move_file_data, move_subtree,
    purge_file, put_back_pointer,
};
use crate::record::{Attr, BackPointer, Record, Timespec, S_IFDIR, S_IFMT, S_IFREG};
use crate::schema;

/// What an entry key resolved to.
pub(super) struct Found {
    /// The directory key of the parent the entry was found in.
    pub(super) dir: Vec<u8>,
    pub(super) key: Vec<u8>,
    pub(super) record: Record,
}

impl Found {
    pub(super) fn ino(&self) -> Ino {
        self.record.ino()
    }
    pub(super) fn is_dir(&self) -> bool {
        self.record.mode() & S_IFMT == S_IFDIR
    }
}

impl FileSystem {
    /// The entry `name` of directory `parent`, if any.
    pub(super) fn find(&self, st: &State, parent: Ino, name: &[u8]) -> FsResult<Option<Found>> {
        name_check(name)?;
        if st.known_absent(parent, name) {
            return Ok(None);
        }
        let dir = st.dir_key(parent)?;
        if let Some(node) = st.named(parent, name) {
            // What the kernel is about to unlink or rename it has looked
            // up: the table has it, and the query of the store that was a
            // quarter of an unlink's time in rm -rf is not needed.
            let found = Found {
                key: schema::entry_key(&dir, name),
                dir,
                record: Record::Inode {
                    attr: Attr {
                        stored_blocks: None,
                        ..node.attr.clone()
                    },
                    target: node.target.clone(),
                },
            };
            debug_assert_eq!(
                self.query_entry(found.dir.clone(), name)
                    .ok()
                    .flatten()
                    .map(|stored| stored.record),
                Some(found.record.clone()),
                "the table's record of {name:?} in {parent} is not the store's"
            );
            return Ok(Some(found));
        }
        self.query_entry(dir, name)
    }

    /// [`FileSystem::find`] when the caller already has the parent's key.
    pub(super) fn find_in(
        &self,
        st: &State,
        parent: Ino,
        dir: Vec<u8>,
        name: &[u8],
    ) -> FsResult<Option<Found>> {
        name_check(name)?;
        if st.known_absent(parent, name) {
            return Ok(None);
        }
        self.query_entry(dir, name)
    }

    /// The stored entry `name` of the directory with key `dir`.
    fn query_entry(&self, dir: Vec<u8>, name: &[u8]) -> FsResult<Option<Found>> {
        let key = schema::entry_key(&dir, name);
        match self.store.get(KeySpace::Meta, &key)? {
            None => Ok(None),
            Some(v) => Ok(Some(Found {
                dir,
                key,
                record: decode(&v)?,
            })),
        }
    }

    /// The attributes behind a record (following a hard link).
    pub(super) fn resolve(&self, st: &State, record: Record) -> FsResult<(Attr, Vec<u8>, Home)> {
        let ino = record.ino();
        if let Record::Link { .. } = record {
            if let Some(n) = st.nodes.get(&ino) {
                return Ok((n.attr.clone(), n.target.clone(), Home::Inode));
            }
        }
        self.resolve_from_store(record)?
            .ok_or_else(|| missing_inode(ino))
    }

    /// [`FileSystem::resolve`] from the stored records alone, as a lookup
    /// reads them without the table (where the table has the inode,
    /// `State::add_lookup` keeps the table's copy). None: a hard link to
    /// an inode that is not stored.
    pub(super) fn resolve_from_store(
        &self,
        record: Record,
    ) -> FsResult<Option<(Attr, Vec<u8>, Home)>> {
        match record {
            Record::Inode { attr, target } => Ok(Some((attr, target, Home::Path))),
            Record::Link { ino, .. } => {
                match self.store.get(KeySpace::Meta, &schema::inode_key(ino))? {
                    Some(v) => match decode(&v)? {
                        Record::Inode { attr, target } => Ok(Some((attr, target, Home::Inode))),
                        Record::Link { .. } => Err(Errno::EIO),
                    },
                    None => Ok(None),
                }
            }
        }
    }

    /// `EPERM` when the entry is immutable or append-only: it may not be
    /// removed, replaced, renamed or linked (Linux's `may_delete`).
    pub(super) fn check_not_pinned(&self, st: &State, found: &Found) -> FsResult<()> {
        let pinned = match &found.record {
            Record::Inode { attr, .. } => attr.is_pinned(),
            Record::Link { .. } => self.resolve(st, found.record.clone())?.0.is_pinned(),
        };
        if pinned {
            return Err(Errno::EPERM);
        }
        Ok(())
    }

    /// Creates a new inode named `name` in `parent`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn make_node(
        &self,
        st: &mut Writer<'_>,
        parent: Ino,
        name: &[u8],
        mode: u32,
        rdev: u32,
        target: &[u8],
        caller: Caller,
    ) -> FsResult<Attr> {
        let dir = st.dir_key(parent)?;
        name_check(name)?;
        let key = schema::entry_key(&dir, name);
        if key.len() > ENTRY_KEY_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        st.check_dir_change(parent, false)?;
        let parent_key = dir_record_key(&dir);
        if self.find_in(st, parent, dir, name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        let is_dir = mode & S_IFMT == S_IFDIR;
        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let mut plan = Planned::new();
        let ino = plan.allocate_ino(st, &mut batch);
        let (attr, inherited_acls) =
            self.new_inode(st, &mut batch, ino, &key, parent, mode, caller, now)?;
        let attr = Attr {
            rdev,
            size: target.len() as u64,
            ..attr
        };
        batch.put(KeySpace::Meta, &key, &inode_record(&attr, target));
        put_back_pointer(&mut batch, attr.ino, parent, name);
        plan.touch_dir(st, parent, now, if is_dir { 1 } else { 0 }, 1)?;
        plan.put_record_at(st, &mut batch, &parent_key, parent)?;
        count_update(&mut batch, 1);
        st.write(&batch)?;
        st.commit(plan);
        st.note_added(parent, name);
        st.add_lookup(parent, name, attr.clone(), target.to_vec(), Home::Path);
        st.resize_node(attr.ino, |n| {
            n.has_xattrs = Some(inherited_acls);
            if is_dir {
                n.child_names = Some(Default::default());
                n.entries = Some(0);
            }
        });
        Ok(attr)
    }

    /// The attributes of new inode `ino` of `mode` in `parent`, with the
    /// ACLs it inherits put under `file_key`: the directory's default ACL
    /// or the caller's umask, and the BSD group under a set-group-ID
    /// directory. Returns the attributes and whether ACLs were stored.
    #[allow(clippy::too_many_arguments)]
    fn new_inode(
        &self,
        st: &mut State,
        batch: &mut WriteBatch,
        ino: Ino,
        file_key: &[u8],
        parent: Ino,
        mode: u32,
        caller: Caller,
        now: Timespec,
    ) -> FsResult<(Attr, bool)> {
        let is_dir = mode & S_IFMT == S_IFDIR;
        // The directory's default ACL, or the caller's umask.
        let parent_default = if mode & S_IFMT == libc::S_IFLNK {
            None
        } else {
            self.stored_xattr(st, parent, acl::DEFAULT_XATTR)?
        };
        // A stored default ACL that does not decode is damage, not bad input.
        let inherited =
            acl::inherit(parent_default.as_deref(), mode, caller.umask).map_err(|_| Errno::EIO)?;
        let mut mode = inherited.mode;
        let parent_attr = &st.node(parent)?.attr;
        // BSD group semantics under a set-group-ID directory.
        let gid = if parent_attr.mode & libc::S_ISGID != 0 {
            if is_dir {
                mode |= libc::S_ISGID;
            }
            parent_attr.gid
        } else {
            caller.gid
        };
        let acls = [
            (acl::ACCESS_XATTR, &inherited.access),
            (acl::DEFAULT_XATTR, &inherited.default),
        ];
        let mut stored = false;
        for (name, value) in acls {
            if let Some(value) = value {
                batch.put(KeySpace::Data, &schema::xattr_key(file_key, name), value);
                stored = true;
            }
        }
        Ok((Attr::new(ino, mode, caller.uid, gid, now), stored))
    }

    /// An unnamed open file in `parent` (O_TMPFILE): it lives under its
    /// inode key with no links, listed as an orphan so that a crash before
    /// its last close (or a `link` naming it) removes it. The directory
    /// itself does not change.
    pub(super) fn make_tmpfile(
        &self,
        parent: Ino,
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> FsResult<(Attr, u64)> {
        let mut st = self.writer();
        if !st.node(parent)?.attr.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        st.check_dir_change(parent, false)?;
        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let mut plan = Planned::new();
        let ino = plan.allocate_ino(&st, &mut batch);
        let key = schema::inode_key(ino);
        let (mut attr, acls) = self.new_inode(
            &mut st,
            &mut batch,
            ino,
            &key,
            parent,
            S_IFREG | (mode & 0o7777),
            caller,
            now,
        )?;
        attr.nlink = 0;
        batch.put(KeySpace::Meta, &key, &inode_record(&attr, &[]));
        batch.put(KeySpace::Meta, &schema::orphan_key(ino), &[]);
        count_update(&mut batch, 1);
        st.write(&batch)?;
        st.commit(plan);
        st.add_lookup(parent, &[], attr.clone(), Vec::new(), Home::Inode);
        st.node_mut(ino)?.has_xattrs = Some(acls);
        let fh = Self::add_file_handle(&mut st, ino, flags)?;
        Ok((attr, fh))
    }

    /// Removes what an entry names, for unlink, rmdir and rename over it.
    /// `delete_entry` is false when the caller overwrites the entry key.
    /// `sub` is the directory key the entry would have as a directory.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn remove_entry(
        &self,
        st: &State,
        plan: &mut Planned,
        batch: &mut WriteBatch,
        found: &Found,
        sub: &[u8],
        now: Timespec,
        delete_entry: bool,
    ) -> FsResult<ReservedBlocks> {
        let ino = found.ino();
        if delete_entry {
            batch.delete(KeySpace::Meta, &found.key);
        }
        if found.is_dir() {
            let (lo, hi) = schema::subtree_range(sub);
            for ks in KeySpace::ALL {
                batch.range_delete(ks, &lo, &hi);
            }
            let (lo, hi) = schema::file_range(&found.key);
            batch.range_delete(KeySpace::Data, &lo, &hi);
            count_update(batch, -1);
            delete_back_pointer(batch, ino);
            plan.mark_unlinked(st, ino, Home::Gone, now);
            return Ok(ReservedBlocks::default());
        }
        let open = st.nodes.get(&ino).is_some_and(|n| n.opens > 0);
        let inode_key = schema::inode_key(ino);
        let mut released = ReservedBlocks::default();
        match &found.record {
            Record::Inode { attr, target } => {
                delete_back_pointer(batch, ino);
                if open {
                    // Keep the data readable until the last close.
                    move_file_data(batch, &found.key, &inode_key);
                    let mut attr = attr.clone();
                    attr.nlink = 0;
                    attr.ctime = now;
                    batch.put(KeySpace::Meta, &inode_key, &inode_record(&attr, target));
                    batch.put(KeySpace::Meta, &schema::orphan_key(ino), &[]);
                    plan.mark_unlinked(st, ino, Home::Inode, now);
                } else {
                    released = self.release_all_reservations(batch, Some(attr), &found.key)?;
                    let (lo, hi) = schema::file_range(&found.key);
                    batch.range_delete(KeySpace::Data, &lo, &hi);
                    count_update(batch, -1);
                    plan.mark_unlinked(st, ino, Home::Gone, now);
                }
            }
            Record::Link { .. } => {
                let (mut attr, target, _) = self.resolve(st, found.record.clone())?;
                attr.nlink = attr.nlink.saturating_sub(1);
                attr.ctime = now;
                if attr.nlink > 0 {
                    batch.put(KeySpace::Meta, &inode_key, &inode_record(&attr, &target));
                } else if open {
                    batch.put(KeySpace::Meta, &inode_key, &inode_record(&attr, &target));
                    batch.put(KeySpace::Meta, &schema::orphan_key(ino), &[]);
                } else {
                    released = self.release_all_reservations(batch, Some(&attr), &inode_key)?;
                    purge_file(batch, &inode_key);
                    count_update(batch, -1);
                }
                if st.nodes.contains_key(&ino) {
                    *plan.attr_mut(st, ino)? = attr.clone();
                    if attr.nlink == 0 && !open {
                        plan.set_home(st, ino, Home::Gone)?;
                    }
                }
            }
        }
        Ok(released)
    }

    pub(super) fn remove_and_commit(
        &self,
        st: &mut Writer<'_>,
        parent: Ino,
        name: &[u8],
        found: Found,
    ) -> FsResult<()> {
        st.check_dir_change(parent, true)?;
        self.check_not_pinned(st, &found)?;
        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let mut plan = Planned::new();
        let is_dir = found.is_dir();
        let sub = schema::child_dir_key(&found.dir, name);
        let released = self.remove_entry(st, &mut plan, &mut batch, &found, &sub, now, true)?;
        plan.touch_dir(st, parent, now, if is_dir { -1 } else { 0 }, -1)?;
        plan.put_record_at(st, &mut batch, &dir_record_key(&found.dir), parent)?;
        st.write_reserving(&batch, released.reservation())?;
        st.commit(plan);
        st.remember_absent(parent, name);
        // A last close while the batch went in saw the file still named.
        self.free_if_closed(st, found.ino())
    }

    pub(super) fn dir_is_empty(&self, dir: &[u8]) -> FsResult<bool> {
        let (lo, hi) = schema::children_range(dir);
        let mut empty = true;
        self.store
            .visit_range_while(KeySpace::Meta, &lo, &hi, &mut |_, _| {
                empty = false;
                ControlFlow::Break(())
            })?;
        Ok(empty)
    }

    /// [`FileSystem::dir_is_empty`] of directory `ino` (whose directory
    /// key is `dir`), from its count of entries when the table knows it
    /// (`Node::entries`). Debug builds check the count against the tree.
    pub(super) fn dir_is_empty_known(&self, st: &State, ino: Ino, dir: &[u8]) -> FsResult<bool> {
        let Some(entries) = st.nodes.get(&ino).and_then(|n| n.entries) else {
            return self.dir_is_empty(dir);
        };
        #[cfg(debug_assertions)]
        {
            let stored = self.dir_is_empty(dir)?;
            assert_eq!(
                entries == 0,
                stored,
                "inode {ino}: the table counts {entries} entries, the tree {}",
                if stored { "none" } else { "some" }
            );
        }
        Ok(entries == 0)
    }

    /// The longest metadata key below a directory (for rename's key
    /// limit).
    pub(super) fn longest_key_below(&self, dir: &[u8]) -> FsResult<usize> {
        let (lo, hi) = schema::subtree_range(dir);
        self.longest_key_in(&lo, &hi)
    }

    pub(super) fn rename_in_table(
        &self,
        st: &mut State,
        ino: Ino,
        new_parent: Ino,
        new_name: &[u8],
    ) {
        if st.nodes.get(&ino).is_none_or(|n| n.home == Home::Inode) {
            return;
        }
        if let Some(old_parent) = st.move_node(ino, new_parent, new_name) {
            st.move_pin(old_parent, new_parent);
        }
    }

    /// lookup(2)'s half in the daemon. A name the table knows absent is
    /// answered from the table alone (the kernel holds the directory
    /// locked while a name in it is made, so no write in flight can be
    /// making this one). Otherwise the entry (and the inode a hard link
    /// names) is read without the table's lock, so that a lookup waiting
    /// for the device holds up no other request; what it found stands if
    /// no batch was written meanwhile (`Store::batches_applied`, taken and
    /// checked with no write in flight: `super::locking`), else it is read
    /// again with the lock held — from the cache by then.
    pub(super) fn lookup_entry(&self, parent: Ino, name: &[u8]) -> FsResult<Attr> {
        name_check(name)?;
        let (dir, seen) = {
            let mut st = self.lock_table();
            if st.known_absent(parent, name) {
                st.remember_absent(parent, name);
                return Err(Errno::ENOENT);
            }
            let st = self.settle(st);
            (st.dir_key(parent)?, self.store.batches_applied())
        };
        let unlocked = self.query_entry(dir, name).and_then(|found| match found {
            Some(found) => {
                let ino = found.ino();
                Ok(Some((ino, self.resolve_from_store(found.record)?)))
            }
            None => Ok(None),
        });
        let mut st = self.lock();
        let found = if self.store.batches_applied() == seen {
            match unlocked? {
                Some((ino, Some(resolved))) => Some((ino, resolved)),
                Some((ino, None)) => return Err(missing_inode(ino)),
                None => None,
            }
        } else {
            match self.find(&st, parent, name)? {
                Some(found) => Some((found.ino(), self.resolve(&st, found.record)?)),
                None => None,
            }
        };
        let Some((ino, (attr, target, home))) = found else {
            st.remember_absent(parent, name);
            return Err(Errno::ENOENT);
        };
        st.add_lookup(parent, name, attr, target, home);
        self.attr_for_kernel(&mut st, ino)
    }

    /// Finds inode `ino` by number alone (the kernel decoding a file
    /// handle asks for "." in it): from the table, from the inode key of a
    /// file kept by number, or by following back pointers up to an inode
    /// the table has, loading the entries on the way. `ESTALE` when it is
    /// gone: inode numbers are never reused, so a handle of a removed file
    /// never finds another one.
    pub(super) fn lookup_by_number(&self, ino: Ino) -> FsResult<Attr> {
        let mut st = self.lock();
        self.load_by_number(&mut st, ino)?;
        st.node_mut(ino)?.lookups += 1;
        self.attr_for_kernel(&mut st, ino)
    }

    /// The parent of directory `ino` (the kernel reconnecting a directory
    /// found by handle asks for ".." in it).
    pub(super) fn lookup_parent(&self, ino: Ino) -> FsResult<Attr> {
        let mut st = self.lock();
        let node = st.node(ino)?;
        if !node.attr.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        let parent = if ino == ROOT_INO {
            ROOT_INO
        } else {
            node.parent
        };
        st.node_mut(parent)?.lookups += 1;
        self.attr_for_kernel(&mut st, parent)
    }

    pub(super) fn load_by_number(&self, st: &mut State, ino: Ino) -> FsResult<()> {
        if let Some(n) = st.nodes.get(&ino) {
            // No name left: stale, as below for one not in the table. The
            // kernel asks only when it holds no inode for the handle, so a
            // file still open through the kernel never gets here; one the
            // table counts as open may be only waiting for its release,
            // which the kernel sends after close returns.
            return match n.home {
                Home::Gone => Err(Errno::ESTALE),
                _ if n.attr.nlink == 0 => Err(Errno::ESTALE),
                _ => Ok(()),
            };
        }
        if let Some(v) = self.store.get(KeySpace::Meta, &schema::inode_key(ino))? {
            let Record::Inode { attr, target } = decode(&v)? else {
                return Err(Errno::EIO);
            };
            // No name left and not open here: it is being freed.
            if attr.nlink == 0 {
                return Err(Errno::ESTALE);
            }
            st.add_unreferenced(ROOT_INO, &[], attr, target, Home::Inode);
            return Ok(());
        }
        // Named by a path: back pointers up to a directory in the table.
        let mut chain = Vec::new();
        let mut cur = ino;
        while !st.nodes.contains_key(&cur) {
            if chain.len() > schema::PATH_MAX {
                tracing::error!("back pointers of inode {ino} loop");
                return Err(Errno::EIO);
            }
            let key = schema::back_pointer_key(cur);
            let Some(v) = self.store.get(KeySpace::Meta, &key)? else {
                return Err(Errno::ESTALE);
            };
            let bp = BackPointer::decode(&v).map_err(|e| {
                tracing::error!("inode {cur}: {}", e.0);
                Errno::EIO
            })?;
            let parent = bp.parent;
            chain.push((cur, bp));
            cur = parent;
        }
        let mut loaded = Vec::new();
        let result = (|| {
            for (here, bp) in chain.iter().rev() {
                let found = self.find(st, bp.parent, &bp.name)?;
                let found = found.filter(|f| f.ino() == *here).ok_or(Errno::ESTALE)?;
                let (attr, target, home) = self.resolve(st, found.record)?;
                st.add_unreferenced(bp.parent, &bp.name, attr, target, home);
                loaded.push(*here);
            }
            Ok(())
        })();
        if result.is_err() {
            // Ancestors loaded for nothing leave the table again.
            for here in loaded.into_iter().rev() {
                st.drop_if_unused(here);
            }
        }
        result
    }

    pub(super) fn link_entry(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> FsResult<Attr> {
        let mut st = self.writer();
        let node = st.node(ino)?;
        if node.attr.is_dir() {
            return Err(Errno::EPERM);
        }
        if node.attr.nlink >= u32::MAX - 1 {
            return Err(Errno::EMLINK);
        }
        if node.attr.is_pinned() {
            return Err(Errno::EPERM);
        }
        st.check_dir_change(new_parent, false)?;
        let dir = st.dir_key(new_parent)?;
        name_check(new_name)?;
        let new_key = schema::entry_key(&dir, new_name);
        if new_key.len() > ENTRY_KEY_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        let parent_key = dir_record_key(&dir);
        if self.find_in(&st, new_parent, dir, new_name)?.is_some() {
            return Err(Errno::EEXIST);
        }
        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let mut plan = Planned::new();
        let was_home = st.node(ino)?.home;
        let inode_key = schema::inode_key(ino);
        // An O_TMPFILE file gets its first name: no longer an orphan.
        if was_home == Home::Inode && st.node(ino)?.attr.nlink == 0 {
            batch.delete(KeySpace::Meta, &schema::orphan_key(ino));
        }
        if was_home == Home::Path {
            // First extra name: the file moves under its inode number.
            let old_key = st.file_key(ino)?;
            move_file_data(&mut batch, &old_key, &inode_key);
            delete_back_pointer(&mut batch, ino);
            let mode = st.node(ino)?.attr.mode;
            batch.put(
                KeySpace::Meta,
                &old_key,
                &Record::Link { ino, mode }.encode(),
            );
        }
        let attr = plan.attr_mut(&st, ino)?;
        attr.nlink += 1;
        attr.ctime = now;
        let mode = attr.mode;
        plan.set_home(&st, ino, Home::Inode)?;
        plan.put_record_at(&st, &mut batch, &inode_key, ino)?;
        batch.put(
            KeySpace::Meta,
            &new_key,
            &Record::Link { ino, mode }.encode(),
        );
        plan.touch_dir(&st, new_parent, now, 0, 1)?;
        plan.put_record_at(&st, &mut batch, &parent_key, new_parent)?;
        st.write(&batch)?;
        st.commit(plan);
        st.note_added(new_parent, new_name);
        let node = st.node(ino)?;
        let (attr, target) = (node.attr.clone(), node.target.clone());
        st.add_lookup(new_parent, new_name, attr.clone(), target, Home::Inode);
        Ok(attr)
    }

    pub(super) fn rename_entry(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameFlags,
    ) -> FsResult<()> {
        let mut st = self.writer();
        if flags.exchange && (flags.noreplace || flags.whiteout.is_some()) {
            return Err(Errno::EINVAL);
        }
        let src = self.find(&st, parent, name)?.ok_or(Errno::ENOENT)?;
        name_check(new_name)?;
        let dst_dir = st.dir_key(new_parent)?;
        let src_dir = src.dir.clone();
        let dst_key = schema::entry_key(&dst_dir, new_name);
        if dst_key.len() > ENTRY_KEY_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        if dst_key == src.key {
            return Ok(());
        }
        let dst = self.find_in(&st, new_parent, dst_dir.clone(), new_name)?;
        if flags.noreplace && dst.is_some() {
            return Err(Errno::EEXIST);
        }
        if flags.exchange && dst.is_none() {
            return Err(Errno::ENOENT);
        }
        // Immutable or append-only entries and directories (Linux's
        // may_delete on both ends; an exchange removes from both).
        self.check_not_pinned(&st, &src)?;
        st.check_dir_change(parent, true)?;
        st.check_dir_change(new_parent, dst.is_some())?;
        if let Some(d) = &dst {
            self.check_not_pinned(&st, d)?;
        }
        // A directory cannot move into its own subtree.
        if src.is_dir() && st.is_within(new_parent, src.ino()) {
            return Err(Errno::EINVAL);
        }
        if let Some(d) = &dst {
            if flags.exchange {
                if d.is_dir() && st.is_within(parent, d.ino()) {
                    return Err(Errno::EINVAL);
                }
            } else {
                if d.ino() == src.ino() {
                    return Ok(()); // two names of one file: nothing to do
                }
                match (src.is_dir(), d.is_dir()) {
                    (true, false) => return Err(Errno::ENOTDIR),
                    (false, true) => return Err(Errno::EISDIR),
                    (true, true) => {
                        let d_dir = schema::child_dir_key(&dst_dir, new_name);
                        if !self.dir_is_empty_known(&st, d.ino(), &d_dir)? {
                            return Err(Errno::ENOTEMPTY);
                        }
                    }
                    (false, false) => {}
                }
            }
        }
        let src_sub = schema::child_dir_key(&src_dir, name);
        let dst_sub = schema::child_dir_key(&dst_dir, new_name);
        // Keys below a moved directory grow by the difference in prefix:
        // within the key limit if the key bound says so, else as the
        // longest key below shows.
        let mut longest = |is_dir: bool, from: &[u8], to: &[u8]| -> FsResult<()> {
            let growth = to.len().saturating_sub(from.len());
            if !is_dir || growth == 0 || st.key_bound.admits_growth(growth) {
                return Ok(());
            }
            if self.longest_key_below(from)? + growth > ENTRY_KEY_MAX {
                return Err(Errno::ENAMETOOLONG);
            }
            if st.key_bound.worth_finding_again() {
                // Grown by many renames' lengthenings: found again, so
                // that the renames after this one need no walk (written
                // with this rename's batch).
                let found = key_bound::rounded(self.longest_meta_key()?);
                st.key_bound.known = Some(found);
            }
            Ok(())
        };
        longest(src.is_dir(), &src_sub, &dst_sub)?;
        if flags.exchange {
            if let Some(d) = &dst {
                longest(d.is_dir(), &dst_sub, &src_sub)?;
            }
        }

        let now = Timespec::now();
        let mut batch = WriteBatch::new();
        let mut plan = Planned::new();
        let mut released = ReservedBlocks::default();
        let src_ino = src.ino();
        let mut src_record = src.record.clone();
        if let Record::Inode { attr, .. } = &mut src_record {
            attr.ctime = now;
        }
        if st.nodes.contains_key(&src_ino) {
            plan.attr_mut(&st, src_ino)?.ctime = now;
        }
        if flags.exchange {
            let Some(d) = &dst else {
                return Err(Errno::ENOENT);
            };
            let mut dst_record = d.record.clone();
            if let Record::Inode { attr, .. } = &mut dst_record {
                attr.ctime = now;
            }
            if st.nodes.contains_key(&d.ino()) {
                plan.attr_mut(&st, d.ino())?.ctime = now;
            }
            // Park both in scratch space, then move each into the other's place.
            let [a, b] = schema::SCRATCH_KEYS;
            stage_move(&mut batch, &src, &src_sub, a);
            stage_move(&mut batch, d, &dst_sub, b);
            finish_move(&mut batch, &src, a, &dst_key, &dst_sub, &src_record);
            finish_move(&mut batch, d, b, &src.key, &src_sub, &dst_record);
            for (f, to_parent, to_name) in [(&src, new_parent, new_name), (d, parent, name)] {
                if matches!(f.record, Record::Inode { .. }) {
                    put_back_pointer(&mut batch, f.ino(), to_parent, to_name);
                }
            }
            if parent != new_parent && src.is_dir() != d.is_dir() {
                let delta = if src.is_dir() { 1 } else { -1 };
                plan.touch_dir(&st, parent, now, -delta, 0)?;
                plan.touch_dir(&st, new_parent, now, delta, 0)?;
            } else {
                plan.touch_dir(&st, parent, now, 0, 0)?;
                plan.touch_dir(&st, new_parent, now, 0, 0)?;
            }
        } else {
            if let Some(d) = &dst {
                released =
                    self.remove_entry(&st, &mut plan, &mut batch, d, &dst_sub, now, false)?;
            }
            batch.delete(KeySpace::Meta, &src.key);
            batch.put(KeySpace::Meta, &dst_key, &src_record.encode());
            if matches!(src.record, Record::Inode { .. }) {
                move_file_data(&mut batch, &src.key, &dst_key);
                put_back_pointer(&mut batch, src_ino, new_parent, new_name);
            }
            if src.is_dir() {
                move_subtree(&mut batch, &src_sub, &dst_sub);
            }
            // overlayfs's whiteout: a 0/0 character device takes the old
            // name in the same batch, after everything of the old name
            // moved (its inherited ACLs must not move with it).
            if let Some(caller) = flags.whiteout {
                let ino = plan.allocate_ino(&st, &mut batch);
                let (whiteout, _) = self.new_inode(
                    &mut st,
                    &mut batch,
                    ino,
                    &src.key,
                    parent,
                    libc::S_IFCHR,
                    caller,
                    now,
                )?;
                batch.put(KeySpace::Meta, &src.key, &inode_record(&whiteout, &[]));
                put_back_pointer(&mut batch, whiteout.ino, parent, name);
                count_update(&mut batch, 1);
            }
            let replaced_dir = dst.as_ref().is_some_and(Found::is_dir);
            // The old name goes (a whiteout takes its place); the new one
            // comes unless it replaced an entry.
            let left = if flags.whiteout.is_some() { 0 } else { -1 };
            let arrived = if dst.is_some() { 0 } else { 1 };
            if src.is_dir() && parent != new_parent {
                plan.touch_dir(&st, parent, now, -1, left)?;
                let nlink = if replaced_dir { 0 } else { 1 };
                plan.touch_dir(&st, new_parent, now, nlink, arrived)?;
            } else {
                plan.touch_dir(&st, parent, now, 0, left)?;
                let nlink = if replaced_dir { -1 } else { 0 };
                plan.touch_dir(&st, new_parent, now, nlink, arrived)?;
            }
        }
        plan.put_record_at(&st, &mut batch, &dir_record_key(&src_dir), parent)?;
        if new_parent != parent {
            plan.put_record_at(&st, &mut batch, &dir_record_key(&dst_dir), new_parent)?;
        }
        st.write_reserving(&batch, released.reservation())?;
        st.commit(plan);
        // The table follows: names move, a replaced node is gone.
        let dst_ino = dst.as_ref().map(Found::ino);
        if let (Some(replaced), false) = (dst_ino, flags.exchange) {
            // A last close while the batch went in saw it still named.
            self.free_if_closed(&mut st, replaced)?;
        }
        self.rename_in_table(&mut st, src_ino, new_parent, new_name);
        if flags.exchange {
            if let Some(d) = dst_ino {
                self.rename_in_table(&mut st, d, parent, name);
            }
        } else if flags.whiteout.is_some() {
            st.note_added(parent, name);
        } else {
            st.remember_absent(parent, name);
        }
        st.note_added(new_parent, new_name);
        Ok(())
    }
}

/// First half of an exchange: everything of `f` moves to the scratch pair
/// `(file prefix, subtree prefix)`.
fn stage_move(batch: &mut WriteBatch, f: &Found, sub: &[u8], scratch: [&[u8]; 2]) {
    if matches!(f.record, Record::Inode { .. }) {
        move_file_data(batch, &f.key, scratch[0]);
    }
    if f.is_dir() {
        move_subtree(batch, sub, scratch[1]);
    }
    batch.delete(KeySpace::Meta, &f.key);
}

/// Second half: from the scratch pair to its new entry key and subtree.
fn finish_move(
    batch: &mut WriteBatch,
    f: &Found,
    scratch: [&[u8]; 2],
    key: &[u8],
    sub: &[u8],
    record: &Record,
) {
    batch.put(KeySpace::Meta, key, &record.encode());
    if matches!(f.record, Record::Inode { .. }) {
        move_file_data(batch, scratch[0], key);
    }
    if f.is_dir() {
        move_subtree(batch, scratch[1], sub);
    }
}

/// A hard link whose inode is not stored: the image is damaged.
fn missing_inode(ino: Ino) -> Errno {
    tracing::error!("hard link to missing inode {ino}");
    Errno::EIO
}
