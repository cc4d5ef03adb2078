//! The source-tree suite (BetrFS 0.2 Table 1, 0.4 Tables 1 and 3, 0.6
//! Table 1): untar, then cold-cache find, grep and tar, then mv of the
//! tree root, a clone of it (`betreefs clone`, `cp -a --reflink=auto`
//! elsewhere) and rm -rf, each ending durable; and the latency of 4 KiB
//! write + fsync while a second untar runs.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use super::{run_tool, timed, Recorder};
use crate::device_stalls::{self, QueueWatch};
use crate::report::Better;
use crate::workloads;

pub fn run(r: &mut Recorder) -> Result<()> {
    let tree = r.trees.source.clone().context("no source tree prepared")?;
    let dir = r.dir();
    let top = dir.join(&tree.top);

    let counts = tree.counts;
    r.phase("untar")?;
    let before = r.requests_before()?;
    let t = r.timed_durable(|| tree.extract_into(&dir))?;
    r.seconds("untar + sync", t);
    r.record_requests("untar + sync", "entry", counts.entries, before)?;

    // An fsync-heavy application beside a second untar: the p99, p99.9
    // and longest of its 4 KiB write + fsync (issue 11's stall target).
    r.phase("write + fsync during untar")?;
    let side = dir.join("beside");
    std::fs::create_dir(&side)?;
    let probe = dir.join("fsync-probe");
    let watch = r.target.device().map(QueueWatch::start).transpose()?;
    let calls = workloads::fsync_latency_during(&probe, || tree.extract_into(&side));
    // Stopped whether the phase went well or not.
    let samples = watch.map(QueueWatch::stop).transpose()?;
    let calls = calls?;
    let times: Vec<Duration> = calls.iter().map(|&(_, took)| took).collect();
    r.latency_quantiles("4 KiB write + fsync during untar", &times);
    if let Some(samples) = samples {
        // What the device held back is not the file system's doing: the
        // longest call with those windows taken out, beside the longest
        // window (docs/benchmarks/fsync-stalls.md).
        let stalls = device_stalls::stall_windows(&samples, device_stalls::STALL_MIN);
        let own = calls
            .iter()
            .map(|&(start, took)| device_stalls::outside(start, took, &stalls))
            .max()
            .unwrap_or_default();
        r.record(
            "4 KiB write + fsync during untar: max, device stalls taken out",
            "ms",
            Better::Lower,
            own.as_secs_f64() * 1e3,
        );
        let longest = stalls.iter().map(|&(from, to)| to - from).max();
        r.record_device_stall("write + fsync during untar", longest.unwrap_or_default());
    }
    std::fs::remove_dir_all(&side)?;
    std::fs::remove_file(&probe)?;
    r.target.sync()?;

    r.target.cold()?;
    r.phase("find")?;
    let before = r.requests_before()?;
    let t = timed(|| {
        run_tool(
            Command::new("find").arg(&top).args(["-name", "wait.c"]),
            &[],
        )
    })?;
    r.seconds("find -name wait.c (cold)", t);
    r.record_requests("find (cold)", "directory", counts.dirs, before)?;

    r.target.cold()?;
    r.phase("grep")?;
    let before = r.requests_before()?;
    // grep exits 1 when nothing matches; the quick tree has matches.
    let t = timed(|| {
        run_tool(
            Command::new("grep").args(["-r", "cpu_to_be64"]).arg(&top),
            &[1],
        )
    })?;
    r.seconds("grep -r cpu_to_be64 (cold)", t);
    r.record_requests("grep -r (cold)", "file", counts.files, before)?;

    r.target.cold()?;
    r.phase("tar")?;
    let before = r.requests_before()?;
    // GNU tar skips reading file contents when the archive is /dev/null,
    // so the archive goes through a pipe and is counted here.
    let t = timed(|| {
        let mut child = Command::new("tar")
            .args(["cf", "-", "-C"])
            .arg(&dir)
            .arg(&tree.top)
            .stdout(Stdio::piped())
            .spawn()
            .context("running tar")?;
        let bytes = workloads::drain(child.stdout.take().context("tar has no stdout")?)?;
        let status = child.wait()?;
        anyhow::ensure!(status.success() && bytes > 0, "tar cf - failed ({status})");
        Ok(())
    })?;
    r.seconds("tar cf of the tree (cold)", t);
    r.record_requests("tar cf (cold)", "entry", counts.entries, before)?;

    r.phase("mv")?;
    let moved = dir.join("moved");
    let t = r.timed_durable(|| run_tool(Command::new("mv").arg(&top).arg(&moved), &[]))?;
    r.seconds("mv of the tree root + sync", t);

    // A copy of the tree that shares its data: `betreefs clone` (one
    // batch, the data one range clone), `cp -a --reflink=auto` elsewhere
    // (reflinks on XFS and btrfs, a full copy on ext4 and tmpfs). The
    // copy is removed before rm -rf, which times the original alone.
    r.phase("clone")?;
    let cloned = dir.join("cloned");
    let mut clone = r.target.tree_clone_command(&moved, &cloned);
    let t = r.timed_durable(|| run_tool(&mut clone, &[]))?;
    r.seconds("clone of the tree + sync", t);
    std::fs::remove_dir_all(&cloned)?;
    r.target.sync()?;

    r.phase("rm -rf")?;
    let before = r.requests_before()?;
    let t = r.timed_durable(|| run_tool(Command::new("rm").arg("-rf").arg(&moved), &[]))?;
    r.seconds("rm -rf + sync", t);
    r.record_requests("rm -rf + sync", "entry", counts.entries, before)?;
    anyhow::ensure!(!moved.exists(), "rm -rf left {} behind", moved.display());
    Ok(())
}
