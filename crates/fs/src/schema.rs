//! Full-path keys (BetrFS 0.4 §2.2, `shared/DESIGN.md` "File system schema").
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

fn escape_into(out: &mut Vec<u8>, name: &[u8]) {
    for &b in name {
        match b {
            0x01..=0x03 => {
                out.push(ESCAPE);
                out.push(b + 3);
            }
            _ => out.push(b),
        }
    }
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

/// `prefix`, then `sep` (if any), then the escaped `name`.
fn join(prefix: &[u8], sep: Option<u8>, name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + name.len() + 1);
    out.extend_from_slice(prefix);
    out.extend(sep);
    escape_into(&mut out, name);
    out
}

/// The encoding of a directory given its path components (root: none).
pub fn dir_key<'a>(components: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    components
        .into_iter()
        .fold(Vec::new(), |dir, c| child_dir_key(&dir, c))
}

/// The encoding of the directory that is entry `name` of directory `dir`.
pub fn child_dir_key(dir: &[u8], name: &[u8]) -> Vec<u8> {
    join(dir, (!dir.is_empty()).then_some(SEP_DIR), name)
}

/// The metadata key of entry `name` in directory `dir`.
pub fn entry_key(dir: &[u8], name: &[u8]) -> Vec<u8> {
    join(dir, Some(SEP_ENTRY), name)
}

/// The name of an entry key within `dir` (for readdir), if it is a child.
pub fn child_name(dir: &[u8], key: &[u8]) -> Option<Vec<u8>> {
    let rest = key.strip_prefix(dir)?.strip_prefix(&[SEP_ENTRY])?;
    unescape(rest)
}

/// The data key of block `block` of the file whose entry key is `entry`.
pub fn data_key(entry: &[u8], block: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(entry.len() + 9);
    out.extend_from_slice(entry);
    out.push(SEP_ENTRY);
    out.extend_from_slice(&block.to_be_bytes());
    out
}

/// The block number of a data key of `entry`.
pub fn data_block(entry: &[u8], key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(entry)?.strip_prefix(&[SEP_ENTRY])?;
    Some(u64::from_be_bytes(rest.try_into().ok()?))
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

    fn name() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(
            prop::sample::select(vec![1u8, 2, 3, 4, 5, 6, b'a', 0xfe, 0xff]),
            1..8,
        )
    }

    proptest! {
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
