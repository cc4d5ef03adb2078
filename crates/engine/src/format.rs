//! On-disk node format, version 4, with key lifting.
//!
//! A node occupies one extent of the node region:
//!
//! ```text
//! +--------------------+------------------+-----+-------------+-------------+
//! | header (64 bytes)  | meta (meta_len)  | pad | basement 0  | basement 1 ...
//! +--------------------+------------------+-----+-------------+-------------+
//!                                               ^ each basement starts on a
//!                                                 4 KiB boundary (leaves)
//! +--------------------+------------------+-----------+-----------+----
//! | header (64 bytes)  | meta (meta_len)  | segment 0 | segment 1 | ... (interior)
//! +--------------------+------------------+-----------+-----------+----
//! header, little-endian:
//!   0 u32 magic "BNOD"        4 u16 version (4)     6 u8 kind (0 leaf, 1 interior)
//!   7 u8 tree (key space)     8 u32 height         12 u32 low-bound suffix length
//!  16 u32 crc32c of the bounds' suffixes            20 u32 meta_len
//!  24 u32 crc32c of meta      28 u64 node number   36 u32 total length in bytes
//!  40 20 zero bytes           60 u32 crc32c of bytes [0, 60)
//! ```
//!
//! Every key, pivot and range-delete bound in the node is stored without its
//! lifted prefix: the longest common prefix of the node's bounds as given
//! by its parent's pivots (BetrFS 0.4 §5). The parent supplies the prefix
//! when the node is read. The header records only what follows the
//! prefix in the node's bounds ([`Bounds::relative_check`]): the image
//! depends on where the node sits only through its prefix, so a range
//! rename can move a whole subtree under a new prefix by changing one
//! pointer (tree surgery) without rewriting a node of it, while a node
//! read under a parent that gives it other bounds is still refused.
//! Version 1 stored the length and crc of the absolute prefix instead.
//!
//! Leaf meta: varint basement count; per basement: (i > 0) pivot suffix as
//! varint length + bytes, u32 offset, u32 length, u32 crc32c, varint entry
//! count, varint chunk-directory length and (if not 0) its u32 crc32c. A
//! basement is a run of entries: varint key-suffix length, key suffix,
//! varint value length, value — or, past 16 KiB, chunks of them named by
//! a chunk directory right after them (`chunks.rs`; node format 3 had no
//! directories).
//!
//! Interior meta: varint child count; child count - 1 pivot suffixes; then
//! per child: u64 node number, varint range-delete count, each (start suffix,
//! end suffix, varint seq); varint segment count, each ((j > 0) the
//! suffix of its first key, u32 offset, u32 length, u32 crc32c, varint
//! point count). The segments follow the meta, packed in child and key
//! order: each a run of point messages (key suffix, u8 base: 0 none / 1
//! put / 2 delete, [varint seq], [value], varint upsert count, each
//! (varint seq, u8 function, argument)) of about [`SEGMENT_BYTES`], so that
//! a point query can read the meta and the one segment holding its key
//! (node format 2 had every message in the meta).
//!
//! The header crc is also kept in the block translation table, so a node
//! read from an extent that was since reused is detected.

use std::sync::Arc;

use betreefs_store::{crc32c_of, AlignedBuf, BLOCK_SIZE};

use crate::buffer::{Base, MessageBuffer, PointMsg, RangeDel, Upsert};
use crate::chunks::{
    decode_dir, encode_dir, parse_chunked, parse_run, plan_chunks, ChunkDir, ChunkDirLoc, ChunkPlan,
};
use crate::codec::{DecodeError, DecodeResult, Decoder, Encoder, Measure, Sink, SliceWriter};
use crate::entries::Entries;
use crate::node::{
    Basement, BasementLoc, Bounds, Interior, Leaf, Node, NodeBody, PartialPoints, Segment, Segments,
};

pub const NODE_MAGIC: u32 = u32::from_le_bytes(*b"BNOD");
pub const NODE_FORMAT_VERSION: u16 = 4;
/// An interior node's point messages are stored in segments of about
/// this many bytes, or a 64th of all of them if that is less (but not
/// under [`SEGMENT_MIN_BYTES`]); a message larger than that is a segment
/// alone. A cold point query reads one per buffer on its way down;
/// smaller segments would make the meta, which names them all, larger.
pub const SEGMENT_BYTES: usize = 8 << 10;
pub const SEGMENT_MIN_BYTES: usize = 256;
pub const HEADER_BYTES: usize = 64;
const KIND_LEAF: u8 = 0;
const KIND_INTERIOR: u8 = 1;

/// The fixed header of a node image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeHeader {
    pub kind_leaf: bool,
    pub tree: u8,
    pub height: u32,
    /// Length of the low bound after the lifted prefix.
    pub bounds_lo_len: u32,
    /// crc32c of the bounds after the lifted prefix.
    pub bounds_crc: u32,
    pub meta_len: u32,
    pub meta_crc: u32,
    pub num: u64,
    pub total_len: u32,
    pub crc: u32,
}

fn strip<'k>(key: &'k [u8], prefix: &[u8]) -> &'k [u8] {
    assert!(
        key.starts_with(prefix),
        "key lifting invariant broken: key {key:?} lacks prefix {prefix:?}"
    );
    key.get(prefix.len()..).unwrap_or_default()
}

/// Copies `bytes` into `buf` at `at` (a layout computed from the same sizes).
fn place(buf: &mut [u8], at: usize, bytes: &[u8]) {
    debug_assert!(
        at + bytes.len() <= buf.len(),
        "node layout overflows its buffer"
    );
    if let Some(dst) = buf.get_mut(at..at + bytes.len()) {
        dst.copy_from_slice(bytes);
    }
}

/// Whether the keys are strictly increasing.
fn strictly_increasing(keys: &[Vec<u8>]) -> bool {
    keys.iter().zip(keys.iter().skip(1)).all(|(a, b)| a < b)
}

fn unlift(prefix: &[u8], suffix: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + suffix.len());
    k.extend_from_slice(prefix);
    k.extend_from_slice(suffix);
    k
}

/// A part's place while the meta is measured, before it is known.
const UNPLACED: BasementLoc = BasementLoc {
    offset: 0,
    len: 0,
    crc: 0,
};

fn round_block(n: usize) -> usize {
    n.div_ceil(BLOCK_SIZE) * BLOCK_SIZE
}

/// A serialised node ready for one write, and its header crc.
pub struct NodeImage {
    pub buf: AlignedBuf,
    pub len: u32,
    pub crc: u32,
    /// Where each basement and its chunk directory landed (leaves), to
    /// keep partial reads possible.
    pub basement_locs: Vec<PlacedBasement>,
}

