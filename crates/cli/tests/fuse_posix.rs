//! A mounted betreefs used like an application would: std::fs and libc
//! calls, checking results and errno values.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use common::*;

fn mounted(tag: &str, options: &[&str]) -> (Scratch, Mount) {
    let s = Scratch::new(tag);
    let image = s.0.join("img");
    mkfs(&image, "1G");
    let m = Mount::start(&image, &s.0.join("mnt"), options);
    (s, m)
}

#[test]
fn files_read_write_truncate_and_open_flags() {
    if !fuse_available() {
        return;
    }
    for transport in transports() {
        files_read_write_truncate_and_open_flags_through(transport);
    }
}

fn files_read_write_truncate_and_open_flags_through(transport: &str) {
    let (_s, m) = mounted("files", &[transport]);
    let p = m.path("f");
    fs::write(&p, b"hello world").unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"hello world");
    // O_EXCL on an existing file.
    let r = OpenOptions::new().write(true).create_new(true).open(&p);
    assert_eq!(err_of(r), libc::EEXIST);
    // O_APPEND writes at the end whatever the offset.
    let mut f = OpenOptions::new().append(true).open(&p).unwrap();
    f.write_all(b"!").unwrap();
    drop(f);
    assert_eq!(fs::read(&p).unwrap(), b"hello world!");
    // O_TRUNC empties.
    File::create(&p).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 0);
    // Sparse writes: holes read as zeros, a write straddling blocks.
    let mut f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    f.seek(SeekFrom::Start(1 << 20)).unwrap();
    f.write_all(b"tail").unwrap();
    f.seek(SeekFrom::Start(4090)).unwrap();
    f.write_all(&[7u8; 20]).unwrap();
    let mut all = Vec::new();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.read_to_end(&mut all).unwrap();
    assert_eq!(all.len(), (1 << 20) + 4);
    assert!(all[..4090].iter().all(|&b| b == 0));
    assert_eq!(&all[4090..4110], &[7u8; 20]);
    assert!(all[4110..1 << 20].iter().all(|&b| b == 0));
    // Truncate down then up: no stale bytes come back.
    f.set_len(4095).unwrap();
    f.set_len(8192).unwrap();
    let data = fs::read(&p).unwrap();
    assert_eq!(data.len(), 8192);
    assert_eq!(&data[4090..4095], &[7u8; 5]);
    assert!(data[4095..].iter().all(|&b| b == 0));
    f.sync_all().unwrap();
    drop(f);
    // A large write in one call and reading it back at odd offsets.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    fs::write(m.path("big"), &big).unwrap();
    let mut f = File::open(m.path("big")).unwrap();
    let mut buf = vec![0u8; 100_000];
    f.seek(SeekFrom::Start(1_234_567)).unwrap();
    f.read_exact(&mut buf).unwrap();
    assert_eq!(&buf[..], &big[1_234_567..1_334_567]);
    drop(f);
    // An unlinked file stays readable while open.
    let mut f = File::open(m.path("big")).unwrap();
    fs::remove_file(m.path("big")).unwrap();
    assert_eq!(err_of(fs::metadata(m.path("big"))), libc::ENOENT);
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    assert_eq!(back.len(), big.len());
    drop(f);
    // fallocate mode 0 extends; other modes are refused.
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(m.path("alloc"))
        .unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a valid open descriptor.
    assert_eq!(unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, 100_000) }, 0);
    assert_eq!(fs::metadata(m.path("alloc")).unwrap().len(), 100_000);
    // SAFETY: as above (the modes are semantics.rs's subject).
    let r = unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_COLLAPSE_RANGE, 0, 4096) };
    assert!(r != 0 && errno() == libc::EOPNOTSUPP);
    drop(f);
    m.unmount();
}

#[test]
fn directories_names_links_and_renames() {
    if !fuse_available() {
        return;
    }
    for transport in transports() {
        directories_names_links_and_renames_through(transport);
    }
}

