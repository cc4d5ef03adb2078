//! The FUSE front end's round trips and transports, seen from the
//! daemon's request counters: requests that must no longer arrive, every
//! opcode through each transport, the interrupt and forget paths, a mount
//! whose io_uring queues fail to register, and set-ID bits dropped on
//! write, truncate, fallocate and chown exactly as the kernel drops them
//! on tmpfs (the daemon does it since it negotiates
//! `FUSE_HANDLE_KILLPRIV_V2`), and requests served while the work left
//! for after their replies is held.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

fn mounted(tag: &str, options: &[&str]) -> (Scratch, Mount) {
    let (s, image, dir) = formatted(tag, "1G");
    let m = Mount::start(&image, &dir, options);
    (s, m)
}

fn count(delta: &BTreeMap<String, u64>, op: &str) -> u64 {
    delta.get(op).copied().unwrap_or(0)
}

/// Requests through /dev/fuse that the protocol keeps there whatever the
/// transport: FORGET (also batched) and INTERRUPT.
fn device_only(delta: &BTreeMap<String, u64>) -> u64 {
    count(delta, "forget") + count(delta, "batch_forget") + count(delta, "interrupt")
}

#[test]
fn removed_round_trips_stay_removed() {
    if !fuse_available() {
        return;
    }
    for transport in transports() {
        let (_s, m) = mounted("rounds", &[transport]);
        fs::create_dir(m.path("d")).unwrap();
        let before = request_counts(&m.dir);
        for i in 0..50 {
            let mut f = File::create(m.path(&format!("d/f{i}"))).unwrap();
            f.write_all(&[1; 100]).unwrap();
            f.write_all(&[2; 100]).unwrap();
        }
        let delta = request_delta(&before, &request_counts(&m.dir));
        assert_eq!(count(&delta, "create"), 50, "{transport}: {delta:?}");
        assert_eq!(count(&delta, "write"), 100, "{transport}: {delta:?}");
        // FLUSH: answered ENOSYS once per mount, then never sent again.
        assert!(count(&delta, "flush") <= 1, "{transport}: {delta:?}");
        // security.capability is asked once per file (killpriv_v2 lets the
        // kernel remember the answer), not once per write.
        assert!(count(&delta, "getxattr") <= 50, "{transport}: {delta:?}");

        // Directories: no OPENDIR/RELEASEDIR, and an unchanged directory
        // is listed from the kernel's cache the second time.
        let before = request_counts(&m.dir);
        let first = fs::read_dir(m.path("d")).unwrap().count();
        let middle = request_counts(&m.dir);
        let second = fs::read_dir(m.path("d")).unwrap().count();
        let after = request_counts(&m.dir);
        assert_eq!(first, 50);
        assert_eq!(second, 50);
        let listing = request_delta(&before, &middle);
        // OPENDIR: answered ENOSYS once per mount, then never sent again.
        assert!(count(&listing, "opendir") <= 1, "{transport}: {listing:?}");
        assert_eq!(count(&listing, "releasedir"), 0, "{transport}: {listing:?}");
        let again = request_delta(&middle, &after);
        let reads = count(&again, "readdir") + count(&again, "readdirplus");
        assert_eq!(
            reads, 0,
            "{transport}: a cached listing asked again: {again:?}"
        );
        let before = request_counts(&m.dir);
        assert_eq!(fs::read_dir(&m.dir).unwrap().count(), 1);
        let root = request_delta(&before, &request_counts(&m.dir));
        assert_eq!(count(&root, "opendir"), 0, "{transport}: {root:?}");
        m.unmount();
    }
}

