//! Read-ahead of the next leaf during sequential scans: what it caches is
//! what the tree holds, also while writers change, split, write back and
//! evict the very leaves being read ahead.

mod common;

use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use betreefs_engine::{KeySpace, Options, Store, WriteBatch};
use betreefs_store::{Device, MemDevice};
use common::{small_options, wait_until};

fn options() -> Options {
    Options {
        read_ahead: true,
        cache_bytes: 256 << 10,
        ..small_options()
    }
}

fn key(i: u32) -> Vec<u8> {
    format!("key{i:08}").into_bytes()
}

fn value(i: u32, version: u32) -> Vec<u8> {
    let mut v = format!("{i}:{version}:").into_bytes();
    v.resize(600, b'v');
    v
}

/// Keys the first scan of a cold store reads: more than a basement holds
/// (each key is about 600 bytes, and basements of less than a block are
/// joined up to one), so that it reads on across basements inside the
/// first leaf, which is what starts read-ahead.
const FIRST: u32 = 12;

/// Scans [`from`, `to`) keys in chunks of `chunk` keys (each spanning
/// several basements), returning every pair.
fn scan(store: &Store, from: u32, to: u32, chunk: u32) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = from;
    while at < to {
        let end = (at + chunk).min(to);
        store
            .visit_range(KeySpace::Data, &key(at), &key(end), &mut |k, v| {
                out.push((k.to_vec(), v.to_vec()))
            })
            .unwrap();
        at = end;
    }
    out
}

/// A device holding keys 0..n at version 0 (a hundred to a batch),
/// written by a store now closed.
fn device_with_keys(n: u32) -> MemDevice {
    let (dev, store) = common::mem_store(64 << 20, options());
    for batch_start in (0..n).step_by(100) {
        let mut batch = WriteBatch::new();
        for i in batch_start..(batch_start + 100).min(n) {
            batch.put(KeySpace::Data, &key(i), &value(i, 0));
        }
        store.write(&batch).unwrap();
    }
    store.close().unwrap();
    dev
}

/// A store holding keys 0..n at version 0, opened again after they were
/// written: nothing cached but the roots.
fn cold_store_with_keys(n: u32) -> Store {
    Store::open_on(Arc::new(device_with_keys(n)), options()).unwrap()
}

/// Whether this thread is one of the store's read-ahead threads.
fn on_a_read_ahead_thread() -> bool {
    std::thread::current()
        .name()
        .is_some_and(|n| n.starts_with("betreefs-readahead"))
}

/// A device that counts the reads the read-ahead threads have in flight
/// and keeps each one in flight until another one joins it (or a second
/// passes): reads made one after another never overlap, reads made at
/// once do.
struct OverlappingReads {
    inner: MemDevice,
    in_flight: Mutex<(usize, usize)>,
    changed: Condvar,
}

impl OverlappingReads {
    fn most_at_once(&self) -> usize {
        self.in_flight.lock().unwrap().1
    }
}

impl Device for OverlappingReads {
    fn len_bytes(&self) -> u64 {
        self.inner.len_bytes()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)?;
        if on_a_read_ahead_thread() {
            let mut counts = self.in_flight.lock().unwrap();
            counts.0 += 1;
            counts.1 = counts.1.max(counts.0);
            self.changed.notify_all();
            let deadline = Instant::now() + Duration::from_secs(1);
            while counts.0 < 2 && Instant::now() < deadline {
                counts = self
                    .changed
                    .wait_timeout(counts, Duration::from_millis(20))
                    .unwrap()
                    .0;
            }
            counts.0 -= 1;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)
    }

    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
}

/// Read-ahead keeps several leaves' reads in flight at once — one at a
/// time, a scan runs at the device's single-request latency, not its
/// bandwidth — and the scan still sees every key once, in order.
#[test]
fn read_ahead_reads_several_leaves_at_once() {
    const N: u32 = 3000;
    let device = Arc::new(OverlappingReads {
        inner: device_with_keys(N),
        in_flight: Mutex::new((0, 0)),
        changed: Condvar::new(),
    });
    // A wide fanout: the leaves after the first share its parent, which
    // the first scan caches, so the read-ahead finds several to read.
    let options = Options {
        fanout: 16,
        ..options()
    };
    let store = Store::open_on(device.clone(), options).unwrap();
    // The first chunk reads on across basements inside the first leaf:
    // the leaves after it are read ahead (wait for them, the threads run
    // on their own; a scan going on meanwhile would read them itself).
    let first = scan(&store, 0, FIRST, FIRST);
    wait_until("read-ahead read one leaf at a time", || {
        device.most_at_once() >= 2
    });
    scan_the_rest_and_close(store, first, N);
}

/// Scans keys [`FIRST`].. of `n` after `first` (the keys before) and checks that
/// together they are every key with its first value; closes the store.
fn scan_the_rest_and_close(store: Store, first: Vec<(Vec<u8>, Vec<u8>)>, n: u32) {
    let rest = scan(&store, FIRST, n, 20);
    let all: Vec<_> = first.into_iter().chain(rest).collect();
    assert_eq!(all.len(), n as usize);
    for (i, (k, v)) in all.iter().enumerate() {
        assert_eq!((k, v), (&key(i as u32), &value(i as u32, 0)));
    }
    store.close().unwrap();
}

#[test]
fn sequential_scans_read_the_next_leaf_ahead() {
    const N: u32 = 3000;
    let store = cold_store_with_keys(N);
    // The first chunk reads on across basements inside the first leaf: the
    // next leaf is read ahead (wait for it, the thread runs on its own).
    let first = scan(&store, 0, FIRST, FIRST);
    wait_until("nothing was read ahead", || {
        store.stats().nodes_read_ahead > 0
    });
    scan_the_rest_and_close(store, first, N);
}

