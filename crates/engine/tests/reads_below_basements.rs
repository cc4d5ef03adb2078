//! Reads below a basement (node format 4): a cold point query, or a range
//! within a chunk or two, reads the basement's chunk directory and the
//! chunks it needs instead of the whole basement; a basement whose chunks
//! are used often is read whole; whatever changes a leaf reads it whole
//! first. Checked against a model: answers, the bytes read, damage found
//! where it is read, and nothing lost when leaves read below are then
//! changed, checkpointed and read back.

mod common;

use std::sync::Arc;

use betreefs_engine::btt::Slot;
use betreefs_engine::node::NodeBody;
use betreefs_engine::{EngineError, KeySpace, Options, Store, WriteBatch};
use betreefs_store::{CrashMode, MemDevice};
use common::{assert_matches, env_count, small_options, Model};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Leaves of 1 MiB in basements of 128 KiB (the default), a cache that
/// holds everything, no background threads.
fn options() -> Options {
    Options {
        node_size: 1 << 20,
        basement_size: 128 << 10,
        fanout: 8,
        cache_bytes: 128 << 20,
        log_bytes: Some(16 << 20),
        ..small_options()
    }
}

fn block_key(file: u32, block: u32) -> Vec<u8> {
    format!("file{file:04}\x00{block:08}").into_bytes()
}

/// A file block's bytes: every one differs from every other.
fn block(file: u32, block: u32, round: u32) -> Vec<u8> {
    let mut v = vec![(file * 31 + block + round) as u8; 4096];
    v[..12]
        .copy_from_slice(&[file.to_le_bytes(), block.to_le_bytes(), round.to_le_bytes()].concat());
    v
}

/// Six files of 400 blocks (about 10 MB of data leaves), and in the
/// metadata tree 6000 small records.
fn filled() -> (MemDevice, Store, Model) {
    let dev = MemDevice::new(512 << 20);
    let store = Store::create_on(Arc::new(dev.clone()), options()).unwrap();
    let mut model = Model::default();
    let mut batch = WriteBatch::new();
    for file in 0..6 {
        for b in 0..400 {
            batch.put(KeySpace::Data, &block_key(file, b), &block(file, b, 0));
            if batch.len() == 32 {
                store.write(&batch).unwrap();
                model.apply(&std::mem::take(&mut batch));
            }
        }
    }
    for i in 0..6000u32 {
        let value = vec![(i % 253) as u8; 60 + (i % 90) as usize];
        batch.put(
            KeySpace::Meta,
            format!("dir\x00name{i:06}").as_bytes(),
            &value,
        );
        if batch.len() == 200 {
            store.write(&batch).unwrap();
            model.apply(&std::mem::take(&mut batch));
        }
    }
    store.write(&batch).unwrap();
    model.apply(&batch);
    (dev, store, model)
}

fn reopen(dev: &MemDevice, store: Store) -> Store {
    store.close().unwrap();
    Store::open_on(Arc::new(dev.clone()), options()).unwrap()
}

fn model_get(model: &Model, ks: KeySpace, k: &[u8]) -> Option<Vec<u8>> {
    model.spaces[ks.index()].get(k).cloned()
}

fn visit(store: &Store, ks: KeySpace, lo: &[u8], hi: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut got = Vec::new();
    store
        .visit_range(ks, lo, hi, &mut |k, v| {
            got.push((k.to_vec(), v.to_vec()));
        })
        .unwrap();
    got
}

