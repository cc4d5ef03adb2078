//! The tests behind docs/SEMANTICS.md: each section of that page names one
//! of these, which fails if the section stops being true.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use common::*;

fn mounted(tag: &str, options: &[&str]) -> (Scratch, Mount) {
    let (s, image, dir) = formatted(tag, "256M");
    let m = Mount::start(&image, &dir, options);
    (s, m)
}

/// Every `Test: name` line of the document names a test here, and every
/// test here is named there.
#[test]
fn semantics_document_and_tests_agree() {
    let doc = include_str!("../../../docs/SEMANTICS.md");
    let source = include_str!("semantics.rs");
    let named: Vec<&str> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("Test: `"))
        .filter_map(|l| l.strip_suffix('`'))
        .collect();
    assert!(named.len() >= 10, "{named:?}");
    for name in &named {
        assert!(
            source.contains(&format!("fn {name}(")),
            "SEMANTICS.md names {name}, which is not a test here"
        );
    }
    let marker = ["#[test]", "\nfn "].concat();
    for chunk in source.split(&marker).skip(1) {
        let name = chunk.split('(').next().unwrap_or_default();
        assert!(
            name == "semantics_document_and_tests_agree" || named.contains(&name),
            "test {name} is not named in SEMANTICS.md"
        );
    }
}

#[test]
fn fsync_of_one_file_makes_every_earlier_write_durable() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-fsync", &[]);
    fs::write(m.path("unsynced"), b"written, never fsync'd").unwrap();
    let mut other = File::create(m.path("other")).unwrap();
    other.write_all(b"x").unwrap();
    other.sync_all().unwrap();
    let (image, dir) = (m.image.clone(), m.dir.clone());
    m.kill();
    let m = Mount::start(&image, &dir, &[]);
    assert_eq!(
        fs::read(m.path("unsynced")).unwrap(),
        b"written, never fsync'd"
    );
    m.unmount();
}

#[test]
fn a_second_mount_is_refused_and_names_the_first() {
    if !fuse_available() {
        return;
    }
    let (s, m) = mounted("sem-second", &[]);
    let other = s.0.join("other");
    fs::create_dir(&other).unwrap();
    let out = std::process::Command::new(binary())
        .arg("mount")
        .arg(&m.image)
        .arg(&other)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&m.dir.display().to_string()), "{err}");
    m.unmount();
}

#[test]
fn locks_are_kept_by_the_kernel() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-locks", &[]);
    let path = m.path("locked");
    fs::write(&path, b"l").unwrap();
    let a = File::open(&path).unwrap();
    let b = File::open(&path).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: valid descriptors.
    unsafe {
        assert_eq!(libc::flock(a.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB), 0);
        assert_eq!(
            libc::flock(b.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB),
            -1
        );
    }
    assert_eq!(errno(), libc::EWOULDBLOCK);
    drop((a, b));
    m.unmount();
}

#[test]
fn cached_reads_do_not_update_atime() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-atime", &["strictatime"]);
    fs::write(m.path("f"), vec![1u8; 8192]).unwrap();
    let (image, dir) = (m.image.clone(), m.dir.clone());
    let atime = |p: &Path| {
        let md = fs::metadata(p).unwrap();
        std::time::UNIX_EPOCH + Duration::new(md.atime() as u64, md.atime_nsec() as u32)
    };
    // A cold read reaches the file system and updates the access time
    // (seen once the kernel's cached attributes are gone: a remount).
    m.unmount();
    let m = Mount::start(&image, &dir, &["strictatime"]);
    let before = atime(&m.path("f"));
    std::thread::sleep(Duration::from_millis(20));
    fs::read(m.path("f")).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let second_read = std::time::SystemTime::now();
    fs::read(m.path("f")).unwrap();
    m.unmount();
    let m = Mount::start(&image, &dir, &["strictatime"]);
    let after = atime(&m.path("f"));
    assert!(after > before, "the cold read updated the access time");
    assert!(
        after < second_read,
        "the read from the page cache did not reach the file system"
    );
    m.unmount();
}

#[test]
fn fifo_io_leaves_its_times() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-fifo", &[]);
    let path = m.path("fifo");
    let c = cstr(&path);
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let times = |p: &Path| {
        let md = fs::metadata(p).unwrap();
        (md.mtime(), md.mtime_nsec(), md.ctime(), md.ctime_nsec())
    };
    let before = times(&path);
    std::thread::sleep(Duration::from_millis(20));
    // O_RDWR on a FIFO never waits for a partner.
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    f.write_all(b"through the pipe").unwrap();
    let mut back = [0u8; 16];
    f.read_exact(&mut back).unwrap();
    drop(f);
    assert_eq!(times(&path), before);
    m.unmount();
}

