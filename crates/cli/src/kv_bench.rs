//! `betreefs kv-bench`: the TRIAD synthetic workloads (WS1-WS3 with a
//! read/write mix) and db_bench-style fill/read/scan runs, on the betreefs
//! engine or (with the `rocksdb` feature) on RocksDB as the baseline.
//!
//! Keys are 8 bytes, values 255 bytes (by default). Skewed workloads pick a
//! hot set of keys spread over the whole key space: WS1 sends 99% of
//! operations to 1% of the keys, WS2 80% to 20%, WS3 is uniform. The store
//! is pre-loaded with half of the keys first; only the measured phase
//! counts towards ops/s and write amplification, which includes the final
//! checkpoint (what is still dirty at the end must reach the device too).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use betreefs_engine::{KeySpace, Options, Store};
use betreefs_fuse::stats::{LatencyHistogram, LatencySummary};
use clap::ValueEnum;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    Ws1,
    Ws2,
    Ws3,
    Fillseq,
    Fillrandom,
    Readrandom,
    Scan,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Betreefs,
    Rocksdb,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Store file (created, replacing any existing file).
    #[arg(long)]
    path: PathBuf,
    #[arg(long, value_enum, default_value = "ws3")]
    workload: Workload,
    /// Percentage of operations that are reads (WS workloads).
    #[arg(long, default_value_t = 10)]
    reads: u32,
    /// Size of the key universe.
    #[arg(long, default_value_t = 1_000_000)]
    keys: u64,
    /// Measured operations (default: --keys).
    #[arg(long)]
    ops: Option<u64>,
    #[arg(long, default_value_t = 255)]
    value_size: usize,
    /// Size of the store file for betreefs.
    #[arg(long, default_value = "8G", value_parser = parse_size)]
    size: u64,
    /// Node cache budget in MiB.
    #[arg(long, default_value_t = 256)]
    cache_mb: usize,
    /// Node size in KiB (betreefs).
    #[arg(long)]
    node_kb: Option<usize>,
    /// Basement size in KiB (betreefs).
    #[arg(long)]
    basement_kb: Option<usize>,
    /// Interior fanout (betreefs).
    #[arg(long)]
    fanout: Option<usize>,
    /// Bytes of writes staged before they are applied to the trees, in
    /// KiB (betreefs; 0: every write holds the tree lock).
    #[arg(long)]
    staged_kb: Option<usize>,
    #[arg(long, value_enum, default_value = "betreefs")]
    engine: Engine,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Client threads sharing the store in the measured phase (WS,
    /// fill and readrandom workloads); each runs an equal share of the
    /// operations with its own random stream.
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Also print the engine's counters (JSON) to stderr at the end.
    #[arg(long)]
    stats: bool,
    /// Who moves messages down the trees (betreefs): each writer
    /// (`inline`, as a mount's default) or a thread of the engine
    /// (`background`, a mount's `-o flush=background`).
    #[arg(long, value_enum, default_value = "inline")]
    flush: FlushBy,
    /// Who writes dirty nodes back when the cache is over budget
    /// (betreefs): the writer that filled the cache (`writer`, the
    /// library's default, which the earlier kv-bench tables ran) or a
    /// thread of the engine (`thread`, as the mount daemon runs it).
    #[arg(long, value_enum, default_value = "writer")]
    write_back: DoneBy,
    /// Who applies the staged writes once a writer takes them past their
    /// bound (betreefs): that writer, in its call (`writer`, the
    /// library's default, which the earlier kv-bench tables ran), or a
    /// thread of the engine (`thread`: the writer returns).
    #[arg(long, value_enum, default_value = "writer")]
    apply: DoneBy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum FlushBy {
    Inline,
    Background,
}

/// Who does a piece of the engine's work (`--write-back`, `--apply`):
/// the writer that made it due, in its call, or a thread of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DoneBy {
    Thread,
    Writer,
}

/// Parses sizes like `4096`, `64K`, `512M`, `8G`, `1T`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits.parse().map_err(|_| format!("bad size '{s}'"))?;
    let shift = match unit
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("bad size unit in '{s}'")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size '{s}' too large"))
}

