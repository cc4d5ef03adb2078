//! The values stored in the metadata key space.
//!
//! # Entry record, format version 1
//!
//! The value at a file key (see [`crate::schema`]); integers little-endian.
//!
//! ```text
//! off len  field
//!   0   1  version = 1
//!   1   1  kind: 1 = the inode's attributes are here, 2 = hard link (the
//!          attributes are at inode_key(ino))
//!   2   8  ino
//!  10   4  mode (file type and permission bits, as st_mode)
//! kind 2 ends here (14 bytes). Kind 1 continues:
//!  14   4  uid
//!  18   4  gid
//!  22   4  nlink
//!  26   4  rdev
//!  30   8  size in bytes
//!  38  12  atime  (i64 seconds, u32 nanoseconds)
//!  50  12  mtime
//!  62  12  ctime
//!  74  12  crtime (birth)
//!  86   4  flags: the inode flags chattr sets, as `FS_IOC_GETFLAGS`
//!          reports them (FS_IMMUTABLE_FL 0x10, FS_APPEND_FL 0x20,
//!          FS_NODUMP_FL 0x40, FS_NOATIME_FL 0x80), and SPARSE_FL
//!          0x8000_0000 (never shown: the file may have holes, so
//!          st_blocks is counted from its stored blocks), PREALLOC_FL
//!          0x4000_0000 (never shown, format 3: the file may have
//!          reservations, so writes look for them); other bits are
//!          refused on decode. Images before these flags wrote 0 here.
//!  90   *  symlink target (symlinks only; the rest of the value)
//! ```
//!
//! # Back pointer, format version 2 (at `back_pointer_key(ino)`)
//!
//! For every inode whose attributes live at an entry key (directories
//! other than the root, files and special files with one name): where
//! that entry is, so that the inode can be found by number.
//!
//! ```text
//!   0   8  parent directory's inode number
//!   8   *  name (1 to 255 bytes, unescaped)
//! ```
//!
//! # Reservation, format version 3 (at `reservation_key(file, end)`)
//!
//! Blocks [start, end) of a file preallocated by fallocate and not written
//! since: they read as zeros (nothing is stored) and the space a write
//! into them needs is held for it (see docs/design.md "Preallocation").
//! Extents of one file are disjoint and never cover a stored block.
//!
//! ```text
//!   0   8  start block (< end)
//! ```
//!
//! # Counts (at `COUNTS_KEY`, a `MERGE_RECORD` value of u64 slots)
//!
//! Slot 0: inodes in use. Slot 1 (format 3): blocks reserved, the sum of
//! every reservation's length.
//!
//! # File-system record, format version 4 (at `INFO_KEY`)
//!
//! Version 2 added back pointers; version 1 images are refused. Version 3
//! added reservations and PREALLOC_FL; a version 2 image has neither and
//! is read as it is. Version 4 added the key bound (below). An older
//! image is upgraded by the first read-write mount, which rewrites this
//! record (after which older builds refuse it) and, from version 4 on,
//! writes the key bound found by a scan of the metadata keys.
//!
//! ```text
//!   0   8  magic "betreefs"
//!   8   4  version = 4
//!  12   8  inode numbers below this may have been handed out
//!  20   8  creation time, seconds since the epoch
//! ```
//!
//! # Key bound, version 1 (at `KEY_BOUND_KEY`, format 4 on)
//!
//! No metadata key is longer than this many bytes: every batch that
//! writes a longer key, or moves keys under a longer prefix (a directory
//! renamed to a longer name), raises it in the same batch. A rename that
//! lengthens a directory's keys needs the longest key below it only when
//! the bound plus the lengthening passes the key limit; below that it
//! needs no walk of the subtree (docs/design.md, "The key bound").
//!
//! ```text
//!   0   1  version = 1
//!   1   8  the bound, bytes (u64)
//! ```

use std::time::{SystemTime, UNIX_EPOCH};

use betreefs_engine::codec::Decoder;

pub const RECORD_VERSION: u8 = 1;
const KIND_INODE: u8 = 1;
const KIND_LINK: u8 = 2;
const INODE_FIXED: usize = 90;
const LINK_LEN: usize = 14;

pub const FS_MAGIC: &[u8; 8] = b"betreefs";
pub const FS_VERSION: u32 = 4;
/// The oldest format this build reads (and upgrades on a read-write mount).
pub const FS_VERSION_OLDEST: u32 = 2;
const FS_INFO_LEN: usize = 28;

