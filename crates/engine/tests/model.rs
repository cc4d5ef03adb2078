//! Model-based tests: random operation sequences against the engine and a
//! BTreeMap, across flushes, splits, merges, evictions, checkpoints and
//! reopen.

mod common;

use std::sync::Arc;

use betreefs_engine::merge::{patch_arg, record_arg};
use betreefs_engine::{KeySpace, RecordOp, Store, WriteBatch, MERGE_PATCH, MERGE_RECORD};
use common::{assert_matches, mem_store, small_options, Model};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use rand::{rngs::SmallRng, Rng, SeedableRng};

#[derive(Clone, Debug)]
enum Op {
    Write(WriteBatch),
    Get(KeySpace, Vec<u8>),
    Scan(KeySpace, Vec<u8>, Vec<u8>),
    Checkpoint,
    Reopen,
}

/// Keys from a tiny alphabet (including the bytes a file system reserves)
/// so that operations collide and prefixes nest.
fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop::sample::select(vec![0u8, 1, 2, b'a', b'b', 0xff]),
        0..7,
    )
}

fn value_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => prop::collection::vec(any::<u8>(), 0..200),
        1 => (0usize..9000, any::<u8>()).prop_map(|(n, b)| vec![b; n]),
    ]
}

fn ks_strategy() -> impl Strategy<Value = KeySpace> {
    prop::sample::select(KeySpace::ALL.to_vec())
}

fn message_strategy() -> impl Strategy<Value = (KeySpace, betreefs_engine::Message)> {
    use betreefs_engine::Message;
    let put = (ks_strategy(), key_strategy(), value_strategy())
        .prop_map(|(ks, key, value)| (ks, Message::Put { key, value }));
    let delete =
        (ks_strategy(), key_strategy()).prop_map(|(ks, key)| (ks, Message::Delete { key }));
    let patch = (
        ks_strategy(),
        key_strategy(),
        0u64..5000,
        prop::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(ks, key, off, bytes)| {
            (
                ks,
                Message::Upsert {
                    key,
                    func: MERGE_PATCH,
                    arg: patch_arg(off, &bytes),
                },
            )
        });
    let record = (
        ks_strategy(),
        key_strategy(),
        0usize..6,
        any::<u64>(),
        0u8..4,
    )
        .prop_map(|(ks, key, slot, v, op)| {
            let op = match op {
                0 => RecordOp::Set(slot, v),
                1 => RecordOp::Max(slot, v),
                2 => RecordOp::Add(slot, v),
                _ => RecordOp::Sub(slot, v),
            };
            (
                ks,
                Message::Upsert {
                    key,
                    func: MERGE_RECORD,
                    arg: record_arg(&[op]),
                },
            )
        });
    let range = (ks_strategy(), key_strategy(), key_strategy()).prop_map(|(ks, a, b)| {
        let (start, end) = if a <= b { (a, b) } else { (b, a) };
        (ks, Message::RangeDelete { start, end })
    });
    let rename = (ks_strategy(), key_strategy(), key_strategy()).prop_map(|(ks, from, to)| {
        match common::subtree_rename(&from, &to) {
            Some(r) => (ks, Message::RangeRename(r)),
            None => (ks, Message::Delete { key: from }),
        }
    });
    prop_oneof![10 => put, 3 => delete, 3 => patch, 2 => record, 2 => range, 2 => rename]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let batch = prop::collection::vec(message_strategy(), 1..4).prop_map(|msgs| {
        let mut b = WriteBatch::new();
        for (ks, m) in msgs {
            b.push(ks, m);
        }
        Op::Write(b)
    });
    prop_oneof![
        30 => batch,
        4 => (ks_strategy(), key_strategy()).prop_map(|(ks, k)| Op::Get(ks, k)),
        1 => (ks_strategy(), key_strategy(), key_strategy()).prop_map(|(ks, a, b)| Op::Scan(ks, a, b)),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Reopen),
    ]
}

