//! Reads below a basement (node format 4): a large basement's entries are
//! cut into *chunks*, and a *chunk directory* after them names each
//! chunk's first key, place, length, checksum and kind. A point query (or
//! a range inside a chunk or two) on a basement the cache does not hold
//! reads the directory and the chunks holding its keys instead of the
//! whole basement (128 KiB by default) — what a cold 4 KiB read of a file
//! costs in each tree (BetrFS 0.6's reads below a basement; docs/design.md,
//! "Reads below a basement").
//!
//! Layout, inside a basement's slot (which starts on a 4 KiB boundary):
//!
//! ```text
//! +-------------------------------------------+-----------------+---------+
//! | chunk area (the basement's `len` bytes):  | chunk directory | zero    |
//! | chunks in key order, zero gaps between    |   (`dir len`)   | padding |
//! +-------------------------------------------+-----------------+---------+
//! directory: varint chunk count c (≥ 1); per chunk, in key order: its
//!   first key's suffix (varint length + bytes), u32 offset from the
//!   basement's start, u32 length, u32 crc32c of its bytes, u8 kind, and
//!   for kind 0 a varint entry count (≥ 1).
//! kind 0: a run of entries in the basement's own encoding (varint
//!   key-suffix length, key suffix, varint value length, value);
//! kind 1: one entry's value alone, raw (its key is the directory's). A
//!   value of a multiple of 4 KiB starts on a 4 KiB boundary of the node,
//!   so a file block is read as exactly one device block.
//! ```
//!
//! Chunks do not overlap and lie within the area; their counts add up to
//! the basement's. The leaf meta names the directory's length and
//! checksum; the basement's own checksum covers the whole area, gaps
//! included, so a whole read checks one checksum as before. A basement of
//! at most [`CHUNKED_BASEMENT_MIN_BYTES`] has no directory (length 0): it
//! is one run of entries, read whole.

use std::sync::Arc;

use betreefs_store::crc32c_of;

use crate::codec::{DecodeError, DecodeResult, Decoder, Measure, Sink};
use crate::entries::Entries;
use crate::node::{BasementLoc, Bounds};

/// A chunk is closed before an entry would take it past this many bytes
/// (an entry larger than that is a chunk alone): a chunk read is at most
/// two device blocks but for the rare large entry.
pub const CHUNK_BYTES: usize = 4 << 10;

/// An entry whose value is at least this long is a raw chunk alone.
pub const RAW_VALUE_MIN_BYTES: usize = 2 << 10;

/// Raw values of a multiple of this many bytes start on such a boundary.
const ALIGN: usize = 4096;

/// A basement read below is read whole once this many of its chunks are
/// cached (the next query that misses in it reads it whole), and so is
/// one for a range that needs more than [`CHUNKS_PER_READ_MAX`] chunks:
/// what is used again, or by more than a point, is worth holding whole,
/// as interior nodes read in part are completed. A file read at random
/// 4 KiB at a time — where the kernel's read-ahead makes many reads
/// larger — read 1.09× its size so (1.03× reading each basement whole at
/// its first use), 1.12× with four chunks, 1.28× with eight and 1.53×
/// when basements were never read whole (docs/benchmarks/reads-below.md).
pub const CHUNKS_BEFORE_WHOLE: usize = 2;

/// See [`CHUNKS_BEFORE_WHOLE`].
pub const CHUNKS_PER_READ_MAX: usize = 1;

/// Basements of at most this many bytes of entries get no directory: the
/// directory read and the chunk read would save little over reading them
/// whole.
pub const CHUNKED_BASEMENT_MIN_BYTES: usize = 16 << 10;

/// Where a basement's chunk directory lies (right after its entries): its
/// length and checksum, as the leaf meta records them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkDirLoc {
    pub len: u32,
    pub crc: u32,
}

/// One chunk of a basement as the writer plans it: the index of its first
/// entry, its offset from the basement's start, its length, its entry
/// count, and whether it is one raw value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPlan {
    pub first: usize,
    pub offset: usize,
    pub len: usize,
    pub count: usize,
    pub raw: bool,
}

/// The bytes entry `i` of `entries` takes in a run of entries whose keys
/// are stored without `prefix_len` bytes.
pub fn encoded_entry_bytes(entries: &Entries, i: usize, prefix_len: usize) -> usize {
    let mut m = Measure::default();
    m.bytes(entries.key(i).get(prefix_len..).unwrap_or_default());
    m.bytes(entries.value(i));
    m.0
}

