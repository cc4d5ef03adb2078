//! IO amplification (the IO-amplification study, Tables 1-3), counted for
//! every file system from its loop device's block statistics: bytes the
//! device wrote by the time the last fsync returned, bytes written later
//! (forced out by unmounting: background writeback, journal and tree
//! checkpoints), bytes read, the space cost (4 KiB blocks of the image
//! that changed: the study's unique locations written), and space in use
//! per user byte.
//!
//! Each operation starts on a file system that has just been unmounted
//! and mounted again, so nothing from its setup is still pending; what
//! mounting itself reads and writes is not counted.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::Recorder;
use crate::devstats::{space_used, IoCounters};
use crate::report::Better;
use crate::workloads::{self, fsync_dir, BLOCK};

const KIB: f64 = 1024.0;

/// Device traffic of one measured operation.
struct Traffic {
    by_fsync: IoCounters,
    later: IoCounters,
    /// Bytes of the image's blocks that changed.
    space: u64,
}

/// Runs `op` and splits the device traffic at the moment it returns (all
/// its fsyncs done) and after everything pending has been forced out by
/// unmounting; the space cost is the image's blocks that changed between
/// the start of `op` and the unmount, so what mounting writes is counted
/// by neither.
fn measure(r: &mut Recorder, op: impl FnOnce() -> Result<()>) -> Result<Traffic> {
    let dev = r.target.device().context("no device")?.to_string();
    let before = r.target.device_state()?;
    op()?;
    let at_fsync = IoCounters::of_device(&dev)?;
    let after = r.target.flush_and_capture()?.context("no device")?;
    Ok(Traffic {
        by_fsync: at_fsync.since(&before.counters),
        later: after.counters.since(&at_fsync),
        space: after.digest.written_since(&before.digest),
    })
}

/// How an operation's figures are expressed.
#[derive(Clone, Copy)]
enum Per {
    /// Data operations: amplification, device bytes per user byte.
    UserBytes(u64),
    /// Metadata operations: KiB per operation.
    Operations(usize),
}

/// An operation's rows: bytes written by fsync, later and in all, read,
/// and its space cost. Returns the total written in the rows' unit.
fn traffic_rows(r: &mut Recorder, op: &str, per: Per, t: &Traffic) -> f64 {
    let (unit, scale) = match per {
        Per::UserBytes(bytes) => ("× user bytes", 1.0 / bytes as f64),
        Per::Operations(n) => ("KiB/op", 1.0 / KIB / n as f64),
    };
    let total = (t.by_fsync.write_bytes + t.later.write_bytes) as f64 * scale;
    let rows = [
        ("written by fsync", t.by_fsync.write_bytes as f64 * scale),
        ("written later", t.later.write_bytes as f64 * scale),
        ("written in all", total),
        (
            "read",
            (t.by_fsync.read_bytes + t.later.read_bytes) as f64 * scale,
        ),
        ("space (blocks written)", t.space as f64 * scale),
    ];
    for (what, value) in rows {
        r.record(&format!("{op}: {what}"), unit, Better::Lower, value);
    }
    total
}

