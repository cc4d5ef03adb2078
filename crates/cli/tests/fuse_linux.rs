//! Linux interfaces beyond plain POSIX, on real mounts: inode flags
//! (chattr), statx birth times, O_TMPFILE, RENAME_WHITEOUT and
//! copy_file_range; each checked for what it does and that it survives a
//! remount and fsck.

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use common::*;

const FS_IMMUTABLE_FL: u32 = 0x10;
const FS_APPEND_FL: u32 = 0x20;
const FS_NODUMP_FL: u32 = 0x40;
const FS_NOATIME_FL: u32 = 0x80;

fn mounted(tag: &str) -> (Scratch, Mount) {
    let (s, image, dir) = formatted(tag, "256M");
    let m = Mount::start(&image, &dir, &[]);
    (s, m)
}

/// FS_IOC_GETFLAGS / SETFLAGS as chattr uses them (on a read-only open,
/// which works on directories too).
fn get_flags(p: &Path) -> Result<u32, i32> {
    let f = File::open(p).map_err(|e| e.raw_os_error().unwrap_or(0))?;
    let mut flags: libc::c_int = 0;
    // SAFETY: valid descriptor; the kernel writes one int.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
    if r == 0 {
        Ok(flags as u32)
    } else {
        Err(errno())
    }
}

fn set_flags(p: &Path, flags: u32) -> Result<(), i32> {
    let f = File::open(p).map_err(|e| e.raw_os_error().unwrap_or(0))?;
    let flags = flags as libc::c_int;
    // SAFETY: valid descriptor; the kernel reads one int.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

fn statx_btime(p: &Path) -> Option<(i64, u32)> {
    let path = cstr(p);
    // SAFETY: zeroed statx is a valid out buffer.
    let mut sx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and buffer.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_STATX_FORCE_SYNC,
            libc::STATX_BASIC_STATS | libc::STATX_BTIME,
            &mut sx,
        )
    };
    assert_eq!(r, 0, "statx {}: {}", p.display(), errno());
    (sx.stx_mask & libc::STATX_BTIME != 0).then_some((sx.stx_btime.tv_sec, sx.stx_btime.tv_nsec))
}

