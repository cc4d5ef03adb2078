//! Per-opcode request counters: how many requests of each kind the kernel
//! sent, and the time the daemon spent answering them (from the request's
//! arrival in the daemon to its reply). `betreefs stats` and the nullfuse
//! control socket report them; `betreefs-bench` turns their differences
//! into requests per operation for each workload.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
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
    /// Requests that came through each transport.
    via_device: AtomicU64,
    via_uring: AtomicU64,
    /// The transport the mount settled on (set once it is serving).
    transport: OnceLock<String>,
}

impl Default for RequestStats {
    fn default() -> Self {
        RequestStats {
            per_opcode: (0..=opcode::COUNT)
                .map(|_| OpcodeCounter::default())
                .collect(),
            via_device: AtomicU64::new(0),
            via_uring: AtomicU64::new(0),
            transport: OnceLock::new(),
        }
    }
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
    fn counter(&self, op: u32) -> Option<&OpcodeCounter> {
        let slot = (op as usize).min(opcode::COUNT);
        self.per_opcode.get(slot)
    }

    /// Counts one request of `op` that took `started.elapsed()`.
    pub fn record(&self, op: u32, via: Via, started: Instant) {
        match via {
            Via::Device => &self.via_device,
            Via::Uring => &self.via_uring,
        }
        .fetch_add(1, Ordering::Relaxed);
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

    /// Names the transport the mount serves with.
    pub fn set_transport(&self, transport: String) {
        let _ = self.transport.set(transport);
    }

    /// Requests that came through `/dev/fuse` and through io_uring.
    pub fn by_transport(&self) -> (u64, u64) {
        (
            self.via_device.load(Ordering::Relaxed),
            self.via_uring.load(Ordering::Relaxed),
        )
    }

    /// `{"lookup": {"count": n, "nanos": t}, ...}`, plus `"total"`, and
    /// the transport: `"transport": {"name": ..., "devfuse": n, "uring": n}`.
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
            ",\"transport\":{{\"name\":\"{name}\",\"devfuse\":{device},\"uring\":{uring}}}}}"
        ));
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
    }
}
