//! Reading nodes: a node's header and meta, then the basements a query
//! needs (one IO for a span of them), checked against the bounds its parent
//! gives.

#![allow(clippy::indexing_slicing)] // see tree/mod.rs

use super::*;
use crate::chunks::{decode_dir, ReadBelow, CHUNKS_BEFORE_WHOLE, CHUNKS_PER_READ_MAX};

/// Reads `len` bytes of a node at height `height` from byte `at` of the
/// device, counted in the stats.
pub(super) fn read_node_bytes(
    device: &dyn Device,
    at: u64,
    len: usize,
    height: u32,
    stats: &Stats,
) -> EngineResult<AlignedBuf> {
    // SAFETY: `filled_by` hands over `n` writable bytes that nothing else
    // uses (what `read_at_uninit` needs), and `read_at_uninit` writes
    // every one of them when it succeeds (what `filled_by` needs).
    let buf = unsafe { AlignedBuf::filled_by(len, |ptr, n| device.read_at_uninit(ptr, n, at)) };
    counted_read(buf, 0, height, stats)
}

/// A node's bytes read (or the error), those past the first `known`
/// counted in the stats as read from the device.
fn counted_read(
    read: std::io::Result<AlignedBuf>,
    known: usize,
    height: u32,
    stats: &Stats,
) -> EngineResult<AlignedBuf> {
    let buf = read.map_err(|e| betreefs_store::StoreError::io("reading node", e))?;
    add(
        &stats.node_bytes_read[level(height)],
        buf.len().saturating_sub(known) as u64,
    );
    Ok(buf)
}

/// `head`, the first bytes of a node at byte `at` of the device, made
/// `len` bytes long (rounded up to whole blocks) by reading only the
/// bytes past it: a node's header block is read before its meta's length
/// is known, and reading the meta from the node's start again cost a
/// block per cold node (docs/design.md, "Warm upper levels").
pub(super) fn extend_node_read(
    device: &dyn Device,
    at: u64,
    head: AlignedBuf,
    len: usize,
    height: u32,
    stats: &Stats,
) -> EngineResult<AlignedBuf> {
    if len <= head.len() {
        return Ok(head);
    }
    let known = head.len();
    // SAFETY: `filled_by` hands over `n` writable bytes that nothing else
    // uses, `n` (`len` in whole blocks) more than `known`: the head is
    // copied into the first `known` (`head` is another buffer) and the
    // device writes the rest when it succeeds — every byte, as
    // `filled_by` needs.
    let buf = unsafe {
        AlignedBuf::filled_by(len, |ptr, n| {
            std::ptr::copy_nonoverlapping(head.as_ptr(), ptr, known);
            device.read_at_uninit(ptr.add(known), n - known, at + known as u64)
        })
    };
    counted_read(buf, known, height, stats)
}

impl Tree {
    pub(super) fn corrupt(ks: KeySpace, num: u64, reason: impl Into<String>) -> EngineError {
        EngineError::CorruptNode {
            tree: ks as u8,
            num,
            reason: reason.into(),
        }
    }

    pub(super) fn read_extent_bytes(
        &self,
        extent: Extent,
        offset: u64,
        len: usize,
        height: u32,
    ) -> EngineResult<AlignedBuf> {
        let at = self.layout.extent_offset(extent) + offset;
        read_node_bytes(self.device.as_ref(), at, len, height, &self.stats)
    }