#[test]
fn chattr_flags_are_kept_and_enforced() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-chattr");
    let f = m.path("f");
    fs::write(&f, b"data").unwrap();
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/inside"), b"x").unwrap();
    assert_eq!(get_flags(&f), Ok(0));
    assert_eq!(get_flags(&m.path("d")), Ok(0));

    // Immutable: no writes, truncation, attribute or name changes.
    set_flags(&f, FS_IMMUTABLE_FL).unwrap();
    assert_eq!(get_flags(&f), Ok(FS_IMMUTABLE_FL));
    assert_eq!(fs::read(&f).unwrap(), b"data");
    assert_eq!(err_of(OpenOptions::new().write(true).open(&f)), libc::EPERM);
    assert_eq!(
        err_of(OpenOptions::new().append(true).open(&f)),
        libc::EPERM
    );
    assert_eq!(err_of(fs::remove_file(&f)), libc::EPERM);
    assert_eq!(err_of(fs::rename(&f, m.path("g"))), libc::EPERM);
    assert_eq!(err_of(fs::hard_link(&f, m.path("h"))), libc::EPERM);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        err_of(fs::set_permissions(&f, fs::Permissions::from_mode(0o600))),
        libc::EPERM
    );
    assert_eq!(set_xattr(&f, "user.a", b"1", 0), Err(libc::EPERM));
    // A file opened for writing before the flag was set writes no more.
    let g = m.path("g");
    fs::write(&g, b"").unwrap();
    let open_before = OpenOptions::new().write(true).open(&g).unwrap();
    set_flags(&g, FS_IMMUTABLE_FL).unwrap();
    assert_eq!(err_of(open_before.write_at(b"late", 0)), libc::EPERM);
    drop(open_before);
    set_flags(&g, 0).unwrap();
    fs::remove_file(&g).unwrap();

    // An immutable directory takes no new or removed entries.
    let d = m.path("d");
    set_flags(&d, FS_IMMUTABLE_FL).unwrap();
    assert_eq!(err_of(fs::write(m.path("d/new"), b"")), libc::EPERM);
    assert_eq!(err_of(fs::remove_file(m.path("d/inside"))), libc::EPERM);
    assert_eq!(err_of(fs::create_dir(m.path("d/sub"))), libc::EPERM);
    assert_eq!(fs::read(m.path("d/inside")).unwrap(), b"x");
    set_flags(&d, 0).unwrap();

    // Append-only: writes only at the end, through O_APPEND.
    let a = m.path("a");
    fs::write(&a, b"log:").unwrap();
    set_flags(&a, FS_APPEND_FL).unwrap();
    assert_eq!(err_of(OpenOptions::new().write(true).open(&a)), libc::EPERM);
    let raw_open = |p: &Path, flags: i32| {
        // SAFETY: valid path.
        let fd = unsafe { libc::open(cstr(p).as_ptr(), flags) };
        if fd >= 0 {
            // SAFETY: ours.
            unsafe { libc::close(fd) };
            0
        } else {
            errno()
        }
    };
    assert_eq!(
        raw_open(&a, libc::O_WRONLY | libc::O_APPEND | libc::O_TRUNC),
        libc::EPERM
    );
    let mut log = OpenOptions::new().append(true).open(&a).unwrap();
    use std::io::Write;
    log.write_all(b"one").unwrap();
    drop(log);
    assert_eq!(fs::read(&a).unwrap(), b"log:one");
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::truncate(cstr(&a).as_ptr(), 0) }, -1);
    assert_eq!(errno(), libc::EPERM);
    assert_eq!(err_of(fs::remove_file(&a)), libc::EPERM);
    // SAFETY: valid path; a NULL times pointer means now, which an
    // append-only file allows (touch).
    assert_eq!(
        unsafe { libc::utimes(cstr(&a).as_ptr(), std::ptr::null()) },
        0
    );

    // Flags the file system does not keep are refused; kept ones survive
    // a remount.
    assert_eq!(
        set_flags(&f, FS_IMMUTABLE_FL | 0x0000_4000),
        Err(libc::EOPNOTSUPP)
    );
    set_flags(&m.path("d/inside"), FS_NODUMP_FL | FS_NOATIME_FL).unwrap();
    let m = m.remount(&[]);
    assert_eq!(get_flags(&m.path("f")), Ok(FS_IMMUTABLE_FL));
    assert_eq!(get_flags(&m.path("a")), Ok(FS_APPEND_FL));
    assert_eq!(
        get_flags(&m.path("d/inside")),
        Ok(FS_NODUMP_FL | FS_NOATIME_FL)
    );
    // noatime: reads leave the access time (another file's is updated).
    let plain = m.path("d/plain");
    fs::write(&plain, b"y").unwrap();
    let old = [
        libc::timeval {
            tv_sec: 1000,
            tv_usec: 0,
        },
        libc::timeval {
            tv_sec: 1000,
            tv_usec: 0,
        },
    ];
    for p in [&m.path("d/inside"), &plain] {
        // SAFETY: valid path; times in the past, so relatime would update.
        assert_eq!(unsafe { libc::utimes(cstr(p).as_ptr(), old.as_ptr()) }, 0);
    }
    drop_caches();
    fs::read(m.path("d/inside")).unwrap();
    fs::read(&plain).unwrap();
    drop_caches();
    assert_eq!(fs::metadata(m.path("d/inside")).unwrap().atime(), 1000);
    assert!(fs::metadata(&plain).unwrap().atime() > 1000);
    // lsattr, as users see it.
    let out = std::process::Command::new("lsattr")
        .arg("-d")
        .arg(m.path("f"))
        .output();
    if let Ok(out) = out {
        assert!(out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("----i"));
    }
    // Root takes the flags off again, and the file is ordinary.
    set_flags(&m.path("f"), 0).unwrap();
    set_flags(&m.path("a"), 0).unwrap();
    fs::remove_file(m.path("f")).unwrap();
    fs::remove_file(m.path("a")).unwrap();
    m.unmount_fsck_clean("after chattr");
}

fn drop_caches() {
    let _ = fs::write("/proc/sys/vm/drop_caches", b"3");
}

/// Opens a removed file by its handle once the kernel has let go of its
/// inode, and gives the error. The kernel answers a handle from an inode
/// it still caches without asking the daemon, and it lets go of a closed
/// file's inode only after the RELEASE it sends once close has returned
/// (asynchronously): under load a single drop of the caches can come
/// first. So the caches are dropped until the open fails, for up to 10 s;
/// an open that still succeeds then is returned as such.
fn stale_after_the_kernel_forgets(mount_fd: &File, handle: &[u32]) -> Option<i32> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        drop_caches();
        let err = open_by_handle(mount_fd, handle, libc::O_RDONLY).err();
        if err.is_some() || std::time::Instant::now() > deadline {
            return err;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn statx_reports_the_birth_time() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-btime");
    let f = m.path("f");
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    fs::write(&f, b"x").unwrap();
    let born = statx_btime(&f).expect("statx must report btime");
    assert!((born.0 - before).abs() <= 2, "{born:?} vs {before}");
    // Writes, renames and time changes leave it.
    std::thread::sleep(std::time::Duration::from_millis(20));
    fs::write(&f, b"yy").unwrap();
    fs::rename(&f, m.path("g")).unwrap();
    // SAFETY: valid path; times long ago.
    let old = [
        libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        },
        libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        },
    ];
    assert_eq!(
        unsafe { libc::utimes(cstr(&m.path("g")).as_ptr(), old.as_ptr()) },
        0
    );
    assert_eq!(statx_btime(&m.path("g")), Some(born));
    let m = m.remount(&[]);
    assert_eq!(statx_btime(&m.path("g")), Some(born));
    m.unmount();
}

