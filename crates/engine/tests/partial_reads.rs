//! Interior nodes read in part (node format 3): a cold point query reads
//! an interior node's meta and the one segment of point messages that
//! would hold its key (a range visit: the segments its range needs), not
//! the whole node; anything that changes the node reads it whole first. Checked against a
//! model: answers, the bytes read, and nothing lost when a node read in
//! part is then changed, checkpointed and read back.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use betreefs_engine::{KeySpace, Options, Store, WriteBatch, MERGE_PATCH};
use betreefs_store::MemDevice;
use common::{assert_matches, mid_options, numbered_key as key, Model};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Nodes of 256 KiB (interior nodes past 4 KiB are read in part), a cache
/// that holds the whole tree, no background threads.
fn options() -> Options {
    mid_options()
}

/// A store filled by [`fill`] (its randomness seeded with `seed`), the
/// device under it, its model and the randomness to go on with.
fn filled(seed: u64) -> (MemDevice, Store, Model, SmallRng) {
    let dev = MemDevice::new(256 << 20);
    let store = Store::create_on(Arc::new(dev.clone()), options()).unwrap();
    let mut model = Model::default();
    let mut rng = SmallRng::seed_from_u64(seed);
    fill(&store, &mut model, &mut rng);
    (dev, store, model, rng)
}

/// What a point query of data key `k` answers, checked against the model.
fn assert_get(store: &Store, model: &Model, k: &[u8]) {
    assert_eq!(
        store.get(KeySpace::Data, k).unwrap(),
        model.spaces[KeySpace::Data.index()].get(k).cloned(),
        "key {:?}",
        String::from_utf8_lossy(k)
    );
}

/// Writes enough that the tree has interior nodes whose buffers hold
/// many messages: puts of every key, then overwrites, deletes and patches
/// of some (the newest of which stay in the buffers above the leaves).
fn fill(store: &Store, model: &mut Model, rng: &mut SmallRng) {
    let mut batch = WriteBatch::new();
    let push = |batch: WriteBatch, model: &mut Model| {
        store.write(&batch).unwrap();
        model.apply(&batch);
    };
    for i in 0..20_000u32 {
        batch.put(KeySpace::Data, &key(i), &[(i % 251) as u8; 60]);
        if batch.len() == 100 {
            push(std::mem::take(&mut batch), model);
        }
    }
    for round in 0..3_000u32 {
        let i = rng.gen_range(0..20_000);
        match round % 3 {
            0 => batch.put(KeySpace::Data, &key(i), &[round as u8; 90]),
            1 => batch.delete(KeySpace::Data, &key(i)),
            _ => batch.upsert(
                KeySpace::Data,
                &key(i),
                MERGE_PATCH,
                &betreefs_engine::merge::patch_arg(3, b"patched"),
            ),
        };
        if batch.len() == 50 {
            push(std::mem::take(&mut batch), model);
        }
    }
    push(batch, model);
}

fn reopen(dev: &MemDevice, store: Store) -> Store {
    store.close().unwrap();
    Store::open_on(Arc::new(dev.clone()), options()).unwrap()
}