/// One of each operation; returns nothing, the counters tell.
fn exercise_every_opcode(m: &Mount) {
    let p = |rel: &str| m.path(rel);
    fs::create_dir(p("d")).unwrap();
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(p("d/f"))
        .unwrap();
    f.write_all(b"hello").unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(fs::read(p("d/f")).unwrap(), b"hello");
    let f = OpenOptions::new().write(true).open(p("d/f")).unwrap();
    f.set_len(2).unwrap();
    // SAFETY: fallocate on a descriptor we own.
    assert_eq!(
        unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, 8192) },
        0
    );
    drop(f);
    fs::set_permissions(p("d/f"), fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::symlink("f", p("d/s")).unwrap();
    assert_eq!(fs::read_link(p("d/s")).unwrap(), Path::new("f"));
    fs::hard_link(p("d/f"), p("d/h")).unwrap();
    let fifo = cstr(&p("d/fifo"));
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(
        unsafe { libc::mknod(fifo.as_ptr(), libc::S_IFIFO | 0o600, 0) },
        0
    );
    set_xattr(&p("d/f"), "user.k", b"v", 0).unwrap();
    assert_eq!(get_xattr(&p("d/f"), "user.k", 64).unwrap(), b"v");
    assert!(!list_xattr(&p("d/f")).unwrap().is_empty());
    remove_xattr(&p("d/f"), "user.k").unwrap();
    fs::rename(p("d/h"), p("d/h2")).unwrap();
    assert_eq!(renameat2(&p("d/h2"), &p("d/s"), libc::RENAME_EXCHANGE), 0);
    assert_eq!(fs::read_dir(p("d")).unwrap().count(), 4);
    File::open(p("d")).unwrap().sync_all().unwrap();
    let stat = cstr(&m.dir);
    // SAFETY: st is written by statvfs.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid path and a writable statvfs.
    assert_eq!(unsafe { libc::statvfs(stat.as_ptr(), &mut st) }, 0);
    fs::remove_file(p("d/fifo")).unwrap();
    fs::remove_file(p("d/s")).unwrap();
    fs::remove_file(p("d/h2")).unwrap();
    fs::remove_file(p("d/f")).unwrap();
    fs::remove_dir(p("d")).unwrap();
    // The kernel forgets what it no longer caches.
    drop_kernel_caches();
}

fn drop_kernel_caches() {
    fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
}

#[test]
fn every_opcode_through_each_transport() {
    if !fuse_available() {
        return;
    }
    for transport in transports() {
        let (_s, m) = mounted("opcodes", &[transport]);
        let before = request_counts(&m.dir);
        exercise_every_opcode(&m);
        // Forgets are sent in the background: wait for them.
        let mut delta = request_delta(&before, &request_counts(&m.dir));
        for _ in 0..100 {
            if count(&delta, "forget") + count(&delta, "batch_forget") > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            delta = request_delta(&before, &request_counts(&m.dir));
        }
        for op in [
            "lookup",
            "getattr",
            "setattr",
            "readlink",
            "symlink",
            "mknod",
            "mkdir",
            "unlink",
            "rmdir",
            "rename2",
            "link",
            "open",
            "read",
            "write",
            "statfs",
            "release",
            "fsync",
            "fsyncdir",
            "setxattr",
            "getxattr",
            "listxattr",
            "removexattr",
            "create",
            "readdirplus",
            "fallocate",
        ] {
            assert!(
                count(&delta, op) > 0,
                "{transport}: no {op} arrived: {delta:?}"
            );
        }
        assert!(
            count(&delta, "forget") + count(&delta, "batch_forget") > 0,
            "{transport}: no forget after dropping the kernel's caches: {delta:?}"
        );
        if transport == "transport=uring" {
            assert_eq!(
                count(&delta, "via devfuse"),
                device_only(&delta),
                "{transport}: only FORGET and INTERRUPT may use /dev/fuse: {delta:?}"
            );
            assert!(count(&delta, "via uring") > 0);
        } else {
            assert_eq!(count(&delta, "via uring"), 0, "{delta:?}");
        }
        m.unmount();
    }
}

