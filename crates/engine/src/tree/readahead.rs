//! Leaves read from the device outside the tree lock. Read-ahead (BetrFS
//! 0.6 §3.2's cooperative read-ahead): when a scan reads a leaf
//! sequentially, the next leaf is read by another thread and put in the
//! cache if the tree still names it there; the reader then finds it cached
//! instead of waiting for the device. And queries: one that finds its leaf
//! uncached (and nothing else on the way) reads the part it needs
//! ([`read_leaf_part`]) holding no lock, so that other requests go on
//! meanwhile.
//!
//! The three steps and what keeps them safe: [`Tree::uncached_leaf_for`]
//! (under the lock) walks cached nodes down to the leaf and notes its
//! place on disk; the read and decode ([`decode_whole_leaf`]) need no
//! lock; [`Tree::adopt_leaf_read`] (under the lock again) caches the
//! leaf only if it is still uncached, the block table still maps it to
//! the same extent and checksum (a leaf changed and written back
//! meanwhile has a new one), and the walk still reaches it with the same
//! bounds. Otherwise the bytes are dropped: read-ahead never decides what
//! a reader sees.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;

/// Where an uncached leaf lies on disk, as found under the lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeafOnDisk {
    pub ks: KeySpace,
    pub num: u64,
    pub bounds: Bounds,
    extent: Extent,
    crc: u32,
    /// Byte offset of the extent on the device.
    pub offset: u64,
    pub len: usize,
}

impl Tree {
    /// The leaf of tree `ks` that holds `key`, when every node above it is
    /// cached and the leaf is not (nothing to read ahead otherwise).
    pub fn uncached_leaf_for(&self, ks: KeySpace, key: &[u8]) -> Option<LeafOnDisk> {
        self.leaf_for(ks, key).and_then(|(place, _)| place)
    }

    /// The leaf of tree `ks` that holds `key`, found through cached nodes:
    /// its place on disk unless it is cached, and where the leaf after it
    /// begins. None when a node above it is not cached.
    pub fn leaf_for(
        &self,
        ks: KeySpace,
        key: &[u8],
    ) -> Option<(Option<LeafOnDisk>, Option<Vec<u8>>)> {
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
            let next = child_bounds.hi.clone();
            if self.cache.contains_key(&child) {
                return Some((None, next));
            }
            let Slot::OnDisk { extent, crc } = self.btt.get(child) else {
                return None;
            };
            let place = LeafOnDisk {
                ks,
                num: child,
                bounds: child_bounds,
                extent,
                crc,
                offset: self.layout.extent_offset(extent),
                len: extent.len as usize,
            };
            return Some((Some(place), next));
        }
    }

    /// Caches a leaf read outside the lock (`ahead`: by the read-ahead
    /// thread) if the tree still names it where it was found (see the
    /// module doc); whether it was taken.
    pub fn adopt_leaf_read(&mut self, place: &LeafOnDisk, node: Node, ahead: bool) -> bool {
        let still = self.uncached_leaf_for(place.ks, &place.bounds.lo);
        if still.as_ref() != Some(place) {
            add(&self.stats.unlocked_reads_dropped, 1);
            return false;
        }
        add(&self.stats.nodes_read, 1);
        add(
            if ahead {
                &self.stats.nodes_read_ahead
            } else {
                &self.stats.leaves_read_unlocked
            },
            1,
        );
        self.put(place.num, node);
        true
    }

    /// Where a scan read on sequentially since this was last asked.
    pub fn take_read_ahead_hint(&mut self) -> Option<(KeySpace, Vec<u8>)> {
        self.read_ahead_hint.take()
    }

    /// The device, for reads made outside the lock.
    pub fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }
}

/// Reads the whole leaf at `place` and decodes it ([`decode_whole_leaf`]).
/// Needs no lock.
pub fn read_whole_leaf(
    place: &LeafOnDisk,
    device: &dyn Device,
    stats: &Stats,
) -> EngineResult<Node> {
    let buf = io::read_node_bytes(device, place.offset, place.len, 0, stats)?;
    decode_whole_leaf(place, &buf)
}

/// Decodes a whole leaf from its extent's bytes, checked as a load checks
/// it (header checksum against the block table's, tree, bounds, every
/// basement). Needs no lock.
fn decode_whole_leaf(place: &LeafOnDisk, bytes: &[u8]) -> EngineResult<Node> {
    let header = checked_leaf_header(place, bytes)?;
    let mut node = decode_leaf_meta(place, &header, bytes)?;
    let (ks, num, bounds) = (place.ks, place.num, &place.bounds);
    if let NodeBody::Leaf(leaf) = &mut node.body {
        Tree::decode_all_basements(ks, num, leaf, bounds, bytes)?;
    }
    Ok(node)
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

/// Reads what a query needs of the uncached leaf at `place` — its header
/// and meta, then the basements `want` covers, as [`Tree::load`] reads
/// them — and decodes it, checked as a load checks it. Needs no lock: the
/// caller adopts the leaf under it ([`Tree::adopt_leaf_read`]).
pub(crate) fn read_leaf_part(
    place: &LeafOnDisk,
    device: &dyn Device,
    want: Want<'_>,
    stats: &Stats,
) -> EngineResult<Node> {
    let first = place.len.min(BLOCK_SIZE);
    let mut head = io::read_node_bytes(device, place.offset, first, 0, stats)?;
    let header = checked_leaf_header(place, &head)?;
    if meta_end(&header) > head.len() {
        head = io::read_node_bytes(device, place.offset, meta_end(&header), 0, stats)?;
    }
    let mut node = decode_leaf_meta(place, &header, &head)?;
    if let NodeBody::Leaf(leaf) = &mut node.body {
        let at = (place.ks, place.num, place.offset, &place.bounds);
        io::read_missing_basements(device, at, leaf, want, stats)?;
    }
    Ok(node)
}
