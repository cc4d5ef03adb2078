//! `betreefs-bench`: betreefs beside ext4, XFS, btrfs (and tmpfs and the
//! no-op FUSE ceiling, nullfuse) in one run, every file system freshly
//! made on its own loop device for every suite, with the papers' suites
//! and device-level IO amplification. Writes raw JSON, Markdown tables
//! with ratios to the best file system, and PNG plots.

mod cleanup;
mod device_stalls;
mod devstats;
mod plot;
mod progress;
mod report;
mod scale;
mod suites;
mod targets;
mod workloads;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde::Serialize;

use crate::cleanup::Resource;
use crate::progress::Progress;
use crate::report::Results;
use crate::scale::{Params, Scale};
use crate::suites::{Recorder, Suite, Trees};
use crate::targets::{Env, FsSpec, Kind, Target};

#[derive(Parser, Debug)]
#[command(
    name = "betreefs-bench",
    version,
    about = "Benchmarks betreefs beside ext4, XFS and btrfs in one run (run as root)"
)]
struct Args {
    /// File systems, comma-separated, in the order of the tables' columns:
    /// betreefs, nullfuse, ext4, xfs, btrfs, tmpfs; a FUSE one may carry
    /// mount options after `@`, joined by `+` (`nullfuse@transport=devfuse`,
    /// `betreefs@writeback+transport=uring`), to compare settings side by
    /// side.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "betreefs,nullfuse,ext4,xfs,btrfs"
    )]
    fs: Vec<FsSpec>,
    /// Suites, comma-separated: micro, source, app, ioamp.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "micro,source,app,ioamp"
    )]
    suite: Vec<Suite>,
    /// quick: a smoke run (a synthetic tree, small sizes); default: the
    /// whole thing in under 45 minutes on a 2-core machine; paper: the
    /// papers' sizes.
    #[arg(long, value_enum, default_value = "default")]
    scale: Scale,
    /// Where results.json, results.md, the plots and daemon logs go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// A disk-backed directory for the images and mount points.
    #[arg(long, default_value = "/var/tmp/betreefs-bench")]
    workdir: PathBuf,
    /// Rounds (the tables show medians); file systems are interleaved
    /// within a round. Default: 3 at the default scale, else 1.
    #[arg(long)]
    rounds: Option<usize>,
    /// The betreefs binary (default: the one next to this binary).
    #[arg(long)]
    betreefs: Option<PathBuf>,
    /// Image size in GiB (sparse) instead of the scale's.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    image_gib: Option<u64>,
}

/// The list without repeats, in the order given.
fn first_of_each<T: PartialEq + Clone>(items: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        if !out.contains(item) {
            out.push(item.clone());
        }
    }
    out
}

/// What the JSON file holds besides the figures.
#[derive(Serialize)]
struct Report<'a> {
    date: String,
    command: String,
    commit: Option<String>,
    machine: Machine,
    scale: Scale,
    rounds: usize,
    file_systems: Vec<String>,
    suites: Vec<&'static str>,
    params: &'a Params,
    results: &'a Results,
}

#[derive(Serialize)]
struct Machine {
    kernel: String,
    cpu: String,
    cpus: usize,
    memory: String,
    /// The fuse module's `enable_uring` (whether FUSE mounts may use
    /// io_uring): "Y", "N", or "absent".
    fuse_uring: String,
}

impl Machine {
    fn here() -> Machine {
        let first = |file: &str, key: &str| {
            std::fs::read_to_string(file)
                .ok()
                .and_then(|t| {
                    t.lines()
                        .find(|l| l.starts_with(key))
                        .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
                })
                .unwrap_or_default()
        };
        Machine {
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            cpu: first("/proc/cpuinfo", "model name"),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory: first("/proc/meminfo", "MemTotal"),
            fuse_uring: std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
                .map(|v| v.trim().to_string())
                .unwrap_or_else(|_| "absent".into()),
        }
    }
}

fn main() {
    let args = Args::parse();
    match run(args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            if cleanup::interrupted() {
                // The signal handler is cleaning up and will exit.
                cleanup::stopped_after_interrupt();
            }
            cleanup::release_all();
            eprintln!("betreefs-bench: {e:#}");
            std::process::exit(2);
        }
    }
}

