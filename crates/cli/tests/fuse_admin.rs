//! Operating betreefs as an administrator does: unmounting means done,
//! fsck reads without writing and follows fsck(8)'s exit codes, a
//! read-only mount writes nothing.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

fn betreefs(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(binary())
        .args(args)
        .output()
        .expect("run betreefs")
}

fn fsck_code(image: &Path, extra: &[&str]) -> (i32, String) {
    let mut cmd = Command::new(binary());
    cmd.arg("fsck").args(extra).arg(image);
    let out = cmd.output().expect("run fsck");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// A CRC of the whole image file.
fn image_crc(image: &Path) -> u32 {
    crc32c::crc32c(&fs::read(image).expect("read image"))
}

fn mount_bg(image: &Path, dir: &Path, options: &[&str]) {
    let mut args = vec!["mount".as_ref(), image.as_os_str(), dir.as_os_str()];
    for o in options {
        args.push("-o".as_ref());
        args.push(o.as_ref());
    }
    assert_succeeded(&betreefs(&args));
}

/// The installed umount helper in a scratch directory.
fn umount_helper(scratch: &Path) -> PathBuf {
    let dir = scratch.join("sbin");
    fs::create_dir_all(&dir).unwrap();
    assert_succeeded(&betreefs(&[
        "install-helper".as_ref(),
        "--dir".as_ref(),
        dir.as_os_str(),
    ]));
    dir.join("umount.fuse.betreefs")
}

/// The issue's loop: mount, write, unmount, at once fsck, at once mount
/// again — twenty times, with every way of unmounting.
#[test]
fn unmount_means_done() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new("umount");
    let image = s.0.join("img");
    let dir = s.0.join("mnt");
    fs::create_dir(&dir).unwrap();
    mkfs(&image, "256M");
    let helper = umount_helper(&s.0);
    for round in 0..20u32 {
        mount_bg(&image, &dir, &[]);
        let name = format!("f{round}");
        let mut f = fs::File::create(dir.join(&name)).unwrap();
        f.write_all(&vec![round as u8; 100_000]).unwrap();
        drop(f);
        // A mounted image is refused by fsck at once, naming the mount.
        if round == 0 {
            let (code, text) = fsck_code(&image, &[]);
            assert_eq!(code, 8, "{text}");
            assert!(text.contains("is mounted on"), "{text}");
        }
        match round % 3 {
            // umount(8) without the helper returns before the daemon is
            // done: fsck and mount wait for it.
            0 => umount(&dir),
            1 => assert_succeeded(&betreefs(&["umount".as_ref(), dir.as_os_str()])),
            _ => assert_succeeded(&Command::new(&helper).arg(&dir).output().unwrap()),
        }
        let (code, text) = fsck_code(&image, &[]);
        assert_eq!(code, 0, "round {round}: {text}");
    }
    mount_bg(&image, &dir, &[]);
    for round in 0..20u32 {
        assert_eq!(
            fs::read(dir.join(format!("f{round}"))).unwrap(),
            vec![round as u8; 100_000]
        );
    }
    assert_succeeded(&betreefs(&["umount".as_ref(), dir.as_os_str()]));
    // Once `betreefs umount` returned, the image is free at once.
    let err = betreefs(&["umount".as_ref(), dir.as_os_str()]);
    assert!(!err.status.success(), "not mounted any more");
}

