//! The two alternating superblock copies.

use crate::bytes::{
    le_u32 as u32_at, le_u64 as u64_at, put_bytes, put_le_u32 as put_u32, put_le_u64 as put_u64,
};
use crate::{crc32c_of, AlignedBuf, Device, Extent, Layout, StoreError, StoreResult, BLOCK_SIZE};

/// First eight bytes of both superblock copies.
pub const MAGIC: [u8; 8] = *b"BETREEFS";
/// The on-disk format this build writes, and the only one it reads (before
/// 1.0 the format changes freely; older images are refused with a message
/// saying so, see [`StoreError::OlderVersion`]).
///
/// Version 2: log records carry the first sequence number of the flush
/// that wrote them, and the superblock has a flags word (`clean`).
/// Version 3: node headers record their bounds relative to the lifted
/// prefix (node format 2), so range renames move subtrees by surgery.
/// Version 4: the block table (version 2) counts references to shared
/// nodes, and the log may hold range clones.
/// Version 5: interior nodes keep their buffers' point messages in
/// segments after the meta (node format 3), so that a point query reads
/// one segment per buffer instead of the whole node.
/// Version 6: large basements of leaves are cut into chunks named by a
/// chunk directory after them (node format 4), so that a point query
/// reads a chunk instead of the whole basement.
pub const FORMAT_VERSION: u32 = 6;
/// How many trees (key spaces) a superblock can name.
pub const MAX_TREES: usize = 8;

const CRC_OFFSET: usize = BLOCK_SIZE - 4;

/// The root record of an image, format version 3.
///
/// Two copies live in blocks 0 and 1; a checkpoint of generation `g` writes
/// copy `g % 2`, so the previous checkpoint stays intact until the new one is
/// durable. Every open writes two checkpoints before it accepts a write, so
/// both copies name the current log epoch, and the previous checkpoint's
/// nodes and log records are kept until the next one is durable: either copy
/// alone recovers everything (docs/design.md, "Durability").
/// Layout (little-endian, 4096 bytes):
///
/// ```text
/// off  size  field
///   0     8  magic "BETREEFS"
///   8     4  format_version (3)
///  12     4  block_size (4096)
///  16     8  generation (checkpoint number, +1 per checkpoint)
///  24     8  device_bytes
///  32     8  log_offset      40  8  log_bytes
///  48     8  nodes_offset    56  8  nodes_bytes
///  64     8  checkpoint_seq  (last sequence number contained in the trees)
///  72     8  log_head        (log stream position where replay starts)
///  80     4  log_epoch       (records of other epochs are not replayed)
///  84     4  tree_count (<= 8)
///  88     8  btt.block  96  4  btt.len  100  4  btt_crc
/// 104    64  roots[8]: u64 node number of each tree's root
/// 168     4  flags: bit 0 = clean (written at close: no log record
///            follows this checkpoint); other bits zero
/// 172  3920  zero
/// 4092    4  crc32c of bytes [0, 4092)
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub generation: u64,
    pub layout: Layout,
    pub checkpoint_seq: u64,
    pub log_head: u64,
    pub log_epoch: u32,
    /// Where the block translation table of this checkpoint lives.
    pub btt: Extent,
    pub btt_crc: u32,
    pub roots: Vec<u64>,
    /// Written by a clean close: nothing in the log follows this checkpoint.
    pub clean: bool,
}

const FLAG_CLEAN: u32 = 1;

/// What [`Superblock::read_copies`] found.
#[derive(Clone, Debug)]
pub struct SuperblockCopies {
    /// The valid copy with the highest generation.
    pub newest: Superblock,
    /// Why the other copy is unusable, if it is.
    pub damaged: Option<String>,
}

/// Why one copy could not be used.
#[derive(Debug)]
enum CopyProblem {
    NoMagic,
    NewerVersion(u32),
    OlderVersion(u32),
    Corrupt(String),
}

