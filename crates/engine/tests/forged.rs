//! Images changed with every checksum made valid again: a child referenced
//! twice, pivots moved, keys outside a node's bounds, a node put back where
//! another belongs, oversized or reversed messages in the log and in node
//! buffers. Each must give a typed error naming the problem — read-write
//! and read-only alike — never a panic, never zeros for intact data.

mod common;

use std::sync::Arc;

use betreefs_engine::merge::patch_arg;
use betreefs_engine::node::NodeBody;
use betreefs_engine::{buffer::PointMsg, EngineError, KeySpace, Options, Store, WriteBatch};
use betreefs_engine::{MergeRegistry, MERGE_PATCH};
use betreefs_store::{CrashMode, MemDevice};
use common::forge::{append_log_record, Forge};
use common::small_options;

fn key(i: u32) -> Vec<u8> {
    format!("dir\x01sub\x00file{i:05}").into_bytes()
}

/// A closed store with a few levels in the data tree.
fn populated(count: u32) -> Vec<u8> {
    let (dev, store) = common::mem_store(32 << 20, small_options());
    for i in 0..count {
        store.put(KeySpace::Data, &key(i), &[i as u8; 150]).unwrap();
    }
    store.close().unwrap();
    dev.current_image()
}

/// Opens the image (read-write, then read-only) and reads every key with
/// range scans and point reads, as a mount serving files does: the reads
/// themselves must fail with a typed error (fsck's full `verify` is not
/// what a mount runs). Panics on a panic or on unnoticed damage.
fn expect_corrupt_node(image: Vec<u8>, what: &str) {
    for read_only in [false, true] {
        let image = image.clone();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
            move || -> Result<(), EngineError> {
                let options = Options {
                    read_only,
                    ..small_options()
                };
                let store = Store::open_on(Arc::new(MemDevice::from_image(image)), options)?;
                for item in store.range(KeySpace::Data, b"", None) {
                    item?;
                }
                for i in 0..3000 {
                    store.get(KeySpace::Data, &key(i))?;
                }
                Ok(())
            },
        ));
        match outcome {
            Err(_) => panic!("{what} (read_only {read_only}): panicked"),
            Ok(Ok(())) => panic!("{what} (read_only {read_only}): reads went on unnoticing"),
            Ok(Err(EngineError::CorruptNode { .. })) => {}
            Ok(Err(e)) => panic!("{what} (read_only {read_only}): unexpected error {e}"),
        }
    }
}

fn interiors(forge: &Forge) -> Vec<common::forge::FoundNode> {
    forge
        .nodes(KeySpace::Data)
        .into_iter()
        .filter(|n| matches!(n.node.body, NodeBody::Interior(_)))
        .collect()
}

#[test]
fn a_child_referenced_twice_is_corruption() {
    let image = populated(3000);
    // Twice in one parent.
    let mut forge = Forge::new(image.clone());
    let parent = interiors(&forge)
        .into_iter()
        .find(|n| matches!(&n.node.body, NodeBody::Interior(i) if i.children.len() >= 2))
        .expect("an interior node with two children");
    let mut node = parent.node.clone();
    if let NodeBody::Interior(int) = &mut node.body {
        int.children[1] = int.children[0];
    }
    forge.write_node(parent.num, &node);
    expect_corrupt_node(forge.finish(), "child twice in one parent");

    // Under two parents: the second one's range does not hold its keys.
    let mut forge = Forge::new(image);
    let lowest: Vec<_> = interiors(&forge)
        .into_iter()
        .filter(|n| matches!(&n.node.body, NodeBody::Interior(i) if i.height == 1))
        .collect();
    assert!(lowest.len() >= 2, "the tree needs two parents of leaves");
    let NodeBody::Interior(other) = &lowest[1].node.body else {
        unreachable!()
    };
    let mut node = lowest[0].node.clone();
    if let NodeBody::Interior(int) = &mut node.body {
        int.children[0] = other.children[0];
    }
    forge.write_node(lowest[0].num, &node);
    expect_corrupt_node(forge.finish(), "child under two parents");
}