    /// Node `num` if it is cached with what `want` needs loaded, reached
    /// under the bounds and at the height it was cached with: what
    /// [`Tree::load`] finds without changing anything but the node's LRU
    /// stamp (and counts as a hit). `None` when `load` would have work to
    /// do — or an error to report.
    pub(super) fn cached_for(
        &self,
        num: u64,
        bounds: &Bounds,
        want: Want<'_>,
        height: Option<u32>,
    ) -> Option<&Node> {
        let node = self.cache.get(&num)?;
        if node.bounds != *bounds || height.is_some_and(|h| h != node.height()) {
            return None;
        }
        match &node.body {
            NodeBody::Leaf(leaf) => {
                if !Self::leaf_holds(leaf, want) {
                    return None;
                }
            }
            NodeBody::Interior(int) if int.is_partial() => match want {
                Want::Key(key) if int.has_point_loaded(key) => {}
                Want::Range(lo, hi) if int.has_range_loaded(lo, hi) => {}
                _ => return None,
            },
            NodeBody::Interior(_) => {}
        }
        node.last_used.set(self.next_tick());
        add(&self.stats.cache_hits, 1);
        Some(node)
    }

    /// Makes sure node `num` is cached with what `want` needs loaded, and
    /// (when known) that it sits at `height`. `bounds` are the node's key
    /// range from its parent; its lifted prefix is only needed to read.
    pub(super) fn load(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        want: Want<'_>,
        height: Option<u32>,
    ) -> EngineResult<()> {
        if self.cached_for(num, bounds, want, height).is_some() {
            return Ok(());
        }
        if self
            .cache
            .get(&num)
            .is_some_and(|node| node.is_partial() && node.bounds != *bounds)
        {
            // Read in part, and reached under other bounds (a moved or
            // shared subtree): it is clean, so it is read again as any
            // uncached node, under the bounds it is reached with.
            drop(self.take(num));
        }
        if let Some(node) = self.cache.get(&num) {
            node.last_used.set(self.next_tick());
            if node.bounds != *bounds {
                // Reached where the node was not found before: its subtree
                // was moved by a range rename, or it is shared (a range
                // clone) and was last reached through another parent. It
                // is re-keyed if its bounds agree after the lifted
                // prefixes, as its image would decode; otherwise the
                // parent names the wrong node.
                if node.bounds.relative_check() != bounds.relative_check() {
                    return Err(Self::corrupt(
                        ks,
                        num,
                        format!(
                            "reached with bounds {bounds:?} but known with {:?}",
                            node.bounds
                        ),
                    ));
                }
                let mut node = self.take(num);
                node.move_to(bounds.clone());
                self.put(num, node);
                add(&self.stats.nodes_rekeyed, 1);
                return self.load(ks, num, bounds, want, height);
            }
            if let Some(h) = height.filter(|&h| h != node.height()) {
                return Err(Self::corrupt(
                    ks,
                    num,
                    format!("at height {} where {h} was expected", node.height()),
                ));
            }
            // Reached as cached but not a hit: basements or a segment
            // `want` needs are still on the device.
            add(&self.stats.cache_misses, 1);
            let mut node = self.take(num);
            let result = self.read_parts(ks, num, &mut node, want);
            self.put(num, node);
            return result;
        }
        add(&self.stats.cache_misses, 1);
        self.read_uncached(ks, num, bounds, Some(want), height)
    }

