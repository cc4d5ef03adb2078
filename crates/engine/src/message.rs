//! What callers send into the tree, and its log encoding.

use crate::codec::{DecodeError, DecodeResult, Decoder, Encoder, Sink};

/// Keys longer than this are refused. Large enough for the file system's
/// worst case: a 4095-byte path whose every name byte needs escaping
/// (doubling it), plus a block number.
pub const MAX_KEY_BYTES: usize = 12 * 1024;
/// Values (and upsert arguments) longer than this are refused.
pub const MAX_VALUE_BYTES: usize = 128 * 1024;

/// The independent trees of one store. They share the log, the node cache
/// and every checkpoint, so a batch may span both atomically.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeySpace {
    /// File system metadata: one entry per path.
    Meta = 0,
    /// File contents: one entry per block.
    Data = 1,
}

/// Number of key spaces; each has its own tree and root.
pub const KEY_SPACES: usize = 2;

impl KeySpace {
    pub const ALL: [KeySpace; KEY_SPACES] = [KeySpace::Meta, KeySpace::Data];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn from_index(i: u8) -> Option<KeySpace> {
        match i {
            0 => Some(KeySpace::Meta),
            1 => Some(KeySpace::Data),
            _ => None,
        }
    }
}

/// One change to one key space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Delete {
        key: Vec<u8>,
    },
    /// Blind read-modify-write with merge function `func` (see [`crate::merge`]).
    Upsert {
        key: Vec<u8>,
        func: u8,
        arg: Vec<u8>,
    },
    /// Deletes every key in [start, end).
    RangeDelete {
        start: Vec<u8>,
        end: Vec<u8>,
    },
    /// Moves every key of [start, end) (which all share their first
    /// `old_prefix_len` bytes) to `new_prefix ++ key[old_prefix_len..]`,
    /// after deleting whatever the destination range held. Source and
    /// destination must not overlap. Applied by copying inside the engine
    /// (the log holds only this message); see [`RangeRename::check`].
    RangeRename(RangeRename),
    /// Copies every key of [start, end) to where a range rename with the
    /// same fields would move it, after deleting whatever the destination
    /// range held; the source stays. Applied by sharing subtrees
    /// copy-on-write (docs/design.md, "Range clone") or, within a leaf, by
    /// copying pairs.
    RangeClone(RangeRename),
}

/// The fields of [`Message::RangeRename`] and [`Message::RangeClone`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeRename {
    pub start: Vec<u8>,
    pub end: Vec<u8>,
    pub old_prefix_len: usize,
    pub new_prefix: Vec<u8>,
}

impl RangeRename {
    pub fn new(start: &[u8], end: &[u8], old_prefix_len: usize, new_prefix: &[u8]) -> Self {
        RangeRename {
            start: start.to_vec(),
            end: end.to_vec(),
            old_prefix_len,
            new_prefix: new_prefix.to_vec(),
        }
    }

    /// Where `key` (inside the source range) moves to.
    pub fn destination(&self, key: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.new_prefix.len() + key.len());
        out.extend_from_slice(&self.new_prefix);
        out.extend_from_slice(key.get(self.old_prefix_len..).unwrap_or_default());
        out
    }

    /// The destination range [start', end').
    pub fn destination_range(&self) -> (Vec<u8>, Vec<u8>) {
        (self.destination(&self.start), self.destination(&self.end))
    }

    /// Whether the message is well formed: a non-empty source range whose
    /// bounds share the prefix, and a destination disjoint from it.
    pub fn check(&self) -> Result<(), String> {
        let p = self.old_prefix_len;
        let (start_prefix, end_prefix) = (self.start.get(..p), self.end.get(..p));
        if start_prefix.is_none() || start_prefix != end_prefix {
            return Err(format!("range bounds do not share a {p}-byte prefix"));
        }
        if self.start >= self.end {
            return Err("empty source range".into());
        }
        let (ds, de) = self.destination_range();
        if ds < self.end && self.start < de {
            return Err("source and destination ranges overlap".into());
        }
        Ok(())
    }
}

const TAG_PUT: u8 = 1;
const TAG_DELETE: u8 = 2;
const TAG_UPSERT: u8 = 3;
const TAG_RANGE_DELETE: u8 = 4;
const TAG_RANGE_RENAME: u8 = 5;
const TAG_RANGE_CLONE: u8 = 6;

impl Message {
    /// Key and value bytes the caller asked to store (write amplification's
    /// denominator).
    pub fn user_bytes(&self) -> u64 {
        match self {
            Message::Put { key, value } => (key.len() + value.len()) as u64,
            Message::Delete { key } => key.len() as u64,
            Message::Upsert { key, arg, .. } => (key.len() + arg.len()) as u64,
            Message::RangeDelete { start, end } => (start.len() + end.len()) as u64,
            Message::RangeRename(r) | Message::RangeClone(r) => {
                (r.start.len() + r.end.len() + r.new_prefix.len()) as u64
            }
        }
    }

