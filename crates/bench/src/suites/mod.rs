//! The four suites. Each runs on a freshly made file system and records
//! its figures through a [`Recorder`].

pub mod app;
pub mod ioamp;
pub mod micro;
pub mod source;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::progress::Progress;
use crate::report::{Better, Results};
use crate::scale::{Params, SourceTree};
use crate::targets::{RequestCounts, Target};

/// The table of FUSE requests per operation (FUSE file systems only).
pub const REQUESTS_TABLE: &str = "requests";

/// The table of the mount daemon's peak resident size per suite (FUSE
/// file systems only).
pub const MEMORY_TABLE: &str = "daemon memory";

/// The table of what the device under a file system held back during a
/// phase (file systems on a device only; `crate::device_stalls`).
pub const DEVICE_TABLE: &str = "device stalls";

/// A suite the harness can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Suite {
    /// Sequential and random IO, tokubench, rename and unlink against size.
    Micro,
    /// untar, find, grep, tar, mv and rm of a source tree.
    Source,
    /// rsync, tar/untar and git on a source tree.
    App,
    /// Device-level write, read and space amplification per operation.
    Ioamp,
}

impl Suite {
    pub fn name(self) -> &'static str {
        match self {
            Suite::Micro => "micro",
            Suite::Source => "source",
            Suite::App => "app",
            Suite::Ioamp => "ioamp",
        }
    }

    /// How many phases the progress display counts for it.
    pub fn phases(self) -> u64 {
        match self {
            Suite::Micro => 9,
            Suite::Source => 7,
            Suite::App => 8,
            Suite::Ioamp => 9,
        }
    }
}

/// What a suite gets: the mounted file system, the sizes, the trees, and
/// where its figures go.
pub struct Recorder<'a> {
    pub target: &'a mut Target,
    pub params: &'a Params,
    pub trees: &'a Trees,
    pub results: &'a mut Results,
    pub progress: &'a Progress,
    pub suite: Suite,
    /// The phase under way (its daemon memory is recorded when it ends).
    pub phase: Option<String>,
    /// The largest of the phases' daemon peaks so far (MiB).
    pub suite_peak_mib: Option<f64>,
}