#[test]
fn moved_pivots_are_corruption() {
    let image = populated(3000);
    let forge = Forge::new(image.clone());
    let parent = interiors(&forge)
        .into_iter()
        .find(|n| matches!(&n.node.body, NodeBody::Interior(i) if i.height == 1 && i.children.len() >= 3))
        .expect("a parent of three leaves");
    let NodeBody::Interior(int) = &parent.node.body else {
        unreachable!()
    };
    // Each pivot moved to the middle of the neighbouring child's keys.
    for (which, pivot) in [(0usize, 1usize), (1, 0)] {
        let mut forge = Forge::new(image.clone());
        let child = forge
            .nodes(betreefs_engine::KeySpace::Data)
            .into_iter()
            .find(|n| n.num == int.children[which])
            .expect("child");
        let NodeBody::Leaf(leaf) = &child.node.body else {
            panic!("height-1 children are leaves")
        };
        let keys: Vec<Vec<u8>> = leaf
            .basements
            .iter()
            .flat_map(|b| {
                let e = b.entries.as_ref().unwrap();
                (0..e.len()).map(|i| e.key(i).to_vec()).collect::<Vec<_>>()
            })
            .collect();
        let mut node = parent.node.clone();
        if let NodeBody::Interior(int) = &mut node.body {
            int.pivots[pivot] = keys[keys.len() / 2].clone();
            if int.pivots.windows(2).any(|w| w[0] >= w[1]) {
                continue;
            }
        }
        forge.write_node(parent.num, &node);
        expect_corrupt_node(forge.finish(), &format!("pivot {pivot} moved"));
    }
}

#[test]
fn keys_outside_a_leafs_bounds_are_corruption() {
    let image = populated(3000);
    let mut forge = Forge::new(image);
    let leaf = forge
        .nodes(KeySpace::Data)
        .into_iter()
        .find(|n| matches!(n.node.body, NodeBody::Leaf(_)) && n.bounds.hi.is_some())
        .expect("a bounded leaf");
    let hi = leaf.bounds.hi.clone().unwrap();
    let mut node = leaf.node.clone();
    let NodeBody::Leaf(l) = &mut node.body else {
        unreachable!()
    };
    // The last key becomes the upper bound itself (still sorted, same prefix).
    let mut entries = l.take_entries();
    let last = entries.len() - 1;
    let mut rebuilt = betreefs_engine::entries::Entries::default();
    for i in 0..last {
        rebuilt.push(entries.key(i), entries.value(i));
    }
    rebuilt.push(&hi, entries.value(last));
    entries = rebuilt;
    *l = betreefs_engine::node::Leaf::from_sorted(&entries, 2 << 10);
    forge.write_node(leaf.num, &node);
    expect_corrupt_node(forge.finish(), "key at the upper bound");
}

#[test]
fn a_node_put_back_where_another_belongs_is_corruption() {
    let image = populated(3000);
    let mut forge = Forge::new(image);
    let leaves: Vec<_> = forge
        .nodes(KeySpace::Data)
        .into_iter()
        .filter(|n| matches!(n.node.body, NodeBody::Leaf(_)))
        .collect();
    // Two leaves with the same lifted prefix, so the header's prefix check
    // passes and only the bounds can tell.
    let (a, b) = leaves
        .iter()
        .enumerate()
        .find_map(|(i, a)| {
            leaves[i + 1..]
                .iter()
                .find(|b| b.bounds.lifted_prefix() == a.bounds.lifted_prefix())
                .map(|b| (a, b))
        })
        .expect("two leaves with one prefix");
    let mut node = a.node.clone();
    node.bounds = b.bounds.clone();
    forge.write_node(b.num, &node);
    expect_corrupt_node(forge.finish(), "leaf put back under another's range");
}

#[test]
fn oversized_and_reversed_messages_in_nodes_are_corruption() {
    let image = populated(3000);
    let forge = Forge::new(image.clone());
    let parent = interiors(&forge).remove(0);
    let NodeBody::Interior(int) = &parent.node.body else {
        unreachable!()
    };
    let target = int.child_bounds(0, &parent.bounds).lo;
    let merges = MergeRegistry::default();
    for (what, offset) in [("2^31", 1u64 << 31), ("2^63-1", (1 << 63) - 1)] {
        let mut forge = Forge::new(image.clone());
        let mut node = parent.node.clone();
        if let NodeBody::Interior(int) = &mut node.body {
            std::sync::Arc::make_mut(&mut int.buffers[0]).insert_point(
                target.clone(),
                PointMsg::upsert(1, MERGE_PATCH, patch_arg(offset, b"x")),
                &merges,
            );
        }
        forge.write_node(parent.num, &node);
        expect_corrupt_node(forge.finish(), &format!("patch at {what} in a buffer"));
    }
}