/// The chunks of a basement: none if its entries take at most
/// [`CHUNKED_BASEMENT_MIN_BYTES`] as one run. Returns them and the length
/// of the basement's bytes: the chunk area (gaps before aligned values
/// included), or the run. One pass over the entries measures both.
pub fn plan_chunks(entries: &Entries, prefix_len: usize) -> (Vec<ChunkPlan>, usize) {
    let mut run_bytes = 0usize;
    let mut plans: Vec<ChunkPlan> = Vec::new();
    let mut run: Option<ChunkPlan> = None;
    let mut end = 0usize;
    for i in 0..entries.len() {
        let n = encoded_entry_bytes(entries, i, prefix_len);
        run_bytes += n;
        let value = entries.value(i).len();
        if value >= RAW_VALUE_MIN_BYTES {
            plans.extend(run.take());
            let offset = if value.is_multiple_of(ALIGN) {
                end.div_ceil(ALIGN) * ALIGN
            } else {
                end
            };
            plans.push(ChunkPlan {
                first: i,
                offset,
                len: value,
                count: 1,
                raw: true,
            });
            end = offset + value;
            continue;
        }
        if run.is_some_and(|r| r.len + n > CHUNK_BYTES) {
            plans.extend(run.take());
        }
        let r = run.get_or_insert(ChunkPlan {
            first: i,
            offset: end,
            len: 0,
            count: 0,
            raw: false,
        });
        r.len += n;
        r.count += 1;
        end += n;
    }
    plans.extend(run);
    if run_bytes <= CHUNKED_BASEMENT_MIN_BYTES {
        return (Vec::new(), run_bytes);
    }
    (plans, end)
}

/// Encodes a chunk directory ([`decode_dir`] reads it); `crcs` all zero
/// while measuring (they are fixed-size).
pub fn encode_dir(
    sink: &mut impl Sink,
    entries: &Entries,
    prefix_len: usize,
    plans: &[ChunkPlan],
    crcs: &[u32],
) {
    sink.varint(plans.len() as u64);
    for (j, plan) in plans.iter().enumerate() {
        sink.bytes(
            entries
                .key(plan.first)
                .get(prefix_len..)
                .unwrap_or_default(),
        );
        sink.u32(plan.offset as u32);
        sink.u32(plan.len as u32);
        sink.u32(crcs.get(j).copied().unwrap_or(0));
        if plan.raw {
            sink.u8(KIND_RAW);
        } else {
            sink.u8(KIND_RUN);
            sink.varint(plan.count as u64);
        }
    }
}

const KIND_RUN: u8 = 0;
const KIND_RAW: u8 = 1;

/// A basement's chunk directory, decoded: chunk `j` holds the keys from
/// `keys[j]` (the basement's low end for the first) up to `keys[j + 1]`
/// (its high end for the last).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkDir {
    /// The first key of every chunk, whole (the lifted prefix put back).
    pub keys: Vec<Vec<u8>>,
    /// Each chunk's place in the node's extent.
    pub locs: Vec<BasementLoc>,
    /// Entries per chunk; `None` for a raw value (one entry).
    pub counts: Vec<Option<usize>>,
    /// The node's lifted prefix's length: what the keys begin with.
    pub prefix_len: usize,
}

impl ChunkDir {
    pub fn chunk_for(&self, key: &[u8]) -> usize {
        self.keys
            .partition_point(|k| k.as_slice() <= key)
            .saturating_sub(1)
    }

    /// The chunks holding keys of [lo, hi).
    pub fn span(&self, lo: &[u8], hi: Option<&[u8]>) -> std::ops::RangeInclusive<usize> {
        let first = self.chunk_for(lo);
        let last = hi.map_or(self.locs.len().saturating_sub(1), |h| {
            self.keys
                .partition_point(|k| k.as_slice() < h)
                .saturating_sub(1)
                .max(first)
        });
        first..=last
    }

    /// The key range of chunk `j` of a basement with range `basement`.
    pub fn chunk_bounds(&self, j: usize, basement: &Bounds) -> Bounds {
        Bounds {
            lo: match j {
                0 => basement.lo.clone(),
                _ => self.keys.get(j).cloned().unwrap_or_default(),
            },
            hi: self
                .keys
                .get(j + 1)
                .cloned()
                .or_else(|| basement.hi.clone()),
        }
    }

    /// Checks the directory against the range of the basement it belongs
    /// to: every chunk's first key lies inside it.
    pub fn check_within(&self, basement: &Bounds) -> Result<(), String> {
        match self.keys.iter().find(|k| !basement.contains(k)) {
            Some(k) => Err(format!(
                "chunk key {k:?} outside its basement's range {basement:?}"
            )),
            None => Ok(()),
        }
    }

