//! The offline checker: every key of both key spaces must be one the
//! schema can produce, and the records must agree with each other.
//!
//! Checked: the identity and root records; every entry's record decodes
//! and its parent directory exists (a parent's entry key sorts before its
//! children's, so one forward scan sees parents first); hard links point
//! at inode records whose link counts match; directory link counts are
//! 2 + subdirectories; inode numbers are unique; the inode count record
//! matches; every data key belongs to a regular file and lies below its
//! size; every xattr key belongs to an existing file; orphan markers name
//! inode records. Tree-level checks (checksums, order, bounds) are the
//! engine's [`betreefs_engine::Store::verify`].

use std::collections::HashMap;

use betreefs_engine::{KeySpace, Store};

use crate::fs::{BLOCK_SIZE, ROOT_INO};
use crate::record::{FsInfo, Record};
use crate::schema::{self, DataKey};

/// What fsck found.
#[derive(Debug, Default)]
pub struct Report {
    pub entries: u64,
    pub directories: u64,
    pub data_keys: u64,
    pub xattrs: u64,
    pub problems: Vec<String>,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
    fn problem(&mut self, p: String) {
        if self.problems.len() < 1000 {
            self.problems.push(p);
        }
    }
}

struct FileInfo {
    size: u64,
    regular: bool,
}

fn show(key: &[u8]) -> String {
    key.escape_ascii().to_string()
}

