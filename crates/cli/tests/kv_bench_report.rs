//! `betreefs kv-bench` reports what each kind of operation waited: the
//! latency of every get and put of the measured phase, summed over the
//! client threads (issue 11 bounds the longest request stall on WS3).

mod common;

use std::process::Command;

use serde_json::Value;

/// A small store: 20,000 keys, the smallest cache the engine takes.
const SMALL: [&str; 6] = ["--keys", "20000", "--size", "256M", "--cache-mb", "16"];

/// Runs kv-bench on a fresh store in `dir` with `args`; its JSON report
/// and, with `--stats`, the engine's counters.
fn kv_bench(dir: &std::path::Path, args: &[&str]) -> (Value, Option<Value>) {
    let out = Command::new(common::binary())
        .arg("kv-bench")
        .args(args)
        .arg("--path")
        .arg(dir.join("kv.img"))
        .output()
        .expect("run kv-bench");
    common::assert_succeeded(&out);
    let report =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("one JSON line");
    let stats = String::from_utf8_lossy(&out.stderr)
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok());
    (report, stats)
}

/// How many operations one latency summary counts, its percentiles
/// checked for order.
fn summary(report: &Value, kind: &str) -> u64 {
    let s = &report[kind];
    let field = |name: &str| {
        s[name]
            .as_u64()
            .unwrap_or_else(|| panic!("{kind}.{name} in {report}"))
    };
    let (count, p50, p99, p999, max) = (
        field("count"),
        field("p50_nanos"),
        field("p99_nanos"),
        field("p999_nanos"),
        field("max_nanos"),
    );
    assert!(
        0 < p50 && p50 <= p99 && p99 <= p999 && p999 <= max,
        "{kind}: {s}"
    );
    count
}

#[test]
fn ws3_reports_get_and_put_latency_of_every_client() {
    let s = common::Scratch::new("kv-latency-ws3");
    let ws3 = [
        "--workload",
        "ws3",
        "--reads",
        "50",
        "--ops",
        "40000",
        "--threads",
        "2",
    ];
    let (report, _) = kv_bench(&s.0, &[&SMALL[..], &ws3].concat());
    let gets = summary(&report, "get_latency");
    let puts = summary(&report, "put_latency");
    assert_eq!(
        gets + puts,
        40_000,
        "every operation of both clients timed once"
    );
    // Half reads, from two seeded streams: far from all of one kind.
    assert!((10_000..30_000).contains(&gets), "{gets} gets");
}

#[test]
fn a_read_only_run_reports_no_put_latency() {
    let s = common::Scratch::new("kv-latency-read");
    let read = ["--workload", "readrandom", "--ops", "5000"];
    let (report, _) = kv_bench(&s.0, &[&SMALL[..], &read].concat());
    let gets = summary(&report, "get_latency");
    assert_eq!(gets, 5000);
    assert!(report["put_latency"].is_null(), "{report}");
}

/// `--flush background` and `--write-back thread` run the engine with its
/// tree flusher and write-back thread (as `-o flush=background` and the
/// mount daemon do); the defaults leave both to the writers. Data four
/// times the 16 MiB cache, so that nodes must be written back.
#[test]
fn the_flush_and_write_back_modes_reach_the_engine() {
    let s = common::Scratch::new("kv-latency-modes");
    let run = |modes: &[&str]| {
        let args = [
            &["--workload", "ws3", "--reads", "10", "--keys", "200000"][..],
            &[
                "--ops",
                "200000",
                "--size",
                "1G",
                "--cache-mb",
                "16",
                "--stats",
            ],
            modes,
        ]
        .concat();
        let (report, stats) = kv_bench(&s.0, &args);
        summary(&report, "put_latency");
        stats.expect("the engine's counters on stderr")
    };
    let counter = |stats: &Value, name: &str| stats[name].as_u64().expect(name);
    let threads = run(&["--flush", "background", "--write-back", "thread"]);
    assert!(counter(&threads, "flush_turns") > 0, "{threads}");
    assert_eq!(counter(&threads, "settle_steps"), 0, "no writer settled");
    assert!(
        counter(&threads, "background_eviction_steps") > 0,
        "{threads}"
    );
    let writers = run(&[]);
    assert_eq!(counter(&writers, "flush_turns"), 0);
    assert!(counter(&writers, "settle_steps") > 0, "{writers}");
    assert_eq!(counter(&writers, "background_eviction_steps"), 0);
    assert!(counter(&writers, "eviction_steps") > 0, "{writers}");
}