fn model_range(model: &Model, ks: KeySpace, lo: &[u8], hi: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    model.spaces[ks.index()]
        .range(lo.to_vec()..hi.to_vec())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Chunk directories and chunks read so far.
fn reads_below(store: &Store) -> (u64, u64) {
    let stats = store.stats();
    (stats.chunk_dirs_read, stats.chunks_read)
}

/// Leaf bytes read (level 0 of the node reads).
fn leaf_bytes_read(store: &Store) -> u64 {
    store.stats().node_bytes_read_per_level[0]
}

#[test]
fn a_cold_point_query_reads_a_chunk_not_the_basement() {
    let (dev, store, model) = filled();
    let store = reopen(&dev, store);
    let k = block_key(3, 211);
    let before = leaf_bytes_read(&store);
    assert!(answers_right(&store, &model, &k));
    assert_eq!(reads_below(&store), (1, 1));
    // The leaf's header block (its meta with it), the directory's block
    // and the block's own (a raw value of 4 KiB lies on a block of the
    // node): three blocks, not the 128 KiB basement. (The root's first
    // block counts here too: its height is not known until it is read.)
    let read = leaf_bytes_read(&store) - before;
    assert!(read <= 4 * 4096, "read {read} bytes of leaves");

    // The next key of the same file is in another chunk: the directory is
    // cached, the chunk read alone.
    let next = block_key(3, 212);
    let before = leaf_bytes_read(&store);
    assert!(answers_right(&store, &model, &next));
    assert_eq!(reads_below(&store), (1, 2));
    assert_eq!(leaf_bytes_read(&store) - before, 4096);

    // Asked again: cached, nothing read.
    let before = leaf_bytes_read(&store);
    assert!(answers_right(&store, &model, &k));
    assert_eq!(leaf_bytes_read(&store), before);

    // A range of one block (a file read of 4 KiB) is read below too, and a
    // metadata lookup (small records, many to a chunk).
    let (lo, hi) = (block_key(5, 17), block_key(5, 18));
    assert!(
        visit(&store, KeySpace::Data, &lo, &hi) == model_range(&model, KeySpace::Data, &lo, &hi)
    );
    assert_eq!(reads_below(&store), (2, 3));
    // A metadata lookup: small records, many to a chunk; a few blocks of
    // leaves at most (none if its message still lies above the leaves).
    let name = b"dir\x00name004321".to_vec();
    let before = leaf_bytes_read(&store);
    assert_eq!(
        store.get(KeySpace::Meta, &name).unwrap(),
        model_get(&model, KeySpace::Meta, &name)
    );
    assert!(leaf_bytes_read(&store) - before <= 6 * 4096);
    assert_matches(&store, &model);
}

#[test]
fn a_basement_queried_again_is_read_whole() {
    let (dev, store, model) = filled();
    let store = reopen(&dev, store);
    // Every block, one point query each, in an order that is not the
    // keys': a basement's first two misses read a chunk each, the third
    // reads it whole (those two chunks again, and nothing more after).
    let mut keys: Vec<Vec<u8>> = (0..6)
        .flat_map(|f| (0..400).map(move |b| block_key(f, b)))
        .collect();
    keys.sort_by_key(|k| crc32c::crc32c(k));
    let before = leaf_bytes_read(&store);
    for k in &keys {
        assert!(answers_right(&store, &model, k));
    }
    let read = leaf_bytes_read(&store) - before;
    let data = 6 * 400 * 4096u64;
    assert!(
        read < data + data / 8,
        "read {read} bytes for {data} of blocks"
    );
    let stats = store.stats();
    assert!(
        stats.chunks_read <= 2 * stats.chunk_dirs_read,
        "{} chunks read below {} basements",
        stats.chunks_read,
        stats.chunk_dirs_read
    );
    // The basements are whole now: a scan of everything reads nothing.
    let before = leaf_bytes_read(&store);
    let (lo, hi) = (block_key(0, 0), block_key(6, 0));
    assert!(
        visit(&store, KeySpace::Data, &lo, &hi) == model_range(&model, KeySpace::Data, &lo, &hi)
    );
    assert_eq!(leaf_bytes_read(&store), before);
}

/// Point queries, ranges of every size and writes in a random mix on a
/// store read cold, against the model; then checkpointed, reopened and
/// compared whole.
#[test]
fn queries_below_basements_agree_with_the_model() {
    for seed in 0..env_count("BETREEFS_BELOW_SEEDS", 3) {
        let (dev, store, mut model) = filled();
        let mut store = reopen(&dev, store);
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut chunks_read = 0;
        for step in 0..600u32 {
            let (file, b) = (rng.gen_range(0..6), rng.gen_range(0..420));
            match rng.gen_range(0..10) {
                0..=3 => {
                    let k = block_key(file, b);
                    assert!(answers_right(&store, &model, &k), "seed {seed} step {step}");
                }
                4 => {
                    let k = format!("dir\x00name{:06}", rng.gen_range(0..6100)).into_bytes();
                    let got = store.get(KeySpace::Meta, &k).unwrap();
                    assert_eq!(
                        got,
                        model_get(&model, KeySpace::Meta, &k),
                        "seed {seed} step {step}"
                    );
                }
                5 | 6 => {
                    let len = [1, 2, 3, 40][rng.gen_range(0..4)];
                    let (lo, hi) = (block_key(file, b), block_key(file, b + len));
                    assert!(
                        visit(&store, KeySpace::Data, &lo, &hi)
                            == model_range(&model, KeySpace::Data, &lo, &hi),
                        "seed {seed} step {step}"
                    );
                }
                7 | 8 => {
                    let mut batch = WriteBatch::new();
                    if rng.gen_bool(0.7) {
                        batch.put(KeySpace::Data, &block_key(file, b), &block(file, b, step));
                    } else {
                        batch.delete(KeySpace::Data, &block_key(file, b));
                    }
                    store.write(&batch).unwrap();
                    model.apply(&batch);
                }
                _ => {
                    if rng.gen_bool(0.2) {
                        chunks_read += store.stats().chunks_read;
                        store = reopen(&dev, store);
                    } else {
                        store.checkpoint().unwrap();
                    }
                }
            }
        }
        chunks_read += store.stats().chunks_read;
        assert!(
            chunks_read > 0,
            "seed {seed}: no query read below a basement"
        );
        let store = reopen(&dev, store);
        assert_matches(&store, &model);
        store.verify().unwrap();
    }
}

/// Every place a block's bytes lie in the device's image (each block is
/// unique; the log may hold a copy beside the leaf's).
fn find_block(image: &[u8], file: u32, b: u32) -> Vec<usize> {
    let needle = block(file, b, 0);
    let found: Vec<usize> = image
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle.as_slice())
        .map(|(at, _)| at)
        .collect();
    assert!(!found.is_empty(), "the block is on the device");
    found
}

