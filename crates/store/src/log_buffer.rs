//! The log's in-memory stream: bytes appended at the back, dropped from
//! the front once durable, held in fixed-size chunks.
//!
//! Why chunks and not one `Vec<u8>`: a burst of appends (a 64 MiB file
//! written before its fsync) grew the vector by doubling, so up to 32 MiB
//! of records sat in a 64 MiB allocation (heaptrack, with glibc's
//! allocator, through the micro suite: 67 MiB at the daemon's peak from
//! the log's appends; the cache's budget counted the records alone), and each
//! flush moved what was appended meanwhile (up to the same again) to the
//! vector's front, under the log's lock. With chunks the memory is the
//! bytes held rounded up to a chunk, counted exactly in the budget
//! (`LogWriter::buffer_use`), and dropping from the front frees whole
//! chunks instead of moving what is left.

use std::collections::VecDeque;

/// Bytes per chunk: small enough that what a flush leaves (the durable
/// part of the tail block) holds little, large enough that a 1 MiB
/// record is a handful of allocations.
#[cfg(not(test))]
const CHUNK_BYTES: usize = 64 << 10;
/// Small in tests, so that records and drains cross chunk boundaries.
#[cfg(test)]
const CHUNK_BYTES: usize = 64;

/// What a flush leaves held (the durable part of the tail block, under a
/// block) is moved into an allocation of its own size, rather than keep
/// a chunk for it.
const SMALL_TAIL_BYTES: usize = CHUNK_BYTES / 16;

/// Part of a range that lies in one chunk: `len` bytes at `offset` in
/// chunk `chunk`, the range's bytes from `done` on.
struct Piece {
    chunk: usize,
    offset: usize,
    len: usize,
    done: usize,
}

/// Where positions lie in the chunks: chunk 0 is filled up to
/// `first_cap`, every other one up to `CHUNK_BYTES`, and `dropped` bytes
/// at the start of chunk 0 are gone.
#[derive(Clone, Copy)]
struct Geometry {
    /// Chunk 0's size when full: `CHUNK_BYTES`, or a small tail's own size.
    first_cap: usize,
    dropped: usize,
}

impl Geometry {
    const FRESH: Geometry = Geometry {
        first_cap: CHUNK_BYTES,
        dropped: 0,
    };

    fn cap_of(self, chunk: usize) -> usize {
        if chunk == 0 {
            self.first_cap
        } else {
            CHUNK_BYTES
        }
    }

    /// The chunk and the offset in it of position `pos` (held or not).
    fn locate(self, pos: usize) -> (usize, usize) {
        let visible = self.first_cap - self.dropped;
        if pos < visible {
            (0, self.dropped + pos)
        } else {
            let past = pos - visible;
            (1 + past / CHUNK_BYTES, past % CHUNK_BYTES)
        }
    }

    /// The pieces, one per chunk, of the held range `[at, at + len)`.
    fn pieces(self, at: usize, len: usize) -> impl Iterator<Item = Piece> {
        let mut done = 0;
        std::iter::from_fn(move || {
            (done < len).then(|| {
                let (chunk, offset) = self.locate(at + done);
                // A held range ends within the last chunk's bytes; any
                // other chunk is full.
                let piece = Piece {
                    chunk,
                    offset,
                    len: (self.cap_of(chunk) - offset).min(len - done),
                    done,
                };
                done += piece.len;
                piece
            })
        })
    }
}

/// A byte stream indexed from its first held byte (position 0).
pub(crate) struct LogBuffer {
    /// Every chunk but the last is full (see [`Geometry`]).
    chunks: VecDeque<Vec<u8>>,
    geometry: Geometry,
    len: usize,
}

impl Default for LogBuffer {
    fn default() -> Self {
        LogBuffer {
            chunks: VecDeque::new(),
            geometry: Geometry::FRESH,
            len: 0,
        }
    }
}

impl LogBuffer {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of memory the buffer holds (its chunks, whole).
    pub(crate) fn held_bytes(&self) -> usize {
        match self.chunks.len() {
            0 => 0,
            n => self.geometry.first_cap + (n - 1) * CHUNK_BYTES,
        }
    }

    pub(crate) fn extend_from_slice(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len();
        while !bytes.is_empty() {
            let last = self.chunks.len().wrapping_sub(1);
            let room = match self.chunks.get(last) {
                Some(chunk) => self.geometry.cap_of(last) - chunk.len(),
                None => 0,
            };
            if room == 0 {
                if self.chunks.is_empty() {
                    self.geometry = Geometry::FRESH;
                }
                self.chunks.push_back(Vec::with_capacity(CHUNK_BYTES));
                continue;
            }
            let (now, rest) = bytes.split_at(room.min(bytes.len()));
            if let Some(chunk) = self.chunks.get_mut(last) {
                chunk.extend_from_slice(now);
            }
            bytes = rest;
        }
    }

    /// Drops the first `n` bytes (all of them when fewer are held).
    pub(crate) fn drop_front(&mut self, n: usize) {
        let mut n = n.min(self.len);
        self.len -= n;
        if self.len == 0 {
            // Nothing held: an idle log holds no memory.
            *self = LogBuffer::default();
            return;
        }
        while let Some(first) = self.chunks.front() {
            let visible = first.len() - self.geometry.dropped;
            if n < visible {
                self.geometry.dropped += n;
                break;
            }
            // A whole chunk dropped: the next one, full-sized, is first.
            self.chunks.pop_front();
            n -= visible;
            self.geometry = Geometry::FRESH;
        }
        if self.len <= SMALL_TAIL_BYTES && self.held_bytes() > self.len {
            let mut tail = vec![0; self.len];
            let copied = self.copy_to(0, &mut tail);
            debug_assert!(copied, "the bytes held are held");
            self.chunks = VecDeque::from([tail]);
            self.geometry = Geometry {
                first_cap: self.len,
                dropped: 0,
            };
        }
    }

