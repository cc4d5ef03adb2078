//! How long encoding a node image takes (`format::encode_node`): a 4 MiB
//! interior node of small messages and 4 MiB leaves of 4 KiB and 100-byte
//! values, 20 encodes a line; and 20 clones of the interior node
//! for comparison. Figures in docs/benchmarks/encode-in-place.md:
//!
//!     cargo run --release -p betreefs-engine --example encode_speed

use betreefs_engine::buffer::PointMsg;
use betreefs_engine::entries::Entries;
use betreefs_engine::format::encode_node;
use betreefs_engine::node::{Bounds, Interior, Leaf, Node, NodeBody};
use betreefs_engine::MergeRegistry;
use std::time::Instant;

/// Encodes per line.
const ENCODES: u32 = 20;

fn node(body: NodeBody) -> Node {
    Node {
        body,
        bounds: Bounds::full(),
        tree: 0,
        dirty: true,
        last_used: Default::default(),
    }
}

/// `lines` lines, each the mean of [`ENCODES`] encodes of `node`.
fn time_encodes(label: &str, node: &Node, lines: usize) {
    for _ in 0..lines {
        let started = Instant::now();
        let mut len = 0;
        for num in 0..u64::from(ENCODES) {
            len = encode_node(node, num).len;
        }
        eprintln!(
            "{label}, {len} bytes: {:?} per encode",
            started.elapsed() / ENCODES
        );
    }
}

fn main() {
    let merges = MergeRegistry::default();
    let mut int = Interior {
        height: 1,
        pivots: (1..16u32)
            .map(|i| format!("k{:08}", i * 1000).into_bytes())
            .collect(),
        children: (0..16).collect(),
        buffers: (0..16).map(|_| Default::default()).collect(),
        partial: None,
    };
    let mut bytes = 0;
    let mut i = 0u32;
    while bytes < 4 << 20 {
        let key = format!("k{:08}/some/path/file{}", (i * 7919) % 16000, i).into_bytes();
        let v = vec![i as u8; if i.is_multiple_of(64) { 4096 } else { 120 }];
        bytes += key.len() + v.len() + 30;
        int.insert_point(key, PointMsg::put(u64::from(i) + 10, v), &merges);
        i += 1;
    }
    let interior = node(NodeBody::Interior(int));
    time_encodes(&format!("interior, {i} messages"), &interior, 3);
    let started = Instant::now();
    for _ in 0..ENCODES {
        std::hint::black_box(interior.clone());
    }
    eprintln!("  its clone: {:?}", started.elapsed() / ENCODES);
    for (vlen, label) in [
        (4096usize, "leaf, 4 KiB values"),
        (100, "leaf, 100-byte values"),
    ] {
        let mut e = Entries::default();
        let mut bytes = 0;
        let mut i = 0u64;
        while bytes < 4 << 20 {
            let key = format!("dir/file{i:010}").into_bytes();
            e.push(&key, &vec![i as u8; vlen]);
            bytes += key.len() + vlen + 4;
            i += 1;
        }
        time_encodes(
            label,
            &node(NodeBody::Leaf(Leaf::from_sorted(&e, 128 << 10))),
            2,
        );
    }
}
