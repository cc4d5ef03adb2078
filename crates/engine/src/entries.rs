//! Sorted key/value pairs packed in one buffer: the in-memory form of a
//! leaf basement. One allocation for the bytes and one for a 12-byte index
//! per entry, instead of two allocations per entry, keeps the node cache's
//! memory close to the data it holds and makes (de)serialisation a copy.
//! A basement decoded from the device keeps its values where they were
//! read ([`Image`]): only its keys are copied.

use std::sync::Arc;

use betreefs_store::AlignedBuf;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slot {
    offset: u32,
    key_len: u32,
    value_len: u32,
}

#[derive(Clone, Debug, Default)]
pub struct Entries {
    /// Each entry's key, then its value, packed in order; only the keys
    /// when the values lie in `image`.
    data: Vec<u8>,
    index: Vec<Slot>,
    image: Option<Image>,
    /// Made by the first search that needs them, once the entries are
    /// complete (a basement is replaced, never changed, once cached);
    /// dropped by every change.
    heads: std::sync::OnceLock<KeyHeads>,
}

/// The bytes a basement was read into, holding its values: a cold
/// sequential read copied every basement it decoded (values included) out
/// of the buffer the device filled, and that copy, with the page faults
/// of the fresh memory it went to, was a fifth of the mount daemon's
/// cycles (docs/design.md, "Values left where they were read"). Entries
/// built by merges own their bytes; one that is changed is made to own
/// them first ([`Entries::make_owned`]).
#[derive(Clone, Debug)]
struct Image {
    bytes: Arc<AlignedBuf>,
    /// Where each entry's value begins in `bytes`.
    value_at: Vec<u32>,
    /// The values' bytes, for the serialised size.
    value_bytes: usize,
    /// The memory of `bytes` these entries answer for: their share of
    /// its allocation (the basements of one read share it).
    charged: usize,
}

/// What a search compares before it reads a key: the length of the
/// prefix every key shares, and each key's next four bytes after it
/// ([`key_head`]). A search of a basement of hundreds of entries read a
/// key at a random place of its 128 KiB at every step (a cache miss
/// each, and a compare of the shared prefix: a full path in the file
/// system's keys); the heads lie together, four bytes an entry, and a
/// search reads one key, or the few whose heads are equal.
#[derive(Clone, Debug)]
struct KeyHeads {
    shared: usize,
    heads: Box<[u32]>,
}

/// The four bytes of `key` from `from` on as a big-endian number, short
/// keys padded with zeros: a head below another's is a key below the
/// other's (padding sorts a key before every longer one it begins); equal
/// heads say nothing.
fn key_head(key: &[u8], from: usize) -> u32 {
    let mut head = [0u8; 4];
    let rest = key.get(from..).unwrap_or_default();
    let n = rest.len().min(4);
    if let (Some(to), Some(from)) = (head.get_mut(..n), rest.get(..n)) {
        to.copy_from_slice(from);
    }
    u32::from_be_bytes(head)
}

/// Entries fewer than this are searched by their keys alone.
const HEADS_FROM_ENTRIES: usize = 16;

impl PartialEq for Entries {
    fn eq(&self, other: &Entries) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Entries {}

/// Per-entry overhead counted in serialised sizes (two varint lengths).
pub const ENTRY_OVERHEAD_BYTES: usize = 4;

impl Entries {
    pub fn with_capacity(entries: usize, bytes: usize) -> Entries {
        Entries {
            data: Vec::with_capacity(bytes),
            index: Vec::with_capacity(entries),
            image: None,
            heads: std::sync::OnceLock::new(),
        }
    }

    /// Empty entries whose values will lie in `image` ([`Entries::push_read`]),
    /// answering for `charged` bytes of its memory.
    pub fn in_image(
        image: Arc<AlignedBuf>,
        charged: usize,
        entries: usize,
        key_bytes: usize,
    ) -> Entries {
        Entries {
            data: Vec::with_capacity(key_bytes),
            index: Vec::with_capacity(entries),
            image: Some(Image {
                bytes: image,
                value_at: Vec::with_capacity(entries),
                value_bytes: 0,
                charged,
            }),
            heads: std::sync::OnceLock::new(),
        }
    }

