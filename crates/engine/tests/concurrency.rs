//! Several threads writing, reading, scanning and syncing at once, with the
//! background flusher and checkpoints running; and a query reading a leaf
//! from the device while other requests go on.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use betreefs_engine::merge::patch_arg;
use betreefs_engine::{KeySpace, Options, Store, TurnHook, WriteBatch, MERGE_PATCH};
use betreefs_store::{finishes_within, HeldReads, MemDevice};
use common::small_options;
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Four threads write, delete, read and scan keys of their own, racing
/// checkpoints, log flushes and (first) the tree flusher's turns, (then)
/// each other's settling in steps — the mount's way, whose merges into
/// leaves are worked out with the tree lock let go, one writer leaving its
/// settling to another; each checks its own keys as it goes, and the
/// store, reopened, holds them all.
#[test]
fn threads_share_one_store() {
    let rounds: u64 = common::env_count("BETREEFS_STRESS_ROUNDS", 1);
    for round in 0..rounds {
        share_one_store(round, true, false);
        share_one_store(round, false, false);
        share_one_store(round, false, true);
    }
}

/// One run of [`threads_share_one_store`]; with `background_apply` the
/// threads that do not work after their replies leave the application
/// of what they stage past the bound to the applier.
fn share_one_store(round: u64, background_flush: bool, background_apply: bool) {
    let mut options = small_options();
    options.log_flush_interval = Some(Duration::from_millis(5));
    options.checkpoint_interval = Some(Duration::from_millis(50));
    // A node per turn: writers run between the checkpoint's encoding turns.
    options.checkpoint_turn_bytes = 1;
    // Background flushing, a part of a buffer per turn, or settling in
    // steps.
    options.background_flush = background_flush;
    options.flush_turn_bytes = 1;
    options.background_apply = background_apply;
    let (dev, store) = common::mem_store(64 << 20, options.clone());
    let store = Arc::new(store);
    let workers: Vec<_> = (0..4u8)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t as u64 + 100 * round);
                let mut mine = BTreeMap::new();
                // Half the threads leave their writes' work for after
                // each operation, as a FUSE serving thread does.
                let works_after_reply = t % 2 == 0;
                if works_after_reply {
                    store.work_after_replies_on_this_thread();
                }
                for i in 0..3000u32 {
                    if works_after_reply && store.has_work_after_reply() {
                        store.work_after_reply().unwrap();
                    }
                    let key = [t, rng.gen_range(0..200u8), rng.gen()].to_vec();
                    match rng.gen_range(0..10) {
                        0..=5 => {
                            let v = vec![t; rng.gen_range(1..200)];
                            store.put(KeySpace::Data, &key, &v).unwrap();
                            mine.insert(key, v);
                        }
                        6 => {
                            store.delete(KeySpace::Data, &key).unwrap();
                            mine.remove(&key);
                        }
                        7 => assert_eq!(
                            store.get(KeySpace::Data, &key).unwrap(),
                            mine.get(&key).cloned()
                        ),
                        8 => {
                            let got: Vec<_> = store
                                .range(KeySpace::Data, &[t], Some(&[t + 1]))
                                .collect::<Result<_, _>>()
                                .unwrap();
                            let want: Vec<_> = mine.clone().into_iter().collect();
                            if got != want {
                                let have: BTreeMap<_, _> = got.iter().cloned().collect();
                                let extra: Vec<_> = have.keys().filter(|k| !mine.contains_key(*k)).take(4).collect();
                                let missing: Vec<_> = mine.keys().filter(|k| !have.contains_key(*k)).take(4).collect();
                                let wrong: Vec<_> = mine.iter().filter(|(k, v)| have.get(*k).is_some_and(|h| h != *v)).map(|(k, _)| k).take(4).collect();
                                panic!("thread {t} op {i}: scan got {} entries, expected {}; extra {extra:?} missing {missing:?} wrong {wrong:?}; verify: {:?}", got.len(), want.len(), store.verify());
                            }
                        }
                        _ => {
                            if i % 7 == 0 {
                                store.sync().unwrap();
                            }
                        }
                    }
                }
                mine
            })
        })
        .collect();
    let mut expected = BTreeMap::new();
    for w in workers {
        expected.extend(w.join().unwrap());
    }
    let stats = store.stats();
    assert!(stats.checkpoints > 1);
    if !background_flush {
        assert!(stats.step_merges_unlocked > 0, "no merge made unlocked");
    }
    store.sync().unwrap();
    let image = dev.current_image();
    drop(store);
    let reopened = Store::open_on(Arc::new(MemDevice::from_image(image)), small_options()).unwrap();
    let all: BTreeMap<_, _> = common::scan_all(&reopened, KeySpace::Data)
        .into_iter()
        .collect();
    assert_eq!(all, expected);
}

/// No intervals, no read-ahead, a 64 KiB staging bound.
fn staging_64k_options() -> Options {
    Options {
        log_flush_interval: None,
        checkpoint_interval: None,
        read_ahead: false,
        staged_write_bytes: 64 << 10,
        ..Options::default()
    }
}

/// A batch that cannot be staged and changes nothing: a range rename of
/// keys the tests never write.
fn empty_range_rename() -> WriteBatch {
    let mut batch = WriteBatch::new();
    batch.range_rename(KeySpace::Data, b"none/", b"none0", 4, b"void");
    batch
}

fn numbered(i: u32) -> Vec<u8> {
    format!("key{i:05}").into_bytes()
}

fn value_of(i: u32, version: u8) -> Vec<u8> {
    vec![version; 500 + i as usize % 7]
}

/// Runs `f` on another thread and gives its result, or fails the test if
/// it has not returned within a generous bound (it would be waiting for
/// the held read).
fn completes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    finishes_within(Duration::from_secs(20), f)
        .unwrap_or_else(|| panic!("{what} waited for a held device read"))
}

/// What lets a held thread's reads go on, once dropped: the
/// announcements of its reads and their go.
type HeldRelease = (Receiver<u64>, Sender<()>);

/// A get of `key` on a thread of its own whose device reads are held,
/// once its first read (of `what`) has arrived: the thread, and the
/// announcements of its reads with their go — dropping them lets it read
/// on.
fn held_get(
    store: &Arc<Store>,
    device: &Arc<HeldReads>,
    key: Vec<u8>,
    what: &str,
) -> (std::thread::JoinHandle<Option<Vec<u8>>>, HeldRelease) {
    let (arrived, held) = channel();
    let (go, wait) = channel();
    let query = {
        let (store, device) = (store.clone(), device.clone());
        std::thread::spawn(move || {
            device.hold_reads_of_this_thread(arrived, wait);
            store.get(KeySpace::Data, &key).unwrap()
        })
    };
    held.recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{what} is read from the device: {e}"));
    (query, (held, go))
}

/// A store of `keys` numbered keys with a root over a few leaves (few
/// enough keys that every node above a leaf is the root), closed, on a
/// device that can hold a thread's reads; and its options.
fn root_over_leaves(keys: u32) -> (Arc<HeldReads>, Options) {
    let options = Options {
        cache_bytes: 8 << 20,
        ..small_options()
    };
    let (dev, store) = common::mem_store(32 << 20, options.clone());
    for i in 0..keys {
        store
            .put(KeySpace::Data, &numbered(i), &value_of(i, 1))
            .unwrap();
    }
    store.compact().unwrap();
    store.close().unwrap();
    (Arc::new(HeldReads::new(dev)), options)
}

