//! `betreefs fsck` (also `fsck.fuse.betreefs`, as `fsck -t fuse.betreefs`
//! calls it).
//!
//! Checking writes nothing: the image is opened read-only (shared lock,
//! `O_RDONLY`), the log is replayed in memory, and the trees and the
//! schema are verified. `--repair` (`-y`, `-a`, `-p`) then opens it
//! read-write and applies the repairs the check found, in passes, and
//! checks again. Exit codes follow fsck(8): 0 clean, 1 errors corrected,
//! 4 errors left uncorrected, 8 operational error, 16 usage error.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use betreefs_engine::{EngineError, Options, RecoveryReport, Store};
use betreefs_store::StoreError;

use crate::fs_cmds::engine_options_for;
use crate::image::{open_store, UNMOUNT_WAIT};

pub const FSCK_CLEAN: i32 = 0;
pub const FSCK_CORRECTED: i32 = 1;
pub const FSCK_UNCORRECTED: i32 = 4;
pub const FSCK_OPERATIONAL: i32 = 8;
pub const FSCK_USAGE: i32 = 16;

/// Repair passes at most: each pass can expose one more layer (a
/// recreated directory changes its parent's link count).
const REPAIR_PASSES: usize = 6;
/// Bytes in a MiB, for the figures fsck prints.
const MIB: f64 = 1024.0 * 1024.0;

#[derive(clap::Args)]
pub struct FsckArgs {
    /// Image file or block device (not mounted).
    pub path: PathBuf,
    /// Repair what can be repaired (orphans, link and inode counts, stray
    /// keys, missing directories, a damaged superblock copy, leaked space).
    #[arg(short = 'y', long, visible_alias = "yes")]
    pub repair: bool,
    /// With --repair, open even past a hole in the log, dropping the
    /// records after it (they cannot be replayed); without it such an
    /// image is only checked.
    #[arg(long, requires = "repair")]
    pub accept_log_loss: bool,
    /// Check only (the default).
    #[arg(short = 'n', long = "no-repair", conflicts_with = "repair")]
    pub no_repair: bool,
    /// fsck(8)'s automatic repair: the same as --repair.
    #[arg(short = 'a', short_alias = 'p', hide = true)]
    pub automatic: bool,
    /// fsck(8)'s force flag: betreefs always checks everything.
    #[arg(short = 'f', hide = true)]
    pub force: bool,
}

/// What the check found, beyond the schema report.
struct Findings {
    /// Problems that are not the schema scan's: (description, repairable).
    problems: Vec<(String, bool)>,
    notes: Vec<String>,
    schema: Option<betreefs_fs::fsck::Report>,
    unreachable: u64,
    log_hole: bool,
}

impl Findings {
    fn count(&self) -> u64 {
        self.problems.len() as u64 + self.schema.as_ref().map_or(0, |r| r.problem_count())
    }

    /// Whether a problem no repair can fix was found (a log hole is
    /// repaired only when the loss is accepted, see `run`).
    fn has_unrepairable(&self) -> bool {
        self.problems.iter().any(|(_, repairable)| !repairable)
            || self
                .schema
                .as_ref()
                .is_some_and(|s| (s.fixable() as u64) < s.problem_count())
    }
}

fn recovery_findings(r: &RecoveryReport, findings: &mut Findings) {
    if r.replayed_records > 0 {
        findings.notes.push(format!(
            "{} log records replayed in memory (a mount replays them for good)",
            r.replayed_records
        ));
    }
    if let Some(why) = &r.damaged_superblock {
        findings.problems.push((
            format!("{why}; the other copy was used (repair rewrites both)"),
            true,
        ));
    }
    if let Some(hole) = &r.hole {
        findings.log_hole = true;
        findings.problems.push((
            format!(
                "records left unreplayed past a hole in the log: {hole}; the files show \
                 the state before it (repairing needs --accept-log-loss and drops them)"
            ),
            true,
        ));
    }
}

/// Checks an open store: trees, then schema.
fn check_store(store: &Store, bar: &indicatif::ProgressBar) -> Result<Findings> {
    let mut findings = Findings {
        problems: Vec::new(),
        notes: Vec::new(),
        schema: None,
        unreachable: 0,
        log_hole: false,
    };
    recovery_findings(store.recovery(), &mut findings);
    bar.set_message("verifying the trees (checksums, order, bounds)");
    match store.verify() {
        Ok(v) => {
            findings.notes.push(format!(
                "{} nodes in the trees, {} of them leaves holding {:.1} MiB ({:.2} MiB each on average)",
                v.nodes,
                v.leaves,
                v.leaf_bytes as f64 / MIB,
                v.leaf_bytes as f64 / MIB / v.leaves.max(1) as f64
            ));
            findings.unreachable = v.unreachable.len() as u64;
            if findings.unreachable > 0 {
                findings.problems.push((
                    format!(
                        "{} nodes are held by the block table but reached by no tree \
                         (leaked space)",
                        findings.unreachable
                    ),
                    true,
                ));
            }
        }
        Err(e) => {
            findings
                .problems
                .push((format!("the trees are damaged: {e}"), false));
            return Ok(findings);
        }
    }
    let report = betreefs_fs::fsck::check(store, |n| {
        bar.set_message(format!("checking the schema: {n} keys"))
    });
    match report {
        Ok(r) => findings.schema = Some(r),
        Err(e) => findings
            .problems
            .push((format!("the schema scan stopped: {e}"), false)),
    }
    Ok(findings)
}

