//! The table of inodes the kernel holds: each with its parent and name
//! (a path is found by walking up), its attributes, and the kernel's
//! references; plus the names a lookup found absent and the open handles.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};

use betreefs_engine::MemoryBesideCache;
use rustc_hash::{FxHashMap, FxHasher};

use super::key_bound::Bound;
use super::listing::dir_cookie as name_hash;
use super::listing::CookieWindow;
use super::{Ino, NEGATIVE_CACHE_MAX, ROOT_INO};

/// Names remembered per directory made during the mount; past this the
/// directory's names are looked up in the store again.
const CHILD_NAMES_MAX: usize = 1 << 16;
/// Directory keys remembered ([`DirKeys`]): the few directories a run of
/// requests works in (an untar's, an rm -rf's, two tokubench clients').
const DIR_KEYS_CACHED: usize = 8;
use crate::error::{Errno, FsResult};
use crate::record::{Attr, S_IFDIR, S_IFMT};
use crate::schema;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Home {
    /// Attributes at the entry key of (parent, name) (or the root key).
    Path,
    /// Attributes and data under the inode key.
    Inode,
    /// Removed; nothing stored.
    Gone,
}

pub(super) struct Node {
    pub(super) parent: Ino,
    pub(super) name: Vec<u8>,
    pub(super) attr: Attr,
    pub(super) target: Vec<u8>,
    pub(super) home: Home,
    /// Kernel references (lookup replies not yet forgotten).
    pub(super) lookups: u64,
    pub(super) opens: u32,
    /// Table entries whose parent this is (they need this one for paths).
    pub(super) children: u32,
    /// Bumped on every change of a directory's entries.
    pub(super) dir_version: u64,
    /// Whether the file has extended attributes, once known.
    pub(super) has_xattrs: Option<bool>,
    /// Whether it has a `security.capability` attribute, once known.
    pub(super) has_capability: Option<bool>,
    /// The kernel was asked to drop its entry ([`State::entries_to_release`])
    /// and has not looked it up since.
    pub(super) released: bool,
    /// For a directory made during this mount: a hash of every name ever
    /// added to it, so that a lookup of any other name is answered absent
    /// without a query (the LOOKUP before each CREATE of an untar). None
    /// when unknown (directories found on the image, or grown too big).
    pub(super) child_names: Option<HashSet<u64>>,
    /// For a directory: how many entries it has, when the table knows —
    /// made during this mount (none), or listed whole in one READDIR with
    /// nothing written meanwhile — and kept by every change of its
    /// entries ([`super::planned::Planned::touch_dir`]). rmdir then needs
    /// no query of the tree, which waits for the tree's lock while staged
    /// writes are applied (rm -rf's rmdirs, each after its directory's
    /// unlinks). None when unknown.
    pub(super) entries: Option<u64>,
    /// Bumped on every change of a file's data (write, truncate,
    /// fallocate).
    pub(super) data_version: u64,
    /// The stored blocks of a file that may have holes, counted at
    /// `data_version` (the first of the pair).
    pub(super) stored_blocks: Option<(u64, u64)>,
}

impl Node {
    /// The memory this entry holds: its box and what its fields own.
    pub(super) fn bytes(&self) -> usize {
        std::mem::size_of::<Node>()
            + self.name.capacity()
            + self.target.capacity()
            + self
                .child_names
                .as_ref()
                .map_or(0, |c| c.capacity() * (std::mem::size_of::<u64>() + 1))
    }

    /// A node the kernel has just been given one reference to.
    pub(super) fn new(parent: Ino, name: Vec<u8>, attr: Attr, target: Vec<u8>, home: Home) -> Node {
        Node {
            parent,
            name,
            attr,
            target,
            home,
            lookups: 1,
            opens: 0,
            children: 0,
            dir_version: 0,
            has_xattrs: None,
            has_capability: None,
            released: false,
            child_names: None,
            entries: None,
            data_version: 0,
            stored_blocks: None,
        }
    }
}

/// An open file (directories need no handle: see [`super::listing`]).
pub(super) struct OpenFile {
    pub(super) ino: Ino,
    pub(super) append: bool,
}

