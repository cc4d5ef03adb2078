//! The micro suite (BetrFS 0.6 Table 1, 0.4 Table 2, 0.2 Figs. 4, 8-10):
//! sequential write and cold read of one file, random 4 KiB and 4-byte
//! writes into it, tokubench, and rename and unlink latency against file
//! size.

use anyhow::Result;

use super::Recorder;
use crate::report::{median, Better};
use crate::workloads;

const MB: f64 = 1e6;

pub fn run(r: &mut Recorder) -> Result<()> {
    let p = r.params.clone();
    let dir = r.dir();
    let seq = dir.join("seq");

    r.phase("sequential write")?;
    let t = workloads::sequential_write(&seq, p.seq_bytes)?;
    r.record(
        "sequential write",
        "MB/s",
        Better::Higher,
        p.seq_bytes as f64 / MB / t.as_secs_f64(),
    );

    r.target.cold()?;
    r.phase("sequential read (cold)")?;
    let (t, n) = workloads::sequential_read(&seq)?;
    anyhow::ensure!(
        n == p.seq_bytes,
        "read {n} bytes of a {}-byte file",
        p.seq_bytes
    );
    r.record(
        "sequential read (cold)",
        "MB/s",
        Better::Higher,
        n as f64 / MB / t.as_secs_f64(),
    );

    r.target.cold()?;
    for (size, label, seed) in [
        (4096, "random 4 KiB writes", 11),
        (4, "random 4-byte writes", 12),
    ] {
        r.phase(label)?;
        let t = workloads::random_writes(&seq, p.random_writes, size, seed)?;
        let ops = p.random_writes as f64 / t.as_secs_f64();
        r.record(&format!("{label} + fsync"), "ops/s", Better::Higher, ops);
    }
    std::fs::remove_file(&seq)?;
    r.target.sync()?;

    r.phase("tokubench")?;
    let toku = dir.join("toku");
    let before = r.requests_before()?;
    let target = &*r.target;
    let run = workloads::tokubench(&toku, p.toku_files, 2, 50, &|| target.sync())?;
    r.record(
        "tokubench (200-byte files, 2 threads)",
        "files/s",
        Better::Higher,
        p.toku_files as f64 / run.elapsed.as_secs_f64(),
    );
    // What each file's client waited (issue 11's stall target).
    r.latency_quantiles("tokubench, a file's create + write + close", &run.per_file);
    r.record_requests("tokubench + sync", "file", p.toku_files as u64, before)?;
    let fs = r.target.label.as_str();
    r.results.set_series(
        "tokubench",
        "files created",
        "cumulative files/s",
        fs,
        run.curve,
    );

    r.phase("rename against file size")?;
    let ren = dir.join("rename");
    std::fs::create_dir(&ren)?;
    r.target.sync()?;
    let renames = workloads::rename_vs_size(&ren, &p.sizes, p.rename_repeats)?;
    latency_rows(r, "rename", &renames);

    r.phase("first link against file size")?;
    let lnk = dir.join("link");
    std::fs::create_dir(&lnk)?;
    r.target.sync()?;
    let links = workloads::first_link_vs_size(&lnk, &p.sizes, p.unlink_repeats)?;
    latency_rows(r, "first link", &links);

    r.phase("copy_file_range (clone) against file size")?;
    let cln = dir.join("clone");
    std::fs::create_dir(&cln)?;
    r.target.sync()?;
    let clones = workloads::clone_vs_size(&cln, &p.sizes, p.unlink_repeats)?;
    latency_rows(r, "copy_file_range", &clones);

    r.phase("unlink against file size")?;
    let unl = dir.join("unlink");
    std::fs::create_dir(&unl)?;
    let target = &*r.target;
    let unlinks = workloads::unlink_vs_size(&unl, &p.sizes, p.unlink_repeats, &|| target.sync())?;
    latency_rows(r, "unlink", &unlinks);
    Ok(())
}

/// One row per size (median milliseconds) and the curve for the plot.
fn latency_rows(r: &mut Recorder, what: &str, per_size: &[(u64, Vec<f64>)]) {
    let mut curve = Vec::new();
    for (size, times) in per_size {
        let Some(ms) = median(times).map(|s| s * 1e3) else {
            continue;
        };
        r.record(
            &format!("{what} {} + fsync of the parent", human_size(*size)),
            "ms",
            Better::Lower,
            ms,
        );
        curve.push((*size as f64, ms));
    }
    let fs = r.target.label.as_str();
    r.results.set_series(
        what,
        "file size (bytes)",
        "median ms per operation",
        fs,
        curve,
    );
}

pub fn human_size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_like_people_write_them() {
        assert_eq!(super::human_size(4096), "4 KiB");
        assert_eq!(super::human_size(64 << 20), "64 MiB");
        assert_eq!(super::human_size(2 << 30), "2 GiB");
        assert_eq!(super::human_size(1000), "1000 B");
    }
}