fn describe(copy: &Result<Superblock, CopyProblem>) -> String {
    match copy {
        Ok(sb) => format!("valid (generation {})", sb.generation),
        Err(CopyProblem::NoMagic) => "no betreefs magic".into(),
        Err(CopyProblem::NewerVersion(v)) | Err(CopyProblem::OlderVersion(v)) => {
            format!("format version {v}")
        }
        Err(CopyProblem::Corrupt(why)) => why.clone(),
    }
}

impl Superblock {
    /// Decodes one copy (4096 bytes) of a device of `device_bytes`: what
    /// `read_copies` does for each slot; for fuzzing and tools.
    pub fn decode_copy(block: &[u8], device_bytes: u64) -> Result<Superblock, String> {
        if block.len() != BLOCK_SIZE {
            return Err(format!(
                "a superblock copy is {BLOCK_SIZE} bytes, not {}",
                block.len()
            ));
        }
        Self::decode(block, device_bytes).map_err(|p| describe(&Err(p)))
    }

    pub fn encode(&self) -> AlignedBuf {
        debug_assert!(self.roots.len() <= MAX_TREES);
        let mut b = AlignedBuf::zeroed(BLOCK_SIZE);
        put_bytes(&mut b, 0, &MAGIC);
        put_u32(&mut b, 8, FORMAT_VERSION);
        put_u32(&mut b, 12, BLOCK_SIZE as u32);
        put_u64(&mut b, 16, self.generation);
        put_u64(&mut b, 24, self.layout.device_bytes);
        put_u64(&mut b, 32, self.layout.log_offset);
        put_u64(&mut b, 40, self.layout.log_bytes);
        put_u64(&mut b, 48, self.layout.nodes_offset);
        put_u64(&mut b, 56, self.layout.nodes_bytes);
        put_u64(&mut b, 64, self.checkpoint_seq);
        put_u64(&mut b, 72, self.log_head);
        put_u32(&mut b, 80, self.log_epoch);
        put_u32(&mut b, 84, self.roots.len() as u32);
        put_u64(&mut b, 88, self.btt.block);
        put_u32(&mut b, 96, self.btt.len);
        put_u32(&mut b, 100, self.btt_crc);
        for (i, root) in self.roots.iter().enumerate() {
            put_u64(&mut b, 104 + 8 * i, *root);
        }
        put_u32(&mut b, 168, if self.clean { FLAG_CLEAN } else { 0 });
        let crc = crc32c_of(&[b.get(..CRC_OFFSET).unwrap_or_default()]);
        put_u32(&mut b, CRC_OFFSET, crc);
        b
    }

    fn decode(b: &[u8], device_bytes: u64) -> Result<Superblock, CopyProblem> {
        if b.get(0..8) != Some(&MAGIC[..]) {
            return Err(CopyProblem::NoMagic);
        }
        let (Some(covered), Some(reserved)) = (b.get(..CRC_OFFSET), b.get(172..CRC_OFFSET)) else {
            return Err(CopyProblem::Corrupt("shorter than a block".into()));
        };
        let stored = u32_at(b, CRC_OFFSET);
        if crc32c_of(&[covered]) != stored {
            return Err(CopyProblem::Corrupt("checksum mismatch".into()));
        }
        let version = u32_at(b, 8);
        if version > FORMAT_VERSION {
            return Err(CopyProblem::NewerVersion(version));
        }
        if version == 0 || u32_at(b, 12) != BLOCK_SIZE as u32 {
            return Err(CopyProblem::Corrupt(format!(
                "bad version {version} or block size {}",
                u32_at(b, 12)
            )));
        }
        if version < FORMAT_VERSION {
            return Err(CopyProblem::OlderVersion(version));
        }
        let flags = u32_at(b, 168);
        if flags & !FLAG_CLEAN != 0 {
            return Err(CopyProblem::Corrupt(format!("unknown flags {flags:#x}")));
        }
        if reserved.iter().any(|&x| x != 0) {
            return Err(CopyProblem::Corrupt("reserved bytes are not zero".into()));
        }
        let layout = Layout {
            device_bytes: u64_at(b, 24),
            log_offset: u64_at(b, 32),
            log_bytes: u64_at(b, 40),
            nodes_offset: u64_at(b, 48),
            nodes_bytes: u64_at(b, 56),
        };
        layout
            .validate(device_bytes)
            .map_err(CopyProblem::Corrupt)?;
        let tree_count = u32_at(b, 84) as usize;
        if tree_count == 0 || tree_count > MAX_TREES {
            return Err(CopyProblem::Corrupt(format!("tree count {tree_count}")));
        }
        let btt = Extent {
            block: u64_at(b, 88),
            len: u32_at(b, 96),
        };
        if btt.block + btt.blocks() > layout.node_blocks() {
            return Err(CopyProblem::Corrupt(
                "block table outside the node region".into(),
            ));
        }
        // 16 bytes per node and a node takes at least a block: a longer
        // table (read whole before its checksum is known) is damage.
        if btt.len as u64 > 16 + layout.node_blocks() * 16 {
            return Err(CopyProblem::Corrupt(format!(
                "block table of {} bytes for {} blocks",
                btt.len,
                layout.node_blocks()
            )));
        }
        Ok(Superblock {
            generation: u64_at(b, 16),
            layout,
            checkpoint_seq: u64_at(b, 64),
            log_head: u64_at(b, 72),
            log_epoch: u32_at(b, 80),
            btt,
            btt_crc: u32_at(b, 100),
            roots: (0..tree_count).map(|i| u64_at(b, 104 + 8 * i)).collect(),
            clean: flags & FLAG_CLEAN != 0,
        })
    }