impl Recorder<'_> {
    /// Announces the next phase; fails if the run has been interrupted.
    pub fn phase(&mut self, name: &str) -> Result<()> {
        crate::cleanup::check_interrupted()?;
        self.end_phase();
        self.phase = Some(name.to_string());
        self.progress
            .phase(self.target.label.as_str(), self.suite.name(), name);
        Ok(())
    }

    /// Ends the phase under way: records the daemon's peak resident size
    /// during it (FUSE file systems), in the daemon memory table.
    pub fn end_phase(&mut self) {
        let Some(phase) = self.phase.take() else {
            return;
        };
        if let Some(peak) = self.target.take_phase_peak_mib() {
            self.record_memory(&format!("{}: {phase}", self.suite.name()), peak);
            self.suite_peak_mib = Some(self.suite_peak_mib.map_or(peak, |p| p.max(peak)));
        }
    }

    /// Ends the suite: its last phase, and the daemon's peak over all of
    /// them. (The final checkpoint after the last unmount is not in it:
    /// the daemon is gone before it could be read.)
    pub fn end_suite(&mut self) {
        self.end_phase();
        if let Some(peak) = self.suite_peak_mib {
            let row = format!("{} suite: daemon peak resident", self.suite.name());
            self.record_memory(&row, peak);
        }
    }

    /// Records the longest window of `phase` in which the file system's
    /// device held requests and completed none, in the device table.
    pub fn record_device_stall(&mut self, phase: &str, longest: Duration) {
        let fs = self.target.label.as_str();
        let row = format!("{}: {phase}: longest stall", self.suite.name());
        self.results.record(
            DEVICE_TABLE,
            &row,
            "ms",
            Better::Lower,
            fs,
            longest.as_secs_f64() * 1e3,
        );
    }

    fn record_memory(&mut self, row: &str, mib: f64) {
        let fs = self.target.label.as_str();
        self.results
            .record(MEMORY_TABLE, row, "MiB", Better::Lower, fs, mib);
    }

    /// Records one figure (and counts the phase as done).
    pub fn record(&mut self, name: &str, unit: &str, better: Better, value: f64) {
        let fs = self.target.label.as_str();
        self.results
            .record(self.suite.name(), name, unit, better, fs, value);
        self.progress
            .figure(fs, self.suite.name(), name, unit, value);
    }

    /// Records the p99, p99.9 and longest of `times` in milliseconds, as
    /// rows "`name`: p99", "`name`: p99.9" and "`name`: max" (none when
    /// there are no times).
    pub fn latency_quantiles(&mut self, name: &str, times: &[Duration]) {
        if times.is_empty() {
            return;
        }
        let mut ms: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        // The value a fraction `q` of the samples are at or under.
        let quantile = |q: f64| {
            let rank = ((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len());
            ms.get(rank - 1).copied().unwrap_or(f64::NAN)
        };
        for (label, q) in [("p99", 0.99), ("p99.9", 0.999), ("max", 1.0)] {
            self.record(
                &format!("{name}: {label}"),
                "ms",
                Better::Lower,
                quantile(q),
            );
        }
    }

    /// Records seconds.
    pub fn seconds(&mut self, name: &str, elapsed: Duration) {
        self.record(name, "s", Better::Lower, elapsed.as_secs_f64());
    }

    /// The FUSE request counters before a phase (None on a kernel file
    /// system), for [`Recorder::record_requests`].
    pub fn requests_before(&self) -> Result<Option<RequestCounts>> {
        self.target.request_counts()
    }

    /// Records the FUSE requests since `before` per operation of the
    /// phase (`ops` operations of what `per` names), in the "requests"
    /// table, and their mix by opcode.
    pub fn record_requests(
        &mut self,
        workload: &str,
        per: &str,
        ops: u64,
        before: Option<RequestCounts>,
    ) -> Result<()> {
        let (Some(before), Some(after)) = (before, self.target.request_counts()?) else {
            return Ok(());
        };
        if ops == 0 {
            return Ok(());
        }
        let row = format!("{workload}: requests per {per}");
        let fs = self.target.label.as_str();
        let mut total = 0;
        for (op, count) in &after {
            let n = count.saturating_sub(before.get(op).copied().unwrap_or(0));
            if n > 0 {
                total += n;
                self.results
                    .record_request_mix(&row, fs, op, n as f64 / ops as f64);
            }
        }
        self.results.record(
            REQUESTS_TABLE,
            &row,
            "requests",
            Better::Lower,
            fs,
            total as f64 / ops as f64,
        );
        Ok(())
    }

    /// Times `body` followed by a sync of the file system: the phase ends
    /// durable.
    pub fn timed_durable(&self, body: impl FnOnce() -> Result<()>) -> Result<Duration> {
        timed(|| {
            body()?;
            self.target.sync()
        })
    }

    pub fn dir(&self) -> PathBuf {
        self.target.dir.clone()
    }
}

/// Runs `body` and returns how long it took.
pub fn timed(body: impl FnOnce() -> Result<()>) -> Result<Duration> {
    let start = Instant::now();
    body()?;
    Ok(start.elapsed())
}

/// Runs a workload command (output discarded); fails with its stderr.
/// `ok_codes` lists the exit codes that are not failures (grep exits 1
/// when nothing matched).
pub fn run_tool(cmd: &mut Command, ok_codes: &[i32]) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    match out.status.code() {
        Some(c) if c == 0 || ok_codes.contains(&c) => Ok(()),
        _ => bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        ),
    }
}

/// A tarball of a source tree, ready to be extracted into a file system.
#[derive(Debug, Clone)]
pub struct Tarball {
    pub path: PathBuf,
    /// The top directory inside the tarball.
    pub top: String,
    /// Members to extract (all when empty).
    pub members: Vec<String>,
    /// What extracting it creates.
    pub counts: MemberCounts,
}

/// The entries of a tarball (what is extracted), from its listing.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemberCounts {
    /// Files, directories, links: everything tar creates.
    pub entries: u64,
    pub dirs: u64,
    /// Everything but directories.
    pub files: u64,
}

