//! Mounting a real betreefs for tests: as root, through /dev/fuse, with the
//! `betreefs` binary cargo built. Each mount runs the daemon in the
//! foreground as a child of the test, so a test can kill it.

#![allow(dead_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_betreefs"))
}

/// FUSE tests need root and /dev/fuse; CI has both. Elsewhere set
/// BETREEFS_SKIP_FUSE=1 to skip them explicitly (they fail otherwise, so
/// that a CI without FUSE can never pass silently).
pub fn fuse_available() -> bool {
    if std::env::var_os("BETREEFS_SKIP_FUSE").is_some() {
        eprintln!("BETREEFS_SKIP_FUSE set: skipping a FUSE test");
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "FUSE tests run as root");
    assert!(Path::new("/dev/fuse").exists(), "FUSE tests need /dev/fuse");
    true
}

/// The transports the FUSE suites run through: `/dev/fuse` always, and
/// io_uring where the kernel offers it (the fuse module parameter
/// `enable_uring`, which `.ci/run` turns on); a skipped transport is said.
pub fn transports() -> Vec<&'static str> {
    const KNOB: &str = "/sys/module/fuse/parameters/enable_uring";
    let mut out = vec!["transport=devfuse"];
    match std::fs::read_to_string(KNOB) {
        Ok(v) if v.trim() == "Y" || v.trim() == "1" => out.push("transport=uring"),
        Ok(_) => eprintln!("FUSE over io_uring not tested: {KNOB} is off (echo 1 > {KNOB})"),
        Err(_) => eprintln!("FUSE over io_uring not tested: this kernel has no {KNOB}"),
    }
    out
}

/// `betreefs stats` of a mount, parsed.
pub fn stats_json(mountpoint: &Path) -> serde_json::Value {
    let out = Command::new(binary())
        .arg("stats")
        .arg(mountpoint)
        .output()
        .expect("betreefs stats");
    assert_succeeded(&out);
    serde_json::from_slice(&out.stdout).expect("stats JSON")
}

