//! Full-path keys (BetrFS 0.4 §2.2, docs/design.md "The file system schema").
//!
//! A directory at path `/c1/c2/.../cn` is encoded as
//! `enc = esc(c1) 01 esc(c2) 01 ... 01 esc(cn)` (the root is empty). The
//! entry for `name` inside it has the key `enc 00 esc(name)`, and a file's
//! block `b` in the data key space is `entry 00 b` (8 bytes, big-endian).
//!
//! Names may hold any byte but `/` and NUL. `esc` keeps every output byte at
//! 0x03 or above by writing 0x01, 0x02 and 0x03 as 0x03 0x04, 0x03 0x05 and
//! 0x03 0x06; this preserves byte order, and it keeps the separators 0x00
//! and 0x01 (and the range end 0x02) out of encoded names. Then:
//!
//! 1. keys compare with memcmp;
//! 2. a directory's descendants (both key spaces) are the one range
//!    [`enc 00`, `enc 02`) — see [`subtree_range`];
//! 3. its direct children are the range [`enc 00`, `enc 01`), all before any
//!    grandchild (`enc 01 ...`) — see [`children_range`];
//! 4. a file's data keys are the range [`entry 00`, `entry 01`), which no
//!    other file's key can fall into — see [`data_range`];
//! 5. names of any bytes but `/` and NUL, up to 255 bytes, round-trip.
//!
//! Every path key begins with 0x00 (an entry of the root) or an escaped
//! name byte (0x03 and above), so keys beginning with 0x01 or 0x02 can never
//! be a path's: they hold what is not named by a path. 0x01 `i` ino (8 bytes,
//! big-endian) is a file kept by inode number (hard links, open unlinked
//! files; [`inode_key`]), and 0x02 keys are file-system records
//! ([`INFO_KEY`], [`ROOT_KEY`], [`COUNTS_KEY`], [`KEY_BOUND_KEY`],
//! [`orphan_key`]).
//!
//! Every file, directory and symlink has a "file key" `F` (its entry key,
//! its inode key, or [`ROOT_KEY`]): its attributes are at `F` in the
//! metadata key space; in the data key space its blocks are `F 00 block`,
//! its preallocated extents `F 01 00 end` ([`reservation_key`], format
//! version 3) and its extended attributes `F 01 name` ([`xattr_key`]; a
//! name never holds a NUL, so the two cannot meet), and everything a file
//! owns there is the one range [`file_range`]: rename, link and unlink
//! carry or drop all of it at once. Extended attributes are kept in the
//! data space, not the metadata space the design suggests, so that
//! readdir's scan of a directory's children never steps over them.

/// Longest file name, in bytes (as in Linux).
pub const NAME_MAX: usize = 255;
/// Longest path, in bytes, including the terminating NUL (as in Linux).
pub const PATH_MAX: usize = 4096;

const SEP_ENTRY: u8 = 0x00;
const SEP_DIR: u8 = 0x01;
const RANGE_END: u8 = 0x02;
const ESCAPE: u8 = 0x03;

/// Why a name cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameError {
    Empty,
    TooLong(usize),
    /// `/` or NUL, or the names `.` and `..`.
    Invalid,
}

/// Checks a single path component as POSIX allows it.
pub fn check_name(name: &[u8]) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > NAME_MAX {
        return Err(NameError::TooLong(name.len()));
    }
    if name.contains(&b'/') || name.contains(&0) || name == b"." || name == b".." {
        return Err(NameError::Invalid);
    }
    Ok(())
}

/// Appends `name` to `out` with the bytes keys use as separators
/// escaped: copied a run at a time between them (they are rare in names;
/// a key is built for every write to a file).
fn escape_into(out: &mut Vec<u8>, name: &[u8]) {
    out.reserve(name.len());
    let mut rest = name;
    while let Some(at) = rest.iter().position(|b| (0x01..=0x03).contains(b)) {
        let (run, from) = rest.split_at(at);
        out.extend_from_slice(run);
        if let Some((&b, after)) = from.split_first() {
            out.push(ESCAPE);
            out.push(b + 3);
            rest = after;
        }
    }
    out.extend_from_slice(rest);
}