/// Writers overwrite and delete keys while readers scan sequentially (so
/// leaves, and basements of cached leaves, are read ahead while they are
/// flushed into, split, written back and evicted under a small cache):
/// every scan afterwards sees exactly the last write of every key, and the
/// tree verifies.
#[test]
fn read_ahead_never_caches_a_stale_leaf() {
    const N: u32 = 2000;
    let store = Arc::new(cold_store_with_keys(N));
    let model: Arc<Mutex<Vec<Option<u32>>>> = Arc::new(Mutex::new(vec![Some(0); N as usize]));
    let writer = {
        let (store, model) = (store.clone(), model.clone());
        std::thread::spawn(move || {
            let mut x: u32 = 7;
            for version in 1..=300u32 {
                let mut batch = WriteBatch::new();
                let mut model = model.lock().unwrap();
                for _ in 0..20 {
                    x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    let i = (x >> 8) % N;
                    if version % 7 == 0 {
                        batch.delete(KeySpace::Data, &key(i));
                        model[i as usize] = None;
                    } else {
                        batch.put(KeySpace::Data, &key(i), &value(i, version));
                        model[i as usize] = Some(version);
                    }
                }
                store.write(&batch).unwrap();
                drop(model);
                if version % 50 == 0 {
                    store.checkpoint().unwrap();
                }
            }
        })
    };
    // Two readers scan in chunks of basements (reading on across them),
    // a third visits one key at a time in key order (its reads of the
    // device are sequential: basements of cached leaves are read ahead).
    let readers: Vec<_> = (0..3)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                for round in 0..6 {
                    let from = (r * 500 + round * 97) % N;
                    if r == 2 {
                        for i in (from..N).step_by(3) {
                            visit_one_key(&store, i);
                        }
                    } else {
                        scan(&store, from, N, 15 + r);
                    }
                }
            })
        })
        .collect();
    writer.join().unwrap();
    for r in readers {
        r.join().unwrap();
    }
    let expected: Vec<(Vec<u8>, Vec<u8>)> = model
        .lock()
        .unwrap()
        .iter()
        .enumerate()
        .filter_map(|(i, v)| v.map(|version| (key(i as u32), value(i as u32, version))))
        .collect();
    assert_eq!(scan(&store, 0, N, 25), expected);
    store.verify().unwrap();
    let stats = store.stats();
    assert!(stats.nodes_read_ahead > 0 && stats.sequential_query_reads > 0);
}

/// Visits key `i` alone: a query short enough to stay inside one
/// basement, never reading on across basements itself (a directory
/// listing of a find).
fn visit_one_key(store: &Store, i: u32) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    store
        .visit_range(KeySpace::Data, &key(i), &key(i + 1), &mut |k, v| {
            out.push((k.to_vec(), v.to_vec()))
        })
        .unwrap();
    out
}

/// A device that counts the reads made by threads other than the
/// read-ahead readers: what queries read themselves.
struct QueryReads {
    inner: MemDevice,
    by_queries: std::sync::atomic::AtomicU64,
}

impl Device for QueryReads {
    fn len_bytes(&self) -> u64 {
        self.inner.len_bytes()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if !on_a_read_ahead_thread() {
            self.by_queries
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)
    }

    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
}

/// Visits of one key each, in key order (as a find lists directories in
/// the order of their keys): the second that reads from the device where
/// the first read ended is sequential, and the planner reads ahead what
/// follows — the rest of the leaf's basements, and the leaves after it —
/// so the visits after it read nothing themselves.
#[test]
fn short_queries_in_key_order_start_read_ahead() {
    const N: u32 = 3000;
    let device = Arc::new(QueryReads {
        inner: device_with_keys(N),
        by_queries: Default::default(),
    });
    let store = Store::open_on(device.clone(), options()).unwrap();
    let mut i = 0;
    while store.stats().sequential_query_reads == 0 {
        assert!(i < 200, "no sequential query read in {i} visits");
        assert_eq!(visit_one_key(&store, i), vec![(key(i), value(i, 0))]);
        i += 1;
    }
    // What the planner hands its readers is read, or being read (a query
    // waits for that rather than read it again): wait for the first.
    wait_until("nothing was read ahead", || {
        store.stats().nodes_read_ahead > 0
    });
    let before = device.by_queries.load(std::sync::atomic::Ordering::SeqCst);
    // The rest of the basement the sequential read took, and past it a
    // leaf's worth of keys (16 KiB leaves of 600-byte values).
    let window = i..i + 30;
    for j in window.clone() {
        assert_eq!(visit_one_key(&store, j), vec![(key(j), value(j, 0))]);
    }
    let after = device.by_queries.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        after, before,
        "visits of keys {window:?}, read ahead, read from the device themselves"
    );
    for j in window.end..N {
        assert_eq!(visit_one_key(&store, j), vec![(key(j), value(j, 0))]);
    }
    store.close().unwrap();
}

/// Visits of one key each against key order: no read continues where the
/// last ended, so nothing is read ahead (random reads stay at what they
/// touch).
#[test]
fn short_queries_against_key_order_read_nothing_ahead() {
    const N: u32 = 1500;
    let store = cold_store_with_keys(N);
    for i in (0..N).rev() {
        assert_eq!(visit_one_key(&store, i), vec![(key(i), value(i, 0))]);
    }
    let stats = store.stats();
    assert_eq!(stats.sequential_query_reads, 0);
    assert_eq!(stats.nodes_read_ahead, 0);
    assert!(stats.basement_reads_unlocked + stats.leaves_read_unlocked > 10);
    store.close().unwrap();
}
