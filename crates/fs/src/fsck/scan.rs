//! The scan: both key spaces in key order, checking every key against the
//! schema and the records against each other.
//!
//! Checked: the identity and root records; every entry's record decodes
//! and its parent directory exists (a parent's entry key sorts before its
//! children's, so one forward scan sees parents first); hard links point
//! at inode records whose link counts match; directory link counts are
//! 2 + subdirectories; inode numbers are unique; the inode count record
//! matches; every data key belongs to a regular file and lies below its
//! size; every xattr key belongs to an existing file; reservations belong
//! to regular files marked as having them, are disjoint, cover no stored
//! block and add up to the count recorded; orphan markers name inode
//! records; every inode named by a path has the back pointer to its
//! entry, and no other back pointer exists.

use std::collections::{BTreeSet, HashMap, HashSet};

use betreefs_engine::{KeySpace, Store};

use super::{Fix, Report};
use crate::fs::key_bound;
use crate::fs::{BLOCK_SIZE, ROOT_INO};
use crate::plan::{dir_record_key, INODES_SLOT, RESERVED_SLOT};
use crate::record::{
    decode_reservation, BackPointer, FsInfo, KeyBound, Record, FS_VERSION, PREALLOC_FL,
};
use crate::schema::{self, DataKey};
use betreefs_engine::merge::record_slot;

struct FileInfo {
    size: u64,
    regular: bool,
    /// Marked as having reservations (`PREALLOC_FL`).
    prealloc: bool,
}

impl FileInfo {
    fn of(attr: &crate::record::Attr) -> FileInfo {
        FileInfo {
            size: attr.size,
            regular: attr.file_type() == libc::S_IFREG,
            prealloc: attr.flags & PREALLOC_FL != 0,
        }
    }
}

/// The data keys of the file being scanned: the runs of blocks it stores
/// (its blocks sort before its reservations) and where its last
/// reservation ended.
#[derive(Default)]
struct CurrentFile {
    key: Vec<u8>,
    stored: Vec<(u64, u64)>,
    reserved_to: u64,
}

/// A directory seen: its record's key, subdirectories found, link count.
struct DirInfo {
    ino: u64,
    record_key: Vec<u8>,
    subdirs: u32,
    nlink: u32,
}

/// An inode kept by number: its recorded link count and the link records
/// naming it.
#[derive(Default)]
struct Linked {
    nlink: Option<u32>,
    links: Vec<Vec<u8>>,
}

fn show(key: &[u8]) -> String {
    key.escape_ascii().to_string()
}

/// The state of one scan.
#[derive(Default)]
struct Scan {
    report: Report,
    /// dir key -> what was seen of it
    dirs: HashMap<Vec<u8>, DirInfo>,
    /// file key -> size and kind, for data keys
    files: HashMap<Vec<u8>, FileInfo>,
    inos: HashMap<u64, Vec<u8>>,
    linked: HashMap<u64, Linked>,
    /// Directories that entries live in but that have no record, with how
    /// many entries were seen in them.
    missing_dirs: HashMap<Vec<u8>, u64>,
    orphans: Vec<u64>,
    /// The back pointer each inode named by a path should have.
    expected_back_pointers: HashMap<u64, BackPointer>,
    back_pointers: HashMap<u64, BackPointer>,
    counted_inodes: u64,
    highest_ino: u64,
    current: CurrentFile,
    /// Blocks in the reservations found sound.
    reserved_blocks: u64,
}

impl Scan {
    fn see_ino(&mut self, ino: u64, key: &[u8]) {
        self.highest_ino = self.highest_ino.max(ino);
        if let Some(other) = self.inos.insert(ino, key.to_vec()) {
            self.report.problem(
                format!(
                    "inode {ino} is used by {} and by {}",
                    show(&other),
                    show(key)
                ),
                None,
            );
        }
    }

