//! The node cache keeps to its budget under reads as well as writes: a
//! cold read of more data than the cache holds (a big file read through
//! the file system) evicts clean nodes as it goes.

mod common;

use std::sync::Arc;

use betreefs_engine::{KeySpace, Options, Store, WriteBatch};
use common::{mem_store, small_options};

/// Puts keys `numbers` (big-endian), 300-byte values, a hundred to a batch.
fn write_numbered(store: &Store, numbers: std::ops::Range<u32>) {
    for chunk in numbers.collect::<Vec<_>>().chunks(100) {
        let mut batch = WriteBatch::new();
        for &i in chunk {
            batch.put(KeySpace::Data, &i.to_be_bytes(), &[i as u8; 300]);
        }
        store.write(&batch).unwrap();
    }
}

/// The cache holds no more than `limit` bytes (what is `left` to it).
fn assert_cached_within(stats: &betreefs_engine::StatsSnapshot, limit: u64, left: &str) {
    assert!(
        stats.cache_bytes <= limit,
        "{} bytes cached, {limit} left to {left}",
        stats.cache_bytes
    );
}

#[test]
fn reads_keep_the_cache_within_its_budget() {
    let options = small_options();
    let budget = options.cache_bytes as u64;
    let (dev, store) = mem_store(64 << 20, small_options());
    let keys = 4_000u32;
    write_numbered(&store, 0..keys);
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

/// Memory the store's user reports beside the cache (the file system's
/// inode table) comes out of the cache's budget: reads and writes keep the
/// cache within what is left, never under four nodes.
#[test]
fn the_cache_makes_room_for_memory_reported_beside_it() {
    let options = small_options();
    let budget = options.cache_bytes as u64;
    let floor = 4 * options.node_size as u64;
    let (_dev, store) = mem_store(64 << 20, small_options());
    let beside = store.memory_beside_cache();
    let write = |from: u32| write_numbered(&store, from..from + 2_000);
    write(0);
    assert_eq!(store.stats().cache_budget_bytes, budget);
    let reported = budget / 4;
    assert!(
        budget - reported > floor,
        "the test needs room above the floor"
    );
    beside.set(reported);
    write(2_000);
    let stats = store.stats();
    assert_eq!(stats.memory_beside_cache_bytes, reported);
    assert_eq!(stats.cache_budget_bytes, budget - reported);
    assert_cached_within(&stats, budget - reported, "the cache");
    // More than the whole budget: the cache keeps its floor of four nodes.
    beside.set(2 * budget);
    write(4_000);
    let stats = store.stats();
    assert_eq!(stats.cache_budget_bytes, floor);
    assert!(
        stats.cache_bytes <= floor,
        "{} bytes cached",
        stats.cache_bytes
    );
    for i in (0..6_000u32).step_by(11) {
        let value = store.get(KeySpace::Data, &i.to_be_bytes()).unwrap();
        assert_eq!(value.as_deref(), Some(&[i as u8; 300][..]));
    }
    assert!(store.stats().cache_bytes <= floor);
}

/// The allocator's overhead, as the store's user reports it, comes out of
/// the budget for clean nodes: they are dropped to make room for it, but
/// no dirty node is written back for its sake.
#[test]
fn clean_nodes_make_room_for_the_allocators_overhead() {
    let options = small_options();
    let budget = options.cache_bytes as u64;
    let (_dev, store) = mem_store(64 << 20, small_options());
    let (tables, allocator) = (budget / 16, budget / 8);
    store.memory_beside_cache().set(tables);
    let keys = 4_000u32;
    write_numbered(&store, 0..keys);
    store.checkpoint().unwrap();
    store.allocator_overhead().set(allocator);
    let written = store.stats().nodes_written;
    // Reads that load leaves make room among the clean nodes.
    let mut visited = 0;
    store
        .visit_range(KeySpace::Data, &[], &[0xff; 8], &mut |_, _| visited += 1)
        .unwrap();
    assert_eq!(visited, keys);
    let stats = store.stats();
    assert_eq!(stats.allocator_overhead_bytes, allocator);
    assert_eq!(stats.cache_budget_bytes, budget - tables);
    // The log's buffer holds what it keeps of its tail block and the
    // chunks it keeps for the next appends (at most an eighth of the
    // cache).
    let log = stats.log_buffer_bytes;
    assert!(log < 4096 + budget / 8, "{log} bytes held by the log");
    assert_eq!(
        stats.cache_clean_budget_bytes,
        budget - tables - allocator - log
    );
    assert_cached_within(&stats, budget - tables - allocator - log, "clean nodes");
    assert_eq!(stats.nodes_written, written, "nothing written back for it");
    // Reported smaller again: the budget grows back.
    store.allocator_overhead().set(0);
    assert_eq!(
        store.stats().cache_clean_budget_bytes,
        budget - tables - log
    );
}

/// The log's buffer (appended, not yet written: up to tens of megabytes
/// in a sequential write) comes out of the budget for clean nodes as well:
/// the writes that grow it drop clean nodes to make room, write no dirty
/// one back for it, and once the log is written the budget is (nearly)
/// whole again.
#[test]
fn clean_nodes_make_room_for_the_logs_buffer() {
    let options = Options {
        cache_bytes: 2 << 20,
        log_bytes: Some(16 << 20),
        ..small_options()
    };
    let budget = options.cache_bytes as u64;
    let (_dev, store) = mem_store(64 << 20, options);
    write_numbered(&store, 0..4_000);
    store.checkpoint().unwrap();
    let stats = store.stats();
    assert_eq!(
        stats.cache_clean_budget_bytes,
        budget - stats.log_buffer_bytes
    );
    assert!(
        stats.cache_bytes > budget / 2,
        "the test needs a full cache"
    );
    let written = stats.nodes_written;
    // Overwrites of one key: the log grows by every one, the cache by
    // hardly anything (each replaces the last in the root's buffer).
    for round in 0..3_000u32 {
        store
            .put(KeySpace::Meta, b"hot", &[round as u8; 400])
            .unwrap();
    }
    let stats = store.stats();
    let buffered = stats.log_buffer_bytes;
    assert!(
        stats.log_unflushed_bytes > budget / 2,
        "only {} log bytes buffered",
        stats.log_unflushed_bytes
    );
    assert!(buffered >= stats.log_unflushed_bytes);
    assert_eq!(stats.cache_clean_budget_bytes, budget - buffered);
    // The cache made room for the log's buffer as it was when a write
    // last held the tree lock: the log has grown since by up to a chunk
    // (a write appends to the log first, and the last ones here are
    // staged, not applied).
    const LOG_CHUNK: u64 = 64 << 10;
    assert_cached_within(&stats, budget - buffered + LOG_CHUNK, "clean nodes");
    assert_eq!(stats.nodes_written, written, "nothing written back for it");
    // Written, the log's buffer is out of the budget but for what
    // it keeps of the tail block (rewritten whole by the next flush) and
    // the chunks it keeps for the next appends (an eighth of the cache).
    store.sync().unwrap();
    let stats = store.stats();
    assert!(
        stats.log_buffer_bytes < 4096 + budget / 8,
        "{} bytes held by the log",
        stats.log_buffer_bytes
    );
    assert!(stats.log_buffer_bytes < buffered / 2);
    assert_eq!(
        stats.cache_clean_budget_bytes,
        budget - stats.log_buffer_bytes
    );
    for i in (0..4_000u32).step_by(7) {
        let value = store.get(KeySpace::Data, &i.to_be_bytes()).unwrap();
        assert_eq!(value.as_deref(), Some(&[i as u8; 300][..]));
    }
    let hot = store.get(KeySpace::Meta, b"hot").unwrap();
    assert_eq!(hot.as_deref(), Some(&[(2_999u32 % 256) as u8; 400][..]));
}

/// The log's buffer keeps the chunks a flush frees for the next appends,
/// counted in what it holds, until its user says memory is short: then
/// they go at once, and come back when it says so again.
#[test]
fn the_logs_spare_chunks_go_while_memory_is_short() {
    let options = Options {
        cache_bytes: 16 << 20,
        ..small_options()
    };
    let (_dev, store) = mem_store(64 << 20, options);
    let fill = |from: u32| {
        for i in from..from + 2_000 {
            store
                .put(KeySpace::Meta, &i.to_be_bytes(), &[i as u8; 400])
                .unwrap();
        }
        store.sync().unwrap();
    };
    fill(0);
    let kept = store.stats().log_buffer_bytes;
    assert!(kept > 256 << 10, "only {kept} bytes kept after a flush");
    assert!(
        kept <= (2 << 20) + 4096,
        "{kept} bytes kept: more than the limit"
    );
    store.set_memory_short(true);
    assert!(store.stats().log_buffer_bytes < 4096);
    fill(2_000);
    assert!(
        store.stats().log_buffer_bytes < 4096,
        "spares kept while memory is short"
    );
    store.set_memory_short(false);
    fill(4_000);
    assert!(store.stats().log_buffer_bytes > 256 << 10);
    for i in (0..6_000u32).step_by(97) {
        let value = store.get(KeySpace::Meta, &i.to_be_bytes()).unwrap();
        assert_eq!(value.as_deref(), Some(&[i as u8; 400][..]));
    }
}

/// While memory is short the write-back thread writes dirty nodes back
/// until the cache is within the clean nodes' budget: the memory beside
/// the cache (here the allocator's free pages) is made room for even when
/// the cache is all dirty. Until then, dirty nodes stay for it.
#[test]
fn dirty_nodes_make_room_for_the_memory_beside_the_cache_while_memory_is_short() {
    let options = Options {
        background_write_back: true,
        cache_bytes: 1 << 20,
        ..small_options()
    };
    let budget = options.cache_bytes as u64;
    let (_dev, store) = mem_store(64 << 20, options);
    write_numbered(&store, 0..1_000);
    store.allocator_overhead().set(budget * 3 / 4);
    write_numbered(&store, 1_000..1_100);
    let before = store.stats();
    assert!(
        before.cache_dirty_bytes > before.cache_clean_budget_bytes,
        "the test needs more dirty nodes than the clean budget: {} dirty, {} budget",
        before.cache_dirty_bytes,
        before.cache_clean_budget_bytes
    );
    store.set_memory_short(true);
    common::wait_until("the cache within the clean nodes' budget", || {
        let stats = store.stats();
        stats.cache_bytes <= stats.cache_clean_budget_bytes
    });
    let after = store.stats();
    assert!(after.nodes_written > before.nodes_written);
    assert!(after.background_eviction_steps > before.background_eviction_steps);
    // Still short, told once: writes that take the cache past the clean
    // budget again, though not past its own, wake the thread themselves.
    write_numbered(&store, 1_100..1_600);
    let grown = store.stats();
    assert!(
        grown.cache_bytes < grown.cache_budget_bytes,
        "the test needs the cache within its own budget: {} of {}",
        grown.cache_bytes,
        grown.cache_budget_bytes
    );
    common::wait_until("the cache back within the clean nodes' budget", || {
        let stats = store.stats();
        stats.cache_bytes <= stats.cache_clean_budget_bytes
    });
    assert!(store.stats().background_eviction_steps > after.background_eviction_steps);
    store.set_memory_short(false);
    for i in (0..1_600u32).step_by(7) {
        let value = store.get(KeySpace::Data, &i.to_be_bytes()).unwrap();
        assert_eq!(value.as_deref(), Some(&[i as u8; 300][..]));
    }
}

/// One batch of many times a node's worth of messages (the file system's
/// clone of a tree writes one) is applied in steps: the cache never holds
/// all of it, and messages later in the batch still win over earlier ones
/// that were flushed down before them.
#[test]
fn a_huge_batch_settles_as_it_goes_and_later_messages_win() {
    let options = small_options();
    let budget = options.cache_bytes as u64;
    let node = options.node_size as u64;
    let (dev, store) = mem_store(64 << 20, small_options());
    let mut batch = WriteBatch::new();
    let mut expected = std::collections::BTreeMap::new();
    // Several nodes' worth (a log record may hold 256 KiB here): every key
    // put, then a third deleted and a third put again with another value,
    // later in the same batch.
    for round in 0..3u8 {
        for i in 0..1_000u32 {
            let key = i.to_be_bytes();
            match (round, i % 3) {
                (0, _) => {
                    batch.put(KeySpace::Data, &key, &[1; 60]);
                    expected.insert(key, Some(vec![1; 60]));
                }
                (1, 0) => {
                    batch.delete(KeySpace::Data, &key);
                    expected.insert(key, None);
                }
                (2, 1) => {
                    batch.put(KeySpace::Data, &key, &[2; 60]);
                    expected.insert(key, Some(vec![2; 60]));
                }
                _ => {}
            }
        }
    }
    store.write(&batch).unwrap();
    let stats = store.stats();
    let peak = stats.cache_peak_bytes;
    // The root may hold up to twice a node before the batch settles it
    // (a writer settles in steps after its batch), or twice the backlog
    // bound with background flushing.
    let backlog = (2 * stats.flush_backlog_bound_bytes).max(2 * node);
    assert!(
        peak <= budget + backlog + 4 * node,
        "the cache reached {peak} bytes in one write (budget {budget}, backlog up to {backlog}, nodes of {node})"
    );
    let check = |store: &Store| {
        for (key, value) in &expected {
            assert_eq!(
                store.get(KeySpace::Data, key).unwrap().as_deref(),
                value.as_deref(),
                "key {key:?}"
            );
        }
    };
    check(&store);
    store.close().unwrap();
    let store = Store::open_on(Arc::new(dev), small_options()).unwrap();
    check(&store);
}

/// A range visit that breaks is called for no pair after it, and reads
/// no leaf past the one it broke in: a listing of a directory's first
/// entries pays for them, not for the directory.
#[test]
fn a_visit_that_breaks_reads_no_further() {
    let (dev, store) = mem_store(64 << 20, small_options());
    let keys = 4_000u32;
    write_numbered(&store, 0..keys);
    store.close().unwrap();
    let cold = || Store::open_on(Arc::new(dev.clone()), small_options()).unwrap();

    let whole = cold();
    let before = whole.stats().nodes_read;
    let mut all = 0u32;
    whole
        .visit_range(KeySpace::Data, &[], &[0xff; 4], &mut |_, _| all += 1)
        .unwrap();
    assert_eq!(all, keys);
    let whole_reads = whole.stats().nodes_read - before;

    for (from, wanted) in [(0u32, 1u32), (1_000, 10), (3_990, 50)] {
        let store = cold();
        let before = store.stats().nodes_read;
        let mut seen = Vec::new();
        store
            .visit_range_while(
                KeySpace::Data,
                &from.to_be_bytes(),
                &[0xff; 4],
                &mut |k, v| {
                    assert_eq!(v, [k[3]; 300]);
                    seen.push(u32::from_be_bytes(k.try_into().unwrap()));
                    if seen.len() as u32 == wanted {
                        std::ops::ControlFlow::Break(())
                    } else {
                        std::ops::ControlFlow::Continue(())
                    }
                },
            )
            .unwrap();
        let expected: Vec<u32> = (from..(from + wanted).min(keys)).collect();
        assert_eq!(seen, expected, "from {from}");
        let reads = store.stats().nodes_read - before;
        assert!(
            reads * 10 < whole_reads,
            "{reads} nodes read for {wanted} pairs, {whole_reads} for all"
        );
    }
}