pub const S_IFMT: u32 = libc::S_IFMT;
pub const S_IFDIR: u32 = libc::S_IFDIR;
pub const S_IFREG: u32 = libc::S_IFREG;
pub const S_IFLNK: u32 = libc::S_IFLNK;

/// A point in time as stored (seconds may be negative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

impl Timespec {
    pub fn now() -> Timespec {
        Timespec::from_system(SystemTime::now())
    }

    pub fn from_system(t: SystemTime) -> Timespec {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timespec {
                sec: d.as_secs() as i64,
                nsec: d.subsec_nanos(),
            },
            Err(e) => {
                let d = e.duration();
                let (sec, nsec) = (d.as_secs() as i64, d.subsec_nanos());
                if nsec == 0 {
                    Timespec { sec: -sec, nsec: 0 }
                } else {
                    Timespec {
                        sec: -sec - 1,
                        nsec: 1_000_000_000 - nsec,
                    }
                }
            }
        }
    }

    pub fn to_system(self) -> SystemTime {
        let nanos = std::time::Duration::from_nanos(self.nsec as u64);
        if self.sec >= 0 {
            UNIX_EPOCH + std::time::Duration::from_secs(self.sec as u64) + nanos
        } else {
            UNIX_EPOCH - std::time::Duration::from_secs(self.sec.unsigned_abs()) + nanos
        }
    }
}

/// An inode's attributes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub rdev: u32,
    pub size: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub crtime: Timespec,
    /// chattr flags (`FS_*_FL`, [`INODE_FLAGS`]) and [`SPARSE_FL`].
    pub flags: u32,
    /// Data blocks stored, when counted (files with [`SPARSE_FL`]); not
    /// part of the record.
    pub stored_blocks: Option<u64>,
}

/// The chattr flags betreefs keeps and enforces.
pub const FS_IMMUTABLE_FL: u32 = 0x10;
pub const FS_APPEND_FL: u32 = 0x20;
pub const FS_NODUMP_FL: u32 = 0x40;
pub const FS_NOATIME_FL: u32 = 0x80;
pub const INODE_FLAGS: u32 = FS_IMMUTABLE_FL | FS_APPEND_FL | FS_NODUMP_FL | FS_NOATIME_FL;
/// The file may have holes: a write began past its last block, or it was
/// extended by truncate or fallocate, or a range was punched or zeroed.
/// Without it every block up to the size is stored.
pub const SPARSE_FL: u32 = 0x8000_0000;
/// The file may have reservations (preallocated blocks not yet written):
/// writes into it look for them. Set by fallocate; kept until a
/// truncate to zero.
pub const PREALLOC_FL: u32 = 0x4000_0000;
/// Flags the file system keeps for itself, never shown to users.
pub const INTERNAL_FLAGS: u32 = SPARSE_FL | PREALLOC_FL;

/// The value of a reservation (see the module doc): its first block.
pub fn encode_reservation(start: u64) -> [u8; 8] {
    start.to_le_bytes()
}

/// The first block of a reservation ending at `end`; `None` when the
/// value is not a non-empty extent's.
pub fn decode_reservation(value: &[u8], end: u64) -> Option<u64> {
    let start = u64::from_le_bytes(value.try_into().ok()?);
    (start < end).then_some(start)
}

impl Attr {
    /// A new inode: no data, every time `now`, two links for a directory
    /// ("." and its entry) and one otherwise.
    pub fn new(ino: u64, mode: u32, uid: u32, gid: u32, now: Timespec) -> Attr {
        Attr {
            ino,
            mode,
            uid,
            gid,
            nlink: if mode & S_IFMT == S_IFDIR { 2 } else { 1 },
            rdev: 0,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            flags: 0,
            stored_blocks: None,
        }
    }

    /// Immutable or append-only: the entry may not be removed, renamed or
    /// linked, its attributes not changed (Linux's `IS_IMMUTABLE ||
    /// IS_APPEND` checks).
    pub fn is_pinned(&self) -> bool {
        self.flags & (FS_IMMUTABLE_FL | FS_APPEND_FL) != 0
    }
    pub fn is_immutable(&self) -> bool {
        self.flags & FS_IMMUTABLE_FL != 0
    }
    pub fn is_append_only(&self) -> bool {
        self.flags & FS_APPEND_FL != 0
    }