/// fsck changes no byte of the image, even with a log to replay (after
/// kill -9), and checks an image on read-only media.
#[test]
fn fsck_writes_nothing() {
    if !fuse_available() {
        return;
    }
    let (_s, image, dir) = formatted("fsck-ro", "256M");
    let mount = Mount::start(&image, &dir, &[]);
    for i in 0..50 {
        let mut f = fs::File::create(mount.path(&format!("f{i}"))).unwrap();
        f.write_all(&[i as u8; 5000]).unwrap();
        f.sync_all().unwrap();
    }
    mount.kill();
    detach(&dir);
    let before = image_crc(&image);
    let (code, text) = fsck_code(&image, &[]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("log records replayed in memory"), "{text}");
    assert_eq!(image_crc(&image), before, "fsck wrote to the image");
    // On a read-only loop device: checkable all the same.
    let out = Command::new("losetup")
        .args(["-f", "--show", "-r"])
        .arg(&image)
        .output()
        .unwrap();
    if out.status.success() {
        let loopdev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let (code, text) = fsck_code(Path::new(&loopdev), &[]);
        let _ = Command::new("losetup").args(["-d", &loopdev]).status();
        assert_eq!(code, 0, "{text}");
    } else {
        eprintln!("no loop device: the read-only device case is skipped");
    }
    assert_eq!(image_crc(&image), before);
    // The next mount replays the log for good; the files are all there.
    let mount = Mount::start(&image, &dir, &[]);
    assert_eq!(fs::read(mount.path("f49")).unwrap(), vec![49u8; 5000]);
    mount.unmount();
}

/// Exit codes as fsck(8) defines them, and a repair that fixes a damaged
/// superblock copy.
#[test]
fn fsck_exit_codes_and_repair() {
    if !fuse_available() {
        return;
    }
    let (s, image, dir) = formatted("fsck-codes", "256M");
    let mount = Mount::start(&image, &dir, &[]);
    fs::write(mount.path("kept"), b"kept").unwrap();
    mount.unmount();
    assert_eq!(fsck_code(&image, &[]).0, 0);
    assert_eq!(fsck_code(&s.0.join("missing"), &[]).0, 8);
    assert_eq!(fsck_code(&image, &["--no-such-flag"]).0, 16);
    let foreign = s.0.join("foreign");
    fs::write(&foreign, vec![0x5au8; 8 << 20]).unwrap();
    assert_eq!(fsck_code(&foreign, &[]).0, 8, "not a betreefs image");

    // One superblock copy damaged: found, left alone without --repair,
    // repaired with it.
    let mut bytes = fs::read(&image).unwrap();
    bytes[4096 + 40] ^= 0x01;
    fs::write(&image, &bytes).unwrap();
    let (code, text) = fsck_code(&image, &[]);
    assert_eq!(code, 4, "{text}");
    assert!(text.contains("superblock copy B"), "{text}");
    assert!(text.contains("--repair"), "{text}");
    let (code, text) = fsck_code(&image, &["-n"]);
    assert_eq!(code, 4, "{text}");
    let (code, text) = fsck_code(&image, &["--repair"]);
    assert_eq!(code, 1, "{text}");
    let (code, text) = fsck_code(&image, &[]);
    assert_eq!(code, 0, "{text}");
    // fsck -t fuse.betreefs runs the helper with fsck(8)'s flags.
    let sbin = s.0.join("sbin");
    fs::create_dir(&sbin).unwrap();
    assert_succeeded(&betreefs(&[
        "install-helper".as_ref(),
        "--dir".as_ref(),
        sbin.as_os_str(),
    ]));
    let out = Command::new(sbin.join("fsck.fuse.betreefs"))
        .arg("-a")
        .arg(&image)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let mount = Mount::start(&image, &dir, &[]);
    assert_eq!(fs::read(mount.path("kept")).unwrap(), b"kept");
    mount.unmount();
}

/// `-o ro` replays a crashed image's log in memory and writes nothing.
#[test]
fn a_read_only_mount_writes_nothing() {
    if !fuse_available() {
        return;
    }
    let (_s, image, dir) = formatted("ro", "256M");
    let mount = Mount::start(&image, &dir, &[]);
    let mut f = fs::File::create(mount.path("synced")).unwrap();
    f.write_all(b"in the log only").unwrap();
    f.sync_all().unwrap();
    drop(f);
    mount.kill();
    detach(&dir);
    let before = image_crc(&image);
    let mount = Mount::start(&image, &dir, &["ro"]);
    assert_eq!(fs::read(mount.path("synced")).unwrap(), b"in the log only");
    assert_eq!(
        err_of(fs::write(mount.path("new"), b"x")),
        libc::EROFS,
        "writes are refused"
    );
    mount.unmount();
    assert_eq!(image_crc(&image), before, "a read-only mount wrote");
    assert_fsck_clean(&image, "after the read-only mount");
}

