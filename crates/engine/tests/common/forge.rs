//! Forging images for tests: decode a real image's trees, change a node
//! or the log, and write it back with every checksum made valid again, as
//! a misdirected write, a firmware bug or an attacker could. What a
//! checksummed format cannot catch by itself, the engine's invariant checks
//! must.

use betreefs_engine::btt::BlockTable;
use betreefs_engine::format::{decode_header, decode_node, encode_node, meta_end};
use betreefs_engine::node::{Bounds, Node, NodeBody};
use betreefs_engine::KeySpace;
use betreefs_store::{
    crc32c_of, replay_log, Extent, LogWriter, MemDevice, ReplayStart, Superblock, BLOCK_SIZE,
};

/// A node as found in the image, fully decoded.
pub struct FoundNode {
    pub num: u64,
    pub bounds: Bounds,
    pub node: Node,
}

/// A decoded image that can be changed and written back consistently.
pub struct Forge {
    pub bytes: Vec<u8>,
    pub sb: Superblock,
    pub btt: BlockTable,
}

impl Forge {
    pub fn new(bytes: Vec<u8>) -> Forge {
        let sb =
            Superblock::read_newest(&MemDevice::from_image(bytes.clone())).expect("superblock");
        let at = sb.layout.extent_offset(sb.btt) as usize;
        let btt = BlockTable::decode(&bytes[at..at + sb.btt.len as usize]).expect("block table");
        Forge { bytes, sb, btt }
    }

    fn read_node(&self, num: u64, bounds: &Bounds) -> Node {
        let betreefs_engine::btt::Slot::OnDisk { extent, crc } = self.btt.get(num) else {
            panic!("node {num} not on disk");
        };
        let at = self.sb.layout.extent_offset(extent) as usize;
        let bytes = &self.bytes[at..at + extent.len as usize];
        let header = decode_header(bytes, crc, num, bounds).expect("header");
        decode_node(&header, bytes, bounds).expect("node")
    }

    /// The root of tree `ks`: its number, the byte offset of its extent in
    /// the image, where its meta ends and its length.
    pub fn root_extent(&self, ks: KeySpace) -> (u64, usize, usize, usize) {
        let num = self.sb.roots[ks.index()];
        let betreefs_engine::btt::Slot::OnDisk { extent, crc } = self.btt.get(num) else {
            panic!("node {num} not on disk");
        };
        let at = self.sb.layout.extent_offset(extent) as usize;
        let bytes = &self.bytes[at..at + extent.len as usize];
        let header = decode_header(bytes, crc, num, &Bounds::full()).expect("header");
        (num, at, meta_end(&header), header.total_len as usize)
    }

    /// Every node of a tree, parents before children.
    pub fn nodes(&self, ks: KeySpace) -> Vec<FoundNode> {
        let mut out = Vec::new();
        let mut todo = vec![(self.sb.roots[ks.index()], Bounds::full())];
        while let Some((num, bounds)) = todo.pop() {
            let node = self.read_node(num, &bounds);
            if let NodeBody::Interior(int) = &node.body {
                for i in (0..int.children.len()).rev() {
                    todo.push((int.children[i], int.child_bounds(i, &bounds)));
                }
            }
            out.push(FoundNode { num, bounds, node });
        }
        out
    }

    /// First block past everything in use: where forged pieces go.
    fn free_block(&self) -> u64 {
        self.btt
            .extents()
            .map(|(_, e)| e.block + e.blocks())
            .chain([self.sb.btt.block + self.sb.btt.blocks()])
            .max()
            .unwrap_or(0)
    }

    fn put_extent(&mut self, data: &[u8]) -> Extent {
        let extent = Extent {
            block: self.free_block(),
            len: data.len() as u32,
        };
        assert!(extent.block + extent.blocks() <= self.sb.layout.node_blocks());
        let at = self.sb.layout.extent_offset(extent) as usize;
        self.bytes[at..at + data.len()].copy_from_slice(data);
        extent
    }

    /// Writes `node` as node `num` (its bounds decide the lifted prefix).
    pub fn write_node(&mut self, num: u64, node: &Node) {
        let mut node = node.clone();
        node.dirty = true;
        let img = encode_node(&node, num);
        let extent = self.put_extent(&img.buf[..img.buf.len()]);
        let extent = Extent {
            len: img.len,
            ..extent
        };
        self.btt.set(num, extent, img.crc);
    }

    /// Points node `num`'s table entry at node `other`'s image (a stale or
    /// misplaced node the checksums alone cannot tell from the right one).
    pub fn alias(&mut self, num: u64, other: u64) {
        let betreefs_engine::btt::Slot::OnDisk { extent, crc } = self.btt.get(other) else {
            panic!("node {other} not on disk");
        };
        self.btt.set(num, extent, crc);
    }

    /// Writes the block table and the newest superblock back, checksums
    /// valid; returns the forged image.
    pub fn finish(mut self) -> Vec<u8> {
        let table = self.btt.encode();
        let mut padded = table.clone();
        padded.resize(table.len().div_ceil(BLOCK_SIZE) * BLOCK_SIZE, 0);
        let extent = self.put_extent(&padded);
        self.sb.btt = Extent {
            len: table.len() as u32,
            ..extent
        };
        self.sb.btt_crc = crc32c_of(&[&table]);
        let slot = (self.sb.generation % 2) as usize;
        let encoded = self.sb.encode();
        self.bytes[slot * BLOCK_SIZE..(slot + 1) * BLOCK_SIZE].copy_from_slice(&encoded);
        self.bytes
    }
}

/// Appends a record with a valid checksum, in sequence, to the log of a
/// crashed image (one whose newest superblock is not clean).
pub fn append_log_record(image: Vec<u8>, payload: &[u8]) -> Vec<u8> {
    let dev = MemDevice::from_image(image);
    let sb = Superblock::read_newest(&dev).expect("superblock");
    let start = ReplayStart {
        head: sb.log_head,
        epoch: sb.log_epoch,
        first_seq: sb.checkpoint_seq + 1,
        look_beyond: false,
    };
    let end = replay_log(
        &dev,
        sb.layout.log_offset,
        sb.layout.log_bytes,
        &start,
        |_, _| Ok(()),
    )
    .expect("replay");
    let log = LogWriter::new(
        std::sync::Arc::new(dev.clone()),
        sb.layout.log_offset,
        sb.layout.log_bytes,
        sb.log_epoch,
        end.end_pos,
    )
    .expect("log writer");
    log.append(end.next_seq, &[payload]).expect("append");
    log.flush().expect("flush");
    dev.current_image()
}