/// A crashed image whose log holds a few synced records after the
/// checkpoint.
fn crashed_with_log() -> (Vec<u8>, u32) {
    let (dev, store) = common::mem_store(32 << 20, small_options());
    for i in 0..50u32 {
        store.put(KeySpace::Data, &key(i), &[1; 20]).unwrap();
    }
    store.sync().unwrap();
    dev.power_off();
    let image = dev.crash_image(CrashMode::DropUnsynced);
    drop(store);
    (image, 50)
}

#[test]
fn oversized_and_reversed_messages_in_the_log_are_refused() {
    let (image, _) = crashed_with_log();
    let forged: Vec<(&str, WriteBatch)> = vec![
        ("patch at 2^63-1", {
            let mut b = WriteBatch::new();
            b.upsert(
                KeySpace::Data,
                b"k",
                MERGE_PATCH,
                &patch_arg((1 << 63) - 1, b"x"),
            );
            b
        }),
        ("patch at 2^31", {
            let mut b = WriteBatch::new();
            b.upsert(KeySpace::Data, b"k", MERGE_PATCH, &patch_arg(1 << 31, b"x"));
            b
        }),
        ("reversed range delete", {
            let mut b = WriteBatch::new();
            b.range_delete(KeySpace::Data, b"z", b"a");
            b
        }),
        ("unknown merge function", {
            let mut b = WriteBatch::new();
            b.upsert(KeySpace::Data, b"k", 77, b"x");
            b
        }),
    ];
    for (what, batch) in forged {
        let bad = append_log_record(image.clone(), &batch.encode());
        for read_only in [false, true] {
            let options = Options {
                read_only,
                ..small_options()
            };
            let bad = bad.clone();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                Store::open_on(Arc::new(MemDevice::from_image(bad)), options).map(|_| ())
            }));
            match outcome {
                Err(_) => panic!("{what}: panicked"),
                Ok(Ok(())) => panic!("{what}: accepted"),
                Ok(Err(EngineError::CorruptLogRecord { .. })) => {}
                Ok(Err(e)) => panic!("{what}: unexpected error {e}"),
            }
        }
    }
    // The unforged image recovers every synced write.
    let store = Store::open_on(Arc::new(MemDevice::from_image(image)), small_options()).unwrap();
    assert_eq!(common::scan_all(&store, KeySpace::Data).len(), 50);
}

/// A range clone leaves nodes shared; a block table whose reference count
/// for one of them is one too high (space never freed) or one too low (a
/// node freed while still named) is found by verify (fsck).
#[test]
fn reference_counts_that_disagree_with_the_trees_are_found() {
    let (dev, store) = common::mem_store(32 << 20, small_options());
    for i in 0..3000 {
        store.put(KeySpace::Data, &key(i), &[i as u8; 150]).unwrap();
    }
    let mut clone = WriteBatch::new();
    clone.range_clone(
        KeySpace::Data,
        b"dir\x01sub\x00",
        b"dir\x01sub\x01",
        7,
        b"dir\x01sup",
    );
    store.write(&clone).unwrap();
    assert_eq!(store.stats().range_clones_by_surgery, 1);
    store.close().unwrap();
    let image = dev.current_image();
    let intact = Store::open_on(
        Arc::new(MemDevice::from_image(image.clone())),
        small_options(),
    );
    intact.unwrap().verify().unwrap();
    let shared: Vec<(u64, u32)> = Forge::new(image.clone()).btt.shared().collect();
    assert!(!shared.is_empty(), "the clone shares nodes");
    let (num, _) = shared[0];
    for too_many in [true, false] {
        let mut forge = Forge::new(image.clone());
        if too_many {
            forge.btt.add_ref(num);
        } else {
            forge.btt.drop_refs(num, 1);
        }
        let image = forge.finish();
        let store = Store::open_on(Arc::new(MemDevice::from_image(image)), small_options());
        match store.unwrap().verify() {
            Err(EngineError::CorruptNode { num: n, .. }) => assert_eq!(n, num),
            other => panic!("count off by one (too many: {too_many}): {other:?}"),
        }
    }
}
