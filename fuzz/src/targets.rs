//! One target per decoder. Each takes arbitrary bytes, decodes them the
//! way betreefs does when it reads them from disk or the log, and must
//! never panic or allocate without bound: a bad input is a typed error.
//! Where a checksum guards the bytes, the target decodes them twice: as
//! given (the checksum rejects almost everything) and with the checksums
//! recomputed, so the parser behind the checksum — what a misdirected write
//! or a crafted image reaches — is exercised too.
//!
//! Seeds are real encodings: a small file system built through the engine,
//! crashed with a log to replay, and its superblocks, log, block table,
//! nodes, batches, records and keys.

use std::sync::{Arc, OnceLock};

use betreefs_engine::btt::{BlockTable, Slot};
use betreefs_engine::entries::Entries;
use betreefs_engine::format::{
    check_chunks, decode_basement_at, decode_basement_in_image, decode_header, decode_meta,
    decode_node, decode_segment, encode_node, HEADER_BYTES,
};
use betreefs_engine::node::{BasementLoc, Bounds, Leaf, Node, NodeBody, Segment};
use betreefs_engine::{validate, KeySpace, MergeRegistry, Message, Options, Store, WriteBatch};
use betreefs_fs::record::{FsInfo, Record};
use betreefs_fs::{schema, AtimePolicy, Caller, FileSystem, Operations, ROOT_INO};
use betreefs_store::{
    crc32c_of, replay_log, AlignedBuf, CrashMode, MemDevice, ReplayStart, Superblock, BLOCK_SIZE,
    LOG_RECORD_OVERHEAD_BYTES,
};

/// A fuzz target: its name, its seeds, and the function under test.
pub struct Target {
    pub name: &'static str,
    pub seeds: fn() -> Vec<Vec<u8>>,
    pub run: fn(&[u8]),
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "superblock",
        seeds: superblock_seeds,
        run: superblock,
    },
    Target {
        name: "log",
        seeds: log_seeds,
        run: log,
    },
    Target {
        name: "block-table",
        seeds: block_table_seeds,
        run: block_table,
    },
    Target {
        name: "node",
        seeds: node_seeds,
        run: node,
    },
    Target {
        name: "batch",
        seeds: batch_seeds,
        run: batch,
    },
    Target {
        name: "record",
        seeds: record_seeds,
        run: record,
    },
    Target {
        name: "key",
        seeds: key_seeds,
        run: key,
    },
    Target {
        name: "image",
        seeds: image_seeds,
        run: image,
    },
];

fn options() -> Options {
    Options {
        node_size: 32 << 10,
        basement_size: 4 << 10,
        cache_bytes: 1 << 20,
        log_flush_interval: None,
        checkpoint_interval: None,
        log_bytes: Some(1 << 20),
        ..Options::default()
    }
}

const ME: Caller = Caller::new(0, 0);

/// A small file system, crashed after a synced tail of work that only the
/// log holds: the seed every target draws from.
fn base_image() -> &'static Vec<u8> {
    static IMAGE: OnceLock<Vec<u8>> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let dev = MemDevice::new(16 << 20);
        let store = Store::create_on(Arc::new(dev.clone()), options()).expect("create");
        FileSystem::format(&store, ME).expect("format");
        let fs = FileSystem::mount(store, AtimePolicy::Noatime).expect("mount");
        let d = fs
            .mkdir(ROOT_INO, b"dir\x01", 0o755, ME)
            .expect("mkdir")
            .ino;
        for i in 0..150u32 {
            let parent = if i % 3 == 0 { ROOT_INO } else { d };
            let name = format!("f{i}\u{ff}");
            let (attr, fh) = fs
                .create(parent, name.as_bytes(), 0o644, 0, ME)
                .expect("create");
            let data = vec![i as u8; (i as usize * 97) % 9000];
            fs.write(attr.ino, fh, 0, &data, None).expect("write");
            fs.write(attr.ino, fh, 3, b"patch", None).expect("patch");
            fs.release(fh).expect("release");
            if i % 10 == 0 {
                fs.setxattr(attr.ino, b"user.k", &[i as u8; 40], 0)
                    .expect("xattr");
            }
            if i == 74 {
                // A clone of the directory so far: shared subtrees, so
                // the block table carries reference counts.
                let copy = fs.mkdir(ROOT_INO, b"copy", 0o755, ME).expect("mkdir").ino;
                fs.clone_tree_into(d, copy, ME).expect("clone");
            }
            if i == 75 {
                fs.store().checkpoint().expect("checkpoint");
            }
        }
        fs.link(
            fs.lookup(ROOT_INO, "f0\u{ff}".as_bytes())
                .expect("lookup")
                .ino,
            d,
            b"hard",
        )
        .expect("link");
        fs.symlink(d, b"sym", b"../f3", ME).expect("symlink");
        fs.rename(
            ROOT_INO,
            "f3\u{ff}".as_bytes(),
            d,
            b"moved",
            betreefs_fs::RenameFlags::default(),
        )
        .expect("rename");
        fs.fsync().expect("fsync");
        dev.power_off();
        let image = dev.crash_image(CrashMode::DropUnsynced);
        drop(fs);
        image
    })
}