/// Removed files' inodes reach the daemon as forgets, through either
/// transport; with the io_uring queues carrying every other request, the
/// `/dev/fuse` readers let forgets gather and take them as batches
/// (`FORGET_GATHERING`): hundreds of removed files, a few reads.
#[test]
fn forgets_of_removed_files_arrive_and_gather_in_batches() {
    if !fuse_available() {
        return;
    }
    const FILES: u64 = 400;
    let forgotten = |m: &Mount| stats_json(&m.dir)["fuse"]["forgotten_inodes"].as_u64();
    for transport in transports() {
        let (_s, m) = mounted("forgets", &[transport]);
        fs::create_dir(m.path("d")).unwrap();
        for i in 0..FILES {
            File::create(m.path(&format!("d/f{i}"))).unwrap();
        }
        let before = request_counts(&m.dir);
        let forgotten_before = forgotten(&m).expect("forgotten_inodes in the stats");
        for i in 0..FILES {
            fs::remove_file(m.path(&format!("d/f{i}"))).unwrap();
        }
        // Each removed inode is evicted and forgotten; forgets are sent in
        // the background: wait for them.
        let mut arrived = 0;
        for _ in 0..250 {
            arrived = forgotten(&m).unwrap() - forgotten_before;
            if arrived >= FILES {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            arrived >= FILES,
            "{transport}: {arrived} of {FILES} removed inodes forgotten"
        );
        let delta = request_delta(&before, &request_counts(&m.dir));
        let requests = count(&delta, "forget") + count(&delta, "batch_forget");
        if transport == "transport=uring" {
            assert!(
                requests <= FILES / 4,
                "{transport}: {FILES} forgets came in {requests} requests: {delta:?}"
            );
        }
        m.unmount();
    }
}

extern "C" fn ignore_signal(_: libc::c_int) {}

/// A signal to a thread waiting for a request makes the kernel send
/// INTERRUPT; the daemon answers ENOSYS (its requests are not
/// interruptible), the kernel stops sending them, and the request
/// completes normally.
#[test]
fn interrupted_requests_complete() {
    if !fuse_available() {
        return;
    }
    // SAFETY: installs a handler that does nothing (so the signal is not
    // fatal and the kernel interrupts rather than aborts the request).
    unsafe {
        libc::signal(
            libc::SIGUSR1,
            ignore_signal as *const () as libc::sighandler_t,
        )
    };
    for transport in transports() {
        let (s, image, dir) = formatted("interrupt", "1G");
        let m = Mount::start_with_env(
            &image,
            &dir,
            &[transport],
            &[("BETREEFS_TEST_DELAY", "fsync:300")],
        );
        let _keep = s;
        fs::write(m.path("f"), b"x").unwrap();
        let before = request_counts(&m.dir);
        let path = m.path("f");
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = std::thread::spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            tx.send(unsafe { libc::pthread_self() }).unwrap();
            File::open(&path).unwrap().sync_all()
        });
        let thread = rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: the thread is alive (it waits for its fsync).
        unsafe { libc::pthread_kill(thread, libc::SIGUSR1) };
        worker
            .join()
            .unwrap()
            .expect("the interrupted fsync completes");
        let delta = request_delta(&before, &request_counts(&m.dir));
        assert_eq!(count(&delta, "interrupt"), 1, "{transport}: {delta:?}");
        assert_eq!(fs::read(m.path("f")).unwrap(), b"x");
        m.unmount();
    }
}

#[test]
fn uring_setup_failures_fall_back_or_say_why() {
    if !fuse_available() {
        return;
    }
    if !transports().contains(&"transport=uring") {
        // No io_uring here: asking for it must fail with the reason.
        let (_s, image, dir) = formatted("nouring", "256M");
        fs::create_dir_all(&dir).unwrap();
        let out = Command::new(binary())
            .args(["mount", "-o", "transport=uring"])
            .arg(&image)
            .arg(&dir)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("enable_uring"), "{err}");
        return;
    }
    // A queue that cannot register: the kernel is told to give up io_uring
    // and the mount works through /dev/fuse.
    let (s, image, dir) = formatted("uringfail", "256M");
    let m = Mount::start_with_env(
        &image,
        &dir,
        &[],
        &[("BETREEFS_TEST_URING_FAIL_QUEUE", "0")],
    );
    fs::write(m.path("f"), b"still served").unwrap();
    assert_eq!(fs::read(m.path("f")).unwrap(), b"still served");
    let counts = request_counts(&m.dir);
    assert_eq!(counts["via uring"], 0, "{counts:?}");
    assert!(counts["via devfuse"] > 0);
    m.unmount();
    // Asking for io_uring explicitly: the mount fails and says why.
    let out = Command::new(binary())
        .args(["mount", "-o", "transport=uring"])
        .arg(&image)
        .arg(&dir)
        .env("BETREEFS_TEST_URING_FAIL_QUEUE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not register"), "{err}");
    assert!(!is_mounted(&dir));
    drop(s);
}

