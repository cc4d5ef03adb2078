//! Warming the trees' upper levels at open (`Options::warm_bytes`): the
//! roots and the levels below them are read, interior nodes whole while
//! the budget allows, leaves' headers and metas, so that a cold point
//! query reads only its basement. Checked against a model: answers, the
//! bytes read by the open and by the query, the warming after a log
//! replay, its bounds (bytes, time, the cache's budget), a damaged node
//! met by the warming and a forged tree that names a node below itself.

mod common;

use std::sync::Arc;

use betreefs_engine::node::NodeBody;
use betreefs_engine::{EngineError, KeySpace, Options, Store, WriteBatch};
use betreefs_store::{CrashMode, MemDevice};
use common::{assert_matches, mid_options, numbered_key as key, Model};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// [`mid_options`] warming `warm_bytes` at open.
fn options(warm_bytes: usize) -> Options {
    Options {
        warm_bytes,
        ..mid_options()
    }
}

/// Data keys a store is filled with, in key order: enough for a data
/// tree three levels high with mid_options, its leaves filled by appends.
const KEYS: u32 = 40_000;

/// A closed store of [`KEYS`] data keys and a tenth as many metadata
/// keys, some overwritten since (so buffers above the leaves hold
/// messages), and its model.
fn filled(seed: u64) -> (MemDevice, Model) {
    let dev = MemDevice::new(256 << 20);
    let store = Store::create_on(Arc::new(dev.clone()), options(0)).unwrap();
    let mut model = Model::default();
    let fill = (0..KEYS).flat_map(|i| {
        let data = (KeySpace::Data, key(i), Some(vec![(i % 251) as u8; 60]));
        let meta = Some(i.to_le_bytes().to_vec());
        let meta = (i % 10 == 0).then(|| (KeySpace::Meta, key(i), meta));
        std::iter::once(data).chain(meta)
    });
    write_changes(&store, &mut model, 100, fill);
    let changes = random_data_changes(seed, 3_000, KEYS, 4, 90);
    write_changes(&store, &mut model, 50, changes);
    store.close().unwrap();
    (dev, model)
}

/// A change of a data key: its new value, or `None` to delete it.
type Change = (KeySpace, Vec<u8>, Option<Vec<u8>>);

/// `count` changes of data keys drawn from `0..keys` (seeded with
/// `seed`): the `delete_every`-th of them deletes, the others put `len`
/// bytes.
fn random_data_changes(
    seed: u64,
    count: u32,
    keys: u32,
    delete_every: u32,
    len: usize,
) -> Vec<Change> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..count)
        .map(|round| {
            let i = rng.gen_range(0..keys);
            let value = (round % delete_every != 0).then(|| vec![round as u8; len]);
            (KeySpace::Data, key(i), value)
        })
        .collect()
}

/// Writes `changes` (a key's new value, or `None` to delete it) in
/// batches of `per_batch`, and applies them to the model.
fn write_changes(
    store: &Store,
    model: &mut Model,
    per_batch: usize,
    changes: impl IntoIterator<Item = Change>,
) {
    let mut batch = WriteBatch::new();
    for (ks, k, v) in changes {
        match v {
            Some(v) => batch.put(ks, &k, &v),
            None => batch.delete(ks, &k),
        };
        if batch.len() >= per_batch {
            store.write(&batch).unwrap();
            model.apply(&batch);
            batch = WriteBatch::new();
        }
    }
    store.write(&batch).unwrap();
    model.apply(&batch);
}

/// The image `store` (on `dev`) leaves when the power is cut right after
/// a sync: what it wrote since its last checkpoint is in the log alone.
fn power_cut_after_sync(dev: &MemDevice, store: Store) -> MemDevice {
    store.sync().unwrap();
    let crashed = MemDevice::from_image(dev.crash_image(CrashMode::DropUnsynced));
    drop(store);
    crashed
}

fn open(dev: &MemDevice, warm_bytes: usize) -> Store {
    Store::open_on(Arc::new(dev.clone()), options(warm_bytes)).unwrap()
}

fn assert_get(store: &Store, model: &Model, ks: KeySpace, k: &[u8]) {
    assert_eq!(
        store.get(ks, k).unwrap(),
        model.spaces[ks.index()].get(k).cloned(),
        "key {:?}",
        String::from_utf8_lossy(k)
    );
}