/// A point query that must read its leaf from the device holds no lock
/// while it reads: a cached query and writes complete meanwhile. And what
/// it read is not cached when the tree changed the leaf in the meantime
/// (here: writes flushed into it), so it answers with the new value.
#[test]
fn requests_go_on_while_a_query_reads_its_leaf() {
    let keys = 60;
    let (device, options) = root_over_leaves(keys);
    let (first, last) = (0, keys - 1);
    // Opens the store again and caches the root and the first key's leaf
    // only (the root is read under the lock: nothing above it is cached).
    let cold_store = || {
        let store = Store::open_on(device.clone(), options.clone()).unwrap();
        assert_eq!(
            store.get(KeySpace::Data, &numbered(first)).unwrap(),
            Some(value_of(first, 1))
        );
        assert_eq!(store.stats().leaves_read_unlocked, 0);
        store
    };
    // Nothing held: the last key's leaf is read outside the lock and cached.
    let store = cold_store();
    assert_eq!(
        store.get(KeySpace::Data, &numbered(last)).unwrap(),
        Some(value_of(last, 1))
    );
    let stats = store.stats();
    assert_eq!(
        (stats.leaves_read_unlocked, stats.unlocked_reads_dropped),
        (1, 0)
    );
    store.close().unwrap();

    let store = Arc::new(cold_store());

    let (cold, release) = held_get(&store, &device, numbered(last), "the last key's leaf");

    let cached = {
        let store = store.clone();
        completes("a cached query", move || {
            store.get(KeySpace::Data, &numbered(first)).unwrap()
        })
    };
    assert_eq!(cached, Some(value_of(first, 1)));
    // A new value for the held query's key and new keys after it, enough
    // to be flushed into its leaf (read again by this thread, dirtied).
    let after_last = move |j: u32| format!("key{last:05}+{j:03}").into_bytes();
    {
        let store = store.clone();
        completes("writes", move || {
            store
                .put(KeySpace::Data, &numbered(last), &value_of(last, 3))
                .unwrap();
            for j in 0..60 {
                store
                    .put(KeySpace::Data, &after_last(j), &value_of(j, 3))
                    .unwrap();
            }
        });
    }
    assert!(store.stats().messages_flushed > 0);
    // Let the held query read on.
    drop(release);
    assert_eq!(cold.join().unwrap(), Some(value_of(last, 3)));
    for j in 0..60 {
        assert_eq!(
            store.get(KeySpace::Data, &after_last(j)).unwrap(),
            Some(value_of(j, 3))
        );
    }
    // What the held query read was dropped: the tree had the leaf by then.
    let stats = store.stats();
    assert_eq!(
        (stats.leaves_read_unlocked, stats.unlocked_reads_dropped),
        (0, 1)
    );
    store.verify().unwrap();
}

/// A point query whose leaf is cached without the basement it needs reads
/// that basement holding no lock: a cached query and a write complete
/// meanwhile, and the basement is cached after. When writes flush into
/// the leaf meanwhile (it is read whole and dirtied), what was read is
/// dropped and the query answers with the new value.
#[test]
fn requests_go_on_while_a_query_reads_a_basement() {
    let keys = 60;
    let (device, options) = root_over_leaves(keys);
    // Two keys of the first leaf, basements apart (a basement holds about
    // four of these values).
    let (first, later) = (0, 9);
    // Opens the store again and caches the root and the first leaf with
    // the first key's basement only (all read under the lock: the root
    // was not cached).
    let cold_store = || {
        let store = Store::open_on(device.clone(), options.clone()).unwrap();
        assert_eq!(
            store.get(KeySpace::Data, &numbered(first)).unwrap(),
            Some(value_of(first, 1))
        );
        Arc::new(store)
    };
    let held_query =
        |store: &Arc<Store>| held_get(store, &device, numbered(later), "the later key's basement");
    let cached_query = |store: &Arc<Store>| {
        let store = store.clone();
        let got = completes("a cached query", move || {
            store.get(KeySpace::Data, &numbered(first)).unwrap()
        });
        assert_eq!(got, Some(value_of(first, 1)));
    };

    // Other requests go on while the basement is read; it is cached after.
    let store = cold_store();
    let (query, release) = held_query(&store);
    cached_query(&store);
    let new_key = format!("key{:05}+", keys + 1).into_bytes();
    {
        let store = store.clone();
        let key = new_key.clone();
        completes("a write", move || {
            store.put(KeySpace::Data, &key, b"new").unwrap()
        });
    }
    drop(release);
    assert_eq!(query.join().unwrap(), Some(value_of(later, 1)));
    let stats = store.stats();
    assert_eq!(
        (stats.basement_reads_unlocked, stats.unlocked_reads_dropped),
        (1, 0)
    );
    // Cached now: no read at all.
    let read_before = store.stats().device_bytes_read;
    assert_eq!(
        store.get(KeySpace::Data, &numbered(later)).unwrap(),
        Some(value_of(later, 1))
    );
    assert_eq!(store.stats().device_bytes_read, read_before);
    Arc::into_inner(store).unwrap().close().unwrap();

    // Writes flushed into the leaf while the basement is read: the read is
    // dropped, and the query sees the new value.
    let store = cold_store();
    let (query, release) = held_query(&store);
    cached_query(&store);
    {
        let store = store.clone();
        completes("writes", move || {
            store
                .put(KeySpace::Data, &numbered(later), &value_of(later, 3))
                .unwrap();
            // Deletes of keys the leaf does not hold, enough to be flushed
            // into it: the leaf keeps its size and its bounds (no split),
            // and is loaded whole.
            for j in 0..1000 {
                let key = format!("key{first:05}+{j:04}").into_bytes();
                store.delete(KeySpace::Data, &key).unwrap();
            }
        });
    }
    assert!(store.stats().messages_flushed > 0);
    assert_eq!(store.stats().splits, 0);
    drop(release);
    assert_eq!(query.join().unwrap(), Some(value_of(later, 3)));
    let stats = store.stats();
    assert_eq!(
        (stats.basement_reads_unlocked, stats.unlocked_reads_dropped),
        (0, 1)
    );
    store.verify().unwrap();
}

/// A hook that, once armed, holds the thread that calls it (announcing
/// it on the receiver) until the sender is dropped; it disarms itself.
fn hook_that_holds_once() -> (TurnHook, Arc<AtomicBool>, Receiver<()>, Sender<()>) {
    hook_that_holds_once_on(|| true)
}

/// [`hook_that_holds_once`], holding only a thread for which `here` says
/// so.
fn hook_that_holds_once_on(
    here: fn() -> bool,
) -> (TurnHook, Arc<AtomicBool>, Receiver<()>, Sender<()>) {
    let (arrived, held) = channel();
    let (go, wait) = channel::<()>();
    let armed = Arc::new(AtomicBool::new(false));
    let hold = {
        let armed = armed.clone();
        let (arrived, wait) = (Mutex::new(arrived), Mutex::new(wait));
        move || {
            if here() && armed.swap(false, Ordering::SeqCst) {
                let _ = arrived.lock().unwrap().send(());
                let _ = wait.lock().unwrap().recv();
            }
        }
    };
    (TurnHook(Arc::new(hold)), armed, held, go)
}

/// A store made with `options` holding keys 0..400 ([`put_numbered`]),
/// and the model of it: what [`overwrite_numbered_in_rounds`] rewrites.
fn store_of_400_numbered(options: Options) -> (Arc<Store>, BTreeMap<Vec<u8>, Vec<u8>>) {
    let (_dev, store) = common::mem_store(32 << 20, options);
    let store = Arc::new(store);
    let mut model = BTreeMap::new();
    put_numbered(&store, &mut model, 400);
    (store, model)
}

/// A thread overwriting keys 0..400 ([`numbered`]) in rounds 2 to 20,
/// round `r` writing `value_of(i, r)`: enough for cascades of settling
/// in a store of [`small_options`] holding those keys.
fn overwrite_numbered_in_rounds(store: &Arc<Store>) -> std::thread::JoinHandle<()> {
    overwrite_first_in_rounds(store, 400, Arc::default())
}

/// [`overwrite_numbered_in_rounds`] of keys `0..n`, ending after the put
/// during which `stop` was set, if one was.
fn overwrite_first_in_rounds(
    store: &Arc<Store>,
    n: u32,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let store = store.clone();
    std::thread::spawn(move || {
        for round in 2..=20u8 {
            for i in 0..n {
                store
                    .put(KeySpace::Data, &numbered(i), &value_of(i, round))
                    .unwrap();
                if stop.load(Ordering::SeqCst) {
                    return;
                }
            }
        }
    })
}

/// What [`overwrite_numbered_in_rounds`] leaves: its last round.
fn last_round_of_overwrites() -> impl Iterator<Item = (Vec<u8>, Vec<u8>)> {
    (0..400).map(|i| (numbered(i), value_of(i, 20)))
}

/// A put of `key` and a query of it, each on a thread of its own, complete
/// (while a writer is held somewhere) and agree.
fn a_write_and_a_query_complete(store: &Arc<Store>, key: &[u8]) {
    {
        let (store, key) = (store.clone(), key.to_vec());
        completes("a write", move || {
            store.put(KeySpace::Data, &key, b"written").unwrap()
        });
    }
    let got = {
        let (store, key) = (store.clone(), key.to_vec());
        completes("a query", move || store.get(KeySpace::Data, &key).unwrap())
    };
    assert_eq!(got, Some(b"written".to_vec()));
}

