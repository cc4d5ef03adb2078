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
//!
//! Chunks dropped from the front are kept as spares, up to a limit the
//! log's owner sets (the bytes one eager flush writes), and reused for
//! the next appends: a sequential write streams gigabytes through the
//! buffer, and fresh chunks from the allocator were fresh pages — their
//! page faults were 12-15% of the mount daemon's CPU, in the writing
//! request's own thread (docs/benchmarks/log-spares.md). The spares are
//! memory the buffer holds, counted as such.

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
    /// Empty chunks of `CHUNK_BYTES` capacity, ready for appends.
    spares: Vec<Vec<u8>>,
    /// At most this many bytes of spares are kept.
    spare_limit: usize,
}

impl Default for LogBuffer {
    fn default() -> Self {
        LogBuffer {
            chunks: VecDeque::new(),
            geometry: Geometry::FRESH,
            len: 0,
            spares: Vec::new(),
            spare_limit: 0,
        }
    }
}

impl LogBuffer {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of memory the buffer holds (its chunks, whole, and its
    /// spares).
    pub(crate) fn held_bytes(&self) -> usize {
        self.chunks_held_bytes() + self.spares.len() * CHUNK_BYTES
    }

    /// Bytes of memory the chunks in use hold.
    fn chunks_held_bytes(&self) -> usize {
        match self.chunks.len() {
            0 => 0,
            n => self.geometry.first_cap + (n - 1) * CHUNK_BYTES,
        }
    }

    /// Keeps at most `bytes` of spare chunks from now on.
    pub(crate) fn set_spare_limit(&mut self, bytes: usize) {
        self.spare_limit = bytes;
        self.spares.truncate(bytes / CHUNK_BYTES);
    }

    /// Gives the spare chunks back to the allocator (an idle log).
    pub(crate) fn release_spares(&mut self) {
        self.spares = Vec::new();
    }

    /// Keeps a chunk dropped from the front as a spare, if it is a whole
    /// chunk and there is room for it.
    fn recycle(&mut self, mut chunk: Vec<u8>) {
        if chunk.capacity() == CHUNK_BYTES
            && (self.spares.len() + 1) * CHUNK_BYTES <= self.spare_limit
        {
            chunk.clear();
            self.spares.push(chunk);
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
                let chunk = self
                    .spares
                    .pop()
                    .unwrap_or_else(|| Vec::with_capacity(CHUNK_BYTES));
                self.chunks.push_back(chunk);
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
            // Nothing held but the spares.
            for chunk in std::mem::take(&mut self.chunks) {
                self.recycle(chunk);
            }
            self.geometry = Geometry::FRESH;
            return;
        }
        while let Some(first) = self.chunks.front() {
            let visible = first.len() - self.geometry.dropped;
            if n < visible {
                self.geometry.dropped += n;
                break;
            }
            // A whole chunk dropped: the next one, full-sized, is first.
            if let Some(chunk) = self.chunks.pop_front() {
                self.recycle(chunk);
            }
            n -= visible;
            self.geometry = Geometry::FRESH;
        }
        if self.len <= SMALL_TAIL_BYTES && self.chunks_held_bytes() > self.len {
            let mut tail = vec![0; self.len];
            let copied = self.copy_to(0, &mut tail);
            debug_assert!(copied, "the bytes held are held");
            for chunk in std::mem::replace(&mut self.chunks, VecDeque::from([tail])) {
                self.recycle(chunk);
            }
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
        SpareLimit(usize),
        ReleaseSpares,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => proptest::collection::vec(any::<u8>(), 0..3 * CHUNK_BYTES).prop_map(Op::Append),
            2 => (0..4 * CHUNK_BYTES).prop_map(Op::DropFront),
            2 => (0..4 * CHUNK_BYTES, proptest::collection::vec(any::<u8>(), 0..2 * CHUNK_BYTES))
                .prop_map(|(at, b)| Op::WriteAt(at, b)),
            2 => (0..4 * CHUNK_BYTES, 0..2 * CHUNK_BYTES).prop_map(|(at, n)| Op::CopyTo(at, n)),
            1 => (0..4 * CHUNK_BYTES).prop_map(Op::SpareLimit),
            1 => Just(Op::ReleaseSpares),
        ]
    }

    proptest! {
        /// The chunked buffer behaves as one vector drained from the
        /// front, spares or none, and holds no more than its bytes rounded
        /// up to a chunk, plus the chunk its front lies in and its spares.
        #[test]
        fn behaves_as_a_vector_drained_from_the_front(ops in proptest::collection::vec(op(), 1..60)) {
            let mut buf = LogBuffer::default();
            let mut model: Vec<u8> = Vec::new();
            let mut spare_limit = 0;
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
                            prop_assert_eq!(buf.held_bytes() - buf.spares.len() * CHUNK_BYTES, model.len());
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
                    Op::SpareLimit(bytes) => {
                        buf.set_spare_limit(bytes);
                        spare_limit = bytes;
                    }
                    Op::ReleaseSpares => {
                        buf.release_spares();
                        prop_assert!(buf.spares.is_empty());
                    }
                }
                prop_assert!(buf.spares.len() * CHUNK_BYTES <= spare_limit);
                prop_assert!(buf.spares.iter().all(|c| c.is_empty() && c.capacity() == CHUNK_BYTES));
                prop_assert_eq!(buf.len(), model.len());
                prop_assert!(buf.held_bytes() <= model.len().div_ceil(CHUNK_BYTES) * CHUNK_BYTES + CHUNK_BYTES + spare_limit);

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

    /// Chunks dropped from the front serve the next appends, up to the
    /// limit, and go back to the allocator when released.
    #[test]
    fn dropped_chunks_serve_the_next_appends() {
        let mut buf = LogBuffer::default();
        buf.set_spare_limit(2 * CHUNK_BYTES);
        buf.extend_from_slice(&[1; 4 * CHUNK_BYTES]);
        let first: Vec<*const u8> = buf.chunks.iter().map(|c| c.as_ptr()).collect();
        // Three whole chunks dropped: two kept, the third freed.
        buf.drop_front(3 * CHUNK_BYTES);
        assert_eq!(buf.spares.len(), 2);
        assert_eq!(buf.held_bytes(), 3 * CHUNK_BYTES);
        // The next two chunks appended are the spares, in memory already.
        buf.extend_from_slice(&[2; 2 * CHUNK_BYTES]);
        assert!(buf.spares.is_empty());
        assert_eq!(buf.held_bytes(), 3 * CHUNK_BYTES);
        let reused = buf
            .chunks
            .iter()
            .skip(1)
            .filter(|c| first.contains(&c.as_ptr()))
            .count();
        assert_eq!(reused, 2);
        let mut all = vec![0; 3 * CHUNK_BYTES];
        assert!(buf.copy_to(0, &mut all));
        assert!(all[..CHUNK_BYTES].iter().all(|&b| b == 1));
        assert!(all[CHUNK_BYTES..].iter().all(|&b| b == 2));
        // Everything dropped: the chunks are spares, up to the limit.
        buf.drop_front(usize::MAX);
        assert_eq!((buf.len(), buf.held_bytes()), (0, 2 * CHUNK_BYTES));
        buf.release_spares();
        assert_eq!(buf.held_bytes(), 0);
        // A lower limit gives back what is beyond it at once.
        buf.set_spare_limit(3 * CHUNK_BYTES);
        buf.extend_from_slice(&[3; 3 * CHUNK_BYTES]);
        buf.drop_front(usize::MAX);
        assert_eq!(buf.spares.len(), 3);
        buf.set_spare_limit(CHUNK_BYTES);
        assert_eq!(buf.held_bytes(), CHUNK_BYTES);
    }
}