fn directories_names_links_and_renames_through(transport: &str) {
    let (_s, m) = mounted("dirs", &[transport]);
    fs::create_dir_all(m.path("a/b/c")).unwrap();
    fs::write(m.path("a/b/c/file"), b"deep").unwrap();
    assert_eq!(err_of(fs::remove_dir(m.path("a/b"))), libc::ENOTEMPTY);
    assert_eq!(err_of(fs::create_dir(m.path("a"))), libc::EEXIST);
    assert_eq!(fs::metadata(m.path("a")).unwrap().nlink(), 3);
    // Rename a non-empty directory, then into its own subtree (EINVAL).
    fs::rename(m.path("a/b"), m.path("moved")).unwrap();
    assert_eq!(fs::read(m.path("moved/c/file")).unwrap(), b"deep");
    assert_eq!(fs::metadata(m.path("a")).unwrap().nlink(), 2);
    assert_eq!(
        err_of(fs::rename(m.path("moved"), m.path("moved/c/x"))),
        libc::EINVAL
    );
    // Over an existing file, over an empty directory, not over a non-empty one.
    fs::write(m.path("x"), b"x").unwrap();
    fs::write(m.path("y"), b"y").unwrap();
    fs::rename(m.path("x"), m.path("y")).unwrap();
    assert_eq!(fs::read(m.path("y")).unwrap(), b"x");
    fs::create_dir(m.path("empty")).unwrap();
    fs::rename(m.path("moved"), m.path("empty")).unwrap();
    assert!(m.path("empty/c/file").exists());
    fs::create_dir(m.path("full")).unwrap();
    fs::write(m.path("full/f"), b"").unwrap();
    fs::create_dir(m.path("d2")).unwrap();
    assert_eq!(
        err_of(fs::rename(m.path("d2"), m.path("full"))),
        libc::ENOTEMPTY
    );
    assert_eq!(err_of(fs::rename(m.path("d2"), m.path("y"))), libc::ENOTDIR);
    assert_eq!(err_of(fs::rename(m.path("y"), m.path("d2"))), libc::EISDIR);
    // RENAME_NOREPLACE and RENAME_EXCHANGE.
    assert_eq!(
        renameat2(&m.path("y"), &m.path("full/f"), libc::RENAME_NOREPLACE),
        libc::EEXIST
    );
    assert_eq!(
        renameat2(&m.path("y"), &m.path("nothere"), libc::RENAME_EXCHANGE),
        libc::ENOENT
    );
    assert_eq!(
        renameat2(&m.path("y"), &m.path("empty"), libc::RENAME_EXCHANGE),
        0
    );
    assert!(m.path("y/c/file").exists());
    assert_eq!(fs::read(m.path("empty")).unwrap(), b"x");
    // Hard links: shared data, link counts.
    fs::hard_link(m.path("empty"), m.path("hl")).unwrap();
    assert_eq!(fs::metadata(m.path("hl")).unwrap().nlink(), 2);
    fs::write(m.path("hl"), b"through the link").unwrap();
    assert_eq!(fs::read(m.path("empty")).unwrap(), b"through the link");
    assert_eq!(
        fs::metadata(m.path("empty")).unwrap().ino(),
        fs::metadata(m.path("hl")).unwrap().ino()
    );
    fs::remove_file(m.path("empty")).unwrap();
    assert_eq!(fs::metadata(m.path("hl")).unwrap().nlink(), 1);
    assert_eq!(
        err_of(fs::hard_link(m.path("y"), m.path("dirlink"))),
        libc::EPERM
    );
    // Symlinks.
    std::os::unix::fs::symlink("y/c/file", m.path("sl")).unwrap();
    assert_eq!(
        fs::read_link(m.path("sl")).unwrap().to_str(),
        Some("y/c/file")
    );
    assert_eq!(fs::read(m.path("sl")).unwrap(), b"deep");
    // FIFOs and sockets.
    let fifo = cstr(&m.path("fifo"));
    // SAFETY: valid path.
    assert_eq!(
        unsafe { libc::mknod(fifo.as_ptr(), libc::S_IFIFO | 0o644, 0) },
        0
    );
    assert!(fs::metadata(m.path("fifo")).unwrap().file_type().is_fifo());
    let sock = std::os::unix::net::UnixListener::bind(m.path("sock")).unwrap();
    assert!(fs::metadata(m.path("sock"))
        .unwrap()
        .file_type()
        .is_socket());
    drop(sock);
    // Names: 255 bytes, odd bytes; 256 bytes is too long.
    let long = "n".repeat(255);
    fs::write(m.path(&long), b"l").unwrap();
    assert_eq!(
        err_of(fs::write(m.path(&"n".repeat(256)), b"")),
        libc::ENAMETOOLONG
    );
    use std::os::unix::ffi::OsStrExt;
    let odd = std::ffi::OsStr::from_bytes(b"\x01\x02\x03\xff odd");
    fs::write(m.dir.join(odd), b"o").unwrap();
    let listed: Vec<_> = fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(listed.iter().any(|n| n == odd) && listed.iter().any(|n| n.len() == 255));
    // inode numbers survive rename and remount.
    let ino = fs::metadata(m.path("y/c/file")).unwrap().ino();
    fs::rename(m.path("y"), m.path("z")).unwrap();
    assert_eq!(fs::metadata(m.path("z/c/file")).unwrap().ino(), ino);
    let m = m.remount(&[]);
    assert_eq!(fs::metadata(m.path("z/c/file")).unwrap().ino(), ino);
    assert_eq!(fs::metadata(m.path("hl")).unwrap().nlink(), 1);
    m.unmount_fsck_clean("after renames and links");
}

