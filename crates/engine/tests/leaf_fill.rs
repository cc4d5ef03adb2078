//! How full leaves end up: a leaf that grows by appends (a file written
//! sequentially) splits with its first pieces full, and every other leaf
//! in even pieces, as before (docs/design.md, "Leaves that grow at their
//! end").

mod common;

use std::sync::Arc;

use betreefs_engine::{KeySpace, Options, Store, WriteBatch, KEY_SPACES};
use common::{mid_options, numbered_key};
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Bytes of each value: a 1 KiB block of a file.
const VALUE: usize = 1024;
/// Keys written: about 24 nodes' worth of values with mid_options.
const KEYS: u32 = 6_000;
/// Keys per write (a 32 KiB write of a file).
const PER_WRITE: usize = 32;

fn value(i: u32) -> Vec<u8> {
    let mut v = i.to_le_bytes().to_vec();
    v.resize(VALUE, (i % 251) as u8);
    v
}

/// Writes keys `order` in writes of [`PER_WRITE`], then checks every one
/// reads back; returns the store.
fn write_in_order(options: Options, order: &[u32]) -> (betreefs_store::MemDevice, Store) {
    let (dev, store) = common::mem_store(256 << 20, options);
    for chunk in order.chunks(PER_WRITE) {
        let mut batch = WriteBatch::new();
        for &i in chunk {
            batch.put(KeySpace::Data, &numbered_key(i), &value(i));
        }
        store.write(&batch).unwrap();
    }
    (dev, store)
}

fn assert_all_there(store: &Store) {
    let all = common::scan_all(store, KeySpace::Data);
    assert_eq!(all.len(), KEYS as usize);
    for (i, (k, v)) in (0..KEYS).zip(&all) {
        assert_eq!(k, &numbered_key(i));
        assert_eq!(v, &value(i));
    }
}

/// Leaves of the data tree, and their mean fill as a share of a node
/// (the other key spaces' trees are a leaf each, empty here).
fn data_leaves(store: &Store, options: &Options) -> (u64, f64) {
    let report = store.verify().unwrap();
    assert!(report.unreachable.is_empty());
    let leaves = report.leaves - (KEY_SPACES as u64 - 1);
    let fill = report.leaf_bytes as f64 / leaves as f64 / options.node_size as f64;
    (leaves, fill)
}

/// Appends leave full leaves behind them, and they stay so across a
/// close and an open (the hint is memory only; the shape is the tree's).
/// With halves, as every split was made before, the leaves were about
/// half full (twice as many).
#[test]
fn leaves_grown_by_appends_split_full() {
    let options = mid_options();
    let order: Vec<u32> = (0..KEYS).collect();
    let (dev, store) = write_in_order(options.clone(), &order);
    assert_all_there(&store);
    // The growing tail, small after each split, is not merged back into
    // the full leaf before it (which that would rewrite, to split it off
    // again).
    assert_eq!(store.stats().merges, 0);
    let (leaves, fill) = data_leaves(&store, &options);
    let total = u64::from(KEYS) * VALUE as u64;
    let full_leaves = total.div_ceil(options.node_size as u64);
    assert!(
        fill > 0.85 && leaves <= full_leaves + 2,
        "{leaves} leaves {:.0}% full on average for {full_leaves} nodes' worth of appends",
        fill * 100.0
    );
    store.close().unwrap();
    let reopened = Store::open_on(Arc::new(dev), options.clone()).unwrap();
    assert_all_there(&reopened);
    assert_eq!(data_leaves(&reopened, &options).0, leaves);
}

/// The same keys written in a random order split in even pieces: no
/// piece is left full for the next insert to split again at once.
#[test]
fn leaves_grown_anywhere_split_evenly() {
    let options = mid_options();
    let mut order: Vec<u32> = (0..KEYS).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    let (_dev, store) = write_in_order(options.clone(), &order);
    assert_all_there(&store);
    let (leaves, fill) = data_leaves(&store, &options);
    assert!(
        fill < 0.8,
        "{leaves} leaves {:.0}% full on average from random inserts",
        fill * 100.0
    );
}

/// Inserts into the middle of leaves filled by appends split them evenly
/// and leave every key where it belongs; a range delete over the tail's
/// leaves then finds them as it finds any others.
#[test]
fn appended_leaves_take_inserts_and_deletes_anywhere() {
    let options = mid_options();
    // Every other key appended, then the rest in reverse.
    let evens: Vec<u32> = (0..KEYS).step_by(2).collect();
    let (_dev, store) = write_in_order(options.clone(), &evens);
    let odds: Vec<u32> = (1..KEYS).step_by(2).rev().collect();
    for chunk in odds.chunks(PER_WRITE) {
        let mut batch = WriteBatch::new();
        for &i in chunk {
            batch.put(KeySpace::Data, &numbered_key(i), &value(i));
        }
        store.write(&batch).unwrap();
    }
    assert_all_there(&store);
    let (leaves, fill) = data_leaves(&store, &options);
    assert!(fill < 0.85, "{leaves} leaves {:.0}% full", fill * 100.0);
    let mut batch = WriteBatch::new();
    batch.range_delete(KeySpace::Data, &numbered_key(KEYS / 2), &numbered_key(KEYS));
    store.write(&batch).unwrap();
    let all = common::scan_all(&store, KeySpace::Data);
    assert_eq!(all.len(), KEYS as usize / 2);
    assert!(all
        .iter()
        .zip(0..)
        .all(|((k, v), i)| *k == numbered_key(i) && *v == value(i)));
    store.verify().unwrap();
}