/// The operations a benchmark needs from an engine. Puts and gets take
/// `&self`: the client threads of the measured phase share the engine.
trait KvEngine: Sync {
    fn put(&self, key: &[u8], value: &[u8]) -> Result<()>;
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Reads every key in order; returns how many.
    fn scan_all(&mut self) -> Result<u64>;
    /// Closes and reopens (cold cache).
    fn reopen(&mut self) -> Result<()>;
    /// Makes everything durable and returns device bytes written/read so far.
    fn finish(&mut self) -> Result<DeviceBytes>;
    fn device_bytes(&self) -> DeviceBytes;
    /// Engine-specific counters, for --stats.
    fn stats_json(&self) -> String;
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
struct DeviceBytes {
    written: u64,
    read: u64,
}

struct BetreefsKv {
    store: Option<Store>,
    path: PathBuf,
    options: Options,
    /// Counters of stores already closed by `reopen`.
    carried: DeviceBytes,
}

impl BetreefsKv {
    fn store(&self) -> Result<&Store> {
        self.store.as_ref().context("store is closed")
    }
}

impl KvEngine for BetreefsKv {
    fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.store()?.put(KeySpace::Data, key, value)?;
        Ok(())
    }
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.store()?.get(KeySpace::Data, key)?)
    }
    fn scan_all(&mut self) -> Result<u64> {
        let mut n = 0;
        for item in self.store()?.range(KeySpace::Data, b"", None) {
            item?;
            n += 1;
        }
        Ok(n)
    }
    fn reopen(&mut self) -> Result<()> {
        let bytes = self.device_bytes();
        if let Some(store) = self.store.take() {
            store.close()?;
        }
        self.carried = bytes;
        self.store = Some(Store::open(&self.path, self.options.clone())?);
        Ok(())
    }
    fn finish(&mut self) -> Result<DeviceBytes> {
        self.store()?.checkpoint()?;
        Ok(self.device_bytes())
    }
    fn stats_json(&self) -> String {
        let s = self.store.as_ref().map(|s| s.stats()).unwrap_or_default();
        serde_json::to_string(&s).unwrap_or_default()
    }
    fn device_bytes(&self) -> DeviceBytes {
        let s = self.store.as_ref().map(|s| s.stats()).unwrap_or_default();
        DeviceBytes {
            written: self.carried.written + s.device_bytes_written,
            read: self.carried.read + s.device_bytes_read,
        }
    }
}

#[cfg(feature = "rocksdb")]
mod rocks {
    use super::*;

    /// RocksDB configured as TRIAD's baseline: 4 MiB write buffer, WAL on,
    /// no fsync per write, block cache of the same budget as ours.
    pub struct RocksKv {
        pub db: Option<rocksdb::DB>,
        pub path: PathBuf,
        pub cache_bytes: usize,
    }

    impl RocksKv {
        pub fn options(cache_bytes: usize) -> Result<rocksdb::Options> {
            let mut o = rocksdb::Options::default();
            o.create_if_missing(true);
            o.set_write_buffer_size(4 << 20);
            o.enable_statistics();
            let mut table = rocksdb::BlockBasedOptions::default();
            table.set_block_cache(&rocksdb::Cache::new_lru_cache(cache_bytes)?);
            o.set_block_based_table_factory(&table);
            o.set_use_direct_io_for_flush_and_compaction(true);
            o.set_use_direct_reads(true);
            Ok(o)
        }
        fn db(&self) -> Result<&rocksdb::DB> {
            self.db.as_ref().context("db closed")
        }
    }