/// One of the engine's counters on a mount (`betreefs stats`).
pub fn engine_counter(mountpoint: &Path, name: &str) -> u64 {
    stats_json(mountpoint)["engine"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no engine counter {name}"))
}

/// One of the FUSE front end's counters on a mount (`betreefs stats`).
pub fn fuse_counter(mountpoint: &Path, name: &str) -> u64 {
    stats_json(mountpoint)["fuse"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no FUSE counter {name}"))
}

/// The daemon's request counters (`betreefs stats`): count per opcode
/// name, and the requests each transport carried.
pub fn request_counts(mountpoint: &Path) -> std::collections::BTreeMap<String, u64> {
    let json = stats_json(mountpoint);
    let mut counts = std::collections::BTreeMap::new();
    let fuse = json["fuse"].as_object().expect("request counters");
    for (op, figures) in fuse {
        if let Some(n) = figures["count"].as_u64() {
            counts.insert(op.clone(), n);
        }
    }
    for via in ["devfuse", "uring"] {
        let n = fuse["transport"][via].as_u64().unwrap_or(0);
        counts.insert(format!("via {via}"), n);
    }
    counts
}

/// What changed between two [`request_counts`].
pub fn request_delta(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    after
        .iter()
        .map(|(op, n)| (op.clone(), n - before.get(op).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// A scratch directory removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("betreefs-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A scratch directory with a fresh image of `size` (not mounted) and the
/// path of a mountpoint in it: (scratch, image, mountpoint).
pub fn formatted(tag: &str, size: &str) -> (Scratch, PathBuf, PathBuf) {
    let s = Scratch::new(tag);
    let image = s.0.join("img");
    let dir = s.0.join("mnt");
    mkfs(&image, size);
    (s, image, dir)
}

pub fn mkfs(image: &Path, size: &str) {
    let out = Command::new(binary())
        .args(["mkfs", "--size", size])
        .arg(image)
        .output()
        .expect("run mkfs");
    assert!(
        out.status.success(),
        "mkfs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The ids of the mounts on `mountpoint` (a dead FUSE mount stays listed
/// until it is detached).
pub fn mount_ids(mountpoint: &Path) -> Vec<String> {
    // A dead mount cannot be canonicalized itself: resolve its parent.
    let canon = match (mountpoint.parent(), mountpoint.file_name()) {
        (Some(parent), Some(name)) => match parent.canonicalize() {
            Ok(p) => p.join(name),
            Err(_) => return Vec::new(),
        },
        _ => return Vec::new(),
    };
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(canon.to_str().unwrap_or("")))
        .filter_map(|l| l.split(' ').next().map(str::to_string))
        .collect()
}

/// Whether a live FUSE file system answers at `dir` (a dead mount fails
/// statfs with ENOTCONN; an unmounted directory reports its parent's type).
pub fn fuse_answers(dir: &Path) -> bool {
    const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
    let c = cstr(dir);
    // SAFETY: valid path; st is written by statfs.
    let (r, kind) = unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        let r = libc::statfs(c.as_ptr(), &mut st);
        (r, st.f_type)
    };
    r == 0 && kind == FUSE_SUPER_MAGIC
}

pub fn is_mounted(mountpoint: &Path) -> bool {
    !mount_ids(mountpoint).is_empty()
}

/// A mounted betreefs whose daemon is our child.
pub struct Mount {
    pub image: PathBuf,
    pub dir: PathBuf,
    child: Option<Child>,
}

impl Mount {
    pub fn start(image: &Path, dir: &Path, options: &[&str]) -> Mount {
        Self::start_with_env(image, dir, options, &[])
    }

    /// [`Mount::start`] with extra environment variables for the daemon.
    pub fn start_with_env(
        image: &Path,
        dir: &Path,
        options: &[&str],
        env: &[(&str, &str)],
    ) -> Mount {
        if std::fs::metadata(dir).is_err() {
            let _ = std::fs::create_dir_all(dir);
        }
        let mut cmd = Command::new(binary());
        cmd.arg("mount").arg(image).arg(dir).arg("--foreground");
        cmd.envs(env.iter().copied());
        for o in options {
            cmd.arg("-o").arg(o);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start daemon");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !fuse_answers(dir) {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("daemon exited before mounting: {status}");
            }
            assert!(Instant::now() < deadline, "mount did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
        Mount {
            image: image.to_path_buf(),
            dir: dir.to_path_buf(),
            child: Some(child),
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// A clean unmount: the daemon writes its final checkpoint and exits 0.
    pub fn unmount(mut self) {
        umount(&self.dir);
        let child = self.child.take();
        if let Some(mut c) = child {
            let status = c.wait().expect("wait for daemon");
            assert!(status.success(), "daemon exited with {status}");
        }
    }

    /// Waits (up to `limit`) for the daemon to exit on its own; its status.
    pub fn wait_exit(mut self, limit: Duration) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("a running daemon");
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait().expect("wait for daemon") {
                return status;
            }
            assert!(Instant::now() < deadline, "the daemon did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM to the daemon: it unmounts, checkpoints and exits 0.
    pub fn terminate(mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: the pid is our child's.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let status = c.wait().expect("wait for daemon");
            assert!(
                status.success(),
                "daemon exited with {status} after SIGTERM"
            );
        }
        assert!(!is_mounted(&self.dir), "SIGTERM left the mount in place");
    }

    /// Unmounts, then mounts the same image on the same directory again
    /// (a fresh daemon) with `options`.
    pub fn remount(self, options: &[&str]) -> Mount {
        self.remount_with_env(options, &[])
    }

    /// [`Mount::remount`] with extra environment variables for the daemon.
    pub fn remount_with_env(self, options: &[&str], env: &[(&str, &str)]) -> Mount {
        let (image, dir) = (self.image.clone(), self.dir.clone());
        self.unmount();
        Mount::start_with_env(&image, &dir, options, env)
    }

    /// Unmounts; `betreefs fsck` must then find the image clean.
    pub fn unmount_fsck_clean(self, context: &str) {
        let image = self.image.clone();
        self.unmount();
        assert_fsck_clean(&image, context);
    }

    /// kill -9 of the daemon; the dead mount is left in place (the next
    /// mount detaches it).
    pub fn kill(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // Known before the lazy unmount hides it: a test that failed
            // may leave a request the daemon never answers, and its thread
            // cannot be killed until the connection ends.
            let connection = betreefs_fuse::mount::connection_id(&self.dir);
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if c.try_wait().ok().flatten().is_none() {
                if let Some(id) = connection {
                    let _ = betreefs_fuse::mount::abort_connection(id);
                }
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A command's output, which must be a success (its stderr otherwise).
pub fn assert_succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// umount(8) of a mount the test made; it must succeed. "Busy" is retried
/// for a few seconds: a child that another test thread is spawning holds
/// copies of this process's descriptors (a file still open here) until it
/// execs, which is the test harness's doing, not the file system's.
pub fn umount(dir: &Path) {
    for _ in 0..50 {
        let out = Command::new("umount").arg(dir).output().expect("umount");
        if out.status.success() {
            return;
        }
        if !String::from_utf8_lossy(&out.stderr).contains("busy") {
            panic!(
                "umount {} failed: {}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("umount {} failed: still busy after 5 s", dir.display());
}

/// mount(8) with `args`, retried for up to 5 s: the daemon of the last
/// mount may still hold the image. True once it mounted.
pub fn mount_retrying(args: &[&std::ffi::OsStr]) -> bool {
    for _ in 0..50 {
        let out = Command::new("mount").args(args).output().expect("mount");
        if out.status.success() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    false
}

pub fn detach(dir: &Path) {
    let _ = Command::new("umount").arg("-l").arg(dir).status();
}

pub fn fsck(image: &Path) -> (bool, String) {
    let out = Command::new(binary())
        .arg("fsck")
        .arg(image)
        .output()
        .expect("run fsck");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code() == Some(0), text)
}

pub fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in path")
}

/// The errno of the last failed libc call.
pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// The errno of an io::Error (0 when none).
pub fn err_of<T>(r: std::io::Result<T>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

/// A checksum of every path, type, size, mode, link count, modification
/// time and content under `root`.
pub fn tree_digest(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry"))
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let rel = p
            .strip_prefix(root)
            .expect("under root")
            .to_string_lossy()
            .into_owned();
        let meta = std::fs::symlink_metadata(&p).expect("lstat");
        use std::os::unix::fs::MetadataExt;
        let desc = if meta.is_dir() {
            walk(root, &p, out);
            format!("dir {:o}", meta.mode())
        } else if meta.file_type().is_symlink() {
            format!("link {:?}", std::fs::read_link(&p).expect("readlink"))
        } else if meta.is_file() {
            let data = std::fs::read(&p).expect("read");
            format!("file {:o} {} {:08x}", meta.mode(), data.len(), crc(&data))
        } else {
            format!("other {:o}", meta.mode())
        };
        let times = format!(
            " nlink={} mtime={}.{:09}",
            meta.nlink(),
            meta.mtime(),
            meta.mtime_nsec()
        );
        out.push((rel, desc + &times));
    }
}

pub fn crc(data: &[u8]) -> u32 {
    data.iter().fold(0x811c9dc5u32, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x01000193)
    })
}

/// renameat2(2): 0, or the errno.
pub fn renameat2(from: &Path, to: &Path, flags: u32) -> i32 {
    let (a, b) = (cstr(from), cstr(to));
    // SAFETY: valid NUL-terminated paths; renameat2 has no libc wrapper here.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    };
    if r == 0 {
        0
    } else {
        errno()
    }
}

/// `betreefs fsck` of an unmounted image must report it clean.
pub fn assert_fsck_clean(image: &Path, context: &str) {
    let (clean, report) = fsck(image);
    assert!(clean, "{context}: fsck: {report}");
}

/// An errno-or-value result of a libc call returning -1 on failure.
fn checked(r: isize) -> Result<usize, i32> {
    if r < 0 {
        Err(errno())
    } else {
        Ok(r as usize)
    }
}

fn xattr_name(name: &str) -> CString {
    CString::new(name).expect("no NUL in an xattr name")
}

/// lsetxattr(2) (symlinks are not followed).
pub fn set_xattr(p: &Path, name: &str, value: &[u8], flags: i32) -> Result<(), i32> {
    let (c, n) = (cstr(p), xattr_name(name));
    // SAFETY: valid path, name and value buffer.
    let r = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    };
    checked(r as isize).map(|_| ())
}

/// lgetxattr(2) into a buffer of `size` bytes.
pub fn get_xattr(p: &Path, name: &str, size: usize) -> Result<Vec<u8>, i32> {
    let (c, n) = (cstr(p), xattr_name(name));
    let mut buf = vec![0u8; size];
    // SAFETY: valid path and name; buf holds `size` bytes.
    let r = unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), size) };
    buf.truncate(checked(r)?);
    Ok(buf)
}

/// llistxattr(2): the names, each followed by a NUL.
pub fn list_xattr(p: &Path) -> Result<Vec<u8>, i32> {
    let c = cstr(p);
    let mut buf = vec![0u8; 4096];
    // SAFETY: valid path; buf holds its length in bytes.
    let r = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(checked(r)?);
    Ok(buf)
}

/// lremovexattr(2).
pub fn remove_xattr(p: &Path, name: &str) -> Result<(), i32> {
    let (c, n) = (cstr(p), xattr_name(name));
    // SAFETY: valid path and name.
    checked(unsafe { libc::lremovexattr(c.as_ptr(), n.as_ptr()) } as isize).map(|_| ())
}

/// The options /proc/mounts shows for the mount on `dir` (the last one
/// mounted there).
pub fn mount_options(dir: &Path) -> Vec<String> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let line = mounts
        .lines()
        .rfind(|l| l.split(' ').nth(1) == dir.to_str())
        .unwrap_or_default();
    line.split(' ')
        .nth(3)
        .unwrap_or_default()
        .split(',')
        .map(str::to_string)
        .collect()
}

/// Set in the environment of a client process (see [`spawn_client`]).
const CLIENT_ENV: &str = "BETREEFS_TEST_CLIENT";

/// Whether this process is a client process that a multi-process test
/// started (the test then acts as the client instead of orchestrating).
pub fn is_client_process() -> bool {
    std::env::var_os(CLIENT_ENV).is_some()
}

/// A variable a client process was given by [`spawn_client`].
pub fn client_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("client process without {name}"))
}

/// Starts a client process for a multi-process test: this test binary
/// again, running only `test` (which sees [`is_client_process`]) with
/// `vars` in its environment; its output goes to `log`. Processes, not
/// threads: each has its own file descriptors and credentials, and the
/// daemon serves them as the kernel interleaves them.
pub fn spawn_client(test: &str, vars: &[(&str, String)], log: &Path) -> (Child, PathBuf) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::fs::File::create(log).expect("client log");
    let err = out.try_clone().expect("client log");
    let child = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CLIENT_ENV, "1")
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("start a client process");
    (child, log.to_path_buf())
}

/// Waits for every client; a client that failed fails the test with its
/// output.
pub fn wait_for_clients(clients: Vec<(Child, PathBuf)>, context: &str) {
    let mut failures = Vec::new();
    for (mut child, log) in clients {
        let status = child.wait().expect("wait for a client process");
        if !status.success() {
            let output = std::fs::read_to_string(&log).unwrap_or_default();
            failures.push(format!("client {} ({status}):\n{output}", log.display()));
        }
    }
    assert!(failures.is_empty(), "{context}: {}", failures.join("\n"));
}
