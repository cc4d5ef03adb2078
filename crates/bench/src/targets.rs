//! The file systems under test, each set up fresh for a run and torn down
//! after it: ext4, XFS and btrfs on a loop device over a sparse image,
//! betreefs on a loop device too (so its device traffic is counted the same
//! way), nullfuse (the no-op FUSE ceiling) and tmpfs (memory).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::cleanup::{self, Resource};
use crate::devstats::{BlockDigest, IoCounters};

/// A file system the harness can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Betreefs,
    Nullfuse,
    Ext4,
    Xfs,
    Btrfs,
    Tmpfs,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Betreefs => "betreefs",
            Kind::Nullfuse => "nullfuse",
            Kind::Ext4 => "ext4",
            Kind::Xfs => "xfs",
            Kind::Btrfs => "btrfs",
            Kind::Tmpfs => "tmpfs",
        }
    }

    /// Whether the file system sits on a loop device whose counters give
    /// its IO amplification.
    pub fn has_device(self) -> bool {
        matches!(self, Kind::Betreefs | Kind::Ext4 | Kind::Xfs | Kind::Btrfs)
    }

    /// Whether it is served by a FUSE daemon (with request counters).
    pub fn is_fuse(self) -> bool {
        matches!(self, Kind::Betreefs | Kind::Nullfuse)
    }

    /// Whether it keeps what is written. nullfuse does not, so it is shown
    /// beside the others but never counted as the best of a row.
    pub fn keeps_data(self) -> bool {
        self != Kind::Nullfuse
    }

    fn mkfs(self) -> Option<(&'static str, &'static [&'static str])> {
        // No discard pass at mkfs: the image is sparse already.
        match self {
            // Inode tables and the journal are initialized now, not by a
            // background thread whose writes would be counted against
            // the workloads.
            Kind::Ext4 => Some((
                "mkfs.ext4",
                &[
                    "-q",
                    "-F",
                    "-E",
                    "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                ],
            )),
            Kind::Xfs => Some(("mkfs.xfs", &["-q", "-f", "-K"])),
            Kind::Btrfs => Some(("mkfs.btrfs", &["-q", "-f", "-K"])),
            _ => None,
        }
    }
}

/// A file system to run and the mount options of a FUSE one:
/// `kind[@option+option...]`, e.g. `nullfuse@transport=devfuse` or
/// `betreefs@writeback`. Its label (the whole spec) names its column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsSpec {
    pub kind: Kind,
    pub options: Vec<String>,
    pub label: String,
}

impl std::str::FromStr for FsSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        use clap::ValueEnum;
        let (name, options) = match s.split_once('@') {
            Some((name, opts)) => (name, opts.split('+').map(str::to_string).collect()),
            None => (s, Vec::new()),
        };
        let kind = Kind::from_str(name, true)?;
        if !options.is_empty() && !kind.is_fuse() {
            return Err(format!("{s}: mount options only for betreefs and nullfuse"));
        }
        if options
            .iter()
            .any(|o| o.is_empty() || o.contains(['/', ' ']))
        {
            return Err(format!("{s}: malformed option"));
        }
        Ok(FsSpec {
            kind,
            options,
            label: s.to_string(),
        })
    }
}

/// Where the targets live and what they need.
#[derive(Debug, Clone)]
pub struct Env {
    /// Images and mount points go here (a disk-backed directory).
    pub work: PathBuf,
    /// The `betreefs` binary.
    pub betreefs: PathBuf,
    /// Size of every image (sparse) and of tmpfs.
    pub image_size: u64,
    /// Daemon logs go here.
    pub logs: PathBuf,
}