/// Serialises a node. Leaves must be fully loaded.
///
/// Each part is measured first and then encoded straight into its place
/// in a recycled device buffer (`AlignedBuf::for_overwrite`): a request
/// that changes a node the checkpoint in flight has not imaged yet does
/// this under the tree lock, and encoding into vectors grown by doubling,
/// then copied into a freshly zeroed buffer, took up to 11.6 ms for one
/// node during an untar (page faults on every fresh megabyte included).
pub fn encode_node(node: &Node, num: u64) -> NodeImage {
    let prefix = node.bounds.lifted_prefix();
    let prefix = prefix.as_slice();
    let (kind, height, mut buf, meta_len, total, locs) = match &node.body {
        NodeBody::Leaf(leaf) => {
            let (buf, meta_len, locs) = encode_leaf_body(leaf, prefix);
            let total = match locs.last() {
                Some((last, dir)) => last.offset as usize + slot_bytes(last, dir.as_ref()),
                None => HEADER_BYTES + meta_len,
            };
            (KIND_LEAF, 0, buf, meta_len, total, locs)
        }
        NodeBody::Interior(int) => {
            let (buf, meta_len, total) = encode_interior_body(int, prefix);
            (KIND_INTERIOR, int.height, buf, meta_len, total, Vec::new())
        }
    };
    let meta_crc = crc32c_of(&[buf
        .get(HEADER_BYTES..HEADER_BYTES + meta_len)
        .unwrap_or_default()]);
    let mut h = Encoder::with_capacity(HEADER_BYTES);
    h.u32(NODE_MAGIC);
    h.put(&NODE_FORMAT_VERSION.to_le_bytes());
    h.u8(kind);
    h.u8(node.tree);
    h.u32(height);
    let (bounds_lo_len, bounds_crc) = node.bounds.relative_check();
    h.u32(bounds_lo_len);
    h.u32(bounds_crc);
    h.u32(meta_len as u32);
    h.u32(meta_crc);
    h.u64(num);
    h.u32(total as u32);
    h.buf.resize(60, 0);
    let crc = crc32c_of(&[&h.buf]);
    h.u32(crc);
    place(&mut buf, 0, &h.buf);
    NodeImage {
        buf,
        len: total as u32,
        crc,
        basement_locs: locs,
    }
}

/// Where a basement of a leaf image lies and where its chunk directory
/// (if it has one) follows it.
pub type PlacedBasement = (BasementLoc, Option<ChunkDirLoc>);

/// The bytes a basement's slot takes: its entries and chunk directory,
/// rounded up to whole blocks (the next basement starts on a boundary).
fn slot_bytes(loc: &BasementLoc, dir: Option<&ChunkDirLoc>) -> usize {
    round_block((loc.len as usize + dir.map_or(0, |d| d.len as usize)).max(1))
}

/// A basement as measured before its leaf is encoded: its entries'
/// encoded length and its chunks (none for a small basement).
struct BasementPlan {
    len: usize,
    chunks: Vec<ChunkPlan>,
    dir_len: usize,
}

fn plan_basement(b: &Basement, prefix: &[u8]) -> BasementPlan {
    let Some(entries) = &b.entries else {
        return BasementPlan {
            len: 0,
            chunks: Vec::new(),
            dir_len: 0,
        };
    };
    let (chunks, mut len) = plan_chunks(entries, prefix.len());
    let dir_len = if chunks.is_empty() {
        0
    } else {
        let mut measure = Measure::default();
        encode_dir(&mut measure, entries, prefix.len(), &chunks, &[]);
        measure.0
    };
    // A directory that fits in a block does not straddle two: the chunk
    // area ends with zeros up to the next block instead (a read below the
    // basement reads the directory's blocks).
    if dir_len > 0 && dir_len <= BLOCK_SIZE && len % BLOCK_SIZE + dir_len > BLOCK_SIZE {
        len = round_block(len);
    }
    BasementPlan {
        len,
        chunks,
        dir_len,
    }
}

/// A leaf's meta and basements (each followed by its chunk directory), in
/// a buffer with the header's bytes left for the caller: returns it, the
/// meta's length and where each basement lies. Every byte past the header
/// is written (padding zeroed).
fn encode_leaf_body(leaf: &Leaf, prefix: &[u8]) -> (AlignedBuf, usize, Vec<PlacedBasement>) {
    let plans: Vec<BasementPlan> = leaf
        .basements
        .iter()
        .map(|b| plan_basement(b, prefix))
        .collect();
    // Offsets and checksums are fixed-size: the meta measures the same
    // before the basements are placed.
    let mut locs: Vec<PlacedBasement> = plans
        .iter()
        .map(|plan| {
            let loc = BasementLoc {
                len: plan.len as u32,
                ..UNPLACED
            };
            let dir = (plan.dir_len > 0).then_some(ChunkDirLoc {
                len: plan.dir_len as u32,
                crc: 0,
            });
            (loc, dir)
        })
        .collect();
    let mut measure = Measure::default();
    encode_leaf_meta(&mut measure, leaf, prefix, &locs);
    let meta_len = measure.0;
    let mut offset = round_block(HEADER_BYTES + meta_len);
    for (loc, dir) in &mut locs {
        loc.offset = offset as u32;
        offset += slot_bytes(loc, dir.as_ref());
    }
    let mut buf = AlignedBuf::for_overwrite(offset);
    for (((loc, dir), b), plan) in locs.iter_mut().zip(&leaf.basements).zip(&plans) {
        let (start, len) = (loc.offset as usize, loc.len as usize);
        let slot = buf
            .get_mut(start..start + slot_bytes(loc, dir.as_ref()))
            .unwrap_or_default();
        let (bytes, rest) = slot.split_at_mut(len.min(slot.len()));
        let (dir_bytes, padding) = rest.split_at_mut(plan.dir_len.min(rest.len()));
        match (dir.as_mut(), &b.entries) {
            (Some(dir), Some(entries)) => {
                let (crcs, area_crc) = encode_chunks(bytes, entries, prefix, &plan.chunks);
                let mut writer = SliceWriter::new(dir_bytes);
                encode_dir(&mut writer, entries, prefix.len(), &plan.chunks, &crcs);
                assert_eq!(
                    writer.written(),
                    plan.dir_len,
                    "chunk directory measured wrong"
                );
                dir.crc = crc32c_of(&[&*dir_bytes]);
                loc.crc = area_crc;
            }
            _ => {
                let mut writer = SliceWriter::new(bytes);
                encode_basement(&mut writer, b, prefix);
                assert_eq!(writer.written(), len, "basement measured wrong");
                loc.crc = crc32c_of(&[&*bytes]);
            }
        }
        padding.fill(0);
    }
    let first = locs
        .first()
        .map_or(round_block(HEADER_BYTES + meta_len), |(l, _)| {
            l.offset as usize
        });
    let (meta, padding) = buf
        .get_mut(HEADER_BYTES..first)
        .unwrap_or_default()
        .split_at_mut(meta_len);
    let mut writer = SliceWriter::new(meta);
    encode_leaf_meta(&mut writer, leaf, prefix, &locs);
    assert_eq!(writer.written(), meta_len, "leaf meta measured wrong");
    padding.fill(0);
    (buf, meta_len, locs)
}

