//! Background flushing (issue 11, item 2): writers leave their messages in
//! the roots' buffers and a thread of the store moves them down in turns.
//! A writer waits only past the backlog bound — and while it waits, reads,
//! syncs and checkpoints go on; power cuts while the flusher and
//! checkpoints run keep every synced write and a valid tree.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use betreefs_engine::{KeySpace, Options, Store, TurnHook, WriteBatch};
use betreefs_store::{CrashMode, MemDevice};
use common::{random_batch, small_options, wait_until, Model};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Holds the flusher before its next turn while closed.
#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    opened: Condvar,
}

/// Opens the gate when dropped, on a failed assertion too: the store's
/// drop joins the flusher, which would otherwise wait at the gate for ever.
struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

impl Gate {
    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.opened.notify_all();
    }

    fn pass(&self) {
        let mut closed = self.closed.lock().unwrap();
        while *closed {
            closed = self.opened.wait(closed).unwrap();
        }
    }
}

/// Small nodes, a cache large enough for a backlog of one and a half of
/// them, and turns of one buffer part each.
fn flushing_options() -> Options {
    Options {
        cache_bytes: 1 << 20,
        background_flush: true,
        flush_turn_bytes: 1,
        ..small_options()
    }
}

fn key(i: usize) -> Vec<u8> {
    format!("key{:06}", i * 7919 % 100_000).into_bytes()
}

fn value(i: usize) -> Vec<u8> {
    vec![(i % 251) as u8; 100]
}

const BATCH: usize = 10;

#[test]
fn writers_wait_past_the_backlog_bound_while_reads_syncs_and_checkpoints_go_on() {
    let gate = Arc::new(Gate::default());
    let mut options = flushing_options();
    let held = gate.clone();
    options.flush_turn_hook = Some(TurnHook(Arc::new(move || held.pass())));
    let (dev, store) = common::mem_store(64 << 20, options.clone());
    let store = Arc::new(store);
    let _open_on_drop = OpenOnDrop(gate.clone());
    let bound = store.stats().flush_backlog_bound_bytes;
    assert_eq!(
        bound,
        3 * options.node_size as u64 / 2,
        "a node and a half fit an eighth of this cache"
    );
    gate.set(true);
    let written = Arc::new(AtomicUsize::new(0));
    let batches = 400;
    let writer = {
        let (store, written) = (store.clone(), written.clone());
        std::thread::spawn(move || {
            for b in 0..batches {
                let mut batch = WriteBatch::new();
                for i in b * BATCH..(b + 1) * BATCH {
                    batch.put(KeySpace::Data, &key(i), &value(i));
                }
                store.write(&batch).unwrap();
                written.store((b + 1) * BATCH, Ordering::SeqCst);
            }
        })
    };
    wait_until("a writer waiting for the flusher", || {
        store.stats().writes_waited_for_flush > 0
    });
    // The writer waits, and the flusher is held: what the roots hold is
    // the bound and at most one batch more.
    let stats = store.stats();
    let batch_bytes = (BATCH * 200) as u64;
    assert!(
        stats.flush_backlog_bytes > bound && stats.flush_backlog_bytes <= bound + batch_bytes,
        "backlog {} with bound {bound}",
        stats.flush_backlog_bytes
    );
    let acknowledged = written.load(Ordering::SeqCst);
    assert!(acknowledged < batches * BATCH);
    // None of this needs the flusher.
    for i in 0..acknowledged {
        assert_eq!(store.get(KeySpace::Data, &key(i)).unwrap(), Some(value(i)));
    }
    store.sync().unwrap();
    store.checkpoint().unwrap();
    assert_eq!(written.load(Ordering::SeqCst), acknowledged, "held back");

    gate.set(false);
    writer.join().unwrap();
    wait_until("the flusher bringing the roots down to a node", || {
        store.stats().flush_backlog_bytes <= options.node_size as u64
    });
    let stats = store.stats();
    assert!(stats.flush_turns > 50, "{} turns", stats.flush_turns);
    assert!(stats.flush_wait_micros_total > 0);
    store.verify().unwrap();
    let mut expected = BTreeMap::new();
    for i in 0..batches * BATCH {
        expected.insert(key(i), value(i));
    }
    let all: BTreeMap<_, _> = common::scan_all(&store, KeySpace::Data)
        .into_iter()
        .collect();
    assert_eq!(all, expected);
    let store = Arc::into_inner(store).expect("the writer is gone");
    store.close().unwrap();
    let reopened = Store::open_on(Arc::new(dev), small_options()).unwrap();
    let all: BTreeMap<_, _> = common::scan_all(&reopened, KeySpace::Data)
        .into_iter()
        .collect();
    assert_eq!(all, expected);
}