/// Puts keys `0..n` (numbered, version 1) into the store and the model.
fn put_numbered(store: &Store, model: &mut BTreeMap<Vec<u8>, Vec<u8>>, n: u32) {
    for i in 0..n {
        store
            .put(KeySpace::Data, &numbered(i), &value_of(i, 1))
            .unwrap();
        model.insert(numbered(i), value_of(i, 1));
    }
}

/// The store's data key space holds the model exactly, and the tree
/// verifies.
fn assert_store_holds(store: &Store, model: &BTreeMap<Vec<u8>, Vec<u8>>) {
    let all: BTreeMap<_, _> = common::scan_all(store, KeySpace::Data)
        .into_iter()
        .collect();
    assert_eq!(&all, model);
    store.verify().unwrap();
}

/// A writer whose settle step flushes into a leaf the cache does not hold
/// reads that leaf holding no lock: a cached query and a write complete
/// while its read is held at the device, and afterwards every key reads
/// back as written.
#[test]
fn requests_go_on_while_a_writer_reads_the_leaf_it_flushes_into() {
    let keys = 60;
    let (device, options) = root_over_leaves(keys);
    let last = keys - 1;
    let store = Arc::new(Store::open_on(device.clone(), options).unwrap());
    let mut model: BTreeMap<_, _> = (0..keys).map(|i| (numbered(i), value_of(i, 1))).collect();
    // The root is cached; so is the first key's leaf, now.
    assert_eq!(
        store.get(KeySpace::Data, &numbered(0)).unwrap(),
        Some(value_of(0, 1))
    );
    // One batch of keys after the last one, enough to take the root past
    // a node's worth: its settling flushes them into the last leaf.
    let after_last = move |j: u32| format!("key{last:05}+{j:03}").into_bytes();
    let (arrived, held) = channel();
    let (go, wait) = channel();
    let writer = {
        let (store, device) = (store.clone(), device.clone());
        std::thread::spawn(move || {
            device.hold_reads_of_this_thread(arrived, wait);
            let mut batch = WriteBatch::new();
            for j in 0..40 {
                batch.put(KeySpace::Data, &after_last(j), &value_of(j, 2));
            }
            store.write(&batch).unwrap();
        })
    };
    held.recv_timeout(Duration::from_secs(20))
        .expect("the writer reads the leaf it flushes into");
    let cached = {
        let store = store.clone();
        completes("a cached query", move || {
            store.get(KeySpace::Data, &numbered(0)).unwrap()
        })
    };
    assert_eq!(cached, Some(value_of(0, 1)));
    let key = b"key00000+written".to_vec();
    a_write_and_a_query_complete(&store, &key);
    drop((held, go));
    writer.join().unwrap();
    model.extend((0..40).map(|j| (after_last(j), value_of(j, 2))));
    model.insert(key, b"written".to_vec());
    assert!(store.stats().leaves_read_for_flushes >= 1);
    assert_store_holds(&store, &model);
}

/// A serving thread that hands long work on (a FUSE io_uring queue's,
/// `Store::hand_long_work_on_from_this_thread`) leaves a settling whose
/// step must read its leaf from the device to the thread it hands such
/// work to: after its work the settling is pending and flagged long, and
/// it read nothing; another thread then reads the leaf and settles. A
/// thread that does not hand long work on reads and settles itself.
#[test]
fn a_settling_that_reads_is_left_to_the_worker_by_a_thread_that_hands_long_work_on() {
    for hands_on in [true, false] {
        let keys = 60;
        let (device, options) = root_over_leaves(keys);
        let last = keys - 1;
        let store = Arc::new(Store::open_on(device, options).unwrap());
        let mut model: BTreeMap<_, _> = (0..keys).map(|i| (numbered(i), value_of(i, 1))).collect();
        // The root is cached; the last key's leaf is not.
        assert_eq!(
            store.get(KeySpace::Data, &numbered(0)).unwrap(),
            Some(value_of(0, 1))
        );
        let after_last = move |j: u32| format!("key{last:05}+{j:03}").into_bytes();
        let leaves_read = store.stats().leaves_read_for_flushes;
        let serving = {
            let store = store.clone();
            std::thread::spawn(move || {
                store.work_after_replies_on_this_thread();
                if hands_on {
                    store.hand_long_work_on_from_this_thread();
                }
                // Too large to stage: applied under the lock, its settling
                // (into the last leaf) left for after the reply.
                let mut batch = WriteBatch::new();
                for j in 0..40 {
                    batch.put(KeySpace::Data, &after_last(j), &value_of(j, 2));
                }
                store.write(&batch).unwrap();
                assert!(store.has_work_after_reply());
                store.work_after_reply().unwrap();
                (
                    store.has_work_after_reply(),
                    store.work_after_reply_is_long(),
                )
            })
        };
        let (pending, long) = serving.join().unwrap();
        model.extend((0..40).map(|j| (after_last(j), value_of(j, 2))));
        let stats = store.stats();
        if hands_on {
            assert!(pending && long, "the settling was not left flagged long");
            assert_eq!(
                stats.leaves_read_for_flushes, leaves_read,
                "the serving thread read"
            );
            assert!(stats.settles_handed_on >= 1);
            // The worker's turn (a thread that hands nothing on).
            store.work_after_reply().unwrap();
            assert!(!store.has_work_after_reply() && !store.work_after_reply_is_long());
        } else {
            assert!(!pending && !long, "the settling was left: {pending} {long}");
            assert_eq!(stats.settles_handed_on, 0);
        }
        assert!(store.stats().leaves_read_for_flushes > leaves_read);
        assert_store_holds(&store, &model);
    }
}

/// A write whose batch overflows a root settles in steps (one flush or one
/// split each, the tree whole in between), and other requests take the
/// lock between two steps: here a query and a write complete while a
/// writer is held after its first step, and everything reads back as
/// written.
#[test]
fn requests_go_on_between_the_steps_of_a_writers_flushes() {
    let (hold, armed, held, go) = hook_that_holds_once();
    let options = Options {
        cache_bytes: 8 << 20,
        settle_step_hook: Some(hold),
        ..small_options()
    };
    // Enough for a root over interior nodes over leaves.
    let (store, mut model) = store_of_400_numbered(options);
    assert!(store.stats().tree_heights[KeySpace::Data as usize] >= 2);
    let steps_before = store.stats().settle_steps;

    armed.store(true, Ordering::SeqCst);
    // Overwrites until one of them sets off a cascade; the hook holds
    // the writer after its first step.
    let writer = overwrite_numbered_in_rounds(&store);
    held.recv_timeout(Duration::from_secs(20))
        .expect("a write settles in steps");
    let key = b"between steps".to_vec();
    a_write_and_a_query_complete(&store, &key);
    drop(go);
    writer.join().unwrap();
    model.extend(last_round_of_overwrites());
    model.insert(key, b"written".to_vec());
    assert!(store.stats().settle_steps > steps_before);
    assert_store_holds(&store, &model);
}

/// [`small_options`] with an 8 MiB cache whose `step_merge_hook` holds
/// the first merge a writer works out once armed
/// ([`hook_that_holds_once`]).
fn options_holding_a_step_merge() -> (Options, Arc<AtomicBool>, Receiver<()>, Sender<()>) {
    let (hold, armed, held, go) = hook_that_holds_once();
    let options = Options {
        cache_bytes: 8 << 20,
        step_merge_hook: Some(hold),
        ..small_options()
    };
    (options, armed, held, go)
}

/// A step of a writer's settling works out its merge into a leaf, most of
/// its work, with the tree lock let go: while a writer is held in that
/// merge, a query completes; let go, the step puts the merge in place,
/// and everything reads back as written.
#[test]
fn queries_go_on_while_a_step_merges_into_a_leaf() {
    let (options, armed, held, go) = options_holding_a_step_merge();
    let (store, mut model) = store_of_400_numbered(options);
    let merges_before = store.stats().step_merges_unlocked;

    armed.store(true, Ordering::SeqCst);
    let writer = overwrite_numbered_in_rounds(&store);
    held.recv_timeout(Duration::from_secs(20))
        .expect("a write's settling merges into a leaf");
    let got = {
        let store = store.clone();
        finishes_within(Duration::from_secs(20), move || {
            store.get(KeySpace::Data, &numbered(7)).unwrap()
        })
        .expect("a query waited for a step's merge")
    };
    assert!(
        (1..=20).any(|round| got == Some(value_of(7, round))),
        "the query read {got:?}"
    );
    drop(go);
    writer.join().unwrap();
    model.extend(last_round_of_overwrites());
    assert!(store.stats().step_merges_unlocked > merges_before);
    assert_store_holds(&store, &model);
}