#[test]
fn timestamps_follow_the_linux_rules() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-times", &[]);
    let path = m.path("f");
    fs::write(&path, b"").unwrap();
    let times = |p: &Path| {
        let md = fs::metadata(p).unwrap();
        ((md.mtime(), md.mtime_nsec()), (md.ctime(), md.ctime_nsec()))
    };
    let pause = || std::thread::sleep(Duration::from_millis(5));
    let before = times(&path);
    pause();
    // O_TRUNC of an empty file marks both.
    drop(
        OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .unwrap(),
    );
    let after_otrunc = times(&path);
    assert!(after_otrunc.0 > before.0 && after_otrunc.1 > before.1);
    pause();
    // truncate(2) to the same size marks nothing.
    let c = cstr(&path);
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::truncate(c.as_ptr(), 0) }, 0);
    assert_eq!(times(&path), after_otrunc);
    // ftruncate to the same size marks both.
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(0).unwrap();
    drop(f);
    let after_ftruncate = times(&path);
    assert!(after_ftruncate.0 > after_otrunc.0);
    pause();
    // chmod: ctime only.
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    let after_chmod = times(&path);
    assert_eq!(after_chmod.0, after_ftruncate.0);
    assert!(after_chmod.1 > after_ftruncate.1);
    m.unmount();
}

#[test]
fn space_is_reported_as_documented() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-space", &[]);
    let path = m.path("f");
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    // SAFETY: valid descriptor.
    let fallocate = |mode: i32, offset: i64, len: i64| unsafe {
        if libc::fallocate(f.as_raw_fd(), mode, offset, len) == 0 {
            0
        } else {
            errno()
        }
    };
    // SAFETY: valid descriptor.
    let seek = |offset: i64, whence: i32| unsafe {
        let r = libc::lseek(f.as_raw_fd(), offset, whence);
        if r >= 0 {
            r
        } else {
            -i64::from(errno())
        }
    };
    let size = || fs::metadata(&path).unwrap().len();
    let free = || {
        // SAFETY: statvfs is plain integers; all zeros is a valid value.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(m.path("").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid path and out-pointer.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
        st.f_bfree * st.f_frsize
    };
    let free_before = free();
    assert_eq!(fallocate(0, 0, 100_000), 0);
    assert_eq!(size(), 100_000);
    // Preallocation holds the space back: df shows it taken.
    assert!(
        free() + 100_000 <= free_before,
        "{} -> {}",
        free_before,
        free()
    );
    // Preallocation past the end keeps the size.
    assert_eq!(fallocate(libc::FALLOC_FL_KEEP_SIZE, 0, 200_000), 0);
    assert_eq!(size(), 100_000);
    // Holes and data: nothing written yet is all hole.
    assert_eq!(seek(0, libc::SEEK_DATA), -i64::from(libc::ENXIO));
    assert_eq!(seek(0, libc::SEEK_HOLE), 0);
    f.write_all_at(&[7u8; 40_000], 20_000).unwrap();
    assert_eq!(seek(0, libc::SEEK_DATA), 16_384);
    assert_eq!(seek(30_000, libc::SEEK_DATA), 30_000);
    assert_eq!(seek(20_000, libc::SEEK_HOLE), 61_440);
    assert_eq!(seek(70_000, libc::SEEK_HOLE), 70_000);
    assert_eq!(seek(100_000, libc::SEEK_HOLE), -i64::from(libc::ENXIO));
    // Punching a hole: the range reads as zeros, the size stays, whole
    // blocks inside it become a hole.
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(fallocate(punch, 25_000, 20_000), 0);
    assert_eq!(size(), 100_000);
    let mut back = vec![0u8; 40_000];
    f.read_exact_at(&mut back, 20_000).unwrap();
    assert!(back[..5_000].iter().all(|&b| b == 7));
    assert!(back[5_000..25_000].iter().all(|&b| b == 0));
    assert!(back[25_000..].iter().all(|&b| b == 7));
    assert_eq!(seek(20_000, libc::SEEK_HOLE), 28_672);
    assert_eq!(seek(28_672, libc::SEEK_DATA), 40_960);
    // Punching needs KEEP_SIZE, as on Linux.
    assert_eq!(
        fallocate(libc::FALLOC_FL_PUNCH_HOLE, 0, 4096),
        libc::EOPNOTSUPP
    );
    // Zeroing a range, past the end too: the size grows unless KEEP_SIZE.
    assert_eq!(fallocate(libc::FALLOC_FL_ZERO_RANGE, 50_000, 60_000), 0);
    assert_eq!(size(), 110_000);
    f.read_exact_at(&mut back, 45_000).unwrap();
    assert!(back[..5_000].iter().all(|&b| b == 7));
    assert!(back[5_000..].iter().all(|&b| b == 0));
    let zero_keep = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(fallocate(zero_keep, 100_000, 50_000), 0);
    assert_eq!(size(), 110_000);
    // Shifting ranges is not offered.
    for mode in [libc::FALLOC_FL_COLLAPSE_RANGE, libc::FALLOC_FL_INSERT_RANGE] {
        assert_eq!(fallocate(mode, 0, 4096), libc::EOPNOTSUPP);
    }
    // st_blocks counts the 4 KiB blocks stored or preallocated, not the
    // holes: of the 49 blocks preallocated, the three whole blocks the
    // punch freed (7-9) are holes; ext4 gives the same count.
    assert_eq!(fs::metadata(&path).unwrap().blocks(), 46 * 8);
    // Truncating to the size frees the preallocation past it (22 blocks
    // from 27 on), as ext4 does; every byte still reads the same.
    let before_cut = fs::read(&path).unwrap();
    f.set_len(110_000).unwrap();
    assert_eq!(fs::metadata(&path).unwrap().blocks(), (46 - 22) * 8);
    assert_eq!(fs::read(&path).unwrap(), before_cut);
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/x"), b"x").unwrap();
    assert_eq!(fs::metadata(m.path("d")).unwrap().len(), 0);
    drop(f);
    m.unmount_fsck_clean("after punched and zeroed ranges");
}

