//! Directory listings without per-open state: the offset of an entry (its
//! cookie, what telldir returns and seekdir takes) is a hash of its name,
//! so a listing resumes after any entry it returned, from any open of the
//! directory, in any order, while entries come and go. Names are listed in
//! key order; resuming seeks to the key after the name the cookie stands
//! for, found in a window of recently returned cookies (sequential reads
//! always hit it) or, failing that, by scanning the directory for the
//! name with that hash.
//!
//! Offsets: 0 is the start, 1 resumes after ".", 2 after "..", and every
//! other cookie lies in 3..2^63 (the kernel's `loff_t` is signed).

use std::collections::VecDeque;
use std::ops::ControlFlow;

use betreefs_engine::KeySpace;
use rustc_hash::FxHashMap;

use super::state::{Home, State};
use super::{decode, DirEntry, FileSystem, Ino};
use crate::error::FsResult;
use crate::record::{Attr, Record, S_IFDIR, S_IFMT};
use crate::schema;

/// Cookies remembered per directory, and directories remembered.
const COOKIES_PER_DIR: usize = 4096;
const COOKIE_DIRS: usize = 256;

/// The cookie of the entry whose escaped name is `esc`: FNV-1a with a
/// final mix, stable across mounts and versions (so NFS clients may keep
/// them), mapped into 3..2^63.
pub fn dir_cookie(esc: &[u8]) -> u64 {
    let mut h = esc.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    // splitmix64's finalizer: spreads similar names apart.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    3 + h % ((1u64 << 63) - 3)
}

/// Cookies returned lately in one directory and the escaped names they
/// stand for, in the order returned: a run of plain arrays, so that
/// remembering an entry costs no hashing and no allocation of its own (a
/// map of cookie to name was a tenth of the daemon's work listing a tree).
#[derive(Default)]
struct CookieRun {
    /// (cookie, end of its name in `names`).
    cookies: Vec<(u64, u32)>,
    names: Vec<u8>,
}

impl CookieRun {
    /// The name of `cookie`, the latest returned first.
    fn name(&self, cookie: u64) -> Option<&[u8]> {
        let at = self.cookies.iter().rposition(|&(c, _)| c == cookie)?;
        let start = at
            .checked_sub(1)
            .and_then(|i| self.cookies.get(i))
            .map_or(0, |&(_, end)| end as usize);
        let (_, end) = *self.cookies.get(at)?;
        self.names.get(start..end as usize)
    }

    fn push(&mut self, cookie: u64, esc: &[u8]) {
        if self.cookies.capacity() == 0 {
            // Room for a directory of average size at once.
            self.cookies.reserve(CHILDREN_RESERVED);
            self.names.reserve(CHILDREN_RESERVED * 16);
        }
        self.names.extend_from_slice(esc);
        // Names are at most 255 bytes escaped a few times over and a run
        // holds at most half of COOKIES_PER_DIR of them: far below 2^32.
        let end = u32::try_from(self.names.len()).unwrap_or(u32::MAX);
        self.cookies.push((cookie, end));
    }

    fn clear(&mut self) {
        self.cookies.clear();
        self.names.clear();
    }
}

/// The cookies of one directory: the latest run and the one before it,
/// so that the last [`COOKIES_PER_DIR`] / 2 to [`COOKIES_PER_DIR`]
/// entries returned are known.
#[derive(Default)]
struct DirCookies {
    latest: CookieRun,
    older: CookieRun,
    /// A listing gave the directory's last entry with this cookie while
    /// the store had taken this many batches (`Store::batches_applied`):
    /// asked to go on from it with the count unchanged, nothing is left
    /// to list. The kernel asks once more after every directory's last
    /// entry (an empty reply is how a listing ends), and that ask needs
    /// no visit to the store (`find` makes one per directory).
    end: Option<ListedEnd>,
}

/// See [`DirCookies::end`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ListedEnd {
    cookie: u64,
    batches: u64,
}

impl DirCookies {
    fn name(&self, cookie: u64) -> Option<&[u8]> {
        self.latest.name(cookie).or_else(|| self.older.name(cookie))
    }

    fn remember(&mut self, cookie: u64, esc: &[u8]) {
        if self.latest.cookies.len() >= COOKIES_PER_DIR / 2 {
            std::mem::swap(&mut self.latest, &mut self.older);
            self.latest.clear();
        }
        self.latest.push(cookie, esc);
    }
}