/// Reverses [`escape_into`]; `None` for bytes no escaping produces.
fn unescape(encoded: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(encoded.len());
    let mut bytes = encoded.iter();
    while let Some(&b) = bytes.next() {
        match b {
            ESCAPE => match bytes.next() {
                Some(&e @ 0x04..=0x06) => out.push(e - 3),
                _ => return None,
            },
            0x00..=0x02 => return None,
            _ => out.push(b),
        }
    }
    Some(out)
}

/// Makes the directory key `dir` that of its child directory `name`, in
/// place.
fn push_child_dir(dir: &mut Vec<u8>, name: &[u8]) {
    if !dir.is_empty() {
        dir.push(SEP_DIR);
    }
    escape_into(dir, name);
}

/// Makes the directory key `dir` the key of its entry `name`, in place.
fn push_entry(dir: &mut Vec<u8>, name: &[u8]) {
    dir.push(SEP_ENTRY);
    escape_into(dir, name);
}

/// A copy of `dir` with room for `name` and a separator, changed by `push`.
fn extended(dir: &[u8], name: &[u8], push: fn(&mut Vec<u8>, &[u8])) -> Vec<u8> {
    let mut out = Vec::with_capacity(dir.len() + name.len() + 1);
    out.extend_from_slice(dir);
    push(&mut out, name);
    out
}

/// The encoding of a directory given its path components (root: none),
/// built in one buffer (every write to a file computes its key).
pub fn dir_key<'a>(components: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    for name in components {
        push_child_dir(&mut out, name);
    }
    out
}

/// The encoding of the directory that is entry `name` of directory `dir`.
pub fn child_dir_key(dir: &[u8], name: &[u8]) -> Vec<u8> {
    extended(dir, name, push_child_dir)
}

/// The metadata key of entry `name` in directory `dir`.
pub fn entry_key(dir: &[u8], name: &[u8]) -> Vec<u8> {
    extended(dir, name, push_entry)
}

/// The name of an entry key within `dir` (for readdir), if it is a child.
pub fn child_name(dir: &[u8], key: &[u8]) -> Option<Vec<u8>> {
    let rest = key.strip_prefix(dir)?.strip_prefix(&[SEP_ENTRY])?;
    unescape(rest)
}

/// The data key of block `block` of the file whose entry key is `entry`.
pub fn data_key(entry: &[u8], block: u64) -> Vec<u8> {
    let mut out = data_prefix(entry);
    out.extend_from_slice(&block.to_be_bytes());
    out
}

/// What every data key of `entry` begins with: block `b` of one file and
/// block `b` of another differ only in it (a range clone of blocks swaps it).
pub fn data_prefix(entry: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entry.len() + 9);
    out.extend_from_slice(entry);
    out.push(SEP_ENTRY);
    out
}