    /// An entry lives in `dir`, which has no record: note it and every
    /// missing ancestor (each recreated, top down).
    fn note_missing_dir(&mut self, dir: &[u8]) {
        *self.missing_dirs.entry(dir.to_vec()).or_default() += 1;
        let mut cur = dir.to_vec();
        while let Some(entry) = schema::dir_entry_key(&cur) {
            let Some((parent, _)) = schema::parse_entry_key(&entry) else {
                return;
            };
            if parent.is_empty() || self.dirs.contains_key(parent) {
                return;
            }
            let parent = parent.to_vec();
            self.missing_dirs.entry(parent.clone()).or_default();
            cur = parent;
        }
    }

    fn root(&mut self, store: &Store) -> Result<(), String> {
        // The root's record sorts after its entries (0x02 > 0x00): read it first.
        match store
            .get(KeySpace::Meta, schema::ROOT_KEY)
            .map_err(|e| format!("reading the root: {e}"))?
        {
            Some(v) => match Record::decode(&v) {
                Ok(Record::Inode { attr, .. }) if attr.is_dir() && attr.ino == ROOT_INO => {
                    self.dirs.insert(
                        Vec::new(),
                        DirInfo {
                            ino: ROOT_INO,
                            record_key: schema::ROOT_KEY.to_vec(),
                            subdirs: 0,
                            nlink: attr.nlink,
                        },
                    );
                    self.files.insert(
                        schema::ROOT_KEY.to_vec(),
                        FileInfo {
                            size: 0,
                            regular: false,
                            prealloc: false,
                        },
                    );
                    self.counted_inodes += 1;
                    self.report.directories += 1;
                }
                _ => self.report.problem(
                    "the root record is not a directory with inode 1".into(),
                    None,
                ),
            },
            None => self
                .report
                .problem("the root directory is missing".into(), None),
        }
        Ok(())
    }

    fn inode_keyed(&mut self, key: Vec<u8>, record: Record) {
        let ino = schema::inode_key_ino(&key);
        match (&record, ino) {
            (Record::Inode { attr, .. }, Some(ino)) if attr.ino == ino && !attr.is_dir() => {
                self.linked.entry(ino).or_default().nlink = Some(attr.nlink);
                self.files.insert(key.clone(), FileInfo::of(attr));
                self.see_ino(ino, &key);
                self.counted_inodes += 1;
            }
            _ => self.report.problem(
                format!(
                    "inode key {} holds a record for another inode or a directory",
                    show(&key)
                ),
                None,
            ),
        }
    }

    fn entry(&mut self, key: Vec<u8>, record: Record) {
        let Some((dir, name)) = schema::parse_entry_key(&key) else {
            self.report.problem(
                format!(
                    "metadata key {} is no entry the schema can produce",
                    show(&key)
                ),
                Some(Fix::DeleteKey(KeySpace::Meta, key.clone())),
            );
            return;
        };
        self.report.entries += 1;
        let is_dir = record.mode() & libc::S_IFMT == libc::S_IFDIR;
        if let (Some(parent), Record::Inode { attr, .. }) = (self.dirs.get(dir), &record) {
            let bp = BackPointer {
                parent: parent.ino,
                name: name.clone(),
            };
            self.expected_back_pointers.insert(attr.ino, bp);
        }
        match self.dirs.get_mut(dir) {
            Some(parent) => parent.subdirs += u32::from(is_dir),
            None => {
                let dir = dir.to_vec();
                self.note_missing_dir(&dir);
            }
        }
        match &record {
            Record::Inode { attr, target } => {
                self.see_ino(attr.ino, &key);
                if attr.is_dir() {
                    self.report.directories += 1;
                    self.dirs.insert(
                        schema::child_dir_key(dir, &name),
                        DirInfo {
                            ino: attr.ino,
                            record_key: key.clone(),
                            subdirs: 0,
                            nlink: attr.nlink,
                        },
                    );
                } else if attr.nlink != 1 {
                    self.report.problem(
                        format!("{} has nlink {} but one name", show(&key), attr.nlink),
                        Some(Fix::SetLinkCount {
                            key: key.clone(),
                            nlink: 1,
                        }),
                    );
                }
                if attr.file_type() == libc::S_IFLNK
                    && (target.is_empty() || attr.size != target.len() as u64)
                {
                    self.report
                        .problem(format!("symlink {} has a bad target", show(&key)), None);
                }
                self.files.insert(key.clone(), FileInfo::of(attr));
                self.counted_inodes += 1;
            }
            Record::Link { ino, .. } => {
                self.linked.entry(*ino).or_default().links.push(key.clone());
            }
        }
    }

