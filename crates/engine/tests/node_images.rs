//! Node images are encoded straight into recycled device buffers
//! (`format::encode_node`): whatever a recycled buffer held before, every
//! byte of the image is written — an image is the same bytes whichever
//! buffer it lands in, and decodes to the node it was made from. (A test
//! binary of its own: the buffer pool is the process's.)

use betreefs_engine::buffer::PointMsg;
use betreefs_engine::entries::Entries;
use betreefs_engine::format::{decode_header, decode_node, encode_node};
use betreefs_engine::node::{Bounds, Interior, Leaf, Node, NodeBody};
use betreefs_engine::MergeRegistry;
use betreefs_store::AlignedBuf;

fn node(body: NodeBody) -> Node {
    Node {
        body,
        bounds: Bounds::full(),
        tree: 1,
        dirty: true,
        last_used: Default::default(),
    }
}

/// A leaf of several basements whose sizes are not multiples of a block.
fn leaf() -> Node {
    let mut e = Entries::default();
    for i in 0..3_000u32 {
        let key = format!("dir/file{i:06}");
        e.push(key.as_bytes(), &vec![i as u8; 37 + (i % 300) as usize]);
    }
    node(NodeBody::Leaf(Leaf::from_sorted(&e, 64 << 10)))
}

fn interior() -> Node {
    let merges = MergeRegistry::default();
    let mut int = Interior {
        height: 1,
        pivots: vec![b"m".to_vec()],
        children: vec![7, 8],
        buffers: vec![Default::default(), Default::default()],
        partial: None,
    };
    for i in 0..2_000u32 {
        let key = format!("{}{i:05}", if i % 2 == 0 { "a" } else { "q" });
        int.insert_point(
            key.into_bytes(),
            PointMsg::put(u64::from(i) + 1, vec![i as u8; 90 + (i % 7) as usize]),
            &merges,
        );
    }
    node(NodeBody::Interior(int))
}

/// Leaves four buffers of `len` bytes, every byte `poison`, in the pool.
fn poison_pool(len: usize, poison: u8) {
    let buffers: Vec<AlignedBuf> = (0..4)
        .map(|_| {
            let mut b = AlignedBuf::for_overwrite(len);
            b.fill(poison);
            b
        })
        .collect();
    drop(buffers);
}

#[test]
fn images_are_the_same_bytes_whatever_buffer_they_land_in() {
    for (what, n) in [("leaf", leaf()), ("interior node", interior())] {
        let len = encode_node(&n, 5).buf.len();
        assert!(
            len >= 128 << 10,
            "{what}: {len} bytes is too small to be pooled"
        );
        poison_pool(len, 0x11);
        let first = encode_node(&n, 5);
        poison_pool(len, 0xee);
        let second = encode_node(&n, 5);
        assert_eq!(first.len, second.len);
        assert!(
            first.buf[..] == second.buf[..],
            "{what}: the image depends on what its buffer held"
        );
        assert_eq!(first.basement_locs, second.basement_locs);
        // Decoded and encoded again: the same bytes.
        let h = decode_header(&first.buf, first.crc, 5, &n.bounds).unwrap();
        let back = decode_node(&h, &first.buf, &n.bounds).unwrap();
        if let NodeBody::Leaf(leaf) = &back.body {
            assert!(leaf.basements.len() > 3, "{what}: too few basements");
        }
        let again = encode_node(&back, 5);
        assert!(
            first.buf[..] == again.buf[..],
            "{what}: decoded, it encodes otherwise"
        );
    }
}