#[test]
fn a_cold_point_query_after_a_warm_open_reads_only_its_basement() {
    let (dev, model) = filled(5);
    let cold = open(&dev, 0);
    assert_eq!(cold.stats().nodes_warmed, 0);
    assert_eq!(cold.stats().node_bytes_read_per_level, [0; 8]);
    drop(cold);

    let store = open(&dev, 32 << 20);
    let opened = store.stats();
    assert!(
        opened.tree_heights[KeySpace::Data.index()] >= 1,
        "the data tree should have interior nodes"
    );
    assert!(opened.nodes_warmed > 2, "{opened:?}");
    assert!(opened.warm_bytes_read > 0, "{opened:?}");
    // Everything above the leaves fit: read whole, not in part.
    assert_eq!(opened.interior_nodes_read_in_part, 0, "{opened:?}");
    let leaves_before = opened.node_bytes_read_per_level[0];
    let above_before: u64 = opened.node_bytes_read_per_level[1..].iter().sum();

    let basement = 8 << 10;
    let mut rng = SmallRng::seed_from_u64(9);
    for _ in 0..20 {
        let i = rng.gen_range(0..KEYS);
        let leaves = store.stats().node_bytes_read_per_level[0];
        assert_get(&store, &model, KeySpace::Data, &key(i));
        let stats = store.stats();
        // One basement (with its block rounding) at most; no interior
        // node, no leaf's header again.
        assert!(
            stats.node_bytes_read_per_level[0] - leaves <= basement + 4096,
            "query of key {i} read {} bytes of leaves",
            stats.node_bytes_read_per_level[0] - leaves
        );
        let above: u64 = stats.node_bytes_read_per_level[1..].iter().sum();
        assert_eq!(above, above_before, "query of key {i} read interior nodes");
        assert_eq!(stats.segments_read, 0);
    }
    assert!(store.stats().node_bytes_read_per_level[0] > leaves_before);
    // Every answer as the model's, then the whole store.
    assert_get(&store, &model, KeySpace::Meta, &key(40));
    assert_get(&store, &model, KeySpace::Data, b"zzz");
    assert_matches(&store, &model);
    store.verify().unwrap();
}

#[test]
fn warming_after_log_replay_finds_the_replayed_writes() {
    let (dev, mut model) = filled(10);
    // Writes synced to the log but in no checkpoint, then a power cut:
    // the open replays them (caching the nodes they change, dirty), then
    // warms what replay left on the device.
    let store = open(&dev, 0);
    let changes = random_data_changes(10, 2_000, KEYS + 5_000, 5, 70);
    write_changes(&store, &mut model, 40, changes);
    let crashed = power_cut_after_sync(&dev, store);

    let store = open(&crashed, 32 << 20);
    assert!(store.stats().log_replayed_records > 0);
    assert!(store.stats().nodes_warmed >= 1);
    for i in (0..25_000).step_by(97) {
        assert_get(&store, &model, KeySpace::Data, &key(i));
    }
    assert_matches(&store, &model);
    store.verify().unwrap();
    // And once more after a clean close, warm again.
    store.close().unwrap();
    let store = open(&crashed, 32 << 20);
    assert_matches(&store, &model);
}

#[test]
fn warming_stops_at_the_caches_budget() {
    let (dev, mut model) = filled(12);
    // A cache of four nodes, filled by the replay of a long log.
    let small = |warm_bytes| Options {
        cache_bytes: 1 << 20,
        warm_bytes,
        ..mid_options()
    };
    let store = Store::open_on(Arc::new(dev.clone()), small(0)).unwrap();
    let puts = (0..8_000u32).map(|i| (KeySpace::Data, key(i * 3), Some(vec![i as u8; 100])));
    write_changes(&store, &mut model, 50, puts);
    let crashed = power_cut_after_sync(&dev, store);

    let store = Store::open_on(Arc::new(crashed), small(512 << 10)).unwrap();
    let stats = store.stats();
    assert!(stats.log_replayed_records > 0);
    // The warming stopped at the cache's budget, not at its own: past it
    // by no more than the node it read last (a root, which the cache
    // keeps; a query would have read it all the same).
    assert!(
        stats.warm_bytes_read < 512 << 10,
        "warmed {} bytes",
        stats.warm_bytes_read
    );
    assert!(
        stats.nodes_warmed <= 1,
        "warmed {} nodes",
        stats.nodes_warmed
    );
    assert!(
        stats.cache_bytes <= stats.cache_budget_bytes + (256 << 10) * 2,
        "warming took the cache to {} bytes, past its budget of {}",
        stats.cache_bytes,
        stats.cache_budget_bytes
    );
    assert_matches(&store, &model);
}