#[test]
fn o_tmpfile_makes_unnamed_files_that_link_may_name() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-tmpfile");
    fs::create_dir(m.path("d")).unwrap();
    let open_tmp = |mode: i32| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o640)
            .custom_flags(libc::O_TMPFILE | mode)
            .open(m.path("d"))
            .unwrap()
    };
    let before = fs::metadata(m.path("d")).unwrap().mtime_nsec();
    // One that is named later.
    let named = open_tmp(0);
    named.write_all_at(b"kept", 0).unwrap();
    let meta = named.metadata().unwrap();
    assert_eq!(meta.nlink(), 0);
    assert_eq!(meta.mode() & 0o7777, 0o640);
    assert!(fs::read_dir(m.path("d")).unwrap().next().is_none());
    assert_eq!(fs::metadata(m.path("d")).unwrap().mtime_nsec(), before);
    assert_eq!(link_open_file(&named, &m.path("d/named")), 0);
    assert_eq!(named.metadata().unwrap().nlink(), 1);
    named.write_all_at(b"!", 4).unwrap();
    drop(named);
    assert_eq!(fs::read(m.path("d/named")).unwrap(), b"kept!");
    // One that never is: gone at its last close; O_EXCL ones cannot be named.
    let scratch = open_tmp(0);
    scratch.write_all_at(&[1; 10_000], 0).unwrap();
    let excl = open_tmp(libc::O_EXCL);
    assert_eq!(link_open_file(&excl, &m.path("d/excl")), libc::ENOENT);
    let files_while_open = statfs_files(&m.dir);
    drop(scratch);
    drop(excl);
    // RELEASE is sent after close returns: wait for it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while statfs_files(&m.dir) != files_while_open - 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(statfs_files(&m.dir), files_while_open - 2);
    let names: Vec<_> = fs::read_dir(m.path("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["named"]);
    // A crash with one open: the next mount removes it.
    let left_open = open_tmp(0);
    left_open.write_all_at(b"lost", 0).unwrap();
    // SAFETY: valid descriptor.
    assert_eq!(unsafe { libc::fsync(left_open.as_raw_fd()) }, 0);
    let files = statfs_files(&m.dir);
    let (image, dir) = (m.image.clone(), m.dir.clone());
    m.kill();
    drop(left_open);
    detach(&dir);
    let m = Mount::start(&image, &dir, &[]);
    assert_eq!(statfs_files(&m.dir), files - 1);
    assert_eq!(fs::read(m.path("d/named")).unwrap(), b"kept!");
    m.unmount_fsck_clean("after O_TMPFILE");
}

/// linkat(2) of an open file, through /proc/self/fd, to `to`: 0 or the
/// errno.
fn link_open_file(f: &File, to: &Path) -> i32 {
    let from = cstr(Path::new(&format!("/proc/self/fd/{}", f.as_raw_fd())));
    let to = cstr(to);
    // SAFETY: valid NUL-terminated paths.
    let r = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if r == 0 {
        0
    } else {
        errno()
    }
}

/// Inodes in use (statfs's files minus free files).
fn statfs_files(dir: &Path) -> u64 {
    let path = cstr(dir);
    // SAFETY: zeroed statvfs is a valid out buffer.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and buffer.
    assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut s) }, 0);
    s.f_files - s.f_ffree
}