pub fn run(r: &mut Recorder) -> Result<()> {
    let p = r.params.clone();
    let dir = r.dir();
    let block = BLOCK as usize;
    let ops = (p.ioamp_bytes / BLOCK) as usize;
    let payload = workloads::random_bytes(block, 3);
    // KiB written per operation, for the plot.
    let mut per_op: Vec<(String, f64)> = Vec::new();

    // Space: one big file, then many 1 KiB files.
    r.phase("space")?;
    let used_before = space_used(&dir)?;
    let big = dir.join("big");
    workloads::write_file(&big, p.ioamp_file, 5)?;
    r.target.flush_everything()?;
    let used_big = space_used(&dir)?;
    r.record(
        &format!(
            "space in use per user byte ({} MB file, statvfs)",
            p.ioamp_file >> 20
        ),
        "× user bytes",
        Better::Lower,
        used_big.saturating_sub(used_before) as f64 / p.ioamp_file as f64,
    );
    let small = dir.join("small");
    std::fs::create_dir(&small)?;
    let small_files = p.ioamp_meta_ops * 5;
    let kib = workloads::random_bytes(1024, 6);
    for i in 0..small_files {
        std::fs::write(small.join(format!("s{i}")), &kib)?;
    }
    r.target.flush_everything()?;
    let used_small = space_used(&dir)?;
    r.record(
        &format!("space in use per user byte ({small_files} files of 1 KiB, statvfs)"),
        "× user bytes",
        Better::Lower,
        used_small.saturating_sub(used_big) as f64 / (small_files * 1024) as f64,
    );

    r.phase("4 KiB random overwrite + fsync")?;
    let t = measure(r, || {
        let f = OpenOptions::new().write(true).open(&big)?;
        let blocks = p.ioamp_file / BLOCK;
        let mut rng = SmallRng::seed_from_u64(21);
        for _ in 0..ops {
            f.write_all_at(&payload, rng.gen_range(0..blocks) * BLOCK)?;
            f.sync_all()?;
        }
        Ok(())
    })?;
    let amp = traffic_rows(
        r,
        "4 KiB overwrite + fsync",
        Per::UserBytes(p.ioamp_bytes),
        &t,
    );
    per_op.push(("overwrite".into(), amp * 4.0));

    r.phase("4 KiB append + fsync")?;
    let log = dir.join("appended");
    File::create(&log)?.sync_all()?;
    fsync_dir(&dir)?;
    r.target.flush_everything()?;
    let t = measure(r, || {
        let mut f = OpenOptions::new().append(true).open(&log)?;
        for _ in 0..ops {
            f.write_all(&payload)?;
            f.sync_all()?;
        }
        Ok(())
    })?;
    let amp = traffic_rows(r, "4 KiB append + fsync", Per::UserBytes(p.ioamp_bytes), &t);
    per_op.push(("append".into(), amp * 4.0));

    // Reads: a file of ioamp_bytes, read in random 4 KiB pieces.
    let readable = dir.join("readable");
    workloads::write_file(&readable, p.ioamp_bytes, 8)?;
    r.target.flush_everything()?;
    for (label, cold) in [
        ("4 KiB random read (cold)", true),
        ("4 KiB random read (warm)", false),
    ] {
        if cold {
            r.target.cold()?;
        }
        r.phase(label)?;
        let dev = r.target.device().context("no device")?.to_string();
        let before = IoCounters::of_device(&dev)?;
        let f = File::open(&readable)?;
        let mut buf = vec![0u8; block];
        let mut rng = SmallRng::seed_from_u64(31);
        let blocks = p.ioamp_bytes / BLOCK;
        for _ in 0..ops {
            f.read_exact_at(&mut buf, rng.gen_range(0..blocks) * BLOCK)?;
        }
        let read = IoCounters::of_device(&dev)?.since(&before).read_bytes;
        r.record(
            &format!("{label}: read"),
            "× user bytes",
            Better::Lower,
            read as f64 / p.ioamp_bytes as f64,
        );
    }

    // One read right after mounting: open + a single 4 KiB read, what a
    // program that reads one block pays cold (the rows above average many
    // reads of one file, which later reads share). The median of a few.
    r.phase("open + one 4 KiB read (cold)")?;
    let mut single: Vec<f64> = Vec::new();
    let mut rng = SmallRng::seed_from_u64(41);
    for _ in 0..5 {
        r.target.cold()?;
        let dev = r.target.device().context("no device")?.to_string();
        let before = IoCounters::of_device(&dev)?;
        let f = File::open(&readable)?;
        let mut buf = vec![0u8; block];
        f.read_exact_at(&mut buf, rng.gen_range(0..p.ioamp_bytes / BLOCK) * BLOCK)?;
        let read = IoCounters::of_device(&dev)?.since(&before).read_bytes;
        single.push(read as f64 / BLOCK as f64);
    }
    single.sort_by(f64::total_cmp);
    r.record(
        "open + one 4 KiB read (cold, just mounted): read",
        "× user bytes",
        Better::Lower,
        single[single.len() / 2],
    );

    // Metadata: a depth-3 directory to create files and directories in.
    let deep = dir.join("d1/d2/d3");
    std::fs::create_dir_all(&deep)?;
    r.target.sync()?;
    r.target.flush_everything()?;
    let n = p.ioamp_meta_ops;

    // Each metadata operation on item i, then an fsync of the parent.
    type MetadataOp = fn(&Path, usize) -> std::io::Result<()>;
    let metadata: [(&str, &str, MetadataOp); 3] = [
        ("create", "create (depth 3) + fsync", |d, i| {
            File::create(d.join(format!("file{i}"))).map(drop)
        }),
        ("mkdir", "mkdir (depth 4) + fsync", |d, i| {
            std::fs::create_dir(d.join(format!("dir{i}")))
        }),
        ("rename", "rename in a directory + fsync", |d, i| {
            std::fs::rename(d.join(format!("file{i}")), d.join(format!("renamed{i}")))
        }),
    ];
    for (name, label, op) in metadata {
        r.phase(label)?;
        let t = measure(r, || {
            for i in 0..n {
                op(&deep, i)?;
                fsync_dir(&deep)?;
            }
            Ok(())
        })?;
        per_op.push((name.into(), traffic_rows(r, label, Per::Operations(n), &t)));
    }

    // A directory rename: what it writes must not grow with what the
    // directory holds (full-path keys move by tree surgery). Ten files of
    // `ioamp_file` bytes (1000 MB at the default scale).
    let holding = dir.join("holding");
    std::fs::create_dir(&holding)?;
    for i in 0..10 {
        workloads::write_file(&holding.join(format!("f{i}")), p.ioamp_file, 50 + i)?;
    }
    r.target.sync()?;
    r.target.flush_everything()?;
    let label = format!(
        "rename of a directory holding {} MB + fsync",
        (10 * p.ioamp_file) >> 20
    );
    r.phase(&label)?;
    let t = measure(r, || {
        std::fs::rename(&holding, dir.join("held"))?;
        fsync_dir(&dir)?;
        Ok(())
    })?;
    per_op.push((
        "dir rename".into(),
        traffic_rows(r, &label, Per::Operations(1), &t),
    ));

    let fs = r.target.label.as_str();
    let points = per_op
        .iter()
        .enumerate()
        .map(|(i, (_, kib))| (i as f64, *kib))
        .collect();
    r.results.set_series(
        "write_amp",
        "operation",
        "device KiB written per operation",
        fs,
        points,
    );
    r.results.set_categories(
        "write_amp",
        per_op.into_iter().map(|(name, _)| name).collect(),
    );
    Ok(())
}
