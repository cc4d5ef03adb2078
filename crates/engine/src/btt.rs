//! The block translation table: node number -> where the node lives.
//!
//! Interior nodes name children by number, not address, so writing a node
//! somewhere new (copy-on-write) changes one table entry and never its
//! parent. The table is written whole at every checkpoint.
//!
//! A node number may be named by more than one parent once a range clone
//! shares a subtree (docs/design.md, "Range clone"): the table keeps each
//! number's reference count, and a number (with its extent) is released
//! only when its last reference goes.
//!
//! Format version 2 (little-endian): u32 magic "BBTT", u32 version, u64
//! entry count, then per entry u64 block (u64::MAX = free number), u32
//! length in bytes, u32 header crc of the node; then u64 shared count and
//! per shared node (in increasing number order) u64 node number, u32
//! reference count (at least 2; every number not listed has one). Version
//! 1 had no shared list. Its own checksum and location are in the
//! superblock.

use std::collections::BTreeMap;

use betreefs_store::Extent;

use crate::codec::{DecodeError, DecodeResult, Decoder, Encoder, Sink};

const BTT_MAGIC: u32 = u32::from_le_bytes(*b"BBTT");
const BTT_VERSION: u32 = 2;
const FREE: u64 = u64::MAX;
/// Longest node image: nodes split at 64 MiB at most (the largest node
/// size) and may hold one more flush's worth before they do. A longer
/// extent in a table is damage, refused before anything reads it whole.
pub const NODE_BYTES_MAX: u32 = 256 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Free,
    /// Allocated but never written (exists only in the cache).
    Unwritten,
    OnDisk {
        extent: Extent,
        crc: u32,
    },
}

/// Cloned by a checkpoint when it begins: the table it writes is the one
/// of that moment, with the extents its own writes give.
#[derive(Clone, Default)]
pub struct BlockTable {
    slots: Vec<Slot>,
    free: Vec<u64>,
    /// Reference counts above one (shared nodes); every other live number
    /// has exactly one.
    shared: BTreeMap<u64, u32>,
}

impl BlockTable {
    pub fn get(&self, num: u64) -> Slot {
        self.slots.get(num as usize).copied().unwrap_or(Slot::Free)
    }

    /// A fresh node number.
    pub fn allocate(&mut self) -> u64 {
        if let Some(num) = self.free.pop() {
            if let Some(slot) = self.slots.get_mut(num as usize) {
                *slot = Slot::Unwritten;
                return num;
            }
        }
        self.slots.push(Slot::Unwritten);
        self.slots.len() as u64 - 1
    }

    /// Records a node's new location; returns the old extent, if any.
    pub fn set(&mut self, num: u64, extent: Extent, crc: u32) -> Option<Extent> {
        let slot = self.slots.get_mut(num as usize);
        debug_assert!(slot.is_some(), "node number {num} was never allocated");
        let old = std::mem::replace(slot?, Slot::OnDisk { extent, crc });
        match old {
            Slot::OnDisk { extent, .. } => Some(extent),
            _ => None,
        }
    }

    /// How many parents (or roots) name node `num`.
    pub fn refs(&self, num: u64) -> u32 {
        self.shared.get(&num).copied().unwrap_or(1)
    }

    /// Every shared node and its reference count.
    pub fn shared(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.shared.iter().map(|(&n, &r)| (n, r))
    }

    /// One more parent names `num`.
    pub fn add_ref(&mut self, num: u64) {
        debug_assert!(
            !matches!(self.get(num), Slot::Free),
            "reference to free node number {num}"
        );
        *self.shared.entry(num).or_insert(1) += 1;
    }

    /// `count` parents of a shared node no longer name it; it stays live
    /// (the last reference goes with [`BlockTable::release`]).
    pub fn drop_refs(&mut self, num: u64, count: u32) {
        let refs = self.refs(num);
        assert!(
            count < refs,
            "tree invariant: dropping {count} of {refs} references to node {num}"
        );
        if refs - count == 1 {
            self.shared.remove(&num);
        } else {
            self.shared.insert(num, refs - count);
        }
    }

    /// Frees a number (its last reference); returns its extent, if it had one.
    pub fn release(&mut self, num: u64) -> Option<Extent> {
        let slot = self.slots.get_mut(num as usize);
        debug_assert!(slot.is_some(), "node number {num} was never allocated");
        debug_assert!(
            !self.shared.contains_key(&num),
            "node number {num} released while shared"
        );
        let old = std::mem::replace(slot?, Slot::Free);
        self.free.push(num);
        match old {
            Slot::OnDisk { extent, .. } => Some(extent),
            _ => None,
        }
    }

