//! The workloads the harness drives itself (through std::fs and libc, like
//! an application), each timed from its first call to its last fsync.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

pub const BLOCK: u64 = 4096;
const MIB: usize = 1 << 20;

/// Incompressible bytes, so no file system gains from compression.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    SmallRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// fsync of a directory (makes its entries durable).
pub fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("fsync of {}", dir.display()))
}

/// Writes `bytes` to a new file in 1 MiB writes, then fsync.
pub fn sequential_write(path: &Path, bytes: u64) -> Result<Duration> {
    let chunk = random_bytes(MIB, 1);
    let start = Instant::now();
    write_repeating(path, bytes, &chunk)?;
    Ok(start.elapsed())
}

/// Reads a file in 1 MiB reads; returns the time and the bytes read.
pub fn sequential_read(path: &Path) -> Result<(Duration, u64)> {
    let mut buf = vec![0u8; MIB];
    let start = Instant::now();
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut total = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    Ok((start.elapsed(), total))
}

/// Times 4 KiB writes, each followed by an fsync, into `probe` (a 1 MiB
/// file, written round-robin) for as long as `alongside` runs in this
/// thread; returns when each write + fsync began and what it took. The
/// latency an fsync-heavy application sees while the file system is busy
/// (issue 11: checkpoints and flush cascades must not stall it).
pub fn fsync_latency_during(
    probe: &Path,
    alongside: impl FnOnce() -> Result<()>,
) -> Result<Vec<(Instant, Duration)>> {
    const PROBE_BYTES: u64 = 1 << 20;
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(probe)
        .with_context(|| format!("creating {}", probe.display()))?;
    f.write_all_at(&random_bytes(PROBE_BYTES as usize, 5), 0)?;
    f.sync_all()?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let payload = random_bytes(BLOCK as usize, 6);
    let (times, result) = std::thread::scope(|s| {
        let writer = s.spawn(|| -> Result<Vec<(Instant, Duration)>> {
            let mut times = Vec::new();
            let mut offset = 0;
            while !stop.load(Ordering::Relaxed) {
                let start = Instant::now();
                f.write_all_at(&payload, offset)
                    .and_then(|()| f.sync_all())
                    .with_context(|| format!("write + fsync of {}", probe.display()))?;
                times.push((start, start.elapsed()));
                offset = (offset + BLOCK) % PROBE_BYTES;
            }
            Ok(times)
        });
        let result = alongside();
        stop.store(true, Ordering::Relaxed);
        let times = writer
            .join()
            .map_err(|_| anyhow::anyhow!("the fsync writer panicked"));
        (times, result)
    });
    result?;
    let times = times??;
    anyhow::ensure!(!times.is_empty(), "no write + fsync finished");
    Ok(times)
}

