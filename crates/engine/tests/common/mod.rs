//! Shared pieces of the engine's integration tests: a reference model and
//! small-tree options that make every code path run on little data.
#![allow(dead_code)]

pub mod forge;

use std::collections::BTreeMap;
use std::sync::Arc;

use betreefs_engine::{KeySpace, MergeRegistry, Message, Options, Store, WriteBatch, KEY_SPACES};
use betreefs_store::{CrashMode, MemDevice};

/// Tiny nodes, basements and cache, no background threads (so a seed
/// replays exactly): splits, merges, evictions and log-full checkpoints
/// happen after a few hundred writes.
pub fn small_options() -> Options {
    Options {
        node_size: 16 << 10,
        basement_size: 2 << 10,
        fanout: 4,
        cache_bytes: 96 << 10,
        log_flush_interval: None,
        checkpoint_interval: None,
        log_bytes: Some(1 << 20),
        read_ahead: false,
        ..Options::default()
    }
}

/// Nodes of 256 KiB with basements of 8 KiB, a cache that holds a tree of
/// a few MB whole, no background threads: interior nodes large enough to
/// be read in part, leaves of many basements.
pub fn mid_options() -> Options {
    Options {
        node_size: 256 << 10,
        basement_size: 8 << 10,
        fanout: 8,
        cache_bytes: 64 << 20,
        log_bytes: Some(8 << 20),
        ..small_options()
    }
}

/// Key `i` of the tests that fill a tree in key order: `key` and seven
/// digits.
pub fn numbered_key(i: u32) -> Vec<u8> {
    format!("key{i:07}").into_bytes()
}