    /// Checks what only the whole metadata scan can tell.
    fn metadata_totals(&mut self, info_seen: bool, recorded_count: Option<u64>) {
        if !info_seen {
            self.report.problem(
                "the identity record is missing".into(),
                Some(Fix::RecreateIdentity {
                    highest_ino: self.highest_ino,
                }),
            );
        }
        let missing: BTreeSet<Vec<u8>> = self.missing_dirs.keys().cloned().collect();
        for dir in missing {
            let entries = self.missing_dirs.get(&dir).copied().unwrap_or(0);
            let record_key = dir_record_key(&dir);
            // A file where the directory should be: recreating it would
            // overwrite the file.
            let fix = (!self.files.contains_key(&record_key))
                .then_some(Fix::RecreateDirectory { key: record_key });
            self.report.problem(
                format!(
                    "directory {} is missing ({entries} entries live in it)",
                    show(&dir)
                ),
                fix,
            );
        }
        let mut dirs: Vec<_> = self.dirs.values().collect();
        dirs.sort_by(|a, b| a.record_key.cmp(&b.record_key));
        let mut wrong = Vec::new();
        for d in dirs {
            if d.nlink != d.subdirs + 2 {
                wrong.push((d.record_key.clone(), d.nlink, d.subdirs + 2));
            }
        }
        for (key, nlink, expected) in wrong {
            self.report.problem(
                format!(
                    "directory {} has nlink {nlink}, expected {expected}",
                    show(&key)
                ),
                Some(Fix::SetLinkCount {
                    key,
                    nlink: expected,
                }),
            );
        }
        let orphans: HashSet<u64> = self.orphans.iter().copied().collect();
        let mut linked: Vec<_> = std::mem::take(&mut self.linked).into_iter().collect();
        linked.sort_by_key(|(ino, _)| *ino);
        for (ino, l) in &linked {
            let links = l.links.len() as u32;
            match l.nlink {
                None => {
                    for key in &l.links {
                        self.report.problem(
                            format!("hard link {} to missing inode {ino}", show(key)),
                            Some(Fix::DeleteKey(KeySpace::Meta, key.clone())),
                        );
                    }
                }
                Some(0) if links == 0 && orphans.contains(ino) => {}
                Some(_) if links == 0 && !orphans.contains(ino) => self.report.problem(
                    format!("inode {ino} has no name and no orphan marker"),
                    Some(Fix::PurgeInode(*ino)),
                ),
                Some(nlink) if nlink != links && links > 0 => self.report.problem(
                    format!("inode {ino} has nlink {nlink} but {links} link(s)"),
                    Some(Fix::SetLinkCount {
                        key: schema::inode_key(*ino),
                        nlink: links,
                    }),
                ),
                Some(_) => {}
            }
        }
        let known: HashSet<u64> = linked
            .iter()
            .filter(|(_, l)| l.nlink.is_some())
            .map(|(ino, _)| *ino)
            .collect();
        let orphans = std::mem::take(&mut self.orphans);
        for ino in orphans {
            if !known.contains(&ino) {
                self.report.problem(
                    format!("orphan marker for missing inode {ino}"),
                    Some(Fix::DeleteKey(KeySpace::Meta, schema::orphan_key(ino))),
                );
            }
        }
        self.check_back_pointers();
        if recorded_count != Some(self.counted_inodes) {
            self.report.problem(
                format!(
                    "inode count record says {recorded_count:?}, found {}",
                    self.counted_inodes
                ),
                Some(Fix::SetInodeCount(self.counted_inodes)),
            );
        }
    }