    pub fn file_type(&self) -> u32 {
        self.mode & S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.file_type() == S_IFDIR
    }
    /// 512-byte blocks, as `st_blocks` counts them: the 4 KiB blocks a
    /// regular file stores (every block up to its size unless it may have
    /// holes, when they were counted); other inodes store no data blocks.
    pub fn blocks(&self) -> u64 {
        const SECTORS_PER_BLOCK: u64 = 8;
        if self.file_type() != S_IFREG {
            return 0;
        }
        self.stored_blocks
            .unwrap_or_else(|| self.size.div_ceil(SECTORS_PER_BLOCK * 512))
            * SECTORS_PER_BLOCK
    }
}

/// What an entry key holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// The attributes (and a symlink's target).
    Inode { attr: Attr, target: Vec<u8> },
    /// A hard link: the attributes are under the inode key.
    Link { ino: u64, mode: u32 },
}

#[derive(Debug, PartialEq, Eq)]
pub struct RecordError(pub String);

impl Record {
    pub fn ino(&self) -> u64 {
        match self {
            Record::Inode { attr, .. } => attr.ino,
            Record::Link { ino, .. } => *ino,
        }
    }
    pub fn mode(&self) -> u32 {
        match self {
            Record::Inode { attr, .. } => attr.mode,
            Record::Link { mode, .. } => *mode,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            Record::Link { ino, mode } => {
                let mut out = Vec::with_capacity(LINK_LEN);
                out.extend_from_slice(&[RECORD_VERSION, KIND_LINK]);
                out.extend_from_slice(&ino.to_le_bytes());
                out.extend_from_slice(&mode.to_le_bytes());
                out
            }
            Record::Inode { attr, target } => encode_inode(attr, target),
        }
    }

    pub fn decode(value: &[u8]) -> Result<Record, RecordError> {
        let bad = |why: &str| RecordError(format!("{why} ({} bytes)", value.len()));
        let mut d = Decoder::new(value);
        let short = |_| bad("record too short");
        let (version, kind) = (d.u8().map_err(short)?, d.u8().map_err(short)?);
        if version != RECORD_VERSION {
            return Err(bad(&format!("unknown record version {version}")));
        }
        let (ino, mode) = (d.u64().map_err(short)?, d.u32().map_err(short)?);
        match kind {
            KIND_LINK if d.is_empty() => Ok(Record::Link { ino, mode }),
            KIND_INODE => {
                let mut u32s = [0u32; 4];
                for v in &mut u32s {
                    *v = d.u32().map_err(short)?;
                }
                let [uid, gid, nlink, rdev] = u32s;
                let size = d.u64().map_err(short)?;
                let mut times = [Timespec::default(); 4];
                for t in &mut times {
                    *t = Timespec {
                        sec: d.u64().map_err(short)? as i64,
                        nsec: d.u32().map_err(short)?,
                    };
                }
                let [atime, mtime, ctime, crtime] = times;
                let flags = d.u32().map_err(short)?;
                if flags & !(INODE_FLAGS | INTERNAL_FLAGS) != 0 {
                    return Err(bad(&format!("unknown inode flags {flags:#x}")));
                }
                let attr = Attr {
                    ino,
                    mode,
                    uid,
                    gid,
                    nlink,
                    rdev,
                    size,
                    atime,
                    mtime,
                    ctime,
                    crtime,
                    flags,
                    stored_blocks: None,
                };
                if attr.nsecs().any(|n| n >= 1_000_000_000) {
                    return Err(bad("nanoseconds out of range"));
                }
                let target = d.take(d.remaining()).map_err(short)?.to_vec();
                Ok(Record::Inode { attr, target })
            }
            kind => Err(bad(&format!("unknown record kind {kind}"))),
        }
    }
}

impl Attr {
    fn nsecs(&self) -> impl Iterator<Item = u32> {
        [self.atime, self.mtime, self.ctime, self.crtime]
            .into_iter()
            .map(|t| t.nsec)
    }
}

fn encode_inode(attr: &Attr, target: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(INODE_FIXED + target.len());
    out.extend_from_slice(&[RECORD_VERSION, KIND_INODE]);
    out.extend_from_slice(&attr.ino.to_le_bytes());
    for v in [attr.mode, attr.uid, attr.gid, attr.nlink, attr.rdev] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&attr.size.to_le_bytes());
    for t in [attr.atime, attr.mtime, attr.ctime, attr.crtime] {
        out.extend_from_slice(&t.sec.to_le_bytes());
        out.extend_from_slice(&t.nsec.to_le_bytes());
    }
    out.extend_from_slice(&attr.flags.to_le_bytes());
    debug_assert_eq!(out.len(), INODE_FIXED);
    out.extend_from_slice(target);
    out
}

