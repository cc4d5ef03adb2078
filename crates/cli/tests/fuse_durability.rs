//! The durability contract on a real mount: kill -9 of the daemon at a
//! random moment loses nothing fsync'd and keeps a prefix of the rest;
//! a full device gives ENOSPC and stays consistent; unmount and mount
//! give back the same tree.
//!
//! BETREEFS_KILL_SEEDS (default 4) sets how many kill -9 rounds run.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn content(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

#[test]
fn kill_minus_nine_keeps_every_fsynced_byte() {
    if !fuse_available() {
        return;
    }
    let seeds: u64 = std::env::var("BETREEFS_KILL_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    for seed in 0..seeds {
        let s = Scratch::new("kill");
        let image = s.0.join("img");
        mkfs(&image, "512M");
        let m = Mount::start(&image, &s.0.join("mnt"), &[]);
        let mut rng = SmallRng::seed_from_u64(seed);
        let kill_after = Duration::from_millis(rng.gen_range(100..1500));
        let pid = m.pid();
        let killer = std::thread::spawn(move || {
            std::thread::sleep(kill_after);
            // SAFETY: pid is our child's.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        });
        let run = create_files_until_error(&m.dir, "", 0, &mut rng);
        killer.join().unwrap();
        m.kill();
        let m = Mount::start(&image, &s.0.join("mnt"), &[]);
        let survived = run.check_after_crash(&m.dir, &format!("seed {seed}"));
        // The whole tree is readable.
        let walked = tree_digest(&m.dir).len();
        eprintln!(
            "seed {seed}: killed after {kill_after:?}: {} files created, {} fsync'd, {survived} survived, {walked} entries",
            run.created.len(),
            run.durable.len(),
        );
        m.unmount();
        assert_fsck_clean(&image, &format!("seed {seed}, after kill -9"));
    }
}

/// What one run of [`create_files_until_error`] did.
#[derive(Debug, Default, PartialEq)]
struct FileRun {
    /// The files created, in order.
    created: Vec<String>,
    /// The files fsync'd (file and directory): (path, content number,
    /// length) of their [`content`].
    durable: Vec<(String, u64, usize)>,
}

/// The workload of the kill -9 tests: numbered files in numbered
/// directories under `root/prefix`, with contents numbered from `key`; some
/// are fsync'd (file and directory), most are not. It stops at the first
/// error (the daemon is gone) or after 200,000 files.
fn create_files_until_error(root: &Path, prefix: &str, key: u64, rng: &mut SmallRng) -> FileRun {
    let mut run = FileRun::default();
    for i in 0..200_000u64 {
        let dir = format!("{prefix}d{:03}", i / 50);
        if i.is_multiple_of(50) && fs::create_dir(root.join(&dir)).is_err() {
            break;
        }
        let rel = format!("{dir}/f{i:06}");
        let len = *[10usize, 4096, 5000, 70_000]
            .get(rng.gen_range(0..4))
            .unwrap_or(&10);
        let data = content(key + i, len);
        let sync = rng.gen_bool(0.2);
        let result = (|| -> std::io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(root.join(&rel))?;
            f.write_all(&data)?;
            if sync {
                f.sync_all()?;
                fsync_dir(&root.join(&dir))?;
            }
            Ok(())
        })();
        if result.is_err() {
            break; // the daemon is gone
        }
        run.created.push(rel.clone());
        if sync {
            run.durable.push((rel, key + i, len));
        }
    }
    run
}

impl FileRun {
    /// After a crash, on the remounted `root`: every fsync'd file is there
    /// with its content, and what survived of the rest is a prefix (one
    /// log orders all of a process's operations). How many files survived.
    fn check_after_crash(&self, root: &Path, context: &str) -> usize {
        for (rel, key, len) in &self.durable {
            let got = fs::read(root.join(rel))
                .unwrap_or_else(|e| panic!("{context}: fsync'd {rel} lost: {e}"));
            assert!(
                got == content(*key, *len),
                "{context}: fsync'd {rel} has wrong content"
            );
        }
        let survived: Vec<bool> = self
            .created
            .iter()
            .map(|rel| root.join(rel).exists())
            .collect();
        if let Some(first_missing) = survived.iter().position(|&s| !s) {
            assert!(
                survived[first_missing..].iter().all(|&s| !s),
                "{context}: {} missing but a later file survived",
                self.created[first_missing]
            );
        }
        survived.iter().filter(|&&s| s).count()
    }

    /// One line per file: `c <path>` created, `d <path> <key> <len>`
    /// fsync'd too.
    fn encode(&self) -> String {
        let mut out = String::new();
        for rel in &self.created {
            out += &format!("c {rel}\n");
        }
        for (rel, key, len) in &self.durable {
            out += &format!("d {rel} {key} {len}\n");
        }
        out
    }

    fn decode(text: &str) -> FileRun {
        let mut run = FileRun::default();
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            match fields[..] {
                ["c", rel] => run.created.push(rel.to_string()),
                ["d", rel, key, len] => {
                    run.durable
                        .push((rel.to_string(), key.parse().unwrap(), len.parse().unwrap()))
                }
                _ => panic!("a client's result has a bad line {line:?}"),
            }
        }
        run
    }
}