    /// Whether the message can only free space.
    pub fn is_removal(&self) -> bool {
        matches!(self, Message::Delete { .. } | Message::RangeDelete { .. })
    }
}

/// An atomic group of messages: they share one sequence number and become
/// visible and durable together.
///
/// Kept in the form the log record carries it (see [`WriteBatch::encode`]):
/// one byte string, not a message object with two allocations apiece. A
/// tree's clone writes a batch of 160,000 messages; as objects they took
/// three times the bytes of their encoding, and the log's copy came on
/// top (docs/design.md, "One memory budget for the mount daemon").
#[derive(Clone, Default, PartialEq, Eq)]
pub struct WriteBatch {
    count: usize,
    /// The messages after the count, encoded.
    body: Vec<u8>,
}

impl std::fmt::Debug for WriteBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.messages()).finish()
    }
}

/// Room a new batch's encoding starts with: a file system operation's
/// batch (a directory entry and an inode, 200-400 bytes) fits, where one
/// grown from empty took five or six reallocations.
const BATCH_START_BYTES: usize = 512;

impl WriteBatch {
    pub fn new() -> Self {
        WriteBatch {
            count: 0,
            body: Vec::with_capacity(BATCH_START_BYTES),
        }
    }
    /// Starts a message: key space and tag.
    fn begin(&mut self, ks: KeySpace, tag: u8) -> Encoder {
        self.count += 1;
        let mut e = Encoder {
            buf: std::mem::take(&mut self.body),
        };
        e.u8(ks as u8);
        e.u8(tag);
        e
    }
    fn end(&mut self, e: Encoder) -> &mut Self {
        self.body = e.buf;
        self
    }
    pub fn put(&mut self, ks: KeySpace, key: &[u8], value: &[u8]) -> &mut Self {
        let mut e = self.begin(ks, TAG_PUT);
        e.bytes(key);
        e.bytes(value);
        self.end(e)
    }
    pub fn delete(&mut self, ks: KeySpace, key: &[u8]) -> &mut Self {
        let mut e = self.begin(ks, TAG_DELETE);
        e.bytes(key);
        self.end(e)
    }
    pub fn upsert(&mut self, ks: KeySpace, key: &[u8], func: u8, arg: &[u8]) -> &mut Self {
        let mut e = self.begin(ks, TAG_UPSERT);
        e.bytes(key);
        e.u8(func);
        e.bytes(arg);
        self.end(e)
    }
    pub fn range_delete(&mut self, ks: KeySpace, start: &[u8], end: &[u8]) -> &mut Self {
        let mut e = self.begin(ks, TAG_RANGE_DELETE);
        e.bytes(start);
        e.bytes(end);
        self.end(e)
    }
    /// See [`Message::RangeRename`].
    pub fn range_rename(
        &mut self,
        ks: KeySpace,
        start: &[u8],
        end: &[u8],
        old_prefix_len: usize,
        new_prefix: &[u8],
    ) -> &mut Self {
        self.transplant(ks, TAG_RANGE_RENAME, start, end, old_prefix_len, new_prefix)
    }
    /// See [`Message::RangeClone`].
    pub fn range_clone(
        &mut self,
        ks: KeySpace,
        start: &[u8],
        end: &[u8],
        old_prefix_len: usize,
        new_prefix: &[u8],
    ) -> &mut Self {
        self.transplant(ks, TAG_RANGE_CLONE, start, end, old_prefix_len, new_prefix)
    }
    fn transplant(
        &mut self,
        ks: KeySpace,
        tag: u8,
        start: &[u8],
        end: &[u8],
        old_prefix_len: usize,
        new_prefix: &[u8],
    ) -> &mut Self {
        let mut e = self.begin(ks, tag);
        e.bytes(start);
        e.bytes(end);
        e.varint(old_prefix_len as u64);
        e.bytes(new_prefix);
        self.end(e)
    }
    pub fn push(&mut self, ks: KeySpace, message: Message) -> &mut Self {
        match &message {
            Message::Put { key, value } => self.put(ks, key, value),
            Message::Delete { key } => self.delete(ks, key),
            Message::Upsert { key, func, arg } => self.upsert(ks, key, *func, arg),
            Message::RangeDelete { start, end } => self.range_delete(ks, start, end),
            Message::RangeRename(r) => {
                self.range_rename(ks, &r.start, &r.end, r.old_prefix_len, &r.new_prefix)
            }
            Message::RangeClone(r) => {
                self.range_clone(ks, &r.start, &r.end, r.old_prefix_len, &r.new_prefix)
            }
        }
    }
    pub fn len(&self) -> usize {
        self.count
    }
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
    /// The bytes of the encoded messages (the payload without its count).
    pub fn body_len(&self) -> usize {
        self.body.len()
    }
    /// The messages in order, decoded.
    pub fn messages(&self) -> Messages<'_> {
        Messages {
            decoder: Decoder::new(&self.body),
            left: self.count,
        }
    }

    /// The log record payload: varint count, then per message
    /// `u8 key_space, u8 tag, fields` with fields
    /// put = key, value; delete = key; upsert = key, u8 func, arg;
    /// range delete = start, end; range rename (tag 5) and range clone
    /// (tag 6) = start, end, varint old prefix length, new prefix (each
    /// byte string a varint length and bytes).
    pub fn encode(&self) -> Vec<u8> {
        let (count, body) = self.payload_parts();
        [count.as_slice(), body].concat()
    }

    /// The payload of [`WriteBatch::encode`] in two parts, the count and
    /// the messages, for a log append that copies them without joining
    /// them first.
    pub fn payload_parts(&self) -> (Vec<u8>, &[u8]) {
        let mut count = Encoder::with_capacity(10);
        count.varint(self.count as u64);
        (count.buf, &self.body)
    }

    pub fn decode(payload: &[u8]) -> DecodeResult<WriteBatch> {
        let mut d = Decoder::new(payload);
        let count = d.varint()?;
        if count > payload.len() as u64 {
            return Err(DecodeError(format!("batch claims {count} messages")));
        }
        let body = payload
            .get(payload.len() - d.remaining()..)
            .unwrap_or_default();
        for _ in 0..count {
            decode_message(&mut d)?;
        }
        if !d.is_empty() {
            return Err(DecodeError(format!(
                "{} trailing bytes after batch",
                d.remaining()
            )));
        }
        Ok(WriteBatch {
            count: count as usize,
            body: body.to_vec(),
        })
    }
}