#[test]
fn writeback_mounts_keep_data_and_sizes() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-writeback", &["writeback"]);
    let path = m.path("f");
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap();
    for i in 0..100u8 {
        f.write_all(&[i; 100]).unwrap();
    }
    drop(f);
    let data = fs::read(&path).unwrap();
    assert_eq!(data.len(), 10_000);
    assert!(data
        .chunks(100)
        .enumerate()
        .all(|(i, c)| c == [i as u8; 100]));
    let m = m.remount(&[]);
    assert_eq!(fs::read(m.path("f")).unwrap(), data);
    m.unmount();
}

#[test]
fn limits_give_the_documented_errors() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-limits", &[]);
    let long = "n".repeat(255);
    fs::write(m.path(&long), b"ok").unwrap();
    assert_eq!(
        err_of(fs::write(m.path(&"n".repeat(256)), b"x")),
        libc::ENAMETOOLONG
    );
    let f = File::create(m.path("big")).unwrap();
    assert_eq!(err_of(f.set_len(1 << 50)), 0);
    assert_eq!(err_of(f.set_len((1 << 50) + 1)), libc::EFBIG);
    drop(f);
    let p = m.path("big");
    assert_eq!(set_xattr(&p, "user.v", &vec![0; 65536], 0), Ok(()));
    assert_eq!(
        set_xattr(&p, "user.v", &vec![0; 65537], 0),
        Err(libc::E2BIG)
    );
    m.unmount();
}

#[test]
fn unsupported_features_say_so() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-unsupported", &[]);
    fs::create_dir(m.path("d")).unwrap();
    let p = m.path("f");
    fs::write(&p, b"f").unwrap();
    // FIEMAP: FUSE does not carry it.
    let f = File::open(&p).unwrap();
    #[repr(C)]
    struct Fiemap {
        start: u64,
        length: u64,
        flags: u32,
        mapped: u32,
        count: u32,
        reserved: u32,
    }
    let mut map = Fiemap {
        start: 0,
        length: u64::MAX,
        flags: 0,
        mapped: 0,
        count: 0,
        reserved: 0,
    };
    const FS_IOC_FIEMAP: libc::c_ulong = 0xc020_660b;
    use std::os::fd::AsRawFd;
    // SAFETY: valid descriptor and a fiemap header with no extents.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_FIEMAP, &mut map) };
    assert_eq!((r, errno()), (-1, libc::EOPNOTSUPP), "FIEMAP");
    drop(f);
    m.unmount();
}

