//! Per-opcode request counters: how many requests of each kind the kernel
//! sent, and the time the daemon spent answering them (from the request's
//! arrival in the daemon to its reply). `betreefs stats` and the nullfuse
//! control socket report them; `betreefs-bench` turns their differences
//! into requests per operation for each workload. A latency histogram of
//! every request (the same arrival-to-reply time) gives the longest
//! request and the p50/p99/p99.9: what a request waited on the engine,
//! flushes and checkpoints included.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use crate::abi::opcode;

/// Counters for one opcode.
#[derive(Default)]
struct OpcodeCounter {
    count: AtomicU64,
    nanos: AtomicU64,
}

/// Request times in buckets: 8 linear sub-buckets per power of two of
/// nanoseconds (at most 12.5% wide), so percentiles are read to within a
/// bucket without keeping every sample.
pub struct LatencyHistogram {
    buckets: Vec<AtomicU64>,
    max_nanos: AtomicU64,
    /// The opcode of the longest request.
    max_opcode: AtomicU64,
}

const SUB_BUCKETS: u64 = 8;
const SUB_BITS: u32 = 3;

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: (0..64 * SUB_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            max_nanos: AtomicU64::new(0),
            max_opcode: AtomicU64::new(0),
        }
    }
}

impl LatencyHistogram {
    /// The bucket of `nanos`: values below 8 have their own; above, the
    /// power of two and the next three bits.
    fn bucket(nanos: u64) -> usize {
        if nanos < SUB_BUCKETS {
            return nanos as usize;
        }
        let octave = 63 - nanos.leading_zeros();
        let sub = (nanos >> (octave - SUB_BITS)) & (SUB_BUCKETS - 1);
        ((octave - SUB_BITS + 1) as u64 * SUB_BUCKETS + sub) as usize
    }