/// Scans both key spaces; `progress` is called with the number of keys
/// checked so far every few thousand keys.
pub fn check(store: &Store, mut progress: impl FnMut(u64)) -> Result<Report, String> {
    let mut r = Report::default();
    let mut seen: u64 = 0;
    let mut tick = |seen: &mut u64| {
        *seen += 1;
        if seen.is_multiple_of(4096) {
            progress(*seen);
        }
    };
    // dir key -> (subdirectories seen, nlink recorded)
    let mut dirs: HashMap<Vec<u8>, (u32, u32)> = HashMap::new();
    // file key -> size and kind, for data keys
    let mut files: HashMap<Vec<u8>, FileInfo> = HashMap::new();
    let mut inos: HashMap<u64, Vec<u8>> = HashMap::new();
    // ino -> (recorded nlink, link records seen)
    let mut linked: HashMap<u64, (u32, u32)> = HashMap::new();
    let mut orphans: Vec<u64> = Vec::new();
    let mut counted_inodes: u64 = 0;
    let mut recorded_count = None;
    let mut info_seen = false;

    // The root's record sorts after its entries (0x02 > 0x00): read it first.
    match store
        .get(KeySpace::Meta, schema::ROOT_KEY)
        .map_err(|e| format!("reading the root: {e}"))?
    {
        Some(v) => match Record::decode(&v) {
            Ok(Record::Inode { attr, .. }) if attr.is_dir() && attr.ino == ROOT_INO => {
                dirs.insert(Vec::new(), (0, attr.nlink));
                files.insert(
                    schema::ROOT_KEY.to_vec(),
                    FileInfo {
                        size: 0,
                        regular: false,
                    },
                );
                counted_inodes += 1;
                r.directories += 1;
            }
            _ => r.problem("the root record is not a directory with inode 1".into()),
        },
        None => r.problem("the root directory is missing".into()),
    }
    for item in store.range(KeySpace::Meta, b"", None) {
        let (key, value) = item.map_err(|e| format!("reading metadata: {e}"))?;
        tick(&mut seen);
        if key == schema::INFO_KEY {
            info_seen = true;
            if let Err(e) = FsInfo::decode(&value) {
                r.problem(format!("identity record: {}", e.0));
            }
            continue;
        }
        if key == schema::COUNTS_KEY {
            recorded_count = Some(betreefs_engine::merge::record_slot(&value, 0));
            continue;
        }
        if let Some(ino) = schema::orphan_ino(&key) {
            orphans.push(ino);
            continue;
        }
        let record = match Record::decode(&value) {
            Ok(rec) => rec,
            Err(e) => {
                r.problem(format!("record at {}: {}", show(&key), e.0));
                continue;
            }
        };
        if key == schema::ROOT_KEY {
            continue;
        }
        if key.len() == 10 && key.starts_with(b"\x01i") {
            let ino = u64::from_be_bytes(key[2..10].try_into().unwrap_or_default());
            match &record {
                Record::Inode { attr, .. } if attr.ino == ino && !attr.is_dir() => {
                    linked.entry(ino).or_default().0 = attr.nlink;
                    files.insert(
                        key.clone(),
                        FileInfo {
                            size: attr.size,
                            regular: attr.file_type() == libc::S_IFREG,
                        },
                    );
                    if let Some(other) = inos.insert(ino, key.clone()) {
                        r.problem(format!(
                            "inode {ino} is used by {} and by {}",
                            show(&other),
                            show(&key)
                        ));
                    }
                    counted_inodes += 1;
                }
                _ => r.problem(format!(
                    "inode key {} holds a record for another inode or a directory",
                    show(&key)
                )),
            }
            continue;
        }
        let Some((dir, name)) = schema::parse_entry_key(&key) else {
            r.problem(format!(
                "metadata key {} is no entry the schema can produce",
                show(&key)
            ));
            continue;
        };
        r.entries += 1;
        match dirs.get_mut(dir) {
            Some(parent) => {
                if record.mode() & libc::S_IFMT == libc::S_IFDIR {
                    parent.0 += 1;
                }
            }
            None => r.problem(format!("entry {} has no parent directory", show(&key))),
        }
        match &record {
            Record::Inode { attr, target } => {
                if let Some(other) = inos.insert(attr.ino, key.clone()) {
                    r.problem(format!(
                        "inode {} is used by {} and by {}",
                        attr.ino,
                        show(&other),
                        show(&key)
                    ));
                }
                if attr.is_dir() {
                    r.directories += 1;
                    dirs.insert(schema::child_dir_key(dir, &name), (0, attr.nlink));
                } else if attr.nlink != 1 {
                    r.problem(format!(
                        "{} has nlink {} but one name",
                        show(&key),
                        attr.nlink
                    ));
                }
                if attr.file_type() == libc::S_IFLNK
                    && (target.is_empty() || attr.size != target.len() as u64)
                {
                    r.problem(format!("symlink {} has a bad target", show(&key)));
                }
                files.insert(
                    key.clone(),
                    FileInfo {
                        size: attr.size,
                        regular: attr.file_type() == libc::S_IFREG,
                    },
                );
                counted_inodes += 1;
            }
            Record::Link { ino, .. } => {
                linked.entry(*ino).or_default().1 += 1;
            }
        }
    }
    if !info_seen {
        r.problem("the identity record is missing".into());
    }
    for (dir, (subdirs, nlink)) in &dirs {
        if *nlink != subdirs + 2 {
            r.problem(format!(
                "directory {} has nlink {nlink}, expected {}",
                show(dir),
                subdirs + 2
            ));
        }
    }
    let orphan_set: std::collections::HashSet<u64> = orphans.iter().copied().collect();
    for (ino, (nlink, links)) in &linked {
        if !inos.contains_key(ino) {
            r.problem(format!("{links} hard link(s) to missing inode {ino}"));
        } else if nlink != links && !(*nlink == 0 && orphan_set.contains(ino)) {
            r.problem(format!("inode {ino} has nlink {nlink} but {links} link(s)"));
        }
    }
    for ino in &orphans {
        if !linked.contains_key(ino) {
            r.problem(format!("orphan marker for missing inode {ino}"));
        }
    }
    if recorded_count != Some(counted_inodes) {
        r.problem(format!(
            "inode count record says {recorded_count:?}, found {counted_inodes}"
        ));
    }

    for item in store.range(KeySpace::Data, b"", None) {
        let (key, value) = item.map_err(|e| format!("reading data: {e}"))?;
        tick(&mut seen);
        match schema::parse_data_key(&key) {
            Some(DataKey::Block { file, block }) => {
                r.data_keys += 1;
                match files.get(file) {
                    Some(f) if f.regular => {
                        let start = block.saturating_mul(BLOCK_SIZE);
                        if value.len() as u64 > BLOCK_SIZE
                            || (!value.is_empty() && start + value.len() as u64 > f.size)
                        {
                            r.problem(format!(
                                "block {block} of {} lies beyond its size {}",
                                show(file),
                                f.size
                            ));
                        }
                    }
                    Some(_) => r.problem(format!("data block under non-file {}", show(file))),
                    None => r.problem(format!("data block {block} of missing file {}", show(file))),
                }
            }
            Some(DataKey::Xattr { file, .. }) => {
                r.xattrs += 1;
                if !files.contains_key(file) {
                    r.problem(format!("xattr of missing file {}", show(file)));
                }
            }
            None => r.problem(format!(
                "data key {} is no key the schema can produce",
                show(&key)
            )),
        }
    }
    progress(seen);
    Ok(r)
}