    fn ticker(db: &rocksdb::DB, name: &str) -> u64 {
        // Statistics come as "name COUNT : n" lines.
        let stats = db
            .property_value("rocksdb.options-statistics")
            .ok()
            .flatten()
            .unwrap_or_default();
        stats
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    impl KvEngine for RocksKv {
        fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
            Ok(self.db()?.put(key, value)?)
        }
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
            Ok(self.db()?.get(key)?)
        }
        fn scan_all(&mut self) -> Result<u64> {
            let mut n = 0;
            for item in self.db()?.iterator(rocksdb::IteratorMode::Start) {
                item?;
                n += 1;
            }
            Ok(n)
        }
        fn reopen(&mut self) -> Result<()> {
            self.db = None;
            self.db = Some(rocksdb::DB::open(
                &Self::options(self.cache_bytes)?,
                &self.path,
            )?);
            Ok(())
        }
        fn finish(&mut self) -> Result<DeviceBytes> {
            let db = self.db()?;
            db.flush_wal(true)?;
            db.flush()?;
            Ok(self.device_bytes())
        }
        fn stats_json(&self) -> String {
            let stats = self
                .db
                .as_ref()
                .and_then(|db| db.property_value("rocksdb.stats").ok().flatten());
            serde_json::to_string(&stats).unwrap_or_default()
        }
        fn device_bytes(&self) -> DeviceBytes {
            let Some(db) = self.db.as_ref() else {
                return DeviceBytes::default();
            };
            DeviceBytes {
                written: ticker(db, "rocksdb.wal.bytes")
                    + ticker(db, "rocksdb.flush.write.bytes")
                    + ticker(db, "rocksdb.compact.write.bytes"),
                read: ticker(db, "rocksdb.compact.read.bytes") + ticker(db, "rocksdb.bytes.read"),
            }
        }
    }
}

#[derive(Serialize)]
struct Report {
    engine: Engine,
    workload: Workload,
    reads_percent: u32,
    keys: u64,
    ops: u64,
    value_size: usize,
    threads: u32,
    seconds: f64,
    ops_per_sec: f64,
    user_bytes_written: u64,
    device_bytes_written: u64,
    device_bytes_read: u64,
    write_amplification: f64,
    /// Device bytes written while the operations ran, before the final
    /// checkpoint (betreefs) or memtable flush (RocksDB), per user byte.
    write_amplification_steady: f64,
    peak_rss_bytes: u64,
    /// Bytes this process sent to the block layer (from /proc/self/io), a
    /// cross-check of device_bytes_written measured the same way for all engines.
    process_write_bytes: u64,
    node_kb: usize,
    cache_mb: usize,
    found: u64,
    /// Latency of the measured phase's gets and puts (None for a kind that
    /// did not run, and for a scan).
    get_latency: Option<LatencySummary>,
    put_latency: Option<LatencySummary>,
}

/// Key number `id` as 8 bytes; `spread` scatters consecutive ids over the
/// key space (random inserts) while keeping the mapping one-to-one.
fn key_of(id: u64, spread: bool) -> [u8; 8] {
    let k = if spread {
        id.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) ^ 0x5851_F42D_4C95_7F2D
    } else {
        id
    };
    k.to_be_bytes()
}

fn ratio(bytes: u64, user_bytes: u64) -> f64 {
    if user_bytes == 0 {
        0.0
    } else {
        bytes as f64 / user_bytes as f64
    }
}

fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage only writes into the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer is always allowed.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    if rc == 0 {
        usage.ru_maxrss as u64 * 1024
    } else {
        0
    }
}

fn process_write_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("write_bytes:"))
                .and_then(|l| l[12..].trim().parse().ok())
        })
        .unwrap_or(0)
}

fn open_engine(args: &Args) -> Result<Box<dyn KvEngine>> {
    match args.engine {
        Engine::Betreefs => {
            let mut options = Options {
                cache_bytes: args.cache_mb << 20,
                background_flush: args.flush == FlushBy::Background,
                background_write_back: args.write_back == DoneBy::Thread,
                background_apply: args.apply == DoneBy::Thread,
                ..Options::default()
            };
            if let Some(kb) = args.node_kb {
                options.node_size = kb << 10;
            }
            if let Some(kb) = args.basement_kb {
                options.basement_size = kb << 10;
            }
            if let Some(f) = args.fanout {
                options.fanout = f;
            }
            if let Some(kb) = args.staged_kb {
                options.staged_write_bytes = kb << 10;
            }
            let store = Store::create(&args.path, args.size, options.clone())
                .with_context(|| format!("creating store {}", args.path.display()))?;
            Ok(Box::new(BetreefsKv {
                store: Some(store),
                path: args.path.clone(),
                options,
                carried: DeviceBytes::default(),
            }))
        }
        #[cfg(feature = "rocksdb")]
        Engine::Rocksdb => {
            let _ = std::fs::remove_dir_all(&args.path);
            let db = rocksdb::DB::open(&rocks::RocksKv::options(args.cache_mb << 20)?, &args.path)?;
            Ok(Box::new(rocks::RocksKv {
                db: Some(db),
                path: args.path.clone(),
                cache_bytes: args.cache_mb << 20,
            }))
        }
        #[cfg(not(feature = "rocksdb"))]
        Engine::Rocksdb => bail!("this build has no RocksDB; rebuild with `--features rocksdb`"),
    }
}