/// Without the thread (`background_flush: false`, the default) writers
/// settle the roots themselves: no backlog, no turns.
#[test]
fn without_background_flushing_writers_settle_the_roots_themselves() {
    let options = Options {
        background_flush: false,
        ..flushing_options()
    };
    let (_dev, store) = common::mem_store(64 << 20, options.clone());
    for b in 0..100 {
        let mut batch = WriteBatch::new();
        for i in b * BATCH..(b + 1) * BATCH {
            batch.put(KeySpace::Data, &key(i), &value(i));
        }
        store.write(&batch).unwrap();
        assert!(store.stats().flush_backlog_bytes <= options.node_size as u64);
    }
    let stats = store.stats();
    assert_eq!((stats.flush_turns, stats.flush_backlog_bound_bytes), (0, 0));
    assert!(stats.flushes > 0);
}

/// Power cuts at every device write of a run in which the flusher moves
/// messages down in one-part turns while checkpoints run every few
/// milliseconds: recovery always finds a valid tree holding a prefix of
/// the batches written, at least as long as the last synced one.
#[test]
fn power_cuts_while_the_flusher_and_checkpoints_run_keep_a_synced_prefix() {
    let mut crash_at = 0u64;
    let mut crashed_runs = 0u64;
    let mut flush_turns = 0;
    // Every third device write (BETREEFS_FLUSH_CRASH_STRIDE=1 for all).
    let stride = common::env_count("BETREEFS_FLUSH_CRASH_STRIDE", 3);
    loop {
        let options = Options {
            checkpoint_interval: Some(Duration::from_millis(3)),
            checkpoint_turn_bytes: 1,
            ..flushing_options()
        };
        let mem = MemDevice::new(32 << 20);
        let store = Store::create_on(Arc::new(mem.clone()), options).unwrap();
        mem.fail_after_writes(crash_at);
        let mut rng = SmallRng::seed_from_u64(crash_at);
        let mut models = vec![Model::default()];
        let mut synced = 0;
        for i in 0..600 {
            let batch = random_batch(&mut rng);
            let mut next = models.last().cloned().unwrap_or_default();
            next.apply(&batch);
            if store.write(&batch).is_err() {
                break;
            }
            models.push(next);
            if i % 10 == 9 {
                if store.sync().is_err() {
                    break;
                }
                synced = models.len() - 1;
            }
            // Besides the timed ones, which may not come in a short run.
            if i % 100 == 99 && store.checkpoint().is_err() {
                break;
            }
        }
        let crashed = mem.has_crashed();
        flush_turns = flush_turns.max(store.stats().flush_turns);
        let mode = CrashMode::from_random(rng.gen());
        let context = format!("power cut after {crash_at} writes, {mode:?}");
        common::assert_power_cut_keeps_a_synced_prefix(
            &mem, store, mode, &context, &models, synced,
        );
        if !crashed {
            break;
        }
        crashed_runs += 1;
        crash_at += stride;
    }
    assert!(crashed_runs > 10, "only {crashed_runs} runs crashed");
    assert!(
        flush_turns > 10,
        "the flusher took only {flush_turns} turns"
    );
}