/// Recently returned cookies, per directory (bounded both ways).
#[derive(Default)]
pub(super) struct CookieWindow {
    dirs: FxHashMap<Ino, DirCookies>,
    order: VecDeque<Ino>,
}

impl CookieWindow {
    fn name(&self, dir: Ino, cookie: u64) -> Option<&[u8]> {
        self.dirs.get(&dir)?.name(cookie)
    }

    fn remember(&mut self, dir: Ino, cookie: u64, esc: &[u8]) {
        // Once per entry listed: one lookup for a directory already here.
        if let Some(d) = self.dirs.get_mut(&dir) {
            d.remember(cookie, esc);
            return;
        }
        self.dir_mut(dir).remember(cookie, esc);
    }

    /// A listing of `dir` gave its last entry (cookie `cookie`, 2 for an
    /// empty directory) with the store at `batches`.
    fn note_end(&mut self, dir: Ino, cookie: u64, batches: u64) {
        self.dir_mut(dir).end = Some(ListedEnd { cookie, batches });
    }

    /// Whether a listing of `dir` from `cookie` has nothing to give, as
    /// [`CookieWindow::note_end`] was told with the store at `batches`.
    fn listed_to_end(&self, dir: Ino, cookie: u64, batches: u64) -> bool {
        self.dirs
            .get(&dir)
            .and_then(|d| d.end)
            .is_some_and(|end| end == ListedEnd { cookie, batches })
    }

    /// The cookies of `dir`, made if new (the oldest directory's
    /// forgotten past [`COOKIE_DIRS`]).
    fn dir_mut(&mut self, dir: Ino) -> &mut DirCookies {
        if !self.dirs.contains_key(&dir) {
            if self.order.len() >= COOKIE_DIRS {
                if let Some(old) = self.order.pop_front() {
                    self.dirs.remove(&old);
                }
            }
            self.order.push_back(dir);
        }
        self.dirs.entry(dir).or_default()
    }
}

/// Entries a listing reads ahead of the table's lock (a readdir reply
/// holds some hundreds of plain entries, a readdirplus reply fewer): the
/// first leaf's reads are made with the lock free, the rest of a long
/// listing from the cache under it.
const ENTRIES_AHEAD: usize = 256;
const ENTRIES_AHEAD_PLUS: usize = 96;

/// What a listing that began at a directory's first entry gave: how many
/// entries, and whether they are all it has (`Node::entries`) if it
/// reaches the end.
struct Counted {
    given: u64,
    whole: bool,
}

/// Children read in one visit are gathered in a vector reserved for this
/// many (a directory of the kernel tree holds 16 on average).
const CHILDREN_RESERVED: usize = 32;

/// A child of a directory as the store holds it.
struct Child {
    key: Vec<u8>,
    name: Vec<u8>,
    record: Record,
}

/// An entry as the store holds it, with what readdirplus needs from the
/// store besides (read without the table's lock when read ahead).
struct Listed {
    child: Child,
    /// readdirplus only.
    stored: Option<StoredAttrs>,
}

/// What readdirplus needs of an entry from the store besides the entry.
struct StoredAttrs {
    /// A hard link's inode as stored: its attributes, symlink target and
    /// home. None when the entry's own record serves, or the table's copy
    /// of the inode (`FileSystem::resolve` then, under the lock).
    linked: Option<(Attr, Vec<u8>, Home)>,
    /// The blocks stored, for a file that may have holes and that the
    /// table does not have.
    blocks: Option<u64>,
}