/// Names stay cached past the attribute timeout: looking at files again
/// later costs at most a GETATTR each, never a LOOKUP of their names; a
/// cached absent name stays absent and a create replaces it.
#[test]
fn names_stay_cached_past_the_attribute_timeout() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("entryttl", &[]);
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..20 {
        fs::write(m.path(&format!("d/f{i}")), b"x").unwrap();
    }
    assert!(fs::metadata(m.path("d/absent")).is_err());
    // Past the 10 s attribute timeout.
    std::thread::sleep(std::time::Duration::from_secs(11));
    let before = request_counts(&m.dir);
    for i in 0..20 {
        assert_eq!(fs::metadata(m.path(&format!("d/f{i}"))).unwrap().len(), 1);
    }
    assert!(fs::metadata(m.path("d/absent")).is_err());
    let delta = request_delta(&before, &request_counts(&m.dir));
    assert_eq!(count(&delta, "lookup"), 0, "{delta:?}");
    fs::write(m.path("d/absent"), b"now here").unwrap();
    assert_eq!(fs::read(m.path("d/absent")).unwrap(), b"now here");
    m.unmount();
}

/// A queue that stops while the mount lives: the kernel keeps routing its
/// CPU's requests to it, so the daemon gives the mount up (every waiting
/// request fails, the daemon exits non-zero after flushing the log)
/// instead of leaving callers hanging; nothing fsync'd is lost. Its ring
/// broke:
#[test]
fn a_stopped_uring_queue_fails_the_mount_instead_of_hanging_it() {
    stopped_uring_queue_fails_the_mount("broken");
}

/// ... the kernel ended its entries with ENOTCONN while the connection
/// lives (as when io_uring cancels them), which looks like an unmount to
/// the queue alone:
#[test]
fn a_uring_queue_whose_entries_were_cancelled_fails_the_mount() {
    stopped_uring_queue_fails_the_mount("cancelled");
}

/// ... its thread panicked outside any request:
#[test]
fn a_uring_queue_that_panicked_fails_the_mount() {
    stopped_uring_queue_fails_the_mount("panic");
}

fn stopped_uring_queue_fails_the_mount(how: &str) {
    if !fuse_available() || !transports().contains(&"transport=uring") {
        return;
    }
    let (_s, image, dir) = formatted(&format!("uringstop-{how}"), "256M");
    let m = Mount::start_with_env(
        &image,
        &dir,
        &["transport=uring"],
        &[("BETREEFS_TEST_URING_STOP_QUEUE", &format!("0:200:{how}"))],
    );
    // Requests issued on CPU 0 go to queue 0.
    let root = m.dir.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        pin_to_cpu_zero();
        // Names are resolved from a descriptor of the mount's root: once
        // the daemon detaches the mount, paths through the mountpoint would
        // reach the directory underneath and succeed.
        let base = fs::File::open(&root).unwrap();
        let root = std::path::PathBuf::from(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&base)
        ));
        let kept = root.join("kept");
        let mut f = fs::File::create(&kept).unwrap();
        std::io::Write::write_all(&mut f, b"synced").unwrap();
        f.sync_all().unwrap();
        drop(f);
        let mut failed = None;
        for i in 0..1000 {
            if let Err(e) = fs::write(root.join(format!("f{i}")), b"x") {
                failed = Some(e.raw_os_error());
                break;
            }
        }
        let _ = tx.send(failed);
    });
    let failed = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("requests on the stopped queue's CPU hang");
    assert!(
        matches!(
            failed,
            Some(Some(
                libc::EIO | libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED
            ))
        ),
        "{failed:?}"
    );
    let status = m.wait_exit(std::time::Duration::from_secs(30));
    assert!(!status.success(), "the daemon must not exit 0");
    assert!(!is_mounted(&dir));
    let again = Mount::start(&image, &dir, &[]);
    assert_eq!(fs::read(again.path("kept")).unwrap(), b"synced");
    again.unmount();
}

