//! Read-ahead of leaves (BetrFS 0.6 §3.2's cooperative read-ahead): when
//! a scan reads a leaf sequentially, the next leaf is read from the device
//! by another thread, outside the tree lock, and put in the cache if the
//! tree still names it there. The reader then finds it cached instead of
//! waiting for the device.
//!
//! The three steps and what keeps them safe: [`Tree::uncached_leaf_for`]
//! (under the lock) walks cached nodes down to the leaf and notes its
//! place on disk; the read and decode ([`decode_whole_leaf`]) need no
//! lock; [`Tree::adopt_read_ahead`] (under the lock again) caches the
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

    /// Caches a leaf read ahead if the tree still names it where it was
    /// found (see the module doc); whether it was taken.
    pub fn adopt_read_ahead(&mut self, place: &LeafOnDisk, node: Node) -> bool {
        let still = self.uncached_leaf_for(place.ks, &place.bounds.lo);
        if still.as_ref() != Some(place) {
            return false;
        }
        add(&self.stats.nodes_read, 1);
        add(&self.stats.nodes_read_ahead, 1);
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

/// Decodes a whole leaf from its extent's bytes, checked as a load checks
/// it (header checksum against the block table's, tree, bounds, every
/// basement). Needs no lock.
pub fn decode_whole_leaf(place: &LeafOnDisk, bytes: &[u8]) -> EngineResult<Node> {
    let (ks, num, bounds) = (place.ks, place.num, &place.bounds);
    let header =
        Tree::checked_header(ks, num, bytes, place.crc, bounds, place.extent.len, Some(0))?;
    let mut node = Tree::decode_node_meta(ks, num, &header, bytes, bounds)?;
    let NodeBody::Leaf(leaf) = &mut node.body else {
        return Err(Tree::corrupt(ks, num, "not the leaf its parent names"));
    };
    validate::check_leaf(leaf, bounds).map_err(|reason| Tree::corrupt(ks, num, reason))?;
    Tree::decode_all_basements(ks, num, leaf, bounds, bytes)?;
    Ok(node)
}