impl FileSystem {
    /// Lists directory `ino` from `offset`, calling `add` for each entry
    /// until it returns `true` (buffer full). With `plus`, entries carry
    /// their attributes and count as lookups (readdirplus fills the
    /// kernel's caches from the same scan).
    ///
    /// The first entries are read without the table's lock (a cold
    /// directory waits for the device with the lock free) and given to
    /// `add` only if no batch was written meanwhile
    /// (`Store::batches_applied`, taken and checked with no write in
    /// flight, as lookups do: `super::locking`); else, and for what lies
    /// past them, the entries are read with the lock held, as they all
    /// were before.
    pub(super) fn list_dir(
        &self,
        ino: Ino,
        offset: u64,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<()> {
        let (dir, parent, from, seen) = {
            let st = self.lock();
            let seen = self.store.batches_applied();
            if offset >= 2 && st.cookies.listed_to_end(ino, offset, seen) {
                return self.note_access(st, ino);
            }
            let dir = st.dir_key(ino)?;
            let parent = st.node(ino)?.parent;
            let from = self.listing_start(&st, ino, &dir, offset)?;
            (dir, parent, from, seen)
        };
        // The cookie of the last entry given.
        let mut last = offset;
        let dots = [(1, ino, &b"."[..]), (2, parent, &b".."[..])];
        for (cookie, dot_ino, name) in dots {
            if offset < cookie {
                let entry = DirEntry {
                    ino: dot_ino,
                    offset: cookie,
                    file_type: S_IFDIR,
                    name,
                    attr: None,
                };
                if add(entry) {
                    return Ok(());
                }
                last = cookie;
            }
        }
        let (_, hi) = schema::children_range(&dir);
        let limit = if plus {
            ENTRIES_AHEAD_PLUS
        } else {
            ENTRIES_AHEAD
        };
        let ahead = self.read_entries(&dir, &from, &hi, plus, limit);
        let mut st = self.lock();
        // The entries given from the first, to count them if they reach
        // the end.
        let mut counted = Counted {
            given: 0,
            whole: offset <= 2,
        };
        // Where the listing goes on with the lock held, if it does: past
        // what was read ahead, or all again.
        let (dir, hi, rest) = match ahead {
            Ok((entries, rest, every_key_named)) if self.store.batches_applied() == seen => {
                counted.whole &= every_key_named;
                for listed in entries {
                    match self.give_entry(&mut st, ino, &dir, listed, plus, add)? {
                        Some(cookie) => {
                            last = cookie;
                            counted.given += 1;
                        }
                        None => return self.note_access(st, ino),
                    }
                }
                (dir, hi, rest)
            }
            _ => {
                // Changed meanwhile (the directory itself may have moved,
                // or a cookie's entry gone), or failed: all again, with
                // the lock.
                let dir = st.dir_key(ino)?;
                let from = self.listing_start(&st, ino, &dir, offset)?;
                let (_, hi) = schema::children_range(&dir);
                (dir, hi, Some(from))
            }
        };
        let end = match rest {
            Some(from) => self.fill_from(
                &mut st,
                ino,
                &dir,
                &from,
                &hi,
                plus,
                last,
                &mut counted,
                add,
            )?,
            None => Some(last),
        };
        if let Some(cookie) = end {
            // Under the lock with no write in flight: the count the
            // entries were read at.
            let batches = self.store.batches_applied();
            st.cookies.note_end(ino, cookie, batches);
            // Listed whole from its first entry, as the table stands now
            // (read at `seen` with no write since, or with the lock held).
            if counted.whole {
                st.node_mut(ino)?.entries = Some(counted.given);
            }
        }
        self.note_access(st, ino)
    }

    /// The key a listing from `offset` starts at (past "." and "..").
    fn listing_start(&self, st: &State, ino: Ino, dir: &[u8], offset: u64) -> FsResult<Vec<u8>> {
        let (lo, _) = schema::children_range(dir);
        if offset <= 2 {
            return Ok(lo);
        }
        Ok(match self.name_of_cookie(st, ino, dir, offset)? {
            Some(esc) => [lo.as_slice(), &esc, &[0]].concat(),
            None => {
                // The entry is gone and its cookie forgotten: list from
                // the start again rather than lose entries (a later
                // entry may repeat; none is skipped).
                tracing::debug!("readdir of {ino}: unknown offset {offset}, restarting");
                lo
            }
        })
    }

    /// The escaped name a cookie stands for: from the window, else by
    /// scanning the directory.
    fn name_of_cookie(
        &self,
        st: &State,
        ino: Ino,
        dir: &[u8],
        cookie: u64,
    ) -> FsResult<Option<Vec<u8>>> {
        if let Some(esc) = st.cookies.name(ino, cookie) {
            return Ok(Some(esc.to_vec()));
        }
        let (lo, hi) = schema::children_range(dir);
        let mut found = None;
        self.store
            .visit_range_while(KeySpace::Meta, &lo, &hi, &mut |key, _| {
                let esc = key.get(dir.len() + 1..).unwrap_or_default();
                if dir_cookie(esc) == cookie {
                    found = Some(esc.to_vec());
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            })?;
        Ok(found)
    }

    /// Up to `limit` children of `dir` from key `from`, in key order, and
    /// the key to go on from if there may be more: decoded where the tree
    /// holds them (no copy of the records), reading no leaf past the
    /// last one wanted.
    fn read_children(
        &self,
        dir: &[u8],
        from: &[u8],
        hi: &[u8],
        limit: usize,
    ) -> FsResult<(Vec<Child>, Option<Vec<u8>>, bool)> {
        let mut children = Vec::with_capacity(limit.min(CHILDREN_RESERVED));
        let mut rest = None;
        let mut undecodable = None;
        // Whether every key in the range named an entry (a damaged one
        // is passed over here, and the listing then counts nothing).
        let mut every_key_named = true;
        self.store
            .visit_range_while(KeySpace::Meta, from, hi, &mut |key, value| {
                if children.len() == limit {
                    rest = Some(key.to_vec());
                    return ControlFlow::Break(());
                }
                let Some(name) = schema::child_name(dir, key) else {
                    every_key_named = false;
                    return ControlFlow::Continue(());
                };
                match decode(value) {
                    Ok(record) => {
                        children.push(Child {
                            key: key.to_vec(),
                            name,
                            record,
                        });
                        ControlFlow::Continue(())
                    }
                    Err(e) => {
                        undecodable = Some(e);
                        ControlFlow::Break(())
                    }
                }
            })?;
        match undecodable {
            Some(e) => Err(e),
            None => Ok((children, rest, every_key_named)),
        }
    }

    /// Up to `limit` entries of `dir` from key `from`, with what
    /// readdirplus needs from the store, and the key to go on from.
    fn read_entries(
        &self,
        dir: &[u8],
        from: &[u8],
        hi: &[u8],
        plus: bool,
        limit: usize,
    ) -> FsResult<(Vec<Listed>, Option<Vec<u8>>, bool)> {
        let (children, rest, every_key_named) = self.read_children(dir, from, hi, limit)?;
        let mut entries = Vec::with_capacity(children.len());
        for child in children {
            entries.push(self.listed(None, child, plus)?);
        }
        Ok((entries, rest, every_key_named))
    }

    /// A child with what readdirplus needs from the store. With the lock
    /// held (`table`), nothing is read for an inode the table has: its
    /// copy is what the entry will show.
    fn listed(&self, table: Option<&State>, child: Child, plus: bool) -> FsResult<Listed> {
        let Child { key, record, .. } = &child;
        let stored = if plus {
            let in_table = table.is_some_and(|st| st.nodes.contains_key(&record.ino()));
            let linked = match record {
                Record::Link { .. } if !in_table => self.resolve_from_store(record.clone())?,
                _ => None,
            };
            let blocks = match (record, &linked) {
                _ if in_table => None,
                (Record::Inode { attr, .. }, _) => self.count_stored_blocks(attr, key)?,
                (_, Some((attr, ..))) => {
                    self.count_stored_blocks(attr, &schema::inode_key(attr.ino))?
                }
                _ => None,
            };
            Some(StoredAttrs { linked, blocks })
        } else {
            None
        };
        Ok(Listed { child, stored })
    }

    /// Gives one entry to `add`, with the lock held: readdirplus takes
    /// the table's view of an inode it has (it may be newer), and counts
    /// the entry as a lookup if it went in. The entry's cookie if it went
    /// in, None if the buffer is full.
    fn give_entry(
        &self,
        st: &mut State,
        ino: Ino,
        dir: &[u8],
        listed: Listed,
        plus: bool,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<Option<u64>> {
        let Listed {
            child: Child { key, name, record },
            stored,
        } = listed;
        let esc = key.get(dir.len() + 1..).unwrap_or_default();
        let cookie = dir_cookie(esc);
        let full = match stored {
            Some(StoredAttrs { linked, blocks }) if plus => {
                let child = record.ino();
                let (mut attr, target, home) = match linked {
                    Some(linked) => linked,
                    None => self.resolve(st, record)?,
                };
                if st.nodes.contains_key(&child) {
                    attr = self.attr_for_kernel(st, child)?;
                } else {
                    attr.stored_blocks = blocks;
                }
                let full = add(DirEntry {
                    ino: attr.ino,
                    offset: cookie,
                    file_type: attr.file_type(),
                    name: &name,
                    attr: Some(&attr),
                });
                if !full {
                    // The table keeps no count: it changes with the data.
                    attr.stored_blocks = None;
                    st.add_lookup(ino, &name, attr, target, home);
                }
                full
            }
            _ => add(DirEntry {
                ino: record.ino(),
                offset: cookie,
                file_type: record.mode() & S_IFMT,
                name: &name,
                attr: None,
            }),
        };
        if full {
            return Ok(None);
        }
        st.cookies.remember(ino, cookie, esc);
        Ok(Some(cookie))
    }

    /// Gives the entries of `dir` from key `from` to `add` until it is
    /// full, with the lock held throughout: read a reply's worth at a
    /// time, so that a long directory is read only as far as the reply
    /// reaches. The cookie of the last entry given (`last` if none) when
    /// the directory's end was reached, None when the buffer filled.
    #[allow(clippy::too_many_arguments)]
    fn fill_from(
        &self,
        st: &mut State,
        ino: Ino,
        dir: &[u8],
        from: &[u8],
        hi: &[u8],
        plus: bool,
        mut last: u64,
        counted: &mut Counted,
        add: &mut dyn FnMut(DirEntry<'_>) -> bool,
    ) -> FsResult<Option<u64>> {
        let limit = if plus {
            ENTRIES_AHEAD_PLUS
        } else {
            ENTRIES_AHEAD
        };
        let mut from = from.to_vec();
        loop {
            let (children, rest, every_key_named) = self.read_children(dir, &from, hi, limit)?;
            counted.whole &= every_key_named;
            for child in children {
                let listed = self.listed(Some(st), child, plus)?;
                match self.give_entry(st, ino, dir, listed, plus, add)? {
                    Some(cookie) => {
                        last = cookie;
                        counted.given += 1;
                    }
                    None => return Ok(None),
                }
            }
            match rest {
                Some(next) => from = next,
                None => return Ok(Some(last)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_stable_distinct_and_in_range() {
        assert_eq!(dir_cookie(b"a"), dir_cookie(b"a"));
        let mut seen = std::collections::HashSet::new();
        for i in 0..100_000u32 {
            let c = dir_cookie(format!("file{i}").as_bytes());
            assert!((3..1u64 << 63).contains(&c));
            assert!(seen.insert(c), "collision at {i}");
        }
    }

    #[test]
    fn the_window_forgets_oldest_first() {
        let mut w = CookieWindow::default();
        let total = COOKIES_PER_DIR as u64 + 10;
        for i in 0..total {
            w.remember(7, i + 3, &i.to_be_bytes());
        }
        // The latest half of COOKIES_PER_DIR at least is known, the first
        // entries are not.
        assert!(w.name(7, 3).is_none());
        assert!(w.name(7, 3 + 9).is_none());
        for i in total - COOKIES_PER_DIR as u64 / 2..total {
            assert_eq!(w.name(7, i + 3), Some(&i.to_be_bytes()[..]));
        }
        for d in 0..COOKIE_DIRS as u64 + 1 {
            w.remember(100 + d, 5, b"x");
        }
        assert!(w.name(7, total + 2).is_none());
        assert_eq!(w.name(100 + COOKIE_DIRS as u64, 5), Some(&b"x"[..]));
    }

    #[test]
    fn the_window_gives_each_cookie_its_own_name() {
        let mut w = CookieWindow::default();
        let names: Vec<Vec<u8>> = (0..3000usize)
            .map(|i| vec![b'a' + (i % 26) as u8; i % 255 + 1])
            .collect();
        for (i, name) in names.iter().enumerate() {
            w.remember(9, 1000 + i as u64, name);
        }
        for (i, name) in names.iter().enumerate().skip(3000 - COOKIES_PER_DIR / 2) {
            assert_eq!(
                w.name(9, 1000 + i as u64),
                Some(name.as_slice()),
                "cookie {i}"
            );
        }
        // A cookie remembered again (a listing read twice) names the
        // latest name given with it.
        w.remember(9, 1000, b"again");
        assert_eq!(w.name(9, 1000), Some(&b"again"[..]));
        assert!(w.name(8, 1000).is_none());
        assert!(w.name(9, 999).is_none());
    }
}