/// Where an inode named by a path is: its parent and its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackPointer {
    pub parent: u64,
    pub name: Vec<u8>,
}

impl BackPointer {
    pub fn encode(&self) -> Vec<u8> {
        [&self.parent.to_le_bytes()[..], &self.name].concat()
    }

    pub fn decode(value: &[u8]) -> Result<BackPointer, RecordError> {
        let bad = || RecordError(format!("back pointer of {} bytes", value.len()));
        let (parent, name) = value.split_at_checked(8).ok_or_else(bad)?;
        if name.is_empty() || name.len() > 255 {
            return Err(bad());
        }
        Ok(BackPointer {
            parent: u64::from_le_bytes(parent.try_into().map_err(|_| bad())?),
            name: name.to_vec(),
        })
    }
}

const KEY_BOUND_VERSION: u8 = 1;
const KEY_BOUND_LEN: usize = 9;

/// The key bound record: no metadata key is longer than this.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyBound(pub usize);

impl KeyBound {
    pub fn encode(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(KEY_BOUND_LEN);
        out.push(KEY_BOUND_VERSION);
        out.extend_from_slice(&(self.0 as u64).to_le_bytes());
        out
    }

    pub fn decode(value: &[u8]) -> Result<KeyBound, RecordError> {
        let bad = |why: &str| RecordError(format!("key bound record: {why}"));
        if value.len() != KEY_BOUND_LEN {
            return Err(bad(&format!("{} bytes, not {KEY_BOUND_LEN}", value.len())));
        }
        let mut d = Decoder::new(value);
        let version = d.u8().map_err(|_| bad("truncated"))?;
        if version != KEY_BOUND_VERSION {
            return Err(bad(&format!("version {version}")));
        }
        let bound = d.u64().map_err(|_| bad("truncated"))?;
        usize::try_from(bound)
            .map(KeyBound)
            .map_err(|_| bad(&format!("{bound} bytes")))
    }
}

/// The file-system identity record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsInfo {
    pub ino_reserved: u64,
    pub created: i64,
}