    /// Every inode named by a path has a back pointer naming that entry,
    /// and no other inode has one.
    fn check_back_pointers(&mut self) {
        let mut expected: Vec<_> = std::mem::take(&mut self.expected_back_pointers)
            .into_iter()
            .collect();
        expected.sort_by_key(|(ino, _)| *ino);
        let mut found = std::mem::take(&mut self.back_pointers);
        for (ino, bp) in expected {
            let what = match found.remove(&ino) {
                Some(have) if have == bp => continue,
                Some(have) => format!(
                    "back pointer of inode {ino} names {} in {}, not {} in {}",
                    show(&have.name),
                    have.parent,
                    show(&bp.name),
                    bp.parent
                ),
                None => format!(
                    "inode {ino} ({} in {}) has no back pointer",
                    show(&bp.name),
                    bp.parent
                ),
            };
            self.report.problem(
                what,
                Some(Fix::SetBackPointer {
                    ino,
                    parent: bp.parent,
                    name: bp.name,
                }),
            );
        }
        let mut stale: Vec<u64> = found.into_keys().collect();
        stale.sort_unstable();
        for ino in stale {
            self.report.problem(
                format!("back pointer of inode {ino}, which no entry names"),
                Some(Fix::DeleteKey(
                    KeySpace::Meta,
                    schema::back_pointer_key(ino),
                )),
            );
        }
    }

    /// Where the scan is: the data keys of `file` from here on.
    fn enter_file(&mut self, file: &[u8]) {
        if self.current.key != file {
            self.current = CurrentFile {
                key: file.to_vec(),
                ..CurrentFile::default()
            };
        }
    }

    /// A reservation [start, end) of `file`: `None` when sound (counted).
    fn reservation(&mut self, file: &[u8], end: u64, value: &[u8]) -> Option<String> {
        self.enter_file(file);
        let Some(start) = decode_reservation(value, end) else {
            return Some(format!(
                "reservation ending at block {end} of {} is corrupt",
                show(file)
            ));
        };
        let problem = match self.files.get(file) {
            None => Some("of a missing file"),
            Some(f) if !f.regular => Some("of a non-file"),
            Some(f) if !f.prealloc => Some("of a file not marked as having any"),
            Some(_) if start < self.current.reserved_to => Some("overlapping another"),
            Some(_) => {
                let stored = &self.current.stored;
                let i = stored.partition_point(|&(_, e)| e <= start);
                stored
                    .get(i)
                    .is_some_and(|&(s, _)| s < end)
                    .then_some("over stored blocks")
            }
        };
        if let Some(why) = problem {
            return Some(format!(
                "reservation of blocks {start}..{end} of {} {why}",
                show(file)
            ));
        }
        self.current.reserved_to = end;
        self.reserved_blocks += end - start;
        None
    }

    fn data_key(&mut self, key: Vec<u8>, value: &[u8]) {
        let value_len = value.len() as u64;
        let stray = |what: String| (what, Some(Fix::DeleteKey(KeySpace::Data, key.clone())));
        let problem = match schema::parse_data_key(&key) {
            Some(DataKey::Reservation { file, end }) => {
                self.reservation(file, end, value).map(stray)
            }
            Some(DataKey::Block { file, block }) => {
                self.report.data_keys += 1;
                self.enter_file(file);
                match self.current.stored.last_mut() {
                    Some(run) if run.1 == block => run.1 += 1,
                    _ => self.current.stored.push((block, block + 1)),
                }
                match self.files.get(file) {
                    Some(f) if f.regular => {
                        let start = block.saturating_mul(BLOCK_SIZE);
                        (value_len > BLOCK_SIZE || (value_len > 0 && start + value_len > f.size))
                            .then(|| {
                                stray(format!(
                                    "block {block} of {} lies beyond its size {}",
                                    show(file),
                                    f.size
                                ))
                            })
                    }
                    Some(_) => Some(stray(format!("data block under non-file {}", show(file)))),
                    None => Some(stray(format!(
                        "data block {block} of missing file {}",
                        show(file)
                    ))),
                }
            }
            Some(DataKey::Xattr { file, .. }) => {
                self.report.xattrs += 1;
                (!self.files.contains_key(file))
                    .then(|| stray(format!("xattr of missing file {}", show(file))))
            }
            None => Some(stray(format!(
                "data key {} is no key the schema can produce",
                show(&key)
            ))),
        };
        if let Some((what, fix)) = problem {
            self.report.problem(what, fix);
        }
    }
}

