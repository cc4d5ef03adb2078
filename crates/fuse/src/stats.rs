//! Per-opcode request counters: how many requests of each kind the kernel
//! sent, and the time the daemon spent answering them (from the request's
//! arrival in the daemon to its reply). `betreefs stats` and the nullfuse
//! control socket report them; `betreefs-bench` turns their differences
//! into requests per operation for each workload.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::abi::opcode;

/// Counters for one opcode.
#[derive(Default)]
struct OpcodeCounter {
    count: AtomicU64,
    nanos: AtomicU64,
}

/// The counters of one mount, shared by its request threads.
pub struct RequestStats {
    /// Indexed by opcode; the last slot takes opcodes past the known ones.
    per_opcode: Vec<OpcodeCounter>,
}

impl Default for RequestStats {
    fn default() -> Self {
        RequestStats {
            per_opcode: (0..=opcode::COUNT)
                .map(|_| OpcodeCounter::default())
                .collect(),
        }
    }
}

/// One opcode's figures in a snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpcodeFigures {
    pub count: u64,
    pub nanos: u64,
}

impl RequestStats {
    fn counter(&self, op: u32) -> Option<&OpcodeCounter> {
        let slot = (op as usize).min(opcode::COUNT);
        self.per_opcode.get(slot)
    }

    /// Counts one request of `op` that took `started.elapsed()`.
    pub fn record(&self, op: u32, started: Instant) {
        if let Some(c) = self.counter(op) {
            let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            c.count.fetch_add(1, Ordering::Relaxed);
            c.nanos.fetch_add(nanos, Ordering::Relaxed);
        }
    }

    /// The opcodes seen so far, by name.
    pub fn snapshot(&self) -> Vec<(&'static str, OpcodeFigures)> {
        self.per_opcode
            .iter()
            .enumerate()
            .filter_map(|(op, c)| {
                let count = c.count.load(Ordering::Relaxed);
                (count > 0).then(|| {
                    let figures = OpcodeFigures {
                        count,
                        nanos: c.nanos.load(Ordering::Relaxed),
                    };
                    (opcode::name(op as u32), figures)
                })
            })
            .collect()
    }

    /// `{"lookup": {"count": n, "nanos": t}, ...}`, plus `"total"`.
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
        out.push('}');
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
        stats.record(opcode::LOOKUP, t);
        stats.record(opcode::LOOKUP, t);
        stats.record(opcode::CREATE, t);
        stats.record(9999, t);
        let snap = stats.snapshot();
        let count = |n: &str| snap.iter().find(|(k, _)| *k == n).map(|(_, f)| f.count);
        assert_eq!(count("lookup"), Some(2));
        assert_eq!(count("create"), Some(1));
        assert_eq!(count("getattr"), None);
        let json = stats.to_json();
        assert!(json.contains("\"lookup\":{\"count\":2,"), "{json}");
        assert!(json.contains("\"total\":{\"count\":4,"), "{json}");
    }
}