pub(super) struct State {
    /// Boxed: the map's slots stay small (a table of a million inodes
    /// grows, and rehashes, 16-byte slots rather than whole nodes).
    /// Hashed with FxHash: inode numbers are the file system's own, and
    /// a request walks a path's worth of them.
    pub(super) nodes: FxHashMap<Ino, Box<Node>>,
    /// Names a lookup found absent and nothing created since, by parent
    /// (looked up by borrowed name: no allocation per lookup).
    pub(super) absent: HashMap<Ino, HashSet<Vec<u8>>>,
    /// How many names `absent` holds.
    pub(super) absent_count: usize,
    pub(super) handles: HashMap<u64, OpenFile>,
    /// Names behind the readdir cookies returned lately.
    pub(super) cookies: CookieWindow,
    pub(super) next_handle: u64,
    /// Bumped whenever an inode's key may change: a rename (of it or of a
    /// directory above it), a new home, a new place found for it. A read
    /// made without the table's lock held across the store's read checks
    /// this (and the file's `data_version`) afterwards to know that the
    /// key it read was the file's, and its data unchanged, throughout.
    pub(super) key_moves: u64,
    /// Bumped whenever a directory's key may change (the part of
    /// `key_moves` that moves whole subtrees): what [`DirKeys`] checks.
    dir_moves: u64,
    /// The keys of directories lately asked for ([`State::dir_key`]).
    dir_keys: RefCell<DirKeys>,
    /// Which inode each (parent, name) of the table names, by a hash of
    /// the pair: an index checked against the node on every use
    /// ([`State::named`]), so that a stale or colliding slot only costs a
    /// query of the store.
    named: FxHashMap<u64, Ino>,
    pub(super) next_ino: Ino,
    pub(super) ino_reserved: Ino,
    pub(super) created: i64,
    /// Where the table's memory is reported: the engine's node cache
    /// makes room for it (one budget, `cache=`, covers both).
    pub(super) memory: TableMemory,
    /// A writer's batch is going into the store with the table's lock let
    /// go: the store may be ahead of the table until it is installed
    /// (`super::locking`).
    pub(super) write_in_flight: bool,
    /// No metadata key is longer ([`super::key_bound`]).
    pub(super) key_bound: Bound,
    /// Inodes in the order the kernel was given them (again after a
    /// release): the order [`State::entries_to_release`] picks in.
    release_order: VecDeque<Ino>,
    /// The memory of the entries released and not yet forgotten: not
    /// counted against the limit again while the FORGETs are on their way.
    released_bytes: usize,
}

/// The most entries one call of [`State::entries_to_release`] names: it
/// holds the table's lock (a few hundred microseconds for these), and the
/// kernel takes each notification in a system call. Asked every 50 ms,
/// that is 160,000 entries a second, more than any client creates.
const RELEASES_PER_CALL: usize = 8192;

/// What an entry costs the table beside [`Node::bytes`]: its slots in the
/// maps and in the order of releases.
const ENTRY_SLOT_BYTES: usize = std::mem::size_of::<(Ino, Box<Node>)>()
    + std::mem::size_of::<(u64, Ino)>()
    + std::mem::size_of::<Ino>();

/// An entry released to the kernel is looked up again or leaves the
/// table: its bytes no longer wait for a FORGET (`State::released_bytes`).
fn release_ended(released_bytes: &mut usize, node: &Node) {
    if node.released {
        *released_bytes = released_bytes.saturating_sub(node.bytes() + ENTRY_SLOT_BYTES);
    }
}

/// The inode table's memory, reported to the engine.
pub(super) struct TableMemory {
    gauge: MemoryBesideCache,
    /// The sum of the entries' [`Node::bytes`].
    entry_bytes: usize,
    /// Changes counted, for the check against a walk of the table.
    #[cfg(debug_assertions)]
    changes: u64,
}

impl TableMemory {
    pub(super) fn new(gauge: MemoryBesideCache) -> TableMemory {
        TableMemory {
            gauge,
            entry_bytes: 0,
            #[cfg(debug_assertions)]
            changes: 0,
        }
    }
}

/// Directory keys built lately, each with the `dir_moves` it was built
/// at: a key stays right until some directory moves (a rename, a
/// removal), which bumps it. Walking up to the root and escaping every
/// name was 2% of the daemon's CPU in rm -rf (every unlink asks for its
/// parent's key, twice).
#[derive(Default)]
struct DirKeys {
    /// Most recently used last.
    keys: Vec<(Ino, u64, Vec<u8>)>,
}

