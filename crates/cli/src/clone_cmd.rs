//! `betreefs clone SRC DST`: a copy of a directory tree on a mounted
//! betreefs whose data is shared copy-on-write (docs/design.md, "Clone of
//! a directory tree").
//!
//! The command makes DST itself (an empty directory, through the kernel,
//! so that every cache of DST's parent stays true), then asks the mount's
//! daemon with the `BETREEFS_IOC_CLONE_TREE` ioctl on DST to fill it with
//! a clone of SRC; the daemon does that in one atomic batch. If the ioctl
//! fails, the empty DST is removed again.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use betreefs_fuse::abi::ioctl::BETREEFS_IOC_CLONE_TREE;

#[derive(clap::Args)]
pub struct CloneArgs {
    /// A directory on a mounted betreefs.
    pub source: PathBuf,
    /// Where the copy goes: a new name on the same mount.
    pub destination: PathBuf,
}

pub fn run(args: CloneArgs) -> Result<()> {
    let (src, dst) = (&args.source, &args.destination);
    let src_meta = std::fs::metadata(src).with_context(|| format!("{}", src.display()))?;
    if !src_meta.is_dir() {
        bail!(
            "{}: not a directory (cp --reflink clones a file)",
            src.display()
        );
    }
    if std::fs::symlink_metadata(dst).is_ok() {
        bail!("{}: exists", dst.display());
    }
    let parent = match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent_meta = std::fs::metadata(parent).with_context(|| format!("{}", parent.display()))?;
    if parent_meta.dev() != src_meta.dev() {
        bail!(
            "{} and {} are not on the same file system",
            src.display(),
            parent.display()
        );
    }
    // Data still in the kernel's page cache reaches the daemon first: the
    // clone copies what the daemon holds.
    let src_dir = File::open(src).with_context(|| format!("{}", src.display()))?;
    // SAFETY: syncfs takes any open descriptor; src_dir outlives the call.
    if unsafe { libc::syncfs(src_dir.as_raw_fd()) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("syncfs {}", src.display()));
    }
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(dst)
        .with_context(|| format!("mkdir {}", dst.display()))?;
    let filled = fill(src_meta.ino(), dst);
    if filled.is_err() {
        let _ = std::fs::remove_dir(dst);
    }
    filled.with_context(|| format!("cloning {} to {}", src.display(), dst.display()))
}

/// Asks the daemon to fill the empty directory `dst` with a clone of the
/// directory numbered `src_ino`, then has the kernel fetch `dst`'s new
/// attributes (its cached ones are those of the empty directory).
fn fill(src_ino: u64, dst: &Path) -> Result<()> {
    let dir = File::open(dst)?;
    // SAFETY: the command is `_IOW(.., u64)`: the kernel reads 8 bytes
    // from the pointer, which points at a live u64.
    let r = unsafe {
        libc::ioctl(
            dir.as_raw_fd(),
            BETREEFS_IOC_CLONE_TREE as libc::c_ulong,
            &src_ino as *const u64,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOTTY) => anyhow::anyhow!("{e}: not a betreefs mount"),
            Some(libc::EPERM) => anyhow::anyhow!("{e}: only root may clone a tree"),
            Some(libc::EINVAL) => anyhow::anyhow!("{e}: the destination is inside the source"),
            Some(libc::EFBIG) => anyhow::anyhow!(
                "{e}: the tree's records do not fit in one batch of the log \
                 (a quarter of the log region; see docs/design.md)"
            ),
            _ => e.into(),
        });
    }
    let path = CString::new(dst.as_os_str().as_bytes())?;
    // SAFETY: statx writes into `out`, a properly sized and aligned struct,
    // and reads the NUL-terminated path.
    let r = unsafe {
        let mut out: libc::statx = std::mem::zeroed();
        libc::statx(
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_STATX_FORCE_SYNC,
            libc::STATX_BASIC_STATS,
            &mut out,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).context("statx");
    }
    Ok(())
}