/// Whether a query's answer is the model's (values are 4 KiB: not
/// printed).
fn answers_right(store: &Store, model: &Model, k: &[u8]) -> bool {
    store.get(KeySpace::Data, k).unwrap() == model_get(model, KeySpace::Data, k)
}

#[test]
fn a_damaged_chunk_fails_the_queries_that_read_it_and_verify() {
    let (dev, store, model) = filled();
    store.close().unwrap();
    let image = dev.current_image();
    for at in find_block(&image, 4, 150) {
        dev.mutate(|bytes| bytes[at + 2000] ^= 0x40);
    }
    let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
    // Its own chunk is refused, with the node named.
    match store.get(KeySpace::Data, &block_key(4, 150)) {
        Err(EngineError::CorruptNode { .. }) => {}
        Err(e) => panic!("a damaged chunk gave {e}"),
        Ok(_) => panic!("a damaged chunk was read"),
    }
    drop(store);
    // Chunks beside it read right; verify finds the damage.
    let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
    assert!(answers_right(&store, &model, &block_key(4, 151)));
    assert!(answers_right(&store, &model, &block_key(4, 149)));
    assert!(store.verify().is_err());
}

#[test]
fn a_damaged_chunk_directory_is_refused_and_found_by_verify() {
    let (dev, store, model) = filled();
    store.close().unwrap();
    // The live leaf holding block (1, 78), from the image's trees, and
    // the directory of its basement holding the block.
    let forge = common::forge::Forge::new(dev.current_image());
    let key = block_key(1, 78);
    let found = forge
        .nodes(KeySpace::Data)
        .into_iter()
        .find(|n| matches!(n.node.body, NodeBody::Leaf(_)) && n.bounds.contains(&key))
        .expect("a leaf holds the block");
    let NodeBody::Leaf(leaf) = &found.node.body else {
        unreachable!()
    };
    let basement = &leaf.basements[leaf.basement_for(&key)];
    let (Some(loc), Some(dir)) = (basement.loc, basement.dir) else {
        panic!("the block's basement has no chunk directory");
    };
    let Slot::OnDisk { extent, .. } = forge.btt.get(found.num) else {
        panic!("the leaf is not on disk");
    };
    let at = forge.sb.layout.extent_offset(extent) as usize + (loc.offset + loc.len) as usize;
    dev.mutate(|bytes| bytes[at + dir.len as usize / 2] ^= 0x01);
    let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
    match store.get(KeySpace::Data, &block_key(1, 78)) {
        Err(EngineError::CorruptNode { reason, .. }) => {
            assert!(reason.contains("chunk directory"), "{reason}")
        }
        Err(e) => panic!("a damaged directory gave {e}"),
        Ok(_) => panic!("a damaged directory was read"),
    }
    assert!(store.verify().is_err(), "verify passed a damaged directory");
    drop(store);
    // A whole read of the basement needs the directory too (it names the
    // raw values' keys): a scan over it is refused the same way.
    let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
    let (lo, hi) = (block_key(1, 0), block_key(1, 400));
    match store.visit_range(KeySpace::Data, &lo, &hi, &mut |_, _| {}) {
        Err(EngineError::CorruptNode { .. }) => {}
        Err(e) => panic!("a scan over a damaged directory gave {e}"),
        Ok(()) => panic!("a scan over a damaged directory passed"),
    }
    // Blocks of other basements still read.
    assert!(answers_right(&store, &model, &block_key(3, 5)));
}

