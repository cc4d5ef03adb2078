//! The node cache keeps to its budget under reads as well as writes: a
//! cold read of more data than the cache holds (a big file read through
//! the file system) evicts clean nodes as it goes.

mod common;

use std::sync::Arc;

use betreefs_engine::{KeySpace, Store, WriteBatch};
use common::{mem_store, small_options};

#[test]
fn reads_keep_the_cache_within_its_budget() {
    let options = small_options();
    let budget = options.cache_bytes as u64;
    let (dev, store) = mem_store(64 << 20, small_options());
    let keys = 4_000u32;
    for chunk in (0..keys).collect::<Vec<_>>().chunks(100) {
        let mut batch = WriteBatch::new();
        for &i in chunk {
            batch.put(KeySpace::Data, &i.to_be_bytes(), &[i as u8; 300]);
        }
        store.write(&batch).unwrap();
    }
    store.close().unwrap();
    // About 1.2 MB of values behind a 96 KiB cache.
    let store = Store::open_on(Arc::new(dev.clone()), small_options()).unwrap();
    let within_budget = |store: &Store, what: &str| {
        let cached = store.stats().cache_bytes;
        assert!(
            cached <= budget,
            "{what}: {cached} bytes cached, budget {budget}"
        );
    };
    for i in (0..keys).step_by(7) {
        let value = store.get(KeySpace::Data, &i.to_be_bytes()).unwrap();
        assert_eq!(value.as_deref(), Some(&[i as u8; 300][..]));
        within_budget(&store, "get");
    }
    let mut seen = 0u32;
    for kv in store.range(KeySpace::Data, &[], None) {
        let (key, value) = kv.unwrap();
        assert_eq!(key, seen.to_be_bytes());
        assert_eq!(value.len(), 300);
        seen += 1;
        if seen.is_multiple_of(50) {
            within_budget(&store, "range");
        }
    }
    assert_eq!(seen, keys);
    let mut visited = 0u32;
    store
        .visit_range(KeySpace::Data, &[], &[0xff; 8], &mut |_, value| {
            assert_eq!(value.len(), 300);
            visited += 1;
        })
        .unwrap();
    assert_eq!(visited, keys);
    within_budget(&store, "visit_range");
    assert!(store.stats().evictions > 0);
}