    /// The largest value bucket `i` holds.
    fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB_BUCKETS {
            return i;
        }
        let octave = i / SUB_BUCKETS + u64::from(SUB_BITS) - 1;
        let sub = i % SUB_BUCKETS;
        let shift = octave - u64::from(SUB_BITS);
        ((SUB_BUCKETS + sub) << shift) + ((1u64 << shift) - 1)
    }

    pub fn record(&self, op: u32, nanos: u64) {
        if let Some(b) = self.buckets.get(Self::bucket(nanos)) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        if self.max_nanos.fetch_max(nanos, Ordering::Relaxed) < nanos {
            self.max_opcode.store(u64::from(op), Ordering::Relaxed);
        }
    }

    /// The time at or under which a fraction `q` of requests finished
    /// (the upper end of its bucket, never above the maximum); 0 when
    /// nothing was recorded.
    pub fn quantile(&self, q: f64) -> u64 {
        self.quantiles(&[q]).1[0]
    }

    /// How many times were recorded, and [`LatencyHistogram::quantile`]
    /// of each of `qs`, from one reading of the buckets.
    fn quantiles<const N: usize>(&self, qs: &[f64; N]) -> (u64, [u64; N]) {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        let max = self.max_nanos();
        let values = qs.map(|q| {
            if total == 0 {
                return 0;
            }
            let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
            let mut seen = 0;
            for (i, c) in counts.iter().enumerate() {
                seen += c;
                if seen >= rank {
                    return Self::upper(i).min(max);
                }
            }
            max
        });
        (total, values)
    }

    pub fn max_nanos(&self) -> u64 {
        self.max_nanos.load(Ordering::Relaxed)
    }

    /// How many times were recorded, and the p50, p99, p99.9 and longest.
    pub fn summary(&self) -> LatencySummary {
        let (count, [p50_nanos, p99_nanos, p999_nanos]) = self.quantiles(&[0.5, 0.99, 0.999]);
        LatencySummary {
            count,
            p50_nanos,
            p99_nanos,
            p999_nanos,
            max_nanos: self.max_nanos(),
        }
    }

    /// Adds `other`'s counts to these (its maximum if it is the larger).
    pub fn add(&self, other: &LatencyHistogram) {
        for (mine, theirs) in self.buckets.iter().zip(&other.buckets) {
            mine.fetch_add(theirs.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        let their_max = other.max_nanos();
        if self.max_nanos.fetch_max(their_max, Ordering::Relaxed) < their_max {
            self.max_opcode
                .store(other.max_opcode.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// `{"max_nanos": .., "max_opcode": "..", "p50_nanos": .., "p99_nanos":
    /// .., "p999_nanos": ..}`.
    pub fn to_json(&self) -> String {
        let op = self.max_opcode.load(Ordering::Relaxed) as u32;
        let s = self.summary();
        format!(
            "{{\"max_nanos\":{},\"max_opcode\":\"{}\",\"p50_nanos\":{},\"p99_nanos\":{},\"p999_nanos\":{}}}",
            s.max_nanos,
            if s.max_nanos == 0 { "" } else { opcode::name(op) },
            s.p50_nanos,
            s.p99_nanos,
            s.p999_nanos
        )
    }
}

/// A [`LatencyHistogram`]'s count and percentiles (`kv-bench` reports it
/// as it is; the request statistics' JSON has its percentiles).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_nanos: u64,
    pub p99_nanos: u64,
    pub p999_nanos: u64,
    pub max_nanos: u64,
}

/// The counters of one mount, shared by its request threads: in shards,
/// each thread counting into one of its own, summed when read. One set
/// of counters that every request thread added to took 6% of the
/// daemon's user CPU in tokubench (its cache lines bouncing between the
/// CPUs: five atomic adds a request).
pub struct RequestStats {
    shards: Vec<StatsShard>,
    /// The transport the mount settled on (set once it is serving).
    transport: OnceLock<String>,
}

/// Shards of [`RequestStats`]: request threads are assigned one in turn.
const STATS_SHARDS: usize = 8;

/// One shard's counters, on cache lines of their own.
#[repr(align(128))]
struct StatsShard {
    /// Every request's time, whatever its opcode.
    latency: LatencyHistogram,
    /// Indexed by opcode; the last slot takes opcodes past the known ones.
    per_opcode: Vec<OpcodeCounter>,
    /// Requests that came through each transport.
    via_device: AtomicU64,
    via_uring: AtomicU64,
    /// Inodes in the FORGET and BATCH_FORGET requests.
    forgotten: AtomicU64,
    /// Entries the kernel was told to drop (FUSE_NOTIFY_INVAL_ENTRY).
    released: AtomicU64,
}

impl Default for StatsShard {
    fn default() -> Self {
        StatsShard {
            latency: LatencyHistogram::default(),
            per_opcode: (0..=opcode::COUNT)
                .map(|_| OpcodeCounter::default())
                .collect(),
            via_device: AtomicU64::new(0),
            via_uring: AtomicU64::new(0),
            forgotten: AtomicU64::new(0),
            released: AtomicU64::new(0),
        }
    }
}

impl Default for RequestStats {
    fn default() -> Self {
        RequestStats {
            shards: (0..STATS_SHARDS).map(|_| StatsShard::default()).collect(),
            transport: OnceLock::new(),
        }
    }
}

/// The shard the calling thread counts into (threads take them in turn).
fn shard_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STATS_SHARDS;
    }
    SHARD.with(|s| *s)
}

/// Which transport carried a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    Device,
    Uring,
}

/// One opcode's figures in a snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpcodeFigures {
    pub count: u64,
    pub nanos: u64,
}

impl RequestStats {
    /// The calling thread's shard.
    fn shard(&self) -> &StatsShard {
        let shards = &self.shards;
        shards
            .get(shard_index() % shards.len())
            .unwrap_or_else(|| unreachable!("RequestStats has {STATS_SHARDS} shards"))
    }

    /// Counts one request of `op` that took `started.elapsed()`.
    pub fn record(&self, op: u32, via: Via, started: Instant) {
        let shard = self.shard();
        match via {
            Via::Device => &shard.via_device,
            Via::Uring => &shard.via_uring,
        }
        .fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let slot = (op as usize).min(opcode::COUNT);
        if let Some(c) = shard.per_opcode.get(slot) {
            c.count.fetch_add(1, Ordering::Relaxed);
            c.nanos.fetch_add(nanos, Ordering::Relaxed);
        }
        shard.latency.record(op, nanos);
    }

    /// Every request's time: the shards' histograms summed.
    pub fn latency(&self) -> LatencyHistogram {
        let sum = LatencyHistogram::default();
        for shard in &self.shards {
            sum.add(&shard.latency);
        }
        sum
    }

