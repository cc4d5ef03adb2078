//! `betreefs mount` and the `mount.fuse.betreefs` helper: opens the image,
//! mounts it, and serves it until it is unmounted or the daemon gets
//! SIGTERM/SIGINT/SIGHUP; both end in a final checkpoint.
//!
//! By default the command forks a daemon and returns only once the mount
//! answers (or with the daemon's one-line error): the child reports over a
//! pipe whose descriptor it is given with `--notify-fd`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use betreefs_fs::{AtimePolicy, FileSystem, Operations};
use betreefs_fuse::{MountConfig, MountFlags};

use crate::fs_cmds::{self, control_socket, parse_size, DEFAULT_IMAGE_SIZE};

#[derive(clap::Args, Clone)]
pub struct MountArgs {
    /// Image file or block device; a default-sized image is created when
    /// the path does not exist.
    pub image: PathBuf,
    /// An existing directory to mount on.
    pub mountpoint: PathBuf,
    /// Comma-separated options: noatime, relatime (default), strictatime,
    /// ro, nosuid, nodev, noexec (and suid, dev, exec), allow_other,
    /// threads=N, cache=SIZE, log=FILE, writeback (kernel writeback cache;
    /// off by default), transport=auto|devfuse|uring (FUSE over io_uring
    /// when the kernel offers it, by default), errors=remount-ro|continue|
    /// panic (what a device fault does; remount-ro by default),
    /// readahead=on|off (leaves read ahead of sequential reads; on),
    /// flush=inline|background (who moves messages down the trees: each
    /// writer, or a thread of the engine; inline);
    /// fstab's defaults, auto, noauto, nofail, _netdev, user(s), rw and
    /// x-* are accepted and ignored.
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// Stay in the foreground (logs to stderr).
    #[arg(short = 'f', long)]
    pub foreground: bool,
    /// Size of the image created when it does not exist.
    #[arg(long, value_parser = parse_size, default_value = "8G")]
    pub size: u64,
    /// (internal) report readiness on this descriptor.
    #[arg(long, hide = true)]
    pub notify_fd: Option<RawFd>,
    /// (internal) serve a no-op file system instead (`betreefs nullfuse`).
    #[arg(long, hide = true)]
    pub nullfuse: bool,
}

/// Parsed `-o` options.
struct Settings {
    atime: AtimePolicy,
    /// `-o ro`: the store is opened read-only too (nothing is written,
    /// not even the log replay).
    read_only: bool,
    config: MountConfig,
    cache_bytes: Option<usize>,
    /// `-o warm=SIZE`: bytes of the trees' upper levels read at mount
    /// (default: a sixteenth of the cache budget; 0: none).
    warm_bytes: Option<usize>,
    log: Option<PathBuf>,
    /// `-o remount`: change a running mount's flags instead of mounting.
    remount: bool,
    /// `-o errors=`: what a device fault does to the mount.
    on_device_error: OnDeviceError,
    /// `-o readahead=off`: no leaves read ahead of sequential reads.
    read_ahead: bool,
    /// `-o flush=background`: a thread of the engine flushes the trees
    /// (its `Options::background_flush`).
    background_flush: bool,
}

/// `-o errors=continue|remount-ro|panic`: what the daemon does when the
/// device fails (an IO error, or a read of something not written). In
/// every case the request that met the fault gets `EIO`, and a fault that
/// leaves the image unable to take writes safely (a failed write to the
/// log or of a checkpoint) makes the store refuse writes; this says what
/// happens to the mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnDeviceError {
    /// Keep serving: later requests that do not need the failing part of
    /// the device go on (writes too, unless the store refuses them).
    Continue,
    /// Refuse writes from then on and remount the kernel's mount
    /// read-only, so that writers get `EROFS`; reads go on.
    RemountReadOnly,
    /// Stop the mount at once, as a crash would: every later request
    /// fails, the daemon unmounts and exits non-zero without a final
    /// checkpoint (the next mount replays the log).
    Stop,
}

impl std::str::FromStr for OnDeviceError {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "continue" => Ok(OnDeviceError::Continue),
            "remount-ro" => Ok(OnDeviceError::RemountReadOnly),
            "panic" => Ok(OnDeviceError::Stop),
            other => Err(format!(
                "errors={other}: use continue, remount-ro (the default) or panic"
            )),
        }
    }
}