impl MemberCounts {
    /// Counts the members `tar tf` lists (directories end in `/`).
    fn of(tar: &Path, members: &[String]) -> Result<MemberCounts> {
        let out = Command::new("tar")
            .arg("tf")
            .arg(tar)
            .args(members)
            .output()
            .context("running tar tf")?;
        if !out.status.success() {
            bail!(
                "tar tf {}: {}",
                tar.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let mut counts = MemberCounts::default();
        for line in out.stdout.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            counts.entries += 1;
            if line.ends_with(b"/") {
                counts.dirs += 1;
            } else {
                counts.files += 1;
            }
        }
        Ok(counts)
    }
}

impl Tarball {
    /// `tar xf` of the tarball into `dir`.
    pub fn extract_into(&self, dir: &Path) -> Result<()> {
        run_tool(
            Command::new("tar")
                .arg("xf")
                .arg(&self.path)
                .arg("-C")
                .arg(dir)
                .args(&self.members),
            &[],
        )
    }
}

/// The trees of the source and application suites.
#[derive(Debug, Clone)]
pub struct Trees {
    pub source: Option<Tarball>,
    pub app: Option<Tarball>,
}

const LINUX_XZ: &str = "/usr/src/linux-source-6.1.tar.xz";
const LINUX_TOP: &str = "linux-source-6.1";

/// Makes the tarball of `tree` in `scratch` (memory-backed, so reading it
/// costs the file systems under test nothing): the Debian kernel source
/// decompressed once, or a generated tree.
pub fn prepare_tree(tree: &SourceTree, scratch: &Path) -> Result<Tarball> {
    match tree {
        SourceTree::Linux { only } => {
            let tar = scratch.join(format!("{LINUX_TOP}.tar"));
            if !tar.exists() {
                if !Path::new(LINUX_XZ).exists() {
                    bail!("{LINUX_XZ} is missing (apt-get install -y linux-source-6.1), or use --scale quick");
                }
                let out = std::fs::File::create(&tar)
                    .with_context(|| format!("creating {}", tar.display()))?;
                let status = Command::new("xz")
                    .arg("-dc")
                    .arg(LINUX_XZ)
                    .stdout(out)
                    .status()
                    .context("running xz")?;
                if !status.success() {
                    let _ = std::fs::remove_file(&tar);
                    bail!("xz -dc {LINUX_XZ} failed ({status})");
                }
            }
            let members: Vec<String> = only.iter().map(|m| format!("{LINUX_TOP}/{m}")).collect();
            Ok(Tarball {
                counts: MemberCounts::of(&tar, &members)?,
                path: tar,
                top: LINUX_TOP.to_string(),
                members,
            })
        }
        SourceTree::Synthetic { files } => {
            let top = "synthetic-tree";
            let base = scratch.join(format!("synthetic-{files}"));
            let tar = scratch.join(format!("synthetic-{files}.tar"));
            if !tar.exists() {
                generate_tree(&base.join(top), *files)?;
                run_tool(
                    Command::new("tar")
                        .arg("cf")
                        .arg(&tar)
                        .arg("-C")
                        .arg(&base)
                        .arg(top),
                    &[],
                )?;
                std::fs::remove_dir_all(&base)?;
            }
            Ok(Tarball {
                counts: MemberCounts::of(&tar, &[])?,
                path: tar,
                top: top.to_string(),
                members: Vec::new(),
            })
        }
    }
}

/// A source-like tree: directories of up to 16 files three levels deep,
/// C-like text files of 200 B to 24 KiB, one `wait.c`, and `cpu_to_be64`
/// in every seventh file.
fn generate_tree(root: &Path, files: usize) -> Result<()> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(61);
    for i in 0..files {
        let dir = root.join(format!("sub{}/dir{}", i / 256, (i / 16) % 16));
        std::fs::create_dir_all(&dir)?;
        let name = if i == files / 2 {
            "wait.c".to_string()
        } else {
            format!("file{i}.c")
        };
        let len = rng.gen_range(200..24 << 10);
        let mut text = String::with_capacity(len + 80);
        text.push_str("// SPDX-License-Identifier: GPL-2.0\n#include <linux/kernel.h>\n");
        let mut line = 0;
        while text.len() < len {
            if i % 7 == 0 && line == 3 {
                text.push_str("\tv = cpu_to_be64(v);\n");
            }
            text.push_str(&format!(
                "static int f{i}_{line}(int x) {{ return x * {}; }}\n",
                rng.gen::<u16>()
            ));
            line += 1;
        }
        std::fs::write(dir.join(name), text)?;
    }
    Ok(())
}