/// Pins the calling thread to CPU 0: its requests go to io_uring queue 0.
fn pin_to_cpu_zero() {
    // SAFETY: the set is zeroed and filled with CPU_SET; the call only
    // changes this thread's affinity.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
}

/// A fresh mount whose work after replies the debug-build hook holds
/// while `flag` exists (it writes `held` once it holds some).
struct HeldWork {
    mount: Mount,
    flag: std::path::PathBuf,
    held: std::path::PathBuf,
    _scratch: Scratch,
}

impl HeldWork {
    /// Only io_uring queues hand their work after replies to the worker.
    const TRANSPORT: &'static str = "transport=uring";

    /// Mounts a fresh 1 GiB image through io_uring, the hold's flag
    /// written first if `holding`; None where FUSE or its io_uring
    /// transport is not available.
    fn mount(tag: &str, holding: bool) -> Option<HeldWork> {
        if !fuse_available() || !transports().contains(&Self::TRANSPORT) {
            return None;
        }
        let (s, image, dir) = formatted(tag, "1G");
        let (flag, held) = (s.0.join("hold"), s.0.join("hold.held"));
        if holding {
            fs::write(&flag, b"").unwrap();
        }
        let mount = Mount::start_with_env(
            &image,
            &dir,
            &[Self::TRANSPORT],
            &[("BETREEFS_TEST_HOLD_AFTER_REPLY", flag.to_str().unwrap())],
        );
        Some(HeldWork {
            mount,
            flag,
            held,
            _scratch: s,
        })
    }
}