#[test]
fn range_visits_that_stop_early_see_what_they_asked() {
    let (dev, store, model) = filled();
    let store = reopen(&dev, store);
    let (lo, hi) = (block_key(0, 5), block_key(0, 7));
    let mut seen = Vec::new();
    store
        .visit_range(KeySpace::Data, &lo, &hi, &mut |k, _| seen.push(k.to_vec()))
        .unwrap();
    let want: Vec<Vec<u8>> = model_range(&model, KeySpace::Data, &lo, &hi)
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(seen, want);
    // The iterator the same way.
    let got: Vec<Vec<u8>> = store
        .range(KeySpace::Data, &lo, Some(&hi))
        .map(|r| r.unwrap().0)
        .collect();
    assert_eq!(got, want);
}

/// Power cut at a random device write during block writes, syncs and
/// checkpoints: the recovered store holds a state at or after the last
/// sync, and cold point queries — read below the basements — answer
/// what a scan of it gives, key by key.
#[test]
fn after_a_power_cut_cold_queries_below_basements_answer_the_recovered_state() {
    let mut chunks_read = 0;
    for seed in 0..env_count("BETREEFS_BELOW_SEEDS", 3) {
        let mut rng = SmallRng::seed_from_u64(1000 + seed);
        let dev = MemDevice::new(256 << 20);
        let store = Store::create_on(Arc::new(dev.clone()), options()).unwrap();
        dev.fail_after_writes(rng.gen_range(1..300));
        let mut history = common::History::default();
        for step in 0..rng.gen_range(20..120u32) {
            let mut batch = WriteBatch::new();
            for _ in 0..16 {
                let (file, b) = (rng.gen_range(0..2), rng.gen_range(0..160));
                if rng.gen_bool(0.9) {
                    batch.put(KeySpace::Data, &block_key(file, b), &block(file, b, step));
                } else {
                    batch.delete(KeySpace::Data, &block_key(file, b));
                }
            }
            if !history.write(&store, &batch, &mut rng, 8) {
                break;
            }
        }
        let mode = CrashMode::from_random(rng.gen());
        dev.power_off();
        let image = dev.crash_image(mode);
        drop(store);
        let context = format!("seed {seed}, {mode:?}");
        let recovered_dev = MemDevice::from_image(image);
        let recovered = Store::open_on(Arc::new(recovered_dev.clone()), options())
            .unwrap_or_else(|e| panic!("{context}: recovery failed: {e}"));
        recovered
            .verify()
            .unwrap_or_else(|e| panic!("{context}: {e}"));
        let state = common::dump(&recovered);
        assert!(
            history.since_synced().contains(&state),
            "{context}: no state at or after the last sync"
        );
        // Closed (checkpointed) and opened again: every leaf cold. Each
        // block, present or not, asked alone.
        recovered.close().unwrap();
        let cold = Store::open_on(Arc::new(recovered_dev), options()).unwrap();
        for file in 0..2 {
            for b in 0..160 {
                let k = block_key(file, b);
                let want = state.spaces[KeySpace::Data.index()].get(&k).cloned();
                assert!(
                    cold.get(KeySpace::Data, &k).unwrap() == want,
                    "{context}: block ({file}, {b})"
                );
            }
        }
        chunks_read += cold.stats().chunks_read;
    }
    assert!(chunks_read > 0, "no query read below a basement");
}