/// Writes a basement's chunks into its chunk area `area` where `plans`
/// put them (gaps zeroed); returns each chunk's checksum and the whole
/// area's.
fn encode_chunks(
    area: &mut [u8],
    entries: &Entries,
    prefix: &[u8],
    plans: &[ChunkPlan],
) -> (Vec<u32>, u32) {
    let mut crcs = Vec::with_capacity(plans.len());
    let mut area_crc = 0;
    let mut end = 0;
    for plan in plans {
        if let Some(gap) = area.get_mut(end..plan.offset) {
            gap.fill(0);
            area_crc = crc32c::crc32c_append(area_crc, gap);
        }
        let chunk = area
            .get_mut(plan.offset..plan.offset + plan.len)
            .unwrap_or_default();
        if plan.raw {
            chunk.copy_from_slice(entries.value(plan.first));
        } else {
            let mut writer = SliceWriter::new(chunk);
            encode_run(
                &mut writer,
                entries,
                plan.first..plan.first + plan.count,
                prefix,
            );
            assert_eq!(writer.written(), plan.len, "chunk measured wrong");
        }
        // The area's checksum goes on over the chunk while it is in the
        // CPU's cache (combining the chunks' checksums instead,
        // `crc32c_combine`, cost a sequential write 40%).
        let crc = crc32c_of(&[&*chunk]);
        area_crc = crc32c::crc32c_append(area_crc, chunk);
        crcs.push(crc);
        end = plan.offset + plan.len;
    }
    assert!(end <= area.len(), "chunk area measured wrong");
    if let Some(tail) = area.get_mut(end..) {
        tail.fill(0);
        area_crc = crc32c::crc32c_append(area_crc, tail);
    }
    (crcs, area_crc)
}

fn encode_basement(sink: &mut impl Sink, b: &Basement, prefix: &[u8]) {
    if let Some(entries) = &b.entries {
        encode_run(sink, entries, 0..entries.len(), prefix);
    }
}

/// Entries `range` of `entries` as a run: each key without `prefix`,
/// then its value.
fn encode_run(
    sink: &mut impl Sink,
    entries: &Entries,
    range: std::ops::Range<usize>,
    prefix: &[u8],
) {
    for i in range {
        sink.bytes(strip(entries.key(i), prefix));
        sink.bytes(entries.value(i));
    }
}

/// A leaf's meta: per basement the part entry ([`encode_part_entry`]),
/// then its chunk directory's varint length and, if not 0, its u32 crc.
fn encode_leaf_meta(sink: &mut impl Sink, leaf: &Leaf, prefix: &[u8], locs: &[PlacedBasement]) {
    sink.varint(leaf.basements.len() as u64);
    for (i, b) in leaf.basements.iter().enumerate() {
        let pivot = i.checked_sub(1).and_then(|p| leaf.pivots.get(p));
        let (loc, dir) = locs.get(i).copied().unwrap_or((UNPLACED, None));
        encode_part_entry(sink, pivot.map(|p| strip(p, prefix)), loc, b.count);
        match dir {
            Some(dir) => {
                sink.varint(dir.len as u64);
                sink.u32(dir.crc);
            }
            None => sink.varint(0),
        }
    }
}

/// One segment of an interior node's image as planned before encoding:
/// the child whose buffer it is part of, its first key, how many point
/// messages it holds and their encoded length.
struct SegmentPlan<'a> {
    child: usize,
    first: &'a [u8],
    count: usize,
    len: usize,
}

/// Cuts each buffer's point messages into segments of about
/// [`SEGMENT_BYTES`] encoded bytes (less in a small node).
fn plan_segments<'a>(int: &'a Interior, prefix: &[u8]) -> Vec<SegmentPlan<'a>> {
    let lens: Vec<usize> = int
        .buffers
        .iter()
        .flat_map(|b| b.points())
        .map(|(key, msg)| {
            let mut measure = Measure::default();
            encode_point(&mut measure, key, msg, prefix);
            measure.0
        })
        .collect();
    let target = (lens.iter().sum::<usize>() / 64).clamp(SEGMENT_MIN_BYTES, SEGMENT_BYTES);
    let mut lens = lens.into_iter();
    let mut plan: Vec<SegmentPlan<'a>> = Vec::new();
    for (child, buffer) in int.buffers.iter().enumerate() {
        for (key, len) in buffer.points().keys().zip(lens.by_ref()) {
            match plan.last_mut() {
                Some(last) if last.child == child && last.len < target => {
                    last.count += 1;
                    last.len += len;
                }
                _ => plan.push(SegmentPlan {
                    child,
                    first: key,
                    count: 1,
                    len,
                }),
            }
        }
    }
    plan
}

/// An interior node's meta and segments, in a buffer with the header's
/// bytes left for the caller: returns it, the meta's length, and the
/// node's length (the end of its last segment). Every byte past the
/// header is written (padding zeroed).
fn encode_interior_body(int: &Interior, prefix: &[u8]) -> (AlignedBuf, usize, usize) {
    assert!(
        !int.is_partial(),
        "tree invariant: an interior node read in part is never written"
    );
    let plan = plan_segments(int, prefix);
    let mut measure = Measure::default();
    encode_interior_meta(&mut measure, int, prefix, &plan, &[]);
    let meta_len = measure.0;
    let mut offset = HEADER_BYTES + meta_len;
    let mut locs: Vec<BasementLoc> = Vec::with_capacity(plan.len());
    for segment in &plan {
        locs.push(BasementLoc {
            offset: offset as u32,
            len: segment.len as u32,
            crc: 0,
        });
        offset += segment.len;
    }
    let end = offset;
    let mut buf = AlignedBuf::for_overwrite(end);
    let mut at = 0;
    for (i, buffer) in int.buffers.iter().enumerate() {
        let mut points = buffer.points().iter();
        while let (Some(segment), Some(loc)) =
            (plan.get(at).filter(|s| s.child == i), locs.get_mut(at))
        {
            let (start, len) = (loc.offset as usize, loc.len as usize);
            let bytes = buf.get_mut(start..start + len).unwrap_or_default();
            let mut writer = SliceWriter::new(bytes);
            for (key, msg) in points.by_ref().take(segment.count) {
                encode_point(&mut writer, key, msg, prefix);
            }
            assert_eq!(writer.written(), len, "segment measured wrong");
            loc.crc = crc32c_of(&[bytes]);
            at += 1;
        }
    }
    buf.get_mut(end..).unwrap_or_default().fill(0);
    let meta = buf
        .get_mut(HEADER_BYTES..HEADER_BYTES + meta_len)
        .unwrap_or_default();
    let mut writer = SliceWriter::new(meta);
    encode_interior_meta(&mut writer, int, prefix, &plan, &locs);
    assert_eq!(writer.written(), meta_len, "interior meta measured wrong");
    (buf, meta_len, end)
}