impl DirKeys {
    /// The key cached for `ino` (made the most recently used), if it was
    /// cached with `moves` directory moves done.
    fn get(&mut self, ino: Ino, moves: u64) -> Option<&[u8]> {
        let at = self.keys.iter().rposition(|(i, _, _)| *i == ino)?;
        let entry = self.keys.remove(at);
        if entry.1 != moves {
            return None;
        }
        self.keys.push(entry);
        self.keys.last().map(|(_, _, key)| key.as_slice())
    }

    fn put(&mut self, ino: Ino, moves: u64, key: &[u8]) {
        if self.keys.len() >= DIR_KEYS_CACHED {
            self.keys.remove(0);
        }
        self.keys.push((ino, moves, key.to_vec()));
    }
}

/// The index slot of the entry `name` in `parent` ([`State::named`]).
fn name_slot(parent: Ino, name: &[u8]) -> u64 {
    let mut h = FxHasher::default();
    parent.hash(&mut h);
    name.hash(&mut h);
    h.finish()
}

impl State {
    /// An empty table (the root is added by the caller).
    pub(super) fn new(memory: TableMemory, next_ino: Ino, created: i64) -> State {
        State {
            nodes: FxHashMap::default(),
            absent: HashMap::new(),
            absent_count: 0,
            handles: HashMap::new(),
            cookies: CookieWindow::default(),
            next_handle: 1,
            key_moves: 0,
            dir_moves: 0,
            dir_keys: RefCell::default(),
            named: FxHashMap::default(),
            next_ino,
            ino_reserved: next_ino,
            created,
            memory,
            write_in_flight: false,
            key_bound: Bound::default(),
            release_order: VecDeque::new(),
            released_bytes: 0,
        }
    }

    /// Reports the table's memory: its slots and the entries' own bytes,
    /// which every change of an entry's size keeps counted
    /// ([`State::insert_node`], [`State::remove_node`],
    /// [`State::resize_node`]). Counted, not measured: a walk of the
    /// table every 4,096 entries was 5-6% of the daemon's CPU creating
    /// 100,000 files (and walking on every change of the map's capacity
    /// made `rm -rf` quadratic before that).
    fn account_table(&mut self) {
        self.memory.gauge.set(self.table_bytes() as u64);
        #[cfg(debug_assertions)]
        {
            self.memory.changes += 1;
            if self.memory.changes.is_multiple_of(256) {
                let walked: usize = self.nodes.values().map(|n| n.bytes()).sum();
                assert_eq!(
                    walked, self.memory.entry_bytes,
                    "the inode table's entries hold other than the bytes counted"
                );
            }
        }
    }

    /// The table's memory: its slots and the entries' own bytes.
    pub(super) fn table_bytes(&self) -> usize {
        let slots = self.nodes.capacity() * (std::mem::size_of::<(Ino, Box<Node>)>() + 1)
            + self.named.capacity() * (std::mem::size_of::<(u64, Ino)>() + 1)
            + self.release_order.capacity() * std::mem::size_of::<Ino>();
        slots + self.memory.entry_bytes
    }

    /// Entries the kernel should drop, as (parent, name), when the table
    /// holds more than `limit` bytes: enough of them to bring it to three
    /// quarters of that (at most [`RELEASES_PER_CALL`]), oldest first. The
    /// kernel keeps an inode (and so this table its entry) for as long as
    /// it caches a name of it, which with memory to spare is for good:
    /// creating a million files grew the table to 359 MiB. Told to drop
    /// the name, it forgets an inode nobody uses at once (FUSE inodes are
    /// not cached without a name), and the entry goes with the FORGET.
    /// Anything but directories, and no open file: a directory holds its
    /// children's names, and the paths of everything below it need its
    /// entry anyway. Each entry is asked for once until the kernel looks
    /// it up again.
    pub(super) fn entries_to_release(&mut self, limit: usize) -> Vec<(Ino, Vec<u8>)> {
        let bytes = self.table_bytes().saturating_sub(self.released_bytes);
        if bytes <= limit {
            return Vec::new();
        }
        let goal = bytes - limit / 4 * 3;
        let (mut freed, mut released) = (0, Vec::new());
        // Each inode looked at once: open files go to the back.
        for _ in 0..self.release_order.len() {
            if freed >= goal || released.len() == RELEASES_PER_CALL {
                break;
            }
            let Some(ino) = self.release_order.pop_front() else {
                break;
            };
            let Some(node) = self.nodes.get_mut(&ino) else {
                continue; // forgotten
            };
            if node.released || node.lookups == 0 || node.attr.mode & S_IFMT == S_IFDIR {
                continue;
            }
            if node.opens > 0 {
                self.release_order.push_back(ino);
                continue;
            }
            node.released = true;
            freed += node.bytes() + ENTRY_SLOT_BYTES;
            released.push((node.parent, node.name.clone()));
        }
        self.released_bytes += freed;
        released
    }