/// Other writers go on too while a step's merge into a leaf is worked out:
/// a write too large to stage (applied under the tree lock) completes
/// while the merging writer is held, and leaves its own settling to that
/// writer. The write replaced the messages the held merge was made from
/// (as many, as large: only the buffer's identity tells), so the step, let
/// go, makes the merge again under the lock rather than put the stale one
/// in place — which would lose the write. (A root over leaves: every step
/// merges out of a root buffer, which the write reaches.)
#[test]
fn writers_go_on_while_a_step_merges_and_a_stale_merge_is_made_again() {
    let (options, armed, held, go) = options_holding_a_step_merge();
    let (_dev, store) = common::mem_store(32 << 20, options);
    let store = Arc::new(store);
    let mut model = BTreeMap::new();
    put_numbered(&store, &mut model, 40);
    assert_eq!(store.stats().tree_heights[KeySpace::Data as usize], 1);
    let before = store.stats();

    armed.store(true, Ordering::SeqCst);
    // Overwrites keys 0..40 in rounds until it has been held.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = overwrite_first_in_rounds(&store, 40, stop.clone());
    held.recv_timeout(Duration::from_secs(20))
        .expect("a write's settling merges into a leaf");
    stop.store(true, Ordering::SeqCst);
    // Every key again, its value as long as before, in one batch over a
    // quarter of the staging bound; the root stays over-full.
    let mut batch = WriteBatch::new();
    for i in 0..40 {
        batch.put(KeySpace::Data, &numbered(i), &value_of(i, 99));
    }
    {
        let store = store.clone();
        finishes_within(Duration::from_secs(20), move || {
            store.write(&batch).unwrap()
        })
        .expect("a write waited for another writer's merge");
    }
    drop(go);
    writer.join().unwrap();
    model.extend((0..40).map(|i| (numbered(i), value_of(i, 99))));
    let after = store.stats();
    assert!(after.settling_left_to_a_merging_writer > before.settling_left_to_a_merging_writer);
    assert!(after.step_merges_redone > before.step_merges_redone);
    assert_store_holds(&store, &model);
}

/// A step of a writer's settling moves at most `settle_step_messages`
/// point messages down, however few bytes they make (a quarter node of
/// small messages took milliseconds of the lock to merge into a leaf),
/// and the trees still hold everything written.
#[test]
fn a_settle_step_moves_no_more_messages_than_its_bound() {
    let options = Options {
        cache_bytes: 8 << 20,
        settle_step_messages: 16,
        ..small_options()
    };
    let (_dev, store) = common::mem_store(32 << 20, options);
    let mut model = BTreeMap::new();
    // About 30 bytes a message: a quarter node (4 KiB) is over 100 of them.
    for round in 0..3u8 {
        for i in 0..3000 {
            let value = [round; 8];
            store.put(KeySpace::Data, &numbered(i), &value).unwrap();
            model.insert(numbered(i), value.to_vec());
        }
    }
    let stats = store.stats();
    assert!(stats.settle_steps > 0);
    assert!(
        (1..=16).contains(&stats.settle_step_messages_max),
        "a step moved {} messages",
        stats.settle_step_messages_max
    );
    assert_store_holds(&store, &model);
}

/// A step into a leaf rewrites no more of its basements than a quarter
/// node fills (here 4 KiB of 2 KiB basements: two), however widely its
/// messages spread over the leaf (uniform keys rewrote every basement of
/// a leaf in one step), and the trees still hold everything written.
#[test]
fn a_settle_step_rewrites_a_bounded_span_of_a_leaf() {
    let options = Options {
        cache_bytes: 8 << 20,
        ..small_options()
    };
    let span = (options.node_size / 4 / options.basement_size) as u64;
    let (_dev, store) = common::mem_store(32 << 20, options);
    let store = Arc::new(store);
    let mut model = BTreeMap::new();
    put_numbered(&store, &mut model, 2000);
    // Overwrites of keys drawn uniformly over every leaf.
    model.extend(overwrite_until_evicting(&store).join().unwrap());
    let stats = store.stats();
    assert!(stats.settle_steps > 0);
    assert!(
        (1..=span).contains(&stats.settle_step_basements_max),
        "a step rewrote {} basements of a leaf",
        stats.settle_step_basements_max
    );
    assert_store_holds(&store, &model);
}

/// With the write-back thread (`Options::background_write_back`), writers
/// that take the cache over its budget leave the dirty nodes to it: while
/// the thread is held in a write-back, a write and a query complete and
/// the overwriting goes on; the thread then brings the cache back within
/// its budget, and everything reads back as written, before and after
/// reopening.
#[test]
fn the_write_back_thread_writes_dirty_nodes_back_for_the_writers() {
    let (hold, armed, held, go) =
        hook_that_holds_once_on(|| std::thread::current().name() == Some("betreefs-write-back"));
    armed.store(true, Ordering::SeqCst);
    let options = Options {
        background_write_back: true,
        evict_step_hook: Some(hold),
        ..small_options()
    };
    let (dev, store, mut model) = store_evicting_in_steps(options.clone());
    let writer = overwrite_until_evicting(&store);
    held.recv_timeout(Duration::from_secs(20))
        .expect("the write-back thread writes a dirty node back");
    let key = b"key00000+while the thread writes back".to_vec();
    a_write_and_a_query_complete(&store, &key);
    let written = writer.join().unwrap();
    drop(go);
    model.extend(written);
    model.insert(key, b"written".to_vec());
    common::wait_until("the cache back within its budget", || {
        let stats = store.stats();
        stats.cache_bytes <= stats.cache_budget_bytes
    });
    assert!(store.stats().background_eviction_steps > 0);
    assert_store_holds(&store, &model);
    store.sync().unwrap();
    let image = dev.current_image();
    drop(store);
    let reopened = Store::open_on(Arc::new(MemDevice::from_image(image)), small_options()).unwrap();
    assert_store_holds(&reopened, &model);
}

/// A write that takes the cache over budget writes dirty nodes back one
/// per step, each device write made with the tree lock let go: here a
/// query and a write complete while a writer is held in its first
/// write-back, and everything reads back as written.
#[test]
fn requests_go_on_while_a_writer_writes_a_dirty_node_back() {
    let (hold, armed, held, go) = hook_that_holds_once();
    let (_dev, store, mut model) = store_evicting_in_steps(Options {
        evict_step_hook: Some(hold),
        ..small_options()
    });
    let steps_before = store.stats().eviction_steps;
    armed.store(true, Ordering::SeqCst);
    let writer = overwrite_until_evicting(&store);
    held.recv_timeout(Duration::from_secs(20))
        .expect("a write evicts in steps");
    let key = b"during a write-back".to_vec();
    a_write_and_a_query_complete(&store, &key);
    drop(go);
    model.extend(writer.join().unwrap());
    model.insert(key, b"written".to_vec());
    assert!(store.stats().eviction_steps > steps_before);
    assert_store_holds(&store, &model);
}

/// A node that changes while its image is on the way to the device keeps
/// the change: the image is dropped (its extent freed), not taken for the
/// node's copy. Here a checkpoint runs while a writer is held in its
/// write-back — the checkpoint writes the node itself and marks it clean,
/// which takes it out as any change does — and the store holds everything
/// written, before and after it is reopened.
#[test]
fn a_write_back_whose_node_changed_meanwhile_is_dropped() {
    a_write_back_held_while_a_checkpoint_runs_is_dropped(|hold| Options {
        evict_step_hook: Some(hold),
        ..small_options()
    });
}

/// The image of a node written back is encoded with the tree lock let go
/// too: the same, with the writer held while it encodes the image, which
/// is then dropped before it is given an extent.
#[test]
fn a_write_back_whose_node_changed_while_it_was_encoded_is_dropped() {
    a_write_back_held_while_a_checkpoint_runs_is_dropped(|hold| Options {
        evict_encode_hook: Some(hold),
        ..small_options()
    });
}