fn encode_interior_meta(
    m: &mut impl Sink,
    int: &Interior,
    prefix: &[u8],
    plan: &[SegmentPlan<'_>],
    locs: &[BasementLoc],
) {
    m.varint(int.children.len() as u64);
    for p in &int.pivots {
        m.bytes(strip(p, prefix));
    }
    let mut at = 0;
    for (i, (child, buffer)) in int.children.iter().zip(&int.buffers).enumerate() {
        m.u64(*child);
        m.varint(buffer.ranges().len() as u64);
        for (start, r) in buffer.ranges() {
            m.bytes(strip(start, prefix));
            m.bytes(strip(&r.end, prefix));
            m.varint(r.seq);
        }
        let first = at;
        while plan.get(at).is_some_and(|s| s.child == i) {
            at += 1;
        }
        m.varint((at - first) as u64);
        for (j, segment) in plan.iter().enumerate().take(at).skip(first) {
            let pivot = (j > first).then(|| strip(segment.first, prefix));
            let loc = locs.get(j).copied().unwrap_or(UNPLACED);
            encode_part_entry(m, pivot, loc, segment.count);
        }
    }
}

fn encode_point(m: &mut impl Sink, key: &[u8], msg: &PointMsg, prefix: &[u8]) {
    m.bytes(strip(key, prefix));
    match &msg.base {
        None => m.u8(0),
        Some(Base::Put { seq, value }) => {
            m.u8(1);
            m.varint(*seq);
            m.bytes(value);
        }
        Some(Base::Delete { seq }) => {
            m.u8(2);
            m.varint(*seq);
        }
    }
    m.varint(msg.upserts.len() as u64);
    for u in &msg.upserts {
        m.varint(u.seq);
        m.u8(u.func);
        m.bytes(&u.arg);
    }
}

/// Parses and checks a header. `expect_crc` comes from the block table.
pub fn decode_header(
    bytes: &[u8],
    expect_crc: u32,
    num: u64,
    bounds: &Bounds,
) -> DecodeResult<NodeHeader> {
    let Some(header_bytes) = bytes.get(..HEADER_BYTES) else {
        return Err(DecodeError("node shorter than its header".into()));
    };
    let mut d = Decoder::new(header_bytes);
    let magic = d.u32()?;
    if magic != NODE_MAGIC {
        return Err(DecodeError(format!("bad node magic {magic:#x}")));
    }
    let (covered, crc_field) = header_bytes.split_at(60);
    let stored_crc = Decoder::new(crc_field).u32()?;
    if crc32c_of(&[covered]) != stored_crc {
        return Err(DecodeError("node header checksum mismatch".into()));
    }
    if stored_crc != expect_crc {
        return Err(DecodeError(
            "node header differs from the block table's record (stale or misplaced node)".into(),
        ));
    }
    let version = u16::from(d.u8()?) | u16::from(d.u8()?) << 8;
    if version != NODE_FORMAT_VERSION {
        return Err(DecodeError(format!("unsupported node version {version}")));
    }
    let kind = d.u8()?;
    let header = NodeHeader {
        kind_leaf: match kind {
            KIND_LEAF => true,
            KIND_INTERIOR => false,
            k => return Err(DecodeError(format!("unknown node kind {k}"))),
        },
        tree: d.u8()?,
        height: d.u32()?,
        bounds_lo_len: d.u32()?,
        bounds_crc: d.u32()?,
        meta_len: d.u32()?,
        meta_crc: d.u32()?,
        num: d.u64()?,
        total_len: d.u32()?,
        crc: stored_crc,
    };
    if header.num != num {
        return Err(DecodeError(format!(
            "node claims number {} but was read as {num}",
            header.num
        )));
    }
    if (header.bounds_lo_len, header.bounds_crc) != bounds.relative_check() {
        return Err(DecodeError(
            "node bounds do not match the parent's pivots".into(),
        ));
    }
    if header.kind_leaf != (header.height == 0) {
        return Err(DecodeError("node kind and height disagree".into()));
    }
    if HEADER_BYTES + header.meta_len as usize > header.total_len as usize {
        return Err(DecodeError("meta runs past the end of the node".into()));
    }
    Ok(header)
}

/// Bytes to read to have the header and meta.
pub fn meta_end(header: &NodeHeader) -> usize {
    HEADER_BYTES + header.meta_len as usize
}

/// Builds a node from its header and meta; leaf basements stay unloaded.
/// `bounds` are what the parent's pivots give the node.
pub fn decode_meta(header: &NodeHeader, meta: &[u8], bounds: &Bounds) -> DecodeResult<Node> {
    let prefix = bounds.lifted_prefix();
    let prefix = prefix.as_slice();
    if crc32c_of(&[meta]) != header.meta_crc {
        return Err(DecodeError("node meta checksum mismatch".into()));
    }
    let mut d = Decoder::new(meta);
    let body = if header.kind_leaf {
        let count = d.varint()? as usize;
        if count == 0 || count > meta.len() {
            return Err(DecodeError(format!("bad basement count {count}")));
        }
        let mut leaf = Leaf {
            pivots: Vec::with_capacity(count - 1),
            basements: Vec::with_capacity(count),
            grows_at_end: false,
        };
        for i in 0..count {
            let (pivot, loc, entries) = decode_part_entry(&mut d, prefix, i == 0)?;
            let dir_len = d.varint()?;
            let dir = match dir_len {
                0 => None,
                len => Some(ChunkDirLoc {
                    len: u32::try_from(len)
                        .map_err(|_| DecodeError(format!("bad chunk directory length {len}")))?,
                    crc: d.u32()?,
                }),
            };
            leaf.pivots.extend(pivot);
            if loc.offset as u64 + loc.len as u64 + dir_len > header.total_len as u64
                || !loc.offset.is_multiple_of(BLOCK_SIZE as u32)
            {
                return Err(DecodeError(format!("basement {i} lies outside its node")));
            }
            leaf.basements.push(Basement {
                entries: None,
                loc: Some(loc),
                dir,
                below: None,
                bytes: loc.len as usize,
                count: entries,
            });
        }
        if !strictly_increasing(&leaf.pivots) {
            return Err(DecodeError("basement pivots out of order".into()));
        }
        NodeBody::Leaf(leaf)
    } else {
        NodeBody::Interior(decode_interior(&mut d, header, prefix)?)
    };
    if !d.is_empty() {
        return Err(DecodeError("trailing bytes after node meta".into()));
    }
    Ok(Node {
        body,
        bounds: bounds.clone(),
        tree: header.tree,
        dirty: false,
        last_used: Default::default(),
    })
}

/// One entry of a leaf's basement table or of a buffer's segment table:
/// the part's first key (all but the first part), place and count.
fn decode_part_entry(
    d: &mut Decoder<'_>,
    prefix: &[u8],
    first: bool,
) -> DecodeResult<(Option<Vec<u8>>, BasementLoc, usize)> {
    let pivot = if first {
        None
    } else {
        Some(unlift(prefix, d.bytes()?))
    };
    let loc = BasementLoc {
        offset: d.u32()?,
        len: d.u32()?,
        crc: d.u32()?,
    };
    Ok((pivot, loc, d.varint()? as usize))
}

/// Encodes an entry [`decode_part_entry`] reads (`loc` all zero while
/// measuring: the fields are fixed-size, so the meta measures the same
/// before the parts' places are known).
fn encode_part_entry(sink: &mut impl Sink, pivot: Option<&[u8]>, loc: BasementLoc, count: usize) {
    if let Some(pivot) = pivot {
        sink.bytes(pivot);
    }
    sink.u32(loc.offset);
    sink.u32(loc.len);
    sink.u32(loc.crc);
    sink.varint(count as u64);
}

/// An interior node's meta: pivots, children, range deletes, and where
/// each buffer's point messages lie (the node read in part).
fn decode_interior(
    d: &mut Decoder<'_>,
    header: &NodeHeader,
    prefix: &[u8],
) -> DecodeResult<Interior> {
    let count = d.varint()? as usize;
    if count == 0 || count > d.remaining() {
        return Err(DecodeError(format!("bad child count {count}")));
    }
    let mut int = Interior {
        height: header.height,
        pivots: Vec::with_capacity(count - 1),
        children: Vec::with_capacity(count),
        buffers: Vec::with_capacity(count),
        partial: None,
    };
    let mut partial = PartialPoints {
        children: Vec::with_capacity(count),
    };
    for _ in 1..count {
        int.pivots.push(unlift(prefix, d.bytes()?));
    }
    if !strictly_increasing(&int.pivots) {
        return Err(DecodeError("pivots out of order".into()));
    }
    // Segments lie after the meta, in order, within the node.
    let mut next_offset = meta_end(header) as u64;
    for _ in 0..count {
        int.children.push(d.u64()?);
        let mut buffer = MessageBuffer::default();
        let ranges = d.varint()?;
        for _ in 0..ranges {
            let start = unlift(prefix, d.bytes()?);
            let end = unlift(prefix, d.bytes()?);
            let seq = d.varint()?;
            buffer.push_decoded_range(start, RangeDel { end, seq });
        }
        int.buffers.push(Arc::new(buffer));
        let n = d.varint()? as usize;
        if n > d.remaining() {
            return Err(DecodeError(format!("bad segment count {n}")));
        }
        let mut segments = Segments {
            pivots: Vec::with_capacity(n.saturating_sub(1)),
            segments: Vec::with_capacity(n),
        };
        for j in 0..n {
            let (pivot, loc, points) = decode_part_entry(d, prefix, j == 0)?;
            segments.pivots.extend(pivot);
            if u64::from(loc.offset) != next_offset
                || u64::from(loc.offset) + u64::from(loc.len) > u64::from(header.total_len)
                || points == 0
                || points > loc.len as usize
            {
                return Err(DecodeError(format!(
                    "segment {j} of child {} lies outside its place",
                    int.children.len() - 1
                )));
            }
            next_offset += u64::from(loc.len);
            segments.segments.push(Segment {
                loc,
                count: points,
                points: None,
            });
        }
        if !strictly_increasing(&segments.pivots) {
            return Err(DecodeError("segment pivots out of order".into()));
        }
        partial.children.push(segments);
    }
    if next_offset != u64::from(header.total_len) {
        return Err(DecodeError("node length and its segments disagree".into()));
    }
    if partial.children.iter().any(|c| !c.segments.is_empty()) {
        int.partial = Some(Box::new(partial));
    }
    Ok(int)
}

/// Decodes one segment of an interior node's point messages from its
/// bytes (already cut to `segment.loc.len`), checking that its keys lie
/// in `range` (the segment's, within its child's) in increasing order.
pub fn decode_segment(
    bytes: &[u8],
    segment: &Segment,
    range: &Bounds,
    prefix: &[u8],
) -> DecodeResult<MessageBuffer> {
    if crc32c_of(&[bytes]) != segment.loc.crc {
        return Err(DecodeError(format!(
            "segment at offset {} fails its checksum",
            segment.loc.offset
        )));
    }
    let mut d = Decoder::new(bytes);
    let mut points = Vec::with_capacity(segment.count.min(bytes.len()));
    let mut previous: Option<&[u8]> = None;
    for _ in 0..segment.count {
        let suffix = d.bytes()?;
        let key = unlift(prefix, suffix);
        // Every key shares the prefix, so suffix order is key order.
        if previous.is_some_and(|p| p >= suffix) || !range.contains(&key) {
            return Err(DecodeError(format!(
                "segment at offset {} holds a key out of order or out of its range",
                segment.loc.offset
            )));
        }
        let base = match d.u8()? {
            0 => None,
            1 => Some(Base::Put {
                seq: d.varint()?,
                value: d.bytes()?.to_vec().into(),
            }),
            2 => Some(Base::Delete { seq: d.varint()? }),
            b => return Err(DecodeError(format!("bad base tag {b}"))),
        };
        let n = d.varint()?;
        if n > d.remaining() as u64 {
            return Err(DecodeError("bad upsert count".into()));
        }
        let mut upserts = Vec::with_capacity(n as usize);
        for _ in 0..n {
            upserts.push(Upsert {
                seq: d.varint()?,
                func: d.u8()?,
                arg: d.bytes()?.to_vec().into(),
            });
        }
        previous = Some(suffix);
        points.push((key, PointMsg { base, upserts }));
    }
    if !d.is_empty() {
        return Err(DecodeError(format!(
            "trailing bytes in the segment at offset {}",
            segment.loc.offset
        )));
    }
    let mut buffer = MessageBuffer::default();
    buffer.put_points_in_order(points);
    Ok(buffer)
}

/// Decodes segment `j` of child `i` of a partly read interior node with
/// bounds `bounds` from `node_bytes`, the node's image from byte `base`
/// of its extent on, and keeps it in the node.
pub fn load_segment(
    int: &mut Interior,
    (i, j): (usize, usize),
    bounds: &Bounds,
    node_bytes: &[u8],
    base: usize,
) -> DecodeResult<()> {
    let child = int.child_bounds(i, bounds);
    let prefix = bounds.lifted_prefix();
    let Some(segments) = int.partial.as_mut().and_then(|p| p.children.get_mut(i)) else {
        return Err(DecodeError(format!("no segments for child {i}")));
    };
    let range = segments.segment_bounds(j, &child);
    let Some(segment) = segments.segments.get_mut(j) else {
        return Err(DecodeError(format!("no segment {j} of child {i}")));
    };
    let start = (segment.loc.offset as usize)
        .checked_sub(base)
        .ok_or_else(|| DecodeError("segment before the bytes read".into()))?;
    let bytes = node_bytes
        .get(start..start + segment.loc.len as usize)
        .ok_or_else(|| DecodeError("segment past the bytes read".into()))?;
    segment.points = Some(decode_segment(bytes, segment, &range, &prefix)?);
    Ok(())
}

/// Decodes a whole node from its image (`node_bytes`, from the start of
/// its extent): the meta, then every basement of a leaf or every segment
/// of an interior node.
pub fn decode_node(header: &NodeHeader, node_bytes: &[u8], bounds: &Bounds) -> DecodeResult<Node> {
    let meta = node_bytes
        .get(HEADER_BYTES..meta_end(header))
        .ok_or_else(|| DecodeError("meta beyond the node".into()))?;
    let mut node = decode_meta(header, meta, bounds)?;
    let prefix = bounds.lifted_prefix();
    match &mut node.body {
        NodeBody::Leaf(leaf) => {
            for i in 0..leaf.basements.len() {
                let range = crate::validate::basement_bounds(leaf, i, bounds);
                let Some(b) = leaf.basements.get_mut(i) else {
                    break;
                };
                let loc = b
                    .loc
                    .ok_or_else(|| DecodeError("basement without location".into()))?;
                if let Some(dir) = &b.dir {
                    check_chunks(node_bytes, &loc, dir, b.count, &prefix, &range)?;
                }
                let entries =
                    decode_basement_at(node_bytes, &loc, b.dir.as_ref(), b.count, &prefix)?;
                b.set_entries(Arc::new(entries));
            }
        }
        NodeBody::Interior(int) => load_all_segments(int, bounds, node_bytes)?,
    }
    Ok(node)
}

/// Loads every segment of a partly read interior node from its whole
/// image and makes it whole.
pub fn load_all_segments(
    int: &mut Interior,
    bounds: &Bounds,
    node_bytes: &[u8],
) -> DecodeResult<()> {
    let all = int
        .partial
        .as_ref()
        .map(|p| p.all_segments())
        .unwrap_or_default();
    for at in all {
        load_segment(int, at, bounds, node_bytes, 0)?;
    }
    int.make_whole().map_err(DecodeError)
}

/// Checks the chunk directory `dir` of the basement at `loc` (whose keys
/// lie in `range`) in a whole node image, and every chunk it names: what
/// a read below the basement would find (a whole read does not need the
/// directory, so verify and decoders of whole images check it here).
pub fn check_chunks(
    node_bytes: &[u8],
    loc: &BasementLoc,
    dir: &ChunkDirLoc,
    count: usize,
    prefix: &[u8],
    range: &Bounds,
) -> DecodeResult<ChunkDir> {
    let at = loc.offset as usize + loc.len as usize;
    let bytes = node_bytes
        .get(at..at + dir.len as usize)
        .ok_or_else(|| DecodeError("chunk directory beyond node".into()))?;
    let chunks = decode_dir(bytes, dir, loc, count, prefix)?;
    chunks.check_within(range).map_err(DecodeError)?;
    for (j, chunk) in chunks.locs.iter().enumerate() {
        let at = chunk.offset as usize;
        let bytes = node_bytes
            .get(at..at + chunk.len as usize)
            .ok_or_else(|| DecodeError("chunk beyond node".into()))?;
        let entries = chunks.decode_chunk(j, bytes, prefix)?;
        crate::validate::check_basement(&entries, &chunks.chunk_bounds(j, range))
            .map_err(DecodeError)?;
    }
    Ok(chunks)
}

/// Decodes one basement's bytes (already cut to `loc.len`), copying them:
/// a basement with no chunk directory (one run of entries).
pub fn decode_basement(
    bytes: &[u8],
    loc: &BasementLoc,
    count: usize,
    prefix: &[u8],
) -> DecodeResult<Entries> {
    copy_basement(bytes, None, loc, count, prefix)
}

/// A basement's entries (one run, or the chunks `dir` names), copied out
/// of `area`, its bytes.
fn copy_basement(
    area: &[u8],
    dir: Option<(&[u8], &ChunkDirLoc)>,
    loc: &BasementLoc,
    count: usize,
    prefix: &[u8],
) -> DecodeResult<Entries> {
    let mut entries = Entries::with_capacity(
        count.min(area.len()),
        area.len() + count.min(area.len()) * prefix.len(),
    );
    walk_basement(area, dir, loc, count, prefix, |suffix, value| {
        entries.push_parts(prefix, suffix, value);
        Ok(())
    })?;
    Ok(entries)
}

/// Decodes the basement at `loc` (with its chunk directory `dir`, if it
/// has one) from a node's image `node_bytes`, copying it.
pub fn decode_basement_at(
    node_bytes: &[u8],
    loc: &BasementLoc,
    dir: Option<&ChunkDirLoc>,
    count: usize,
    prefix: &[u8],
) -> DecodeResult<Entries> {
    let (area, dir) = basement_bytes(node_bytes, 0, loc, dir)?;
    copy_basement(area, dir, loc, count, prefix)
}

/// The bytes of the basement at `loc`, and of its chunk directory `dir`
/// (right after it), in `bytes` — the node's image from byte `bytes_at`
/// of its extent on.
#[allow(clippy::type_complexity)]
fn basement_bytes<'b>(
    bytes: &'b [u8],
    bytes_at: usize,
    loc: &BasementLoc,
    dir: Option<&'b ChunkDirLoc>,
) -> DecodeResult<(&'b [u8], Option<(&'b [u8], &'b ChunkDirLoc)>)> {
    let start = (loc.offset as usize)
        .checked_sub(bytes_at)
        .ok_or_else(|| DecodeError("basement before the bytes read".into()))?;
    let end = start + loc.len as usize;
    let area = bytes
        .get(start..end)
        .ok_or_else(|| DecodeError("basement beyond the bytes read".into()))?;
    let dir = match dir {
        None => None,
        Some(d) => Some((
            bytes
                .get(end..end + d.len as usize)
                .ok_or_else(|| DecodeError("chunk directory beyond the bytes read".into()))?,
            d,
        )),
    };
    Ok((area, dir))
}