    /// Overwrites `[at, at + bytes.len())`; false (and nothing written)
    /// when that range is not all held.
    pub(crate) fn write_at(&mut self, at: usize, bytes: &[u8]) -> bool {
        if !self.holds(at, bytes.len()) {
            return false;
        }
        for piece in self.geometry.pieces(at, bytes.len()) {
            let to = self
                .chunks
                .get_mut(piece.chunk)
                .and_then(|c| c.get_mut(piece.offset..piece.offset + piece.len));
            let from = bytes.get(piece.done..piece.done + piece.len);
            if let (Some(to), Some(from)) = (to, from) {
                to.copy_from_slice(from);
            }
        }
        true
    }

    /// Copies `[at, at + to.len())` into `to`; false (and `to` untouched)
    /// when that range is not all held.
    pub(crate) fn copy_to(&self, at: usize, to: &mut [u8]) -> bool {
        if !self.holds(at, to.len()) {
            return false;
        }
        for piece in self.geometry.pieces(at, to.len()) {
            let from = self
                .chunks
                .get(piece.chunk)
                .and_then(|c| c.get(piece.offset..piece.offset + piece.len));
            let into = to.get_mut(piece.done..piece.done + piece.len);
            if let (Some(from), Some(into)) = (from, into) {
                into.copy_from_slice(from);
            }
        }
        true
    }

    fn holds(&self, at: usize, len: usize) -> bool {
        at.checked_add(len).is_some_and(|end| end <= self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::{LogBuffer, CHUNK_BYTES, SMALL_TAIL_BYTES};
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Append(Vec<u8>),
        DropFront(usize),
        WriteAt(usize, Vec<u8>),
        CopyTo(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => proptest::collection::vec(any::<u8>(), 0..3 * CHUNK_BYTES).prop_map(Op::Append),
            2 => (0..4 * CHUNK_BYTES).prop_map(Op::DropFront),
            2 => (0..4 * CHUNK_BYTES, proptest::collection::vec(any::<u8>(), 0..2 * CHUNK_BYTES))
                .prop_map(|(at, b)| Op::WriteAt(at, b)),
            2 => (0..4 * CHUNK_BYTES, 0..2 * CHUNK_BYTES).prop_map(|(at, n)| Op::CopyTo(at, n)),
        ]
    }

    proptest! {
        /// The chunked buffer behaves as one vector drained from the
        /// front, and holds no more than its bytes rounded up to a chunk,
        /// plus the chunk its front lies in.
        #[test]
        fn behaves_as_a_vector_drained_from_the_front(ops in proptest::collection::vec(op(), 1..60)) {
            let mut buf = LogBuffer::default();
            let mut model: Vec<u8> = Vec::new();
            for op in ops {
                match op {
                    Op::Append(bytes) => {
                        buf.extend_from_slice(&bytes);
                        model.extend_from_slice(&bytes);
                    }
                    Op::DropFront(n) => {
                        buf.drop_front(n);
                        model.drain(..n.min(model.len()));
                        if model.len() <= SMALL_TAIL_BYTES {
                            // What a flush leaves holds its own size.
                            prop_assert_eq!(buf.held_bytes(), model.len());
                        }
                    }
                    Op::WriteAt(at, bytes) => {
                        let fits = at + bytes.len() <= model.len();
                        prop_assert_eq!(buf.write_at(at, &bytes), fits);
                        if fits {
                            model[at..at + bytes.len()].copy_from_slice(&bytes);
                        }
                    }
                    Op::CopyTo(at, n) => {
                        let mut out = vec![0xee; n];
                        let fits = at + n <= model.len();
                        prop_assert_eq!(buf.copy_to(at, &mut out), fits);
                        if fits {
                            prop_assert_eq!(&out[..], &model[at..at + n]);
                        } else {
                            prop_assert!(out.iter().all(|&b| b == 0xee));
                        }
                    }
                }
                prop_assert_eq!(buf.len(), model.len());
                prop_assert!(buf.held_bytes() <= model.len().div_ceil(CHUNK_BYTES) * CHUNK_BYTES + CHUNK_BYTES);

            }
            let mut all = vec![0; model.len()];
            prop_assert!(buf.copy_to(0, &mut all));
            prop_assert_eq!(all, model);
        }
    }

    #[test]
    fn what_a_flush_leaves_holds_little_memory() {
        let mut buf = LogBuffer::default();
        buf.extend_from_slice(&[7; 5 * CHUNK_BYTES / 2]);
        assert_eq!(buf.held_bytes(), 3 * CHUNK_BYTES);
        buf.drop_front(CHUNK_BYTES + 1);
        assert_eq!(buf.held_bytes(), 2 * CHUNK_BYTES);
        // A tail of 3 bytes: held in 3 bytes, then appended after.
        buf.drop_front(buf.len() - 3);
        assert_eq!((buf.len(), buf.held_bytes()), (3, 3));
        buf.extend_from_slice(&[8; CHUNK_BYTES]);
        assert_eq!(buf.held_bytes(), 3 + CHUNK_BYTES);
        let mut all = vec![0; 3 + CHUNK_BYTES];
        assert!(buf.copy_to(0, &mut all));
        assert_eq!(&all[..4], &[7, 7, 7, 8]);
        buf.drop_front(usize::MAX);
        assert_eq!((buf.len(), buf.held_bytes()), (0, 0));
    }
}
