//! When the device under a file system made no progress: a watch that
//! samples its block statistics (`/sys/block/<dev>/stat`, the kernel's
//! Documentation/block/stat.rst) every few milliseconds during a phase,
//! and the windows in which it held requests and completed none.
//!
//! The source suite's 4 KiB write + fsync beside an untar waited 40-80 ms
//! at its longest on the reference machine's virtual disk, whatever the
//! file system did: a log write of a few KiB that the loop device held
//! for 35-70 ms while it and the disk below completed nothing
//! (docs/benchmarks/fsync-stalls.md). Taking
//! those windows out of each call tells what the file system itself made
//! a caller wait, which is what issue 11's stall target is about.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::devstats::{read_stat, stat_fields, stat_path};

/// How often the watch samples the device.
const SAMPLE_EVERY: Duration = Duration::from_millis(2);

/// The shortest window counted as a stall: a 4 KiB write takes ~0.5 ms on
/// the reference disk and a 4 MiB one 2-3 ms, so 5 ms with requests in
/// flight and none completed is the device holding them, not serving them.
pub const STALL_MIN: Duration = Duration::from_millis(5);

/// A device's requests completed so far and in flight now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueSample {
    /// Reads, writes, discards and flushes completed (fields 1, 5, 12 and
    /// 16 of the stat line; the last two are missing on old kernels).
    pub completed: u64,
    /// Requests in flight (field 9). A flush is not counted there, but the
    /// requests queued behind one are.
    pub in_flight: u64,
}

impl QueueSample {
    pub fn parse(text: &str) -> Result<QueueSample> {
        let fields = stat_fields(text, 9)?;
        let field = |i: usize| fields.get(i).copied().unwrap_or(0);
        Ok(QueueSample {
            completed: field(0) + field(4) + field(11) + field(15),
            in_flight: field(8),
        })
    }
}

/// The windows of `samples` (in time order) over which the device held
/// requests and completed none, at least `min` long: runs of consecutive
/// sampling intervals that began with a request in flight and saw no
/// completion, each from its first interval's start to its last one's end.
pub fn stall_windows(samples: &[(Instant, QueueSample)], min: Duration) -> Vec<(Instant, Instant)> {
    let mut windows = Vec::new();
    let mut close = |from: Instant, to: Instant| {
        if to - from >= min {
            windows.push((from, to));
        }
    };
    let mut open: Option<(Instant, Instant)> = None;
    for pair in samples.windows(2) {
        let [(then, before), (now, after)] = pair else {
            continue;
        };
        let held = before.in_flight > 0 && after.completed == before.completed;
        open = match (held, open) {
            (true, Some((from, _))) => Some((from, *now)),
            (true, None) => Some((*then, *now)),
            (false, Some((from, to))) => {
                close(from, to);
                None
            }
            (false, None) => None,
        };
    }
    if let Some((from, to)) = open {
        close(from, to);
    }
    windows
}

/// How much of [start, start + took) lies outside `windows` (disjoint, in
/// time order): only the windows that overlap it are visited, as a phase
/// has tens of thousands of calls.
pub fn outside(start: Instant, took: Duration, windows: &[(Instant, Instant)]) -> Duration {
    let end = start + took;
    let first = windows.partition_point(|&(_, to)| to <= start);
    let inside: Duration = windows[first..]
        .iter()
        .take_while(|&&(from, _)| from < end)
        .map(|&(from, to)| to.min(end).saturating_duration_since(from.max(start)))
        .sum();
    took.saturating_sub(inside)
}

/// A thread sampling a device's queue until stopped.
pub struct QueueWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<Vec<(Instant, QueueSample)>>>,
}

impl QueueWatch {
    /// Starts sampling `dev` (such as `/dev/loop3`); fails at once if its
    /// statistics cannot be read.
    pub fn start(dev: &str) -> Result<QueueWatch> {
        let path = stat_path(dev);
        let read = move || QueueSample::parse(&read_stat(&path)?);
        let first = read()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("device-watch".into())
            .spawn(move || {
                let mut samples = vec![(Instant::now(), first)];
                while !stopped.load(Ordering::Relaxed) {
                    std::thread::sleep(SAMPLE_EVERY);
                    samples.push((Instant::now(), read()?));
                }
                Ok(samples)
            })
            .context("starting the device watch")?;
        Ok(QueueWatch { stop, thread })
    }

    /// Stops the watch; its samples, in time order.
    pub fn stop(self) -> Result<Vec<(Instant, QueueSample)>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the device watch panicked"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_new_and_old_stat_lines() {
        let line = " 3036053   503476 764872270  1573774  7978430   369451 1423586936  2272191        3   874932  4008565   194642       39 903801136    74213  2760589    88387\n";
        let s = QueueSample::parse(line).unwrap();
        assert_eq!(s.completed, 3036053 + 7978430 + 194642 + 2760589);
        assert_eq!(s.in_flight, 3);
        // Before discards and flushes were counted: eleven fields.
        let old = "1 0 8 1 2 0 16 1 4 2 2";
        assert_eq!(
            QueueSample::parse(old).unwrap(),
            QueueSample {
                completed: 3,
                in_flight: 4
            }
        );
        assert!(QueueSample::parse("1 2 3 4 5 6 7 8").is_err());
        assert!(QueueSample::parse("1 2 3 4 5 6 7 8 x").is_err());
    }

    /// Samples every 2 ms from (completed, in flight) pairs.
    fn samples(t0: Instant, pairs: &[(u64, u64)]) -> Vec<(Instant, QueueSample)> {
        pairs
            .iter()
            .enumerate()
            .map(|(i, &(completed, in_flight))| {
                let at = t0 + Duration::from_millis(2 * i as u64);
                (
                    at,
                    QueueSample {
                        completed,
                        in_flight,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn finds_the_windows_a_device_held_its_requests() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // Progress, then 1 request held over four intervals (8 ms),
        // progress, an idle device (nothing in flight, nothing completed:
        // no stall), a short hold (4 ms, under the minimum), then a hold
        // still open at the last sample (6 ms).
        let s = samples(
            t0,
            &[
                (0, 2),
                (5, 1),
                (5, 1),
                (5, 1),
                (5, 1),
                (5, 1),
                (9, 0),
                (9, 0),
                (9, 0),
                (9, 2),
                (9, 2),
                (9, 2),
                (12, 1),
                (12, 1),
                (12, 1),
                (12, 1),
            ],
        );
        let w = stall_windows(&s, STALL_MIN);
        assert_eq!(w, vec![(ms(2), ms(10)), (ms(24), ms(30))]);
        assert_eq!(stall_windows(&s, Duration::from_millis(3)).len(), 3);
        assert!(stall_windows(&s[..1], STALL_MIN).is_empty());
        assert!(stall_windows(&[], STALL_MIN).is_empty());
    }

    #[test]
    fn takes_the_stalls_out_of_a_call() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let d = Duration::from_millis;
        let windows = [(ms(10), ms(20)), (ms(30), ms(35))];
        // A call across both windows and one outside them.
        assert_eq!(outside(ms(5), d(40), &windows), d(25));
        assert_eq!(outside(ms(0), d(10), &windows), d(10));
        // Starting and ending inside windows.
        assert_eq!(outside(ms(15), d(17), &windows), d(10));
        assert_eq!(outside(ms(11), d(2), &windows), d(0));
        assert_eq!(outside(ms(11), d(2), &[]), d(2));
    }
}
