//! Leaves read from the device outside the tree lock. Read-ahead (BetrFS
//! 0.6 §3.2's cooperative read-ahead): when a scan reads a leaf
//! sequentially, the next leaves are read by other threads, several at
//! once, and put in the cache if the tree still names them there; the
//! reader then finds them cached instead of waiting for the device. And queries: one that finds its leaf
//! uncached, or cached without the basements it needs (and nothing else
//! missing on the way), reads what it needs holding no lock, so that other
//! requests go on meanwhile.
//!
//! The three steps and what keeps them safe: a walk under the lock
//! through cached nodes notes the leaf's place on disk ([`LeafOnDisk`]:
//! [`Tree::leaf_for`], or a query's walk on the shared lock), and for a
//! cached leaf its pivots and basements' places; the read and decode
//! ([`read_leaf`]) need no lock; [`Tree::adopt_leaf_read`] (under the lock
//! again) caches what was read only if the block table still maps the leaf
//! to the same extent and checksum (a leaf changed and written back
//! meanwhile has a new one) and — for an uncached leaf — the walk still
//! reaches it, uncached, with the same bounds, or — for basements of a
//! cached leaf — the cached leaf still has those bounds and pivots, and
//! each basement is still missing with the same place in the extent (a
//! partly loaded leaf is always clean: dirty leaves are whole). Otherwise
//! the bytes are dropped: a read outside the lock never decides what a
//! reader sees.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

/// Who read a leaf outside the lock ([`Tree::adopt_leaf_read`]): what the
/// stats count it as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFor {
    /// A query, for the leaf or basements it answers from.
    Query,
    /// A read-ahead reader, ahead of a sequential scan.
    ReadAhead,
    /// A writer, for the leaf its next settle step flushes into.
    Flush,
}

/// Where a leaf lies on disk, as found under the lock.
#[derive(Clone, Debug)]
pub struct LeafOnDisk {
    pub ks: KeySpace,
    pub num: u64,
    pub bounds: Bounds,
    extent: Extent,
    crc: u32,
    /// Byte offset of the extent on the device.
    pub offset: u64,
    pub len: usize,
    /// For a leaf the cache holds with basements still on the device: its
    /// pivots and its basements' places ([`Leaf::skeleton`]). None for a
    /// leaf the cache does not hold.
    cached: Option<Leaf>,
}

impl LeafOnDisk {
    /// Whether this names basements of a leaf the cache holds (a read of
    /// it fills in that leaf), not a leaf the cache does not hold.
    pub fn is_of_cached_leaf(&self) -> bool {
        self.cached.is_some()
    }

    /// Whether `other` names the same leaf at the same place on disk.
    fn same_place(&self, other: &LeafOnDisk) -> bool {
        (self.ks, self.num, &self.bounds, self.extent, self.crc)
            == (other.ks, other.num, &other.bounds, other.extent, other.crc)
    }
}

impl Tree {
    /// The leaf of tree `ks` that holds `key`, when every node above it is
    /// cached and the leaf is not (nothing to read ahead otherwise).
    pub fn uncached_leaf_for(&self, ks: KeySpace, key: &[u8]) -> Option<LeafOnDisk> {
        self.leaf_for(ks, key, false).and_then(|(place, _)| place)
    }

    /// The leaf of tree `ks` that holds `key`, found through cached nodes:
    /// what of it there is to read on disk, and where the leaf after it
    /// begins. To read is the leaf if the cache does not hold it, or, with
    /// `basements_from_key`, the basements from `key` on that a leaf the
    /// cache holds still has on the device (its place with its skeleton,
    /// to read them from `key`: `Want::Range(key, None)`); None if nothing.
    /// None when a node above it is not cached.
    pub fn leaf_for(
        &self,
        ks: KeySpace,
        key: &[u8],
        basements_from_key: bool,
    ) -> Option<(Option<LeafOnDisk>, Option<Vec<u8>>)> {
        let (num, bounds) = self.leaf_reached(ks, key)?;
        let next = bounds.hi.clone();
        let Some(node) = self.cache.get(&num) else {
            let place = self.leaf_on_disk(ks, num, bounds)?;
            return Some((Some(place), next));
        };
        let missing_from_key = match &node.body {
            NodeBody::Leaf(leaf) if basements_from_key => leaf
                .basements
                .iter()
                .skip(leaf.basement_for(key))
                .any(|b| b.entries.is_none()),
            _ => false,
        };
        let basements = if missing_from_key {
            self.basements_on_disk(ks, num, &bounds)
        } else {
            None
        };
        Some((basements, next))
    }