#[test]
fn rename_whiteout_leaves_a_whiteout() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-whiteout");
    fs::write(m.path("f"), b"moved").unwrap();
    fs::create_dir_all(m.path("dir/sub")).unwrap();
    assert_eq!(
        renameat2(&m.path("f"), &m.path("g"), libc::RENAME_WHITEOUT),
        0
    );
    assert_eq!(fs::read(m.path("g")).unwrap(), b"moved");
    let w = fs::symlink_metadata(m.path("f")).unwrap();
    assert_eq!(w.mode() & libc::S_IFMT, libc::S_IFCHR);
    assert_eq!(w.rdev(), 0);
    // Directories too, and over an existing target.
    fs::write(m.path("target"), b"old").unwrap();
    assert_eq!(
        renameat2(&m.path("g"), &m.path("target"), libc::RENAME_WHITEOUT),
        0
    );
    assert_eq!(fs::read(m.path("target")).unwrap(), b"moved");
    assert_eq!(
        renameat2(&m.path("dir"), &m.path("dir2"), libc::RENAME_WHITEOUT),
        0
    );
    assert!(m.path("dir2/sub").is_dir());
    assert_eq!(
        fs::symlink_metadata(m.path("dir")).unwrap().mode() & libc::S_IFMT,
        libc::S_IFCHR
    );
    // Under a default ACL: the moved file keeps its own ACL, the
    // whiteout gets one of its own.
    fs::create_dir(m.path("acl")).unwrap();
    let entry = |tag: u16, perm: u16, id: u32| {
        let mut e = tag.to_le_bytes().to_vec();
        e.extend_from_slice(&perm.to_le_bytes());
        e.extend_from_slice(&id.to_le_bytes());
        e
    };
    let mut default = 2u32.to_le_bytes().to_vec();
    for e in [
        entry(0x01, 7, u32::MAX),
        entry(0x02, 7, 1000),
        entry(0x04, 5, u32::MAX),
        entry(0x10, 7, u32::MAX),
        entry(0x20, 5, u32::MAX),
    ] {
        default.extend(e);
    }
    set_xattr(&m.path("acl"), "system.posix_acl_default", &default, 0).unwrap();
    fs::write(m.path("acl/x"), b"acl").unwrap();
    let access = "system.posix_acl_access";
    let before = get_xattr(&m.path("acl/x"), access, 4096).unwrap();
    assert_eq!(
        renameat2(&m.path("acl/x"), &m.path("y"), libc::RENAME_WHITEOUT),
        0
    );
    assert_eq!(get_xattr(&m.path("y"), access, 4096).unwrap(), before);
    assert_ne!(get_xattr(&m.path("acl/x"), access, 4096).unwrap(), before);
    // Not with an exchange.
    assert_eq!(
        renameat2(
            &m.path("target"),
            &m.path("dir2"),
            libc::RENAME_WHITEOUT | libc::RENAME_EXCHANGE
        ),
        libc::EINVAL
    );
    let m = m.remount(&[]);
    for name in ["f", "g", "dir"] {
        let meta = fs::symlink_metadata(m.path(name)).unwrap();
        assert_eq!(meta.mode() & libc::S_IFMT, libc::S_IFCHR, "{name}");
    }
    m.unmount_fsck_clean("after whiteouts");
}

#[test]
fn copy_file_range_copies_inside_the_file_system() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-copy");
    let src = m.path("src");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    {
        let f = File::create(&src).unwrap();
        f.write_all_at(&data[..1_000_000], 0).unwrap();
        // A hole from 1,000,000 to 2,000,000, then data again.
        f.write_all_at(&data[2_000_000..], 2_000_000).unwrap();
    }
    let mut expect = data.clone();
    expect[1_000_000..2_000_000].fill(0);
    let copy = |from: &File, off_in: i64, to: &File, off_out: i64, len: usize| -> i64 {
        let (mut i, mut o) = (off_in, off_out);
        let mut total = 0i64;
        while (total as usize) < len {
            // SAFETY: valid descriptors and offsets.
            let n = unsafe {
                libc::copy_file_range(
                    from.as_raw_fd(),
                    &mut i,
                    to.as_raw_fd(),
                    &mut o,
                    len - total as usize,
                    0,
                )
            };
            if n < 0 {
                return -i64::from(errno());
            }
            total += n as i64;
            // Short: the end of the source (which, copying within one
            // file, may have grown by this very copy).
            if (n as usize) < len - (total - n as i64) as usize {
                break;
            }
        }
        total
    };
    let requests_before = request_counts(&m.dir);
    let clones_before = engine_counter(&m.dir, "range_clones_by_surgery");
    let from = File::open(&src).unwrap();
    let to = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(m.path("dst"))
        .unwrap();
    to.write_all_at(&[0xee; 1_500_000], 0).unwrap();
    assert_eq!(copy(&from, 0, &to, 0, 3_000_000), 3_000_000);
    drop(to);
    let counts = request_delta(&requests_before, &request_counts(&m.dir));
    assert!(fs::read(m.path("dst")).unwrap() == expect, "copied bytes");
    assert!(
        counts.get("copy_file_range").copied().unwrap_or(0) >= 1,
        "{counts:?}"
    );
    assert_eq!(counts.get("read").copied().unwrap_or(0), 0, "{counts:?}");
    // The same offset, whole blocks up to the source's end: a range clone
    // (the data is shared, not copied).
    assert!(engine_counter(&m.dir, "range_clones_by_surgery") > clones_before);
    // The hole stays a hole in the copy (past what was written before).
    let to = File::open(m.path("dst")).unwrap();
    // SAFETY: valid descriptor.
    let hole = unsafe { libc::lseek(to.as_raw_fd(), 0, libc::SEEK_HOLE) };
    assert_eq!(hole, 1_003_520);
    // Into the same file, not overlapping; short at the source's end.
    let same = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&src)
        .unwrap();
    assert_eq!(copy(&same, 0, &same, 3_000_000, 100), 100);
    assert_eq!(copy(&same, 3_000_050, &same, 4_000_000, 100), 50);
    let mut back = vec![0u8; 100];
    same.read_exact_at(&mut back, 3_000_000).unwrap();
    assert_eq!(back, data[..100]);
    // Overlapping ranges of one file are refused.
    assert_eq!(copy(&same, 0, &same, 50, 100), -i64::from(libc::EINVAL));
    drop((from, same, to));
    m.unmount_fsck_clean("after copy_file_range");
}