/// `count` writes of `size` bytes at random block-aligned offsets of an
/// existing file, then one fsync.
pub fn random_writes(path: &Path, count: usize, size: usize, seed: u64) -> Result<Duration> {
    let payload = random_bytes(size, seed);
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let blocks = f.metadata()?.len() / BLOCK;
    anyhow::ensure!(blocks > 0, "{} is empty", path.display());
    let mut rng = SmallRng::seed_from_u64(seed);
    let start = Instant::now();
    for _ in 0..count {
        let offset = rng.gen_range(0..blocks) * BLOCK;
        f.write_all_at(&payload, offset)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    f.sync_all()
        .with_context(|| format!("fsync of {}", path.display()))?;
    Ok(start.elapsed())
}

/// The path of tokubench file `i` of `total`: a balanced tree with at most
/// `fanout` entries per directory (directories named d0..dN, files f0..fN).
pub fn toku_path(i: usize, total: usize, fanout: usize) -> PathBuf {
    let mut levels = 1;
    let mut capacity = fanout;
    while capacity < total {
        capacity *= fanout;
        levels += 1;
    }
    let mut digits = Vec::with_capacity(levels);
    let mut n = i;
    for _ in 0..levels {
        digits.push(n % fanout);
        n /= fanout;
    }
    digits.reverse();
    let mut path = PathBuf::new();
    for d in &digits[..levels - 1] {
        path.push(format!("d{d}"));
    }
    path.push(format!("f{}", digits[levels - 1]));
    path
}

/// What a tokubench run measured.
pub struct Tokubench {
    /// From the first file to the end of the final sync.
    pub elapsed: Duration,
    /// The cumulative throughput (files created, files/s) at regular
    /// points, the last one after the sync.
    pub curve: Vec<(f64, f64)>,
    /// Each file's create + write + close, as its thread waited for them
    /// (the file system's stalls included, queueing in a FUSE daemon too).
    pub per_file: Vec<Duration>,
}

/// tokubench: `total` files of 200 bytes in a balanced tree of at most 128
/// entries per directory, created by `threads` threads (each its own
/// contiguous part of the tree), then a sync; the throughput at `points`
/// regular points.
pub fn tokubench(
    root: &Path,
    total: usize,
    threads: usize,
    points: usize,
    sync: &(dyn Fn() -> Result<()> + Sync),
) -> Result<Tokubench> {
    const FANOUT: usize = 128;
    let content = random_bytes(200, 7);
    let created = AtomicUsize::new(0);
    let step = (total / points.max(1)).max(1);
    let curve = Mutex::new(Vec::new());
    let start = Instant::now();
    let per_thread = total.div_ceil(threads);
    let per_file = std::thread::scope(|scope| -> Result<Vec<Duration>> {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (content, created, curve) = (&content, &created, &curve);
                scope.spawn(move || -> Result<Vec<Duration>> {
                    let first = t * per_thread;
                    let last = ((t + 1) * per_thread).min(total);
                    let mut times = Vec::with_capacity(last.saturating_sub(first));
                    for i in first..last {
                        let path = root.join(toku_path(i, total, FANOUT));
                        let parent = path.parent().unwrap_or(root);
                        if i == first || i % FANOUT == 0 {
                            std::fs::create_dir_all(parent)
                                .with_context(|| format!("creating {}", parent.display()))?;
                        }
                        let began = Instant::now();
                        let mut f = File::create(&path)
                            .with_context(|| format!("creating {}", path.display()))?;
                        f.write_all(content)
                            .with_context(|| format!("writing {}", path.display()))?;
                        drop(f);
                        times.push(began.elapsed());
                        let n = created.fetch_add(1, Ordering::Relaxed) + 1;
                        if n % step == 0 {
                            let secs = start.elapsed().as_secs_f64();
                            curve
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((n as f64, n as f64 / secs));
                        }
                    }
                    Ok(times)
                })
            })
            .collect();
        let mut per_file = Vec::with_capacity(total);
        for w in workers {
            per_file.extend(
                w.join()
                    .map_err(|_| anyhow::anyhow!("a tokubench thread panicked"))??,
            );
        }
        Ok(per_file)
    })?;
    sync()?;
    let elapsed = start.elapsed();
    let mut curve = curve.into_inner().unwrap_or_else(|e| e.into_inner());
    curve.sort_by(|a, b| a.0.total_cmp(&b.0));
    // The last point includes the final sync.
    curve.push((total as f64, total as f64 / elapsed.as_secs_f64()));
    Ok(Tokubench {
        elapsed,
        curve,
        per_file,
    })
}

/// Writes a file of `size` bytes and fsyncs it.
pub fn write_file(path: &Path, size: u64, seed: u64) -> Result<()> {
    write_repeating(
        path,
        size,
        &random_bytes(size.min(MIB as u64) as usize, seed),
    )
}

/// Creates a file of `size` bytes by writing `chunk` over and over, then
/// fsyncs it.
fn write_repeating(path: &Path, size: u64, chunk: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])
            .with_context(|| format!("writing {}", path.display()))?;
        left -= n as u64;
    }
    f.sync_all()
        .with_context(|| format!("fsync of {}", path.display()))
}