    /// Puts `ino` last in the order of releases. Forgotten inodes leave
    /// the order only when it is walked, so it is swept of them once it
    /// holds twice the table (a long run of creates and unlinks would
    /// grow it for good).
    fn queue_for_release(&mut self, ino: Ino) {
        self.release_order.push_back(ino);
        if self.release_order.len() > 2 * self.nodes.len() + 1024 {
            let nodes = &self.nodes;
            self.release_order.retain(|i| nodes.contains_key(i));
            self.release_order
                .shrink_to(2 * self.release_order.len() + 1024);
        }
    }

    /// Adds an entry to the table, counting its memory.
    pub(super) fn insert_node(&mut self, ino: Ino, node: Box<Node>) {
        self.memory.entry_bytes += node.bytes();
        let slot = name_slot(node.parent, &node.name);
        if let Some(old) = self.nodes.insert(ino, node) {
            release_ended(&mut self.released_bytes, &old);
            self.memory.entry_bytes -= old.bytes();
            self.unindex(ino, name_slot(old.parent, &old.name));
        }
        self.named.insert(slot, ino);
        self.account_table();
    }

    /// Removes an entry from the table, counting its memory.
    pub(super) fn remove_node(&mut self, ino: Ino) -> Option<Box<Node>> {
        let node = self.nodes.remove(&ino)?;
        release_ended(&mut self.released_bytes, &node);
        self.memory.entry_bytes -= node.bytes();
        self.unindex(ino, name_slot(node.parent, &node.name));
        self.account_table();
        Some(node)
    }

    /// Drops index slot `slot` if it names `ino` (another inode may have
    /// taken it since: a rename over, a colliding pair).
    fn unindex(&mut self, ino: Ino, slot: u64) {
        if self.named.get(&slot) == Some(&ino) {
            self.named.remove(&slot);
        }
    }

    /// The inode the table knows as `name` in `parent`, with its entry's
    /// record at that path (home [`Home::Path`]): what the store holds
    /// there, since every change of the table follows its batch into the
    /// store (`super::planned`). None when the table does not know (a
    /// hard link's entry names its inode elsewhere: the store is asked).
    pub(super) fn named(&self, parent: Ino, name: &[u8]) -> Option<&Node> {
        let ino = self.named.get(&name_slot(parent, name))?;
        let node = self.nodes.get(ino)?;
        (node.parent == parent && node.name == name && node.home == Home::Path).then_some(&**node)
    }

    /// Moves `ino` to `name` in `parent` in the table; returns its old
    /// parent if it moved, else None.
    pub(super) fn move_node(&mut self, ino: Ino, parent: Ino, name: &[u8]) -> Option<Ino> {
        let node = self.nodes.get(&ino)?;
        if node.parent == parent && node.name == name {
            return None;
        }
        let old_slot = name_slot(node.parent, &node.name);
        let old_parent = self.resize_node(ino, |node| {
            let old_parent = node.parent;
            node.parent = parent;
            node.name = name.to_vec();
            old_parent
        })?;
        self.unindex(ino, old_slot);
        self.named.insert(name_slot(parent, name), ino);
        self.note_key_move(ino);
        self.account_table();
        Some(old_parent)
    }

    /// `ino`'s key (and its subtree's, if a directory) may have changed:
    /// a move, a new home.
    pub(super) fn note_key_move(&mut self, ino: Ino) {
        self.key_moves += 1;
        if self.nodes.get(&ino).is_none_or(|n| n.attr.is_dir()) {
            self.dir_moves += 1;
        }
    }

