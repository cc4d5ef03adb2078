//! Opening an image from the command line: who else holds it.
//!
//! A store takes an advisory lock on its image (exclusive to write, shared
//! to read). When the lock is taken, either the image is mounted (refused
//! at once, naming the mountpoint) or a daemon is finishing an unmount —
//! writing its final checkpoint after the kernel already let the mountpoint
//! go — and the command waits for it, with a message and a bound, instead
//! of failing: `umount DIR && betreefs fsck IMAGE` just works.

use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use betreefs_engine::{EngineError, Options, Store};
use betreefs_store::StoreError;

/// How long a command waits for a daemon that is unmounting the image.
pub const UNMOUNT_WAIT: Duration = Duration::from_secs(120);

/// The mounts of type `fuse.betreefs`: (source, mountpoint).
pub fn betreefs_mounts() -> Vec<(String, PathBuf)> {
    betreefs_fuse::mount::mounts()
        .into_iter()
        .filter(|m| m.fstype == "fuse.betreefs")
        .map(|m| (m.source, m.mountpoint))
        .collect()
}

/// Where `image` is mounted, if it is (the mount's source is the image's
/// canonical path, see `daemon`).
pub fn mounted_at(image: &Path) -> Option<PathBuf> {
    let canonical = image.canonicalize().ok()?;
    betreefs_mounts()
        .into_iter()
        .find(|(source, _)| Path::new(source) == canonical)
        .map(|(_, dir)| dir)
}

/// The process holding a lock on `image`, from /proc/locks.
pub fn lock_holder(image: &Path) -> Option<u32> {
    let meta = std::fs::metadata(image).ok()?;
    let (dev, ino) = (meta.dev(), meta.ino());
    let wanted = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|line| {
        // 1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (pid, id) = (fields.get(4)?, fields.get(5)?);
        (fields.get(1) == Some(&"FLOCK") && *id == wanted)
            .then(|| pid.parse().ok())
            .flatten()
    })
}

fn is_locked(e: &EngineError) -> bool {
    matches!(e, EngineError::Store(StoreError::Io { source, .. }) if source.kind() == ErrorKind::WouldBlock)
}

/// Opens a store, refusing a mounted image and waiting up to `wait` for
/// a daemon that is unmounting it.
pub fn open_store(image: &Path, options: Options, wait: Duration) -> Result<Store> {
    let started = Instant::now();
    let mut told = false;
    loop {
        match Store::open(image, options.clone()) {
            Ok(store) => return Ok(store),
            Err(e) if is_locked(&e) => {
                if let Some(dir) = mounted_at(image) {
                    bail!(
                        "{} is mounted on {}; unmount it first",
                        image.display(),
                        dir.display()
                    );
                }
                let holder = lock_holder(image)
                    .map_or_else(|| "another process".into(), |pid| format!("process {pid}"));
                if started.elapsed() >= wait {
                    bail!(
                        "{} is still held by {holder} after {} s",
                        image.display(),
                        wait.as_secs()
                    );
                }
                if !told {
                    eprintln!(
                        "betreefs: {} is held by {holder} (a daemon finishing its unmount?); \
                         waiting up to {} s",
                        image.display(),
                        wait.as_secs()
                    );
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(anyhow::Error::new(e)),
        }
    }
}