/// The block number of a data key of `entry`.
pub fn data_block(entry: &[u8], key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(entry)?.strip_prefix(&[SEP_ENTRY])?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

/// Where the file-system identity record lives (magic, version, inode
/// number reservation).
pub const INFO_KEY: &[u8] = b"\x02info";
/// The root directory's attributes (its entries are `00 name`).
pub const ROOT_KEY: &[u8] = b"\x02root";
/// The inode count, a `MERGE_RECORD` value updated by upserts.
pub const COUNTS_KEY: &[u8] = b"\x02count";
/// The key bound: no metadata key is longer (`record::KeyBound`).
pub const KEY_BOUND_KEY: &[u8] = b"\x02keybound";
const ORPHAN_PREFIX: &[u8] = b"\x02orphan\x00";
/// Scratch prefixes for swapping two entries in one batch
/// (RENAME_EXCHANGE): for each side, a file-key prefix and a directory-key
/// prefix, whose ranges are disjoint.
pub const SCRATCH_KEYS: [[&[u8]; 2]; 2] = [
    [b"\x02swap\x00fa", b"\x02swap\x00da"],
    [b"\x02swap\x00fb", b"\x02swap\x00db"],
];

const BACK_POINTER_PREFIX: &[u8] = b"\x02bp\x00";

/// Where an inode named by a path (a directory, or a file with one name)
/// is found from its number: the back pointer naming its parent and name
/// (see [`crate::record::BackPointer`]). File handles need it: the kernel
/// may ask for an inode by number alone, after a remount.
pub fn back_pointer_key(ino: u64) -> Vec<u8> {
    [BACK_POINTER_PREFIX, &ino.to_be_bytes()].concat()
}

/// The inode number of a back-pointer key.
pub fn back_pointer_ino(key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(BACK_POINTER_PREFIX)?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

/// The file key of a file kept by inode number.
pub fn inode_key(ino: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(10);
    out.extend_from_slice(b"\x01i");
    out.extend_from_slice(&ino.to_be_bytes());
    out
}

/// The inode number of an inode key (see [`inode_key`]).
pub fn inode_key_ino(key: &[u8]) -> Option<u64> {
    let raw = key.strip_prefix(b"\x01i")?;
    Some(u64::from_be_bytes(raw.try_into().ok()?))
}

/// The marker of an unlinked file still open when it was unlinked: it is
/// removed on the last close, or at the next mount after a crash.
pub fn orphan_key(ino: u64) -> Vec<u8> {
    [ORPHAN_PREFIX, &ino.to_be_bytes()].concat()
}

/// Every orphan marker.
pub fn orphan_range() -> (Vec<u8>, Vec<u8>) {
    let mut end = ORPHAN_PREFIX.to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    (ORPHAN_PREFIX.to_vec(), end)
}

/// The inode number of an orphan marker key.
pub fn orphan_ino(key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(ORPHAN_PREFIX)?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

/// The key of extended attribute `name` of the file with file key `file`.
pub fn xattr_key(file: &[u8], name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(file.len() + name.len() + 1);
    out.extend_from_slice(file);
    out.push(SEP_DIR);
    out.extend_from_slice(name);
    out
}

/// Every extended attribute of a file (data key space): after its
/// reservations (`F 01 00 ...`), since no name starts with a NUL.
pub fn xattr_range(file: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let (_, hi) = range_after(file, SEP_DIR, RANGE_END);
    ([file, &[SEP_DIR, 0x01]].concat(), hi)
}

const RESERVATION_TAG: [u8; 2] = [SEP_DIR, 0x00];

/// The key of the preallocated extent of a file that ends (exclusive) at
/// block `end`; its value is the first block (see
/// [`crate::record::encode_reservation`]). Keyed by the end, a query
/// from just past a block finds first the one extent that could hold it.
pub fn reservation_key(file: &[u8], end: u64) -> Vec<u8> {
    [file, &RESERVATION_TAG, &end.to_be_bytes()].concat()
}

/// The end block of a reservation key of `file`.
pub fn reservation_end(file: &[u8], key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(file)?.strip_prefix(&RESERVATION_TAG)?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
}

/// Every reservation of a file ending past block `after` (data key space).
pub fn reservations_ending_after(file: &[u8], after: u64) -> (Vec<u8>, Vec<u8>) {
    let lo = match after.checked_add(1) {
        Some(end) => reservation_key(file, end),
        None => xattr_range(file).0,
    };
    (lo, xattr_range(file).0)
}

/// Everything a file owns in the data key space: blocks, then xattrs.
pub fn file_range(file: &[u8]) -> (Vec<u8>, Vec<u8>) {
    range_after(file, SEP_ENTRY, RANGE_END)
}

/// How a data-space key divides: the file key it belongs to, and what it is.
#[derive(Debug, PartialEq, Eq)]
pub enum DataKey<'a> {
    Block { file: &'a [u8], block: u64 },
    Reservation { file: &'a [u8], end: u64 },
    Xattr { file: &'a [u8], name: &'a [u8] },
}

/// Parses a data-space key (for fsck); `None` for keys no file can own.
pub fn parse_data_key(key: &[u8]) -> Option<DataKey<'_>> {
    // The file key ends where the first byte below 0x03 after its fixed
    // part is: the entry separator of a path key, or the 10 bytes of an
    // inode key, or the root's key.
    let file_len = if key.starts_with(b"\x01i") {
        10
    } else if key.starts_with(ROOT_KEY) {
        ROOT_KEY.len()
    } else {
        let sep = key.iter().position(|&b| b == SEP_ENTRY)?;
        sep + 1 + key.get(sep + 1..)?.iter().position(|&b| b <= RANGE_END)?
    };
    let (file, rest) = (key.get(..file_len)?, key.get(file_len..)?);
    match rest.split_first()? {
        (&SEP_ENTRY, block) => Some(DataKey::Block {
            file,
            block: u64::from_be_bytes(block.try_into().ok()?),
        }),
        (&SEP_DIR, [0x00, end @ ..]) => Some(DataKey::Reservation {
            file,
            end: u64::from_be_bytes(end.try_into().ok()?),
        }),
        (&SEP_DIR, name) if !name.is_empty() => Some(DataKey::Xattr { file, name }),
        _ => None,
    }
}

/// How a metadata-space path key divides: its directory's key and the
/// entry's name; `None` for keys that are not an entry's.
pub fn parse_entry_key(key: &[u8]) -> Option<(&[u8], Vec<u8>)> {
    let sep = key.iter().position(|&b| b == SEP_ENTRY)?;
    let (dir, name) = (key.get(..sep)?, key.get(sep + 1..)?);
    if dir.first().is_some_and(|&b| b < ESCAPE) {
        return None;
    }
    Some((dir, unescape(name).filter(|n| !n.is_empty())?))
}

/// The entry key naming directory `dir` (the inverse of [`child_dir_key`]);
/// `None` for the root.
pub fn dir_entry_key(dir: &[u8]) -> Option<Vec<u8>> {
    if dir.is_empty() {
        return None;
    }
    let (parent, name) = match dir.iter().rposition(|&b| b == SEP_DIR) {
        Some(i) => (dir.get(..i)?, dir.get(i + 1..)?),
        None => (&b""[..], dir),
    };
    let mut out = Vec::with_capacity(dir.len() + 1);
    out.extend_from_slice(parent);
    out.push(SEP_ENTRY);
    out.extend_from_slice(name);
    Some(out)
}

/// The half-open range [`prefix lo`, `prefix hi`).
fn range_after(prefix: &[u8], lo: u8, hi: u8) -> (Vec<u8>, Vec<u8>) {
    let with = |b: u8| {
        let mut k = Vec::with_capacity(prefix.len() + 1);
        k.extend_from_slice(prefix);
        k.push(b);
        k
    };
    (with(lo), with(hi))
}

/// All data keys of a file, as a half-open range.
pub fn data_range(entry: &[u8]) -> (Vec<u8>, Vec<u8>) {
    range_after(entry, SEP_ENTRY, SEP_DIR)
}

/// Data keys of blocks `from` and above of a file (truncate).
pub fn data_range_from(entry: &[u8], from: u64) -> (Vec<u8>, Vec<u8>) {
    (data_key(entry, from), data_range(entry).1)
}

/// The direct children of a directory (readdir), as a half-open range.
pub fn children_range(dir: &[u8]) -> (Vec<u8>, Vec<u8>) {
    range_after(dir, SEP_ENTRY, SEP_DIR)
}

/// Every descendant of a directory in either key space, as a half-open range.
pub fn subtree_range(dir: &[u8]) -> (Vec<u8>, Vec<u8>) {
    range_after(dir, SEP_ENTRY, RANGE_END)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dir(path: &[&[u8]]) -> Vec<u8> {
        dir_key(path.iter().copied())
    }

    fn within(key: &[u8], range: &(Vec<u8>, Vec<u8>)) -> bool {
        key >= range.0.as_slice() && key < range.1.as_slice()
    }

    #[test]
    fn layout_matches_the_design() {
        assert_eq!(entry_key(&dir(&[b"a", b"b"]), b"c"), b"a\x01b\x00c");
        assert_eq!(child_dir_key(&dir(&[b"a"]), b"b"), dir(&[b"a", b"b"]));
        assert_eq!(child_dir_key(&[], b"a"), dir(&[b"a"]));
        assert_eq!(entry_key(&[], b"etc"), b"\x00etc");
        assert_eq!(data_key(b"\x00f", 1), b"\x00f\x00\0\0\0\0\0\0\0\x01");
    }

    #[test]
    fn invariant_2_subtree_is_one_range_in_both_spaces() {
        let d = dir(&[b"usr", b"src"]);
        let range = subtree_range(&d);
        let inside = [
            entry_key(&d, b"linux"),
            entry_key(&child_dir_key(&d, b"linux"), b"Makefile"),
            data_key(&entry_key(&child_dir_key(&d, b"linux"), b"Makefile"), 7),
            entry_key(
                &child_dir_key(&child_dir_key(&d, b"linux"), b"\xff"),
                b"\x01",
            ),
        ];
        for k in &inside {
            assert!(within(k, &range), "{k:?}");
        }
        let outside = [
            entry_key(&dir(&[b"usr"]), b"src"), // the directory's own entry
            entry_key(&dir(&[b"usr"]), b"src2"),
            entry_key(&dir(&[b"usr", b"src\x01"]), b"x"),
            entry_key(&dir(&[b"usr", b"sr"]), b"x"),
            entry_key(&dir(&[b"usr", b"srd"]), b"x"),
            entry_key(&dir(&[b"usr", b"src\xff"]), b"x"),
        ];
        for k in &outside {
            assert!(!within(k, &range), "{k:?}");
        }
    }

    #[test]
    fn invariant_3_children_first_and_contiguous() {
        let d = dir(&[b"home"]);
        let children = children_range(&d);
        let child = entry_key(&d, b"\xff\xff");
        let grandchild = entry_key(&child_dir_key(&d, b"\x04"), b"a");
        assert!(within(&child, &children));
        assert!(!within(&grandchild, &children));
        assert!(child < grandchild, "children sort before grandchildren");
        assert_eq!(child_name(&d, &child).unwrap(), b"\xff\xff");
        assert_eq!(child_name(&d, &grandchild), None);
    }

    #[test]
    fn invariant_4_file_data_never_interleaves() {
        let d = dir(&[b"x"]);
        let f = entry_key(&d, b"f");
        let range = data_range(&f);
        for other in [
            b"f\x01".as_slice(),
            b"f\x03",
            b"f0",
            b"e\xff",
            b"g",
            b"f\xff",
        ] {
            let g = entry_key(&d, other);
            assert!(!within(&data_key(&g, 0), &range), "{other:?}");
            assert!(!within(&data_key(&g, u64::MAX), &range), "{other:?}");
            assert!(!within(&g, &range));
        }
        assert!(within(&data_key(&f, 0), &range) && within(&data_key(&f, u64::MAX), &range));
        assert_eq!(data_block(&f, &data_key(&f, 42)), Some(42));
        let tail = data_range_from(&f, 10);
        assert!(within(&data_key(&f, 10), &tail) && !within(&data_key(&f, 9), &tail));
    }

    #[test]
    fn invariant_5_names_and_limits() {
        assert_eq!(check_name(&[b'a'; 255]), Ok(()));
        assert_eq!(check_name(&[b'a'; 256]), Err(NameError::TooLong(256)));
        assert_eq!(check_name(b"a/b"), Err(NameError::Invalid));
        assert_eq!(check_name(b"a\0b"), Err(NameError::Invalid));
        assert_eq!(check_name(b".."), Err(NameError::Invalid));
        assert_eq!(check_name(b""), Err(NameError::Empty));
        // A 4095-byte path of 255-byte components with odd bytes.
        let component: Vec<u8> = (0..255u32)
            .map(|i| [1u8, 2, 3, 0xff, b'z'][i as usize % 5])
            .collect();
        let path: Vec<&[u8]> = std::iter::repeat_n(component.as_slice(), 4095 / 256).collect();
        let d = dir_key(path.iter().copied());
        let e = entry_key(&d, &component);
        let parent = dir_key(path[..path.len() - 1].iter().copied());
        assert_eq!(
            child_name(&parent, &entry_key(&parent, &component)).unwrap(),
            component
        );
        assert!(within(&e, &subtree_range(&parent)));
    }

    /// The longest possible key fits the engine: a 4095-byte path (with
    /// its slashes) whose name bytes all need escaping, plus a block number.
    #[test]
    fn worst_case_keys_fit_the_engine() {
        let component = [1u8; NAME_MAX];
        // "/" + 15 components of 255 bytes and a last one filling up to 4095.
        let last = [2u8; PATH_MAX - 1 - 15 * (NAME_MAX + 1) - 1];
        let mut dirs: Vec<&[u8]> = std::iter::repeat_n(&component[..], 15).collect();
        let path_len: usize = dirs.iter().map(|c| c.len() + 1).sum::<usize>() + 1 + last.len();
        assert_eq!(path_len, PATH_MAX - 1);
        let key = data_key(&entry_key(&dir_key(dirs.drain(..)), &last), u64::MAX);
        assert!(
            key.len() <= betreefs_engine::MAX_KEY_BYTES,
            "{} bytes",
            key.len()
        );
    }

    #[test]
    fn reserved_keys_are_never_path_keys() {
        let d = dir(&[b"\x01", b"\x02"]);
        for k in [entry_key(&[], b"\x01"), entry_key(&d, b"\x02"), d.clone()] {
            assert!(!k.starts_with(b"\x01") && !k.starts_with(b"\x02"), "{k:?}");
        }
        let f = entry_key(&d, b"f\x01");
        assert_eq!(
            parse_data_key(&data_key(&f, 7)),
            Some(DataKey::Block { file: &f, block: 7 })
        );
        let x = xattr_key(&f, b"user.\x01a");
        assert_eq!(
            parse_data_key(&x),
            Some(DataKey::Xattr {
                file: &f,
                name: b"user.\x01a"
            })
        );
        assert!(within(&x, &file_range(&f)) && within(&data_key(&f, 0), &file_range(&f)));
        assert!(!within(&x, &data_range(&f)));
        // Reservations: in the file's range, outside its blocks and its
        // xattrs (even one named by the lowest byte a name may start with).
        for end in [1, 2, u64::MAX] {
            let rk = reservation_key(&f, end);
            assert_eq!(
                parse_data_key(&rk),
                Some(DataKey::Reservation { file: &f, end })
            );
            assert_eq!(reservation_end(&f, &rk), Some(end));
            assert!(within(&rk, &file_range(&f)));
            assert!(!within(&rk, &data_range(&f)) && !within(&rk, &xattr_range(&f)));
            assert!(within(&xattr_key(&f, b"\x01"), &xattr_range(&f)));
            let after = reservations_ending_after(&f, end.saturating_sub(1));
            assert!(within(&rk, &after));
            assert!(!within(&reservation_key(&f, end - 1), &after));
        }
        let i = inode_key(0x0200);
        assert_eq!(
            parse_data_key(&data_key(&i, 1)),
            Some(DataKey::Block { file: &i, block: 1 })
        );
        let r = xattr_key(ROOT_KEY, b"user.x");
        assert_eq!(
            parse_data_key(&r),
            Some(DataKey::Xattr {
                file: ROOT_KEY,
                name: b"user.x"
            })
        );
        assert_eq!(orphan_ino(&orphan_key(99)), Some(99));
        let (lo, hi) = orphan_range();
        assert!(orphan_key(u64::MAX) >= lo && orphan_key(u64::MAX) < hi);
        assert_eq!(parse_entry_key(&f), Some((d.as_slice(), b"f\x01".to_vec())));
        assert_eq!(parse_entry_key(INFO_KEY), None);
        assert_eq!(
            dir_entry_key(&d),
            Some(entry_key(&dir(&[b"\x01"]), b"\x02"))
        );
        assert_eq!(dir_entry_key(&dir(&[b"top"])), Some(entry_key(&[], b"top")));
        assert_eq!(dir_entry_key(&[]), None);
    }

    fn name() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(
            prop::sample::select(vec![1u8, 2, 3, 4, 5, 6, b'a', 0xfe, 0xff]),
            1..8,
        )
    }

    proptest! {
        #[test]
        fn keys_built_in_one_buffer_are_the_keys_built_a_level_at_a_time(
            path in proptest::collection::vec(name(), 0..6),
        ) {
            let levels = path.iter().fold(Vec::new(), |d, c| child_dir_key(&d, c));
            let whole = dir_key(path.iter().map(Vec::as_slice));
            prop_assert_eq!(&whole, &levels);
        }

        #[test]
        fn escaping_round_trips_and_preserves_order(a in name(), b in name()) {
            let d = dir(&[b"p"]);
            let (ka, kb) = (entry_key(&d, &a), entry_key(&d, &b));
            prop_assert_eq!(child_name(&d, &ka).unwrap(), a.clone());
            prop_assert_eq!(a.cmp(&b), ka.cmp(&kb));
            prop_assert!(!ka[d.len() + 1..].iter().any(|&x| x <= RANGE_END));
        }

        #[test]
        fn subtrees_of_siblings_are_disjoint(a in name(), b in name(), c in name()) {
            prop_assume!(a != b);
            let (da, db) = (dir(&[&a]), dir(&[&b]));
            let deep = entry_key(&child_dir_key(&db, &c), &c);
            prop_assert!(!within(&deep, &subtree_range(&da)));
            prop_assert!(within(&deep, &subtree_range(&db)));
        }
    }
}