fn parse_options(args: &MountArgs) -> Result<Settings> {
    let mut s = Settings {
        atime: AtimePolicy::Relatime,
        read_only: false,
        config: MountConfig {
            fs_name: args.image.display().to_string(),
            ..MountConfig::default()
        },
        cache_bytes: None,
        warm_bytes: None,
        log: None,
        remount: false,
        on_device_error: OnDeviceError::RemountReadOnly,
        read_ahead: true,
        background_flush: false,
    };
    for opt in args.options.iter().flat_map(|o| o.split(',')) {
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        let no_value = || -> Result<bool> {
            if value.is_some() {
                bail!("option {key} takes no value");
            }
            Ok(true)
        };
        let flags = &mut s.config.flags;
        match key {
            "" | "defaults" | "auto" | "noauto" | "nofail" | "_netdev" | "user" | "users"
            | "async" => {}
            k if k.starts_with("x-") => {}
            // What the kernel shows of a FUSE mount in /proc/mounts, which
            // mount(8) hands back on a remount.
            "user_id"
            | "group_id"
            | "default_permissions"
            | "rootmode"
            | "max_read"
            | "blksize"
            | "fd" => {}
            "remount" => s.remount = no_value()?,
            "rw" => {
                s.read_only = false;
                flags.read_only = !no_value()?;
            }
            "sync" => flags.sync = no_value()?,
            "dirsync" => flags.dirsync = no_value()?,
            "nodiratime" => flags.nodiratime = no_value()?,
            "diratime" => flags.nodiratime = !no_value()?,
            "lazytime" => flags.lazytime = no_value()?,
            "nolazytime" => flags.lazytime = !no_value()?,
            "noatime" => {
                s.atime = AtimePolicy::Noatime;
                flags.noatime = no_value()?;
            }
            "relatime" => s.atime = AtimePolicy::Relatime,
            "strictatime" | "atime" => s.atime = AtimePolicy::Strictatime,
            "ro" => {
                s.read_only = true;
                flags.read_only = no_value()?;
            }
            "nosuid" => flags.nosuid = no_value()?,
            "suid" => flags.nosuid = !no_value()?,
            "nodev" => flags.nodev = no_value()?,
            "dev" => flags.nodev = !no_value()?,
            "noexec" => flags.noexec = no_value()?,
            "exec" => flags.noexec = !no_value()?,
            "readahead" => {
                s.read_ahead = match value {
                    Some("on") => true,
                    Some("off") => false,
                    _ => bail!("readahead= needs on or off"),
                }
            }
            "flush" => {
                s.background_flush = match value {
                    Some("background") => true,
                    Some("inline") => false,
                    _ => bail!("flush= needs background or inline"),
                }
            }
            "errors" => {
                s.on_device_error = value
                    .ok_or_else(|| anyhow!("errors= needs continue, remount-ro or panic"))?
                    .parse()
                    .map_err(|e: String| anyhow!(e))?;
            }
            "transport" => {
                s.config.transport = value
                    .ok_or_else(|| anyhow!("transport= needs auto, devfuse or uring"))?
                    .parse()
                    .map_err(|e: String| anyhow!(e))?;
            }
            "allow_other" => s.config.allow_other = true,
            "writeback" => s.config.writeback_cache = true,
            "nowriteback" => s.config.writeback_cache = false,
            "threads" => {
                let n: usize = value
                    .and_then(|v| v.parse().ok())
                    .filter(|n| (1..=64).contains(n))
                    .ok_or_else(|| anyhow!("threads= needs a number from 1 to 64"))?;
                s.config.threads = n;
            }
            "cache" => {
                let v = value.ok_or_else(|| anyhow!("cache= needs a size"))?;
                s.cache_bytes = Some(parse_size(v).map_err(|e| anyhow!(e))? as usize);
            }
            "warm" => {
                let v = value.ok_or_else(|| anyhow!("warm= needs a size"))?;
                s.warm_bytes = Some(parse_size(v).map_err(|e| anyhow!(e))? as usize);
            }
            "log" => {
                s.log = Some(PathBuf::from(
                    value.ok_or_else(|| anyhow!("log= needs a file"))?,
                ))
            }
            other => bail!("unknown mount option {other:?}"),
        }
    }
    Ok(s)
}

/// Whether `path` is a FUSE mount whose daemon is gone: statfs always
/// reaches the daemon (stat may be answered from the kernel's cache). A
/// request that was queued when the connection was aborted ends with
/// ECONNABORTED rather than ENOTCONN: with FUSE over io_uring the
/// connection of a killed daemon is aborted only when its rings are torn
/// down, a moment after the process is gone, so the first statfs can meet
/// either.
fn is_dead_mount(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: c is a valid NUL-terminated path; st is written by statvfs.
    let r = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        libc::statvfs(c.as_ptr(), &mut st)
    };
    r != 0
        && matches!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENOTCONN | libc::ECONNABORTED)
        )
}

fn check_mountpoint(mountpoint: &Path) -> Result<()> {
    if is_dead_mount(mountpoint) {
        eprintln!(
            "betreefs: {} was a dead mount; detaching it",
            mountpoint.display()
        );
        unmount(mountpoint);
    }
    match std::fs::metadata(mountpoint) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => bail!("mountpoint {} is not a directory", mountpoint.display()),
        Err(e) => bail!("mountpoint {}: {e}", mountpoint.display()),
    }
}

pub fn run_mount(args: MountArgs) -> Result<()> {
    let mut settings = parse_options(&args)?;
    if settings.remount {
        return remount(&args, &settings);
    }
    check_mountpoint(&args.mountpoint)?;
    if !args.nullfuse && !args.image.exists() {
        fs_cmds::mkfs(&args.image, Some(args.size.max(64 << 20)), false)?;
        eprintln!(
            "betreefs: created {} ({} MiB)",
            args.image.display(),
            args.size >> 20
        );
    }
    if !args.nullfuse {
        // The mount's source is the image's canonical path: `fsck` and
        // `umount` find the mount of an image by it.
        let canonical = args
            .image
            .canonicalize()
            .with_context(|| format!("{}", args.image.display()))?;
        settings.config.fs_name = canonical.display().to_string();
    }
    if args.foreground || args.notify_fd.is_some() {
        return serve(&args, settings);
    }
    spawn_daemon(&args, settings.log.as_deref())
}