/// What one client thread of the measured phase did.
#[derive(Default)]
struct ClientTotals {
    user_bytes: u64,
    found: u64,
    /// How long each get and each put took, from the call to its return:
    /// what a client waited on the engine (issue 11 bounds the longest).
    gets: LatencyHistogram,
    puts: LatencyHistogram,
}

/// Runs `op`, recording how long it took in `into`.
fn timed<T>(into: &LatencyHistogram, op: impl FnOnce() -> Result<T>) -> Result<T> {
    let started = Instant::now();
    let result = op();
    // The opcode slot names FUSE requests; an engine call has none.
    into.record(0, started.elapsed().as_nanos() as u64);
    result
}

/// One kind of operation's latency in the report: None when none ran.
fn latency_of(histogram: &LatencyHistogram) -> Option<LatencySummary> {
    Some(histogram.summary()).filter(|s| s.count > 0)
}

/// The operation numbers each of `threads` clients runs: equal shares of
/// `0..ops`, in order (fillseq's keys stay sequential within a client).
fn thread_shares(ops: u64, threads: u32) -> Vec<std::ops::Range<u64>> {
    let threads = u64::from(threads);
    (0..threads)
        .map(|t| ops * t / threads..ops * (t + 1) / threads)
        .collect()
}

/// One client of the measured phase: the operations numbered `share` of a
/// fill, readrandom or WS workload, with a random stream of its own.
fn run_client(
    engine: &dyn KvEngine,
    args: &Args,
    thread: u64,
    share: std::ops::Range<u64>,
) -> Result<ClientTotals> {
    // The stream differs from the pre-load's (seed + 0) and per thread.
    let mut rng = SmallRng::seed_from_u64(args.seed.wrapping_add(1 + thread));
    let mut value = vec![0u8; args.value_size];
    let mut totals = ClientTotals::default();
    let (hot_fraction, hot_share) = match args.workload {
        Workload::Ws1 => (0.01, 0.99),
        Workload::Ws2 => (0.20, 0.80),
        _ => (1.0, 1.0),
    };
    let hot_keys = ((args.keys as f64 * hot_fraction) as u64).max(1);
    for id in share {
        match args.workload {
            Workload::Fillseq | Workload::Fillrandom => {
                rng.fill(&mut value[..]);
                let spread = args.workload == Workload::Fillrandom;
                let key = key_of(id % args.keys, spread);
                timed(&totals.puts, || engine.put(&key, &value))?;
                totals.user_bytes += 8 + value.len() as u64;
            }
            Workload::Readrandom => {
                let key = key_of(rng.gen_range(0..args.keys), true);
                totals.found += timed(&totals.gets, || engine.get(&key))?.is_some() as u64;
            }
            Workload::Ws1 | Workload::Ws2 | Workload::Ws3 => {
                let id = if rng.gen_bool(hot_share) {
                    rng.gen_range(0..hot_keys)
                } else {
                    rng.gen_range(hot_keys.min(args.keys - 1)..args.keys)
                };
                // Hot ids are spread over the key space by key_of.
                let key = key_of(id, true);
                if rng.gen_range(0..100) < args.reads {
                    totals.found += timed(&totals.gets, || engine.get(&key))?.is_some() as u64;
                } else {
                    rng.fill(&mut value[..]);
                    timed(&totals.puts, || engine.put(&key, &value))?;
                    totals.user_bytes += 8 + value.len() as u64;
                }
            }
            Workload::Scan => bail!("a scan runs as one client"),
        }
    }
    Ok(totals)
}