/// Rename latency against file size: one file of each size renamed
/// `repeats` times within a directory, with an fsync of the directory
/// after each rename. Returns, per size, every rename's seconds.
pub fn rename_vs_size(dir: &Path, sizes: &[u64], repeats: usize) -> Result<Vec<(u64, Vec<f64>)>> {
    let mut out = Vec::new();
    for &size in sizes {
        let (a, b) = (
            dir.join(format!("rename-{size}-a")),
            dir.join(format!("rename-{size}-b")),
        );
        write_file(&a, size, size)?;
        fsync_dir(dir)?;
        let mut times = Vec::with_capacity(repeats);
        for i in 0..repeats {
            let (from, to) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
            let start = Instant::now();
            std::fs::rename(from, to).with_context(|| format!("renaming {}", from.display()))?;
            fsync_dir(dir)?;
            times.push(start.elapsed().as_secs_f64());
        }
        let last = if repeats.is_multiple_of(2) { &a } else { &b };
        anyhow::ensure!(
            std::fs::metadata(last)?.len() == size,
            "{} lost its size across renames",
            last.display()
        );
        std::fs::remove_file(last)?;
        out.push((size, times));
    }
    Ok(out)
}

/// First hard link against file size: `repeats` fresh files of each size
/// (fsync'd, each linked once: on a full-path file system the first link
/// is the one that moves the data), each link followed by an fsync of the
/// directory. Returns, per size, every link's seconds.
pub fn first_link_vs_size(
    dir: &Path,
    sizes: &[u64],
    repeats: usize,
) -> Result<Vec<(u64, Vec<f64>)>> {
    second_name_vs_size(dir, sizes, repeats, "link", |file, link, _| {
        std::fs::hard_link(file, link).with_context(|| format!("linking {}", file.display()))?;
        fsync_dir(dir)
    })
}

/// copy_file_range(2) against file size: `repeats` fresh files of each
/// size, each copied whole to a new file (a clone where the file system
/// shares data: XFS and btrfs reflink, betreefs clones a range of its
/// tree), with an fsync of the copy and of the directory. Returns, per
/// size, every copy's seconds.
pub fn clone_vs_size(dir: &Path, sizes: &[u64], repeats: usize) -> Result<Vec<(u64, Vec<f64>)>> {
    use std::os::fd::AsRawFd;
    second_name_vs_size(dir, sizes, repeats, "clone", |file, copy, size| {
        let from = File::open(file).with_context(|| format!("opening {}", file.display()))?;
        let to = File::create(copy).with_context(|| format!("creating {}", copy.display()))?;
        let mut left = size;
        while left > 0 {
            // SAFETY: both descriptors are open for the call's duration;
            // null offsets use and advance the files' own positions.
            let n = unsafe {
                libc::copy_file_range(
                    from.as_raw_fd(),
                    std::ptr::null_mut(),
                    to.as_raw_fd(),
                    std::ptr::null_mut(),
                    left as usize,
                    0,
                )
            };
            anyhow::ensure!(
                n > 0,
                "copy_file_range to {}: {}",
                copy.display(),
                std::io::Error::last_os_error()
            );
            left -= n as u64;
        }
        to.sync_all()?;
        fsync_dir(dir)
    })
}

/// For each size, `repeats` times: writes a fresh file (and fsyncs the
/// directory), then times `op(file, second, size)`, which gives the file's
/// content a second name (a link, a copy); checks its size and removes
/// both. Returns, per size, every operation's seconds.
fn second_name_vs_size(
    dir: &Path,
    sizes: &[u64],
    repeats: usize,
    tag: &str,
    op: impl Fn(&Path, &Path, u64) -> Result<()>,
) -> Result<Vec<(u64, Vec<f64>)>> {
    let mut out = Vec::new();
    for &size in sizes {
        let mut times = Vec::with_capacity(repeats);
        for i in 0..repeats {
            let file = dir.join(format!("{tag}-{size}-{i}"));
            let second = dir.join(format!("{tag}-{size}-{i}-second"));
            write_file(&file, size, size + i as u64)?;
            fsync_dir(dir)?;
            let start = Instant::now();
            op(&file, &second, size)?;
            times.push(start.elapsed().as_secs_f64());
            anyhow::ensure!(
                std::fs::metadata(&second)?.len() == size,
                "{} has the wrong size",
                second.display()
            );
            std::fs::remove_file(&file)?;
            std::fs::remove_file(&second)?;
        }
        out.push((size, times));
    }
    Ok(out)
}