impl FsInfo {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FS_INFO_LEN);
        out.extend_from_slice(FS_MAGIC);
        out.extend_from_slice(&FS_VERSION.to_le_bytes());
        out.extend_from_slice(&self.ino_reserved.to_le_bytes());
        out.extend_from_slice(&self.created.to_le_bytes());
        out
    }

    pub fn decode(value: &[u8]) -> Result<FsInfo, RecordError> {
        Self::decode_versioned(value).map(|(info, _)| info)
    }

    /// The record and the format version it was written in (an older one
    /// this build reads is upgraded by writing the record again).
    pub fn decode_versioned(value: &[u8]) -> Result<(FsInfo, u32), RecordError> {
        let foreign = || RecordError("not a betreefs file system (no identity record)".into());
        if value.len() != FS_INFO_LEN {
            return Err(foreign());
        }
        let mut d = Decoder::new(value);
        if d.take(FS_MAGIC.len()).map_err(|_| foreign())? != FS_MAGIC {
            return Err(foreign());
        }
        let version = d.u32().map_err(|_| foreign())?;
        if version > FS_VERSION {
            return Err(RecordError(format!(
                "file-system format version {version} is newer than this build reads ({FS_VERSION}): use a newer betreefs"
            )));
        }
        if version < FS_VERSION_OLDEST {
            return Err(RecordError(format!(
                "file-system format version {version} is older than this build reads ({FS_VERSION_OLDEST}: back pointers for file handles were added); copy the files out with the betreefs that made the image and into a new one"
            )));
        }
        let ino_reserved = d.u64().map_err(|_| foreign())?;
        let created = d.u64().map_err(|_| foreign())? as i64;
        let info = FsInfo {
            ino_reserved,
            created,
        };
        Ok((info, version))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Attr {
        Attr {
            ino: 0x0102030405060708,
            mode: S_IFLNK | 0o777,
            uid: 1000,
            gid: 100,
            nlink: 1,
            rdev: 7,
            size: 3,
            atime: Timespec { sec: -5, nsec: 1 },
            mtime: Timespec {
                sec: 1 << 40,
                nsec: 999_999_999,
            },
            ctime: Timespec { sec: 0, nsec: 0 },
            crtime: Timespec { sec: 17, nsec: 5 },
            flags: FS_APPEND_FL | FS_NODUMP_FL | SPARSE_FL,
            stored_blocks: None,
        }
    }

    #[test]
    fn records_round_trip() {
        for r in [
            Record::Inode {
                attr: sample(),
                target: b"a\xff/b".to_vec(),
            },
            Record::Link {
                ino: 42,
                mode: S_IFREG | 0o644,
            },
        ] {
            assert_eq!(Record::decode(&r.encode()), Ok(r));
        }
        let enc = Record::Inode {
            attr: sample(),
            target: Vec::new(),
        }
        .encode();
        assert_eq!(enc.len(), INODE_FIXED);
        assert_eq!(&enc[..2], &[1, 1]);
        assert_eq!(&enc[2..10], &0x0102030405060708u64.to_le_bytes());
    }

    #[test]
    fn corrupt_records_are_refused() {
        let enc = Record::Inode {
            attr: sample(),
            target: Vec::new(),
        }
        .encode();
        for cut in 0..INODE_FIXED {
            assert!(Record::decode(&enc[..cut]).is_err() || cut == LINK_LEN);
        }
        let mut bad = enc.clone();
        bad[0] = 2;
        assert!(Record::decode(&bad).is_err());
        let mut bad = enc.clone();
        bad[1] = 9;
        assert!(Record::decode(&bad).is_err());
        let mut bad = enc.clone();
        bad[86..90].copy_from_slice(&0x1000u32.to_le_bytes());
        assert!(Record::decode(&bad).is_err(), "unknown inode flag");
        let mut bad = enc;
        bad[46..50].copy_from_slice(&2_000_000_000u32.to_le_bytes());
        assert!(Record::decode(&bad).is_err());
    }

    #[test]
    fn fs_info_round_trips_and_refuses_foreign() {
        let info = FsInfo {
            ino_reserved: 4096,
            created: 1_700_000_000,
        };
        assert_eq!(FsInfo::decode(&info.encode()), Ok(info.clone()));
        let mut other = info.encode();
        other[0] = b'x';
        assert!(FsInfo::decode(&other).is_err());
        assert_eq!(
            FsInfo::decode_versioned(&info.encode()),
            Ok((info.clone(), FS_VERSION))
        );
        let mut newer = info.encode();
        newer[8] = 5;
        assert!(FsInfo::decode(&newer).unwrap_err().0.contains("version 5"));
        let mut older = info.encode();
        older[8] = 1;
        assert!(FsInfo::decode(&older).unwrap_err().0.contains("version 1"));
        // Versions 2 and 3 lack only what later versions added: read, and
        // upgraded.
        for version in [2, 3] {
            older[8] = version;
            assert_eq!(FsInfo::decode(&older), Ok(info.clone()));
            assert_eq!(
                FsInfo::decode_versioned(&older).map(|(_, v)| v),
                Ok(u32::from(version))
            );
        }
    }

    #[test]
    fn the_key_bound_round_trips_and_refuses_bad_records() {
        for bound in [0, 256, 11_904, usize::MAX >> 1] {
            assert_eq!(
                KeyBound::decode(&KeyBound(bound).encode()),
                Ok(KeyBound(bound))
            );
        }
        let good = KeyBound(320).encode();
        assert!(KeyBound::decode(&good[..8]).is_err());
        assert!(KeyBound::decode(&[good.as_slice(), &[0]].concat()).is_err());
        let mut other_version = good.clone();
        other_version[0] = 2;
        assert!(KeyBound::decode(&other_version)
            .unwrap_err()
            .0
            .contains("version 2"));
    }

    #[test]
    fn back_pointers_round_trip_and_refuse_bad_lengths() {
        let bp = BackPointer {
            parent: 77,
            name: b"a\x00/b".to_vec(),
        };
        assert_eq!(BackPointer::decode(&bp.encode()), Ok(bp));
        assert!(BackPointer::decode(&[1; 8]).is_err());
        assert!(BackPointer::decode(&[1; 7]).is_err());
        assert!(BackPointer::decode(&[1; 8 + 256]).is_err());
    }

    #[test]
    fn times_before_the_epoch() {
        let t = Timespec { sec: -2, nsec: 500 };
        assert_eq!(Timespec::from_system(t.to_system()), t);
        let t = Timespec { sec: 12, nsec: 7 };
        assert_eq!(Timespec::from_system(t.to_system()), t);
    }
}
