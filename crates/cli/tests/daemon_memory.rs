//! The mount daemon stays within its memory budget (issue 11): `cache=`
//! covers the node cache, the inode table (the cache makes room for it)
//! and idle IO buffers, and the daemon's peak resident size stays under
//! the budget + 64 MiB through a sequential write much larger than the
//! budget and the creation of many files. (Full-size figures, with the
//! default 256 MiB budget, in docs/benchmarks/daemon-memory.md.)

mod common;

use std::io::Write;

use common::{formatted, Mount};

const BUDGET_MIB: u64 = 64;

#[test]
fn the_daemon_stays_within_its_budget_plus_64_mib() {
    if !common::fuse_available() {
        return;
    }
    let (_scratch, image, dir) = formatted("daemon-memory", "2G");
    let cache = format!("cache={BUDGET_MIB}M");
    let mount = Mount::start(&image, &dir, &[&cache]);

    // Six times the budget, in 1 MiB writes, then durable.
    let mut file = std::fs::File::create(mount.path("big")).unwrap();
    let block: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    for _ in 0..6 * BUDGET_MIB {
        file.write_all(&block).unwrap();
    }
    file.sync_all().unwrap();
    drop(file);

    // Files the kernel keeps looked up: the inode table grows, and the
    // node cache's budget shrinks to make room.
    for d in 0..40 {
        let sub = mount.path(&format!("d{d:02}"));
        std::fs::create_dir(&sub).unwrap();
        for f in 0..500 {
            std::fs::write(sub.join(format!("file-{f:04}")), [d as u8; 300]).unwrap();
        }
    }
    let stats = common::stats_json(&mount.dir);
    let engine = &stats["engine"];
    let beside = engine["memory_beside_cache_bytes"].as_u64().unwrap();
    let budget = engine["cache_budget_bytes"].as_u64().unwrap();
    assert!(
        beside > 20_000 * 100,
        "the inode table of 20,000 files reported as {beside} bytes"
    );
    assert!(
        budget + beside < BUDGET_MIB << 20,
        "the node cache's budget {budget} makes no room for the table ({beside})"
    );
    let peak = stats["memory"]["peak_resident_bytes"].as_u64().unwrap();
    assert!(
        peak < (BUDGET_MIB + 64) << 20,
        "peak resident {} MiB with cache={BUDGET_MIB}M",
        peak >> 20
    );
    eprintln!(
        "peak resident {} MiB, node cache budget {} MiB, inode table {} KiB",
        peak >> 20,
        budget >> 20,
        beside >> 10
    );
    mount.unmount();
}

/// The inode table keeps what the kernel holds, and the kernel, with
/// memory to spare, holds every name it has looked up: past a quarter of
/// the budget the daemon tells it to drop the oldest unused entries, and
/// the table comes back under its share while every file stays where it
/// was (looked up again when asked for).
#[test]
fn the_inode_table_stays_within_its_share_of_the_budget() {
    if !common::fuse_available() {
        return;
    }
    const CACHE_MIB: usize = 8;
    let limit = (CACHE_MIB << 20) / 4;
    let (_scratch, image, dir) = formatted("table-share", "1G");
    let cache = format!("cache={CACHE_MIB}M");
    let mount = Mount::start(&image, &dir, &[&cache]);
    let name = |d: usize, f: usize| format!("d{d:02}/file-{f:04}");
    for d in 0..40 {
        std::fs::create_dir(mount.path(&format!("d{d:02}"))).unwrap();
        for f in 0..500 {
            std::fs::write(mount.path(&name(d, f)), [d as u8, f as u8]).unwrap();
        }
    }
    // 20,000 entries are several times the share: the kernel is told to
    // drop the oldest, forgets them, and the table shrinks.
    let settled = std::time::Instant::now();
    let (table, released, forgotten) = loop {
        let stats = common::stats_json(&mount.dir);
        let table = stats["engine"]["memory_beside_cache_bytes"]
            .as_u64()
            .unwrap();
        let released = stats["fuse"]["released_entries"].as_u64().unwrap();
        let forgotten = stats["fuse"]["forgotten_inodes"].as_u64().unwrap();
        if table <= limit as u64 || settled.elapsed() > std::time::Duration::from_secs(20) {
            break (table, released, forgotten);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(
        table <= limit as u64,
        "the inode table holds {table} bytes, its share is {limit} ({released} entries released, {forgotten} forgotten)"
    );
    assert!(
        released > 10_000 && forgotten >= released / 2,
        "{released} released, {forgotten} forgotten"
    );
    // Every file is still there, with what was written.
    for d in 0..40 {
        let mut names: Vec<String> = std::fs::read_dir(mount.path(&format!("d{d:02}")))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names.len(), 500);
        for f in (0..500).step_by(7) {
            assert_eq!(
                std::fs::read(mount.path(&name(d, f))).unwrap(),
                [d as u8, f as u8]
            );
        }
    }
    mount.unmount_fsck_clean("after the kernel dropped entries");
}
