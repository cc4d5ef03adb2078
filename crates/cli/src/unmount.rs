//! `betreefs umount DIR` and the `umount.fuse.betreefs` helper that
//! umount(8) calls for mounts of that type: unmount, then return only once
//! the daemon has written its final checkpoint and exited, so the next
//! command (fsck, mount, a benchmark's cleanup) finds the image free.
//! The kernel lets a FUSE mountpoint go before the daemon is done.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::image::{betreefs_mounts, lock_holder};

/// How long to wait for a daemon's final checkpoint.
const DAEMON_EXIT_WAIT: Duration = Duration::from_secs(600);

#[derive(clap::Args)]
pub struct UmountArgs {
    /// Where the file system is mounted (or its image).
    pub target: PathBuf,
    /// Detach now and do not wait for the daemon (umount -l).
    #[arg(short = 'l', long)]
    pub lazy: bool,
}

/// The mountpoint and the image of a betreefs mount named by either.
fn find_mount(target: &Path) -> Result<(PathBuf, PathBuf)> {
    let canonical = target
        .canonicalize()
        .with_context(|| format!("{}", target.display()))?;
    betreefs_mounts()
        .into_iter()
        .find(|(source, dir)| *dir == canonical || Path::new(source) == canonical)
        .map(|(source, dir)| (dir, PathBuf::from(source)))
        .ok_or_else(|| anyhow!("{} is not a mounted betreefs", target.display()))
}

/// Whether process `pid` is gone (or a zombie: it finished).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // pid (comm) state ...: the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

fn unmount_syscall(dir: &Path, lazy: bool) -> Result<()> {
    let path = CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| anyhow!("{} has a NUL byte", dir.display()))?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: path is a valid NUL-terminated string.
    if unsafe { libc::umount2(path.as_ptr(), flags) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EPERM) {
        // Not root: the FUSE way.
        let mut cmd = std::process::Command::new("fusermount3");
        cmd.arg("-u");
        if lazy {
            cmd.arg("-z");
        }
        let status = cmd.arg(dir).status().context("running fusermount3")?;
        if status.success() {
            return Ok(());
        }
        bail!("fusermount3 -u {} failed", dir.display());
    }
    Err(err).with_context(|| format!("unmounting {}", dir.display()))
}

/// Unmounts a betreefs and waits for its daemon to exit.
pub fn unmount_and_wait(target: &Path, lazy: bool) -> Result<()> {
    let (dir, image) = find_mount(target)?;
    let daemon = lock_holder(&image);
    unmount_syscall(&dir, lazy)?;
    let Some(pid) = daemon.filter(|_| !lazy) else {
        return Ok(());
    };
    let started = Instant::now();
    let mut told = false;
    while !exited(pid) {
        if started.elapsed() > DAEMON_EXIT_WAIT {
            bail!(
                "unmounted {}, but its daemon (process {pid}) is still running after {} s",
                dir.display(),
                DAEMON_EXIT_WAIT.as_secs()
            );
        }
        if !told && started.elapsed() > Duration::from_secs(1) {
            eprintln!(
                "betreefs: waiting for the daemon (process {pid}) to write its final checkpoint"
            );
            told = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

pub fn run(args: UmountArgs) -> Result<()> {
    unmount_and_wait(&args.target, args.lazy)
}

/// `umount.fuse.betreefs TARGET [-flnrv] [-N ns] [-t type]`, as umount(8)
/// calls it.
pub fn run_helper(argv: &[String]) -> Result<()> {
    let mut target = None;
    let mut lazy = false;
    let mut i = 0;
    while i < argv.len() {
        match argv[i].as_str() {
            "-t" | "-N" => i += 1,
            flags if flags.starts_with('-') => lazy |= flags.contains('l'),
            t => target = Some(PathBuf::from(t)),
        }
        i += 1;
    }
    let target =
        target.ok_or_else(|| anyhow!("usage: umount.fuse.betreefs MOUNTPOINT [-flnrv]"))?;
    unmount_and_wait(&target, lazy)
}