#[test]
fn set_id_bits_follow_the_callers_primary_group() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-setid", &[]);
    let p = m.path("f");
    fs::write(&p, b"data").unwrap();
    let c = cstr(&p);
    // SAFETY: a valid path; owner 65534, group 65532, then the mode (the
    // chown would clear set-ID bits).
    unsafe {
        assert_eq!(libc::chown(c.as_ptr(), 65534, 65532), 0);
        assert_eq!(libc::chmod(c.as_ptr(), 0o2666), 0);
        assert_eq!(libc::chmod(cstr(&m.dir).as_ptr(), 0o777), 0);
    }
    // Another user whose primary group is not the file's, in the file's
    // group only as a supplementary group: Linux would keep set-group-ID.
    let status = std::process::Command::new("setpriv")
        .args(["--reuid=65533", "--regid=65533", "--groups=65532"])
        .args(["sh", "-c", &format!("printf x >> '{}'", p.display())])
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, 0o666);
}

#[test]
fn directory_offsets_survive_seeks_and_changes() {
    if !fuse_available() {
        return;
    }
    let (_s, m) = mounted("sem-offsets", &[]);
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    for i in 0..300 {
        fs::write(d.join(format!("e{i:03}")), b"").unwrap();
    }
    let dir = cstr(&d);
    // SAFETY: opendir/readdir/telldir/seekdir on a stream we own and close.
    unsafe {
        let stream = libc::opendir(dir.as_ptr());
        assert!(!stream.is_null());
        let mut listing = Vec::new();
        loop {
            let pos = libc::telldir(stream);
            let e = libc::readdir(stream);
            if e.is_null() {
                break;
            }
            let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr()).to_owned();
            listing.push((pos, name));
        }
        assert_eq!(listing.len(), 302);
        // Changes elsewhere in the directory, then seeks backwards and
        // forwards: each position lists from its entry on.
        fs::remove_file(d.join("e150")).unwrap();
        fs::write(d.join("zz-new"), b"").unwrap();
        for &i in &[250usize, 10, 299, 2] {
            libc::seekdir(stream, listing[i].0);
            let e = libc::readdir(stream);
            assert!(!e.is_null(), "seekdir to entry {i} ended the listing");
            let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr());
            assert_eq!(name, listing[i].1.as_c_str(), "seekdir to entry {i}");
        }
        libc::closedir(stream);
    }
}