fn newest(image: &[u8]) -> Superblock {
    Superblock::read_newest(&MemDevice::from_image(image.to_vec())).expect("superblock")
}

fn block_table_of(image: &[u8], sb: &Superblock) -> BlockTable {
    let at = sb.layout.extent_offset(sb.btt) as usize;
    BlockTable::decode(&image[at..at + sb.btt.len as usize]).expect("block table")
}

// ---- superblock --------------------------------------------------------

fn superblock_seeds() -> Vec<Vec<u8>> {
    let image = base_image();
    vec![
        image[..BLOCK_SIZE].to_vec(),
        image[BLOCK_SIZE..2 * BLOCK_SIZE].to_vec(),
    ]
}

fn superblock(data: &[u8]) {
    let mut block = data.to_vec();
    block.resize(BLOCK_SIZE, 0);
    let device_bytes = base_image().len() as u64;
    let _ = Superblock::decode_copy(&block, device_bytes);
    let crc = crc32c_of(&[&block[..BLOCK_SIZE - 4]]);
    block[BLOCK_SIZE - 4..].copy_from_slice(&crc.to_le_bytes());
    if let Ok(sb) = Superblock::decode_copy(&block, device_bytes) {
        // What decodes must encode back to itself.
        let again = sb.encode();
        assert_eq!(Superblock::decode_copy(&again, device_bytes), Ok(sb));
    }
}

// ---- log ---------------------------------------------------------------

/// Input: u32 epoch, u64 first sequence number, then the log region from
/// its head.
fn log_seeds() -> Vec<Vec<u8>> {
    let image = base_image();
    let sb = newest(image);
    let (offset, bytes) = (sb.layout.log_offset as usize, sb.layout.log_bytes as usize);
    let head = sb.log_head as usize % bytes;
    let mut region = image[offset + head..offset + bytes].to_vec();
    region.extend_from_slice(&image[offset..offset + head]);
    region.truncate(64 << 10);
    let mut seed = sb.log_epoch.to_le_bytes().to_vec();
    seed.extend_from_slice(&(sb.checkpoint_seq + 1).to_le_bytes());
    seed.extend_from_slice(&region);
    vec![seed]
}

/// Recomputes every record's checksum, walking by the lengths as written.
fn fix_log_checksums(region: &mut [u8]) {
    let mut pos = 0usize;
    while pos + LOG_RECORD_OVERHEAD_BYTES <= region.len() {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(&region[pos..pos + 4]);
        let len = u32::from_le_bytes(raw) as usize;
        let end = pos + LOG_RECORD_OVERHEAD_BYTES + len;
        if len == 0 || end > region.len() {
            return;
        }
        let crc = crc32c_of(&[&region[pos + 8..end]]);
        region[pos + 4..pos + 8].copy_from_slice(&crc.to_le_bytes());
        pos = end;
    }
}

fn log(data: &[u8]) {
    if data.len() < 12 {
        return;
    }
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&data[..4]);
    let epoch = u32::from_le_bytes(raw);
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&data[4..12]);
    let first_seq = u64::from_le_bytes(raw);
    let mut region = data[12..].to_vec();
    let len = region.len().div_ceil(BLOCK_SIZE).max(4) * BLOCK_SIZE;
    region.resize(len, 0);
    for fixed in [false, true] {
        if fixed {
            fix_log_checksums(&mut region);
        }
        let dev = MemDevice::from_image(region.clone());
        let start = ReplayStart {
            head: 0,
            epoch,
            first_seq,
            look_beyond: true,
        };
        let merges = MergeRegistry::default();
        let _ = replay_log(&dev, 0, len as u64, &start, |_, payload| {
            if let Ok(batch) = WriteBatch::decode(payload) {
                let _ = validate::check_batch(&batch, &merges);
            }
            Ok(())
        });
    }
}