    /// The leaf of tree `ks` that holds `key` and its bounds, reached
    /// through cached interior nodes (the leaf itself may be uncached).
    fn leaf_reached(&self, ks: KeySpace, key: &[u8]) -> Option<(u64, Bounds)> {
        let mut num = self.roots[ks.index()];
        let mut bounds = Bounds::full();
        loop {
            let node = self.cache.get(&num)?;
            let NodeBody::Interior(int) = &node.body else {
                return None;
            };
            let i = int.child_index(key);
            let child = int.children[i];
            let child_bounds = int.child_bounds(i, &bounds);
            if int.height > 1 {
                num = child;
                bounds = child_bounds;
                continue;
            }
            return Some((child, child_bounds));
        }
    }

    /// Where leaf `num` (not cached), reached under `bounds`, lies on
    /// disk; None if the block table has it nowhere.
    pub(super) fn leaf_on_disk(
        &self,
        ks: KeySpace,
        num: u64,
        bounds: Bounds,
    ) -> Option<LeafOnDisk> {
        let Slot::OnDisk { extent, crc } = self.btt.get(num) else {
            return None;
        };
        Some(LeafOnDisk {
            ks,
            num,
            bounds,
            extent,
            crc,
            offset: self.layout.extent_offset(extent),
            len: extent.len as usize,
            cached: None,
        })
    }

    /// Where the basements leaf `num` (cached, reached under `bounds`)
    /// still has on the device lie; None if it is not such a leaf. (The
    /// place names all its basements; what is read of them is kept only
    /// where the cached leaf misses it.)
    pub(super) fn basements_on_disk(
        &self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
    ) -> Option<LeafOnDisk> {
        let node = self.cache.get(&num)?;
        let NodeBody::Leaf(leaf) = &node.body else {
            return None;
        };
        if node.bounds != *bounds {
            return None;
        }
        let mut place = self.leaf_on_disk(ks, num, bounds.clone())?;
        place.cached = Some(leaf.skeleton());
        Some(place)
    }

    /// Caches a leaf, or basements of a cached leaf, read outside the lock
    /// (`by` whom) if the tree still names them where they were found (see
    /// the module doc); whether they were taken.
    pub fn adopt_leaf_read(&mut self, place: &LeafOnDisk, node: Node, by: ReadFor) -> bool {
        let taken = match &place.cached {
            None => self.adopt_uncached_leaf(place, node),
            Some(_) => self.adopt_basements(place, node),
        };
        let counter = match (taken, by, &place.cached) {
            (false, ..) => &self.stats.unlocked_reads_dropped,
            (true, ReadFor::ReadAhead, _) => &self.stats.nodes_read_ahead,
            (true, ReadFor::Flush, _) => &self.stats.leaves_read_for_flushes,
            (true, ReadFor::Query, None) => &self.stats.leaves_read_unlocked,
            (true, ReadFor::Query, Some(_)) => &self.stats.basement_reads_unlocked,
        };
        add(counter, 1);
        taken
    }

    fn adopt_uncached_leaf(&mut self, place: &LeafOnDisk, node: Node) -> bool {
        let still = self.uncached_leaf_for(place.ks, &place.bounds.lo);
        if !still.is_some_and(|still| still.same_place(place)) {
            return false;
        }
        add(&self.stats.nodes_read, 1);
        self.put(place.num, node);
        true
    }

    /// Moves the basements in `read` (a skeleton of the cached leaf
    /// `place` names, with the basements read) into that leaf, each if it
    /// is still missing there with the same place in the same extent.
    fn adopt_basements(&mut self, place: &LeafOnDisk, read: Node) -> bool {
        let NodeBody::Leaf(read) = read.body else {
            return false;
        };
        let at = self.leaf_on_disk(place.ks, place.num, place.bounds.clone());
        if !at.is_some_and(|at| at.same_place(place)) {
            return false;
        }
        let Some(node) = self.cache.get(&place.num) else {
            return false;
        };
        let NodeBody::Leaf(leaf) = &node.body else {
            return false;
        };
        if node.bounds != place.bounds
            || leaf.pivots != read.pivots
            || leaf.basements.len() != read.basements.len()
        {
            return false;
        }
        // Each basement read (whole, or below it) is taken if the cached
        // leaf still misses it, at the same place.
        let keep: Vec<bool> = leaf
            .basements
            .iter()
            .zip(&read.basements)
            .map(|(cached, read)| {
                cached.entries.is_none()
                    && (read.entries.is_some() || read.below.is_some())
                    && (cached.loc, cached.dir, cached.count, cached.bytes)
                        == (read.loc, read.dir, read.count, read.bytes)
            })
            .collect();
        if !keep.contains(&true) {
            return false;
        }
        // Taken out and put back, as a load does: the cache counts the
        // node's bytes as it goes in.
        let mut node = self.take(place.num);
        if let NodeBody::Leaf(leaf) = &mut node.body {
            for ((cached, read), keep) in leaf.basements.iter_mut().zip(read.basements).zip(keep) {
                match (keep, read.entries, read.below) {
                    (false, ..) => {}
                    (true, Some(entries), _) => cached.set_entries(entries),
                    // What another query read below it meanwhile is kept too.
                    (true, None, Some(below)) => {
                        let below = match &cached.below {
                            Some(had) if Arc::ptr_eq(&had.dir, &below.dir) => {
                                Arc::new(had.with(&below))
                            }
                            _ => below,
                        };
                        match below.whole() {
                            Some(entries) => cached.set_entries(Arc::new(entries)),
                            None => cached.below = Some(below),
                        }
                    }
                    (true, None, None) => {}
                }
            }
        }
        self.put(place.num, node);
        true
    }
}