    /// Reads node `num`, not cached, and caches it with what `want` needs
    /// loaded — or, with `want` `None`, its header and meta alone: an
    /// interior node in part with no segment, a leaf with no basement
    /// (small interior nodes are read whole either way).
    pub(super) fn read_uncached(
        &mut self,
        ks: KeySpace,
        num: u64,
        bounds: &Bounds,
        want: Option<Want<'_>>,
        height: Option<u32>,
    ) -> EngineResult<()> {
        let Slot::OnDisk { extent, crc } = self.btt.get(num) else {
            return Err(Self::corrupt(ks, num, "referenced but never written"));
        };
        let mut whole = matches!(want, Some(Want::Whole));
        let first_len = if whole {
            extent.len as usize
        } else {
            (extent.len as usize).min(BLOCK_SIZE)
        };
        let at = self.layout.extent_offset(extent);
        let device = self.device.as_ref();
        let mut head = read_node_bytes(device, at, first_len, height.unwrap_or(0), &self.stats)?;
        let header = Self::checked_header(ks, num, &head, crc, bounds, extent.len, height)?;
        let extend =
            |head, len| extend_node_read(device, at, head, len, header.height, &self.stats);
        // An interior node is read in part only when it is large enough
        // for that to save reading.
        if !whole && !header.kind_leaf && extent.len as usize <= self.partial_read_min_bytes() {
            whole = true;
            head = extend(head, extent.len as usize)?;
        }
        head = extend(head, meta_end(&header))?;
        let mut node = Self::decode_node_meta(ks, num, &header, &head, bounds)?;
        if let (true, NodeBody::Interior(int)) = (whole, &mut node.body) {
            // The whole extent is in memory: its segments go into the
            // buffers before the node is checked, once, whole.
            load_all_segments(int, bounds, &head).map_err(|e| Self::corrupt(ks, num, e.0))?;
        }
        let max_seq = self.next_seq.saturating_sub(1);
        match &node.body {
            NodeBody::Interior(int) => {
                validate::check_interior(int, bounds, num, &self.merges, max_seq)
            }
            NodeBody::Leaf(leaf) => validate::check_leaf(leaf, bounds),
        }
        .map_err(|reason| Self::corrupt(ks, num, reason))?;
        add(&self.stats.nodes_read, 1);
        if !whole && node.is_partial() {
            add(&self.stats.interior_nodes_read_in_part, 1);
        }
        let result = match (whole, &mut node.body) {
            // The whole extent is in memory already: decode every basement
            // from it.
            (true, NodeBody::Leaf(leaf)) => {
                Self::decode_all_basements(ks, num, leaf, bounds, &Arc::new(head))
            }
            (true, NodeBody::Interior(_)) => Ok(()),
            (false, _) => match want {
                Some(want) => self.read_parts(ks, num, &mut node, want),
                None => Ok(()),
            },
        };
        result?;
        self.put(num, node);
        Ok(())
    }

    /// Decodes a node's header from the start of its extent (`extent_len`
    /// bytes) and checks it: its checksum against the block table's, its
    /// tree, its length and (when known) its height.
    pub(super) fn checked_header(
        ks: KeySpace,
        num: u64,
        bytes: &[u8],
        crc: u32,
        bounds: &Bounds,
        extent_len: u32,
        height: Option<u32>,
    ) -> EngineResult<NodeHeader> {
        let header = decode_header(bytes, crc, num, bounds)
            .map_err(|e: DecodeError| Self::corrupt(ks, num, e.0))?;
        if header.tree != ks as u8 {
            return Err(Self::corrupt(
                ks,
                num,
                format!("belongs to tree {}", header.tree),
            ));
        }
        if header.total_len > extent_len {
            return Err(Self::corrupt(ks, num, "longer than its extent"));
        }
        if let Some(h) = height.filter(|&h| h != header.height) {
            return Err(Self::corrupt(
                ks,
                num,
                format!("at height {} where {h} was expected", header.height),
            ));
        }
        Ok(header)
    }

    /// The node a checked header and the bytes holding its meta describe
    /// (basements not loaded).
    pub(super) fn decode_node_meta(
        ks: KeySpace,
        num: u64,
        header: &NodeHeader,
        bytes: &[u8],
        bounds: &Bounds,
    ) -> EngineResult<Node> {
        let meta = bytes
            .get(HEADER_BYTES..meta_end(header))
            .ok_or_else(|| Self::corrupt(ks, num, "meta beyond the node"))?;
        decode_meta(header, meta, bounds).map_err(|e| Self::corrupt(ks, num, e.0))
    }

    /// Decodes every basement of a leaf from the bytes of its whole extent,
    /// their values left in them.
    pub(super) fn decode_all_basements(
        ks: KeySpace,
        num: u64,
        leaf: &mut Leaf,
        bounds: &Bounds,
        node_bytes: &Arc<AlignedBuf>,
    ) -> EngineResult<()> {
        (0..leaf.basements.len()).try_for_each(|i| {
            let entries = Self::decode_checked_basement(ks, num, leaf, i, bounds, node_bytes, 0)?;
            leaf.basements[i].set_entries(Arc::new(entries));
            Ok(())
        })
    }