// ---- block table ---------------------------------------------------------

fn block_table_seeds() -> Vec<Vec<u8>> {
    let image = base_image();
    let sb = newest(image);
    let at = sb.layout.extent_offset(sb.btt) as usize;
    vec![image[at..at + sb.btt.len as usize].to_vec()]
}

fn block_table(data: &[u8]) {
    if let Ok(table) = BlockTable::decode(data) {
        // Free slots are normalised, so compare one round later.
        let once = table.encode();
        let twice = BlockTable::decode(&once).expect("an encoded table decodes");
        assert_eq!(twice.encode(), once);
    }
}

// ---- node ----------------------------------------------------------------

/// Input: u8 prefix length, the lifted prefix, then the node's image.
fn node_seeds() -> Vec<Vec<u8>> {
    let image = base_image();
    let sb = newest(image);
    let table = block_table_of(image, &sb);
    let mut seeds = Vec::new();
    for ks in KeySpace::ALL {
        let mut todo = vec![(sb.roots[ks.index()], Bounds::full())];
        while let Some((num, bounds)) = todo.pop() {
            let Slot::OnDisk { extent, crc } = table.get(num) else {
                continue;
            };
            let at = sb.layout.extent_offset(extent) as usize;
            let bytes = &image[at..at + extent.len as usize];
            let prefix = bounds.lifted_prefix();
            let Ok(header) = decode_header(bytes, crc, num, &bounds) else {
                continue;
            };
            let meta = &bytes[HEADER_BYTES..HEADER_BYTES + header.meta_len as usize];
            if let Ok(node) = decode_meta(&header, meta, &bounds) {
                if let NodeBody::Interior(int) = &node.body {
                    for i in 0..int.children.len() {
                        todo.push((int.children[i], int.child_bounds(i, &bounds)));
                    }
                }
            }
            if prefix.len() < 256 {
                let mut seed = vec![prefix.len() as u8];
                seed.extend_from_slice(&prefix);
                seed.extend_from_slice(bytes);
                seeds.push(seed);
            }
        }
    }
    seeds.push(chunked_leaf_seed());
    seeds
}

/// A leaf of large basements, cut into chunks (runs of small entries and
/// raw values of 4 KiB): the image's basements are too small to have any.
fn chunked_leaf_seed() -> Vec<u8> {
    let prefix = b"d\x00".to_vec();
    let bounds = Bounds {
        lo: prefix.clone(),
        hi: Some([&prefix[..], &[0xff]].concat()),
    };
    let mut entries = Entries::default();
    for i in 0..60u32 {
        let len = if i % 4 == 0 { 50 + i as usize } else { 4096 };
        let key = [&prefix[..], format!("f{i:04}").as_bytes()].concat();
        entries.push(&key, &vec![i as u8; len]);
    }
    let node = Node {
        body: NodeBody::Leaf(Leaf::from_sorted(&entries, 64 << 10)),
        bounds,
        tree: KeySpace::Data as u8,
        dirty: true,
        last_used: Default::default(),
    };
    let img = encode_node(&node, 7);
    let mut seed = vec![prefix.len() as u8];
    seed.extend_from_slice(&prefix);
    seed.extend_from_slice(img.buf.get(..img.len as usize).unwrap_or_default());
    seed
}

fn field_u32(bytes: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(raw)
}

/// Makes the header's bounds fields (for `bounds`), meta checksum and
/// header checksum agree with the bytes.
fn fix_node_checksums(bytes: &mut [u8], bounds: &Bounds) {
    if bytes.len() < HEADER_BYTES {
        return;
    }
    let (lo_len, bounds_crc) = bounds.relative_check();
    bytes[12..16].copy_from_slice(&lo_len.to_le_bytes());
    bytes[16..20].copy_from_slice(&bounds_crc.to_le_bytes());
    let meta_len = field_u32(bytes, 20) as usize;
    if let Some(meta) = bytes.get(HEADER_BYTES..HEADER_BYTES.saturating_add(meta_len)) {
        let crc = crc32c_of(&[meta]);
        bytes[24..28].copy_from_slice(&crc.to_le_bytes());
    }
    let crc = crc32c_of(&[&bytes[..60]]);
    bytes[60..64].copy_from_slice(&crc.to_le_bytes());
}