fn run_ops(ops: &[Op]) {
    let (dev, mut store) = mem_store(48 << 20, small_options());
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Write(batch) => {
                store.write(batch).expect("write");
                model.apply(batch);
            }
            Op::Get(ks, key) => assert_eq!(
                store.get(*ks, key).expect("get"),
                model.get(*ks, key),
                "get {key:?}"
            ),
            Op::Scan(ks, a, b) => {
                let got: Vec<_> = store
                    .range(*ks, a, Some(b))
                    .collect::<Result<_, _>>()
                    .expect("scan");
                let want: Vec<_> = if a < b {
                    model.spaces[ks.index()]
                        .range(a.clone()..b.clone())
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                } else {
                    Vec::new()
                };
                assert_eq!(got, want, "scan {a:?}..{b:?}");
            }
            Op::Checkpoint => store.checkpoint().expect("checkpoint"),
            Op::Reopen => {
                store.close().expect("close");
                store = Store::open_on(Arc::new(dev.clone()), small_options()).expect("reopen");
            }
        }
    }
    assert_matches(&store, &model);
    store.verify().expect("tree invariants");
    // Recovery from the log alone (no final checkpoint) gives the same.
    store.sync().expect("sync");
    let image = dev.current_image();
    drop(store);
    let recovered = Store::open_on(
        Arc::new(betreefs_store::MemDevice::from_image(image)),
        small_options(),
    )
    .expect("recover");
    assert_matches(&recovered, &model);
    recovered.verify().expect("tree invariants after recovery");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn engine_matches_btreemap(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run_ops(&ops);
    }
}

/// A longer seeded run that grows trees several levels deep and then
/// deletes most of them again, so merges and subtree drops run.
#[test]
fn deep_tree_grows_and_shrinks() {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut ops = Vec::new();
    for i in 0..6000u32 {
        let mut b = WriteBatch::new();
        let key = format!("k{:06}", rng.gen_range(0..4000u32)).into_bytes();
        let ks = if i % 3 == 0 {
            KeySpace::Meta
        } else {
            KeySpace::Data
        };
        match rng.gen_range(0..10) {
            0..=6 => b.put(ks, &key, &vec![i as u8; rng.gen_range(10..400)]),
            7 => b.delete(ks, &key),
            8 => b.upsert(
                ks,
                &key,
                MERGE_PATCH,
                &patch_arg(rng.gen_range(0..300), b"patch"),
            ),
            _ => b.upsert(ks, &key, MERGE_RECORD, &record_arg(&[RecordOp::Add(1, 1)])),
        };
        ops.push(Op::Write(b));
        if i % 1500 == 0 {
            ops.push(Op::Reopen);
        }
    }
    for lo in (0..4000u32).step_by(400) {
        let mut b = WriteBatch::new();
        b.range_delete(
            KeySpace::Data,
            format!("k{lo:06}").as_bytes(),
            format!("k{:06}", lo + 390).as_bytes(),
        );
        ops.push(Op::Write(b));
    }
    ops.push(Op::Checkpoint);
    run_ops(&ops);
}

#[test]
fn stats_count_what_happened() {
    let (_dev, store) = mem_store(48 << 20, small_options());
    for i in 0..3000u32 {
        store
            .put(KeySpace::Data, &i.to_be_bytes(), &[1; 100])
            .unwrap();
    }
    store.checkpoint().unwrap();
    let s = store.stats();
    assert_eq!(s.user_messages, 3000);
    assert_eq!(s.user_bytes_written, 3000 * 104);
    assert!(s.flushes > 0 && s.splits > 0 && s.checkpoints >= 2);
    assert!(s.node_bytes_written_per_level[0] > 0 && s.node_bytes_written_per_level[1] > 0);
    assert!(s.write_amplification > 1.0, "{}", s.write_amplification);
    assert!(s.checkpoint_micros_max > 0 && s.checkpoint_micros_total >= s.checkpoint_micros_max);
    assert!(s.tree_heights[KeySpace::Data.index()] >= 2);
}

/// Seeded runs that compare the whole store with the model after every
/// operation, so a failure names the first operation that went wrong.
#[test]
fn seeded_runs_checked_after_every_operation() {
    for seed in 0..6u64 {
        let mut runner = proptest::test_runner::TestRunner::new_with_rng(
            ProptestConfig::default(),
            proptest::test_runner::TestRng::from_seed(
                proptest::test_runner::RngAlgorithm::ChaCha,
                &[seed as u8; 32],
            ),
        );
        let ops = prop::collection::vec(op_strategy(), 300)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let (dev, mut store) = mem_store(48 << 20, small_options());
        let mut model = Model::default();
        for (i, op) in ops.iter().enumerate() {
            match op {
                Op::Write(batch) => {
                    store.write(batch).unwrap();
                    model.apply(batch);
                }
                Op::Checkpoint => store.checkpoint().unwrap(),
                Op::Reopen => {
                    store.close().unwrap();
                    store = Store::open_on(Arc::new(dev.clone()), small_options()).unwrap();
                }
                _ => continue,
            }
            if let Err(e) = store.verify() {
                panic!("seed {seed}: tree invalid after operation {i}: {e}");
            }
            let check = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                assert_matches(&store, &model)
            }));
            if check.is_err() {
                panic!("seed {seed}: diverged after operation {i}: {op:?}");
            }
        }
    }
}

