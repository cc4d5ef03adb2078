//! Leaves read from the device outside the tree lock. Read-ahead (BetrFS
//! 0.6 §3.2's cooperative read-ahead): when a scan reads a leaf
//! sequentially, the next leaf is read by another thread and put in the
//! cache if the tree still names it there; the reader then finds it cached
//! instead of waiting for the device. And queries: one that finds its leaf
//! uncached (and nothing else on the way) reads the part it needs holding
//! no lock, so that other requests go on meanwhile.
//!
//! The three steps and what keeps them safe: a walk under the lock
//! through cached nodes notes the leaf's place on disk ([`LeafOnDisk`]:
//! [`Tree::leaf_for`], or a query's walk on the shared lock); the read
//! and decode ([`read_leaf`]) need no lock; [`Tree::adopt_leaf_read`]
//! (under the lock again) caches the leaf only if it is still uncached,
//! the block table still maps it to the same extent and checksum (a leaf
//! changed and written back meanwhile has a new one), and the walk still
//! reaches it with the same bounds. Otherwise the bytes are dropped: a
//! read outside the lock never decides what a reader sees.

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
            let place = self.leaf_on_disk(ks, child, child_bounds)?;
            return Some((Some(place), next));
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
        })
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
    let whole = matches!(want, Want::Whole);
    let first = if whole {
        place.len
    } else {
        place.len.min(BLOCK_SIZE)
    };
    let mut head = io::read_node_bytes(device, place.offset, first, 0, stats)?;
    let header = checked_leaf_header(place, &head)?;
    if meta_end(&header) > head.len() {
        head = io::read_node_bytes(device, place.offset, meta_end(&header), 0, stats)?;
    }
    let mut node = decode_leaf_meta(place, &header, &head)?;
    let (ks, num, bounds) = (place.ks, place.num, &place.bounds);
    if let NodeBody::Leaf(leaf) = &mut node.body {
        if whole {
            Tree::decode_all_basements(ks, num, leaf, bounds, &head)?;
        } else {
            let at = (ks, num, place.offset, bounds);
            io::read_missing_basements(device, at, leaf, want, stats)?;
        }
    }
    Ok(node)
}