fn node(data: &[u8]) {
    let Some((&plen, rest)) = data.split_first() else {
        return;
    };
    let Some((prefix, image)) = rest.split_at_checked(plen as usize) else {
        return;
    };
    let bounds = Bounds {
        lo: prefix.to_vec(),
        hi: Some([prefix, &[0xff]].concat()),
    };
    let merges = MergeRegistry::default();
    for fixed in [false, true] {
        let mut bytes = image.to_vec();
        if fixed {
            fix_node_checksums(&mut bytes, &bounds);
        }
        if bytes.len() < HEADER_BYTES {
            return;
        }
        // The block table's record of the header, and the number asked
        // for, as the header itself states them.
        let expect_crc = field_u32(&bytes, 60);
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&bytes[28..36]);
        let num = u64::from_le_bytes(raw);
        let Ok(header) = decode_header(&bytes, expect_crc, num, &bounds) else {
            continue;
        };
        let Some(meta) = bytes.get(HEADER_BYTES..HEADER_BYTES + header.meta_len as usize) else {
            continue;
        };
        let Ok(node) = decode_meta(&header, meta, &bounds) else {
            continue;
        };
        match &node.body {
            NodeBody::Interior(int) => {
                let _ = validate::check_interior(int, &bounds, num, &merges, u64::MAX);
                // Each segment alone (as a point query reads it), with the
                // stored checksum and with one that matches; then the
                // whole node.
                let children = int.partial.iter().flat_map(|p| p.children.iter());
                for (i, child) in children.enumerate() {
                    let child_bounds = int.child_bounds(i, &bounds);
                    for (j, segment) in child.segments.iter().enumerate() {
                        let (at, len) = (segment.loc.offset as usize, segment.loc.len as usize);
                        let Some(raw) = bytes.get(at..at + len) else {
                            continue;
                        };
                        let range = child.segment_bounds(j, &child_bounds);
                        for crc in [segment.loc.crc, crc32c_of(&[raw])] {
                            let segment = Segment {
                                loc: BasementLoc { crc, ..segment.loc },
                                count: segment.count,
                                points: None,
                            };
                            let _ = decode_segment(raw, &segment, &range, prefix);
                        }
                    }
                }
                if let Ok(whole) = decode_node(&header, &bytes, &bounds) {
                    if let NodeBody::Interior(int) = &whole.body {
                        let _ = validate::check_interior(int, &bounds, num, &merges, u64::MAX);
                    }
                }
            }
            NodeBody::Leaf(leaf) => {
                let _ = validate::check_leaf(leaf, &bounds);
                // The whole image as a read of the leaf leaves it, for
                // basements decoded in place.
                let image = Arc::new(AlignedBuf::from_slice(&bytes));
                for (i, b) in leaf.basements.iter().enumerate() {
                    let Some(loc) = b.loc else { continue };
                    let dir = b.dir.as_ref();
                    let Some(raw) = bytes.get(loc.offset as usize..(loc.offset + loc.len) as usize)
                    else {
                        // Past the bytes: decoding in the image refuses it.
                        let _ = decode_basement_in_image(&image, 0, &loc, dir, b.count, prefix);
                        continue;
                    };
                    // Its chunk directory and each chunk, as a read below
                    // the basement reads them.
                    if let Some(dir) = dir {
                        let range = validate::basement_bounds(leaf, i, &bounds);
                        let _ = check_chunks(&bytes, &loc, dir, b.count, prefix, &range);
                    }
                    // With the stored checksum, then with one that matches.
                    for crc in [loc.crc, crc32c_of(&[raw])] {
                        let loc = BasementLoc { crc, ..loc };
                        let copied = decode_basement_at(&bytes, &loc, dir, b.count, prefix);
                        // In the image (values left there when large):
                        // the same entries, or the same refusal.
                        let in_image =
                            decode_basement_in_image(&image, 0, &loc, dir, b.count, prefix);
                        assert_eq!(
                            copied.as_ref().ok(),
                            in_image.as_ref().ok(),
                            "a basement decoded in its image is not the one copied"
                        );
                        if let Ok(entries) = copied {
                            let range = validate::basement_bounds(leaf, i, &bounds);
                            let _ = validate::check_basement(&entries, &range);
                        }
                    }
                }
            }
        }
    }
}