/// A writer held in its first write-back by the hook that `options` puts
/// in place: a write and a query complete, a checkpoint runs, the
/// write-back is dropped, and everything reads back as written, before
/// and after reopening.
fn a_write_back_held_while_a_checkpoint_runs_is_dropped(options: impl FnOnce(TurnHook) -> Options) {
    let (hold, armed, held, go) = hook_that_holds_once();
    let (dev, store, mut model) = store_evicting_in_steps(options(hold));
    assert_eq!(store.stats().write_backs_dropped, 0);
    armed.store(true, Ordering::SeqCst);
    let writer = overwrite_until_evicting(&store);
    held.recv_timeout(Duration::from_secs(20))
        .expect("a write evicts in steps");
    store.checkpoint().unwrap();
    let key = b"after the checkpoint".to_vec();
    a_write_and_a_query_complete(&store, &key);
    drop(go);
    model.extend(writer.join().unwrap());
    model.insert(key, b"written".to_vec());
    assert!(store.stats().write_backs_dropped >= 1);
    assert_store_holds(&store, &model);
    drop(store);
    let reopened = Store::open_on(Arc::new(dev), small_options()).unwrap();
    assert_store_holds(&reopened, &model);
}

/// A store of 2000 keys made with `options` (whose writers evict in
/// steps); the model of what it holds.
fn store_evicting_in_steps(
    options: Options,
) -> (MemDevice, Arc<Store>, BTreeMap<Vec<u8>, Vec<u8>>) {
    let (dev, store) = common::mem_store(32 << 20, options);
    let store = Arc::new(store);
    let mut model = BTreeMap::new();
    put_numbered(&store, &mut model, 2000);
    (dev, store, model)
}

/// A thread overwriting keys drawn uniformly over every leaf, 20,000 of
/// them (enough to take the cache over budget, where a hook may hold it
/// in a write-back); joined, what it wrote.
fn overwrite_until_evicting(
    store: &Arc<Store>,
) -> std::thread::JoinHandle<BTreeMap<Vec<u8>, Vec<u8>>> {
    let store = store.clone();
    std::thread::spawn(move || {
        let mut rng = SmallRng::seed_from_u64(11);
        let mut written = BTreeMap::new();
        for _ in 0..20_000 {
            let i = rng.gen_range(0..2000);
            store
                .put(KeySpace::Data, &numbered(i), &value_of(i, 2))
                .unwrap();
            written.insert(numbered(i), value_of(i, 2));
        }
        written
    })
}

/// A merge function (id 200) that, given the argument `hold`, announces
/// its call and waits until the sender is dropped: the tree lock is held
/// exclusively meanwhile by whoever applies it to a leaf. Otherwise it
/// sets the value to its argument.
fn merge_that_holds() -> (Options, Receiver<()>, Sender<()>) {
    let (arrived, held) = channel();
    let (go, wait) = channel::<()>();
    let (arrived, wait) = (Mutex::new(arrived), Mutex::new(wait));
    let mut options = small_options();
    options
        .merges
        .register(
            200,
            Arc::new(move |_old: Option<&[u8]>, arg: &[u8]| {
                if arg == b"hold" {
                    let _ = arrived.lock().unwrap().send(());
                    let _ = wait.lock().unwrap().recv();
                }
                arg.to_vec()
            }),
        )
        .unwrap();
    (options, held, go)
}

/// A store on a device of `bytes` (with `options` from
/// [`merge_that_holds`]) holding 200 numbered keys, compacted, and an
/// upsert of the holding merge onto the eighth that the next compaction
/// applies to its leaf; and what it holds.
fn compacted_with_an_upsert_that_holds(
    options: Options,
    bytes: u64,
) -> (Arc<Store>, BTreeMap<Vec<u8>, Vec<u8>>) {
    let (_dev, store) = common::mem_store(bytes, options);
    let store = Arc::new(store);
    let mut model = BTreeMap::new();
    put_numbered(&store, &mut model, 200);
    store.compact().unwrap();
    store
        .upsert(KeySpace::Data, &numbered(7), 200, b"hold")
        .unwrap();
    model.insert(numbered(7), b"hold".to_vec());
    (store, model)
}

/// Writes of point messages are staged without the tree lock, and a query
/// of a key they decide reads them alone: while a compaction holds the
/// tree lock exclusively (stopped inside a merge function as it applies
/// an upsert to a leaf), puts, deletes and queries of what they wrote
/// complete. Afterwards everything reads back as written, in order.
#[test]
fn staged_writes_and_their_queries_go_on_while_the_tree_lock_is_held() {
    let (options, held, go) = merge_that_holds();
    let (store, mut model) = compacted_with_an_upsert_that_holds(options, 32 << 20);
    // Read before: the counters' snapshot takes the tree lock.
    let staged_before = store.stats().writes_staged;
    let compaction = {
        let store = store.clone();
        std::thread::spawn(move || store.compact())
    };
    held.recv_timeout(Duration::from_secs(20))
        .expect("the compaction applies the upsert to its leaf");
    for i in 0..20u32 {
        let key = format!("staged{i:03}").into_bytes();
        a_write_and_a_query_complete(&store, &key);
        model.insert(key, b"written".to_vec());
    }
    {
        let store = store.clone();
        completes("a delete", move || {
            store.delete(KeySpace::Data, &numbered(3)).unwrap()
        });
    }
    model.remove(&numbered(3));
    let deleted = {
        let store = store.clone();
        completes("a query of a deleted key", move || {
            store.get(KeySpace::Data, &numbered(3)).unwrap()
        })
    };
    assert_eq!(deleted, None);
    drop(go);
    compaction.join().unwrap().unwrap();
    assert_eq!(store.stats().writes_staged, staged_before + 21);
    assert_store_holds(&store, &model);
    assert_eq!(
        store.get(KeySpace::Data, &numbered(7)).unwrap().as_deref(),
        Some(&b"hold"[..])
    );
}

/// With the applier (`Options::background_apply`), a writer that takes
/// the staged writes past their bound returns, and the applier applies
/// them: while a compaction holds the tree lock (stopped inside a merge
/// function), writes go on past the bound; a writer past twice the bound
/// waits for room (counted) until the applier, once the lock is let go,
/// takes some. Without the applier the writer that passes the bound waits
/// for the lock itself. Afterwards the store holds what was written.
#[test]
fn the_applier_applies_what_writers_take_past_the_bound() {
    for background_apply in [true, false] {
        // Nodes of the default size: a small node's quarter bounds what is
        // staged below the 64 KiB asked for.
        let (holding, held, go) = merge_that_holds();
        let options = Options {
            merges: holding.merges,
            background_apply,
            ..staging_64k_options()
        };
        let (store, mut model) = compacted_with_an_upsert_that_holds(options, 64 << 20);
        // Read before: the counters' snapshot takes the tree lock.
        let before = store.stats();
        let compaction = {
            let store = store.clone();
            std::thread::spawn(move || store.compact())
        };
        held.recv_timeout(Duration::from_secs(20))
            .expect("the compaction applies the upsert to its leaf");
        // About 1 KiB counted a write (its payload, and its key and value
        // in the staged map): the 64 KiB bound passed after ~60 of them,
        // twice the bound after ~120.
        let write_range = |range: std::ops::Range<u32>| {
            let store = store.clone();
            move || {
                for i in range {
                    store
                        .put(KeySpace::Data, &numbered(1000 + i), &value_of(i, 2))
                        .unwrap();
                }
            }
        };
        let (done, finished) = channel();
        let writer = {
            let write = write_range(0..90);
            std::thread::spawn(move || {
                write();
                let _ = done.send(());
            })
        };
        let past_bound = finished.recv_timeout(Duration::from_millis(500)).is_ok();
        assert_eq!(
            past_bound, background_apply,
            "writes past the bound returned while the tree lock was held: {past_bound}"
        );
        let past_twice_the_bound = if background_apply {
            let (done, finished) = channel();
            let write = write_range(90..400);
            let writer = std::thread::spawn(move || {
                write();
                let _ = done.send(());
            });
            assert!(
                finished.recv_timeout(Duration::from_millis(500)).is_err(),
                "writes past twice the bound returned while the applier could not apply"
            );
            Some(writer)
        } else {
            None
        };
        drop(go);
        compaction.join().unwrap().unwrap();
        writer.join().unwrap();
        let mut written = 0..90;
        if let Some(writer) = past_twice_the_bound {
            writer.join().unwrap();
            written = 0..400;
        }
        for i in written {
            model.insert(numbered(1000 + i), value_of(i, 2));
        }
        assert_store_holds(&store, &model);
        let stats = store.stats();
        if background_apply {
            assert!(stats.staging_room_waits >= 1, "{stats:?}");
            assert!(
                stats.work_after_reply > before.work_after_reply,
                "{stats:?}"
            );
        } else {
            assert_eq!(stats.staging_room_waits, 0);
            assert_eq!(stats.work_after_reply, 0);
        }
    }
}