    /// Decodes basement `i` of a leaf with bounds `bounds` from `image`,
    /// the leaf's bytes from `image_at` of its extent on (its values left
    /// there), and checks that its keys lie in the basement's range.
    pub(super) fn decode_checked_basement(
        ks: KeySpace,
        num: u64,
        leaf: &Leaf,
        i: usize,
        bounds: &Bounds,
        image: &Arc<AlignedBuf>,
        image_at: usize,
    ) -> EngineResult<Entries> {
        let b = &leaf.basements[i];
        let Some(loc) = b.loc else {
            return Err(Self::corrupt(ks, num, "basement without location"));
        };
        let prefix = bounds.lifted_prefix();
        let entries =
            decode_basement_in_image(image, image_at, &loc, b.dir.as_ref(), b.count, &prefix)
                .map_err(|e| Self::corrupt(ks, num, e.0))?;
        validate::check_basement(&entries, &validate::basement_bounds(leaf, i, bounds))
            .map_err(|reason| Self::corrupt(ks, num, reason))?;
        Ok(entries)
    }

    /// Whether a cached leaf holds what `want` needs of it: the basements
    /// it covers, or for a key or a range within one basement the chunks
    /// of it read below that hold them.
    pub(super) fn leaf_holds(leaf: &Leaf, want: Want<'_>) -> bool {
        let mut span = Self::basement_span(leaf, want);
        let (first, last) = (*span.start(), *span.end());
        match want {
            Want::Key(key) => leaf.basements[first].holds_key(key),
            Want::Range(lo, hi) if first == last => leaf.basements[first].holds_range(lo, hi),
            _ => span.all(|i| leaf.basements[i].entries.is_some()),
        }
    }

    /// The basements `want` covers.
    pub(super) fn basement_span(leaf: &Leaf, want: Want<'_>) -> std::ops::RangeInclusive<usize> {
        let (first, last) = match want {
            Want::Whole => (0, leaf.basements.len() - 1),
            Want::Key(k) => (leaf.basement_for(k), leaf.basement_for(k)),
            Want::Range(s, e) => {
                let first = leaf.basement_for(s);
                let last = e.map_or(leaf.basements.len() - 1, |e| {
                    leaf.last_basement_before(e, first)
                });
                // A scan over more than one basement is read ahead to the
                // end of the leaf (in the same IO): a sequential reader
                // asks for the rest next. Small ranges read only what they
                // touch, so random reads stay cheap.
                (
                    first,
                    if last > first {
                        leaf.basements.len() - 1
                    } else {
                        last
                    },
                )
            }
        };
        first..=last
    }

    /// Interior nodes of at most this many bytes (a 64th of a node: 64
    /// KiB by default) are read whole even for a point query: reading the
    /// meta and a segment apart would save little and cost more IOs.
    fn partial_read_min_bytes(&self) -> usize {
        self.opts.node_size / 64
    }

