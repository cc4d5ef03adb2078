//! In-memory tree nodes.
//!
//! Keys are held whole in memory; on disk a node stores only what follows
//! its lifted prefix (see [`crate::format`]). A leaf may be partly loaded:
//! its basement table is always present, each basement's entries only once
//! read.

use crate::buffer::{Base, MessageBuffer, PointMsg};
use crate::merge::MergeRegistry;

/// Serialised size of one key/value entry in a basement, near enough.
pub fn entry_bytes(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + 4
}

/// Rough heap overhead per stored entry or message (allocation headers,
/// map nodes), so the cache budget tracks real memory.
const ENTRY_MEM_OVERHEAD: usize = 112;

/// The key range a node covers: [lo, hi), `hi == None` meaning unbounded.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Bounds {
    pub lo: Vec<u8>,
    pub hi: Option<Vec<u8>>,
}

impl Bounds {
    pub fn full() -> Bounds {
        Bounds::default()
    }

    /// The prefix every key in [lo, hi) shares: the longest common prefix
    /// of the bounds (empty when unbounded). Key lifting strips it.
    pub fn lifted_prefix(&self) -> Vec<u8> {
        match &self.hi {
            None => Vec::new(),
            Some(hi) => {
                let n = self
                    .lo
                    .iter()
                    .zip(hi.iter())
                    .take_while(|(a, b)| a == b)
                    .count();
                self.lo[..n].to_vec()
            }
        }
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        key >= self.lo.as_slice() && self.hi.as_deref().is_none_or(|hi| key < hi)
    }
}

/// Where a basement lies inside the node's current extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BasementLoc {
    pub offset: u32,
    pub len: u32,
    pub crc: u32,
}

#[derive(Clone, Debug, Default)]
pub struct Basement {
    /// Sorted entries, or `None` while only on disk.
    pub entries: Option<Vec<(Vec<u8>, Vec<u8>)>>,
    /// Location in the node's on-disk image (valid while the node is clean).
    pub loc: Option<BasementLoc>,
    /// Serialised size of the entries.
    pub bytes: usize,
    pub count: usize,
}