/// With staging off, every write takes the tree lock: the same write
/// waits for the held compaction (what the test above would find
/// without staging).
#[test]
fn without_staging_a_write_waits_for_the_tree_lock() {
    let (mut options, held, go) = merge_that_holds();
    options.staged_write_bytes = 0;
    let (_dev, store) = common::mem_store(32 << 20, options);
    let store = Arc::new(store);
    let mut model = BTreeMap::new();
    put_numbered(&store, &mut model, 200);
    store
        .upsert(KeySpace::Data, &numbered(7), 200, b"hold")
        .unwrap();
    let compaction = {
        let store = store.clone();
        std::thread::spawn(move || store.compact())
    };
    held.recv_timeout(Duration::from_secs(20))
        .expect("the compaction applies the upsert to its leaf");
    let write = {
        let store = store.clone();
        finishes_within(Duration::from_millis(300), move || {
            store.put(KeySpace::Data, b"late", b"1").unwrap()
        })
    };
    assert!(write.is_none(), "the write did not wait for the tree lock");
    drop(go);
    compaction.join().unwrap().unwrap();
    assert_eq!(store.stats().writes_staged, 0);
}

/// What is staged is applied a quarter of the staging bound per hold of
/// the tree lock, the lock handed on between holds — by a writer past the
/// bound, by a write that cannot be staged (a range rename) and by a
/// checkpoint — and the store still answers as the model does.
#[test]
fn staged_batches_are_applied_a_quarter_bound_per_hold() {
    let per_hold = (64 << 10) / 4;
    let (_dev, store) = common::mem_store(64 << 20, staging_64k_options());
    let mut model = BTreeMap::new();
    // About 0.5 KiB a batch: a hundred stay under the bound.
    let put = |store: &Store, model: &mut BTreeMap<_, _>, keys: std::ops::Range<u32>| {
        for i in keys {
            let (key, value) = (numbered(i), value_of(i, 1));
            store.put(KeySpace::Data, &key, &value).unwrap();
            model.insert(key, value);
        }
    };
    put(&store, &mut model, 0..2000);
    let stats = store.stats();
    assert!(stats.staged_applications > 0, "{stats:?}");
    assert!(stats.staged_application_turns > 0, "{stats:?}");
    // Nothing staged, then under the bound, then a write that takes the
    // tree lock.
    store.checkpoint().unwrap();
    put(&store, &mut model, 2000..2100);
    let turns = store.stats().staged_application_turns;
    store.write(&empty_range_rename()).unwrap();
    assert!(store.stats().staged_application_turns > turns);
    put(&store, &mut model, 3000..3100);
    let turns = store.stats().staged_application_turns;
    store.checkpoint().unwrap();
    assert!(store.stats().staged_application_turns > turns);
    let stats = store.stats();
    assert!(
        stats.staged_application_bytes_max <= per_hold,
        "one hold applied {} staged bytes",
        stats.staged_application_bytes_max
    );
    assert_store_holds(&store, &model);
}

/// The longest piece of work after a reply is counted: a serving thread
/// doing it takes no request of its queue meanwhile, and the latency of a
/// request that came in does not start until it is done. Here the
/// settling that work does sleeps 2 ms after each step
/// (`Options::settle_step_hook`): the longest piece is at least that.
#[test]
fn the_longest_work_after_a_reply_is_counted() {
    let pause = Duration::from_millis(2);
    let options = Options {
        cache_bytes: 8 << 20,
        settle_step_hook: Some(TurnHook(Arc::new(move || std::thread::sleep(pause)))),
        ..small_options()
    };
    let (_dev, store) = common::mem_store(32 << 20, options);
    store.work_after_replies_on_this_thread();
    let mut model = BTreeMap::new();
    assert_eq!(store.stats().work_after_reply_micros_max, 0);
    for round in 1..=3u8 {
        for i in 0..400 {
            let (key, value) = (numbered(i), value_of(i, round));
            store.put(KeySpace::Data, &key, &value).unwrap();
            model.insert(key, value);
            if store.has_work_after_reply() {
                store.work_after_reply().unwrap();
            }
        }
    }
    let stats = store.stats();
    assert!(stats.work_after_reply > 0, "{stats:?}");
    assert!(stats.settle_steps > 0, "{stats:?}");
    assert!(
        stats.work_after_reply_micros_max >= pause.as_micros() as u64,
        "{stats:?}"
    );
    assert_store_holds(&store, &model);
}

/// A range rename is staged, not applied in its writer's call: on a
/// thread that works after its replies it leaves the application (the
/// surgery) for after the reply, flagged long; until then a query of a
/// key in its source or destination range, or a visit into either, has
/// everything staged applied first and sees the rename, and a query
/// elsewhere is answered without that. Where nothing works after
/// replies, the writer applies it in its own call. A range clone is not
/// staged.
#[test]
fn a_range_rename_is_staged_and_applied_after_the_reply() {
    let (_dev, store) = common::mem_store(64 << 20, staging_64k_options());
    store.work_after_replies_on_this_thread();
    let mut model = BTreeMap::new();
    let with = |prefix: &[u8], i: u32| [prefix, &[0], &i.to_be_bytes()].concat();
    // The store judges its space when it opens and when its promises are
    // set: a rename as the first write is staged too (a mount's `mv`).
    store.set_promised_bytes(1 << 20);
    let mut batch = WriteBatch::new();
    let rename = common::subtree_rename(b"none", b"nil").unwrap();
    batch.push(
        KeySpace::Data,
        betreefs_engine::Message::RangeRename(rename),
    );
    store.write(&batch).unwrap();
    assert_eq!(store.stats().writes_staged, 1);
    store.work_after_reply().unwrap();
    store.put(KeySpace::Data, b"first", b"1").unwrap();
    model.insert(b"first".to_vec(), b"1".to_vec());
    for i in 0..600u32 {
        let mut batch = WriteBatch::new();
        batch.put(KeySpace::Data, &with(b"src", i), &value_of(i, 1));
        model.insert(with(b"src", i), value_of(i, 1));
        if i % 3 == 0 {
            batch.put(KeySpace::Data, &with(b"dst", i + 1), b"old");
            model.insert(with(b"dst", i + 1), b"old".to_vec());
        }
        store.write(&batch).unwrap();
        if store.has_work_after_reply() {
            store.work_after_reply().unwrap();
        }
    }
    store.work_after_reply().unwrap();
    let renamed =
        |store: &Store, model: &mut BTreeMap<Vec<u8>, Vec<u8>>, from: &[u8], to: &[u8]| {
            let mut batch = WriteBatch::new();
            let rename = common::subtree_rename(from, to).unwrap();
            batch.push(
                KeySpace::Data,
                betreefs_engine::Message::RangeRename(rename),
            );
            batch.put(KeySpace::Data, b"zzz", from);
            let before = store.stats();
            store.write(&batch).unwrap();
            let range = |p: &[u8]| [p, &[0]].concat()..[p, &[2]].concat();
            let moved: Vec<_> = model
                .range(range(from))
                .map(|(k, v)| ([to, &k[from.len()..]].concat(), v.clone()))
                .collect();
            let (source, destination) = (range(from), range(to));
            model.retain(|k, _| !source.contains(k) && !destination.contains(k));
            model.extend(moved);
            model.insert(b"zzz".to_vec(), from.to_vec());
            before
        };

    let before = renamed(&store, &mut model, b"src", b"dst");
    let stats = store.stats();
    assert_eq!(stats.writes_staged, before.writes_staged + 1, "{stats:?}");
    let transplants =
        |s: &betreefs_engine::StatsSnapshot| s.range_renames_by_surgery + s.range_renames_copied;
    assert_eq!(transplants(&stats), transplants(&before), "not applied yet");
    assert!(store.has_work_after_reply() && store.work_after_reply_is_long());
    // Elsewhere: answered from the staged batches and the trees as they are.
    assert_eq!(
        store.get(KeySpace::Data, b"first").unwrap().as_deref(),
        Some(&b"1"[..])
    );
    assert_eq!(
        store.get(KeySpace::Data, b"zzz").unwrap().as_deref(),
        Some(&b"src"[..])
    );
    assert_eq!(transplants(&store.stats()), transplants(&before));
    // In the destination: applied first, in the query's call.
    assert_eq!(
        store.get(KeySpace::Data, &with(b"dst", 7)).unwrap(),
        Some(value_of(7, 1))
    );
    assert_eq!(store.get(KeySpace::Data, &with(b"dst", 600)).unwrap(), None);
    assert_eq!(transplants(&store.stats()), transplants(&before) + 1);
    assert_store_holds(&store, &model);

    // Back again, applied by the work after the reply; a visit into the
    // source range before it applies it too.
    let before = renamed(&store, &mut model, b"dst", b"src");
    assert!(store.work_after_reply_is_long());
    store.work_after_reply().unwrap();
    assert!(!store.work_after_reply_is_long() && !store.has_work_after_reply());
    assert_eq!(transplants(&store.stats()), transplants(&before) + 1);
    assert_store_holds(&store, &model);
    let before = renamed(&store, &mut model, b"src", b"dst");
    let visited: BTreeMap<_, _> = common::scan_all(&store, KeySpace::Data)
        .into_iter()
        .collect();
    assert_eq!(visited, model);
    assert_eq!(transplants(&store.stats()), transplants(&before) + 1);

    // A thread that does not work after its replies applies in its call.
    let before = std::thread::scope(|s| {
        s.spawn(|| renamed(&store, &mut model, b"dst", b"src"))
            .join()
            .unwrap()
    });
    assert_eq!(transplants(&store.stats()), transplants(&before) + 1);
    assert_store_holds(&store, &model);

    // A clone is not staged (it adds what it copies: the tree's space
    // check): applied in its writer's call on this thread too. (The
    // long-work flag of the rename a visit applied above stays until the
    // work after the reply runs.)
    store.work_after_reply().unwrap();
    assert!(!store.work_after_reply_is_long());
    let before = store.stats();
    let mut batch = WriteBatch::new();
    let clone = common::subtree_rename(b"src", b"cln").unwrap();
    batch.push(KeySpace::Data, betreefs_engine::Message::RangeClone(clone));
    store.write(&batch).unwrap();
    let stats = store.stats();
    assert_eq!(stats.writes_staged, before.writes_staged, "{stats:?}");
    let clones =
        |s: &betreefs_engine::StatsSnapshot| s.range_clones_by_surgery + s.range_clones_copied;
    assert_eq!(clones(&stats), clones(&before) + 1);
    assert!(!store.work_after_reply_is_long());
}