#[test]
fn readdir_while_the_directory_changes() {
    if !fuse_available() {
        return;
    }
    for transport in transports() {
        readdir_while_the_directory_changes_through(transport);
    }
}

fn readdir_while_the_directory_changes_through(transport: &str) {
    let (_s, m) = mounted("readdir", &[transport]);
    for i in 0..2000 {
        File::create(m.path(&format!("f{i:05}"))).unwrap();
    }
    // Delete every other entry while reading: every surviving entry that
    // existed throughout is seen exactly once.
    let dir = cstr(&m.dir);
    // SAFETY: valid path; the stream is closed below.
    let d = unsafe { libc::opendir(dir.as_ptr()) };
    assert!(!d.is_null());
    let mut seen = std::collections::HashMap::new();
    let mut n = 0;
    loop {
        // SAFETY: d is an open stream.
        let e = unsafe { libc::readdir(d) };
        if e.is_null() {
            break;
        }
        // SAFETY: d_name is NUL-terminated within the entry.
        let name = unsafe { std::ffi::CStr::from_ptr((*e).d_name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        *seen.entry(name.clone()).or_insert(0) += 1;
        n += 1;
        if n % 100 == 0 {
            for j in (0..2000).step_by(2).skip(n / 100 * 50).take(50) {
                let _ = fs::remove_file(m.path(&format!("f{j:05}")));
            }
        }
    }
    // SAFETY: d is open.
    unsafe { libc::closedir(d) };
    assert!(
        seen.values().all(|&c| c == 1),
        "an entry was returned twice"
    );
    for i in (1..2000).step_by(2) {
        assert_eq!(seen.get(&format!("f{i:05}")), Some(&1), "f{i:05} missing");
    }
    m.unmount();
}

#[test]
fn attributes_permissions_xattrs_and_statfs() {
    if !fuse_available() {
        return;
    }
    for transport in transports() {
        attributes_permissions_xattrs_and_statfs_through(transport);
    }
}

fn attributes_permissions_xattrs_and_statfs_through(transport: &str) {
    let (_s, m) = mounted("attrs", &["noatime", transport]);
    let p = m.path("f");
    fs::write(&p, b"data").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, 0o640);
    std::os::unix::fs::chown(&p, Some(1234), Some(5678)).unwrap();
    let md = fs::metadata(&p).unwrap();
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    // utimensat: set mtime, UTIME_OMIT atime; then UTIME_NOW.
    let c = cstr(&p);
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: 1_000_000_000,
            tv_nsec: 123,
        },
    ];
    let atime_before = fs::metadata(&p).unwrap().atime();
    // SAFETY: valid path and two timespecs.
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) },
        0
    );
    let md = fs::metadata(&p).unwrap();
    assert_eq!(
        (md.mtime(), md.mtime_nsec(), md.atime()),
        (1_000_000_000, 123, atime_before)
    );
    let now = [libc::timespec {
        tv_sec: 0,
        tv_nsec: libc::UTIME_NOW,
    }; 2];
    // SAFETY: as above.
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), now.as_ptr(), 0) },
        0
    );
    assert!(fs::metadata(&p).unwrap().mtime() > 1_000_000_000);
    // noatime: reading does not change atime.
    let a0 = fs::metadata(&p).unwrap().atime_nsec();
    std::thread::sleep(std::time::Duration::from_millis(20));
    fs::read(&p).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().atime_nsec(), a0);
    // Permission checks by the kernel for another user.
    fs::write(m.path("private"), b"secret").unwrap();
    fs::set_permissions(m.path("private"), fs::Permissions::from_mode(0o600)).unwrap();
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=1000", "--regid=1000", "--clear-groups", "cat"])
        .arg(m.path("private"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "another user read a 0600 file");
    // New files belong to the caller; setgid directories pass on their group.
    fs::create_dir(m.path("shared")).unwrap();
    std::os::unix::fs::chown(m.path("shared"), None, Some(4242)).unwrap();
    fs::set_permissions(m.path("shared"), fs::Permissions::from_mode(0o2777)).unwrap();
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=1000", "--regid=1000", "--clear-groups", "sh", "-c"])
        .arg(format!(
            "touch {0}/file && mkdir {0}/sub",
            m.path("shared").display()
        ))
        .output()
        .unwrap();
    assert_succeeded(&out);
    let f = fs::metadata(m.path("shared/file")).unwrap();
    assert_eq!((f.uid(), f.gid()), (1000, 4242));
    let sub = fs::metadata(m.path("shared/sub")).unwrap();
    assert_eq!((sub.gid(), sub.mode() & 0o2000), (4242, 0o2000));
    // Extended attributes.
    assert_eq!(set_xattr(&p, "user.k", b"v1", libc::XATTR_CREATE), Ok(()));
    assert_eq!(
        set_xattr(&p, "user.k", b"v2", libc::XATTR_CREATE),
        Err(libc::EEXIST)
    );
    assert_eq!(
        set_xattr(&p, "user.none", b"v", libc::XATTR_REPLACE),
        Err(libc::ENODATA)
    );
    assert_eq!(get_xattr(&p, "user.k", 16), Ok(b"v1".to_vec()));
    assert_eq!(get_xattr(&p, "user.k", 1), Err(libc::ERANGE));
    assert_eq!(list_xattr(&p), Ok(b"user.k\0".to_vec()));
    assert_eq!(remove_xattr(&p, "user.k"), Ok(()));
    assert_eq!(get_xattr(&p, "user.k", 16), Err(libc::ENODATA));
    // statfs reports the store's real figures.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let d = cstr(&m.dir);
    // SAFETY: valid path and output struct.
    assert_eq!(unsafe { libc::statvfs(d.as_ptr(), &mut st) }, 0);
    assert_eq!(st.f_bsize, 4096);
    assert!(st.f_blocks > 200_000 && st.f_bfree < st.f_blocks && st.f_namemax == 255);
    // stats answers with JSON.
    let out = std::process::Command::new(binary())
        .arg("stats")
        .arg(&m.dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("\"write_amplification\""),
        "{text}"
    );
    m.unmount();
}