pub fn run(args: Args) -> Result<()> {
    if args.keys == 0 || args.reads > 100 || args.threads == 0 {
        bail!("--keys and --threads must be positive and --reads at most 100");
    }
    let ops = args.ops.unwrap_or(args.keys);
    let mut engine = open_engine(&args)?;
    let mut rng = SmallRng::seed_from_u64(args.seed);
    // Values are random bytes: incompressible, so an engine that
    // compresses (RocksDB does, by default) gains nothing it would not gain
    // on real data of unknown entropy.
    let mut value = vec![0u8; args.value_size];

    // Pre-load.
    let preload = match args.workload {
        Workload::Ws1 | Workload::Ws2 | Workload::Ws3 => args.keys / 2,
        Workload::Readrandom | Workload::Scan => args.keys,
        Workload::Fillseq | Workload::Fillrandom => 0,
    };
    for id in 0..preload {
        rng.fill(&mut value[..]);
        engine.put(&key_of(id, true), &value)?;
    }
    if matches!(args.workload, Workload::Readrandom | Workload::Scan) {
        engine.reopen()?;
    } else if preload > 0 {
        engine.finish()?;
    }

    let before = engine.device_bytes();
    let io_before = process_write_bytes();
    let start = Instant::now();
    let (gets, puts) = (LatencyHistogram::default(), LatencyHistogram::default());
    let (done, user_bytes, found) = if args.workload == Workload::Scan {
        let found = engine.scan_all()?;
        (found, 0, found)
    } else {
        let engine = &*engine;
        let shares = thread_shares(ops, args.threads);
        let totals = std::thread::scope(|scope| {
            let clients: Vec<_> = shares
                .iter()
                .enumerate()
                .map(|(thread, share)| {
                    let args = &args;
                    let share = share.clone();
                    scope.spawn(move || run_client(engine, args, thread as u64, share))
                })
                .collect();
            clients
                .into_iter()
                .map(|c| {
                    c.join()
                        .map_err(|_| anyhow::anyhow!("a client thread panicked"))?
                })
                .collect::<Result<Vec<_>>>()
        })?;
        for t in &totals {
            gets.add(&t.gets);
            puts.add(&t.puts);
        }
        totals.iter().fold((ops, 0, 0), |(n, u, f), t| {
            (n, u + t.user_bytes, f + t.found)
        })
    };
    let steady = engine.device_bytes();
    let after = engine.finish()?;
    let seconds = start.elapsed().as_secs_f64();
    let written = after.written - before.written;
    let report = Report {
        engine: args.engine,
        workload: args.workload,
        reads_percent: args.reads,
        threads: args.threads,
        keys: args.keys,
        ops: done,
        value_size: args.value_size,
        seconds,
        ops_per_sec: done as f64 / seconds,
        user_bytes_written: user_bytes,
        device_bytes_written: written,
        device_bytes_read: after.read - before.read,
        write_amplification: ratio(written, user_bytes),
        write_amplification_steady: ratio(steady.written - before.written, user_bytes),
        peak_rss_bytes: peak_rss_bytes(),
        process_write_bytes: process_write_bytes() - io_before,
        node_kb: args.node_kb.unwrap_or(Options::default().node_size >> 10),
        cache_mb: args.cache_mb,
        found,
        get_latency: latency_of(&gets),
        put_latency: latency_of(&puts),
    };
    if args.stats {
        eprintln!("{}", engine.stats_json());
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("8G"), Ok(8 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn client_shares_cover_every_operation_once() {
        for (ops, threads) in [(10, 1), (10, 3), (2, 4), (1_000_001, 4)] {
            let shares = thread_shares(ops, threads);
            assert_eq!(shares.len(), threads as usize);
            assert_eq!(shares.first().map(|r| r.start), Some(0));
            assert_eq!(shares.last().map(|r| r.end), Some(ops));
            assert!(shares.windows(2).all(|w| w[0].end == w[1].start));
        }
    }

    #[test]
    fn spread_keys_are_distinct() {
        let keys: std::collections::HashSet<_> = (0..100_000).map(|i| key_of(i, true)).collect();
        assert_eq!(keys.len(), 100_000);
    }
}