/// Polls `what` until it holds, failing after a minute: for what the
/// store's own threads do in their time.
pub fn wait_until(why: &str, what: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !what() {
        assert!(
            std::time::Instant::now() < deadline,
            "gave up waiting: {why}"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

pub fn mem_store(bytes: u64, options: Options) -> (MemDevice, Store) {
    let dev = MemDevice::new(bytes);
    let store = Store::create_on(Arc::new(dev.clone()), options).expect("create store");
    (dev, store)
}

/// A count from the environment (to run a test longer), or `default`.
pub fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// What the store should contain.
#[derive(Clone, Default, Debug, PartialEq, Eq)]
pub struct Model {
    pub spaces: [BTreeMap<Vec<u8>, Vec<u8>>; KEY_SPACES],
}

impl Model {
    pub fn apply(&mut self, batch: &WriteBatch) {
        let merges = MergeRegistry::default();
        for (ks, m) in batch.messages() {
            let map = &mut self.spaces[ks.index()];
            match &m {
                Message::Put { key, value } => {
                    map.insert(key.clone(), value.clone());
                }
                Message::Delete { key } => {
                    map.remove(key);
                }
                Message::Upsert { key, func, arg } => {
                    let new = merges
                        .apply(*func, map.get(key).map(|v| v.as_slice()), arg)
                        .expect("known function");
                    map.insert(key.clone(), new);
                }
                Message::RangeDelete { start, end } => remove_range(map, start, end),
                Message::RangeRename(r) | Message::RangeClone(r) => {
                    let (ds, de) = r.destination_range();
                    remove_range(map, &ds, &de);
                    let moved: Vec<_> = map
                        .range(r.start.clone()..r.end.clone())
                        .map(|(k, v)| (r.destination(k), v.clone()))
                        .collect();
                    if matches!(m, Message::RangeRename(_)) {
                        remove_range(map, &r.start, &r.end);
                    }
                    map.extend(moved);
                }
            }
        }
    }

    pub fn get(&self, ks: KeySpace, key: &[u8]) -> Option<Vec<u8>> {
        self.spaces[ks.index()].get(key).cloned()
    }
}

fn remove_range(map: &mut BTreeMap<Vec<u8>, Vec<u8>>, start: &[u8], end: &[u8]) {
    if start < end {
        let doomed: Vec<_> = map
            .range(start.to_vec()..end.to_vec())
            .map(|(k, _)| k.clone())
            .collect();
        for k in doomed {
            map.remove(&k);
        }
    }
}

/// A well-formed range rename of the "subtree" [from 00, from 02) to `to`,
/// or `None` when the two would overlap.
pub fn subtree_rename(from: &[u8], to: &[u8]) -> Option<betreefs_engine::RangeRename> {
    let with = |b: u8| [from, &[b]].concat();
    let r = betreefs_engine::RangeRename {
        start: with(0),
        end: with(2),
        old_prefix_len: from.len(),
        new_prefix: to.to_vec(),
    };
    r.check().is_ok().then_some(r)
}

/// Everything in one key space, through the range iterator.
pub fn scan_all(store: &Store, ks: KeySpace) -> Vec<(Vec<u8>, Vec<u8>)> {
    store
        .range(ks, b"", None)
        .collect::<Result<Vec<_>, _>>()
        .expect("scan")
}

/// Asserts the store holds exactly the model, by full scans and point reads.
pub fn assert_matches(store: &Store, model: &Model) {
    for ks in KeySpace::ALL {
        let expected: Vec<_> = model.spaces[ks.index()].clone().into_iter().collect();
        let actual = scan_all(store, ks);
        if actual != expected {
            let have: BTreeMap<_, _> = actual.iter().cloned().collect();
            let want = &model.spaces[ks.index()];
            let extra: Vec<_> = have
                .keys()
                .filter(|k| !want.contains_key(*k))
                .take(5)
                .collect();
            let missing: Vec<_> = want
                .keys()
                .filter(|k| !have.contains_key(*k))
                .take(5)
                .collect();
            let wrong: Vec<_> = want
                .iter()
                .filter(|(k, v)| have.get(*k).is_some_and(|h| h != *v))
                .map(|(k, _)| k)
                .take(5)
                .collect();
            panic!(
                "key space {ks:?}: store has {} entries, model {}; extra {extra:?}, missing {missing:?}, wrong values {wrong:?}",
                actual.len(),
                expected.len(),
            );
        }
        for (k, v) in expected.iter().step_by(7) {
            assert_eq!(
                store.get(ks, k).expect("get").as_ref(),
                Some(v),
                "get {k:?}"
            );
        }
    }
}

/// The states a store went through, batch by batch, and the last one
/// made durable: what a power cut may leave of them
/// ([`assert_power_cut_keeps_a_synced_prefix`]).
pub struct History {
    pub models: Vec<Model>,
    pub synced: usize,
}

impl Default for History {
    fn default() -> Self {
        History {
            models: vec![Model::default()],
            synced: 0,
        }
    }
}

impl History {
    /// Writes `batch` (its state noted first: a write that fails may
    /// still be durable), then syncs or checkpoints, each one time in
    /// `durable_one_in`. False once the store fails: the device was cut
    /// off.
    pub fn write(
        &mut self,
        store: &Store,
        batch: &WriteBatch,
        rng: &mut impl rand::Rng,
        durable_one_in: u32,
    ) -> bool {
        let mut next = self.models.last().cloned().unwrap_or_default();
        next.apply(batch);
        self.models.push(next);
        if store.write(batch).is_err() {
            return false;
        }
        let durable = match rng.gen_range(0..durable_one_in) {
            0 => store.sync().map(|_| true),
            1 => store.checkpoint().map(|_| true),
            _ => Ok(false),
        };
        match durable {
            Err(_) => false,
            Ok(true) => {
                self.synced = self.models.len() - 1;
                true
            }
            Ok(false) => true,
        }
    }

    /// The states at or after the last durable one.
    pub fn since_synced(&self) -> &[Model] {
        self.models.get(self.synced..).unwrap_or_default()
    }
}

/// Cuts the power of `mem` under `store` and recovers its crash image
/// (`mode`): the tree must be valid and hold one of `models[synced..]` —
/// the state after some batch at or after the last synced one.
pub fn assert_power_cut_keeps_a_synced_prefix(
    mem: &MemDevice,
    store: impl Sized,
    mode: CrashMode,
    context: &str,
    models: &[Model],
    synced: usize,
) {
    mem.power_off();
    let image = mem.crash_image(mode);
    drop(store);
    let recovered = Store::open_on(Arc::new(MemDevice::from_image(image)), small_options())
        .unwrap_or_else(|e| panic!("{context}: recovery failed: {e}"));
    recovered
        .verify()
        .unwrap_or_else(|e| panic!("{context}: tree invalid: {e}"));
    let state = dump(&recovered);
    assert!(
        models
            .get(synced..)
            .is_some_and(|after| after.contains(&state)),
        "{context}: recovered state matches no prefix at or after the last sync ({synced})"
    );
}

/// The whole contents of a store, as a model.
pub fn dump(store: &Store) -> Model {
    let mut model = Model::default();
    for ks in KeySpace::ALL {
        model.spaces[ks.index()] = scan_all(store, ks).into_iter().collect();
    }
    model
}

/// A random batch over a small key alphabet (1 to 3 messages of every kind).
pub fn random_batch(rng: &mut impl rand::Rng) -> WriteBatch {
    use betreefs_engine::merge::{patch_arg, record_arg};
    use betreefs_engine::{RecordOp, MERGE_PATCH, MERGE_RECORD};
    let mut batch = WriteBatch::new();
    for _ in 0..rng.gen_range(1..=3) {
        let ks = if rng.gen_bool(0.5) {
            KeySpace::Meta
        } else {
            KeySpace::Data
        };
        let key = random_key(rng);
        match rng.gen_range(0..20) {
            0..=10 => {
                let len = if rng.gen_bool(0.05) {
                    rng.gen_range(2000..9000)
                } else {
                    rng.gen_range(0..300)
                };
                batch.put(ks, &key, &vec![rng.gen(); len])
            }
            11..=13 => batch.delete(ks, &key),
            14..=16 => batch.upsert(
                ks,
                &key,
                MERGE_PATCH,
                &patch_arg(rng.gen_range(0..400), &[rng.gen(); 7]),
            ),
            18 => match subtree_rename(&key, &random_key(rng)) {
                Some(r) => batch.push(ks, Message::RangeRename(r)),
                None => batch.delete(ks, &key),
            },
            17 => batch.upsert(
                ks,
                &key,
                MERGE_RECORD,
                &record_arg(&[RecordOp::Add(rng.gen_range(0..4), 3)]),
            ),
            _ => {
                let other = random_key(rng);
                let (a, b) = if key <= other {
                    (key, other)
                } else {
                    (other, key)
                };
                batch.range_delete(ks, &a, &b)
            }
        };
    }
    batch
}

pub fn random_key(rng: &mut impl rand::Rng) -> Vec<u8> {
    const ALPHABET: [u8; 6] = [0, 1, 2, b'a', b'b', 0xff];
    (0..rng.gen_range(0..6))
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())])
        .collect()
}
