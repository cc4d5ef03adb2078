//! Everything a run creates outside its output directory (mounts, loop
//! devices, mount daemons, images, scratch files) is registered here the
//! moment it exists and released in reverse order: by the owner on the
//! normal path, and by [`release_all`] on an error or a signal. A run never
//! leaves a mount or a loop device behind, and never touches one it did not
//! create.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One thing a run created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resource {
    /// A mount on this directory.
    Mount(PathBuf),
    /// A loop device (`/dev/loopN`).
    Loop(String),
    /// A mount daemon we started (process id); it exits once its mount is
    /// gone, and is sent SIGTERM if it does not.
    Daemon(u32),
    /// A file to remove.
    File(PathBuf),
    /// A directory to remove with everything in it, unless something is
    /// mounted on or below it.
    Tree(PathBuf),
}

static REGISTRY: Mutex<Vec<Resource>> = Mutex::new(Vec::new());
/// Set by the signal handler before it releases everything; from then on
/// nothing new may be registered.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Set by the main thread once it has stopped working after an interrupt.
static STOPPED: AtomicBool = AtomicBool::new(false);

fn registry() -> std::sync::MutexGuard<'static, Vec<Resource>> {
    // A panic elsewhere must not stop the cleanup.
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records a resource the run now owns. After an interrupt the resource
/// is released at once and an error returned, so that nothing created
/// while the handler cleans up outlives the run.
pub fn register(resource: Resource) -> anyhow::Result<()> {
    let mut list = registry();
    if INTERRUPTED.load(Ordering::SeqCst) {
        drop(list);
        if let Resource::Daemon(pid) = resource {
            // It may be mounting right now: tell it to unmount and exit.
            stop_daemon(pid, Duration::ZERO);
        } else if let Err(e) = release(&resource) {
            eprintln!("betreefs-bench: cleanup of {resource:?}: {e:#}");
        }
        anyhow::bail!("interrupted");
    }
    list.push(resource);
    Ok(())
}

/// Fails once the run has been interrupted; checked between phases.
pub fn check_interrupted() -> anyhow::Result<()> {
    anyhow::ensure!(!INTERRUPTED.load(Ordering::SeqCst), "interrupted");
    Ok(())
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Called by the main thread when it has noticed the interrupt and
/// stopped; the signal handler then ends the process.
pub fn stopped_after_interrupt() -> ! {
    STOPPED.store(true, Ordering::SeqCst);
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Takes a resource back from the registry so that its owner can release
/// it; false if the signal handler has taken (and released) it already.
pub fn take(resource: &Resource) -> bool {
    let mut list = registry();
    match list.iter().rposition(|r| r == resource) {
        Some(i) => {
            list.remove(i);
            true
        }
        None => false,
    }
}

/// Releases every registered resource, newest first. Used after an error
/// and from the signal handler; failures are reported and the rest is
/// still released.
pub fn release_all() {
    let resources: Vec<Resource> = std::mem::take(&mut *registry());
    for resource in resources.into_iter().rev() {
        if let Err(e) = release(&resource) {
            eprintln!("betreefs-bench: cleanup of {resource:?}: {e:#}");
        }
    }
}

/// Releases one resource.
pub fn release(resource: &Resource) -> anyhow::Result<()> {
    match resource {
        Resource::Mount(dir) => unmount(dir, true),
        Resource::Loop(dev) => detach_loop(dev),
        Resource::Daemon(pid) => {
            stop_daemon(*pid, Duration::from_secs(60));
            Ok(())
        }
        Resource::File(path) => match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        },
        Resource::Tree(path) => {
            anyhow::ensure!(
                !has_mount_at_or_below(path),
                "{} still has a mount; left in place",
                path.display()
            );
            match std::fs::remove_dir_all(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
                _ => Ok(()),
            }
        }
    }
}

/// The mount points of this system.
fn mount_points() -> Vec<PathBuf> {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return Vec::new();
    };
    mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .map(|m| PathBuf::from(unescape_mount_field(m)))
        .collect()
}

/// Whether `dir` is a mount point of this system.
pub fn is_mounted(dir: &Path) -> bool {
    mount_points().iter().any(|m| m == dir)
}

fn has_mount_at_or_below(dir: &Path) -> bool {
    mount_points().iter().any(|m| m.starts_with(dir))
}