/// Creates `repeats` files of each size (fsync'd), then `sync`, then
/// measures each unlink plus an fsync of the directory. Returns, per size,
/// every unlink's seconds.
pub fn unlink_vs_size(
    dir: &Path,
    sizes: &[u64],
    repeats: usize,
    sync: &dyn Fn() -> Result<()>,
) -> Result<Vec<(u64, Vec<f64>)>> {
    let name = |size: u64, i: usize| dir.join(format!("unlink-{size}-{i}"));
    for &size in sizes {
        for i in 0..repeats {
            write_file(&name(size, i), size, size + i as u64)?;
        }
    }
    sync()?;
    let mut out = Vec::new();
    for &size in sizes {
        let mut times = Vec::with_capacity(repeats);
        for i in 0..repeats {
            let path = name(size, i);
            let start = Instant::now();
            std::fs::remove_file(&path).with_context(|| format!("unlinking {}", path.display()))?;
            fsync_dir(dir)?;
            times.push(start.elapsed().as_secs_f64());
        }
        out.push((size, times));
    }
    Ok(out)
}

/// Reads a whole stream (e.g. `tar cf -` of a tree) and returns its length.
pub fn drain(mut reader: impl Read) -> Result<u64> {
    let mut buf = vec![0u8; 256 << 10];
    let mut total = 0;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toku_paths_form_a_balanced_tree() {
        assert_eq!(toku_path(5, 100, 128), PathBuf::from("f5"));
        assert_eq!(toku_path(0, 1000, 128), PathBuf::from("d0/f0"));
        assert_eq!(toku_path(129, 1000, 128), PathBuf::from("d1/f1"));
        assert_eq!(
            toku_path(128 * 128 + 3, 100_000, 128),
            PathBuf::from("d1/d0/f3")
        );
        let mut seen = std::collections::HashSet::new();
        for i in 0..20_000 {
            let p = toku_path(i, 20_000, 128);
            assert!(p.components().count() == 3);
            assert!(seen.insert(p));
        }
    }

    #[test]
    fn workloads_run_on_a_directory() {
        let dir = std::env::temp_dir().join(format!("betreefs-bench-wl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("seq");
        sequential_write(&f, 3 * MIB as u64 + 5).unwrap();
        let (_, n) = sequential_read(&f).unwrap();
        assert_eq!(n, 3 * MIB as u64 + 5);
        let before = std::fs::read(&f).unwrap();
        random_writes(&f, 50, 4, 9).unwrap();
        let after = std::fs::read(&f).unwrap();
        assert_eq!(before.len(), after.len());
        assert_ne!(before, after);
        let toku = dir.join("toku");
        let run = tokubench(&toku, 1000, 2, 10, &|| Ok(())).unwrap();
        assert_eq!(run.curve.last().unwrap().0, 1000.0);
        assert!(run.curve.len() >= 10);
        // Every file timed once, each within the whole run.
        assert_eq!(run.per_file.len(), 1000);
        assert!(run.per_file.iter().all(|t| *t <= run.elapsed));
        let files = walk_count(&toku);
        assert_eq!(files, 1000);
        let r = rename_vs_size(&dir, &[4096, 65536], 3).unwrap();
        assert_eq!(r.len(), 2);
        assert!(r.iter().all(|(_, t)| t.len() == 3));
        let u = unlink_vs_size(&dir, &[4096], 2, &|| Ok(())).unwrap();
        assert_eq!(u[0].1.len(), 2);
        assert!(!dir.join("unlink-4096-0").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn walk_count(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    walk_count(&e.path())
                } else {
                    1
                }
            })
            .sum()
    }
}