    /// Appends an entry whose key is `prefix ++ suffix` and whose value is
    /// the `value_len` bytes at `value_at` of the image these entries were
    /// made with ([`Entries::in_image`]); keys must arrive in increasing
    /// order. False (nothing appended) when the value is not within the
    /// image or there is none.
    pub fn push_read(
        &mut self,
        prefix: &[u8],
        suffix: &[u8],
        value_at: usize,
        value_len: usize,
    ) -> bool {
        let Some(image) = &mut self.image else {
            return false;
        };
        let (Ok(at), Ok(len)) = (u32::try_from(value_at), u32::try_from(value_len)) else {
            return false;
        };
        if image.bytes.get(value_at..value_at + value_len).is_none() {
            return false;
        }
        self.heads.take();
        image.value_at.push(at);
        image.value_bytes += value_len;
        let offset = self.data.len() as u32;
        self.data.extend_from_slice(prefix);
        self.data.extend_from_slice(suffix);
        self.index.push(Slot {
            offset,
            key_len: (prefix.len() + suffix.len()) as u32,
            value_len: len,
        });
        debug_assert!(
            self.len() < 2 || self.key(self.len() - 2) < self.key(self.len() - 1),
            "entries out of order"
        );
        true
    }

    /// Whether the values lie in the bytes they were read into.
    pub fn in_read_image(&self) -> bool {
        self.image.is_some()
    }

    /// Copies the values out of the image they were read into, if they
    /// lie in one, so that these entries own every byte they hold: before
    /// a change, and where the basements that share an image part (a
    /// merge replaces one of them: the image would stay for the others,
    /// uncounted for the one gone).
    pub fn make_owned(&mut self) {
        if self.image.is_none() {
            return;
        }
        let mut owned = Entries::with_capacity(self.len(), self.bytes());
        owned.extend_from(self, 0, self.len());
        *self = owned;
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Serialised size: keys, values and length fields.
    pub fn bytes(&self) -> usize {
        let values = self.image.as_ref().map_or(0, |i| i.value_bytes);
        self.data.len() + values + self.index.len() * ENTRY_OVERHEAD_BYTES
    }

    /// Heap memory held, the search heads counted whether made yet or
    /// not: the count must not change while the entries do not (the cache
    /// counts a node's memory when it is put in and taken out).
    pub fn mem_bytes(&self) -> usize {
        let image = self.image.as_ref().map_or(0, |i| {
            i.charged + i.value_at.capacity() * std::mem::size_of::<u32>()
        });
        self.data.capacity()
            + self.index.capacity() * (std::mem::size_of::<Slot>() + std::mem::size_of::<u32>())
            + image
            + 48
    }

    // Reviewed exception (indexing): callers pass i < len.
    #[allow(clippy::indexing_slicing)]
    pub fn key(&self, i: usize) -> &[u8] {
        self.slot_key(&self.index[i])
    }

    /// The key a slot of this index points at.
    // Reviewed exception (indexing): every slot is written by `push_parts`
    // together with the bytes it points at.
    #[allow(clippy::indexing_slicing)]
    fn slot_key(&self, s: &Slot) -> &[u8] {
        &self.data[s.offset as usize..(s.offset + s.key_len) as usize]
    }

    // Reviewed exception (indexing): every slot is written by `push_parts`
    // together with the bytes it points at, or by `push_read` with a value
    // it checked lies in the image, and callers pass i < len.
    #[allow(clippy::indexing_slicing)]
    pub fn value(&self, i: usize) -> &[u8] {
        let s = self.index[i];
        let len = s.value_len as usize;
        match &self.image {
            None => {
                let start = (s.offset + s.key_len) as usize;
                &self.data[start..start + len]
            }
            Some(image) => {
                let start = image.value_at[i] as usize;
                &image.bytes[start..start + len]
            }
        }
    }

    pub fn first_key(&self) -> Option<&[u8]> {
        (!self.is_empty()).then(|| self.key(0))
    }

    pub fn last_key(&self) -> Option<&[u8]> {
        self.len().checked_sub(1).map(|i| self.key(i))
    }

    // Reviewed exception (indexing): every slot is written by `push_parts`
    // together with the bytes it points at, and callers pass i < len.
    #[allow(clippy::indexing_slicing)]
    pub fn entry_bytes(&self, i: usize) -> usize {
        let s = self.index[i];
        (s.key_len + s.value_len) as usize + ENTRY_OVERHEAD_BYTES
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&[u8], &[u8])> + ExactSizeIterator + '_ {
        (0..self.len()).map(|i| (self.key(i), self.value(i)))
    }