    /// Reads what `want` needs of a node cached in part: basements of a
    /// leaf; of an interior node read in part, the segment holding a
    /// point query's key, those a range visit needs, or (wanted whole)
    /// every segment not loaded yet, after which it is whole.
    pub(super) fn read_parts(
        &self,
        ks: KeySpace,
        num: u64,
        node: &mut Node,
        want: Want<'_>,
    ) -> EngineResult<()> {
        let Node { body, bounds, .. } = node;
        let NodeBody::Interior(int) = body else {
            return self.read_basements(ks, num, node, want);
        };
        let Some(partial) = &int.partial else {
            return Ok(());
        };
        let wanted: Vec<(usize, usize)> = match want {
            Want::Key(key) => {
                let i = int.child_index(key);
                let j = partial.children.get(i).map_or(0, |c| c.segment_for(key));
                vec![(i, j)]
            }
            Want::Range(lo, hi) => {
                let (i, span) = int.segment_span(lo, hi);
                span.map(|j| (i, j)).collect()
            }
            Want::Whole => Vec::new(),
        };
        // A node whose segments are read one run after another (a scan,
        // or many lookups through it) is read whole once it has needed
        // more than a few (as 0.6 reads a leaf's basement alone or the
        // whole leaf by recent use): what changes or scans it next would
        // read the rest anyway, a run at a time.
        let complete = matches!(want, Want::Whole)
            || wanted.len() + partial.loaded_segments() > COMPLETE_AFTER_SEGMENTS;
        if complete {
            let all = partial.all_segments();
            match self.complete(ks, num, int, bounds, &all) {
                Ok(()) => return Ok(()),
                // A damaged segment: a query still reads what it needs,
                // and fails only if that is the damaged one.
                Err(_) if !matches!(want, Want::Whole) => {}
                Err(e) => return Err(e),
            }
        }
        self.read_segments(ks, num, int, bounds, &wanted)
    }

    /// Reads the segments an interior node read in part lacks (`all` of
    /// its segments) and makes it whole.
    fn complete(
        &self,
        ks: KeySpace,
        num: u64,
        int: &mut Interior,
        bounds: &Bounds,
        all: &[(usize, usize)],
    ) -> EngineResult<()> {
        // Each segment is checked as it is read, and the range deletes
        // were with the meta: the whole node needs no check of its own.
        self.read_segments(ks, num, int, bounds, all)?;
        int.make_whole()
            .map_err(|reason| Self::corrupt(ks, num, reason))?;
        add(&self.stats.interior_nodes_completed, 1);
        Ok(())
    }

    /// Reads and checks the segments `wanted` ((child, segment) pairs, in
    /// order) of interior node `num` (read in part) that are not loaded,
    /// in one IO (they lie in order, packed).
    fn read_segments(
        &self,
        ks: KeySpace,
        num: u64,
        int: &mut Interior,
        bounds: &Bounds,
        wanted: &[(usize, usize)],
    ) -> EngineResult<()> {
        let Some(partial) = &int.partial else {
            return Ok(());
        };
        let segment = |&(i, j): &(usize, usize)| {
            partial
                .children
                .get(i)
                .and_then(|c| c.segments.get(j))
                .filter(|s| s.points.is_none())
                .map(|s| ((i, j), s.loc))
        };
        let missing: Vec<((usize, usize), BasementLoc)> =
            wanted.iter().filter_map(segment).collect();
        let (Some((_, lo)), Some((_, hi))) = (missing.first(), missing.last()) else {
            return Ok(());
        };
        let Slot::OnDisk { extent, .. } = self.btt.get(num) else {
            return Err(Self::corrupt(ks, num, "partly loaded node has no extent"));
        };
        // Device reads are whole blocks: read the blocks the segments
        // overlap.
        let first = lo.offset as usize / BLOCK_SIZE * BLOCK_SIZE;
        let end = (hi.offset as usize + hi.len as usize).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        let end = end.min((extent.len as usize).div_ceil(BLOCK_SIZE) * BLOCK_SIZE);
        if first >= end {
            return Err(Self::corrupt(ks, num, "segment past its node"));
        }
        let bytes = self.read_extent_bytes(extent, first as u64, end - first, int.height)?;
        let max_seq = self.next_seq.saturating_sub(1);
        for ((i, j), _) in missing {
            load_segment(int, (i, j), bounds, &bytes, first)
                .map_err(|e| Self::corrupt(ks, num, e.0))?;
            add(&self.stats.segments_read, 1);
            // The segment's messages are checked as a whole node's are.
            if let Some(points) = int.segment_points(i, j..j + 1).next() {
                let child = int.child_bounds(i, bounds);
                validate::check_buffer(points, &child, &self.merges, max_seq)
                    .map_err(|reason| Self::corrupt(ks, num, reason))?;
            }
        }
        Ok(())
    }