    /// Changes entry `ino` by `change`, counting what it gains or loses
    /// in memory (a new name, a set of child names grown or dropped).
    pub(super) fn resize_node<T>(
        &mut self,
        ino: Ino,
        change: impl FnOnce(&mut Node) -> T,
    ) -> Option<T> {
        let node = self.nodes.get_mut(&ino)?;
        let before = node.bytes();
        let value = change(node);
        let after = node.bytes();
        self.memory.entry_bytes = self.memory.entry_bytes - before + after;
        if before != after {
            self.account_table();
        }
        Some(value)
    }

    pub(super) fn node(&self, ino: Ino) -> FsResult<&Node> {
        self.nodes.get(&ino).map(|n| &**n).ok_or(Errno::ESTALE)
    }

    pub(super) fn node_mut(&mut self, ino: Ino) -> FsResult<&mut Node> {
        self.nodes
            .get_mut(&ino)
            .map(|n| &mut **n)
            .ok_or(Errno::ESTALE)
    }

    /// `EPERM` when directory `ino` may not gain entries (immutable) or,
    /// with `removing`, lose them (immutable or append-only).
    pub(super) fn check_dir_change(&self, ino: Ino, removing: bool) -> FsResult<()> {
        let attr = &self.node(ino)?.attr;
        if attr.is_immutable() || (removing && attr.is_append_only()) {
            return Err(Errno::EPERM);
        }
        Ok(())
    }

    /// `EPERM` when `ino` is immutable or append-only: its mode, owner,
    /// explicit times and extended attributes stay (Linux's
    /// `notify_change` and `xattr_permission`).
    pub(super) fn check_attributes_change(&self, ino: Ino) -> FsResult<()> {
        if self.node(ino)?.attr.is_pinned() {
            return Err(Errno::EPERM);
        }
        Ok(())
    }

    /// The encoded path of a directory.
    pub(super) fn dir_key(&self, ino: Ino) -> FsResult<Vec<u8>> {
        self.with_dir_key(ino, <[u8]>::to_vec)
    }

    /// `make` of the encoded path of a directory, without a copy of it
    /// when it is cached (every write to a file builds its key on its
    /// directory's).
    pub(super) fn with_dir_key<R>(&self, ino: Ino, make: impl FnOnce(&[u8]) -> R) -> FsResult<R> {
        let in_place = self
            .nodes
            .get(&ino)
            .is_some_and(|n| n.home == Home::Path && n.attr.is_dir());
        if in_place {
            let mut cached = self.dir_keys.borrow_mut();
            if let Some(key) = cached.get(ino, self.dir_moves) {
                debug_assert_eq!(Ok(key), self.walk_dir_key(ino).as_deref());
                return Ok(make(key));
            }
        }
        let key = self.walk_dir_key(ino)?;
        self.dir_keys.borrow_mut().put(ino, self.dir_moves, &key);
        Ok(make(&key))
    }

    /// [`State::dir_key`] from the names up to the root.
    fn walk_dir_key(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let mut names: Vec<&[u8]> = Vec::new();
        let mut cur = ino;
        while cur != ROOT_INO {
            let node = self.node(cur)?;
            if node.home != Home::Path || !node.attr.is_dir() {
                return Err(if node.home == Home::Gone {
                    Errno::ENOENT
                } else {
                    Errno::ENOTDIR
                });
            }
            names.push(&node.name);
            cur = node.parent;
            if names.len() > schema::PATH_MAX {
                tracing::error!("inode table has a parent cycle at {ino}");
                return Err(Errno::EIO);
            }
        }
        Ok(schema::dir_key(names.into_iter().rev()))
    }

    /// Where a file's record lives and the prefix of its data.
    pub(super) fn file_key(&self, ino: Ino) -> FsResult<Vec<u8>> {
        let node = self.node(ino)?;
        match node.home {
            Home::Inode => Ok(schema::inode_key(ino)),
            Home::Gone => Err(Errno::ENOENT),
            Home::Path if ino == ROOT_INO => Ok(schema::ROOT_KEY.to_vec()),
            Home::Path => self.with_dir_key(node.parent, |dir| schema::entry_key(dir, &node.name)),
        }
    }