/// kill -9 of the daemon while several client processes create and fsync
/// files at once, each in its own directory: every client's fsync'd files
/// survive and its other files survive as a prefix. Seeds take turns with
/// the transports; BETREEFS_KILL_SEEDS (default 4) rounds of
/// BETREEFS_KILL_CLIENTS (default 3) clients.
#[test]
fn kill_minus_nine_with_several_clients_keeps_every_fsynced_byte() {
    if is_client_process() {
        let root = PathBuf::from(client_var("BETREEFS_CLIENT_ROOT"));
        let key: u64 = client_var("BETREEFS_CLIENT_KEY").parse().unwrap();
        let mut rng = SmallRng::seed_from_u64(key);
        let run =
            create_files_until_error(&root, &client_var("BETREEFS_CLIENT_PREFIX"), key, &mut rng);
        assert_eq!(FileRun::decode(&run.encode()), run);
        fs::write(client_var("BETREEFS_CLIENT_RESULT"), run.encode()).unwrap();
        return;
    }
    if !fuse_available() {
        return;
    }
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (seeds, clients) = (
        env("BETREEFS_KILL_SEEDS", 4),
        env("BETREEFS_KILL_CLIENTS", 3),
    );
    let transports = transports();
    for seed in 0..seeds {
        let s = Scratch::new("kill-clients");
        let image = s.0.join("img");
        mkfs(&image, "512M");
        let transport = transports[seed as usize % transports.len()];
        let m = Mount::start(&image, &s.0.join("mnt"), &[transport]);
        for k in 0..clients {
            fs::create_dir(m.path(&format!("c{k}"))).unwrap();
        }
        fsync_dir(&m.dir).unwrap();
        let mut rng = SmallRng::seed_from_u64(seed);
        let kill_after = Duration::from_millis(rng.gen_range(200..2000));
        let results: Vec<PathBuf> = (0..clients)
            .map(|k| s.0.join(format!("result-{k}")))
            .collect();
        let spawned = (0..clients)
            .map(|k| {
                let vars = [
                    ("BETREEFS_CLIENT_ROOT", m.dir.display().to_string()),
                    ("BETREEFS_CLIENT_PREFIX", format!("c{k}/")),
                    // Contents differ between clients and seeds.
                    (
                        "BETREEFS_CLIENT_KEY",
                        ((seed * clients + k) << 20).to_string(),
                    ),
                    (
                        "BETREEFS_CLIENT_RESULT",
                        results[k as usize].display().to_string(),
                    ),
                ];
                let log = s.0.join(format!("client-{k}.log"));
                spawn_client(
                    "kill_minus_nine_with_several_clients_keeps_every_fsynced_byte",
                    &vars,
                    &log,
                )
            })
            .collect();
        std::thread::sleep(kill_after);
        m.kill();
        wait_for_clients(spawned, &format!("seed {seed}"));
        let m = Mount::start(&image, &s.0.join("mnt"), &[]);
        let mut summary = Vec::new();
        for (k, result) in results.iter().enumerate() {
            let run = FileRun::decode(&fs::read_to_string(result).unwrap());
            assert!(
                !run.created.is_empty(),
                "seed {seed}: client {k} created nothing before the kill"
            );
            let survived = run.check_after_crash(&m.dir, &format!("seed {seed} client {k}"));
            summary.push(format!(
                "{} created, {} fsync'd, {survived} survived",
                run.created.len(),
                run.durable.len()
            ));
        }
        let walked = tree_digest(&m.dir).len();
        eprintln!(
            "seed {seed} ({transport}): killed after {kill_after:?}: {summary:?}, {walked} entries"
        );
        m.unmount();
        assert_fsck_clean(
            &image,
            &format!("seed {seed}, after kill -9 of several clients' mount"),
        );
    }
}