// ---- batch ---------------------------------------------------------------

fn batch_seeds() -> Vec<Vec<u8>> {
    let image = base_image();
    let sb = newest(image);
    let mut seeds = Vec::new();
    let start = ReplayStart {
        head: sb.log_head,
        epoch: sb.log_epoch,
        first_seq: sb.checkpoint_seq + 1,
        look_beyond: false,
    };
    let dev = MemDevice::from_image(image.clone());
    let _ = replay_log(
        &dev,
        sb.layout.log_offset,
        sb.layout.log_bytes,
        &start,
        |_, payload| {
            if seeds.len() < 64 {
                seeds.push(payload.to_vec());
            }
            Ok(())
        },
    );
    let mut every = WriteBatch::new();
    every
        .put(KeySpace::Meta, b"k", b"v")
        .delete(KeySpace::Data, b"d")
        .upsert(
            KeySpace::Data,
            b"u",
            betreefs_engine::MERGE_PATCH,
            &betreefs_engine::merge::patch_arg(7, b"xyz"),
        )
        .upsert(
            KeySpace::Meta,
            b"r",
            betreefs_engine::MERGE_RECORD,
            &betreefs_engine::merge::record_arg(&[betreefs_engine::RecordOp::Add(1, 5)]),
        )
        .upsert(
            KeySpace::Data,
            b"t",
            betreefs_engine::MERGE_TRUNCATE,
            &betreefs_engine::merge::truncate_arg(3),
        )
        .range_delete(KeySpace::Data, b"a", b"z")
        .range_rename(KeySpace::Meta, b"p\x00", b"p\x02", 1, b"q");
    seeds.push(every.encode());
    seeds
}

fn batch(data: &[u8]) {
    let Ok(batch) = WriteBatch::decode(data) else {
        return;
    };
    let merges = MergeRegistry::default();
    assert_eq!(WriteBatch::decode(&batch.encode()).as_ref(), Ok(&batch));
    if validate::check_batch(&batch, &merges).is_err() {
        return;
    }
    // What the engine accepts, it can apply: upserts meet a value.
    for (_, m) in batch.messages() {
        if let Message::Upsert { func, arg, .. } = m {
            for old in [None, Some(&b"old value"[..])] {
                let v = merges.apply(func, old, &arg).expect("a checked function");
                assert!(v.len() <= betreefs_engine::MAX_VALUE_BYTES);
            }
        }
    }
}

// ---- file-system records and keys ---------------------------------------------

fn store_pairs(ks: KeySpace) -> Vec<(Vec<u8>, Vec<u8>)> {
    let ro = Options {
        read_only: true,
        ..options()
    };
    let store =
        Store::open_on(Arc::new(MemDevice::from_image(base_image().clone())), ro).expect("open");
    store
        .range(ks, b"", None)
        .collect::<Result<Vec<_>, _>>()
        .expect("scan")
}

fn record_seeds() -> Vec<Vec<u8>> {
    store_pairs(KeySpace::Meta)
        .into_iter()
        .map(|(_, v)| v)
        .filter(|v| !v.is_empty())
        .take(100)
        .collect()
}

fn record(data: &[u8]) {
    if let Ok(r) = Record::decode(data) {
        assert_eq!(Record::decode(&r.encode()), Ok(r));
    }
    if let Ok(info) = FsInfo::decode(data) {
        assert_eq!(FsInfo::decode(&info.encode()), Ok(info));
    }
}

fn key_seeds() -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> = store_pairs(KeySpace::Meta)
        .into_iter()
        .chain(store_pairs(KeySpace::Data))
        .map(|(k, _)| k)
        .collect();
    keys.truncate(200);
    keys
}

fn key(data: &[u8]) {
    if let Some((dir, name)) = schema::parse_entry_key(data) {
        assert_eq!(schema::entry_key(dir, &name), data);
        let _ = schema::child_name(dir, data);
        let sub = schema::child_dir_key(dir, &name);
        let _ = schema::dir_entry_key(&sub);
    }
    let _ = schema::parse_data_key(data);
    let _ = schema::dir_entry_key(data);
    let _ = schema::inode_key_ino(data);
    let _ = schema::orphan_ino(data);
    let _ = schema::check_name(data);
}