    /// Whether `ino` is `ancestor` or lies below it.
    pub(super) fn is_within(&self, mut ino: Ino, ancestor: Ino) -> bool {
        for _ in 0..=schema::PATH_MAX {
            if ino == ancestor {
                return true;
            }
            if ino == ROOT_INO {
                return false;
            }
            match self.nodes.get(&ino) {
                Some(n) => ino = n.parent,
                None => return false,
            }
        }
        false
    }

    /// Records that `name` now exists in `parent`.
    pub(super) fn note_added(&mut self, parent: Ino, name: &[u8]) {
        if let Some(names) = self.absent.get_mut(&parent) {
            if names.remove(name) {
                self.absent_count -= 1;
            }
        }
        let hash = name_hash(name);
        self.resize_node(parent, |node| {
            if let Some(names) = &mut node.child_names {
                if names.len() >= CHILD_NAMES_MAX {
                    node.child_names = None;
                } else {
                    names.insert(hash);
                }
            }
        });
    }

    /// Whether `name` is known not to exist in `parent`, without a query.
    pub(super) fn known_absent(&self, parent: Ino, name: &[u8]) -> bool {
        let never_added = self
            .nodes
            .get(&parent)
            .and_then(|n| n.child_names.as_ref())
            .is_some_and(|names| !names.contains(&name_hash(name)));
        never_added || self.absent.get(&parent).is_some_and(|n| n.contains(name))
    }

    pub(super) fn remember_absent(&mut self, parent: Ino, name: &[u8]) {
        if self.absent_count >= NEGATIVE_CACHE_MAX {
            self.absent.clear();
            self.absent_count = 0;
        }
        if self.absent.entry(parent).or_default().insert(name.to_vec()) {
            self.absent_count += 1;
        }
    }

    /// Records a kernel reference to `ino`, known as `name` in `parent`.
    pub(super) fn add_lookup(
        &mut self,
        parent: Ino,
        name: &[u8],
        attr: Attr,
        target: Vec<u8>,
        home: Home,
    ) {
        let ino = attr.ino;
        let known = self.nodes.get_mut(&ino).map(|node| {
            node.lookups += 1;
            release_ended(&mut self.released_bytes, node);
            let again = std::mem::take(&mut node.released);
            (again, home == Home::Path || node.parent == parent)
        });
        if let Some((true, _)) = known {
            self.queue_for_release(ino);
        }
        match known.map(|(_, here)| here) {
            Some(true) => {
                if let Some(old_parent) = self.move_node(ino, parent, name) {
                    self.move_pin(old_parent, parent);
                }
            }
            Some(false) => {}
            None => {
                let node = Node::new(parent, name.to_vec(), attr, target, home);
                self.insert_node(ino, Box::new(node));
                self.queue_for_release(ino);
                if let Some(p) = self.nodes.get_mut(&parent) {
                    p.children += 1;
                }
            }
        }
    }

    /// Adds `ino` to the table without a kernel reference (an ancestor
    /// loaded to find a file by number: its children pin it).
    pub(super) fn add_unreferenced(
        &mut self,
        parent: Ino,
        name: &[u8],
        attr: Attr,
        target: Vec<u8>,
        home: Home,
    ) {
        let ino = attr.ino;
        if self.nodes.contains_key(&ino) {
            return;
        }
        self.add_lookup(parent, name, attr, target, home);
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.lookups = 0;
        }
    }

    pub(super) fn move_pin(&mut self, from: Ino, to: Ino) {
        if from == to {
            return;
        }
        if let Some(p) = self.nodes.get_mut(&to) {
            p.children += 1;
        }
        if let Some(p) = self.nodes.get_mut(&from) {
            p.children = p.children.saturating_sub(1);
        }
        self.drop_if_unused(from);
    }

    /// Drops table entries nothing refers to any more (walking up).
    pub(super) fn drop_if_unused(&mut self, mut ino: Ino) {
        while ino != ROOT_INO {
            let Some(node) = self.nodes.get(&ino) else {
                return;
            };
            if node.lookups > 0 || node.opens > 0 || node.children > 0 {
                return;
            }
            let parent = node.parent;
            self.remove_node(ino);
            match self.nodes.get_mut(&parent) {
                Some(p) => p.children = p.children.saturating_sub(1),
                None => return,
            }
            ino = parent;
        }
    }
}