impl Env {
    /// Checks up front that every tool the chosen file systems need is
    /// here, so a run does not fail half-way.
    pub fn check_tools(&self, specs: &[FsSpec]) -> Result<()> {
        for kind in specs.iter().map(|s| &s.kind) {
            if let Some((mkfs, _)) = kind.mkfs() {
                if !on_path(mkfs) {
                    bail!("{mkfs} is missing (apt-get install -y e2fsprogs xfsprogs btrfs-progs)");
                }
            }
            if matches!(kind, Kind::Betreefs | Kind::Nullfuse) && !self.betreefs.is_file() {
                bail!(
                    "{} not found; build it first (cargo build --release) or pass --betreefs",
                    self.betreefs.display()
                );
            }
            if matches!(kind, Kind::Betreefs | Kind::Nullfuse) && !Path::new("/dev/fuse").exists() {
                bail!("/dev/fuse is missing; FUSE file systems cannot be mounted here");
            }
        }
        if specs.iter().any(|s| s.kind.has_device()) && !on_path("losetup") {
            bail!("losetup is missing (apt-get install -y mount)");
        }
        Ok(())
    }
}

pub fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file()))
}

/// A mounted file system under test.
pub struct Target {
    pub kind: Kind,
    /// Its column in the tables (the spec it was made from).
    pub label: String,
    options: Vec<String>,
    pub dir: PathBuf,
    env: Env,
    loop_dev: Option<String>,
    image: Option<PathBuf>,
    /// What this target registered, oldest first.
    owned: Vec<Resource>,
    /// The largest resident size (KiB) any of its mount daemons reached
    /// since the current phase began, sampled before each unmount too (a
    /// cold remount starts a new daemon).
    phase_peak_kib: u64,
}