/// A writer on a thread that works after its replies (a FUSE serving
/// thread) leaves the application of what is staged past the bound for
/// `Store::work_after_reply`, and so does the next one (one piece of
/// pending work applies everything staged); past twice the bound a
/// writer applies in its own call. The store answers as the model does
/// before and after the work is done.
#[test]
fn writes_leave_their_work_for_after_the_reply() {
    let (_dev, store) = common::mem_store(64 << 20, staging_64k_options());
    store.work_after_replies_on_this_thread();
    let mut model = BTreeMap::new();
    // The store judged its space when it opened: the first write is
    // staged like the others, and leaves nothing.
    let staged = store.stats().writes_staged;
    store.put(KeySpace::Data, b"first", b"1").unwrap();
    model.insert(b"first".to_vec(), b"1".to_vec());
    assert!(!store.has_work_after_reply());
    assert_eq!(store.stats().writes_staged, staged + 1);
    let applications = store.stats().staged_applications;
    let mut i = 0;
    // About 0.5 KiB a batch: past the 64 KiB bound after ~130.
    while !store.has_work_after_reply() {
        assert!(i < 1000, "no work left after {i} writes");
        let (key, value) = (numbered(i), value_of(i, 1));
        store.put(KeySpace::Data, &key, &value).unwrap();
        model.insert(key, value);
        i += 1;
    }
    let stats = store.stats();
    assert_eq!(stats.staged_applications, applications);
    assert!(stats.writes_staged > 10, "{stats:?}");
    // Point queries read the staged batches.
    for (key, value) in &model {
        assert_eq!(
            store.get(KeySpace::Data, key).unwrap().as_ref(),
            Some(value)
        );
    }
    // The writers after it leave theirs too, up to twice the bound; then
    // one applies in its own call.
    let left = i;
    while store.stats().staged_applications == applications {
        assert!(
            i < left + 1000,
            "no application after {} more writes",
            i - left
        );
        let (key, value) = (numbered(i), value_of(i, 1));
        store.put(KeySpace::Data, &key, &value).unwrap();
        model.insert(key, value);
        i += 1;
    }
    // Another bound's worth: about as many writes as reached the first.
    assert!(
        i - left > left / 2,
        "applied after {} more writes ({left} reached the bound)",
        i - left
    );
    assert!(store.has_work_after_reply());
    store.work_after_reply().unwrap();
    assert!(!store.has_work_after_reply());
    assert_eq!(store.stats().work_after_reply, 1);
    assert_store_holds(&store, &model);
    // A range delete is staged: queries read it there.
    let staged = store.stats().writes_staged;
    let mut range_delete = WriteBatch::new();
    range_delete.range_delete(KeySpace::Data, &numbered(10), &numbered(20));
    store.write(&range_delete).unwrap();
    model.retain(|k, _| !(numbered(10)..numbered(20)).contains(k));
    assert_eq!(store.stats().writes_staged, staged + 1);
    assert_eq!(store.get(KeySpace::Data, &numbered(15)).unwrap(), None);
    assert!(store.get(KeySpace::Data, &numbered(20)).unwrap().is_some());
    assert_store_holds(&store, &model);
    // On another thread nothing is left.
    let store = Arc::new(store);
    let writer = store.clone();
    std::thread::spawn(move || {
        for i in 2000..2400 {
            writer
                .put(KeySpace::Data, &numbered(i), &value_of(i, 2))
                .unwrap();
        }
    })
    .join()
    .unwrap();
    assert!(!store.has_work_after_reply());
    for i in 2000..2400 {
        model.insert(numbered(i), value_of(i, 2));
    }
    assert_store_holds(&store, &model);
}

/// Range deletes staged past half their limit count as past the bound:
/// the writer that passes it leaves the application for after its reply,
/// and no later one takes the tree lock for passing the limit (a file
/// system's unlinks stage one range delete each).
#[test]
fn staged_range_deletes_past_half_their_limit_leave_work_after_the_reply() {
    let (_dev, store) = common::mem_store(64 << 20, staging_64k_options());
    store.work_after_replies_on_this_thread();
    store.put(KeySpace::Data, b"first", b"1").unwrap();
    let staged = store.stats().writes_staged;
    let mut deletes = 0;
    while !store.has_work_after_reply() {
        assert!(deletes < 64, "no work left after {deletes} range deletes");
        let (start, end) = (numbered(2 * deletes), numbered(2 * deletes + 1));
        store
            .write(WriteBatch::new().range_delete(KeySpace::Data, &start, &end))
            .unwrap();
        deletes += 1;
    }
    assert_eq!(deletes, 33);
    assert_eq!(store.stats().writes_staged, staged + 33);
    store.work_after_reply().unwrap();
    assert_eq!(store.stats().work_after_reply, 1);
    // Applied: room for as many again, all staged.
    for i in 100..164 {
        store
            .write(WriteBatch::new().range_delete(
                KeySpace::Data,
                &numbered(2 * i),
                &numbered(2 * i + 1),
            ))
            .unwrap();
        store.work_after_reply().unwrap();
    }
    assert_eq!(store.stats().writes_staged, staged + 33 + 64);
    assert_eq!(
        store.get(KeySpace::Data, b"first").unwrap().as_deref(),
        Some(&b"1"[..])
    );
}

