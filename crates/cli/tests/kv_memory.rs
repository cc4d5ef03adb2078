//! The engine's memory stays within its promise: a WS3 run's peak resident
//! size is the node cache budget plus a bounded overhead. Run with 1 MiB
//! nodes: with the 4 MiB that `--size 1G` picks, a 64 MiB cache holds 16
//! nodes and the node-sized buffers in flight at a checkpoint or a write
//! back swing the peak by 10 MiB from run to run (95-107 MiB on the
//! 2026-11-29 guest, past the bound one run in five); with 1 MiB nodes it
//! is 78-81 MiB, 81-87 beside a busy loop. (The full-size figure, 1M keys
//! and 2M operations with the 256 MiB cache, is in
//! docs/benchmarks/kv-memory.md; this smaller run catches a regression of
//! the engine's overhead past 40 MiB in CI.)

mod common;

use std::process::Command;

#[test]
fn ws3_stays_within_the_cache_budget_plus_40_mib() {
    let s = common::Scratch::new("kv-memory");
    let cache_mb = 64u64;
    let out = Command::new(common::binary())
        .args(["kv-bench", "--workload", "ws3", "--reads", "10"])
        .args(["--keys", "100000", "--ops", "200000", "--size", "1G"])
        .args(["--cache-mb", &cache_mb.to_string(), "--node-kb", "1024"])
        .arg("--path")
        .arg(s.0.join("kv.img"))
        .output()
        .expect("run kv-bench");
    common::assert_succeeded(&out);
    let line = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(line.trim()).expect("one JSON line");
    let peak = json["peak_rss_bytes"].as_u64().expect("peak_rss_bytes");
    assert!(
        peak < (cache_mb + 40) << 20,
        "peak resident {} MiB with a {cache_mb} MiB cache",
        peak >> 20
    );
}