    /// Decodes chunk `j` from `bytes` (its bytes alone), checked against
    /// its checksum: a run of entries, or the one raw value.
    pub fn decode_chunk(&self, j: usize, bytes: &[u8], prefix: &[u8]) -> DecodeResult<Entries> {
        let (Some(loc), Some(count), Some(key)) =
            (self.locs.get(j), self.counts.get(j), self.keys.get(j))
        else {
            return Err(DecodeError(format!("no chunk {j}")));
        };
        if crc32c_of(&[bytes]) != loc.crc {
            return Err(DecodeError(format!(
                "chunk at offset {} fails its checksum",
                loc.offset
            )));
        }
        let mut entries = Entries::with_capacity(count.unwrap_or(1), bytes.len() + key.len());
        match count {
            None => entries.push(key, bytes),
            Some(count) => {
                let mut n = 0;
                parse_run(bytes, |suffix, value| {
                    if n == 0 && key.get(self.prefix_len..) != Some(suffix) {
                        return Err(DecodeError(
                            "chunk's first key is not its directory's".into(),
                        ));
                    }
                    entries.push_parts(prefix, suffix, value);
                    n += 1;
                    Ok(())
                })?;
                if n != *count {
                    return Err(DecodeError(format!(
                        "chunk holds {n} entries, directory says {count}"
                    )));
                }
            }
        }
        Ok(entries)
    }

    pub fn mem_bytes(&self) -> usize {
        self.keys.iter().map(|k| k.len() + 24).sum::<usize>() + self.locs.len() * 32 + 96
    }
}

/// Walks a run of entries in order, giving each key suffix and value to
/// `push`; checks that the keys increase.
pub fn parse_run<'b>(
    bytes: &'b [u8],
    mut push: impl FnMut(&'b [u8], &'b [u8]) -> DecodeResult<()>,
) -> DecodeResult<()> {
    let mut d = Decoder::new(bytes);
    let mut previous: Option<&[u8]> = None;
    while !d.is_empty() {
        let suffix = d.bytes()?;
        let value = d.bytes()?;
        // Every key shares the prefix, so suffix order is key order.
        if previous.is_some_and(|p| p >= suffix) {
            return Err(DecodeError("basement keys out of order".into()));
        }
        previous = Some(suffix);
        push(suffix, value)?;
    }
    Ok(())
}

/// Walks the entries of a basement with a chunk directory from its chunk
/// area `area` (the basement's bytes), in key order: each chunk's entries,
/// a raw chunk's key from the directory. Checks that keys increase across
/// chunks and that the chunks hold `count` entries (checksums are the
/// caller's: the area's, or each chunk's).
pub fn parse_chunked<'b>(
    area: &'b [u8],
    dir: &ChunkDir,
    base: u32,
    count: usize,
    mut push: impl FnMut(&[u8], &'b [u8]) -> DecodeResult<()>,
) -> DecodeResult<()> {
    let mut n = 0usize;
    let suffix_of = |j: usize| {
        dir.keys
            .get(j)
            .map(|k| k.get(dir.prefix_len..).unwrap_or_default())
    };
    for (j, (loc, chunk_count)) in dir.locs.iter().zip(&dir.counts).enumerate() {
        let at = (loc.offset - base) as usize;
        let bytes = area
            .get(at..at + loc.len as usize)
            .ok_or_else(|| DecodeError(format!("chunk {j} past its basement")))?;
        let first = suffix_of(j).unwrap_or_default();
        match chunk_count {
            // Its one key is the directory's, whose keys increase.
            None => {
                push(first, bytes)?;
                n += 1;
            }
            // A run's keys increase (`parse_run`), begin with the
            // directory's key and stay below the next chunk's.
            Some(expected) => {
                let mut last: Option<&[u8]> = None;
                let mut in_chunk = 0usize;
                parse_run(bytes, |suffix, value| {
                    if last.is_none() && suffix != first {
                        return Err(DecodeError(
                            "chunk's first key is not its directory's".into(),
                        ));
                    }
                    last = Some(suffix);
                    in_chunk += 1;
                    push(suffix, value)
                })?;
                if last
                    .zip(suffix_of(j + 1))
                    .is_some_and(|(l, next)| l >= next)
                {
                    return Err(DecodeError("basement keys out of order".into()));
                }
                if in_chunk != *expected {
                    return Err(DecodeError(format!(
                        "chunk holds {in_chunk} entries, directory says {expected}"
                    )));
                }
                n += in_chunk;
            }
        }
    }
    if n != count {
        return Err(DecodeError(format!(
            "basement holds {n} entries, meta says {count}"
        )));
    }
    Ok(())
}

