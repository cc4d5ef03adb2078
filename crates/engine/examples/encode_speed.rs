//! How long encoding a node image takes (`format::encode_node`): a 4 MiB
//! interior node of small messages and 4 MiB leaves of 4 KiB and 100-byte
//! values, 20 encodes each, three times; and a clone of the interior node
//! for comparison. Figures in docs/benchmarks/encode-in-place.md:
//!
//!     cargo run --release -p betreefs-engine --example encode_speed

use betreefs_engine::buffer::{MessageBuffer, PointMsg};
use betreefs_engine::entries::Entries;
use betreefs_engine::format::encode_node;
use betreefs_engine::node::{Bounds, Interior, Leaf, Node, NodeBody};
use betreefs_engine::MergeRegistry;
use std::time::Instant;

fn main() {
    let merges = MergeRegistry::default();
    let mut int = Interior {
        height: 1,
        pivots: (1..16u32)
            .map(|i| format!("k{:08}", i * 1000).into_bytes())
            .collect(),
        children: (0..16).collect(),
        buffers: (0..16).map(|_| MessageBuffer::default()).collect(),
    };
    let mut bytes = 0;
    let mut i = 0u32;
    while bytes < 4 << 20 {
        let key = format!("k{:08}/some/path/file{}", (i * 7919) % 16000, i).into_bytes();
        let v = vec![i as u8; if i.is_multiple_of(64) { 4096 } else { 120 }];
        bytes += key.len() + v.len() + 30;
        int.insert_point(key, PointMsg::put(i as u64 + 10, v), &merges);
        i += 1;
    }
    let node = Node {
        body: NodeBody::Interior(int),
        bounds: Bounds::full(),
        tree: 0,
        dirty: true,
        last_used: Default::default(),
    };
    for _ in 0..3 {
        let t = Instant::now();
        let n = 20;
        let mut len = 0;
        for k in 0..n {
            len = encode_node(&node, k).len;
        }
        eprintln!(
            "interior {} msgs, {} bytes: {:?} per encode",
            i,
            len,
            t.elapsed() / n as u32
        );
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(node.clone());
        }
        eprintln!("  clone: {:?}", t.elapsed() / n as u32);
    }
    for (vlen, label) in [(4096usize, "4 KiB values"), (100, "100-byte values")] {
        let mut e = Entries::default();
        let mut bytes = 0;
        let mut i = 0u64;
        while bytes < 4 << 20 {
            let key = format!("dir/file{:010}", i).into_bytes();
            e.push(&key, &vec![i as u8; vlen]);
            bytes += key.len() + vlen + 4;
            i += 1;
        }
        let leaf = Node {
            body: NodeBody::Leaf(Leaf::from_sorted(&e, 128 << 10)),
            bounds: Bounds::full(),
            tree: 0,
            dirty: true,
            last_used: Default::default(),
        };
        for _ in 0..2 {
            let t = Instant::now();
            let n = 20;
            let mut len = 0;
            for k in 0..n {
                len = encode_node(&leaf, k).len;
            }
            eprintln!(
                "leaf {label}, {len} bytes: {:?} per encode",
                t.elapsed() / n as u32
            );
        }
    }
}