/// Writes files `fill0`, `fill1`, ... of four `chunk`s each until a
/// create or write fails: the files started, and the error.
fn fill_until_full(m: &Mount, chunk: &[u8]) -> (usize, Option<i32>) {
    let mut files = 0;
    for i in 0..1000 {
        let mut f = match File::create(m.path(&format!("fill{i}"))) {
            Ok(f) => f,
            Err(e) => return (files, e.raw_os_error()),
        };
        files += 1;
        for _ in 0..4 {
            if let Err(e) = f.write_all(chunk).and_then(|()| f.flush()) {
                return (files, e.raw_os_error());
            }
        }
    }
    (files, None)
}

#[test]
fn a_full_device_gives_enospc_and_recovers() {
    if !fuse_available() {
        return;
    }
    // Writers flushing the trees themselves (the default), and the
    // engine's flusher thread, which stands aside as space runs low.
    for options in [&[][..], &["flush=background"][..]] {
        fill_delete_and_write_again(options);
    }
}

fn fill_delete_and_write_again(options: &[&str]) {
    let (_s, image, dir) = formatted("enospc", "128M");
    let m = Mount::start(&image, &dir, options);
    let chunk = vec![0xa5u8; 1 << 20];
    let (files, hit) = fill_until_full(&m, &chunk);
    assert_eq!(
        hit,
        Some(libc::ENOSPC),
        "filling the device must end in ENOSPC"
    );
    assert!(files > 5, "only {files} files fit");
    // Still consistent and readable.
    assert_eq!(fs::read(m.path("fill0")).unwrap().len(), 4 << 20);
    // Delete, then write again.
    for i in 0..files / 2 {
        fs::remove_file(m.path(&format!("fill{i}")))
            .unwrap_or_else(|e| panic!("unlink fill{i} on a full device: {e}"));
    }
    let mut wrote = false;
    for _ in 0..50 {
        let r = fs::write(m.path("after"), &chunk);
        if r.is_ok() {
            wrote = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(wrote, "space freed by deletes was not reusable");
    assert_eq!(fs::read(m.path("after")).unwrap(), chunk);
    m.unmount();
    assert_fsck_clean(&image, "after ENOSPC");
}

/// fallocate (mode 0) on a real mount: other files fill the device to
/// ENOSPC, and every byte of the preallocated range can still be written
/// and synced; the image is clean afterwards.
#[test]
fn preallocated_space_is_there_when_the_device_is_full() {
    if !fuse_available() {
        return;
    }
    use std::os::fd::AsRawFd;
    let (_s, image, dir) = formatted("prealloc", "128M");
    let m = Mount::start(&image, &dir, &[]);
    const RANGE: usize = 8 << 20;
    let pre = fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(m.path("pre"))
        .unwrap();
    // SAFETY: a valid descriptor.
    let r = unsafe { libc::fallocate(pre.as_raw_fd(), 0, 0, RANGE as i64) };
    assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
    let chunk = vec![0x5au8; 1 << 20];
    let (_, hit) = fill_until_full(&m, &chunk);
    assert_eq!(hit, Some(libc::ENOSPC), "the other files fill the device");
    use std::os::unix::fs::FileExt;
    for at in (0..RANGE).step_by(chunk.len()) {
        pre.write_all_at(&chunk, at as u64)
            .unwrap_or_else(|e| panic!("writing the preallocated range at {at}: {e}"));
    }
    pre.sync_all().unwrap();
    drop(pre);
    let back = fs::read(m.path("pre")).unwrap();
    assert_eq!(back.len(), RANGE);
    assert!(back.iter().all(|&b| b == 0x5a));
    m.unmount();
    assert_fsck_clean(&image, "after filling around a preallocated file");
}

#[test]
fn unmount_and_mount_give_back_the_same_tree() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new("remount");
    let image = s.0.join("img");
    mkfs(&image, "1G");
    let m = Mount::start(&image, &s.0.join("mnt"), &[]);
    // A real tree: this crate's sources, plus odd files.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(&src)
        .arg(m.path("src"))
        .status()
        .unwrap();
    assert!(status.success());
    fs::write(m.path("sparse"), b"").unwrap();
    let f = OpenOptions::new()
        .write(true)
        .open(m.path("sparse"))
        .unwrap();
    f.set_len(10 << 20).unwrap();
    drop(f);
    let before = tree_digest(&m.dir);
    assert!(before.len() > 20);
    let (img, dir) = (m.image.clone(), m.dir.clone());
    m.unmount();
    let m = Mount::start(&img, &dir, &[]);
    assert_eq!(tree_digest(&m.dir), before);
    m.unmount();
    assert_fsck_clean(&image, "after remount");
}

#[test]
fn sigterm_unmounts_with_a_final_checkpoint() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new("sigterm");
    let image = s.0.join("img");
    mkfs(&image, "256M");
    let m = Mount::start(&image, &s.0.join("mnt"), &[]);
    fs::write(m.path("kept"), b"after SIGTERM").unwrap();
    m.terminate();
    assert_fsck_clean(&image, "after SIGTERM");
    let m = Mount::start(&image, &s.0.join("mnt"), &[]);
    assert_eq!(fs::read(m.path("kept")).unwrap(), b"after SIGTERM");
    // Once failed under load in a full parallel run, with nothing on
    // stdout (cause not found): a second try tells a transient control
    // socket failure from a wrong answer, and the first error is shown.
    let stats = || {
        std::process::Command::new(binary())
            .arg("stats")
            .arg(&m.dir)
            .output()
            .unwrap()
    };
    let mut out = stats();
    if !out.status.success() {
        eprintln!(
            "betreefs stats failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
        out = stats();
    }
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("\"log_replayed_records\":0"),
        "the final checkpoint covered everything: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.unmount();
}

/// A request that panics in the daemon gets EIO, every later one fails
/// too, the mount goes away and the daemon exits non-zero — never a dead
/// mount with a daemon reporting success. Nothing fsync'd is lost: the
/// next mount replays the log.
#[test]
fn a_panicking_request_stops_the_mount_and_loses_nothing_synced() {
    if !common::fuse_available() {
        return;
    }
    let scratch = Scratch::new("panic");
    let image = scratch.0.join("img");
    let dir = scratch.0.join("mnt");
    common::mkfs(&image, "256M");
    let mount = Mount::start_with_env(&image, &dir, &[], &[("BETREEFS_TEST_PANIC_LOOKUP", "boom")]);
    let kept = mount.path("kept");
    {
        let mut f = std::fs::File::create(&kept).unwrap();
        f.write_all(b"synced before the panic").unwrap();
        f.sync_all().unwrap();
    }
    let err = std::fs::metadata(mount.path("boom")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    let status = mount.wait_exit(std::time::Duration::from_secs(30));
    assert!(
        !status.success(),
        "the daemon must not exit 0 after a panic"
    );
    assert!(!common::is_mounted(&dir), "the mount must go away");
    common::assert_fsck_clean(&image, "after a panic");
    let again = Mount::start(&image, &dir, &[]);
    assert_eq!(
        std::fs::read(again.path("kept")).unwrap(),
        b"synced before the panic"
    );
    again.unmount();
}

/// `errors=`: a device that fails under a mount (the daemon's image made
/// to fail every IO while a trigger file exists, a debug-build hook) gets
/// EIO for the request that met it; then `remount-ro` (the default) turns
/// the mount read-only with reads going on, `continue` keeps the mount
/// read-write and serving, `panic` stops it as a crash would. Nothing
/// fsync'd before the fault is lost, and the image is clean afterwards.
#[test]
fn device_faults_do_what_errors_says() {
    if !common::fuse_available() {
        return;
    }
    for policy in ["remount-ro", "continue", "panic"] {
        let (scratch, image, dir) = formatted(&format!("errors-{policy}"), "256M");
        let trigger = scratch.0.join("fault");
        let option = format!("errors={policy}");
        let trigger_var = trigger.to_str().unwrap();
        let mount = Mount::start_with_env(
            &image,
            &dir,
            &[&option],
            &[("BETREEFS_TEST_FAULTY_WHILE", trigger_var)],
        );
        {
            let mut f = std::fs::File::create(mount.path("kept")).unwrap();
            f.write_all(b"synced before the fault").unwrap();
            f.sync_all().unwrap();
        }
        std::fs::write(&trigger, b"").unwrap();
        let mut f = std::fs::File::create(mount.path("lost")).unwrap();
        f.write_all(b"never durable").unwrap();
        let err = f.sync_all().unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{policy}: {err}");
        drop(f);
        let listed = || -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        let status = match policy {
            "remount-ro" => {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
                while !common::mount_options(&dir).iter().any(|o| o == "ro") {
                    assert!(std::time::Instant::now() < deadline, "never remounted ro");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let err = std::fs::File::create(mount.path("new")).unwrap_err();
                assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
                assert_eq!(listed(), ["kept", "lost"], "reads go on");
                common::umount(&dir);
                mount.wait_exit(std::time::Duration::from_secs(30))
            }
            "continue" => {
                std::fs::remove_file(&trigger).unwrap();
                assert!(common::mount_options(&dir).iter().any(|o| o == "rw"));
                assert_eq!(listed(), ["kept", "lost"], "still serving");
                assert_eq!(
                    std::fs::read(mount.path("kept")).unwrap(),
                    b"synced before the fault"
                );
                // The failed log write left the store refusing writes.
                let err = std::fs::create_dir(mount.path("new")).unwrap_err();
                assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
                common::umount(&dir);
                mount.wait_exit(std::time::Duration::from_secs(30))
            }
            _ => {
                let status = mount.wait_exit(std::time::Duration::from_secs(30));
                assert!(!common::is_mounted(&dir), "the mount must go away");
                status
            }
        };
        // The log could not be flushed, so the daemon says so.
        assert!(!status.success(), "{policy}: exited {status}");
        let _ = std::fs::remove_file(&trigger);
        common::assert_fsck_clean(&image, &format!("after errors={policy}"));
        let again = Mount::start(&image, &dir, &[]);
        assert_eq!(
            std::fs::read(again.path("kept")).unwrap(),
            b"synced before the fault",
            "{policy}"
        );
        again.unmount_fsck_clean(&format!("remounted after errors={policy}"));
    }
}