/// Entries of at least this many bytes on average (values, in effect: a
/// data leaf's blocks) are left in the bytes they were read into;
/// smaller ones are copied. With small values the image saves little
/// copying and costs the cache more memory than a copy: the keys are held
/// twice (copied out, and in the image), and the image is counted by its
/// blocks and its allocation's class — some 7-20% more for a basement of
/// metadata entries or of kv-bench's 255-byte values, and so fewer of
/// them cached (docs/benchmarks/values-where-read.md).
pub const IMAGE_MIN_ENTRY_BYTES: usize = 1024;

/// Decodes the basement at `loc` (with its chunk directory `dir`, if it
/// has one) of a leaf read into `image` from byte `image_at` of its
/// extent on. If its entries are large (at least [`IMAGE_MIN_ENTRY_BYTES`]
/// on average) its keys are copied and its values stay in the image
/// ([`Entries::in_image`]), which the entries answer for in proportion to
/// the basement's share of it; otherwise it is copied whole.
pub fn decode_basement_in_image(
    image: &Arc<AlignedBuf>,
    image_at: usize,
    loc: &BasementLoc,
    dir: Option<&ChunkDirLoc>,
    count: usize,
    prefix: &[u8],
) -> DecodeResult<Entries> {
    let (bytes, dir_bytes) = basement_bytes(image, image_at, loc, dir)?;
    if bytes.len() < count.saturating_mul(IMAGE_MIN_ENTRY_BYTES) {
        return copy_basement(bytes, dir_bytes, loc, count, prefix);
    }
    // Its blocks, scaled by what the allocation holds past the bytes read.
    let span = round_block(bytes.len());
    let charged = span.saturating_mul(image.capacity()) / image.len().max(1);
    let mut entries = Entries::in_image(
        image.clone(),
        charged,
        count.min(bytes.len()),
        count.min(bytes.len()) * (prefix.len() + 16),
    );
    let base = image.as_ptr() as usize;
    walk_basement(bytes, dir_bytes, loc, count, prefix, |suffix, value| {
        // `value` is a slice of `bytes`, which lies in the image.
        let at = value.as_ptr() as usize - base;
        if entries.push_read(prefix, suffix, at, value.len()) {
            Ok(())
        } else {
            Err(DecodeError("value beyond the bytes read".into()))
        }
    })?;
    Ok(entries)
}