/// `betreefs mount -o remount,...` (what mount(8) runs through the
/// helper for `mount -o remount,ro DIR`).
fn remount(m: &Mount, options: &str) -> std::process::Output {
    std::process::Command::new(binary())
        .arg("mount")
        .arg("-o")
        .arg(format!("remount,{options}"))
        .arg(&m.image)
        .arg(&m.dir)
        .output()
        .unwrap()
}

#[test]
fn remount_read_only_and_back() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-remount");
    fs::write(m.path("f"), b"before").unwrap();
    let out = remount(&m, "ro");
    assert_succeeded(&out);
    assert!(mount_options(&m.dir).contains(&"ro".to_string()));
    assert_eq!(err_of(fs::write(m.path("g"), b"x")), libc::EROFS);
    assert_eq!(err_of(fs::remove_file(m.path("f"))), libc::EROFS);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"before");
    let out = remount(&m, "rw");
    assert_succeeded(&out);
    assert!(mount_options(&m.dir).contains(&"rw".to_string()));
    fs::write(m.path("g"), b"after").unwrap();
    let (image, dir) = (m.image.clone(), m.dir.clone());
    m.unmount();
    assert_fsck_clean(&image, "after remounts");
    // A mount read-only from the start has its image open read-only: it
    // cannot be made writable without mounting again.
    let m = Mount::start(&image, &dir, &["ro"]);
    let out = remount(&m, "rw");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("mount again"),
        "{out:?}"
    );
    assert_eq!(fs::read(m.path("g")).unwrap(), b"after");
    m.unmount();
}

#[test]
fn sync_and_dirsync_mounts_make_changes_durable_at_once() {
    if !fuse_available() {
        return;
    }
    let (_s, image, dir) = formatted("linux-sync", "256M");
    // dirsync: a new name survives a kill right after it is made.
    let m = Mount::start(&image, &dir, &["dirsync"]);
    assert!(mount_options(&m.dir).contains(&"dirsync".to_string()));
    fs::create_dir(m.path("d")).unwrap();
    File::create(m.path("d/f")).unwrap();
    m.kill();
    let m = Mount::start(&image, &dir, &["sync"]);
    assert!(m.path("d/f").exists(), "dirsync lost a create");
    // sync: data too.
    fs::write(m.path("d/f"), b"synchronous").unwrap();
    m.kill();
    let m = Mount::start(&image, &dir, &[]);
    assert_eq!(fs::read(m.path("d/f")).unwrap(), b"synchronous");
    m.unmount();
}

/// A buffer aligned for O_DIRECT.
struct Aligned {
    ptr: *mut u8,
    len: usize,
}

impl Aligned {
    fn filled(len: usize, byte: u8) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null());
        // SAFETY: ptr holds len bytes.
        unsafe { std::ptr::write_bytes(ptr, byte, len) };
        Aligned { ptr, len }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, 4096).unwrap();
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// Linux native AIO (io_submit), as libaio and fio use it: the kernel
/// returns from io_submit before a direct write completes.
struct LinuxAio {
    ctx: libc::c_ulong,
}

/// `struct iocb`.
#[repr(C)]
struct Iocb {
    data: u64,
    key: u32,
    rw_flags: i32,
    opcode: u16,
    reqprio: i16,
    fildes: u32,
    buf: u64,
    nbytes: u64,
    offset: i64,
    reserved2: u64,
    flags: u32,
    resfd: u32,
}

/// `struct io_event`.
#[repr(C)]
#[derive(Default)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

impl LinuxAio {
    fn new() -> LinuxAio {
        let mut ctx: libc::c_ulong = 0;
        // SAFETY: ctx is a valid out pointer.
        let r = unsafe { libc::syscall(libc::SYS_io_setup, 8, &mut ctx) };
        assert_eq!(r, 0, "io_setup: {}", errno());
        LinuxAio { ctx }
    }

