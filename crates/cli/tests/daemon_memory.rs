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