/// `-o remount[,ro|rw,...]`: new kernel flags for the mount, and the
/// daemon told to refuse writes (after a checkpoint, so the image is
/// whole without its log) or to take them again. The kernel refuses
/// writes first on the way to read-only, the daemon takes them first on
/// the way back. A mount made read-only from the start has its image
/// open read-only and stays so.
fn remount(args: &MountArgs, settings: &Settings) -> Result<()> {
    let dir = &args.mountpoint;
    let tell = |request: &str| -> Result<()> {
        let reply = fs_cmds::control_request(dir, request)?;
        if reply.contains("\"error\"") {
            bail!("{}: {}", dir.display(), reply.trim());
        }
        Ok(())
    };
    if !settings.read_only {
        tell("read-write")?;
    }
    settings
        .config
        .flags
        .remount(dir)
        .with_context(|| format!("remounting {}", dir.display()))?;
    if settings.read_only {
        tell("read-only")?;
    }
    Ok(())
}

/// Starts `betreefs mount ... --notify-fd N` detached, and waits for it to
/// say the mount answers.
fn spawn_daemon(args: &MountArgs, log: Option<&Path>) -> Result<()> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds is a valid array of two descriptors for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("creating a pipe");
    }
    let (read_fd, write_fd) = (fds[0], fds[1]);
    // SAFETY: read_fd was just created by pipe2 and is owned only here.
    let mut reader = unsafe { std::fs::File::from_raw_fd(read_fd) };
    let exe = std::env::current_exe().context("finding the betreefs executable")?;
    let stderr = match log {
        Some(path) => std::process::Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening log {}", path.display()))?,
        ),
        None => std::process::Stdio::null(),
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("mount")
        .arg(&args.image)
        .arg(&args.mountpoint)
        .arg("--notify-fd")
        .arg(write_fd.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(stderr);
    for o in &args.options {
        cmd.arg("-o").arg(o);
    }
    if args.nullfuse {
        cmd.arg("--nullfuse");
    }
    // The daemon leaves the caller's process group (so a Ctrl-C or a
    // shell's SIGHUP to its jobs does not unmount it) but stays in its
    // session: with autogroup scheduling (`kernel.sched_autogroup_enabled`,
    // on in most distributions) a session is a scheduling group, and a
    // client in another group than the daemon is woken on the other CPU
    // at every reply. On this machine rm -rf of the kernel tree took 6-7 s
    // through nullfuse from another session, 2.7 s from the same one
    // (docs/design.md, "The daemon's session").
    // SAFETY: only async-signal-safe calls (setpgid, fcntl) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setpgid(0, 0);
            let flags = libc::fcntl(write_fd, libc::F_GETFD);
            libc::fcntl(write_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            Ok(())
        });
    }
    let child = cmd.spawn().context("starting the daemon");
    // SAFETY: write_fd is ours; the child has its own copy now.
    unsafe { libc::close(write_fd) };
    let mut child = child?;
    let mut answer = String::new();
    reader.read_to_string(&mut answer).ok();
    match answer.lines().next() {
        Some("ok") => Ok(()),
        Some(line) => {
            let _ = child.wait();
            bail!("{}", line.trim_start_matches("error: "))
        }
        None => {
            let status = child.wait().context("waiting for the daemon")?;
            bail!("the daemon exited ({status}) before the mount was ready")
        }
    }
}

fn notify(fd: Option<RawFd>, message: &str) {
    if let Some(fd) = fd {
        // SAFETY: the parent passed this descriptor for us to own and close.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        let _ = f.write_all(message.as_bytes());
    }
}

/// Blocks the termination signals in this thread and every thread it
/// starts later, so that one thread can wait for them with sigwait.
fn block_signals() -> libc::sigset_t {
    // SAFETY: the set is initialised by sigemptyset before use; the calls
    // only manipulate this thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn unmount(mountpoint: &Path) {
    if let Err(e) = betreefs_fuse::mount::unmount(mountpoint) {
        tracing::warn!("unmounting {}: {e}", mountpoint.display());
    }
}

/// The kernel caps a FUSE mount's read-ahead at 128 KiB whatever the
/// daemon offers; as root, raise it to the request size (1 MiB) through
/// the mount's backing device info. Best effort: a failure only costs
/// sequential read speed.
fn raise_read_ahead(mountpoint: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(mountpoint) else {
        return;
    };
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let knob = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    let kib = betreefs_fuse::MAX_REQUEST / 1024;
    if let Err(e) = std::fs::write(&knob, kib.to_string()) {
        tracing::debug!("read-ahead stays at the kernel's default: {knob}: {e}");
    }
}