/// Scans both key spaces; `progress` is called with the number of keys
/// checked so far every few thousand keys. Reads only.
pub fn check(store: &Store, mut progress: impl FnMut(u64)) -> Result<Report, String> {
    let mut scan = Scan::default();
    let mut seen: u64 = 0;
    let mut tick = |seen: &mut u64| {
        *seen += 1;
        if seen.is_multiple_of(4096) {
            progress(*seen);
        }
    };
    let mut recorded_count = None;
    let mut recorded_reserved = 0;
    let mut info_seen = false;
    let mut format = FS_VERSION;
    let mut key_bound: Option<Result<usize, String>> = None;
    let mut longest_key = 0;
    scan.root(store)?;
    for item in store.range(KeySpace::Meta, b"", None) {
        let (key, value) = item.map_err(|e| format!("reading metadata: {e}"))?;
        tick(&mut seen);
        longest_key = longest_key.max(key.len());
        if key == schema::INFO_KEY {
            info_seen = true;
            match FsInfo::decode_versioned(&value) {
                Ok((info, version)) => {
                    scan.highest_ino = scan.highest_ino.max(info.ino_reserved);
                    format = version;
                }
                Err(e) => scan
                    .report
                    .problem(format!("identity record: {}", e.0), None),
            }
            continue;
        }
        if key == schema::KEY_BOUND_KEY {
            key_bound = Some(KeyBound::decode(&value).map(|b| b.0).map_err(|e| e.0));
            continue;
        }
        if key == schema::COUNTS_KEY {
            recorded_count = Some(record_slot(&value, INODES_SLOT));
            recorded_reserved = record_slot(&value, RESERVED_SLOT);
            continue;
        }
        if key == schema::ROOT_KEY {
            continue;
        }
        if let Some(ino) = schema::orphan_ino(&key) {
            scan.orphans.push(ino);
            continue;
        }
        if let Some(ino) = schema::back_pointer_ino(&key) {
            match BackPointer::decode(&value) {
                Ok(bp) => {
                    scan.back_pointers.insert(ino, bp);
                }
                Err(e) => scan.report.problem(
                    format!("back pointer of inode {ino}: {}", e.0),
                    Some(Fix::DeleteKey(KeySpace::Meta, key.clone())),
                ),
            }
            continue;
        }
        let record = match Record::decode(&value) {
            Ok(rec) => rec,
            Err(e) => {
                scan.report
                    .problem(format!("record at {}: {}", show(&key), e.0), None);
                continue;
            }
        };
        if schema::inode_key_ino(&key).is_some() {
            scan.inode_keyed(key, record);
        } else {
            scan.entry(key, record);
        }
    }
    scan.metadata_totals(info_seen, recorded_count);
    // Images before format 4 have no key bound (a read-write mount finds
    // it); from format 4 on, no metadata key may be longer.
    let bound_problem = match key_bound {
        _ if format < 4 => None,
        None => Some("the key bound record is missing".to_string()),
        Some(Err(e)) => Some(e),
        Some(Ok(bound)) if bound < longest_key => Some(format!(
            "the key bound says {bound} bytes, the longest metadata key has {longest_key}"
        )),
        Some(Ok(_)) => None,
    };
    if let Some(what) = bound_problem {
        scan.report.problem(
            what,
            Some(Fix::SetKeyBound(key_bound::rounded(longest_key))),
        );
    }
    for item in store.range(KeySpace::Data, b"", None) {
        let (key, value) = item.map_err(|e| format!("reading data: {e}"))?;
        tick(&mut seen);
        scan.data_key(key, &value);
    }
    if scan.reserved_blocks != recorded_reserved {
        scan.report.problem(
            format!(
                "the reserved-block count says {recorded_reserved}, the reservations hold {}",
                scan.reserved_blocks
            ),
            Some(Fix::SetReservedCount(scan.reserved_blocks)),
        );
    }
    progress(seen);
    Ok(scan.report)
}