    fn submit_write(&self, fd: i32, buf: &Aligned, offset: u64) {
        let mut iocb = Iocb {
            data: 0,
            key: 0,
            rw_flags: 0,
            opcode: 1, // IOCB_CMD_PWRITE
            reqprio: 0,
            fildes: fd as u32,
            buf: buf.ptr as u64,
            nbytes: buf.len as u64,
            offset: offset as i64,
            reserved2: 0,
            flags: 0,
            resfd: 0,
        };
        let mut list = [&mut iocb as *mut Iocb];
        // SAFETY: one valid iocb whose buffer outlives the operation
        // (the caller waits for it); the kernel copies the iocb itself.
        let r = unsafe { libc::syscall(libc::SYS_io_submit, self.ctx, 1, list.as_mut_ptr()) };
        assert_eq!(r, 1, "io_submit: {}", errno());
    }

    /// Waits for one completion; its result.
    fn wait_one(&self) -> i64 {
        let mut event = IoEvent::default();
        // SAFETY: room for one event; no timeout.
        let r = unsafe {
            libc::syscall(
                libc::SYS_io_getevents,
                self.ctx,
                1,
                1,
                &mut event,
                std::ptr::null::<libc::timespec>(),
            )
        };
        assert_eq!(r, 1, "io_getevents: {}", errno());
        event.res
    }
}

impl Drop for LinuxAio {
    fn drop(&mut self) {
        // SAFETY: our context.
        unsafe { libc::syscall(libc::SYS_io_destroy, self.ctx) };
    }
}

/// An asynchronous O_DIRECT write (native AIO: the kernel completes it
/// after io_submit returns) into a file another descriptor
/// has cached: once the write has completed, a buffered read sees it.
#[test]
fn buffered_reads_see_completed_async_direct_writes() {
    if !fuse_available() {
        return;
    }
    // Each WRITE is held 30 ms in the daemon, so that a read lands while
    // the direct write is in flight (the race a buffered reader loses);
    // several /dev/fuse threads, so that the READ is not queued behind it.
    let (_s, image, dir) = formatted("linux-dio", "256M");
    let m = Mount::start_with_env(
        &image,
        &dir,
        &["transport=devfuse", "threads=4"],
        &[("BETREEFS_TEST_DELAY", "write:30")],
    );
    let path = m.path("f");
    const LEN: usize = 1 << 20;
    fs::write(&path, vec![0xaa; LEN]).unwrap();
    let reader = File::open(&path).unwrap();
    let mut back = vec![0u8; LEN];
    let writer = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .unwrap();
    let aio = LinuxAio::new();
    for round in 0..8u8 {
        // The page cache holds the old bytes.
        reader.read_exact_at(&mut back, 0).unwrap();
        let fill = 0xb0 + round % 16;
        let buf = Aligned::filled(64 << 10, fill);
        let offset = u64::from(round) * (64 << 10) % LEN as u64;
        aio.submit_write(writer.as_raw_fd(), &buf, offset);
        // A buffered read while the write is in flight caches old bytes...
        std::thread::sleep(std::time::Duration::from_millis(10));
        reader.read_exact_at(&mut back, 0).unwrap();
        // ...which must be gone once the write has completed.
        assert_eq!(aio.wait_one(), buf.len as i64, "direct write");
        let mut now = vec![0u8; buf.len];
        reader.read_exact_at(&mut now, offset).unwrap();
        assert!(
            now.iter().all(|&b| b == fill),
            "round {round}: a buffered read after the direct write completed saw stale data"
        );
    }
    drop((reader, writer));
    m.unmount();
}