    pub(super) fn read_basements(
        &self,
        ks: KeySpace,
        num: u64,
        node: &mut Node,
        want: Want<'_>,
    ) -> EngineResult<()> {
        let Node { body, bounds, .. } = node;
        let NodeBody::Leaf(leaf) = body else {
            return Ok(());
        };
        let Slot::OnDisk { extent, .. } = self.btt.get(num) else {
            return Err(Self::corrupt(ks, num, "partly loaded leaf has no extent"));
        };
        let at = self.layout.extent_offset(extent);
        let place = (ks, num, at, &*bounds);
        read_missing_basements(self.device.as_ref(), place, leaf, want, &self.stats)
    }
}

/// Reads the basements of `leaf` that `want` covers and are not loaded,
/// with one IO (basements lie in key order at increasing offsets of the
/// node's extent), and decodes them. `place` is the leaf's tree, number,
/// the byte offset of its extent, and its bounds. Needs no lock.
pub(super) fn read_missing_basements(
    device: &dyn Device,
    place: (KeySpace, u64, u64, &Bounds),
    leaf: &mut Leaf,
    want: Want<'_>,
    stats: &Stats,
) -> EngineResult<()> {
    let (ks, num, at, bounds) = place;
    let span = Tree::basement_span(leaf, want);
    if span.start() == span.end() && read_below_basement(device, place, leaf, want, stats)? {
        return Ok(());
    }
    let missing: Vec<usize> = span
        .filter(|&i| leaf.basements[i].entries.is_none())
        .collect();
    let mut locs = Vec::with_capacity(missing.len());
    for &i in &missing {
        let Some(loc) = leaf.basements[i].loc else {
            return Err(Tree::corrupt(ks, num, "basement without location"));
        };
        locs.push(loc);
    }
    let (Some(first), Some(last)) = (locs.first(), locs.last()) else {
        return Ok(());
    };
    // The last basement's chunk directory too: it names its chunks.
    let last_dir = missing
        .last()
        .and_then(|&i| leaf.basements[i].dir)
        .map_or(0, |d| d.len as u64);
    let lo = first.offset as u64;
    let hi = last.offset as u64 + last.len as u64 + last_dir;
    let in_order = locs
        .iter()
        .zip(locs.iter().skip(1))
        .all(|(a, b)| a.offset <= b.offset);
    if !in_order || hi < lo {
        return Err(Tree::corrupt(ks, num, "basements out of order"));
    }
    let buf = Arc::new(read_node_bytes(
        device,
        at + lo,
        (hi - lo) as usize,
        0,
        stats,
    )?);
    for &i in &missing {
        // Offsets are in order, but a damaged length could still run
        // past what was read: the decoder refuses it.
        let entries = Tree::decode_checked_basement(ks, num, leaf, i, bounds, &buf, lo as usize)?;
        leaf.basements[i].set_entries(Arc::new(entries));
    }
    Ok(())
}