    /// The opcodes seen so far, by name.
    pub fn snapshot(&self) -> Vec<(&'static str, OpcodeFigures)> {
        (0..=opcode::COUNT)
            .filter_map(|op| {
                let mut figures = OpcodeFigures::default();
                for c in self.shards.iter().filter_map(|s| s.per_opcode.get(op)) {
                    figures.count += c.count.load(Ordering::Relaxed);
                    figures.nanos += c.nanos.load(Ordering::Relaxed);
                }
                (figures.count > 0).then(|| (opcode::name(op as u32), figures))
            })
            .collect()
    }

    /// Counts inodes the kernel forgot (one per FORGET, each of a
    /// BATCH_FORGET).
    pub fn forgotten(&self, inodes: u64) {
        self.shard().forgotten.fetch_add(inodes, Ordering::Relaxed);
    }

    /// Inodes the kernel forgot so far.
    pub fn forgotten_inodes(&self) -> u64 {
        self.summed(|s| &s.forgotten)
    }

    /// One counter of every shard, summed.
    fn summed(&self, counter: impl Fn(&StatsShard) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .map(|s| counter(s).load(Ordering::Relaxed))
            .sum()
    }

    /// Counts entries the kernel was told to drop.
    pub fn released(&self, entries: u64) {
        self.shard().released.fetch_add(entries, Ordering::Relaxed);
    }

    /// Entries the kernel was told to drop so far.
    pub fn released_entries(&self) -> u64 {
        self.summed(|s| &s.released)
    }

    /// Names the transport the mount serves with.
    pub fn set_transport(&self, transport: String) {
        let _ = self.transport.set(transport);
    }

    /// Requests that came through `/dev/fuse` and through io_uring.
    pub fn by_transport(&self) -> (u64, u64) {
        self.shards.iter().fold((0, 0), |(device, uring), s| {
            (
                device + s.via_device.load(Ordering::Relaxed),
                uring + s.via_uring.load(Ordering::Relaxed),
            )
        })
    }