/// Decodes the chunk directory `bytes` of the basement at `basement`
/// (holding `count` entries), checked against `dir`'s checksum; `prefix`
/// is the node's lifted prefix.
pub fn decode_dir(
    bytes: &[u8],
    dir: &ChunkDirLoc,
    basement: &BasementLoc,
    count: usize,
    prefix: &[u8],
) -> DecodeResult<ChunkDir> {
    if crc32c_of(&[bytes]) != dir.crc {
        return Err(DecodeError(format!(
            "chunk directory of the basement at offset {} fails its checksum",
            basement.offset
        )));
    }
    let mut d = Decoder::new(bytes);
    let chunks = d.varint()? as usize;
    if chunks == 0 || chunks > bytes.len() {
        return Err(DecodeError(format!("bad chunk count {chunks}")));
    }
    let mut out = ChunkDir {
        keys: Vec::with_capacity(chunks),
        locs: Vec::with_capacity(chunks),
        counts: Vec::with_capacity(chunks),
        prefix_len: prefix.len(),
    };
    let (mut end, mut total) = (0u64, 0usize);
    for j in 0..chunks {
        let suffix = d.bytes()?;
        let mut key = Vec::with_capacity(prefix.len() + suffix.len());
        key.extend_from_slice(prefix);
        key.extend_from_slice(suffix);
        if out.keys.last().is_some_and(|k| *k >= key) {
            return Err(DecodeError("chunk keys out of order".into()));
        }
        out.keys.push(key);
        let (offset, len, crc) = (d.u32()? as u64, d.u32()?, d.u32()?);
        let n = match d.u8()? {
            KIND_RUN => Some(d.varint()? as usize),
            KIND_RAW => None,
            kind => return Err(DecodeError(format!("chunk {j} of unknown kind {kind}"))),
        };
        if len == 0 || n == Some(0) || offset < end {
            return Err(DecodeError(format!("chunk {j} empty or overlapping")));
        }
        end = offset + len as u64;
        out.locs.push(BasementLoc {
            offset: u32::try_from(basement.offset as u64 + offset)
                .map_err(|_| DecodeError("chunk past its node".into()))?,
            len,
            crc,
        });
        out.counts.push(n);
        total = total.saturating_add(n.unwrap_or(1));
    }
    if !d.is_empty() {
        return Err(DecodeError("trailing bytes after a chunk directory".into()));
    }
    if end > basement.len as u64 || total != count {
        return Err(DecodeError(format!(
            "chunks of the basement at offset {} do not add up to it",
            basement.offset
        )));
    }
    Ok(out)
}

/// What is cached of a basement read below: its directory and the chunks
/// read through it. Shared and never changed in place (a read adds chunks
/// to a copy), as a basement's entries are.
#[derive(Clone, Debug)]
pub struct ReadBelow {
    pub dir: Arc<ChunkDir>,
    /// (chunk index, its entries), in increasing index order.
    pub chunks: Vec<(usize, Arc<Entries>)>,
}

impl ReadBelow {
    pub fn chunk(&self, j: usize) -> Option<&Arc<Entries>> {
        self.chunks
            .binary_search_by_key(&j, |(i, _)| *i)
            .ok()
            .and_then(|at| self.chunks.get(at))
            .map(|(_, e)| e)
    }

    /// The chunks holding [lo, hi), if all are read.
    pub fn span_read(
        &self,
        lo: &[u8],
        hi: Option<&[u8]>,
    ) -> Option<std::ops::RangeInclusive<usize>> {
        let span = self.dir.span(lo, hi);
        span.clone()
            .all(|j| self.chunk(j).is_some())
            .then_some(span)
    }

    /// Whether the chunk holding `key` is read.
    pub fn holds_key(&self, key: &[u8]) -> bool {
        self.chunk(self.dir.chunk_for(key)).is_some()
    }

    /// The value at `key` (`Some(None)` if absent), if its chunk is read.
    pub fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        Some(self.chunk(self.dir.chunk_for(key))?.get(key))
    }

    /// This and `more` (read below the same directory) together.
    pub fn with(&self, more: &ReadBelow) -> ReadBelow {
        let mut chunks = self.chunks.clone();
        for (j, e) in &more.chunks {
            if let Err(at) = chunks.binary_search_by_key(j, |(i, _)| *i) {
                chunks.insert(at, (*j, e.clone()));
            }
        }
        ReadBelow {
            dir: self.dir.clone(),
            chunks,
        }
    }

    /// The whole basement's entries, once every chunk is read: chunks are
    /// never read twice, and a basement read chunk by chunk ends whole.
    pub fn whole(&self) -> Option<Entries> {
        if self.chunks.len() != self.dir.locs.len() {
            return None;
        }
        let (count, bytes) = self
            .chunks
            .iter()
            .fold((0, 0), |(n, b), (_, e)| (n + e.len(), b + e.bytes()));
        let mut all = Entries::with_capacity(count, bytes);
        for (_, e) in &self.chunks {
            all.extend_from(e, 0, e.len());
        }
        Some(all)
    }

    pub fn mem_bytes(&self) -> usize {
        self.dir.mem_bytes()
            + self
                .chunks
                .iter()
                .map(|(_, e)| e.mem_bytes() + 16)
                .sum::<usize>()
    }
}