/// Unmounts on SIGTERM, SIGINT or SIGHUP (blocked in every thread, so this
/// one receives them); the session then ends as on any unmount.
fn spawn_signal_thread(signals: libc::sigset_t, mountpoint: PathBuf) -> Result<()> {
    std::thread::Builder::new()
        .name("betreefs-signals".into())
        .spawn(move || loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: signals is a valid, initialised set; sig is writable.
            if unsafe { libc::sigwait(&signals, &mut sig) } == 0 {
                tracing::info!("signal {sig}: unmounting");
                unmount(&mountpoint);
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

/// The daemon proper (betreefs, or the no-op file system for `nullfuse`).
fn serve(args: &MountArgs, settings: Settings) -> Result<()> {
    let signals = block_signals();
    // A request that panics stops the mount (see betreefs_fuse::guard):
    // unmount from a thread of our own, never from the request's thread.
    let guard = {
        let mountpoint = args.mountpoint.clone();
        Arc::new(betreefs_fuse::RequestGuard::new(move |_| {
            let mountpoint = mountpoint.clone();
            let _ = std::thread::Builder::new()
                .name("betreefs-fatal".into())
                .spawn(move || unmount(&mountpoint));
        }))
    };
    let stats = Arc::new(betreefs_fuse::RequestStats::default());
    let started = if args.nullfuse {
        start_nullfuse(args, &settings, guard.clone(), stats.clone())
            .map(|(session, socket)| (session, socket, None))
    } else {
        start(args, &settings, guard.clone(), stats.clone())
            .map(|(fs, session, socket)| (session, socket, Some(fs)))
    };
    let (session, socket, betreefs) = match started {
        Ok(v) => v,
        Err(e) => {
            notify(args.notify_fd, &format!("error: {e:#}\n"));
            return Err(e);
        }
    };
    raise_read_ahead(&args.mountpoint);
    notify(args.notify_fd, "ok\n");
    tracing::info!(
        "mounted {} on {}",
        args.image.display(),
        args.mountpoint.display()
    );
    spawn_signal_thread(signals, args.mountpoint.clone())?;
    if let Err(e) = session.join() {
        tracing::warn!("session ended with {e}");
    }
    let fatal = guard.failure();
    let _ = std::fs::remove_file(&socket);
    let Some(fs) = betreefs else {
        return match fatal {
            Some(what) => bail!("stopped serving: {what}"),
            None => Ok(()),
        };
    };
    if let Some(what) = fatal {
        // The in-memory state may be inconsistent: keep only the log (it
        // holds every acknowledged write, and the next mount replays it).
        let flushed = match fs.store().sync() {
            Ok(()) => "the log was flushed".to_string(),
            Err(e) => format!("flushing the log failed too: {e}"),
        };
        bail!(
            "stopped serving: {what}; {flushed}, no final checkpoint was written (the next \
             mount replays the log)"
        );
    }
    match Arc::try_unwrap(fs) {
        Ok(fs) => fs.close().context("final checkpoint")?,
        Err(fs) => {
            // Someone still holds the file system: make the log durable
            // first, so that a failing checkpoint loses nothing.
            fs.store().sync().context("final log flush")?;
            fs.store().checkpoint().context("final checkpoint")?
        }
    }
    tracing::info!("unmounted; final checkpoint written");
    Ok(())
}

type Started = (Arc<FileSystem>, betreefs_fuse::Session, PathBuf);

/// With `allow_other`, other users reach the files through their
/// permissions; an image they can read would hand them every byte without
/// any. Block devices follow the system's disk-group rules instead.
fn check_image_private(image: &Path, allow_other: bool) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(image).with_context(|| format!("{}", image.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if allow_other && meta.is_file() && mode & 0o077 != 0 {
        bail!(
            "{} is open to other users (mode {mode:o}): with allow_other they would reach \
             every file through the image, bypassing its permissions; `chmod 600 {}` first",
            image.display(),
            image.display()
        );
    }
    Ok(())
}

/// Mounts the no-op file system and its control socket (request counters).
fn start_nullfuse(
    args: &MountArgs,
    settings: &Settings,
    guard: Arc<betreefs_fuse::RequestGuard>,
    stats: Arc<betreefs_fuse::RequestStats>,
) -> Result<(betreefs_fuse::Session, PathBuf)> {
    let socket = control_socket(&args.mountpoint)?;
    let answering = stats.clone();
    serve_control(&socket, move |request| match request {
        "stats" => Some(format!("{{\"fuse\":{}}}", answering.to_json())),
        _ => None,
    })?;
    let session = betreefs_fuse::nullfuse::mount(&args.mountpoint, &settings.config, guard, stats)
        .map_err(|e| {
            let _ = std::fs::remove_file(&socket);
            anyhow!("mounting on {}: {e}", args.mountpoint.display())
        })?;
    Ok((session, socket))
}

/// What the mount daemon's memory budget keeps free of the node cache for
/// the buffers that come and go beside it: the log's records on their way
/// to the device (a 1 MiB piece; the unflushed records themselves, up to
/// 32 MiB, the node cache makes room for among its clean nodes), a checkpoint turn's
/// images (2 MiB and a node), requests in flight (a 1 MiB write is in its
/// request buffer, its batch and its log record at once), a write's flush
/// cascade before eviction (a leaf's old and new basements), and the
/// allocator's pages on their way back to the kernel. Sampled at the micro
/// suite's peaks, what was allocated beyond the cache, the inode table,
/// the idle buffers, the log and a checkpoint's held images came to 37-69
/// MiB (docs/benchmarks/allocator-purge.md); with 48 MiB kept for it the
/// micro suite peaked at 322-342 MiB against the 320 MiB target, with 64
/// MiB at 307-316 (docs/benchmarks/working-memory.md).
const WORKING_MEMORY: usize = 64 << 20;

/// The most the mount daemon keeps in idle IO buffers (an eighth of its
/// memory budget when that is less): recycled node-sized buffers spare a
/// page fault per 4 KiB of every cold read.
const IO_BUFFER_POOL_MAX: usize = 16 << 20;

/// The share of the memory budget the mount reads of the trees' upper
/// levels at most: 16 MiB of the default 256 MiB, the roots and the
/// levels below them whole or in part, and the leaves' metas of an image
/// of several GiB.
const WARM_FRACTION: usize = 16;

/// The share of the memory budget the inode table may hold before the
/// kernel is asked to drop entries: a quarter, 64 MiB of the default 256
/// (about 180,000 files), which leaves the node cache at least 112 MiB.
const TABLE_FRACTION: usize = 4;

/// Test hook (debug builds): `BETREEFS_TEST_TABLE_LIMIT=<bytes>` gives
/// the inode table that limit instead of its share, so that the FUSE tests
/// have entries released while they work (1: every unused one, each time
/// the releaser asks).
fn test_table_limit() -> Option<usize> {
    if !cfg!(debug_assertions) {
        return None;
    }
    std::env::var("BETREEFS_TEST_TABLE_LIMIT")
        .ok()?
        .parse()
        .ok()
}

fn start(
    args: &MountArgs,
    settings: &Settings,
    guard: Arc<betreefs_fuse::RequestGuard>,
    stats: Arc<betreefs_fuse::RequestStats>,
) -> Result<Started> {
    check_image_private(&args.image, settings.config.allow_other)?;
    let mut options = fs_cmds::engine_options_for(&args.image);
    // One budget for the node cache, the inode table (which the node
    // cache makes room for as it grows) and idle IO buffers.
    let budget = settings.cache_bytes.unwrap_or(options.cache_bytes);
    let pool = (budget / 8).min(IO_BUFFER_POOL_MAX);
    betreefs_store::set_buffer_pool_limit(pool);
    let working = (budget / 4).min(WORKING_MEMORY);
    options.cache_bytes = budget
        .saturating_sub(pool + working)
        .max(4 * options.node_size);
    // The upper levels every cold lookup and read passes through, read
    // at mount (docs/design.md, "Warm upper levels").
    options.warm_bytes = settings
        .warm_bytes
        .unwrap_or(budget / WARM_FRACTION)
        .min(options.cache_bytes / 2);
    options.read_ahead = settings.read_ahead;
    options.background_flush = settings.background_flush;
    // Dirty nodes are written back on a thread of their own, not in the
    // request of the writer that filled the cache.
    options.background_write_back = true;
    options.read_only = settings.read_only;
    let store = crate::image::open_store(&args.image, options, crate::image::UNMOUNT_WAIT)
        .map_err(|e| anyhow!("{}: {e:#}", args.image.display()))?;
    let fs = FileSystem::mount(store, settings.atime)
        .map_err(|e| anyhow!("{}: {e}", args.image.display()))?;
    // Past its share the inode table asks the kernel to drop entries
    // (docs/design.md, "One memory budget for the mount daemon").
    fs.set_table_limit(test_table_limit().unwrap_or(budget / TABLE_FRACTION));
    let fs = Arc::new(fs);
    let watched = Arc::downgrade(&fs);
    watch_allocator(
        fs.store().allocator_overhead(),
        budget / 4,
        PurgePolicy {
            free_above: budget / 8,
            resident_above: budget,
        },
        move |near_limit| {
            // Weak: the watch outlives the mount, which must drop the
            // store (its last checkpoint) when it ends.
            if let Some(fs) = watched.upgrade() {
                fs.store().set_memory_short(near_limit);
            }
        },
    )?;
    watch_device_faults(&fs, settings, &args.mountpoint, guard.clone());
    let socket = control_socket(&args.mountpoint)?;
    // The control socket is up before the mount answers: whoever waits
    // for the mount (`betreefs mount`, the benchmark's --foreground
    // daemons) may ask for stats at once.
    let weak = Arc::downgrade(&fs);
    let answering = stats.clone();
    serve_control(&socket, move |request| {
        let fs = weak.upgrade()?;
        Some(match request {
            "stats" => stats_json(&fs, &answering),
            "checkpoint" => match fs.store().checkpoint() {
                Ok(()) => "{\"checkpoint\":\"ok\"}".to_string(),
                Err(e) => serde_json::json!({ "error": e.to_string() }).to_string(),
            },
            "read-only" | "read-write" => {
                let refuse = request == "read-only";
                match fs.store().set_writes_refused(refuse) {
                    Ok(()) => serde_json::json!({ "mode": request }).to_string(),
                    Err(e) if !refuse && fs.store().is_read_only() => serde_json::json!({
                        "error": format!("{e} (mounted with -o ro: unmount and mount again to write)")
                    })
                    .to_string(),
                    Err(e) => serde_json::json!({ "error": e.to_string() }).to_string(),
                }
            }
            other => {
                serde_json::json!({ "error": format!("unknown request {other:?}") }).to_string()
            }
        })
    })?;
    let session = betreefs_fuse::mount(
        fs.clone(),
        &args.mountpoint,
        &settings.config,
        "betreefs",
        guard,
        stats,
    )
    .map_err(|e| {
        let _ = std::fs::remove_file(&socket);
        anyhow!("mounting on {}: {e}", args.mountpoint.display())
    })?;
    Ok((fs, session, socket))
}

/// How often the daemon measures what its allocator holds beyond the
/// bytes allocated: often enough that a burst of frees (a sequential
/// write drops node images of megabytes many times a second) is caught
/// within tens of megabytes.
const ALLOCATOR_MEASURE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// Times the allocator's watch had jemalloc give its free pages back
/// (reported by `betreefs stats`, "memory").
static ALLOCATOR_PURGES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Reports to the engine, every [`ALLOCATOR_MEASURE_INTERVAL`], what
/// jemalloc keeps resident beyond the bytes allocated (at most `cap`):
/// clean nodes of the cache make room for it, so that the daemon's
/// resident size, not only what it allocates, stays within its budget.
/// The micro suite's first-link phase showed why: 253 MiB allocated,
/// 325 MiB resident in the allocator — pages of freed node images and
/// basements waiting for their decay (docs/design.md, "One memory budget
/// for the mount daemon").
///
/// Clean nodes cannot make room when the cache is nearly all dirty (a
/// file of tens of megabytes written before its fsync): the micro suite's
/// phases against file size then peaked at 320-350 MiB with 160 of 163
/// MiB cached dirty and 64-85 MiB of free pages held. So past
/// `purge_above` the watch has jemalloc return every free page at once
/// ("arena.<all>.purge"): 317-326 MiB instead of 338-346, at the same
/// speed. Returning every freed page at once, always
/// (`dirty_decay_ms:0`), kept the peak at 300 MiB but cost 12-15% of the
/// sequential write; a lower threshold (a sixteenth of the budget) did
/// no better than an eighth, and purging only once the daemon's resident
/// size was within 48 or 32 MiB of the limit let it peak 7-14 MiB higher
/// (docs/benchmarks/allocator-purge.md).
///
/// A purge is not free: the pages given back are faulted in and zeroed
/// again by the next allocations. A sequential write churns through
/// gigabytes of log chunks and basements, and with a purge every 130 ms
/// a quarter of the daemon's CPU went to page faults; so the watch
/// purges only while the resident size is within 64 MiB of the limit
/// ([`PurgePolicy`]), where the phases above live, and leaves the decay
/// to return the rest (docs/benchmarks/purge-near-limit.md).
///
/// `on_near_limit` hears each time the resident size crosses that line
/// (true: past it): the store then keeps no spare log chunks and writes
/// dirty nodes back for the memory beside its cache
/// (`Store::set_memory_short`, docs/benchmarks/memory-short.md).
fn watch_allocator(
    gauge: betreefs_engine::MemoryBesideCache,
    cap: usize,
    policy: PurgePolicy,
    on_near_limit: impl Fn(bool) + Send + 'static,
) -> Result<()> {
    std::thread::Builder::new()
        .name("betreefs-memory".into())
        .spawn(move || {
            let mut near_limit = false;
            loop {
                let resident = resident_bytes();
                let near = policy.near_limit(resident);
                if near != near_limit {
                    near_limit = near;
                    on_near_limit(near);
                }
                watch_allocator_once(&gauge, cap, &policy, resident);
                std::thread::sleep(ALLOCATOR_MEASURE_INTERVAL);
            }
        })
        .context("starting the allocator's watch")?;
    Ok(())
}

/// One measure of the allocator's watch: reports what jemalloc holds
/// beyond the bytes allocated, after a purge if the policy wants one.
fn watch_allocator_once(
    gauge: &betreefs_engine::MemoryBesideCache,
    cap: usize,
    policy: &PurgePolicy,
    resident: Option<usize>,
) {
    if let Some(mut held) = held_beyond_allocated() {
        if policy.wants_purge(held, resident) && purge_allocator() {
            ALLOCATOR_PURGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            held = held_beyond_allocated().unwrap_or(held);
        }
        gauge.set(held.min(cap) as u64);
    }
}

/// When the allocator's watch has jemalloc give its free pages back.
#[derive(Debug, Clone, Copy)]
struct PurgePolicy {
    /// Free pages held beyond this many bytes (an eighth of the budget)...
    free_above: usize,
    /// ...while the daemon's resident size is past this (its budget:
    /// within 64 MiB of the limit of budget + 64 MiB).
    resident_above: usize,
}

impl PurgePolicy {
    /// Whether to purge with `free` bytes held beyond those allocated and
    /// the process `resident` (None when unknown: then as if near the
    /// limit, the safe side).
    fn wants_purge(&self, free: usize, resident: Option<usize>) -> bool {
        free > self.free_above && self.near_limit(resident)
    }

    /// Whether the process is within 64 MiB of its limit (or its size is
    /// unknown).
    fn near_limit(&self, resident: Option<usize>) -> bool {
        resident.is_none_or(|r| r > self.resident_above)
    }
}

/// The daemon's resident size now (None if the kernel's status cannot be
/// read).
fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status_bytes(&status, "VmRSS:").map(|b| b as usize)
}

/// A size field of /proc/self/status (given in kB there), in bytes.
fn status_bytes(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|k| k * 1024)
}

/// What jemalloc keeps resident beyond the bytes allocated, now (None if
/// its statistics cannot be read).
fn held_beyond_allocated() -> Option<usize> {
    use tikv_jemalloc_ctl::{epoch, stats};
    // The statistics are a snapshot taken at an epoch.
    epoch::advance().ok()?;
    Some(
        stats::resident::read()
            .ok()?
            .saturating_sub(stats::allocated::read().ok()?),
    )
}

/// Has jemalloc return the free pages of every arena to the kernel now;
/// false if it refused.
fn purge_allocator() -> bool {
    // "arena.<MALLCTL_ARENAS_ALL>.purge": MALLCTL_ARENAS_ALL is 4096.
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: the name is NUL-terminated; "arena.<i>.purge" reads and
    // writes no value, so every value pointer is null and both lengths 0,
    // as jemalloc requires of it.
    let status = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    status == 0
}

/// Acts on device faults as `errors=` says (see [`OnDeviceError`]). The
/// store calls the observer with its locks held: the work that calls back
/// into it (refusing writes checkpoints) or into the kernel (the remount
/// flushes the kernel's caches through this daemon) runs on a thread of
/// its own, once.
fn watch_device_faults(
    fs: &Arc<FileSystem>,
    settings: &Settings,
    mountpoint: &Path,
    guard: Arc<betreefs_fuse::RequestGuard>,
) {
    let policy = settings.on_device_error;
    let weak = Arc::downgrade(fs);
    let mountpoint = mountpoint.to_path_buf();
    let mut read_only_flags = settings.config.flags;
    read_only_flags.read_only = true;
    let acted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    fs.store()
        .set_fault_observer(Arc::new(move |e, refusing_writes| {
            tracing::error!(
                "device fault: {e}{}",
                if refusing_writes {
                    "; the image takes no more writes until it is mounted again"
                } else {
                    ""
                }
            );
            if policy == OnDeviceError::Continue
                || acted.swap(true, std::sync::atomic::Ordering::SeqCst)
            {
                return;
            }
            if policy == OnDeviceError::Stop {
                guard.fail(&format!("device fault with errors=panic: {e}"));
                return;
            }
            let weak = weak.clone();
            let mountpoint = mountpoint.clone();
            let spawned = std::thread::Builder::new()
                .name("betreefs-errors".into())
                .spawn(move || {
                    if let Some(fs) = weak.upgrade() {
                        if let Err(e) = fs.store().set_writes_refused(true) {
                            tracing::warn!("refusing writes after the fault: {e}");
                        }
                    }
                    remount_read_only(&read_only_flags, &mountpoint, &weak);
                });
            if let Err(e) = spawned {
                tracing::error!("could not start the remount thread: {e}");
            }
        }));
}

/// The kernel's half of `errors=remount-ro`. It refuses to make a mount
/// read-only while files are open for writing (`EBUSY`), which a process
/// whose write just failed usually has: the daemon refuses writes itself
/// (`EROFS`) meanwhile and tries again until they are closed or the file
/// system is gone.
fn remount_read_only(flags: &MountFlags, mountpoint: &Path, fs: &std::sync::Weak<FileSystem>) {
    let mut told = false;
    loop {
        match flags.remount(mountpoint) {
            Ok(()) => {
                tracing::error!(
                    "remounted {} read-only (errors=remount-ro)",
                    mountpoint.display()
                );
                return;
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && fs.strong_count() > 0 => {
                if !told {
                    tracing::error!(
                        "{} stays mounted read-write while files are open for writing; \
                         writes are refused (EROFS) and the remount is retried",
                        mountpoint.display()
                    );
                    told = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(e) => {
                tracing::error!(
                    "remounting {} read-only failed: {e}; the daemon refuses writes itself",
                    mountpoint.display()
                );
                return;
            }
        }
    }
}

/// Serves requests on a Unix socket named after the mountpoint, one line
/// each: `stats` (JSON of the request counters, and for betreefs the
/// engine's counters and statfs figures) and `checkpoint`. `answer`
/// returns None once the file system is gone (or, for nullfuse, for a
/// request it does not know).
fn serve_control(
    socket: &Path,
    answer: impl Fn(&str) -> Option<String> + Send + 'static,
) -> Result<()> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(socket);
    let listener =
        UnixListener::bind(socket).with_context(|| format!("binding {}", socket.display()))?;
    std::thread::Builder::new()
        .name("betreefs-control".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut line = String::new();
                let mut reader = BufReader::new(&stream);
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                let reply = answer(line.trim()).unwrap_or_else(|| {
                    serde_json::json!({ "error": format!("unknown request {:?}", line.trim()) })
                        .to_string()
                });
                let _ = (&stream).write_all(reply.as_bytes());
            }
        })
        .context("starting the control thread")?;
    Ok(())
}

/// The daemon's memory as the kernel and the allocator see it: resident
/// now and at its peak; the bytes the program holds (allocated), the pages
/// they occupy (active: allocated plus size-class slack), and what the
/// allocator keeps resident in all (its free pages not yet returned and
/// its own metadata included); the idle IO buffers; and the inode table
/// and node cache (in "engine").
fn memory_json() -> serde_json::Value {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let bytes = |field: &str| status_bytes(&status, field);
    // The allocator's statistics are a snapshot taken at an epoch.
    let allocator = tikv_jemalloc_ctl::epoch::advance().ok().map(|_| {
        use tikv_jemalloc_ctl::stats;
        serde_json::json!({
            "allocated_bytes": stats::allocated::read().ok(),
            "active_bytes": stats::active::read().ok(),
            "resident_bytes": stats::resident::read().ok(),
        })
    });
    serde_json::json!({
        "resident_bytes": bytes("VmRSS:"),
        "peak_resident_bytes": bytes("VmHWM:"),
        "allocator": allocator,
        "io_buffer_pool_bytes": betreefs_store::buffer_pool_bytes(),
        "allocator_purges": ALLOCATOR_PURGES.load(std::sync::atomic::Ordering::Relaxed),
    })
}

fn stats_json(fs: &FileSystem, requests: &betreefs_fuse::RequestStats) -> String {
    let s = fs.statfs();
    let fuse: serde_json::Value =
        serde_json::from_str(&requests.to_json()).unwrap_or(serde_json::Value::Null);
    serde_json::json!({
        "engine": fs.store().stats(),
        "fuse": fuse,
        "memory": memory_json(),
        "statfs": {
            "block_size": s.block_size,
            "blocks": s.blocks,
            "blocks_free": s.blocks_free,
            "files": s.files,
            "files_free": s.files_free,
            "inodes": s.inodes,
        },
    })
    .to_string()
}

/// `mount.fuse.betreefs SOURCE DIR [-sfnv] [-o OPTIONS]`, as mount(8)
/// calls it for `-t fuse.betreefs` and fstab lines.
pub fn run_helper(argv: &[String]) -> Result<()> {
    let mut positional = Vec::new();
    let mut options = Vec::new();
    let mut i = 0;
    while i < argv.len() {
        match argv[i].as_str() {
            "-o" => {
                i += 1;
                options.push(
                    argv.get(i)
                        .cloned()
                        .ok_or_else(|| anyhow!("-o needs options"))?,
                );
            }
            // -s (sloppy), -f (fake), -n (no mtab), -v (verbose): nothing to do.
            "-s" | "-n" | "-v" => {}
            "-f" => return Ok(()),
            "-t" | "-N" => i += 1,
            s if s.starts_with("-o") => options.push(s[2..].to_string()),
            s => positional.push(s.to_string()),
        }
        i += 1;
    }
    let [image, mountpoint] = positional.as_slice() else {
        bail!("usage: mount.fuse.betreefs IMAGE MOUNTPOINT [-o OPTIONS]");
    };
    let image = image.strip_prefix("betreefs#").unwrap_or(image);
    run_mount(MountArgs {
        image: PathBuf::from(image),
        mountpoint: PathBuf::from(mountpoint),
        options,
        foreground: false,
        size: DEFAULT_IMAGE_SIZE,
        notify_fd: None,
        nullfuse: false,
    })
}

#[derive(clap::Args)]
pub struct NullfuseArgs {
    /// An existing directory to mount on.
    pub mountpoint: PathBuf,
    /// Mount options, as for `mount` (threads=N, writeback, ...).
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// Stay in the foreground.
    #[arg(short = 'f', long)]
    pub foreground: bool,
}

/// Mounts the no-op FUSE file system (names and sizes kept, data dropped),
/// with the settings betreefs uses: the ceiling for any FUSE file system.
pub fn run_nullfuse(args: NullfuseArgs) -> Result<()> {
    run_mount(MountArgs {
        image: PathBuf::from("nullfuse"),
        mountpoint: args.mountpoint,
        options: args.options,
        foreground: args.foreground,
        size: DEFAULT_IMAGE_SIZE,
        notify_fd: None,
        nullfuse: true,
    })
}

#[derive(clap::Args)]
pub struct InstallHelperArgs {
    /// Where mount(8) looks for helpers.
    #[arg(long, default_value = "/sbin")]
    pub dir: PathBuf,
}

/// Links `DIR/{mount,umount,fsck}.fuse.betreefs` to this executable.
pub fn run_install_helper(args: InstallHelperArgs) -> Result<()> {
    let exe = std::env::current_exe().context("finding the betreefs executable")?;
    for name in ["mount", "umount", "fsck"] {
        let link = args.dir.join(format!("{name}.fuse.betreefs"));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&exe, &link)
            .with_context(|| format!("linking {} to {}", link.display(), exe.display()))?;
        println!("{} -> {}", link.display(), exe.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// jemalloc accepts the purge of every arena, and it gives the free
    /// pages back: 64 MiB written and freed stay held (their decay takes
    /// a quarter of a second) until the purge returns them.
    #[test]
    fn the_allocators_purge_returns_free_pages() {
        let held = || super::held_beyond_allocated().unwrap();
        let blocks: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i | 1; 1 << 20]).collect();
        drop(blocks);
        let before = held();
        assert!(super::purge_allocator(), "jemalloc refused the purge");
        let after = held();
        assert!(
            after + (32 << 20) < before,
            "held beyond the bytes allocated: {} MiB before the purge, {} MiB after",
            before >> 20,
            after >> 20
        );
    }

    /// Free pages are given back only near the limit, or when the
    /// resident size is unknown; never when few are free.
    #[test]
    fn the_purge_waits_for_the_resident_size_to_near_the_limit() {
        let policy = super::PurgePolicy {
            free_above: 32 << 20,
            resident_above: 256 << 20,
        };
        let mib = |m: usize| m << 20;
        assert!(
            !policy.wants_purge(mib(48), Some(mib(200))),
            "far below the limit"
        );
        assert!(
            policy.wants_purge(mib(48), Some(mib(260))),
            "near the limit"
        );
        assert!(
            !policy.wants_purge(mib(16), Some(mib(300))),
            "few free pages"
        );
        assert!(policy.wants_purge(mib(48), None), "resident size unknown");
        assert!(!policy.near_limit(Some(mib(256))));
        assert!(policy.near_limit(Some(mib(257))));
        assert!(policy.near_limit(None));
    }

    /// The kernel's status fields are read in bytes, and the daemon's own
    /// resident size is found.
    #[test]
    fn status_fields_are_read_in_bytes() {
        let status = "Name:\tbetreefs\nVmHWM:\t  300 kB\nVmRSS:\t  123 kB\n";
        assert_eq!(super::status_bytes(status, "VmRSS:"), Some(123 * 1024));
        assert_eq!(super::status_bytes(status, "VmHWM:"), Some(300 * 1024));
        assert_eq!(super::status_bytes(status, "VmSwap:"), None);
        assert!(super::resident_bytes().is_some_and(|r| r > 0));
    }
}