#[test]
fn st_blocks_counts_the_blocks_stored() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-blocks");
    let blocks = |name: &str| fs::metadata(m.path(name)).unwrap().blocks();
    // Dense: every 4 KiB block up to the size.
    fs::write(m.path("dense"), vec![1u8; 10_000]).unwrap();
    assert_eq!(blocks("dense"), 3 * 8);
    // A write far past the end stores one block.
    let f = File::create(m.path("sparse")).unwrap();
    f.write_all_at(&[2u8; 4096], 1 << 20).unwrap();
    drop(f);
    assert_eq!(
        fs::metadata(m.path("sparse")).unwrap().len(),
        (1 << 20) + 4096
    );
    assert_eq!(blocks("sparse"), 8);
    // Extended by truncate: nothing stored.
    File::create(m.path("empty"))
        .unwrap()
        .set_len(10 << 20)
        .unwrap();
    assert_eq!(blocks("empty"), 0);
    // A punched range leaves the file.
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(m.path("punched"))
        .unwrap();
    f.write_all_at(&[3u8; 65536], 0).unwrap();
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: valid descriptor.
    assert_eq!(
        unsafe { libc::fallocate(f.as_raw_fd(), punch, 4096, 8192) },
        0
    );
    drop(f);
    assert_eq!(blocks("punched"), 14 * 8);
    // Filling the hole counts again; listings (readdirplus) agree.
    let f = OpenOptions::new()
        .write(true)
        .open(m.path("sparse"))
        .unwrap();
    f.write_all_at(&[4u8; 8192], 0).unwrap();
    drop(f);
    assert_eq!(blocks("sparse"), 3 * 8);
    let m = m.remount(&[]);
    let out = std::process::Command::new("du")
        .arg("-k")
        .arg(m.path("empty"))
        .arg(m.path("sparse"))
        .output()
        .unwrap();
    let du = String::from_utf8_lossy(&out.stdout).into_owned();
    let sizes: Vec<&str> = du.lines().filter_map(|l| l.split('\t').next()).collect();
    assert_eq!(sizes, ["0", "12"], "{du}");
    let listed: Vec<(String, u64)> = fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().unwrap().blocks(),
            )
        })
        .collect();
    for (name, expect) in [
        ("dense", 24),
        ("sparse", 24),
        ("empty", 0),
        ("punched", 112),
    ] {
        assert!(
            listed.contains(&(name.to_string(), expect)),
            "{name}: {listed:?}"
        );
    }
    m.unmount();
}

/// name_to_handle_at(2): the handle's bytes (`struct file_handle`).
fn name_to_handle(p: &Path) -> Result<Vec<u32>, i32> {
    let mut handle = vec![0u32; 2 + 32];
    handle[0] = 128; // handle_bytes
    let mut mount_id: libc::c_int = 0;
    let c = cstr(p);
    // SAFETY: valid path; the buffer holds a file_handle with 128 bytes.
    let r = unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            libc::AT_FDCWD,
            c.as_ptr(),
            handle.as_mut_ptr(),
            &mut mount_id,
            0,
        )
    };
    if r == 0 {
        Ok(handle)
    } else {
        Err(errno())
    }
}

/// open_by_handle_at(2) on the mount `mount_fd` is on.
fn open_by_handle(mount_fd: &File, handle: &[u32], flags: i32) -> Result<File, i32> {
    let mut handle = handle.to_vec();
    // SAFETY: a file_handle as name_to_handle_at filled it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            mount_fd.as_raw_fd(),
            handle.as_mut_ptr(),
            flags,
        )
    };
    if fd < 0 {
        return Err(errno());
    }
    use std::os::fd::FromRawFd;
    // SAFETY: a descriptor the kernel just gave us.
    Ok(unsafe { File::from_raw_fd(fd as i32) })
}

fn read_by_handle(mount_fd: &File, handle: &[u32]) -> Vec<u8> {
    use std::io::Read;
    let mut f = open_by_handle(mount_fd, handle, libc::O_RDONLY).expect("open by handle");
    let mut out = Vec::new();
    f.read_to_end(&mut out).unwrap();
    out
}

fn list_by_handle(mount_fd: &File, handle: &[u32]) -> Vec<String> {
    let d = open_by_handle(mount_fd, handle, libc::O_RDONLY | libc::O_DIRECTORY)
        .expect("open a directory by handle");
    let mut names: Vec<String> = fs::read_dir(format!("/proc/self/fd/{}", d.as_raw_fd()))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn file_handles_find_files_after_eviction_renames_and_remounts() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-handles");
    fs::create_dir_all(m.path("a/b")).unwrap();
    fs::write(m.path("a/b/f"), b"handled").unwrap();
    fs::write(m.path("one"), b"linked").unwrap();
    fs::hard_link(m.path("one"), m.path("two")).unwrap();
    fs::write(m.path("gone"), b"x").unwrap();
    let file = name_to_handle(&m.path("a/b/f")).unwrap();
    let dir = name_to_handle(&m.path("a/b")).unwrap();
    let linked = name_to_handle(&m.path("one")).unwrap();
    let gone = name_to_handle(&m.path("gone")).unwrap();
    fs::remove_file(m.path("gone")).unwrap();
    // The kernel forgets the inodes: the handles find them by number.
    let mount_fd = File::open(&m.dir).unwrap();
    drop_caches();
    assert_eq!(read_by_handle(&mount_fd, &file), b"handled");
    assert_eq!(read_by_handle(&mount_fd, &linked), b"linked");
    assert_eq!(list_by_handle(&mount_fd, &dir), ["f"]);
    assert_eq!(
        stale_after_the_kernel_forgets(&mount_fd, &gone),
        Some(libc::ESTALE)
    );
    // Renames of the file's directories do not matter.
    fs::rename(m.path("a"), m.path("z")).unwrap();
    fs::rename(m.path("z/b/f"), m.path("z/b/g")).unwrap();
    drop_caches();
    assert_eq!(read_by_handle(&mount_fd, &file), b"handled");
    // Nor does a remount (a new daemon, an empty inode table).
    drop(mount_fd);
    let m = m.remount(&[]);
    let mount_fd = File::open(&m.dir).unwrap();
    assert_eq!(read_by_handle(&mount_fd, &file), b"handled");
    assert_eq!(read_by_handle(&mount_fd, &linked), b"linked");
    assert_eq!(list_by_handle(&mount_fd, &dir), ["g"]);
    // Removed: stale, also after the kernel forgot it.
    fs::remove_file(m.path("z/b/g")).unwrap();
    fs::remove_file(m.path("one")).unwrap();
    fs::remove_file(m.path("two")).unwrap();
    for h in [&file, &linked] {
        assert_eq!(
            stale_after_the_kernel_forgets(&mount_fd, h),
            Some(libc::ESTALE)
        );
    }
    drop(mount_fd);
    m.unmount_fsck_clean("after file handles");
}