#[test]
fn a_cold_point_query_reads_a_segment_not_the_whole_node() {
    let (dev, store, model, mut rng) = filled(7);
    let buffered = store.stats().flush_backlog_bytes;
    assert!(
        buffered > 64 << 10,
        "the root should hold many messages, holds {buffered} bytes"
    );
    let store = reopen(&dev, store);

    // One cold point query: the root's meta and one segment, not its
    // buffers' messages.
    let want = model.spaces[KeySpace::Data.index()].clone();
    assert_get(&store, &model, &key(12_345));
    let stats = store.stats();
    // (The heights of the cached roots: the probe read the data tree's.)
    let height = stats.tree_heights[KeySpace::Data.index()] as usize;
    assert!(height >= 1, "the data tree should have interior nodes");
    let root_read = stats.node_bytes_read_per_level[height];
    assert!(stats.interior_nodes_read_in_part >= 1, "{stats:?}");
    assert!(stats.segments_read >= 1, "{stats:?}");
    assert_eq!(stats.interior_nodes_completed, 0, "{stats:?}");
    assert!(
        root_read < buffered / 4,
        "the root's read ({root_read} bytes) should be far less than its messages ({buffered})"
    );

    // Small ranges through them read the segments the range needs.
    let before = store.stats().segments_read;
    for _ in 0..300 {
        let lo = rng.gen_range(0..20_000u32);
        let hi = lo + rng.gen_range(1..40);
        let got: Vec<(Vec<u8>, Vec<u8>)> = store
            .range(KeySpace::Data, &key(lo), Some(&key(hi)))
            .collect::<Result<_, _>>()
            .unwrap();
        let expected: Vec<(Vec<u8>, Vec<u8>)> = want
            .range(key(lo)..key(hi))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(got, expected, "range {lo}..{hi}");
    }
    assert!(store.stats().segments_read > before);
    // Every key, point queries alone: each answer as the model's.
    for i in 0..20_000u32 {
        assert_get(&store, &model, &key(i));
    }
    assert_get(&store, &model, b"key");
    assert_get(&store, &model, b"zzz");
    // So many queries through the nodes read in part made them whole.
    assert!(store.stats().interior_nodes_completed >= 1);
    // The whole key space, then verify (which reads every node whole).
    assert_matches(&store, &model);
    store.verify().unwrap();
}

#[test]
fn nodes_read_in_part_are_read_whole_before_they_change() {
    let (dev, mut store, mut model, mut rng) = filled(11);
    for round in 0..4u8 {
        store = reopen(&dev, store);
        // Point queries read interior nodes in part, then writes change
        // them: nothing their images held may be lost.
        for _ in 0..200 {
            assert_get(&store, &model, &key(rng.gen_range(0..20_000)));
        }
        assert!(store.stats().interior_nodes_read_in_part >= 1);
        let mut batch = WriteBatch::new();
        for _ in 0..2_000 {
            let i = rng.gen_range(0..20_000);
            if rng.gen_bool(0.2) {
                batch.delete(KeySpace::Data, &key(i));
            } else {
                batch.put(KeySpace::Data, &key(i), &[round; 70]);
            }
            if batch.len() == 40 {
                store.write(&batch).unwrap();
                model.apply(&batch);
                batch = WriteBatch::new();
            }
        }
        store.write(&batch).unwrap();
        model.apply(&batch);
        // The nodes the queries read in part were completed, not read
        // again from their start.
        assert!(store.stats().interior_nodes_completed >= 1);
        if round % 2 == 1 {
            store.checkpoint().unwrap();
        }
        store = reopen(&dev, store);
        assert_matches(&store, &model);
        store.verify().unwrap();
    }
}

#[test]
fn a_damaged_segment_is_refused_and_other_keys_still_read() {
    let (dev, store, model, _) = filled(3);
    store.close().unwrap();
    let mut image = dev.current_image();
    let forge = common::forge::Forge::new(image.clone());
    // The root of the data tree: damage one byte in the middle of its
    // segments (past the meta).
    let (root, at, meta_end, len) = forge.root_extent(KeySpace::Data);
    assert!(len > meta_end + 4096, "the root should hold segments");
    let target = at + meta_end + (len - meta_end) / 2;
    image[target] ^= 0x40;
    let dev = MemDevice::from_image(image);
    let store = Store::open_on(Arc::new(dev), options()).unwrap();
    let mut refused = 0;
    let mut answered: BTreeMap<u32, bool> = BTreeMap::new();
    for i in (0..20_000u32).step_by(7) {
        match store.get(KeySpace::Data, &key(i)) {
            Ok(v) => {
                assert_eq!(
                    v,
                    model.spaces[KeySpace::Data.index()].get(&key(i)).cloned()
                );
                answered.insert(i, true);
            }
            Err(e) => {
                assert!(e.to_string().contains("segment"), "node {root}: {e}");
                refused += 1;
            }
        }
    }
    assert!(refused > 0, "a query through the damaged segment must fail");
    assert!(answered.len() > refused, "others read on");
}