    /// Reads both copies and returns the valid one with the highest
    /// generation. A copy that is torn or damaged is skipped when the other
    /// one is valid (a crash during a superblock write leaves exactly that);
    /// when neither is usable the error says why.
    pub fn read_newest(device: &dyn Device) -> StoreResult<Superblock> {
        Self::read_copies(device).map(|c| c.newest)
    }

    /// Like [`Superblock::read_newest`], and says whether the other copy
    /// was unusable: the unusable one may have been the newer, so recovery
    /// then looks past the end of the log it replays (see `replay_log`).
    pub fn read_copies(device: &dyn Device) -> StoreResult<SuperblockCopies> {
        let device_bytes = device.len_bytes();
        if device_bytes < 2 * BLOCK_SIZE as u64 {
            return Err(StoreError::NotBetreefs(format!(
                "only {device_bytes} bytes, too small to hold superblocks"
            )));
        }
        let mut copies = Vec::with_capacity(2);
        for slot in 0..2u64 {
            let mut buf = AlignedBuf::zeroed(BLOCK_SIZE);
            device
                .read_at(&mut buf, slot * BLOCK_SIZE as u64)
                .map_err(|e| StoreError::io("reading superblock", e))?;
            copies.push(Self::decode(&buf, device_bytes));
        }
        let best = copies
            .iter()
            .filter_map(|c| c.as_ref().ok())
            .max_by_key(|sb| sb.generation)
            .cloned();
        if let Some(newest) = best {
            let mut damaged = None;
            for (slot, copy) in copies.iter().enumerate() {
                if let Err(problem) = copy {
                    tracing::warn!(slot, ?problem, "superblock copy unusable; using the other");
                    let name = if slot == 0 { "A" } else { "B" };
                    damaged = Some(format!(
                        "superblock copy {name} is unusable: {}",
                        describe(copy)
                    ));
                }
            }
            return Ok(SuperblockCopies { newest, damaged });
        }
        let [a, b] = copies.as_slice() else {
            unreachable!("two copies were read")
        };
        match (a, b) {
            (Err(CopyProblem::NoMagic), Err(CopyProblem::NoMagic)) => Err(StoreError::NotBetreefs(
                "no betreefs magic in either superblock".into(),
            )),
            (Err(CopyProblem::NewerVersion(v)), _) | (_, Err(CopyProblem::NewerVersion(v))) => {
                Err(StoreError::UnsupportedVersion {
                    found: *v,
                    supported: FORMAT_VERSION,
                })
            }
            (Err(CopyProblem::OlderVersion(v)), _) | (_, Err(CopyProblem::OlderVersion(v))) => {
                Err(StoreError::OlderVersion {
                    found: *v,
                    supported: FORMAT_VERSION,
                })
            }
            (a, b) => Err(StoreError::CorruptSuperblock(format!(
                "copy A: {}; copy B: {}",
                describe(a),
                describe(b)
            ))),
        }
    }