/// Reads below the one basement `want` covers when that is what to do
/// (`chunks.rs`): a key, or a range within [`CHUNKS_PER_READ_MAX`]
/// chunks, of a basement not loaded that has a chunk directory and fewer
/// than [`CHUNKS_BEFORE_WHOLE`] chunks read. Reads the directory if it is
/// not cached yet, then the chunks needed (one IO), and keeps both in the
/// basement (whole once every chunk is read). Returns whether it did;
/// otherwise the caller reads the basement whole.
fn read_below_basement(
    device: &dyn Device,
    place: (KeySpace, u64, u64, &Bounds),
    leaf: &mut Leaf,
    want: Want<'_>,
    stats: &Stats,
) -> EngineResult<bool> {
    let (ks, num, at, bounds) = place;
    let (lo, hi) = match want {
        Want::Key(key) => (key, None),
        Want::Range(lo, hi) => (lo, Some(hi)),
        Want::Whole => return Ok(false),
    };
    let i = leaf.basement_for(lo);
    let range = validate::basement_bounds(leaf, i, bounds);
    let b = &leaf.basements[i];
    let (Some(loc), Some(dir_loc), None) = (b.loc, b.dir, &b.entries) else {
        return Ok(false);
    };
    if b.below.as_ref().map_or(0, |r| r.chunks.len()) >= CHUNKS_BEFORE_WHOLE {
        return Ok(false);
    }
    let corrupt = |e: DecodeError| Tree::corrupt(ks, num, e.0);
    let prefix = bounds.lifted_prefix();
    let below = match &b.below {
        Some(below) => (**below).clone(),
        None => {
            let dir_at = loc.offset as usize + loc.len as usize;
            let len = dir_loc.len as usize;
            let (buf, skip) = read_blocks_of(device, at, dir_at, len, stats)?;
            let bytes = buf
                .get(skip..skip + len)
                .ok_or_else(|| Tree::corrupt(ks, num, "chunk directory beyond the bytes read"))?;
            let dir = decode_dir(bytes, &dir_loc, &loc, b.count, &prefix).map_err(corrupt)?;
            dir.check_within(&range)
                .map_err(|reason| Tree::corrupt(ks, num, reason))?;
            add(&stats.chunk_dirs_read, 1);
            ReadBelow {
                dir: Arc::new(dir),
                chunks: Vec::new(),
            }
        }
    };
    // A point query's range is its key alone.
    let span = match hi {
        None => {
            let j = below.dir.chunk_for(lo);
            j..=j
        }
        Some(hi) => below.dir.span(lo, hi),
    };
    if span.clone().count() > CHUNKS_PER_READ_MAX {
        // Keep the directory: the next query of one chunk needs it.
        leaf.basements[i].below = Some(Arc::new(below));
        return Ok(false);
    }
    let missing: Vec<usize> = span.filter(|&j| below.chunk(j).is_none()).collect();
    let locs: Vec<(usize, BasementLoc)> = missing
        .iter()
        .filter_map(|&j| below.dir.locs.get(j).map(|l| (j, *l)))
        .collect();
    let mut read = ReadBelow {
        dir: below.dir.clone(),
        chunks: Vec::with_capacity(locs.len()),
    };
    if let (Some(&(_, first)), Some(&(_, last))) = (locs.first(), locs.last()) {
        let len = (last.offset + last.len - first.offset) as usize;
        let (buf, skip) = read_blocks_of(device, at, first.offset as usize, len, stats)?;
        for (j, chunk) in locs {
            let start = skip + (chunk.offset - first.offset) as usize;
            let bytes = buf
                .get(start..start + chunk.len as usize)
                .ok_or_else(|| Tree::corrupt(ks, num, "chunk beyond the bytes read"))?;
            let entries = below.dir.decode_chunk(j, bytes, &prefix).map_err(corrupt)?;
            validate::check_basement(&entries, &below.dir.chunk_bounds(j, &range))
                .map_err(|reason| Tree::corrupt(ks, num, reason))?;
            read.chunks.push((j, Arc::new(entries)));
            add(&stats.chunks_read, 1);
        }
    }
    let below = below.with(&read);
    match below.whole() {
        Some(entries) => leaf.basements[i].set_entries(Arc::new(entries)),
        None => leaf.basements[i].below = Some(Arc::new(below)),
    }
    Ok(true)
}

/// Reads the blocks of a node's extent (at byte `at` of the device) that
/// bytes [from, from + len) of it overlap: returns them and where byte
/// `from` lies in them.
fn read_blocks_of(
    device: &dyn Device,
    at: u64,
    from: usize,
    len: usize,
    stats: &Stats,
) -> EngineResult<(AlignedBuf, usize)> {
    let first = from / BLOCK_SIZE * BLOCK_SIZE;
    let end = (from + len).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    let buf = read_node_bytes(device, at + first as u64, end - first, 0, stats)?;
    Ok((buf, from - first))
}