/// An ACL in the kernel's xattr form: (tag, permissions, id) entries.
fn acl_bytes(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut out = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        out.extend_from_slice(&tag.to_le_bytes());
        out.extend_from_slice(&perm.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

/// The (tag, permissions, id) entries of an ACL in xattr form.
fn acl_entries(bytes: &[u8]) -> Vec<(u16, u16, u32)> {
    assert_eq!(bytes.get(..4), Some(&2u32.to_le_bytes()[..]), "{bytes:?}");
    bytes[4..]
        .chunks_exact(8)
        .map(|c| {
            let tag = u16::from_le_bytes([c[0], c[1]]);
            let id = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
            let id = if tag == 0x02 || tag == 0x08 {
                id
            } else {
                u32::MAX
            };
            (tag, u16::from_le_bytes([c[2], c[3]]), id)
        })
        .collect()
}

/// Runs `script` with sh as `uid` (group `uid`, no other groups).
fn as_user(uid: u32, script: &str) -> bool {
    std::process::Command::new("setpriv")
        .args([
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".to_string(),
        ])
        .args(["sh", "-c", script])
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
        .success()
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn posix_acls_are_enforced_and_follow_the_mode() {
    if !fuse_available() {
        return;
    }
    const ACCESS: &str = "system.posix_acl_access";
    const DEFAULT: &str = "system.posix_acl_default";
    const NONE: u32 = u32::MAX;
    let (user_obj, user, group_obj, mask, other) = (0x01, 0x02, 0x04, 0x10, 0x20);
    let (alice, bob) = (65531, 65530);
    let (_s, m) = mounted("sem-acl", &[]);
    let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o7777;
    let reads = |uid, p: &Path| as_user(uid, &format!("cat '{}' > /dev/null", p.display()));
    let f = m.path("f");
    fs::write(&f, b"secret").unwrap();
    chmod(&f, 0o644);
    assert!(reads(alice, &f) && reads(bob, &f));

    // An ACL that shuts one user out: the kernel enforces it.
    let shut_out = acl_bytes(&[
        (user_obj, 6, NONE),
        (user, 0, alice),
        (group_obj, 4, NONE),
        (mask, 4, NONE),
        (other, 4, NONE),
    ]);
    set_xattr(&f, ACCESS, &shut_out, 0).unwrap();
    assert!(!reads(alice, &f), "the ACL must shut alice out");
    assert!(reads(bob, &f));
    assert_eq!(mode(&f), 0o644);
    assert_eq!(get_xattr(&f, ACCESS, 4096).unwrap(), shut_out);

    // chmod rewrites the owner, mask and other entries.
    chmod(&f, 0o600);
    assert!(!reads(bob, &f));
    assert_eq!(
        acl_entries(&get_xattr(&f, ACCESS, 4096).unwrap()),
        [
            (user_obj, 6, NONE),
            (user, 0, alice),
            (group_obj, 4, NONE),
            (mask, 0, NONE),
            (other, 0, NONE)
        ]
    );
    // Setting an ACL sets the mode: group bits from the mask.
    let wide = acl_bytes(&[
        (user_obj, 6, NONE),
        (user, 0, alice),
        (group_obj, 4, NONE),
        (mask, 7, NONE),
        (other, 5, NONE),
    ]);
    set_xattr(&f, ACCESS, &wide, 0).unwrap();
    assert_eq!(mode(&f), 0o675);
    assert!(reads(bob, &f) && !reads(alice, &f));
    // An ACL the mode says exactly is not kept as one.
    let minimal = acl_bytes(&[(user_obj, 6, NONE), (group_obj, 4, NONE), (other, 0, NONE)]);
    set_xattr(&f, ACCESS, &minimal, 0).unwrap();
    assert_eq!(mode(&f), 0o640);
    assert_eq!(get_xattr(&f, ACCESS, 4096), Err(libc::ENODATA));
    assert!(!reads(alice, &f) && !reads(bob, &f));
    // Malformed ACLs are refused.
    let named_without_mask = acl_bytes(&[
        (user_obj, 6, NONE),
        (user, 4, alice),
        (group_obj, 4, NONE),
        (other, 0, NONE),
    ]);
    assert_eq!(
        set_xattr(&f, ACCESS, &named_without_mask, 0),
        Err(libc::EINVAL)
    );

    // Default ACLs: inherited by new files and directories, masked by the
    // requested mode; the umask does not apply.
    let d = m.path("d");
    fs::create_dir(&d).unwrap();
    chmod(&d, 0o755);
    let default = acl_bytes(&[
        (user_obj, 7, NONE),
        (user, 7, alice),
        (group_obj, 5, NONE),
        (mask, 7, NONE),
        (other, 0, NONE),
    ]);
    set_xattr(&d, DEFAULT, &default, 0).unwrap();
    assert_eq!(set_xattr(&f, DEFAULT, &default, 0), Err(libc::EACCES));
    let made = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 077 && touch '{0}/new' && mkdir '{0}/sub'",
            d.display()
        ))
        .status()
        .unwrap();
    assert!(made.success());
    let new = d.join("new");
    assert_eq!(mode(&new), 0o660);
    assert_eq!(
        acl_entries(&get_xattr(&new, ACCESS, 4096).unwrap()),
        [
            (user_obj, 6, NONE),
            (user, 7, alice),
            (group_obj, 5, NONE),
            (mask, 6, NONE),
            (other, 0, NONE)
        ]
    );
    assert_eq!(get_xattr(&new, DEFAULT, 4096), Err(libc::ENODATA));
    assert!(as_user(alice, &format!("printf x >> '{}'", new.display())));
    assert!(!as_user(bob, &format!("printf x >> '{}'", new.display())));
    let sub = d.join("sub");
    assert_eq!(mode(&sub), 0o770);
    assert_eq!(get_xattr(&sub, DEFAULT, 4096).unwrap(), default);
    // Without a default ACL, the umask.
    let plain = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 027 && touch '{}'",
            m.path("plain").display()
        ))
        .status()
        .unwrap();
    assert!(plain.success());
    assert_eq!(mode(&m.path("plain")), 0o640);

    // The owner sets an ACL while outside the file's group: set-group-ID
    // goes, as chmod would drop it.
    let g = m.path("g");
    fs::write(&g, b"g").unwrap();
    std::os::unix::fs::chown(&g, Some(alice), Some(0)).unwrap();
    chmod(&g, 0o2770);
    let value: String = minimal.iter().map(|b| format!("\\x{b:02x}")).collect();
    assert!(as_user(
        alice,
        &format!(
            "python3 -c \"import os; os.setxattr('{}', '{ACCESS}', b'{value}')\"",
            g.display()
        )
    ));
    assert_eq!(mode(&g), 0o640);

    // All of it survives a remount.
    let m = m.remount(&[]);
    assert_eq!(mode(&m.path("f")), 0o640);
    assert_eq!(get_xattr(&m.path("d"), DEFAULT, 4096).unwrap(), default);
    assert!(reads(alice, &m.path("d/new")));
    assert!(!reads(bob, &m.path("d/new")));
    m.unmount_fsck_clean("after ACLs");
}