/// /proc/mounts escapes space, tab, newline and backslash as octal.
fn unescape_mount_field(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let digit = |k: usize| u32::from(bytes[i + k] - b'0');
            out.push((digit(1) * 64 + digit(2) * 8 + digit(3)) as u8);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Unmounts `dir`; with `lazy` a busy mount (a workload still inside it
/// after an interrupt) is detached anyway.
pub fn unmount(dir: &Path, lazy: bool) -> anyhow::Result<()> {
    if !is_mounted(dir) {
        return Ok(());
    }
    let status = Command::new("umount").arg(dir).status()?;
    if status.success() {
        return Ok(());
    }
    if lazy {
        let status = Command::new("umount").arg("-l").arg(dir).status()?;
        if status.success() {
            return Ok(());
        }
    }
    anyhow::bail!("umount {} failed", dir.display())
}

/// Detaches a loop device; if it is still busy (a lazily unmounted file
/// system) the kernel detaches it once the last user is gone.
pub fn detach_loop(dev: &str) -> anyhow::Result<()> {
    let status = Command::new("losetup").arg("-d").arg(dev).status()?;
    anyhow::ensure!(status.success(), "losetup -d {dev} failed");
    Ok(())
}

/// Waits for a daemon we started to exit (it does once its mount is
/// gone, after its final checkpoint); SIGTERM after `patience` (it then
/// unmounts and checkpoints), SIGKILL after 10 s more.
pub fn stop_daemon(pid: u32, patience: Duration) {
    let pid = pid as libc::pid_t;
    // Only a child that waitpid still reports as running is alive; once
    // reaped (here or when its mount failed) its id may belong to another
    // process, which must never be signalled.
    let alive = || {
        // SAFETY: waitpid with WNOHANG on our own child only reads its
        // status.
        unsafe {
            let mut status = 0;
            libc::waitpid(pid, &mut status, libc::WNOHANG) == 0
        }
    };
    let wait = |limit: Duration| {
        let start = Instant::now();
        while alive() {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    };
    if wait(patience) {
        return;
    }
    // SAFETY: signalling a child process we started, by its id.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    if wait(Duration::from_secs(10)) {
        return;
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait(Duration::from_secs(5));
}

/// Installs the SIGINT/SIGTERM/SIGHUP handler: refuse new resources,
/// release everything (busy mounts lazily, so a running workload fails
/// fast), give the main thread up to 15 s to notice and stop, release
/// anything it still held, and exit with 130.
pub fn install_signal_handler() -> anyhow::Result<()> {
    ctrlc::set_handler(|| {
        eprintln!("\nbetreefs-bench: interrupted; unmounting and detaching what this run created");
        INTERRUPTED.store(true, Ordering::SeqCst);
        release_all();
        let start = Instant::now();
        while !STOPPED.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(15) {
            std::thread::sleep(Duration::from_millis(50));
        }
        release_all();
        std::process::exit(130);
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_fields_are_unescaped() {
        assert_eq!(unescape_mount_field(r"/tmp/a\040b"), "/tmp/a b");
        assert_eq!(unescape_mount_field(r"/tmp/x\134y"), r"/tmp/x\y");
        assert_eq!(unescape_mount_field("/plain"), "/plain");
        assert_eq!(unescape_mount_field(r"/end\04"), r"/end\04");
    }

    #[test]
    fn take_removes_only_the_named_resource_once() {
        let a = Resource::File(PathBuf::from("/nonexistent/betreefs-bench-a"));
        let b = Resource::File(PathBuf::from("/nonexistent/betreefs-bench-b"));
        register(a.clone()).unwrap();
        register(b.clone()).unwrap();
        assert!(take(&a));
        assert!(!take(&a));
        assert!(registry().contains(&b));
        assert!(!registry().contains(&a));
        assert!(take(&b));
    }

    #[test]
    fn a_tree_with_a_mount_below_is_never_removed() {
        // /proc is mounted below / on every Linux system.
        assert!(has_mount_at_or_below(Path::new("/")));
        assert!(release(&Resource::Tree(PathBuf::from("/"))).is_err());
        let scratch =
            std::env::temp_dir().join(format!("betreefs-bench-tree-{}", std::process::id()));
        std::fs::create_dir_all(scratch.join("a/b")).unwrap();
        std::fs::write(scratch.join("a/b/f"), b"x").unwrap();
        release(&Resource::Tree(scratch.clone())).unwrap();
        assert!(!scratch.exists());
        release(&Resource::File(scratch.join("missing"))).unwrap();
    }
}