/// Waits (at most 30 s) until the debug-build hook holds the work after
/// replies (it writes `held`).
fn wait_until_held(held: &Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !held.exists() {
        assert!(std::time::Instant::now() < deadline, "no work was left");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Checks that the work after replies, held since `done_before` was
/// counted, has not run; lets it go (removes `flag`) and waits (at most
/// 30 s) until it has.
fn let_held_work_go(m: &Mount, flag: &Path, done_before: u64, what: &str) {
    assert_eq!(
        engine_counter(&m.dir, "work_after_reply"),
        done_before,
        "{what}: the work ran while held"
    );
    fs::remove_file(flag).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while engine_counter(&m.dir, "work_after_reply") == done_before {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: the work was not done once let go"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// While one client alone issues requests, the work a request leaves for
/// after its reply (here the application of staged unlinks, past half
/// the range deletes that may be staged) is done by a thread that serves
/// no request: held there by a debug-build hook, the requests the client
/// goes on to issue from the same CPU (the io_uring queue its next
/// request goes to) are served meanwhile. Done by the queue's thread
/// after its replies, as before, they waited behind it (tried: this test
/// then times out). `/dev/fuse` has several unpinned readers and keeps
/// the work on the reader that served the request.
#[test]
fn requests_are_served_while_the_work_after_their_replies_is_held() {
    let Some(HeldWork {
        mount: m,
        flag,
        held,
        _scratch,
    }) = HeldWork::mount("afterreply", true)
    else {
        return;
    };
    let transport = HeldWork::TRANSPORT;
    let done_before = engine_counter(&m.dir, "work_after_reply");
    let root = m.dir.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        pin_to_cpu_zero();
        for i in 0..200 {
            fs::write(root.join(format!("f{i}")), b"x").unwrap();
        }
        // Each unlink stages a range delete (the file's data); past
        // half the limit the writer leaves their application for
        // after its reply.
        let mut removed = 0;
        while !held.exists() && removed < 100 {
            fs::remove_file(root.join(format!("f{removed}"))).unwrap();
            removed += 1;
        }
        wait_until_held(&held);
        // The work is pending and held: requests from this CPU go on,
        // past the staged range deletes' limit (a write that applies
        // in its request).
        for j in 0..80 {
            fs::write(root.join(format!("g{j}")), b"y").unwrap();
            assert_eq!(fs::read(root.join(format!("g{j}"))).unwrap(), b"y");
            fs::remove_file(root.join(format!("f{}", removed + j))).unwrap();
        }
        let _ = tx.send(removed + 80);
    });
    let removed = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("requests wait behind the work after a reply");
    let_held_work_go(&m, &flag, done_before, transport);
    let mut names: Vec<String> = fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut expected: Vec<String> = (removed..200)
        .map(|i| format!("f{i}"))
        .chain((0..80).map(|j| format!("g{j}")))
        .collect();
    expected.sort();
    assert_eq!(names, expected, "{transport}");
    let m = m.remount(&[transport]);
    assert_eq!(fs::read(m.path("g79")).unwrap(), b"y");
    assert!(!m.path("f0").exists());
    m.unmount_fsck_clean(transport);
}

/// A directory rename returns before its surgery: the rename is staged
/// and its application left to the after-reply worker, held here by the
/// debug-build hook. Meanwhile the tree answers under its new name — the
/// reads of the renamed tree apply what is staged themselves — and the
/// work, let go, finds nothing left to do wrongly; the tree is whole
/// after a remount. The client is one thread pinned to CPU 0, as in the
/// test above.
#[test]
fn a_renamed_tree_is_served_while_the_rename_waits_for_the_worker() {
    let Some(HeldWork {
        mount: m,
        flag,
        held,
        _scratch,
    }) = HeldWork::mount("renamestaged", false)
    else {
        return;
    };
    let transport = HeldWork::TRANSPORT;
    fn content(i: usize) -> Vec<u8> {
        format!("file {i} ").repeat(600).into_bytes()
    }
    let in_client = |work: Box<dyn FnOnce() + Send>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            pin_to_cpu_zero();
            work();
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the client's requests wait behind the held work");
    };
    let root = m.dir.clone();
    in_client(Box::new(move || {
        for d in 0..4 {
            fs::create_dir_all(root.join(format!("a/d{d}"))).unwrap();
            for i in 0..50 {
                fs::write(root.join(format!("a/d{d}/f{i}")), content(d * 50 + i)).unwrap();
            }
        }
        File::open(&root).unwrap().sync_all().unwrap();
    }));
    let renames = || {
        engine_counter(&m.dir, "range_renames_by_surgery")
            + engine_counter(&m.dir, "range_renames_copied")
    };
    fs::write(&flag, b"").unwrap();
    // Work begun before the flag was there ends meanwhile.
    std::thread::sleep(Duration::from_millis(200));
    let (renamed_before, done_before) = (renames(), engine_counter(&m.dir, "work_after_reply"));
    let staged_before = engine_counter(&m.dir, "writes_staged");
    let (root, held_too) = (m.dir.clone(), held.clone());
    in_client(Box::new(move || {
        fs::rename(root.join("a"), root.join("b")).unwrap();
        wait_until_held(&held_too);
        // Held: the tree is served under its new name all the same.
        assert!(!root.join("a").exists());
        for d in 0..4 {
            let mut names: Vec<String> = fs::read_dir(root.join(format!("b/d{d}")))
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            let mut want: Vec<String> = (0..50).map(|i| format!("f{i}")).collect();
            want.sort();
            assert_eq!(names, want);
            for i in [0, 17, 49] {
                assert_eq!(
                    fs::read(root.join(format!("b/d{d}/f{i}"))).unwrap(),
                    content(d * 50 + i)
                );
            }
        }
    }));
    assert!(engine_counter(&m.dir, "writes_staged") > staged_before);
    assert!(renames() > renamed_before, "the reads applied the rename");
    let_held_work_go(&m, &flag, done_before, transport);
    let m = m.remount(&[transport]);
    assert!(!m.path("a").exists());
    assert_eq!(fs::read(m.path("b/d3/f49")).unwrap(), content(199));
    assert_eq!(fs::read_dir(m.path("b/d0")).unwrap().count(), 50);
    m.unmount_fsck_clean(transport);
}

/// Runs `script` with `sh -c` as user and group `uid` (no other groups).
fn as_user(uid: u32, script: &str) {
    let status = Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .args(["sh", "-c", script])
        .status()
        .expect("setpriv (util-linux)");
    assert!(status.success(), "as {uid}: {script}");
}

/// The modes a set of changes leaves, for the files of `dir`.
fn set_id_cases(dir: &Path) -> Vec<(String, u32)> {
    const OWNER: u32 = 65534;
    const OTHER: u32 = 65533;
    // (name, mode, what happens to it)
    let cases: [(&str, u32, &str); 12] = [
        ("write-g+x", 0o6755, "owner-write"),
        ("write-g-x", 0o6644, "owner-write"),
        ("write-other", 0o6666, "other-write"),
        ("write-other-g+x", 0o6777, "other-write"),
        ("truncate", 0o6744, "owner-truncate"),
        ("truncate-g-x", 0o6644, "owner-truncate"),
        ("fallocate-other", 0o6666, "other-fallocate"),
        ("fallocate-owner", 0o6644, "owner-fallocate"),
        ("chown-root-g+x", 0o6755, "root-chown"),
        ("chown-root-g-x", 0o6745, "root-chown"),
        ("chgrp-owner", 0o6755, "owner-chgrp"),
        ("dir-chown", 0o2755, "root-chown-dir"),
    ];
    let mut out = Vec::new();
    for (name, mode, change) in cases {
        let p = dir.join(name);
        if change.ends_with("-dir") {
            fs::create_dir(&p).unwrap();
        } else {
            fs::write(&p, b"data").unwrap();
        }
        let c = cstr(&p);
        // SAFETY: valid path; owner then mode (chown clears set-ID bits).
        unsafe {
            assert_eq!(libc::chown(c.as_ptr(), OWNER, OWNER), 0);
            assert_eq!(libc::chmod(c.as_ptr(), mode), 0);
        }
        let q = p.display();
        match change {
            "owner-write" => as_user(OWNER, &format!("printf x >> '{q}'")),
            "other-write" => as_user(OTHER, &format!("printf x >> '{q}'")),
            "owner-truncate" => as_user(OWNER, &format!("truncate -s 1 '{q}'")),
            "other-fallocate" => as_user(OTHER, &format!("fallocate -l 8192 '{q}'")),
            "owner-fallocate" => as_user(OWNER, &format!("fallocate -l 8192 '{q}'")),
            "owner-chgrp" => as_user(OWNER, &format!("chgrp {OWNER} '{q}'")),
            "root-chown" | "root-chown-dir" => {
                // SAFETY: a valid path.
                assert_eq!(unsafe { libc::chown(c.as_ptr(), OWNER, OWNER) }, 0);
            }
            other => unreachable!("{other}"),
        }
        let mode = fs::symlink_metadata(&p).unwrap().mode() & 0o7777;
        out.push((name.to_string(), mode));
    }
    out
}

#[test]
fn set_id_bits_are_dropped_as_the_kernel_drops_them() {
    if !fuse_available() {
        return;
    }
    let tmpfs = Path::new("/dev/shm").join(format!("betreefs-setid-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmpfs);
    fs::create_dir(&tmpfs).unwrap();
    fs::set_permissions(&tmpfs, fs::Permissions::from_mode(0o777)).unwrap();
    let want = set_id_cases(&tmpfs);
    fs::remove_dir_all(&tmpfs).unwrap();
    for transport in transports() {
        let (_s, m) = mounted("setid", &[transport]);
        fs::set_permissions(&m.dir, fs::Permissions::from_mode(0o777)).unwrap();
        // The scratch directory above the mount must let the users through.
        let mut up = m.dir.parent();
        while let Some(dir) = up.filter(|d| d.starts_with(std::env::temp_dir())) {
            let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o755));
            up = dir.parent();
        }
        let got = set_id_cases(&m.dir);
        assert_eq!(
            got, want,
            "{transport}: modes after changes (betreefs vs tmpfs)"
        );
        m.unmount();
    }
}
