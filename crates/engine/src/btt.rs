//! The block translation table: node number -> where the node lives.
//!
//! Interior nodes name children by number, not address, so writing a node
//! somewhere new (copy-on-write) changes one table entry and never its
//! parent. The table is written whole at every checkpoint.
//!
//! Format version 1 (little-endian): u32 magic "BBTT", u32 version, u64
//! entry count, then per entry u64 block (u64::MAX = free number), u32
//! length in bytes, u32 header crc of the node. Its own checksum and
//! location are in the superblock.

use betreefs_store::Extent;

use crate::codec::{DecodeError, DecodeResult, Decoder, Encoder};

const BTT_MAGIC: u32 = u32::from_le_bytes(*b"BBTT");
const BTT_VERSION: u32 = 1;
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

#[derive(Default)]
pub struct BlockTable {
    slots: Vec<Slot>,
    free: Vec<u64>,
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

    /// Frees a number; returns its extent, if it had one.
    pub fn release(&mut self, num: u64) -> Option<Extent> {
        let slot = self.slots.get_mut(num as usize);
        debug_assert!(slot.is_some(), "node number {num} was never allocated");
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
        if count.saturating_mul(16) != d.remaining() as u64 {
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
}