// ---- whole images --------------------------------------------------------

/// Input: patches of 5 bytes, u32 position and u8 mask, xored into the
/// base image at its live regions (superblocks, block table, nodes, log).
fn image_seeds() -> Vec<Vec<u8>> {
    (0u32..8)
        .map(|i| {
            let mut p = (i.wrapping_mul(2_654_435_761)).to_le_bytes().to_vec();
            p.push(1 << i);
            p
        })
        .collect()
}

/// The byte ranges of the base image worth damaging.
fn live_ranges() -> &'static Vec<(usize, usize)> {
    static RANGES: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    RANGES.get_or_init(|| {
        let image = base_image();
        let sb = newest(image);
        let table = block_table_of(image, &sb);
        let mut ranges = vec![(0, 2 * BLOCK_SIZE)];
        ranges.push((
            sb.layout.extent_offset(sb.btt) as usize,
            sb.btt.len as usize,
        ));
        for (_, e) in table.extents() {
            ranges.push((sb.layout.extent_offset(e) as usize, e.len as usize));
        }
        let log = (sb.layout.log_offset + sb.log_head % sb.layout.log_bytes) as usize;
        ranges.push((log, 64 << 10));
        ranges
    })
}

fn image(data: &[u8]) {
    let mut image = base_image().clone();
    let ranges = live_ranges();
    let total: usize = ranges.iter().map(|r| r.1).sum();
    for patch in data.chunks_exact(5).take(64) {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(&patch[..4]);
        let mut at = u32::from_le_bytes(raw) as usize % total;
        for &(start, len) in ranges {
            if at < len {
                if let Some(b) = image.get_mut(start + at) {
                    *b ^= patch[4];
                }
                break;
            }
            at -= len;
        }
    }
    // Half the inputs open as the mount daemon does, reading the upper
    // levels first (docs/design.md, "Warm upper levels").
    let warm_bytes = if data.len().is_multiple_of(2) {
        256 << 10
    } else {
        0
    };
    let options = Options {
        warm_bytes,
        ..options()
    };
    let Ok(store) = Store::open_on(Arc::new(MemDevice::from_image(image)), options) else {
        return;
    };
    let Ok(fs) = FileSystem::mount(store, AtimePolicy::Noatime) else {
        return;
    };
    // Read everything reachable; errors are fine, panics are not.
    let mut todo = vec![ROOT_INO];
    let mut seen = 0;
    while let Some(dir) = todo.pop() {
        let mut names = Vec::new();
        let _ = fs.readdir(dir, 0, true, &mut |e| {
            if e.name != b"." && e.name != b".." {
                names.push(e.name.to_vec());
            }
            false
        });
        for name in names {
            seen += 1;
            if seen > 2000 {
                return;
            }
            let Ok(attr) = fs.lookup(dir, &name) else {
                continue;
            };
            if attr.is_dir() {
                todo.push(attr.ino);
            } else {
                let _ = fs.read_to_vec(attr.ino, 0, attr.size.min(1 << 20) as u32);
                let _ = fs.listxattr(attr.ino);
                let _ = fs.readlink(attr.ino);
            }
        }
    }
    let _ = fs.store().verify();
    let _ = betreefs_fs::fsck::check(fs.store(), |_| {});
}

#[cfg(test)]
mod tests {
    use super::*;
    use betreefs_store::LOG_RECORD_HEADER_BYTES;

    #[test]
    fn every_seed_runs_clean() {
        for t in TARGETS {
            let seeds = (t.seeds)();
            assert!(!seeds.is_empty(), "{} has no seeds", t.name);
            for s in &seeds {
                (t.run)(s);
            }
        }
    }

    #[test]
    fn log_fixups_make_records_valid_again() {
        let seed = &log_seeds()[0];
        let mut region = seed[12..].to_vec();
        assert!(region.len() > LOG_RECORD_HEADER_BYTES);
        region[LOG_RECORD_HEADER_BYTES] ^= 1;
        let before = field_u32(&region, 4);
        fix_log_checksums(&mut region);
        assert_ne!(field_u32(&region, 4), before);
    }

    /// The seeds reach what the format has: the base image's block table
    /// lists shared nodes.
    #[test]
    fn the_base_image_has_shared_nodes() {
        let image = base_image();
        let table = block_table_of(image, &newest(image));
        assert!(table.shared().next().is_some(), "no shared node");
    }
}