    /// Writes this superblock into its slot and makes it durable.
    pub fn write(&self, device: &dyn Device) -> StoreResult<()> {
        let slot = self.generation % 2;
        device
            .write_at(&self.encode(), slot * BLOCK_SIZE as u64)
            .map_err(|e| StoreError::io("writing superblock", e))?;
        device
            .sync()
            .map_err(|e| StoreError::io("syncing superblock", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    fn sample(generation: u64) -> Superblock {
        Superblock {
            generation,
            layout: Layout::plan(16 << 20, None).unwrap(),
            checkpoint_seq: 42,
            log_head: 8192,
            log_epoch: 3,
            btt: Extent { block: 7, len: 100 },
            btt_crc: 0xdead_beef,
            roots: vec![1, 2],
            clean: generation.is_multiple_of(3),
        }
    }

    #[test]
    fn round_trip_and_newest_wins() {
        let dev = MemDevice::new(16 << 20);
        sample(4).write(&dev).unwrap();
        sample(5).write(&dev).unwrap();
        assert_eq!(Superblock::read_newest(&dev).unwrap(), sample(5));
    }

    #[test]
    fn every_corruption_is_detected() {
        for byte in (0..172).chain([200, 4000, 4095]) {
            let dev = MemDevice::new(16 << 20);
            sample(4).write(&dev).unwrap();
            sample(5).write(&dev).unwrap();
            // Corrupting the newer copy falls back to the older one.
            dev.mutate(|img| img[BLOCK_SIZE + byte] ^= 0x40);
            assert_eq!(Superblock::read_newest(&dev).unwrap().generation, 4);
            // Corrupting both is a typed error, never a panic.
            dev.mutate(|img| img[byte] ^= 0x40);
            let err = Superblock::read_newest(&dev).unwrap_err();
            assert!(
                matches!(
                    err,
                    StoreError::CorruptSuperblock(_) | StoreError::NotBetreefs(_)
                ),
                "byte {byte}: {err}"
            );
        }
    }

    #[test]
    fn foreign_newer_and_older_images_are_refused() {
        let dev = MemDevice::new(16 << 20);
        assert!(matches!(
            Superblock::read_newest(&dev),
            Err(StoreError::NotBetreefs(_))
        ));
        let with_version = |v: u32| {
            let mut b = sample(1).encode();
            b[8..12].copy_from_slice(&v.to_le_bytes());
            let crc = crc32c_of(&[&b[..CRC_OFFSET]]);
            b[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
            b
        };
        dev.write_at(&with_version(FORMAT_VERSION + 1), BLOCK_SIZE as u64)
            .unwrap();
        assert!(matches!(
            Superblock::read_newest(&dev),
            Err(StoreError::UnsupportedVersion { found, .. }) if found == FORMAT_VERSION + 1
        ));
        // An image of an earlier format is refused with a message saying so.
        dev.write_at(&with_version(1), 0).unwrap();
        dev.write_at(&with_version(1), BLOCK_SIZE as u64).unwrap();
        let err = Superblock::read_newest(&dev).unwrap_err();
        assert!(
            matches!(err, StoreError::OlderVersion { found: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("earlier betreefs"), "{err}");
    }

    #[test]
    fn a_damaged_copy_is_reported() {
        let dev = MemDevice::new(16 << 20);
        sample(4).write(&dev).unwrap();
        sample(5).write(&dev).unwrap();
        assert!(Superblock::read_copies(&dev).unwrap().damaged.is_none());
        dev.mutate(|img| img[BLOCK_SIZE + 166] ^= 1);
        let copies = Superblock::read_copies(&dev).unwrap();
        assert_eq!(copies.newest.generation, 4);
        assert!(copies.damaged.unwrap().contains("copy B"));
    }
}