/// The messages of a [`WriteBatch`], decoded one at a time.
pub struct Messages<'a> {
    decoder: Decoder<'a>,
    left: usize,
}

impl Iterator for Messages<'_> {
    type Item = (KeySpace, Message);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The body was encoded here or checked whole by `decode`.
        let decoded = decode_message(&mut self.decoder);
        debug_assert!(decoded.is_ok(), "a batch's own encoding: {decoded:?}");
        decoded.ok()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.left))
    }
}

fn decode_message(d: &mut Decoder) -> DecodeResult<(KeySpace, Message)> {
    let ks_raw = d.u8()?;
    let ks = KeySpace::from_index(ks_raw)
        .ok_or_else(|| DecodeError(format!("unknown key space {ks_raw}")))?;
    let m = match d.u8()? {
        TAG_PUT => Message::Put {
            key: d.bytes()?.to_vec(),
            value: d.bytes()?.to_vec(),
        },
        TAG_DELETE => Message::Delete {
            key: d.bytes()?.to_vec(),
        },
        TAG_UPSERT => Message::Upsert {
            key: d.bytes()?.to_vec(),
            func: d.u8()?,
            arg: d.bytes()?.to_vec(),
        },
        TAG_RANGE_DELETE => Message::RangeDelete {
            start: d.bytes()?.to_vec(),
            end: d.bytes()?.to_vec(),
        },
        tag @ (TAG_RANGE_RENAME | TAG_RANGE_CLONE) => {
            let (start, end) = (d.bytes()?, d.bytes()?);
            let old_prefix_len = d.varint()? as usize;
            let r = RangeRename::new(start, end, old_prefix_len, d.bytes()?);
            if tag == TAG_RANGE_CLONE {
                Message::RangeClone(r)
            } else {
                Message::RangeRename(r)
            }
        }
        tag => return Err(DecodeError(format!("unknown message tag {tag}"))),
    };
    Ok((ks, m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_round_trip_and_garbage() {
        let mut b = WriteBatch::new();
        b.put(KeySpace::Meta, b"a", b"1")
            .delete(KeySpace::Data, b"\0\xff")
            .upsert(KeySpace::Meta, b"k", 1, b"arg")
            .range_delete(KeySpace::Data, b"a", b"z")
            .range_rename(KeySpace::Meta, b"p\0", b"p\x02", 1, b"q")
            .range_clone(KeySpace::Data, b"p\0", b"p\x02", 1, b"r");
        let listed: Vec<(KeySpace, Message)> = b.messages().collect();
        assert_eq!(listed.len(), b.len());
        assert_eq!(
            listed[2],
            (
                KeySpace::Meta,
                Message::Upsert {
                    key: b"k".to_vec(),
                    func: 1,
                    arg: b"arg".to_vec()
                }
            )
        );
        // Pushing the decoded messages builds the same batch.
        let mut again = WriteBatch::new();
        for (ks, m) in listed {
            again.push(ks, m);
        }
        assert_eq!(again, b);
        let enc = b.encode();
        let (count, body) = b.payload_parts();
        assert_eq!([count.as_slice(), body].concat(), enc);
        assert_eq!(WriteBatch::decode(&enc).unwrap(), b);
        for cut in 0..enc.len() {
            assert!(WriteBatch::decode(&enc[..cut]).is_err());
        }
        let mut bad = enc.clone();
        bad[1] = 9;
        assert!(WriteBatch::decode(&bad).is_err());
    }
}