/// Runs everything; Ok(false) when some suite failed on some file system
/// (the others still ran and were reported).
fn run(args: Args) -> Result<bool> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("run as root: the harness makes loop devices, mounts file systems and drops caches");
    }
    let rounds = args.rounds.unwrap_or(match args.scale {
        Scale::Default => 3,
        Scale::Quick | Scale::Paper => 1,
    });
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let specs = first_of_each(&args.fs);
    let suite_list = first_of_each(&args.suite);
    let mut params = Params::of(args.scale);
    if let Some(gib) = args.image_gib {
        params.image_size = gib << 30;
    }
    let betreefs = match &args.betreefs {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .context("locating this binary")?
            .with_file_name("betreefs"),
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let out = args.out.canonicalize()?;
    let logs = out.join("logs");
    std::fs::create_dir_all(&logs)?;
    let work = args.workdir.join(format!("run-{}", std::process::id()));
    let env = Env {
        work: work.clone(),
        betreefs,
        image_size: params.image_size,
        logs,
    };
    env.check_tools(&specs)?;
    let mut tools = vec![];
    if suite_list.contains(&Suite::Source) {
        tools.extend(["tar", "find", "grep", "xz"]);
    }
    if suite_list.contains(&Suite::App) {
        tools.extend(["tar", "rsync", "git"]);
    }
    if let Some(missing) = tools.iter().find(|t| !targets::on_path(t)) {
        bail!("{missing} is missing (apt-get install -y tar findutils grep xz-utils rsync git)");
    }

    std::fs::create_dir_all(&args.workdir)
        .with_context(|| format!("creating {}", args.workdir.display()))?;
    let scratch = PathBuf::from(format!("/dev/shm/betreefs-bench-{}", std::process::id()));
    for (dir, needed, hint) in [
        (
            args.workdir.as_path(),
            params.workdir_bytes_needed(&suite_list),
            "--workdir",
        ),
        (
            Path::new("/dev/shm"),
            params.shm_bytes_needed(&suite_list),
            "a smaller --scale",
        ),
    ] {
        let available = devstats::space_available(dir)?;
        if available < needed {
            bail!(
                "{} has {} MiB free; this run needs about {} MiB there (try {hint})",
                dir.display(),
                available >> 20,
                needed >> 20
            );
        }
    }

    cleanup::install_signal_handler()?;
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    cleanup::register(Resource::Tree(work.clone()))?;
    std::fs::create_dir_all(&scratch)?;
    cleanup::register(Resource::Tree(scratch.clone()))?;

    let runs_on = |kind: Kind, suite: Suite| suite != Suite::Ioamp || kind.has_device();
    let total: u64 = specs
        .iter()
        .flat_map(|spec| {
            suite_list
                .iter()
                .filter(move |s| runs_on(spec.kind, **s))
                .map(|s| s.phases())
        })
        .sum::<u64>()
        * rounds as u64;
    let progress = Progress::new(total);
    progress.status("preparing the source trees");
    let trees = Trees {
        source: suite_list
            .contains(&Suite::Source)
            .then(|| suites::prepare_tree(&params.source_tree, &scratch))
            .transpose()?,
        app: suite_list
            .contains(&Suite::App)
            .then(|| suites::prepare_tree(&params.app_tree, &scratch))
            .transpose()?,
    };

    let mut results = Results::default();
    for round in 0..rounds {
        for spec in &specs {
            for &suite in suite_list.iter().filter(|s| runs_on(spec.kind, **s)) {
                let start = progress.position();
                let what = format!("round {} · {} · {}", round + 1, spec.label, suite.name());
                progress.status(&format!("{what} · setting up"));
                let outcome =
                    run_suite(spec, suite, &env, &params, &trees, &mut results, &progress);
                if cleanup::interrupted() {
                    progress.finish();
                    cleanup::stopped_after_interrupt();
                }
                if let Err(e) = outcome {
                    let line = format!("{what}: {e:#}");
                    progress.line(&format!("FAILED {line}"));
                    results.errors.push(line);
                }
                progress.set_position(start + suite.phases());
            }
        }
    }
    progress.finish();
    cleanup::release_all();

    let names: Vec<String> = specs.iter().map(|s| s.label.clone()).collect();
    let report = Report {
        date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        commit: git_commit(),
        machine: Machine::here(),
        scale: args.scale,
        rounds,
        file_systems: names.clone(),
        suites: suite_list.iter().map(|s| s.name()).collect(),
        params: &params,
        results: &results,
    };
    let json = out.join("results.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let plots = write_plots(&out, &results);
    let md = out.join("results.md");
    std::fs::write(&md, markdown(&report, &specs, &plots))
        .with_context(|| format!("writing {}", md.display()))?;
    eprintln!(
        "betreefs-bench: wrote {}, {} and {} plots",
        json.display(),
        md.display(),
        plots.iter().filter(|p| p.1.is_ok()).count()
    );
    for e in &results.errors {
        eprintln!("betreefs-bench: FAILED {e}");
    }
    Ok(results.errors.is_empty())
}

/// One suite on a freshly made file system, which is torn down after it
/// whatever happened.
fn run_suite(
    spec: &FsSpec,
    suite: Suite,
    env: &Env,
    params: &Params,
    trees: &Trees,
    results: &mut Results,
    progress: &Progress,
) -> Result<()> {
    let mut target = Target::setup(spec, env)?;
    let mut recorder = Recorder {
        target: &mut target,
        params,
        trees,
        results,
        progress,
        suite,
        phase: None,
        suite_peak_mib: None,
    };
    let outcome = match suite {
        Suite::Micro => suites::micro::run(&mut recorder),
        Suite::Source => suites::source::run(&mut recorder),
        Suite::App => suites::app::run(&mut recorder),
        Suite::Ioamp => suites::ioamp::run(&mut recorder),
    };
    if outcome.is_ok() {
        recorder.end_suite();
    }
    progress.status(&format!("{} · {} · tearing down", spec.label, suite.name()));
    let teardown = target.teardown();
    outcome?;
    teardown
}

fn git_commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Draws the plots; each entry is the file name and whether it was drawn.
fn write_plots(out: &Path, results: &Results) -> Vec<(String, Result<()>)> {
    use plot::Axis;
    let mut drawn = Vec::new();
    if let Err(e) = plot::register_font() {
        drawn.push(("(all)".to_string(), Err(e)));
        return drawn;
    }
    /// How a series is drawn.
    enum Chart {
        Line(Axis, Axis),
        Bars,
    }
    let plots = [
        (
            "tokubench",
            "tokubench.png",
            "tokubench: cumulative throughput",
            Chart::Line(Axis::Linear, Axis::Log10),
        ),
        (
            "rename",
            "rename.png",
            "rename + fsync against file size",
            Chart::Line(Axis::LogBytes, Axis::Log10),
        ),
        (
            "unlink",
            "unlink.png",
            "unlink + fsync against file size",
            Chart::Line(Axis::LogBytes, Axis::Log10),
        ),
        (
            "write_amp",
            "write-amp.png",
            "device KiB written per operation",
            Chart::Bars,
        ),
    ];
    for (series, file, title, chart) in plots {
        if let Some(s) = results.series.get(series) {
            let path = out.join(file);
            let done = match chart {
                Chart::Line(x, y) => plot::line_plot(&path, title, s, x, y),
                Chart::Bars => plot::bar_plot(&path, title, s),
            };
            drawn.push((file.to_string(), done));
        }
    }
    drawn
}

const SUITE_NOTES: [(&str, &str); 4] = [
    (
        "micro",
        "Sequential write of one file in 1 MiB writes + fsync, then its cold sequential read; random block-aligned 4 KiB and 4-byte writes into it, one fsync at the end; tokubench (200-byte files, at most 128 entries per directory, 2 threads, ending with a sync; also the p99, p99.9 and longest of a file's create + write + close, as its thread waited); rename, first hard link and unlink of files of each size, each followed by an fsync of the parent (median of the repeats).",
    ),
    (
        "source",
        "A source tree: untar + sync; the p99, p99.9 and longest 4 KiB write + fsync (into a 1 MiB file, round-robin) while a second untar of the tree runs, and on a device the longest call with the device's stalls taken out (windows of 5 ms or more in which the loop device held requests and completed none, sampled every 2 ms: the table \"Device stalls\" below); then cold-cache find, grep -r and tar cf (to a pipe: GNU tar does not read files when the archive is /dev/null), mv of the tree root + sync, a clone of it + sync (betreefs clone; cp -a --reflink=auto on the others: reflinks on XFS and btrfs, a copy on ext4, tmpfs and nullfuse), rm -rf + sync.",
    ),
    (
        "app",
        "On a source tree inside the file system, each phase cold and ending with a sync: rsync -a and rsync -a --inplace to new directories, tar cf of the tree into the file system and untar of that archive, git init + add + commit of the tree, git status, git diff between two commits (every 20th file changed), and a local git clone.",
    ),
    (
        "ioamp",
        "Device bytes from the loop device's block counters (the same for every file system): written by the time the operation's fsyncs returned, written later (forced out by unmounting: writeback, journal and tree checkpoints), and read; data operations as a multiple of the user bytes, metadata operations in KiB per operation; space used (statvfs) per user byte; cold 4 KiB reads both as many random reads of one file and as one open + read right after mounting (median of five mounts). File systems without a device (nullfuse, tmpfs) have no row here.",
    ),
];

fn markdown(report: &Report, specs: &[FsSpec], plots: &[(String, Result<()>)]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# betreefs-bench results\n");
    let _ = writeln!(md, "- date: {}", report.date);
    let _ = writeln!(md, "- command: `{}`", report.command);
    if let Some(commit) = &report.commit {
        let _ = writeln!(md, "- commit: {commit}");
    }
    let m = &report.machine;
    let _ = writeln!(
        md,
        "- machine: Linux {}, {} × {}, {} memory, FUSE over io_uring: {}",
        m.kernel,
        m.cpus,
        m.cpu,
        m.memory,
        match m.fuse_uring.as_str() {
            "Y" | "1" => "on (FUSE mounts use it unless told otherwise)",
            "absent" => "not in this kernel",
            _ => "off (fuse module parameter enable_uring)",
        }
    );
    let _ = writeln!(
        md,
        "- scale: {:?}, rounds: {}\n",
        report.scale, report.rounds
    );
    let _ = writeln!(
        md,
        "Each cell is the median over the rounds, then its fraction of the best file system in that row \
         (nullfuse keeps no data and never counts as the best); ✓ marks the compleat band (at least {:.0}% of \
         the best), ✗ a figure under {:.0}% of the best.\n",
        report::COMPLEAT * 100.0,
        report::FAR_BEHIND * 100.0
    );
    let order: Vec<String> = report.file_systems.iter().map(|s| s.to_string()).collect();
    let keeps_data = |fs: &str| specs.iter().any(|s| s.label == fs && s.kind.keeps_data());
    let fuse: Vec<String> = specs
        .iter()
        .filter(|s| s.kind.is_fuse())
        .map(|s| s.label.clone())
        .collect();
    let on_device: Vec<String> = specs
        .iter()
        .filter(|s| s.kind.has_device())
        .map(|s| s.label.clone())
        .collect();
    // The tables of figures that rank nothing: a heading, what they hold,
    // and a column for each file system they concern.
    let unranked: [(&str, &str, &str, &[String]); 3] = [
        (
            suites::MEMORY_TABLE,
            "Daemon memory",
            "The mount daemon's peak resident size over each suite and each of its phases (the \
             kernel's high-water mark, VmHWM, read at the end of every phase and before every \
             unmount, then reset; the final checkpoint after the last unmount is not in it). \
             betreefs runs with its default memory budget, `cache=256M` (node cache, inode \
             table and IO buffers); its target is the budget + 64 MiB, 320 MiB.",
            &fuse,
        ),
        (
            suites::DEVICE_TABLE,
            "Device stalls",
            "The longest window of a phase in which the loop device under the file system held \
             requests and completed none (its block statistics sampled every 2 ms; windows of 5 ms \
             or more): time the device, not the file system, made callers wait. The suites' rows \
             \"device stalls taken out\" are their calls less these windows \
             (docs/benchmarks/fsync-stalls.md).",
            &on_device,
        ),
        (
            suites::REQUESTS_TABLE,
            "FUSE requests",
            "Requests the daemon answered during each phase (its per-opcode counters, \
             `betreefs stats`), divided by the phase's operations: the entries of the tree for \
             untar, tar and rm -rf, its directories for find, its files for grep, the files \
             created for tokubench; the phase's closing sync included.",
            &fuse,
        ),
    ];
    for suite in report.results.suites() {
        if unranked.iter().any(|(table, ..)| *table == suite) {
            continue;
        }
        let _ = writeln!(md, "## {suite}\n");
        if let Some((_, note)) = SUITE_NOTES.iter().find(|(s, _)| *s == suite) {
            let _ = writeln!(md, "{note}\n");
        }
        let _ = writeln!(
            md,
            "{}",
            report.results.markdown(&suite, &order, &keeps_data)
        );
    }
    for (table, heading, about, columns) in unranked {
        if !report.results.suites().iter().any(|s| s == table) {
            continue;
        }
        let _ = writeln!(md, "## {heading}\n\n{about}\n");
        let _ = writeln!(
            md,
            "{}",
            report.results.markdown(table, columns, &|_| false)
        );
        if table == suites::REQUESTS_TABLE {
            let _ = writeln!(md, "{}", report.results.request_mix_markdown(&fuse));
        }
    }
    if !plots.is_empty() {
        let _ = writeln!(md, "## Plots\n");
        for (file, drawn) in plots {
            match drawn {
                Ok(()) => {
                    let _ = writeln!(md, "![{file}]({file})\n");
                }
                Err(e) => {
                    let _ = writeln!(md, "- {file}: not drawn: {e:#}\n");
                }
            }
        }
    }
    if !report.results.errors.is_empty() {
        let _ = writeln!(md, "## Failures\n");
        for e in &report.results.errors {
            let _ = writeln!(md, "- {e}");
        }
    }
    md
}
