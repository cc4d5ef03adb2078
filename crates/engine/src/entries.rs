//! Sorted key/value pairs packed in one buffer: the in-memory form of a
//! leaf basement. One allocation for the bytes and one for a 12-byte index
//! per entry, instead of two allocations per entry, keeps the node cache's
//! memory close to the data it holds and makes (de)serialisation a copy.

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slot {
    offset: u32,
    key_len: u32,
    value_len: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entries {
    data: Vec<u8>,
    index: Vec<Slot>,
}

/// Per-entry overhead counted in serialised sizes (two varint lengths).
pub const ENTRY_OVERHEAD_BYTES: usize = 4;

impl Entries {
    pub fn with_capacity(entries: usize, bytes: usize) -> Entries {
        Entries {
            data: Vec::with_capacity(bytes),
            index: Vec::with_capacity(entries),
        }
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Serialised size: keys, values and length fields.
    pub fn bytes(&self) -> usize {
        self.data.len() + self.index.len() * ENTRY_OVERHEAD_BYTES
    }

    /// Heap memory held.
    pub fn mem_bytes(&self) -> usize {
        self.data.capacity() + self.index.capacity() * std::mem::size_of::<Slot>() + 48
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
    // together with the bytes it points at, and callers pass i < len.
    #[allow(clippy::indexing_slicing)]
    pub fn value(&self, i: usize) -> &[u8] {
        let s = self.index[i];
        let start = (s.offset + s.key_len) as usize;
        &self.data[start..start + s.value_len as usize]
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
        self.index.binary_search_by(|s| self.slot_key(s).cmp(key))
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
    /// [from, to) (`to` if there is none).
    // Reviewed exception (indexing): callers pass from <= to <= len.
    #[allow(clippy::indexing_slicing)]
    pub fn lower_bound_in(&self, from: usize, to: usize, key: &[u8]) -> usize {
        from + self.index[from..to].partition_point(|s| self.slot_key(s) < key)
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