fn print_findings(path: &Path, f: &Findings) {
    for note in &f.notes {
        println!("{}: {note}", path.display());
    }
    for (what, repairable) in &f.problems {
        let tag = if *repairable { "" } else { " [not repairable]" };
        println!("problem: {what}{tag}");
    }
    if let Some(r) = &f.schema {
        println!(
            "{}: {} entries, {} directories, {} data blocks, {} xattrs",
            path.display(),
            r.entries,
            r.directories,
            r.data_keys,
            r.xattrs
        );
        for p in &r.problems {
            let tag = if p.fix.is_some() {
                ""
            } else {
                " [not repairable]"
            };
            println!("problem: {}{tag}", p.what);
        }
        if r.problems_not_shown > 0 {
            println!("... and {} more problems", r.problems_not_shown);
        }
    }
}

fn spinner() -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Whether an open failed because the image is damaged (a finding) rather
/// than unusable for other reasons (an operational error).
fn is_damage(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<EngineError>(),
        Some(
            EngineError::Store(StoreError::CorruptSuperblock(_) | StoreError::CorruptLog { .. })
                | EngineError::CorruptNode { .. }
                | EngineError::CorruptBlockTable(_)
                | EngineError::CorruptLogRecord { .. }
        )
    )
}

fn check_only(path: &Path, options: &Options) -> Result<(Findings, bool)> {
    let bar = spinner();
    bar.set_message("opening read-only (replaying the log in memory)");
    let store = match open_store(
        path,
        Options {
            read_only: true,
            ..options.clone()
        },
        UNMOUNT_WAIT,
    ) {
        Ok(store) => store,
        Err(e) if is_damage(&e) => {
            bar.finish_and_clear();
            let findings = Findings {
                problems: vec![(format!("the image cannot be opened: {e:#}"), false)],
                notes: Vec::new(),
                schema: None,
                unreachable: 0,
                log_hole: false,
            };
            return Ok((findings, false));
        }
        Err(e) => return Err(e),
    };
    let findings = check_store(&store, &bar);
    bar.finish_and_clear();
    store.close().context("closing")?;
    findings.map(|f| (f, true))
}

/// Opens read-write and repairs in passes; returns what is left.
fn repair(path: &Path, options: &Options, accept_log_loss: bool) -> Result<Findings> {
    let bar = spinner();
    bar.set_message("opening read-write to repair");
    let store = open_store(
        path,
        Options {
            accept_log_hole: accept_log_loss,
            ..options.clone()
        },
        UNMOUNT_WAIT,
    )?;
    let mut findings = check_store(&store, &bar)?;
    if findings.unreachable > 0 {
        let freed = store
            .free_unreachable_nodes()
            .context("freeing leaked nodes")?;
        println!("repaired: freed {freed} leaked nodes");
    }
    for _ in 0..REPAIR_PASSES {
        let Some(report) = findings.schema.as_ref().filter(|r| r.fixable() > 0) else {
            break;
        };
        let applied = betreefs_fs::fsck::repair(&store, report).map_err(|e| anyhow!(e))?;
        println!("repaired: {applied} schema problems");
        findings = check_store(&store, &bar)?;
    }
    bar.finish_and_clear();
    store.close().context("writing the repaired image")?;
    Ok(findings)
}

/// Runs fsck; returns the exit code.
pub fn run(args: FsckArgs) -> Result<i32> {
    if !args.path.exists() {
        eprintln!("betreefs fsck: {}: no such image", args.path.display());
        return Ok(FSCK_OPERATIONAL);
    }
    let options = engine_options_for(&args.path);
    let (findings, opened) = check_only(&args.path, &options)?;
    print_findings(&args.path, &findings);
    if findings.count() == 0 {
        println!("clean");
        return Ok(FSCK_CLEAN);
    }
    let want_repair = (args.repair || args.automatic) && !args.no_repair;
    let refusal = if !opened || findings.has_unrepairable() {
        Some("some cannot be repaired")
    } else if !want_repair {
        Some("run `betreefs fsck --repair` to repair them")
    } else if findings.log_hole && !args.accept_log_loss {
        Some("the log has a hole: repairing drops what lies past it, add --accept-log-loss")
    } else {
        None
    };
    if let Some(why) = refusal {
        println!("{} problem(s) found; {why}", findings.count());
        return Ok(FSCK_UNCORRECTED);
    }
    repair(&args.path, &options, args.accept_log_loss)?;
    // The repaired image, checked read-only as a mount would see it.
    let (after_check, _) = check_only(&args.path, &options)?;
    if after_check.count() == 0 {
        println!("{} problem(s) repaired; clean", findings.count());
        Ok(FSCK_CORRECTED)
    } else {
        print_findings(&args.path, &after_check);
        println!("{} problem(s) left after repair", after_check.count());
        Ok(FSCK_UNCORRECTED)
    }
}