    /// Binary search by key.
    pub fn search(&self, key: &[u8]) -> Result<usize, usize> {
        self.search_in(0, self.len(), key)
    }

    /// Binary search by key among entries [from, to): by the heads where
    /// they serve ([`KeyHeads`]), else by the keys.
    // Reviewed exception (indexing): callers pass from <= to <= len.
    #[allow(clippy::indexing_slicing)]
    fn search_in(&self, from: usize, to: usize, key: &[u8]) -> Result<usize, usize> {
        let Some((heads, head)) = self.heads_for(key) else {
            return self.index[from..to]
                .binary_search_by(|s| self.slot_key(s).cmp(key))
                .map(|i| from + i)
                .map_err(|i| from + i);
        };
        let shared = heads.shared;
        let rest = key.get(shared..).unwrap_or_default();
        // Equal heads: the keys after their shared prefix decide.
        let mut at = from;
        let mut size = to - from;
        while size > 0 {
            let half = size / 2;
            let mid = at + half;
            let order = match heads.heads.get(mid) {
                Some(h) if *h != head => h.cmp(&head),
                _ => self.key(mid).get(shared..).unwrap_or_default().cmp(rest),
            };
            match order {
                std::cmp::Ordering::Less => {
                    at = mid + 1;
                    size -= half + 1;
                }
                std::cmp::Ordering::Greater => size = half,
                std::cmp::Ordering::Equal => return Ok(mid),
            }
        }
        Err(at)
    }

    /// The search heads, made if need be, and `key`'s head, when they
    /// serve: enough entries, and `key` begins with the prefix they all
    /// share (else the plain search finds it below or above them all
    /// within a compare or two).
    fn heads_for(&self, key: &[u8]) -> Option<(&KeyHeads, u32)> {
        if self.len() < HEADS_FROM_ENTRIES {
            return None;
        }
        let heads = self.heads.get_or_init(|| self.make_heads());
        let first = self.first_key()?;
        (key.get(..heads.shared)? == first.get(..heads.shared)?)
            .then(|| (heads, key_head(key, heads.shared)))
    }

    fn make_heads(&self) -> KeyHeads {
        let (first, last) = (
            self.first_key().unwrap_or_default(),
            self.last_key().unwrap_or_default(),
        );
        // Sorted keys: what the first and last share, all share.
        let shared = first.iter().zip(last).take_while(|(a, b)| a == b).count();
        KeyHeads {
            shared,
            heads: (0..self.len())
                .map(|i| key_head(self.key(i), shared))
                .collect(),
        }
    }

    /// Index of the first key not less than `key`.
    pub fn lower_bound(&self, key: &[u8]) -> usize {
        self.lower_bound_in(0, self.len(), key)
    }

    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.search(key).ok().map(|i| self.value(i))
    }

    /// Appends an entry whose key is `prefix ++ suffix`; keys must arrive in
    /// increasing order.
    pub fn push_parts(&mut self, prefix: &[u8], suffix: &[u8], value: &[u8]) {
        self.make_owned();
        self.heads.take();
        let offset = self.data.len() as u32;
        self.data.extend_from_slice(prefix);
        self.data.extend_from_slice(suffix);
        self.data.extend_from_slice(value);
        self.index.push(Slot {
            offset,
            key_len: (prefix.len() + suffix.len()) as u32,
            value_len: value.len() as u32,
        });
        debug_assert!(
            self.len() < 2 || self.key(self.len() - 2) < self.key(self.len() - 1),
            "entries out of order"
        );
    }

    pub fn push(&mut self, key: &[u8], value: &[u8]) {
        self.push_parts(&[], key, value);
    }

    /// Replaces the first `old_len` bytes of every key (which all share
    /// them) with `new_prefix`: in place when the lengths agree — a range
    /// rename of a cached dirty leaf then costs a few bytes per entry, not
    /// a copy of its values — otherwise by rebuilding.
    pub fn replace_prefix(&mut self, old_len: usize, new_prefix: &[u8]) {
        if new_prefix.len() == old_len {
            self.heads.take();
            for s in &self.index {
                let at = s.offset as usize;
                debug_assert!(s.key_len as usize >= old_len);
                if let Some(key_start) = self.data.get_mut(at..at + old_len) {
                    key_start.copy_from_slice(new_prefix);
                }
            }
            return;
        }
        let delta = self.len() * new_prefix.len();
        let mut out = Entries::with_capacity(self.len(), self.bytes() + delta);
        for (k, v) in self.iter() {
            out.push_parts(new_prefix, k.get(old_len..).unwrap_or_default(), v);
        }
        *self = out;
    }