    /// `{"lookup": {"count": n, "nanos": t}, ...}`, plus `"total"`, the
    /// transport: `"transport": {"name": ..., "devfuse": n, "uring": n}`,
    /// `"forgotten_inodes": n` ([`RequestStats::forgotten_inodes`]),
    /// `"released_entries": n` ([`RequestStats::released_entries`]) and
    /// `"latency"` ([`LatencyHistogram::to_json`]).
    pub fn to_json(&self) -> String {
        let snapshot = self.snapshot();
        let total = snapshot
            .iter()
            .fold(OpcodeFigures::default(), |t, (_, f)| OpcodeFigures {
                count: t.count + f.count,
                nanos: t.nanos + f.nanos,
            });
        let mut out = String::from("{");
        for (name, f) in snapshot.iter().chain([("total", total)].iter()) {
            if out.len() > 1 {
                out.push(',');
            }
            out.push_str(&format!(
                "\"{name}\":{{\"count\":{},\"nanos\":{}}}",
                f.count, f.nanos
            ));
        }
        let (device, uring) = self.by_transport();
        let name = self.transport.get().map(String::as_str).unwrap_or("");
        out.push_str(&format!(
            ",\"transport\":{{\"name\":\"{name}\",\"devfuse\":{device},\"uring\":{uring}}}"
        ));
        out.push_str(&format!(
            ",\"forgotten_inodes\":{},\"released_entries\":{}",
            self.forgotten_inodes(),
            self.released_entries()
        ));
        out.push_str(&format!(",\"latency\":{}}}", self.latency().to_json()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_opcode_with_a_total() {
        let stats = RequestStats::default();
        let t = Instant::now();
        stats.record(opcode::LOOKUP, Via::Device, t);
        stats.record(opcode::LOOKUP, Via::Uring, t);
        stats.record(opcode::CREATE, Via::Uring, t);
        stats.record(9999, Via::Uring, t);
        assert_eq!(stats.by_transport(), (1, 3));
        let snap = stats.snapshot();
        let count = |n: &str| snap.iter().find(|(k, _)| *k == n).map(|(_, f)| f.count);
        assert_eq!(count("lookup"), Some(2));
        assert_eq!(count("create"), Some(1));
        assert_eq!(count("getattr"), None);
        let json = stats.to_json();
        assert!(json.contains("\"lookup\":{\"count\":2,"), "{json}");
        assert!(json.contains("\"total\":{\"count\":4,"), "{json}");
        assert!(json.contains("\"latency\":{\"max_nanos\":"), "{json}");
    }

    #[test]
    fn threads_count_into_shards_read_as_one() {
        let stats = RequestStats::default();
        std::thread::scope(|scope| {
            for t in 0..STATS_SHARDS as u64 + 3 {
                let stats = &stats;
                scope.spawn(move || {
                    for i in 0..500u64 {
                        let started =
                            Instant::now() - std::time::Duration::from_micros(t * 1000 + i);
                        let via = if i % 2 == 0 { Via::Uring } else { Via::Device };
                        stats.record(opcode::GETATTR, via, started);
                    }
                });
            }
        });
        let requests = 500 * (STATS_SHARDS as u64 + 3);
        assert_eq!(stats.by_transport(), (requests / 2, requests / 2));
        let snap = stats.snapshot();
        assert_eq!(snap.len(), 1);
        assert_eq!(snap[0].0, "getattr");
        assert_eq!(snap[0].1.count, requests);
        let latency = stats.latency();
        // The slowest thread's last request: at least its backdated start.
        let slowest = (STATS_SHARDS as u64 + 2) * 1000 + 499;
        assert!(
            latency.max_nanos() >= slowest * 1000,
            "{}",
            latency.max_nanos()
        );
        assert!(latency.to_json().contains("\"max_opcode\":\"getattr\""));
        assert!(
            latency.quantile(0.5) >= 1000 * 1000,
            "half the requests took over a millisecond"
        );
    }

    #[test]
    fn latency_quantiles_fall_within_a_bucket() {
        let h = LatencyHistogram::default();
        assert_eq!(h.quantile(0.99), 0);
        for n in 1..=1000u64 {
            h.record(opcode::GETATTR, n * 1000);
        }
        h.record(opcode::WRITE, 375_000_000);
        assert_eq!(h.max_nanos(), 375_000_000);
        let within = |got: u64, want: u64| {
            assert!(got >= want && got <= want + want / 8 + 1, "{got} vs {want}");
        };
        within(h.quantile(0.5), 501_000);
        within(h.quantile(0.99), 991_000);
        assert_eq!(h.quantile(1.0), 375_000_000);
        assert!(h.to_json().contains("\"max_opcode\":\"write\""));
        // Buckets cover every value, in order.
        let mut last = 0;
        for v in [
            0u64,
            1,
            7,
            8,
            9,
            15,
            16,
            17,
            1 << 20,
            (1 << 20) + 1,
            u64::MAX / 2,
            u64::MAX,
        ] {
            let b = LatencyHistogram::bucket(v);
            assert!(b >= last && b < 64 * SUB_BUCKETS as usize, "{v}: {b}");
            assert!(LatencyHistogram::upper(b) >= v, "{v}");
            last = b;
        }
    }

    #[test]
    fn histograms_add_up_counts_and_keep_the_longest() {
        let (a, b) = (LatencyHistogram::default(), LatencyHistogram::default());
        assert_eq!(a.summary(), LatencySummary::default());
        for n in 1..=300u64 {
            a.record(opcode::READ, n * 1000);
        }
        for n in 1..=100u64 {
            b.record(opcode::WRITE, n * 10_000);
        }
        b.record(opcode::FSYNC, 50_000_000);
        a.add(&b);
        let s = a.summary();
        assert_eq!(s.count, 401);
        assert_eq!(s.max_nanos, 50_000_000);
        assert!(a.to_json().contains("\"max_opcode\":\"fsync\""));
        // b's 100 values of 10-1000 us now weigh in the upper tail.
        assert!(a.quantile(0.9) >= 300_000, "{}", a.quantile(0.9));
        assert_eq!(b.summary().count, 101, "the source is left as it was");
        // One reading of the buckets gives what separate ones do.
        assert_eq!(
            (s.p50_nanos, s.p99_nanos, s.p999_nanos),
            (a.quantile(0.5), a.quantile(0.99), a.quantile(0.999))
        );
    }
}
