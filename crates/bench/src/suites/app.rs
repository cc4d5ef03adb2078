//! The application suite (BetrFS 0.4 §7.4, 0.6 §7.2): rsync with and
//! without --inplace, tar and untar within the file system, and git (add
//! and commit of a tree, status, diff between two commits, local clone).
//! Every phase starts cold and ends durable. On nullfuse only the phases
//! that never read back what they wrote run.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use super::{run_tool, timed, Recorder};

/// git with a fixed identity and no user or system configuration, so runs
/// do not depend on the machine.
fn git(repo: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("-C")
        .arg(repo)
        .args(["-c", "gc.auto=0", "-c", "init.defaultBranch=main"])
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", "bench")
        .env("GIT_AUTHOR_EMAIL", "bench@localhost")
        .env("GIT_COMMITTER_NAME", "bench")
        .env("GIT_COMMITTER_EMAIL", "bench@localhost");
    cmd
}

pub fn run(r: &mut Recorder) -> Result<()> {
    let tree = r
        .trees
        .app
        .clone()
        .context("no application tree prepared")?;
    let dir = r.dir();
    let src = dir.join("src");
    // The tree to work on (not timed).
    tree.extract_into(&dir)?;
    std::fs::rename(dir.join(&tree.top), &src)?;
    r.target.sync()?;

    let copies = [
        ("rsync -a", "rsync", false),
        ("rsync -a --inplace", "rsync-inplace", true),
    ];
    for (label, to, inplace) in copies {
        r.target.cold()?;
        r.phase(label)?;
        let before = r.requests_before()?;
        let t = r.timed_durable(|| {
            let mut cmd = Command::new("rsync");
            cmd.arg("-a");
            if inplace {
                cmd.arg("--inplace");
            }
            run_tool(
                cmd.arg(format!("{}/", src.display())).arg(dir.join(to)),
                &[],
            )
        })?;
        r.seconds(&format!("{label} of the tree + sync"), t);
        r.record_requests(
            &format!("{label} + sync"),
            "entry",
            tree.counts.entries,
            before,
        )?;
    }

    r.target.cold()?;
    r.phase("tar")?;
    let archive = dir.join("tree.tar");
    let t = r.timed_durable(|| {
        run_tool(
            Command::new("tar")
                .arg("cf")
                .arg(&archive)
                .arg("-C")
                .arg(&dir)
                .arg("src"),
            &[],
        )
    })?;
    r.seconds("tar cf into the file system + sync", t);

    if !r.target.kind.keeps_data() {
        // nullfuse reads back zeros: an archive or a repository written to
        // it cannot be read again, so the phases that do are not run.
        return Ok(());
    }

    r.target.cold()?;
    r.phase("untar")?;
    let untar = dir.join("untar");
    std::fs::create_dir(&untar)?;
    let t = r.timed_durable(|| {
        run_tool(
            Command::new("tar")
                .arg("xf")
                .arg(&archive)
                .arg("-C")
                .arg(&untar),
            &[],
        )
    })?;
    r.seconds("untar from the file system + sync", t);

    // git works on the first rsync copy.
    let repo = dir.join("rsync");
    r.target.cold()?;
    r.phase("git add + commit")?;
    let t = r.timed_durable(|| {
        run_tool(git(&repo).args(["init", "-q"]), &[])?;
        // --force: the whole tree is the workload, whatever its
        // .gitignore says (Debian's kernel source ignores everything at
        // its top level).
        run_tool(git(&repo).args(["add", "-A", "--force"]), &[])?;
        run_tool(git(&repo).args(["commit", "-q", "-m", "the tree"]), &[])
    })?;
    r.seconds("git init + add + commit + sync", t);

    // A second commit that changes every 20th file (not timed).
    let mut files = Vec::new();
    collect_files(&repo, &mut files)?;
    files.sort();
    for f in files.iter().step_by(20) {
        let mut text = std::fs::read(f)?;
        text.extend_from_slice(b"\n/* changed by betreefs-bench */\n");
        std::fs::write(f, text)?;
    }
    run_tool(
        git(&repo).args(["commit", "-q", "-a", "-m", "changes"]),
        &[],
    )?;
    r.target.sync()?;

    r.target.cold()?;
    r.phase("git status")?;
    let t = timed(|| run_tool(git(&repo).arg("status"), &[]))?;
    r.seconds("git status (cold)", t);

    r.target.cold()?;
    r.phase("git diff")?;
    let t = timed(|| run_tool(git(&repo).args(["diff", "HEAD~1", "HEAD"]), &[]))?;
    r.seconds("git diff between two commits (cold)", t);

    r.target.cold()?;
    r.phase("git clone")?;
    let t =
        r.timed_durable(|| run_tool(git(&dir).args(["clone", "-q"]).arg(&repo).arg("clone"), &[]))?;
    r.seconds("git clone (local) + sync", t);
    Ok(())
}

/// Regular files below `dir`, skipping `.git`.
fn collect_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            if entry.file_name() != ".git" {
                collect_files(&entry.path(), out)?;
            }
        } else if kind.is_file() {
            out.push(entry.path());
        }
    }
    Ok(())
}