    pub fn extents(&self) -> impl Iterator<Item = (u64, Extent)> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, s)| match s {
            Slot::OnDisk { extent, .. } => Some((i as u64, *extent)),
            _ => None,
        })
    }

    /// Every node number in use (written or not).
    pub fn live_numbers(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !matches!(s, Slot::Free))
            .map(|(i, _)| i as u64)
    }

    /// Node numbers in use (free numbers all sit on the free list).
    pub fn live_count(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Serialises the table; every live node must have been written.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(16 + self.slots.len() * 16);
        e.u32(BTT_MAGIC);
        e.u32(BTT_VERSION);
        e.u64(self.slots.len() as u64);
        for slot in &self.slots {
            match slot {
                Slot::OnDisk { extent, crc } => {
                    e.u64(extent.block);
                    e.u32(extent.len);
                    e.u32(*crc);
                }
                Slot::Free => {
                    e.u64(FREE);
                    e.u32(0);
                    e.u32(0);
                }
                Slot::Unwritten => panic!("block table written with an unwritten node"),
            }
        }
        e.u64(self.shared.len() as u64);
        for (&num, &refs) in &self.shared {
            e.u64(num);
            e.u32(refs);
        }
        e.buf
    }

    pub fn decode(bytes: &[u8]) -> DecodeResult<BlockTable> {
        let mut d = Decoder::new(bytes);
        if d.u32()? != BTT_MAGIC {
            return Err(DecodeError("bad block table magic".into()));
        }
        let version = d.u32()?;
        if version != BTT_VERSION {
            return Err(DecodeError(format!(
                "unsupported block table version {version}"
            )));
        }
        let count = d.u64()?;
        if count.saturating_mul(16).saturating_add(8) > d.remaining() as u64 {
            return Err(DecodeError(format!(
                "block table of {count} entries has {} bytes",
                d.remaining()
            )));
        }
        let mut table = BlockTable::default();
        for i in 0..count {
            let (block, len, crc) = (d.u64()?, d.u32()?, d.u32()?);
            if block != FREE && len > NODE_BYTES_MAX {
                return Err(DecodeError(format!(
                    "node {i} is {len} bytes long, more than any node can be"
                )));
            }
            if block == FREE {
                table.slots.push(Slot::Free);
                table.free.push(i);
            } else {
                table.slots.push(Slot::OnDisk {
                    extent: Extent { block, len },
                    crc,
                });
            }
        }
        table.free.reverse();
        let shared = d.u64()?;
        if shared.saturating_mul(12) != d.remaining() as u64 {
            return Err(DecodeError(format!(
                "{shared} shared nodes in {} bytes",
                d.remaining()
            )));
        }
        for _ in 0..shared {
            let (num, refs) = (d.u64()?, d.u32()?);
            if refs < 2 || !matches!(table.get(num), Slot::OnDisk { .. }) {
                return Err(DecodeError(format!(
                    "node {num} listed as shared {refs} times"
                )));
            }
            if table
                .shared
                .last_key_value()
                .is_some_and(|(&n, _)| n >= num)
            {
                return Err(DecodeError("shared nodes out of order".into()));
            }
            table.shared.insert(num, refs);
        }
        Ok(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_reuse() {
        let mut t = BlockTable::default();
        let a = t.allocate();
        let b = t.allocate();
        t.set(
            a,
            Extent {
                block: 3,
                len: 5000,
            },
            7,
        );
        t.set(b, Extent { block: 9, len: 10 }, 8);
        assert_eq!(t.release(b), Some(Extent { block: 9, len: 10 }));
        let back = BlockTable::decode(&t.encode()).unwrap();
        assert_eq!(back.get(a), t.get(a));
        assert_eq!(back.get(b), Slot::Free);
        assert_eq!((t.live_count(), back.live_count()), (1, 1));
        let mut back = back;
        assert_eq!(back.allocate(), b);
        assert!(BlockTable::decode(&t.encode()[..20]).is_err());
    }

    #[test]
    fn reference_counts_round_trip_and_are_checked() {
        let mut t = BlockTable::default();
        let nums: Vec<u64> = (0..3).map(|_| t.allocate()).collect();
        for &n in &nums {
            t.set(
                n,
                Extent {
                    block: n * 4,
                    len: 4096,
                },
                1,
            );
        }
        t.add_ref(nums[1]);
        t.add_ref(nums[1]);
        t.add_ref(nums[2]);
        assert_eq!(
            (t.refs(nums[0]), t.refs(nums[1]), t.refs(nums[2])),
            (1, 3, 2)
        );
        let enc = t.encode();
        let back = BlockTable::decode(&enc).unwrap();
        assert_eq!(
            back.shared().collect::<Vec<_>>(),
            vec![(nums[1], 3), (nums[2], 2)]
        );
        t.drop_refs(nums[1], 2);
        t.drop_refs(nums[2], 1);
        assert_eq!(t.shared().count(), 0);
        assert_eq!(
            t.release(nums[1]),
            Some(Extent {
                block: 4,
                len: 4096
            })
        );
        // A count below two, a free number and a wrong order are refused.
        let shared_at = enc.len() - 2 * 12;
        let mut bad = enc.clone();
        bad[shared_at + 8..shared_at + 12].copy_from_slice(&1u32.to_le_bytes());
        assert!(BlockTable::decode(&bad).is_err());
        let mut bad = enc.clone();
        bad[shared_at..shared_at + 8].copy_from_slice(&9u64.to_le_bytes());
        assert!(BlockTable::decode(&bad).is_err());
        let mut bad = enc.clone();
        bad[shared_at + 12..shared_at + 20].copy_from_slice(&nums[0].to_le_bytes());
        assert!(BlockTable::decode(&bad).is_err());
        for cut in 0..enc.len() {
            assert!(BlockTable::decode(&enc[..cut]).is_err());
        }
    }
}