/// A mount reads the trees' upper levels first (`-o warm=`, a sixteenth
/// of the budget by default): one cold 4 KiB read of a file right after
/// mounting reads its basement's chunk directory and chunk, not the
/// interior nodes and leaves above them. `warm=0` reads none at mount.
#[test]
fn a_mount_warms_the_upper_levels() {
    if !fuse_available() {
        return;
    }
    let (_s, image, dir) = formatted("warm", "1G");
    let mount = Mount::start(&image, &dir, &[]);
    let block: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut f = fs::File::create(mount.path("big")).unwrap();
    for i in 0..(48u32 << 8) {
        let mut b = block.clone();
        b[..4].copy_from_slice(&i.to_le_bytes());
        f.write_all(&b).unwrap();
    }
    drop(f);
    fs::create_dir(mount.path("small")).unwrap();
    for i in 0..300 {
        fs::write(mount.path(&format!("small/f{i}")), [i as u8; 900]).unwrap();
    }
    mount.unmount();

    let mount = Mount::start(&image, &dir, &[]);
    assert!(engine_counter(&dir, "nodes_warmed") >= 2);
    let warmed = engine_counter(&dir, "warm_bytes_read");
    assert!(warmed > 0 && warmed <= (16 << 20) + (64 << 10), "{warmed}");
    let before = engine_counter(&dir, "device_bytes_read");
    let f = fs::File::open(mount.path("big")).unwrap();
    let mut buf = vec![0u8; 4096];
    use std::os::unix::fs::FileExt;
    f.read_exact_at(&mut buf, 5000 * 4096).unwrap();
    assert_eq!(&buf[..4], &5000u32.to_le_bytes());
    assert_eq!(&buf[4..], &block[4..]);
    let read = engine_counter(&dir, "device_bytes_read") - before;
    // The chunk directory and the chunk (the file's metadata was read
    // at mount with the warmed leaves, or costs one more block).
    assert!(read <= 3 * 4096, "a cold 4 KiB read read {read} bytes");
    drop(f);
    mount.unmount();

    let mount = Mount::start(&image, &dir, &["warm=0"]);
    assert_eq!(engine_counter(&dir, "nodes_warmed"), 0);
    assert_eq!(
        fs::read(mount.path("small/f7")).unwrap(),
        vec![7u8; 900],
        "answers as before"
    );
    mount.unmount();
    assert_fsck_clean(&image, "after the warm mounts");
}

/// The session and process group of a process, from /proc/PID/stat
/// (fields 5 and 6; the name in field 2 may hold spaces, so counted from
/// its closing parenthesis).
fn process_group_and_session(pid: u32) -> (i32, i32) {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    (fields[2].parse().unwrap(), fields[3].parse().unwrap())
}

/// The daemon `betreefs mount` forks stays in the caller's session (with
/// autogroup scheduling a session is a scheduling group, and a client
/// in another one is woken on the other CPU at every reply) but leads a
/// process group of its own, so the signals a shell or a terminal sends
/// to the caller's group do not unmount it.
#[test]
fn the_daemon_keeps_the_session_and_leaves_the_process_group() {
    if !fuse_available() {
        return;
    }
    let (_s, image, dir) = formatted("session", "256M");
    fs::create_dir(&dir).unwrap();
    mount_bg(&image, &dir, &[]);
    let image_arg = image.to_str().unwrap().to_owned();
    let daemon = fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            args.contains(&image_arg.as_bytes()) && args.contains(&b"--notify-fd".as_slice())
        })
        .expect("the daemon of this mount");
    let (group, session) = process_group_and_session(daemon);
    let (own_group, own_session) = process_group_and_session(std::process::id());
    assert_eq!(
        session, own_session,
        "the daemon keeps the mounter's session"
    );
    assert_eq!(
        group, daemon as i32,
        "the daemon leads its own process group"
    );
    assert_ne!(group, own_group);
    assert_succeeded(&betreefs(&["umount".as_ref(), dir.as_os_str()]));
    assert_fsck_clean(&image, "after the daemonized mount");
}