/// `betreefs clone SRC DST` on a mount: the copy matches (data shared by a
/// range clone), the kernel sees it at once (the parent's listing, the
/// new directory's attributes), writes to either side leave the other as
/// it was, refusals say why and leave nothing behind, and fsck is clean.
#[test]
fn clone_copies_a_directory_tree() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("linux-clone");
    let src = m.path("src");
    fs::create_dir_all(src.join("a/b")).unwrap();
    fs::create_dir(src.join("c")).unwrap();
    for i in 0..40 {
        fs::write(
            src.join(format!("a/f{i}")),
            format!("file {i}\n").repeat(i + 1),
        )
        .unwrap();
    }
    let big: Vec<u8> = (0..6_000_000u32).map(|i| (i % 253) as u8).collect();
    fs::write(src.join("a/b/big"), &big).unwrap();
    fs::hard_link(src.join("a/f1"), src.join("c/hard")).unwrap();
    std::os::unix::fs::symlink("../a/f2", src.join("c/sym")).unwrap();
    // The parent's listing is cached before the clone adds to it.
    assert_eq!(fs::read_dir(m.dir.clone()).unwrap().count(), 1);
    let clones_before = engine_counter(&m.dir, "range_clones_by_surgery");

    let run = |from: &Path, to: &Path| {
        std::process::Command::new(binary())
            .arg("clone")
            .arg(from)
            .arg(to)
            .output()
            .unwrap()
    };
    let dst = m.path("dst");
    assert_succeeded(&run(&src, &dst));
    assert!(engine_counter(&m.dir, "range_clones_by_surgery") > clones_before);
    assert_eq!(tree_digest(&src), tree_digest(&dst));
    let names: Vec<_> = fs::read_dir(m.dir.clone())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let (s_meta, d_meta) = (fs::metadata(&src).unwrap(), fs::metadata(&dst).unwrap());
    assert_eq!(
        (s_meta.mode(), s_meta.nlink()),
        (d_meta.mode(), d_meta.nlink())
    );
    assert_ne!(s_meta.ino(), d_meta.ino());
    let (h1, h2) = (
        fs::metadata(dst.join("a/f1")).unwrap(),
        fs::metadata(dst.join("c/hard")).unwrap(),
    );
    assert_eq!((h1.ino(), h1.nlink()), (h2.ino(), 2));
    assert_ne!(h1.ino(), fs::metadata(src.join("a/f1")).unwrap().ino());

    // Independent copies.
    File::options()
        .write(true)
        .open(dst.join("a/b/big"))
        .unwrap()
        .write_all_at(&[7; 100_000], 1 << 20)
        .unwrap();
    fs::write(src.join("a/f3"), b"changed in the source").unwrap();
    fs::remove_file(dst.join("a/f4")).unwrap();
    let mut changed = big.clone();
    changed[1 << 20..(1 << 20) + 100_000].fill(7);
    assert!(fs::read(src.join("a/b/big")).unwrap() == big);
    assert!(fs::read(dst.join("a/b/big")).unwrap() == changed);
    assert_eq!(fs::read(dst.join("a/f3")).unwrap(), b"file 3\n".repeat(4));
    assert!(src.join("a/f4").exists());

    // Refusals: an existing destination, a destination inside the source,
    // a file as the source; nothing is left behind.
    let out = run(&src, &dst);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("exists"),
        "{out:?}"
    );
    let inside = src.join("a/inside");
    let out = run(&src, &inside);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("inside the source"),
        "{out:?}"
    );
    assert!(!inside.exists());
    let out = run(&src.join("a/f1"), &m.path("file-clone"));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a directory"),
        "{out:?}"
    );
    m.unmount_fsck_clean("after clones");
}