/// The header of the leaf at `place`, from the start of its extent,
/// checked against what its parent and the block table say.
fn checked_leaf_header(place: &LeafOnDisk, bytes: &[u8]) -> EngineResult<NodeHeader> {
    let (ks, num, bounds, crc) = (place.ks, place.num, &place.bounds, place.crc);
    Tree::checked_header(ks, num, bytes, crc, bounds, place.extent.len, Some(0))
}

/// The leaf at `place` with no basement loaded, from its checked header
/// and bytes of its extent that reach past its meta, checked as a load
/// checks it.
fn decode_leaf_meta(place: &LeafOnDisk, header: &NodeHeader, bytes: &[u8]) -> EngineResult<Node> {
    let (ks, num, bounds) = (place.ks, place.num, &place.bounds);
    let node = Tree::decode_node_meta(ks, num, header, bytes, bounds)?;
    let NodeBody::Leaf(leaf) = &node.body else {
        return Err(Tree::corrupt(ks, num, "not the leaf its parent names"));
    };
    validate::check_leaf(leaf, bounds).map_err(|reason| Tree::corrupt(ks, num, reason))?;
    Ok(node)
}

/// Reads what `want` needs of the uncached leaf at `place` as
/// [`Tree::load`] reads it — the whole extent in one IO for
/// [`Want::Whole`] (read-ahead), else its header and meta, then the
/// basements `want` covers — and decodes it, checked as a load checks it.
/// Needs no lock: the caller caches the leaf under it
/// ([`Tree::adopt_leaf_read`]).
pub(crate) fn read_leaf(
    place: &LeafOnDisk,
    device: &dyn Device,
    want: Want<'_>,
    stats: &Stats,
) -> EngineResult<Node> {
    if let Some(skeleton) = &place.cached {
        return read_cached_leafs_basements(place, skeleton.clone(), device, want, stats);
    }
    let whole = matches!(want, Want::Whole);
    let first = if whole {
        place.len
    } else {
        place.len.min(BLOCK_SIZE)
    };
    let mut head = io::read_node_bytes(device, place.offset, first, 0, stats)?;
    let header = checked_leaf_header(place, &head)?;
    head = io::extend_node_read(device, place.offset, head, meta_end(&header), 0, stats)?;
    let mut node = decode_leaf_meta(place, &header, &head)?;
    let (ks, num, bounds) = (place.ks, place.num, &place.bounds);
    if let NodeBody::Leaf(leaf) = &mut node.body {
        if whole {
            Tree::decode_all_basements(ks, num, leaf, bounds, &Arc::new(head))?;
        } else {
            let at = (ks, num, place.offset, bounds);
            io::read_missing_basements(device, at, leaf, want, stats)?;
        }
    }
    Ok(node)
}

/// The basements `want` covers that the cached leaf at `place` (whose
/// `skeleton` it is) does not hold, read and decoded into the skeleton.
fn read_cached_leafs_basements(
    place: &LeafOnDisk,
    mut skeleton: Leaf,
    device: &dyn Device,
    want: Want<'_>,
    stats: &Stats,
) -> EngineResult<Node> {
    let at = (place.ks, place.num, place.offset, &place.bounds);
    io::read_missing_basements(device, at, &mut skeleton, want, stats)?;
    Ok(Node {
        body: NodeBody::Leaf(skeleton),
        bounds: place.bounds.clone(),
        tree: place.ks as u8,
        dirty: false,
        last_used: Default::default(),
    })
}