/// Images are created 0600, and one that other users can read is not
/// mounted with allow_other (they would read every file from it).
#[test]
fn images_are_private() {
    if !fuse_available() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let s = Scratch::new("private");
    let image = s.0.join("img");
    let dir = s.0.join("mnt");
    fs::create_dir(&dir).unwrap();
    mkfs(&image, "256M");
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&image), 0o600);
    // The default image `mount` creates.
    let created = s.0.join("created");
    mount_bg(&created, &dir, &[]);
    assert_eq!(mode(&created), 0o600);
    assert_succeeded(&betreefs(&["umount".as_ref(), dir.as_os_str()]));
    fs::set_permissions(&image, fs::Permissions::from_mode(0o644)).unwrap();
    let out = betreefs(&["mount".as_ref(), image.as_os_str(), dir.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("chmod 600"), "{err}");
    assert!(!is_mounted(&dir));
    fs::set_permissions(&image, fs::Permissions::from_mode(0o600)).unwrap();
    mount_bg(&image, &dir, &[]);
    assert_succeeded(&betreefs(&["umount".as_ref(), dir.as_os_str()]));
}

/// A loop device attached for a test, detached on drop.
struct LoopDevice(String);

impl LoopDevice {
    fn attach(file: &Path) -> Option<LoopDevice> {
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(file)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| LoopDevice(String::from_utf8_lossy(&out.stdout).trim().to_string()))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// mkfs formats a whole block device unless --size says otherwise, and
/// refuses (without --force) one that holds a file system, naming it.
#[test]
fn mkfs_on_block_devices() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new("mkfs-dev");
    let backing = s.0.join("backing");
    fs::File::create(&backing)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let Some(dev) = LoopDevice::attach(&backing) else {
        eprintln!("no loop device: skipped");
        return;
    };
    let devpath = Path::new(&dev.0);
    let mkfs_dev = |extra: &[&str]| {
        let mut cmd = Command::new(binary());
        cmd.arg("mkfs").args(extra).arg(devpath);
        cmd.output().unwrap()
    };
    // Another file system on it: named, and kept without --force.
    if Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(devpath)
        .status()
        .is_ok_and(|s| s.success())
    {
        let out = mkfs_dev(&[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("ext4"), "{err}");
    }
    let out = mkfs_dev(&["--force"]);
    assert_succeeded(&out);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1024 MiB"),
        "the whole device: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Now a betreefs: refused again without --force.
    let out = mkfs_dev(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("betreefs"), "{err}");
    assert_succeeded(&mkfs_dev(&["--force", "--size", "512M"]));
    let out = mkfs_dev(&["--force", "--size", "2G"]);
    assert!(!out.status.success(), "larger than the device");
    // It mounts, and holds 512 MiB.
    let dir = s.0.join("mnt");
    let mount = Mount::start(devpath, &dir, &[]);
    fs::write(mount.path("f"), b"on a device").unwrap();
    let total = {
        let c = cstr(&dir);
        // SAFETY: valid path; st is written by statvfs.
        unsafe {
            let mut st: libc::statvfs = std::mem::zeroed();
            assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0);
            st.f_blocks * st.f_frsize
        }
    };
    assert!(
        total > 400 << 20 && total <= 512 << 20,
        "{total} bytes in a 512 MiB file system"
    );
    mount.unmount();
    // An existing image file: named too.
    let image = s.0.join("img");
    mkfs(&image, "128M");
    let out = betreefs(&["mkfs".as_ref(), image.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("betreefs"), "{err}");
}