impl Target {
    /// Creates and mounts a fresh instance of `spec`.
    pub fn setup(spec: &FsSpec, env: &Env) -> Result<Target> {
        let slug: String = spec
            .label
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let dir = env.work.join(format!("mnt-{slug}"));
        if cleanup::is_mounted(&dir) {
            bail!("{} is already a mount point (another run?)", dir.display());
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut target = Target {
            kind: spec.kind,
            label: spec.label.clone(),
            options: spec.options.clone(),
            dir,
            env: env.clone(),
            loop_dev: None,
            image: None,
            owned: Vec::new(),
            phase_peak_kib: 0,
        };
        if let Err(e) = target.create() {
            target.teardown_quietly();
            return Err(e);
        }
        Ok(target)
    }

    fn own(&mut self, resource: Resource) -> Result<()> {
        cleanup::register(resource.clone())?;
        self.owned.push(resource);
        Ok(())
    }

    /// Releases one of this target's resources, unless the signal
    /// handler already has.
    fn release_owned(&mut self, resource: &Resource) -> Result<()> {
        if let Some(i) = self.owned.iter().rposition(|r| r == resource) {
            self.owned.remove(i);
        }
        if cleanup::take(resource) {
            cleanup::release(resource)?;
        }
        Ok(())
    }

    fn create(&mut self) -> Result<()> {
        match self.kind {
            Kind::Tmpfs => {
                let size = format!("size={}", self.env.image_size);
                run_quiet(
                    Command::new("mount")
                        .args(["-t", "tmpfs", "-o", &size, "tmpfs"])
                        .arg(&self.dir),
                )?;
                self.own(Resource::Mount(self.dir.clone()))?;
            }
            Kind::Nullfuse => self.mount()?,
            Kind::Ext4 | Kind::Xfs | Kind::Btrfs | Kind::Betreefs => {
                let image = self.env.work.join(format!("{}.img", self.kind.name()));
                // One image per kind at a time: runs are sequential.
                self.own(Resource::File(image.clone()))?;
                if self.kind == Kind::Betreefs {
                    run_quiet(
                        Command::new(&self.env.betreefs)
                            .args(["mkfs", "--force", "--size"])
                            .arg(self.env.image_size.to_string())
                            .arg(&image),
                    )?;
                } else {
                    let f = File::create(&image)
                        .with_context(|| format!("creating {}", image.display()))?;
                    f.set_len(self.env.image_size)?;
                }
                // Direct IO on the backing file: no second page cache
                // under the file system (the loop device behaves like a
                // disk), and it was the faster setting here for every file
                // system (2 GiB sequential write + fsync, two runs minutes
                // apart: ext4 283 vs 213 MB/s buffered, XFS 321 vs 295,
                // betreefs 117 vs 83). fsync reaches the disk either way.
                let out = Command::new("losetup")
                    .args(["-f", "--show", "--direct-io=on"])
                    .arg(&image)
                    .output()
                    .context("running losetup")?;
                if !out.status.success() {
                    bail!(
                        "losetup {}: {}",
                        image.display(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                }
                let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
                self.own(Resource::Loop(dev.clone()))?;
                self.loop_dev = Some(dev.clone());
                self.image = Some(image);
                if let Some((mkfs, args)) = self.kind.mkfs() {
                    run_quiet(Command::new(mkfs).args(args).arg(&dev))?;
                }
                self.mount()?;
            }
        }
        Ok(())
    }

    /// Mounts the (already created) file system.
    fn mount(&mut self) -> Result<()> {
        match self.kind {
            Kind::Ext4 | Kind::Xfs | Kind::Btrfs => {
                let dev = self.loop_dev.clone().context("no loop device")?;
                run_quiet(Command::new("mount").arg(&dev).arg(&self.dir))?;
                self.own(Resource::Mount(self.dir.clone()))?;
            }
            Kind::Betreefs | Kind::Nullfuse => {
                let log_path = self
                    .env
                    .logs
                    .join(format!("{}-daemon.log", self.label.replace('/', "-")));
                let log = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log_path)
                    .with_context(|| format!("opening {}", log_path.display()))?;
                let mut cmd = Command::new(&self.env.betreefs);
                if self.kind == Kind::Betreefs {
                    let dev = self.loop_dev.clone().context("no loop device")?;
                    cmd.arg("mount").arg(dev).arg(&self.dir).arg("--foreground");
                } else {
                    cmd.arg("nullfuse").arg(&self.dir).arg("--foreground");
                }
                for option in &self.options {
                    cmd.arg("-o").arg(option);
                }
                // Its own process group: an interrupt of the harness must
                // not reach the daemon before the harness unmounts.
                let child = cmd
                    .stdin(Stdio::null())
                    .stdout(log.try_clone()?)
                    .stderr(log)
                    .process_group(0)
                    .spawn()
                    .with_context(|| format!("starting {}", self.env.betreefs.display()))?;
                let pid = child.id();
                self.own(Resource::Daemon(pid))?;
                self.own(Resource::Mount(self.dir.clone()))?;
                wait_for_fuse_mount(&self.dir, pid, &log_path)?;
            }
            Kind::Tmpfs => bail!("tmpfs cannot be mounted again without losing its contents"),
        }
        Ok(())
    }

    /// Unmounts and, for a FUSE file system, waits until its daemon has
    /// exited (betreefs writes its final checkpoint first).
    fn unmount(&mut self) -> Result<()> {
        self.note_daemon_peak();
        // A plain unmount: failing on a busy mount is a bug to report.
        cleanup::unmount(&self.dir, false)?;
        self.release_owned(&Resource::Mount(self.dir.clone()))?;
        if let Some(daemon) = self
            .owned
            .iter()
            .rev()
            .find(|r| matches!(r, Resource::Daemon(_)))
            .cloned()
        {
            self.release_owned(&daemon)?;
        }
        Ok(())
    }

    /// Adds the running daemon's peak resident size (the kernel's
    /// high-water mark, VmHWM) to what earlier daemons of the phase reached.
    fn note_daemon_peak(&mut self) {
        let Some(pid) = self.daemon_pid() else {
            return;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return;
        };
        let peak = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
        if let Some(kib) = peak {
            self.phase_peak_kib = self.phase_peak_kib.max(kib);
        }
    }

    fn daemon_pid(&self) -> Option<u32> {
        self.owned.iter().rev().find_map(|r| match r {
            Resource::Daemon(pid) => Some(*pid),
            _ => None,
        })
    }

    /// The largest resident size of this target's mount daemons since the
    /// last call, in MiB (None for a kernel file system), and the running
    /// daemon's high-water mark reset for the next phase.
    pub fn take_phase_peak_mib(&mut self) -> Option<f64> {
        if !self.kind.is_fuse() {
            return None;
        }
        self.note_daemon_peak();
        let peak = std::mem::take(&mut self.phase_peak_kib);
        if let Some(pid) = self.daemon_pid() {
            // "5" resets the process's peak resident size (proc(5)).
            let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
        }
        (peak > 0).then(|| peak as f64 / 1024.0)
    }

    /// The loop device the file system sits on.
    pub fn device(&self) -> Option<&str> {
        self.loop_dev.as_deref()
    }

    /// Makes everything written so far durable: syncfs and fsync of the
    /// root (FUSE does not forward syncfs; an fsync on betreefs makes every
    /// earlier operation durable).
    pub fn sync(&self) -> Result<()> {
        let root =
            File::open(&self.dir).with_context(|| format!("opening {}", self.dir.display()))?;
        // SAFETY: syncfs on a descriptor we own.
        if unsafe { libc::syncfs(root.as_raw_fd()) } != 0 {
            return Err(std::io::Error::last_os_error()).context("syncfs");
        }
        root.sync_all().context("fsync of the root")?;
        Ok(())
    }

    /// The FUSE request counters of the daemon (count per opcode name),
    /// from `betreefs stats`; None for a kernel file system.
    pub fn request_counts(&self) -> Result<Option<RequestCounts>> {
        if !self.kind.is_fuse() {
            return Ok(None);
        }
        let out = Command::new(&self.env.betreefs)
            .arg("stats")
            .arg(&self.dir)
            .output()
            .context("running betreefs stats")?;
        if !out.status.success() {
            bail!(
                "betreefs stats {}: {}",
                self.dir.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let json: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("parsing betreefs stats")?;
        let fuse = json
            .get("fuse")
            .and_then(|f| f.as_object())
            .context("betreefs stats has no request counters")?;
        Ok(Some(
            fuse.iter()
                .filter(|(op, _)| op.as_str() != "total")
                .filter_map(|(op, f)| Some((op.clone(), f.get("count")?.as_u64()?)))
                .collect(),
        ))
    }

    /// The command that copies directory `from` to `to` sharing data
    /// where the file system can: `betreefs clone` on betreefs, `cp -a
    /// --reflink=auto` (a reflink per file on XFS and btrfs) elsewhere.
    pub fn tree_clone_command(&self, from: &Path, to: &Path) -> Command {
        let mut cmd = if self.kind == Kind::Betreefs {
            let mut c = Command::new(&self.env.betreefs);
            c.arg("clone");
            c
        } else {
            let mut c = Command::new("cp");
            c.args(["-a", "--reflink=auto"]);
            c
        };
        cmd.arg(from).arg(to);
        cmd
    }

    /// Empties every cache the next phase could read from: the page cache
    /// for all, and for betreefs its own node cache (unmount and mount).
    pub fn cold(&mut self) -> Result<()> {
        if self.kind == Kind::Betreefs {
            self.remount_with(|_| drop_caches()).map(drop)
        } else {
            drop_caches()
        }
    }

    /// Forces out everything the file system would write later
    /// (background writeback, journal checkpoints, betreefs's checkpoint)
    /// by unmounting and mounting again; file systems without a device
    /// only sync.
    pub fn flush_everything(&mut self) -> Result<()> {
        self.remount_with(|_| Ok(())).map(drop)
    }

    /// [`Target::flush_everything`], returning the device's state taken
    /// while it was unmounted (None without a device).
    pub fn flush_and_capture(&mut self) -> Result<Option<DeviceState>> {
        self.remount_with(Self::device_state)
    }

    /// Unmounts, runs `between`, and mounts again; a file system without a
    /// device (which cannot be mounted again with its contents) only
    /// syncs.
    fn remount_with<T>(&mut self, between: impl FnOnce(&Self) -> Result<T>) -> Result<Option<T>> {
        if !self.kind.has_device() {
            return self.sync().map(|()| None);
        }
        self.unmount()?;
        let value = between(self)?;
        self.mount()?;
        Ok(Some(value))
    }

    /// The device's counters and a digest of its image now (mounted or
    /// not; the loop device writes around the page cache and the digest
    /// drops the image's cached pages first).
    pub fn device_state(&self) -> Result<DeviceState> {
        let dev = self.loop_dev.as_deref().context("no loop device")?;
        let image = self.image.as_deref().context("no image")?;
        Ok(DeviceState {
            counters: IoCounters::of_device(dev)?,
            digest: BlockDigest::of_image(image)?,
        })
    }

    /// Unmounts and removes everything this target created.
    pub fn teardown(mut self) -> Result<()> {
        let mut first_error = None;
        while let Some(resource) = self.owned.last().cloned() {
            if let Err(e) = self.release_owned(&resource) {
                first_error.get_or_insert(e);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
        first_error.map_or(Ok(()), Err)
    }

    fn teardown_quietly(&mut self) {
        while let Some(resource) = self.owned.last().cloned() {
            if let Err(e) = self.release_owned(&resource) {
                eprintln!("betreefs-bench: cleanup of {resource:?}: {e:#}");
            }
        }
    }
}

/// Requests a FUSE daemon has answered, by opcode name.
pub type RequestCounts = std::collections::BTreeMap<String, u64>;

/// A device's counters and a digest of its image.
pub struct DeviceState {
    pub counters: IoCounters,
    pub digest: BlockDigest,
}

/// The f_type statfs reports for FUSE mounts.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

fn wait_for_fuse_mount(dir: &Path, pid: u32, log: &Path) -> Result<()> {
    let start = Instant::now();
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
    loop {
        // SAFETY: statfs into a zeroed struct we own.
        let mounted = unsafe {
            let mut st: libc::statfs = std::mem::zeroed();
            libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == FUSE_SUPER_MAGIC
        };
        if mounted {
            return Ok(());
        }
        // SAFETY: non-blocking status check of our own child.
        let exited = unsafe {
            let mut status = 0;
            libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) == pid as libc::pid_t
        };
        if exited {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            bail!(
                "the mount daemon exited before mounting {}: {}",
                dir.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            );
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!(
                "{} did not mount within 120 s (log: {})",
                dir.display(),
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes back dirty pages and drops the page, dentry and inode caches.
pub fn drop_caches() -> Result<()> {
    // SAFETY: sync(2) has no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3\n")
        .context("writing /proc/sys/vm/drop_caches (run as root)")
}

/// Runs a setup command; its output is shown only when it fails.
pub fn run_quiet(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_a_kind_and_its_mount_options() {
        let s: FsSpec = "nullfuse@transport=devfuse+writeback".parse().unwrap();
        assert_eq!(s.kind, Kind::Nullfuse);
        assert_eq!(s.options, ["transport=devfuse", "writeback"]);
        assert_eq!(s.label, "nullfuse@transport=devfuse+writeback");
        let s: FsSpec = "ext4".parse().unwrap();
        assert_eq!((s.kind, s.options.len()), (Kind::Ext4, 0));
        assert!(
            "ext4@noatime".parse::<FsSpec>().is_err(),
            "kernel file systems take none"
        );
        assert!("zfs".parse::<FsSpec>().is_err());
        assert!("betreefs@".parse::<FsSpec>().is_err());
    }
}