impl Basement {
    pub fn from_entries(entries: Vec<(Vec<u8>, Vec<u8>)>) -> Basement {
        let bytes = entries.iter().map(|(k, v)| entry_bytes(k, v)).sum();
        Basement {
            count: entries.len(),
            entries: Some(entries),
            loc: None,
            bytes,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Leaf {
    /// `pivots[i]` is the smallest key of basement `i + 1`.
    pub pivots: Vec<Vec<u8>>,
    pub basements: Vec<Basement>,
}

impl Default for Leaf {
    fn default() -> Self {
        Leaf {
            pivots: Vec::new(),
            basements: vec![Basement::from_entries(Vec::new())],
        }
    }
}

impl Leaf {
    pub fn basement_for(&self, key: &[u8]) -> usize {
        self.pivots.partition_point(|p| p.as_slice() <= key)
    }

    pub fn is_fully_loaded(&self) -> bool {
        self.basements.iter().all(|b| b.entries.is_some())
    }

    pub fn bytes(&self) -> usize {
        self.basements.iter().map(|b| b.bytes).sum()
    }

    pub fn entry_count(&self) -> usize {
        self.basements.iter().map(|b| b.count).sum()
    }

    pub fn mem_bytes(&self) -> usize {
        self.basements
            .iter()
            .filter(|b| b.entries.is_some())
            .map(|b| b.bytes + b.count * ENTRY_MEM_OVERHEAD)
            .sum::<usize>()
            + self.pivots.iter().map(|p| p.len() + 32).sum::<usize>()
            + 128
    }

    /// Looks a key up in a loaded basement.
    pub fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        let b = &self.basements[self.basement_for(key)];
        let entries = b.entries.as_ref()?;
        Some(
            entries
                .binary_search_by(|(k, _)| k.as_slice().cmp(key))
                .ok()
                .map(|i| entries[i].1.as_slice()),
        )
    }

    /// Applies a flushed buffer. Requires every basement loaded. Returns
    /// `Err(id)` for an unknown merge function.
    pub fn apply_buffer(
        &mut self,
        buffer: MessageBuffer,
        merges: &MergeRegistry,
    ) -> Result<(), u8> {
        debug_assert!(self.is_fully_loaded());
        let (ranges, points) = buffer.into_parts();
        for (start, r) in ranges {
            let first = self.basement_for(&start);
            let last = self.basement_for(&r.end);
            for bi in first..=last.min(self.basements.len() - 1) {
                let b = &mut self.basements[bi];
                if let Some(entries) = b.entries.as_mut() {
                    let lo = entries.partition_point(|(k, _)| k.as_slice() < start.as_slice());
                    let hi = entries.partition_point(|(k, _)| k.as_slice() < r.end.as_slice());
                    if lo < hi {
                        entries.drain(lo..hi);
                        b.loc = None;
                    }
                }
            }
        }
        for (key, msg) in points {
            let bi = self.basement_for(&key);
            let b = &mut self.basements[bi];
            let Some(entries) = b.entries.as_mut() else {
                continue;
            };
            b.loc = None;
            let found = entries.binary_search_by(|(k, _)| k.as_slice().cmp(&key));
            let old = found.ok().map(|i| entries[i].1.as_slice());
            let new = match (&msg.base, msg.upserts.is_empty()) {
                (Some(Base::Put { value, .. }), true) => Some(value.clone()),
                (Some(Base::Delete { .. }), true) => None,
                _ => msg.apply(old, merges)?,
            };
            match (found, new) {
                (Ok(i), Some(v)) => entries[i].1 = v,
                (Ok(i), None) => {
                    entries.remove(i);
                }
                (Err(i), Some(v)) => entries.insert(i, (key, v)),
                (Err(_), None) => {}
            }
        }
        for b in &mut self.basements {
            if let Some(entries) = &b.entries {
                b.count = entries.len();
                b.bytes = entries.iter().map(|(k, v)| entry_bytes(k, v)).sum();
            }
        }
        Ok(())
    }

    /// Re-chunks basements so each holds about `basement_size` bytes.
    pub fn rebalance_basements(&mut self, basement_size: usize) {
        debug_assert!(self.is_fully_loaded());
        let needs = self
            .basements
            .iter()
            .any(|b| b.bytes > 2 * basement_size || b.count == 0)
            && !(self.basements.len() == 1 && self.basements[0].count == 0);
        if !needs {
            return;
        }
        let entries = self.take_entries();
        *self = Leaf::from_sorted(entries, basement_size);
    }

    /// Takes all entries out in order.
    pub fn take_entries(&mut self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let mut all = Vec::with_capacity(self.entry_count());
        for b in &mut self.basements {
            all.extend(b.entries.take().unwrap_or_default());
        }
        all
    }

    /// A fully loaded leaf chunked into basements of about `basement_size`.
    pub fn from_sorted(entries: Vec<(Vec<u8>, Vec<u8>)>, basement_size: usize) -> Leaf {
        let mut leaf = Leaf {
            pivots: Vec::new(),
            basements: Vec::new(),
        };
        let mut current = Vec::new();
        let mut bytes = 0;
        for (k, v) in entries {
            let eb = entry_bytes(&k, &v);
            if bytes + eb > basement_size && !current.is_empty() {
                leaf.pivots.push(k.clone());
                leaf.basements
                    .push(Basement::from_entries(std::mem::take(&mut current)));
                bytes = 0;
            }
            bytes += eb;
            current.push((k, v));
        }
        leaf.basements.push(Basement::from_entries(current));
        leaf
    }
}

#[derive(Clone, Debug)]
pub struct Interior {
    /// Distance from the leaves (children of a height-1 node are leaves).
    pub height: u32,
    /// `pivots[i]` is the smallest key of child `i + 1`.
    pub pivots: Vec<Vec<u8>>,
    pub children: Vec<u64>,
    pub buffers: Vec<MessageBuffer>,
}

impl Interior {
    pub fn child_index(&self, key: &[u8]) -> usize {
        self.pivots.partition_point(|p| p.as_slice() <= key)
    }

    pub fn child_bounds(&self, i: usize, own: &Bounds) -> Bounds {
        Bounds {
            lo: if i == 0 {
                own.lo.clone()
            } else {
                self.pivots[i - 1].clone()
            },
            hi: if i == self.pivots.len() {
                own.hi.clone()
            } else {
                Some(self.pivots[i].clone())
            },
        }
    }

    pub fn buffer_bytes(&self) -> usize {
        self.buffers.iter().map(|b| b.bytes()).sum()
    }

    pub fn mem_bytes(&self) -> usize {
        self.buffers
            .iter()
            .map(|b| b.bytes() + b.message_count() * ENTRY_MEM_OVERHEAD)
            .sum::<usize>()
            + self.pivots.iter().map(|p| p.len() + 32).sum::<usize>()
            + self.children.len() * 16
            + 128
    }

    /// Puts a message into the buffer(s) of the child(ren) it concerns,
    /// clamping range deletes to each child's range. Returns messages eaten.
    pub fn insert_range_delete(
        &mut self,
        start: &[u8],
        end: &[u8],
        seq: u64,
        own: &Bounds,
    ) -> usize {
        if start >= end {
            return 0;
        }
        let first = self.child_index(start);
        let mut eaten = 0;
        for i in first..self.children.len() {
            let b = self.child_bounds(i, own);
            if b.lo.as_slice() >= end {
                break;
            }
            let s = start.max(b.lo.as_slice()).to_vec();
            let e = match &b.hi {
                Some(hi) => end.min(hi.as_slice()).to_vec(),
                None => end.to_vec(),
            };
            eaten += self.buffers[i].insert_range_delete(s, e, seq);
        }
        eaten
    }

    pub fn insert_point(&mut self, key: Vec<u8>, msg: PointMsg, merges: &MergeRegistry) -> usize {
        let i = self.child_index(&key);
        self.buffers[i].insert_point(key, msg, merges)
    }

    /// Distributes a batch flushed from the parent into our children's
    /// buffers. Returns messages eaten.
    pub fn absorb_batch(
        &mut self,
        batch: MessageBuffer,
        own: &Bounds,
        merges: &MergeRegistry,
    ) -> usize {
        let (ranges, points) = batch.into_parts();
        let mut eaten = 0;
        for (start, r) in ranges {
            eaten += self.insert_range_delete(&start, &r.end, r.seq, own);
        }
        for (key, msg) in points {
            eaten += self.insert_point(key, msg, merges);
        }
        eaten
    }
}

#[derive(Clone, Debug)]
pub enum NodeBody {
    Leaf(Leaf),
    Interior(Interior),
}

/// A cached node.
#[derive(Clone, Debug)]
pub struct Node {
    pub body: NodeBody,
    /// The lifted prefix: what the parent's pivots say every key here begins with.
    pub prefix: Vec<u8>,
    /// The key space (tree) the node belongs to.
    pub tree: u8,
    pub dirty: bool,
    pub last_used: u64,
}

impl Node {
    pub fn height(&self) -> u32 {
        match &self.body {
            NodeBody::Leaf(_) => 0,
            NodeBody::Interior(i) => i.height,
        }
    }

    pub fn mem_bytes(&self) -> usize {
        match &self.body {
            NodeBody::Leaf(l) => l.mem_bytes(),
            NodeBody::Interior(i) => i.mem_bytes(),
        }
    }

    /// Bytes this node's contents amount to (what the node-size limit measures).
    pub fn content_bytes(&self) -> usize {
        match &self.body {
            NodeBody::Leaf(l) => l.bytes(),
            NodeBody::Interior(i) => {
                i.buffer_bytes() + i.pivots.iter().map(|p| p.len() + 12).sum::<usize>()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifted_prefix_of_bounds() {
        let b = Bounds {
            lo: b"a\x01b\x00c".to_vec(),
            hi: Some(b"a\x01b\x00q".to_vec()),
        };
        assert_eq!(b.lifted_prefix(), b"a\x01b\x00");
        assert!(b.contains(b"a\x01b\x00d"));
        assert!(!b.contains(b"a\x01b\x00q"));
        assert!(Bounds::full().lifted_prefix().is_empty());
    }

    #[test]
    fn leaf_apply_and_rebalance() {
        let merges = MergeRegistry::default();
        let mut leaf = Leaf::default();
        let mut buf = MessageBuffer::default();
        for i in 0..100u32 {
            buf.insert_point(
                i.to_be_bytes().to_vec(),
                PointMsg::put(1, vec![7; 100]),
                &merges,
            );
        }
        leaf.apply_buffer(buf, &merges).unwrap();
        leaf.rebalance_basements(1000);
        assert!(leaf.basements.len() > 5);
        assert_eq!(leaf.entry_count(), 100);
        let mut del = MessageBuffer::default();
        del.insert_range_delete(
            10u32.to_be_bytes().to_vec(),
            90u32.to_be_bytes().to_vec(),
            2,
        );
        leaf.apply_buffer(del, &merges).unwrap();
        leaf.rebalance_basements(1000);
        assert_eq!(leaf.entry_count(), 20);
        assert_eq!(leaf.get(&5u32.to_be_bytes()), Some(Some(&[7u8; 100][..])));
        assert_eq!(leaf.get(&50u32.to_be_bytes()), Some(None));
    }
}