/// Deletes shrink leaves until they merge, while new puts for the same
/// range wait in the parent's buffers; merged leaves that are too big split
/// again. Every buffered message must stay reachable (a merge-then-resplit
/// once left them in the wrong child's buffer).
#[test]
fn merges_and_resplits_keep_buffered_messages_reachable() {
    for seed in 0..20u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let (_dev, store) = mem_store(48 << 20, small_options());
        let mut model = Model::default();
        for i in 0..6000u32 {
            let mut b = WriteBatch::new();
            // First fill 1500 keys, then mostly delete with a few puts mixed in.
            let key = if i < 1500 {
                i
            } else {
                rng.gen_range(0..1500u32)
            }
            .to_be_bytes();
            if i >= 1500 && rng.gen_range(0..100) < 85 {
                b.delete(KeySpace::Data, &key);
            } else {
                b.put(
                    KeySpace::Data,
                    &key,
                    &vec![i as u8; rng.gen_range(100..400)],
                );
            }
            store.write(&b).unwrap();
            model.apply(&b);
            if i % 50 == 0 {
                if let Err(e) = store.verify() {
                    panic!("seed {seed} op {i}: {e}");
                }
            }
            if i % 400 == 399 {
                store.compact().unwrap();
            }
        }
        assert_matches(&store, &model);
        let s = store.stats();
        assert!(s.merges > 0, "the workload must merge nodes: {s:?}");
    }
}

/// Dropping a store without `close` (and without any sync) still makes
/// what it holds durable through a final checkpoint.
#[test]
fn drop_without_close_checkpoints() {
    let (dev, store) = mem_store(48 << 20, small_options());
    for i in 0..500u32 {
        store
            .put(KeySpace::Meta, &i.to_be_bytes(), b"kept")
            .unwrap();
    }
    drop(store);
    let reopened = Store::open_on(Arc::new(dev), small_options()).unwrap();
    assert_eq!(common::scan_all(&reopened, KeySpace::Meta).len(), 500);
    assert_eq!(
        reopened.stats().log_replayed_records,
        0,
        "the final checkpoint covered everything"
    );
}

/// A range rename of a range spanning many leaves moves every pair, clears
/// the destination first, and replays from the log to the same state.
#[test]
fn range_rename_moves_many_leaves_and_replays() {
    let (dev, store) = mem_store(64 << 20, small_options());
    let mut model = Model::default();
    let mut batch = WriteBatch::new();
    for i in 0..3000u32 {
        let mut key = b"src\x00".to_vec();
        key.extend_from_slice(&i.to_be_bytes());
        batch.put(KeySpace::Data, &key, &[i as u8; 100]);
        if i % 3 == 0 {
            batch.put(KeySpace::Data, &[b"dst\x00", &key[4..]].concat(), b"old");
        }
        if batch.len() > 50 {
            store.write(&batch).unwrap();
            model.apply(&batch);
            batch = WriteBatch::new();
        }
    }
    batch.put(KeySpace::Data, b"dst\x00zzz-stale", b"gone after rename");
    batch.put(KeySpace::Data, b"src", b"outside the range");
    store.write(&batch).unwrap();
    model.apply(&batch);
    store.checkpoint().unwrap();

    let rename = common::subtree_rename(b"src", b"dst").unwrap();
    let mut batch = WriteBatch::new();
    batch.push(
        KeySpace::Data,
        betreefs_engine::Message::RangeRename(rename),
    );
    store.write(&batch).unwrap();
    model.apply(&batch);
    assert_matches(&store, &model);
    assert_eq!(
        store.get(KeySpace::Data, b"dst\x00zzz-stale").unwrap(),
        None
    );
    store.sync().unwrap();

    // Crash before any checkpoint: the rename must come back from the log.
    dev.power_off();
    let image = dev.crash_image(betreefs_store::CrashMode::DropUnsynced);
    drop(store);
    let reopened = Store::open_on(
        Arc::new(betreefs_store::MemDevice::from_image(image)),
        small_options(),
    )
    .unwrap();
    assert!(reopened.stats().log_replayed_records >= 1);
    assert_matches(&reopened, &model);
    reopened.verify().unwrap();

    let overlapping = betreefs_engine::RangeRename {
        start: b"a\x00".to_vec(),
        end: b"a\x02".to_vec(),
        old_prefix_len: 1,
        new_prefix: b"a\x00x".to_vec(),
    };
    let mut bad = WriteBatch::new();
    bad.push(
        KeySpace::Meta,
        betreefs_engine::Message::RangeRename(overlapping),
    );
    assert!(matches!(
        reopened.write(&bad),
        Err(betreefs_engine::EngineError::InvalidMessage(_))
    ));
}