/// A range visit merges what is staged in its range over the trees'
/// pairs, across leaves, and applies nothing (before, every visit applied
/// what was staged, in its call); only upserts onto the trees' values
/// staged in its range make it apply first.
#[test]
fn range_visits_merge_what_is_staged_without_applying_it() {
    let options = Options {
        node_size: 64 << 10,
        basement_size: 4 << 10,
        cache_bytes: 4 << 20,
        ..staging_64k_options()
    };
    let (_dev, store) = common::mem_store(64 << 20, options);
    let mut model = BTreeMap::new();
    put_numbered(&store, &mut model, 400);
    // Everything in the trees, across many leaves.
    store.checkpoint().unwrap();
    let (applications, staged) = {
        let stats = store.stats();
        (stats.staged_applications, stats.writes_staged)
    };
    let mut writes = 0;
    let mut write = |batch: &WriteBatch| {
        store.write(batch).unwrap();
        writes += 1;
    };
    let between = |i: u32| format!("key{i:05}+").into_bytes();
    for i in (5..400).step_by(40) {
        // A new key between two of the trees', a changed one, a deleted one.
        write(WriteBatch::new().put(KeySpace::Data, &between(i), b"new"));
        model.insert(between(i), b"new".to_vec());
        write(WriteBatch::new().put(KeySpace::Data, &numbered(i + 1), b"changed"));
        model.insert(numbered(i + 1), b"changed".to_vec());
        write(WriteBatch::new().delete(KeySpace::Data, &numbered(i + 2)));
        model.remove(&numbered(i + 2));
    }
    // A range delete, and a key put in its range after it.
    write(WriteBatch::new().range_delete(KeySpace::Data, &numbered(100), &numbered(150)));
    model.retain(|k, _| !(numbered(100)..numbered(150)).contains(k));
    write(WriteBatch::new().put(KeySpace::Data, &numbered(120), b"after"));
    model.insert(numbered(120), b"after".to_vec());
    assert_eq!(store.stats().writes_staged, staged + writes);
    let visited = |from: &[u8], end: &[u8]| {
        let mut pairs = Vec::new();
        store
            .visit_range(KeySpace::Data, from, end, &mut |k, v| {
                pairs.push((k.to_vec(), v.to_vec()))
            })
            .unwrap();
        pairs
    };
    let modelled = |model: &BTreeMap<Vec<u8>, Vec<u8>>, from: &[u8], end: &[u8]| -> Vec<_> {
        model
            .range(from.to_vec()..end.to_vec())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    for (from, end) in [
        (0, 400),
        (3, 7),
        (99, 151),
        (120, 121),
        (121, 150),
        (250, 380),
    ] {
        let (from, end) = (numbered(from), numbered(end));
        assert_eq!(visited(&from, &end), modelled(&model, &from, &end));
        let ranged: Vec<_> = store
            .range(KeySpace::Data, &from, Some(&end))
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(ranged, modelled(&model, &from, &end));
    }
    assert_eq!(
        common::scan_all(&store, KeySpace::Data),
        modelled(&model, b"", b"~")
    );
    assert_eq!(store.stats().staged_applications, applications);
    // An upsert onto a tree value: a visit of another range still merges,
    // one over its key applies first.
    let patch = patch_arg(0, b"P");
    store
        .write(WriteBatch::new().upsert(KeySpace::Data, &numbered(300), MERGE_PATCH, &patch))
        .unwrap();
    if let Some(v) = model.get_mut(&numbered(300)) {
        v[0] = b'P';
    }
    assert_eq!(
        visited(&numbered(0), &numbered(299)),
        modelled(&model, &numbered(0), &numbered(299))
    );
    assert_eq!(store.stats().staged_applications, applications);
    assert_eq!(
        visited(&numbered(290), &numbered(310)),
        modelled(&model, &numbered(290), &numbered(310))
    );
    assert!(store.stats().staged_applications > applications);
    assert_store_holds(&store, &model);
}

/// A write under the tree lock, on a thread that works after its
/// replies, leaves its settling and eviction for then when they have work
/// to do (small nodes and cache: often), and settles nothing itself.
#[test]
fn a_write_under_the_tree_lock_leaves_its_settling_when_due() {
    let (_dev, store) = common::mem_store(64 << 20, small_options());
    store.work_after_replies_on_this_thread();
    let mut model = BTreeMap::new();
    let mut left = 0;
    for i in 0..800 {
        let mut batch = empty_range_rename();
        batch.put(KeySpace::Data, &numbered(i), &value_of(i, 1));
        model.insert(numbered(i), value_of(i, 1));
        let stats = store.stats();
        let steps = (stats.settle_steps, stats.eviction_steps);
        store.write(&batch).unwrap();
        if store.has_work_after_reply() {
            left += 1;
            let stats = store.stats();
            assert_eq!(
                (stats.settle_steps, stats.eviction_steps),
                steps,
                "write {i} settled or evicted"
            );
            store.work_after_reply().unwrap();
            assert!(!store.has_work_after_reply());
        }
    }
    assert!(left > 10, "{left} writes left work");
    let stats = store.stats();
    assert!(stats.settle_steps + stats.eviction_steps > 0, "{stats:?}");
    assert_eq!(stats.work_after_reply, left);
    assert_store_holds(&store, &model);
}

/// With no log flusher, a writer whose records fill the log's buffer past
/// its bound (twice the eager bound: 2 MiB for this cache) writes the log
/// itself in its request — counted, with the time it took — so the buffer
/// never holds much more than the bound; with a flush under way it would
/// wait for that flush's pieces instead (`LogWriter::make_room`).
#[test]
fn a_writer_past_the_log_s_bound_writes_it_itself_when_nobody_else_does() {
    let options = Options {
        cache_bytes: 8 << 20,
        log_bytes: Some(32 << 20),
        ..common::mid_options()
    };
    let bound = 2u64 << 20;
    let (_dev, store) = common::mem_store(128 << 20, options);
    let value = vec![3u8; 16 << 10];
    let mut most = 0;
    for i in 0..400 {
        store.put(KeySpace::Data, &numbered(i), &value).unwrap();
        most = most.max(store.stats().log_unflushed_bytes);
    }
    let stats = store.stats();
    assert!(stats.writes_flushed_log >= 2, "{stats:?}");
    assert_eq!(stats.writes_waited_for_log, stats.writes_flushed_log);
    assert!(stats.log_wait_micros_total >= stats.log_wait_micros_max);
    assert!(stats.log_wait_micros_max > 0, "{stats:?}");
    assert!(
        most <= bound + value.len() as u64 + 1024,
        "the log's buffer held {most} unflushed bytes"
    );
    for i in (0..400).step_by(37) {
        assert_eq!(
            store.get(KeySpace::Data, &numbered(i)).unwrap(),
            Some(value.clone())
        );
    }
}

/// A checkpoint in flight does not keep the log from being written: with
/// the background thread held between two of its checkpoint's turns,
/// writers buffer more of the log than the eager bound (short of the
/// bound at which they write it themselves), and the log flusher writes
/// it meanwhile. Before the log flusher, the background thread did both,
/// and the log waited for the checkpoint: writers then flushed it in
/// their own requests, behind the checkpoint's writes.
#[test]
fn the_log_flusher_writes_the_log_while_a_checkpoint_is_in_flight() {
    let (hold, armed, held, go) = hook_that_holds_once();
    let options = Options {
        checkpoint_turn_hook: Some(hold),
        checkpoint_interval: Some(Duration::from_millis(10)),
        // A node per turn: any checkpoint stops at the hook.
        checkpoint_turn_bytes: 1,
        log_bytes: Some(16 << 20),
        ..small_options()
    };
    // This cache's eager bound is its floor (1 MiB); writers write the log
    // themselves past twice that.
    let eager = 1u64 << 20;
    let (_dev, store) = common::mem_store(64 << 20, options);
    // Let go before the store on a failure: its drop joins the thread held.
    let go = go;
    armed.store(true, Ordering::SeqCst);
    // Dirty nodes for a checkpoint of several turns.
    for i in 0..500 {
        store
            .put(KeySpace::Data, &numbered(i), &value_of(i, 1))
            .unwrap();
    }
    held.recv_timeout(Duration::from_secs(20))
        .expect("a background checkpoint stops between its turns");
    let value = vec![7u8; 1000];
    for i in 0..1500 {
        store.put(KeySpace::Meta, &numbered(i), &value).unwrap();
    }
    common::wait_until("the log written while the checkpoint is held", || {
        store.stats().log_unflushed_bytes < eager
    });
    assert_eq!(
        store.stats().writes_flushed_log,
        0,
        "no writer wrote the log itself"
    );
    drop(go);
    store.sync().unwrap();
    assert_eq!(
        store.get(KeySpace::Meta, &numbered(1499)).unwrap(),
        Some(value)
    );
}