/// Checks a basement's bytes against its checksum and walks its entries
/// in order — one run, or the chunks its directory `dir` names — giving
/// each key suffix and value to `push`; checks their order and count.
fn walk_basement<'b>(
    bytes: &'b [u8],
    dir: Option<(&[u8], &ChunkDirLoc)>,
    loc: &BasementLoc,
    count: usize,
    prefix: &[u8],
    mut push: impl FnMut(&[u8], &'b [u8]) -> DecodeResult<()>,
) -> DecodeResult<()> {
    if crc32c_of(&[bytes]) != loc.crc {
        return Err(DecodeError(format!(
            "basement at offset {} fails its checksum",
            loc.offset
        )));
    }
    if let Some((dir_bytes, dir)) = dir {
        let chunks = decode_dir(dir_bytes, dir, loc, count, prefix)?;
        return parse_chunked(bytes, &chunks, loc.offset, count, push);
    }
    let mut n = 0;
    parse_run(bytes, |suffix, value| {
        n += 1;
        push(suffix, value)
    })?;
    if n != count {
        return Err(DecodeError(format!(
            "basement holds {n} entries, meta says {count}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::merge::MergeRegistry;

    fn round_trip(node: &Node, num: u64) -> Node {
        let img = encode_node(node, num);
        let h = decode_header(&img.buf, img.crc, num, &node.bounds).unwrap();
        assert_eq!(h.total_len, img.len);
        decode_node(&h, &img.buf, &node.bounds).unwrap()
    }

    fn lifted_leaf() -> Node {
        let bounds = Bounds {
            lo: b"dir\x00a".to_vec(),
            hi: Some(b"dir\x00z".to_vec()),
        };
        let mut entries = Entries::default();
        for i in 0..300u32 {
            entries.push(
                format!("dir\x00f{i:05}").as_bytes(),
                &vec![i as u8; (i % 50) as usize],
            );
        }
        Node {
            body: NodeBody::Leaf(Leaf::from_sorted(&entries, 2000)),
            bounds,
            tree: 1,
            dirty: true,
            last_used: Default::default(),
        }
    }

    #[test]
    fn leaf_round_trip_with_lifting() {
        let node = lifted_leaf();
        assert_eq!(node.bounds.lifted_prefix(), b"dir\x00");
        let back = round_trip(&node, 9);
        let (NodeBody::Leaf(a), NodeBody::Leaf(b)) = (&node.body, &back.body) else {
            panic!()
        };
        assert_eq!(a.pivots, b.pivots);
        let ea: Vec<_> = a
            .basements
            .iter()
            .map(|x| x.entries.clone().unwrap())
            .collect();
        let eb: Vec<_> = b
            .basements
            .iter()
            .map(|x| x.entries.clone().unwrap())
            .collect();
        assert_eq!(ea, eb);
        // Stored keys omit the prefix: the image has no "dir\0f" runs.
        let img = encode_node(&node, 9);
        assert!(!img.buf.windows(5).any(|w| w == b"dir\x00f"));
    }

    /// A leaf's basements decoded in the bytes they were read into hold
    /// what copied ones do, from a read of the whole leaf or of a span
    /// starting at a basement; a length past the bytes read is refused;
    /// and a change to the leaf leaves every basement owning its values
    /// (none holds the read bytes the others would keep uncounted).
    #[test]
    fn basements_decoded_in_their_image_are_the_copied_ones_until_changed() {
        // Small entries are copied, not left in the image.
        let small = lifted_leaf();
        let img = encode_node(&small, 9);
        let h = decode_header(&img.buf, img.crc, 9, &small.bounds).unwrap();
        let read = decode_meta(&h, &img.buf[HEADER_BYTES..meta_end(&h)], &small.bounds).unwrap();
        let NodeBody::Leaf(leaf) = &read.body else {
            panic!("a leaf decodes as a leaf")
        };
        let whole = Arc::new(AlignedBuf::from_slice(&img.buf));
        let b = &leaf.basements[0];
        let prefix = small.bounds.lifted_prefix();
        let e =
            decode_basement_in_image(&whole, 0, &b.loc.unwrap(), b.dir.as_ref(), b.count, &prefix)
                .unwrap();
        assert!(
            !e.in_read_image(),
            "entries under {IMAGE_MIN_ENTRY_BYTES} bytes are copied"
        );
        // Large entries (a data leaf's blocks) stay in it.
        let mut entries = Entries::default();
        for i in 0..40u32 {
            entries.push(
                format!("dir\x00f{i:05}").as_bytes(),
                &vec![i as u8; 1500 + i as usize],
            );
        }
        let node = Node {
            body: NodeBody::Leaf(Leaf::from_sorted(&entries, 8000)),
            ..lifted_leaf()
        };
        let img = encode_node(&node, 9);
        let h = decode_header(&img.buf, img.crc, 9, &node.bounds).unwrap();
        let meta = &img.buf[HEADER_BYTES..meta_end(&h)];
        let mut read = decode_meta(&h, meta, &node.bounds).unwrap();
        let NodeBody::Leaf(leaf) = &mut read.body else {
            panic!("a leaf decodes as a leaf")
        };
        assert!(leaf.basements.len() > 2, "the test needs several basements");
        let prefix = node.bounds.lifted_prefix();
        let whole = Arc::new(AlignedBuf::from_slice(&img.buf));
        let second = leaf.basements[1].loc.unwrap().offset as usize;
        let from_second = Arc::new(AlignedBuf::from_slice(&img.buf[second..]));
        for (i, b) in leaf.basements.iter_mut().enumerate() {
            let loc = b.loc.unwrap();
            let bytes = &img.buf[loc.offset as usize..(loc.offset + loc.len) as usize];
            let copied = decode_basement(bytes, &loc, b.count, &prefix).unwrap();
            let in_whole =
                decode_basement_in_image(&whole, 0, &loc, b.dir.as_ref(), b.count, &prefix)
                    .unwrap();
            assert!(in_whole.in_read_image() && !copied.in_read_image());
            assert_eq!(in_whole, copied);
            assert_eq!(in_whole.bytes(), copied.bytes());
            assert!(
                in_whole.mem_bytes() >= loc.len as usize,
                "the bytes read are counted"
            );
            if i > 0 {
                let in_span = decode_basement_in_image(
                    &from_second,
                    second,
                    &loc,
                    b.dir.as_ref(),
                    b.count,
                    &prefix,
                )
                .unwrap();
                assert_eq!(in_span, copied);
            } else {
                assert!(decode_basement_in_image(
                    &from_second,
                    second,
                    &loc,
                    b.dir.as_ref(),
                    b.count,
                    &prefix
                )
                .is_err());
            }
            let past = BasementLoc {
                len: (whole.len() - loc.offset as usize + 1) as u32,
                ..loc
            };
            assert!(
                decode_basement_in_image(&whole, 0, &past, b.dir.as_ref(), b.count, &prefix)
                    .is_err()
            );
            b.entries = Some(Arc::new(in_whole));
        }
        let mut model: std::collections::BTreeMap<Vec<u8>, Vec<u8>> = leaf
            .basements
            .iter()
            .flat_map(|b| b.entries.as_deref().unwrap().iter())
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        let merges = MergeRegistry::default();
        let mut buffer = MessageBuffer::default();
        let key = b"dir\x00f00015".to_vec();
        buffer.insert_point(key.clone(), PointMsg::put(1000, b"new".to_vec()), &merges);
        model.insert(key, b"new".to_vec());
        leaf.apply_buffer(buffer, &merges, 8000).unwrap();
        assert!(leaf
            .basements
            .iter()
            .all(|b| !b.entries.as_deref().unwrap().in_read_image()));
        let after: Vec<(Vec<u8>, Vec<u8>)> = leaf
            .basements
            .iter()
            .flat_map(|b| b.entries.as_deref().unwrap().iter())
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        assert_eq!(after, model.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn interior_round_trip() {
        let merges = MergeRegistry::default();
        let mut int = Interior {
            height: 2,
            pivots: vec![b"m".to_vec()],
            children: vec![4, 5],
            buffers: vec![Default::default(), Default::default()],
            partial: None,
        };
        int.insert_range_delete(b"c", b"q", 3, &Bounds::full());
        int.insert_point(b"a".to_vec(), PointMsg::put(4, b"v".to_vec()), &merges);
        int.insert_point(b"z".to_vec(), PointMsg::upsert(5, 1, vec![0, 1]), &merges);
        int.insert_point(b"y".to_vec(), PointMsg::delete(6), &merges);
        let node = Node {
            body: NodeBody::Interior(int.clone()),
            bounds: Bounds::full(),
            tree: 0,
            dirty: true,
            last_used: Default::default(),
        };
        let back = round_trip(&node, 3);
        let NodeBody::Interior(b) = back.body else {
            panic!()
        };
        assert_eq!(
            (b.pivots, b.children, b.buffers),
            (int.pivots, int.children, int.buffers)
        );
    }

    /// A leaf of large basements, cut into chunks: file blocks of 4 KiB
    /// and small entries between them.
    fn chunked_leaf() -> Node {
        let mut entries = Entries::default();
        for i in 0..200u32 {
            let len = if i % 3 == 0 { 100 + i as usize } else { 4096 };
            entries.push(format!("dir\x00f{i:05}").as_bytes(), &vec![i as u8; len]);
        }
        Node {
            body: NodeBody::Leaf(Leaf::from_sorted(&entries, 128 << 10)),
            ..lifted_leaf()
        }
    }

    #[test]
    fn chunks_hold_their_basements_entries_in_order() {
        let node = chunked_leaf();
        let img = encode_node(&node, 9);
        let prefix = node.bounds.lifted_prefix();
        let NodeBody::Leaf(leaf) = &node.body else {
            unreachable!()
        };
        let mut chunked = 0;
        for (b, (loc, dir)) in leaf.basements.iter().zip(&img.basement_locs) {
            let entries = b.entries.as_deref().unwrap();
            let Some(dir) = dir else {
                assert!(loc.len as usize <= crate::chunks::CHUNKED_BASEMENT_MIN_BYTES);
                continue;
            };
            chunked += 1;
            let chunks = check_chunks(&img.buf, loc, dir, b.count, &prefix, &node.bounds).unwrap();
            let mut at = 0;
            for (j, (chunk, n)) in chunks.locs.iter().zip(&chunks.counts).enumerate() {
                let bytes = &img.buf[chunk.offset as usize..(chunk.offset + chunk.len) as usize];
                let got = chunks.decode_chunk(j, bytes, &prefix).unwrap();
                match n {
                    // A raw value: a block of 4 KiB lies on a block of
                    // the node.
                    None => {
                        assert!(got.value(0).len() >= crate::chunks::RAW_VALUE_MIN_BYTES);
                        if chunk.len % 4096 == 0 {
                            assert_eq!(chunk.offset % 4096, 0);
                        }
                    }
                    Some(_) => assert!(chunk.len as usize <= crate::chunks::CHUNK_BYTES),
                }
                let want: Vec<_> = entries.iter().skip(at).take(got.len()).collect();
                assert_eq!(got.iter().collect::<Vec<_>>(), want);
                assert_eq!(chunks.keys[j], entries.key(at));
                for (k, _) in got.iter() {
                    assert_eq!(chunks.chunk_for(k), j);
                }
                at += got.len();
            }
            assert_eq!(at, entries.len());
            // Read whole, through the directory, the same entries.
            let whole = decode_basement_at(&img.buf, loc, Some(dir), b.count, &prefix).unwrap();
            assert_eq!(&whole, entries);
        }
        assert!(chunked >= 2, "{chunked} basements chunked");
    }

    #[test]
    fn every_flipped_byte_is_caught() {
        for node in [lifted_leaf(), chunked_leaf()] {
            every_flipped_byte_of_a_leaf_is_caught(node);
        }
    }

    fn every_flipped_byte_of_a_leaf_is_caught(node: Node) {
        let img = encode_node(&node, 9);
        let prefix = node.bounds.lifted_prefix();
        let step = (img.len as usize / 300).max(1);
        for at in (0..img.len as usize).step_by(step) {
            let mut bad = img.buf.to_vec();
            bad[at] ^= 0x10;
            let result = decode_header(&bad, img.crc, 9, &node.bounds).and_then(|h| {
                let mut n = decode_meta(&h, &bad[HEADER_BYTES..meta_end(&h)], &node.bounds)?;
                if let NodeBody::Leaf(leaf) = &mut n.body {
                    for b in &mut leaf.basements {
                        let loc = b.loc.unwrap();
                        decode_basement_at(&bad, &loc, b.dir.as_ref(), b.count, &prefix)?;
                        if let Some(dir) = &b.dir {
                            check_chunks(&bad, &loc, dir, b.count, &prefix, &node.bounds)?;
                        }
                    }
                }
                Ok(())
            });
            // Padding bytes are not covered by any checksum and are never read.
            let in_padding = {
                let NodeBody::Leaf(leaf) = &node.body else {
                    unreachable!()
                };
                let meta_end = HEADER_BYTES
                    + decode_header(&img.buf, img.crc, 9, &node.bounds)
                        .unwrap()
                        .meta_len as usize;
                let covered = at < meta_end
                    || img.basement_locs.iter().any(|(l, dir)| {
                        let end = l.offset + l.len + dir.map_or(0, |d| d.len);
                        (l.offset as usize..end as usize).contains(&at)
                    });
                let _ = leaf;
                !covered
            };
            assert_eq!(result.is_err(), !in_padding, "flip at {at}");
        }
        // Bounds the node was not written with are caught too, while the
        // same bounds under another prefix (a moved subtree) are not.
        let wrong = Bounds {
            lo: b"dir\x00b".to_vec(),
            hi: node.bounds.hi.clone(),
        };
        assert!(decode_header(&img.buf, img.crc, 9, &wrong).is_err());
        let unbounded = Bounds {
            lo: node.bounds.lo.clone(),
            hi: None,
        };
        assert!(decode_header(&img.buf, img.crc, 9, &unbounded).is_err());
        let moved = Bounds {
            lo: b"elsewhere/dir\x00a".to_vec(),
            hi: Some(b"elsewhere/dir\x00z".to_vec()),
        };
        assert!(decode_header(&img.buf, img.crc, 9, &moved).is_ok());
        assert!(decode_header(&img.buf, img.crc, 8, &node.bounds).is_err());
    }
}