    /// Index of the first key not less than `key` among entries
    /// [from, to) (`to` if there is none); callers pass from <= to <= len.
    pub fn lower_bound_in(&self, from: usize, to: usize, key: &[u8]) -> usize {
        // Keys are unique: where one equals `key`, it is the first not less.
        self.search_in(from, to, key).unwrap_or_else(|at| at)
    }

    /// Appends entries [from, to) of `other`, whose keys must all follow
    /// this one's: one copy of their bytes, which lie together and in
    /// order in `other` (every entry is appended by `push_parts`, packed
    /// after the one before), and their slots moved to where the bytes
    /// land. A merge of a few messages into a basement copies the runs
    /// between them this way, not entry by entry.
    // Reviewed exception (indexing): callers pass from <= to <= other.len(),
    // and the slots of [from, to) cover other.data[start..end] exactly.
    #[allow(clippy::indexing_slicing)]
    pub fn extend_from(&mut self, other: &Entries, from: usize, to: usize) {
        if from >= to {
            return;
        }
        if other.image.is_some() {
            // The values lie apart from the keys: entry by entry.
            for i in from..to {
                self.push_parts(&[], other.key(i), other.value(i));
            }
            return;
        }
        self.make_owned();
        let (first, last) = (other.index[from], other.index[to - 1]);
        debug_assert!(
            self.is_empty() || self.key(self.len() - 1) < other.key(from),
            "entries out of order"
        );
        let start = first.offset;
        let end = (last.offset + last.key_len + last.value_len) as usize;
        debug_assert_eq!(
            end - start as usize,
            other.index[from..to]
                .iter()
                .map(|s| (s.key_len + s.value_len) as usize)
                .sum::<usize>(),
            "entries not packed in order"
        );
        self.heads.take();
        let base = self.data.len() as u32;
        self.data
            .extend_from_slice(&other.data[start as usize..end]);
        self.index
            .extend(other.index[from..to].iter().map(|s| Slot {
                offset: s.offset - start + base,
                ..*s
            }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::{btree_set, vec};
    use proptest::prelude::*;

    proptest! {
        /// A search by the heads finds what a search by the keys alone
        /// does, for keys that share a prefix, end inside or just past
        /// the heads' four bytes, or hold zeros (padding's value), and
        /// for keys searched for that lack the prefix or end within it.
        #[test]
        fn a_search_by_heads_finds_what_a_search_by_keys_does(
            prefix in vec(0u8..3, 0..6),
            suffixes in btree_set(vec(prop_oneof![Just(0u8), Just(1), Just(255)], 0..7), 0..60),
            probes in vec((vec(0u8..3, 0..7), vec(prop_oneof![Just(0u8), Just(1), Just(255)], 0..7)), 1..30),
        ) {
            let mut e = Entries::default();
            for suffix in &suffixes {
                e.push_parts(&prefix, suffix, suffix);
            }
            let keys: Vec<Vec<u8>> = e.iter().map(|(k, _)| k.to_vec()).collect();
            let probes = probes.into_iter().map(|(a, b)| [a, b].concat());
            for (n, probe) in keys.clone().into_iter().chain(probes).enumerate() {
                let want = keys.binary_search(&probe);
                prop_assert_eq!(e.search(&probe), want, "{:?}", probe);
                prop_assert_eq!(e.get(&probe).is_some(), want.is_ok());
                // Within a window of the entries too, as merges search.
                let to = keys.len() - (n % 2).min(keys.len());
                let from = (n % (keys.len() + 1)).min(to);
                let in_window = from + keys[from..to].partition_point(|k| *k < probe);
                prop_assert_eq!(e.lower_bound_in(from, to, &probe), in_window, "{:?} in [{}, {})", probe, from, to);
            }
        }
    }

    #[test]
    fn packed_entries() {
        let mut e = Entries::default();
        e.push(b"a", b"1");
        e.push_parts(b"b", b"c", b"22");
        e.push(b"d", b"");
        assert_eq!(e.len(), 3);
        assert_eq!(e.key(1), b"bc");
        assert_eq!(e.value(1), b"22");
        assert_eq!(e.get(b"d"), Some(&b""[..]));
        assert_eq!(e.search(b"c"), Err(2));
        assert_eq!(e.lower_bound(b"bc"), 1);
        assert_eq!(e.bytes(), 1 + 1 + 2 + 2 + 1 + 3 * ENTRY_OVERHEAD_BYTES);
        assert_eq!(e.lower_bound_in(1, 3, b"a"), 1);
        assert_eq!(e.lower_bound_in(1, 3, b"c"), 2);
        assert_eq!(e.lower_bound_in(0, 2, b"z"), 2);
        let mut f = Entries::default();
        f.push(b"0", b"zero");
        f.extend_from(&e, 1, 3);
        f.extend_from(&e, 3, 3);
        assert_eq!(
            f.iter()
                .map(|(k, v)| (k.to_vec(), v.to_vec()))
                .collect::<Vec<_>>(),
            vec![
                (b"0".to_vec(), b"zero".to_vec()),
                (b"bc".to_vec(), b"22".to_vec()),
                (b"d".to_vec(), b"".to_vec())
            ]
        );
        assert_eq!(f.bytes(), 1 + 4 + 2 + 2 + 1 + 3 * ENTRY_OVERHEAD_BYTES);
    }

    /// Entries whose values lie in the bytes read serve, copy, change
    /// and are renamed as entries owning their bytes do.
    #[test]
    fn entries_in_an_image_behave_as_owned_ones() {
        let image = Arc::new(AlignedBuf::from_slice(b"xxoneTWOthree"));
        let mut read = Entries::in_image(image.clone(), 4096, 3, 16);
        assert!(read.push_read(b"dir/", b"a", 2, 3));
        assert!(read.push_read(b"dir/", b"b", 5, 3));
        assert!(read.push_read(b"dir/", b"c", 8, 5));
        assert!(
            !read.push_read(b"dir/", b"d", image.len() - 1, 2),
            "past the image"
        );
        let mut owned = Entries::default();
        for (k, v) in [
            (&b"dir/a"[..], &b"one"[..]),
            (b"dir/b", b"TWO"),
            (b"dir/c", b"three"),
        ] {
            owned.push(k, v);
        }
        assert!(read.in_read_image());
        assert_eq!(read, owned);
        assert_eq!(read.bytes(), owned.bytes());
        assert_eq!(read.get(b"dir/b"), Some(&b"TWO"[..]));
        assert!(read.mem_bytes() >= 4096);
        // Runs copied from it, entry by entry.
        let mut tail = Entries::default();
        tail.push(b"a", b"0");
        tail.extend_from(&read, 1, 3);
        assert_eq!(tail.len(), 3);
        assert_eq!(tail.value(2), b"three");
        assert!(!tail.in_read_image());
        // Renamed in place: the keys change, the values stay read.
        let mut renamed = read.clone();
        renamed.replace_prefix(3, b"new");
        assert!(renamed.in_read_image());
        assert_eq!(renamed.key(2), b"new/c");
        assert_eq!(renamed.value(2), b"three");
        // Appended to: owned first.
        let mut grown = read.clone();
        grown.push(b"dir/d", b"four");
        assert!(!grown.in_read_image());
        assert_eq!(grown.value(0), b"one");
        assert_eq!(grown.value(3), b"four");
        read.make_owned();
        assert!(!read.in_read_image());
        assert_eq!(read, owned);
    }

    #[test]
    fn prefixes_are_replaced_in_place_or_rebuilt() {
        let mut e = Entries::default();
        for name in [&b"dir/a"[..], b"dir/b", b"dir/c"] {
            e.push(name, &name[4..].repeat(3));
        }
        let mut same = e.clone();
        same.replace_prefix(3, b"xyz");
        let mut longer = e.clone();
        longer.replace_prefix(3, b"elsewhere");
        let mut shorter = e;
        shorter.replace_prefix(4, b"");
        for (got, prefix) in [
            (same, &b"xyz/"[..]),
            (longer, b"elsewhere/"),
            (shorter, b""),
        ] {
            let pairs: Vec<(Vec<u8>, Vec<u8>)> =
                got.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
            let want: Vec<(Vec<u8>, Vec<u8>)> = [b"a", b"b", b"c"]
                .iter()
                .map(|n| ([prefix, &n[..]].concat(), n.repeat(3)))
                .collect();
            assert_eq!(pairs, want);
            assert_eq!(
                got.bytes(),
                want.iter()
                    .map(|(k, v)| k.len() + v.len() + 4)
                    .sum::<usize>()
            );
        }
    }
}