#[test]
fn warming_stops_at_its_budget() {
    let (dev, model) = filled(6);
    let whole = open(&dev, 32 << 20).stats().warm_bytes_read;
    for budget in [4096usize, 64 << 10, 256 << 10] {
        let store = open(&dev, budget);
        let stats = store.stats();
        assert!(stats.nodes_warmed >= 1, "budget {budget}: {stats:?}");
        // The last node read may pass the budget by its header and meta
        // (a whole node is read only if it fits).
        assert!(
            stats.warm_bytes_read <= budget as u64 + (64 << 10),
            "budget {budget}: read {} bytes",
            stats.warm_bytes_read
        );
        assert!(stats.warm_bytes_read < whole, "budget {budget}");
        assert_matches(&store, &model);
    }
}

#[test]
fn warming_stops_at_its_time() {
    let (dev, model) = filled(9);
    let options = Options {
        warm_time: std::time::Duration::ZERO,
        ..options(32 << 20)
    };
    let store = Store::open_on(Arc::new(dev.clone()), options).unwrap();
    assert_eq!(store.stats().nodes_warmed, 0);
    assert_eq!(store.stats().warm_bytes_read, 0);
    assert_matches(&store, &model);
}

#[test]
fn a_warm_budget_past_half_the_cache_is_refused() {
    let dev = MemDevice::new(64 << 20);
    let options = Options {
        warm_bytes: 33 << 20,
        ..options(0)
    };
    match Store::create_on(Arc::new(dev), options) {
        Err(EngineError::InvalidOption(why)) => assert!(why.contains("warm_bytes"), "{why}"),
        other => panic!("expected InvalidOption, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_damaged_node_met_while_warming_is_reported_by_the_query_that_needs_it() {
    let (dev, model) = filled(7);
    let mut image = dev.current_image();
    let forge = common::forge::Forge::new(image.clone());
    // A leaf of the data tree, its header damaged: the warming reads it
    // (every leaf's header fits this budget).
    let found = forge.nodes(KeySpace::Data);
    let leaf = found
        .iter()
        .filter(|f| matches!(f.node.body, NodeBody::Leaf(_)))
        .nth(3)
        .expect("the data tree should have several leaves");
    let betreefs_engine::btt::Slot::OnDisk { extent, .. } = forge.btt.get(leaf.num) else {
        panic!("leaf not on disk");
    };
    let at = forge.sb.layout.extent_offset(extent) as usize;
    image[at + 30] ^= 0x20;
    let dev = MemDevice::from_image(image);

    // The open goes on; the warming stops at the damaged leaf.
    let store = open(&dev, 32 << 20);
    assert!(store.stats().nodes_warmed >= 1);
    // A key in the first leaf still reads; a key of the damaged leaf
    // fails, naming it (as it would have without the warming).
    assert_get(&store, &model, KeySpace::Data, &key(0));
    match store.get(KeySpace::Data, &leaf.bounds.lo) {
        Err(EngineError::CorruptNode { num, .. }) => assert_eq!(num, leaf.num),
        other => panic!("expected the damaged leaf to be reported, got {other:?}"),
    }
}

#[test]
fn a_forged_tree_that_names_a_node_below_itself_neither_hangs_the_open_nor_answers() {
    let (dev, model) = filled(8);
    let mut forge = common::forge::Forge::new(dev.current_image());
    // An interior node below the data tree's root, its second child
    // replaced by the root: a cycle each node's own checks cannot see.
    let nodes = forge.nodes(KeySpace::Data);
    let root = nodes.first().expect("a root").num;
    let (num, bounds, mut forged) = nodes
        .iter()
        .skip(1)
        .find(|f| matches!(&f.node.body, NodeBody::Interior(int) if int.children.len() >= 2))
        .map(|f| (f.num, f.bounds.clone(), f.node.clone()))
        .expect("the data tree should be three levels high");
    let NodeBody::Interior(int) = &mut forged.body else {
        unreachable!()
    };
    let under_forged = int.pivots[0].clone();
    int.children[1] = root;
    forge.write_node(num, &forged);
    let dev = MemDevice::from_image(forge.finish());

    let store = open(&dev, 32 << 20);
    assert!(store.stats().nodes_warmed >= 2);
    // Keys outside the forged node's subtree still read; one under the
    // forged child is refused as corrupt.
    let outside = model.spaces[KeySpace::Data.index()]
        .keys()
        .find(|k| !bounds.contains(k))
        .expect("a key outside the forged node")
        .clone();
    assert_get(&store, &model, KeySpace::Data, &outside);
    match store.get(KeySpace::Data, &under_forged) {
        Err(EngineError::CorruptNode { .. }) => {}
        other => panic!("expected the forged child to be refused, got {other:?}"),
    }
}