#[test]
fn relatime_updates_atime_once_after_a_write() {
    if !fuse_available() {
        return;
    }
    for transport in transports() {
        relatime_updates_atime_once_after_a_write_through(transport);
    }
}

fn relatime_updates_atime_once_after_a_write_through(transport: &str) {
    let (_s, m) = mounted("atime", &[transport]);
    let p = m.path("f");
    fs::write(&p, b"x").unwrap();
    let c = cstr(&p);
    let old = [
        libc::timespec {
            tv_sec: 1000,
            tv_nsec: 0,
        },
        libc::timespec {
            tv_sec: 2000,
            tv_nsec: 0,
        },
    ];
    // SAFETY: valid path and times.
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), old.as_ptr(), 0) },
        0
    );
    fs::read(&p).unwrap();
    let a1 = fs::metadata(&p).unwrap().atime();
    assert!(a1 > 2000, "relatime updates an atime older than mtime");
    fs::read(&p).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().atime(), a1);
    m.unmount();
}

#[test]
fn cli_usage_errors_background_mount_and_helper() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new("cli");
    let run = |args: &[&std::ffi::OsStr]| {
        std::process::Command::new(binary())
            .args(args)
            .output()
            .unwrap()
    };
    let img = s.0.join("img");
    let mnt = s.0.join("mnt");
    fs::create_dir(&mnt).unwrap();
    // The first command of the README: mount creates a default image.
    let out = run(&["mount".as_ref(), img.as_os_str(), mnt.as_os_str()]);
    assert_succeeded(&out);
    assert!(is_mounted(&mnt));
    let mounts = fs::read_to_string("/proc/mounts").unwrap();
    let line = mounts
        .lines()
        .find(|l| l.split(' ').nth(1) == mnt.to_str())
        .unwrap_or_default();
    assert_eq!(line.split(' ').nth(2), Some("fuse.betreefs"), "{line}");
    fs::write(mnt.join("f"), b"bg").unwrap();
    // Already mounted: refused with one line.
    let other = s.0.join("mnt2");
    fs::create_dir(&other).unwrap();
    let out = run(&["mount".as_ref(), img.as_os_str(), other.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.lines().count() == 1 && !err.contains("panick"),
        "{err}"
    );
    umount(&mnt);
    // Wait for the daemon to let go of the image.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !fsck(&img).0 {
        assert!(std::time::Instant::now() < deadline, "{}", fsck(&img).1);
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Bad usage.
    let file = s.0.join("plain");
    fs::write(&file, b"").unwrap();
    for (args, what) in [
        (vec![img.as_os_str(), file.as_os_str()], "not a directory"),
        (
            vec![
                img.as_os_str(),
                s.0.join("nodir").into_os_string().leak() as &std::ffi::OsStr,
            ],
            "mountpoint",
        ),
    ] {
        let mut full = vec![std::ffi::OsStr::new("mount")];
        full.extend(args);
        let out = run(&full);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(what) && err.lines().count() == 1,
            "{err}"
        );
    }
    let foreign = s.0.join("foreign");
    fs::write(&foreign, vec![0x5au8; 8 << 20]).unwrap();
    let out = run(&["mount".as_ref(), foreign.as_os_str(), mnt.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.lines().count() == 1 && !err.contains("panick"),
        "{err}"
    );
    let out = run(&["fsck".as_ref(), foreign.as_os_str()]);
    assert!(!out.status.success());
    // mount -t fuse.betreefs through the helper.
    let helper_dir = s.0.join("sbin");
    fs::create_dir(&helper_dir).unwrap();
    let out = run(&[
        "install-helper".as_ref(),
        "--dir".as_ref(),
        helper_dir.as_os_str(),
    ]);
    assert!(out.status.success());
    let helper = helper_dir.join("mount.fuse.betreefs");
    let out = std::process::Command::new(&helper)
        .arg(&img)
        .arg(&mnt)
        .args(["-o", "rw,noatime"])
        .output()
        .unwrap();
    assert_succeeded(&out);
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"bg");
    // As root, like mount -t ext4: set-ID bits and device nodes work unless
    // nosuid/nodev are asked for (mount(8) leaves these defaults to the
    // helper).
    let opts = mount_options(&mnt);
    assert!(
        !opts.iter().any(|o| o == "nosuid" || o == "nodev"),
        "{opts:?}"
    );
    let null = mnt.join("null");
    let c = cstr(&null);
    // SAFETY: valid path; makedev(1, 3) is /dev/null's number.
    assert_eq!(
        unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) },
        0
    );
    fs::write(&null, b"into the device").expect("a device node opens on a dev mount");
    fs::remove_file(&null).unwrap();
    if Path::new("/sbin/mount.fuse.betreefs").exists()
        || fs::symlink_metadata("/sbin/mount.fuse.betreefs").is_err()
    {
        // mount(8) itself, when the helper is (or can be) installed system-wide.
        umount(&mnt);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let installed = run(&["install-helper".as_ref()]);
        if installed.status.success() {
            let status = mount_retrying(&[
                "-t".as_ref(),
                "fuse.betreefs".as_ref(),
                img.as_os_str(),
                mnt.as_os_str(),
            ]);
            assert!(status, "mount -t fuse.betreefs failed");
            assert_eq!(fs::read(mnt.join("f")).unwrap(), b"bg");
            // mount(8)'s remount goes through the helper too.
            let remount = |opts: &str| {
                std::process::Command::new("mount")
                    .args(["-o", opts])
                    .arg(&mnt)
                    .output()
                    .unwrap()
            };
            assert_succeeded(&remount("remount,ro"));
            assert!(mount_options(&mnt).iter().any(|o| o == "ro"));
            assert_eq!(err_of(fs::write(mnt.join("probe"), b"x")), libc::EROFS);
            assert_succeeded(&remount("remount,rw"));
            fs::write(mnt.join("probe"), b"x").unwrap();
            fs::remove_file(mnt.join("probe")).unwrap();
            // An fstab line (an alternative fstab file, as mount -T reads it).
            umount(&mnt);
            let fstab = s.0.join("fstab");
            fs::write(
                &fstab,
                format!(
                    "{} {} fuse.betreefs defaults,noatime,nosuid,nodev 0 0\n",
                    img.display(),
                    mnt.display()
                ),
            )
            .unwrap();
            let status = mount_retrying(&["-T".as_ref(), fstab.as_os_str(), mnt.as_os_str()]);
            let _ = fs::remove_file("/sbin/mount.fuse.betreefs");
            assert!(status, "mounting from an fstab line failed");
            assert_eq!(fs::read(mnt.join("f")).unwrap(), b"bg");
            let opts = mount_options(&mnt);
            assert!(
                opts.iter().any(|o| o == "nosuid") && opts.iter().any(|o| o == "nodev"),
                "{opts:?}"
            );
        }
    }
    umount(&mnt);
}

#[test]
fn nullfuse_keeps_names_and_sizes_and_drops_data() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new("nullfuse");
    let mnt = s.0.join("mnt");
    fs::create_dir(&mnt).unwrap();
    let out = std::process::Command::new(binary())
        .arg("nullfuse")
        .arg(&mnt)
        .output()
        .unwrap();
    assert_succeeded(&out);
    assert!(fuse_answers(&mnt));
    fs::create_dir_all(mnt.join("a/b")).unwrap();
    fs::write(mnt.join("a/b/f"), b"dropped").unwrap();
    assert_eq!(fs::metadata(mnt.join("a/b/f")).unwrap().len(), 7);
    let mut f = File::open(mnt.join("a/b/f")).unwrap();
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    drop(f);
    assert!(
        back.iter().all(|&b| b == 0) && back.len() <= 7,
        "data is dropped"
    );
    fs::rename(mnt.join("a/b"), mnt.join("c")).unwrap();
    let names: Vec<_> = fs::read_dir(&mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2);
    assert_eq!(err_of(fs::remove_dir(mnt.join("c"))), libc::ENOTEMPTY);
    fs::remove_file(mnt.join("c/f")).unwrap();
    fs::remove_dir(mnt.join("c")).unwrap();
    umount(&mnt);
}
