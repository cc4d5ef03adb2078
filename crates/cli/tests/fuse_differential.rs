//! Seeded random operations applied to a mounted betreefs and to a
//! reference directory on tmpfs: every result and errno must agree, every
//! operation must mark the same timestamps for update (POSIX: which of
//! mtime and ctime of the file and its parent directories change), and the
//! two trees (paths, types, sizes, modes, link counts, contents, symlink
//! targets, xattrs) must be identical at checkpoints along the way and
//! after a remount.
//!
//! BETREEFS_DIFF_SEEDS (default 3) and BETREEFS_DIFF_OPS (default 3000)
//! make it run longer.
//!
//! The same comparison runs with several client processes on one mount at
//! once, each in its own directory against its own reference; then the
//! clients race on shared names, where only the file system's consistency
//! can be checked (BETREEFS_DIFF_CLIENTS, default 4, and
//! BETREEFS_DIFF_CLIENT_OPS, default 1500).

mod common;

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const NAMES: &[&[u8]] = &[
    b"a",
    b"b",
    b"c",
    b"dir",
    b"x\x01y",
    b"\x02",
    b"\xff\xfe",
    b"long-name-long-name-long-name-long-name-long-name-long-name-long-name-long-name",
];

/// Every directory and every non-directory below `root` (relative paths).
fn listing(root: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut dirs = vec![PathBuf::new()];
    let mut others = Vec::new();
    let mut i = 0;
    while i < dirs.len() {
        let d = root.join(&dirs[i]);
        let mut entries: Vec<_> = fs::read_dir(&d).unwrap().map(|e| e.unwrap()).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let rel = dirs[i].join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                dirs.push(rel);
            } else {
                others.push(rel);
            }
        }
        i += 1;
    }
    (dirs, others)
}

fn xattrs(p: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
    let names = list_xattr(p).unwrap_or_default();
    let mut out: Vec<_> = names
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| {
            let name = String::from_utf8_lossy(n).into_owned();
            (n.to_vec(), get_xattr(p, &name, 65536).unwrap_or_default())
        })
        .collect();
    out.sort();
    out
}

/// Everything compared about a tree.
fn snapshot(root: &Path) -> Vec<String> {
    let (dirs, others) = listing(root);
    let mut out = Vec::new();
    for rel in dirs.iter().skip(1).chain(&others) {
        let p = root.join(rel);
        let m = fs::symlink_metadata(&p).unwrap();
        let what = if m.is_dir() {
            format!("dir mode={:o} nlink={}", m.mode(), m.nlink())
        } else if m.file_type().is_symlink() {
            format!("symlink {:?}", fs::read_link(&p).unwrap())
        } else if !m.is_file() {
            // Opening a FIFO would wait for a writer.
            format!("special mode={:o} nlink={}", m.mode(), m.nlink())
        } else {
            let data = fs::read(&p).unwrap();
            format!(
                "file mode={:o} nlink={} size={} crc={:08x}",
                m.mode(),
                m.nlink(),
                data.len(),
                crc(&data)
            )
        };
        out.push(format!("{:?}: {what} xattrs={:?}", rel, xattrs(&p)));
    }
    out
}

fn pick<'a, T>(rng: &mut SmallRng, v: &'a [T]) -> &'a T {
    &v[rng.gen_range(0..v.len())]
}

fn name(rng: &mut SmallRng) -> &'static std::ffi::OsStr {
    std::ffi::OsStr::from_bytes(NAMES[rng.gen_range(0..NAMES.len())])
}

/// One random operation, described and applied to a root.
#[derive(Debug, Clone)]
enum Op {
    Write {
        path: PathBuf,
        offset: u64,
        len: usize,
        byte: u8,
    },
    Truncate {
        path: PathBuf,
        size: u64,
    },
    Mkdir {
        path: PathBuf,
    },
    Rmdir {
        path: PathBuf,
    },
    Unlink {
        path: PathBuf,
    },
    Rename {
        from: PathBuf,
        to: PathBuf,
        flags: u32,
    },
    Link {
        from: PathBuf,
        to: PathBuf,
    },
    Symlink {
        target: PathBuf,
        path: PathBuf,
    },
    Chmod {
        path: PathBuf,
        mode: u32,
    },
    SetXattr {
        path: PathBuf,
        name: String,
        value: Vec<u8>,
    },
    RemoveXattr {
        path: PathBuf,
        name: String,
    },
    /// open(O_WRONLY | O_CREAT | O_TRUNC), then close.
    OpenTruncate {
        path: PathBuf,
    },
    Read {
        path: PathBuf,
    },
    List {
        path: PathBuf,
    },
    Stat {
        path: PathBuf,
    },
    Mkfifo {
        path: PathBuf,
    },
    /// What `cp` does: open the target with O_TRUNC, then copy_file_range
    /// of the whole source (a range clone on betreefs when whole blocks).
    CopyFile {
        from: PathBuf,
        to: PathBuf,
    },
}

impl Op {
    /// The paths whose timestamps the operation may touch: its operands
    /// and their parent directories.
    fn affected(&self) -> Vec<PathBuf> {
        let operands: Vec<&PathBuf> = match self {
            Op::Rename { from, to, .. } | Op::Link { from, to } | Op::CopyFile { from, to } => {
                vec![from, to]
            }
            Op::Symlink { path, .. }
            | Op::Write { path, .. }
            | Op::Truncate { path, .. }
            | Op::Mkdir { path }
            | Op::Rmdir { path }
            | Op::Unlink { path }
            | Op::Chmod { path, .. }
            | Op::SetXattr { path, .. }
            | Op::RemoveXattr { path, .. }
            | Op::OpenTruncate { path }
            | Op::Read { path }
            | Op::List { path }
            | Op::Stat { path }
            | Op::Mkfifo { path } => vec![path],
        };
        let mut out = Vec::new();
        for p in operands {
            out.push(p.clone());
            out.push(p.parent().map(Path::to_path_buf).unwrap_or_default());
        }
        out
    }
}

fn random_op(rng: &mut SmallRng, reference: &Path) -> Op {
    let (dirs, others) = listing(reference);
    random_op_among(rng, &dirs, &others)
}

/// A random operation on the directories `dirs` (the first is the root)
/// and the other entries `others`, or on new names in those directories.
fn random_op_among(rng: &mut SmallRng, dirs: &[PathBuf], others: &[PathBuf]) -> Op {
    let any: Vec<PathBuf> = dirs.iter().skip(1).chain(others).cloned().collect();
    let new_path = |rng: &mut SmallRng| pick(rng, dirs).join(name(rng));
    let existing = |rng: &mut SmallRng| {
        if any.is_empty() || rng.gen_bool(0.2) {
            new_path(rng)
        } else {
            pick(rng, &any).clone()
        }
    };
    match rng.gen_range(0..100) {
        0..=29 => Op::Write {
            path: existing(rng),
            offset: *pick(rng, &[0u64, 1, 4095, 4096, 8190, 100_000, 1 << 20])
                + rng.gen_range(0..3),
            len: *pick(rng, &[1usize, 4, 100, 4096, 5000, 70_000]),
            byte: rng.gen(),
        },
        30..=37 => Op::Truncate {
            path: existing(rng),
            size: *pick(rng, &[0u64, 1, 4095, 4097, 50_000]),
        },
        38..=49 => Op::Mkdir {
            path: new_path(rng),
        },
        50..=54 => Op::Rmdir {
            path: existing(rng),
        },
        55..=61 => Op::Unlink {
            path: existing(rng),
        },
        62..=77 => Op::Rename {
            from: existing(rng),
            to: if rng.gen_bool(0.5) {
                existing(rng)
            } else {
                new_path(rng)
            },
            flags: *pick(
                rng,
                &[0u32, 0, 0, libc::RENAME_NOREPLACE, libc::RENAME_EXCHANGE],
            ),
        },
        78..=83 => Op::Link {
            from: existing(rng),
            to: new_path(rng),
        },
        84..=86 => Op::Symlink {
            target: existing(rng),
            path: new_path(rng),
        },
        87..=91 => Op::Chmod {
            path: existing(rng),
            mode: *pick(rng, &[0o644u32, 0o600, 0o755, 0o2755]),
        },
        92..=94 => Op::SetXattr {
            path: existing(rng),
            name: pick(rng, &["user.a", "user.b", "user.long.name"]).to_string(),
            value: vec![rng.gen(); rng.gen_range(0..300)],
        },
        95 => Op::RemoveXattr {
            path: existing(rng),
            name: pick(rng, &["user.a", "user.b"]).to_string(),
        },
        96 => Op::OpenTruncate {
            path: existing(rng),
        },
        97 => match rng.gen_range(0..3) {
            0 => Op::Read {
                path: existing(rng),
            },
            1 => Op::List {
                path: pick(rng, dirs).clone(),
            },
            _ => Op::Stat {
                path: existing(rng),
            },
        },
        98 => Op::Mkfifo {
            path: new_path(rng),
        },
        _ => Op::CopyFile {
            from: existing(rng),
            to: existing(rng),
        },
    }
}

fn libc_result(r: i64) -> Result<(), i32> {
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

fn io_result<T>(r: std::io::Result<T>) -> Result<(), i32> {
    r.map(|_| ()).map_err(|e| e.raw_os_error().unwrap_or(-1))
}

fn apply(root: &Path, op: &Op) -> Result<(), i32> {
    let at = |p: &PathBuf| root.join(p);
    match op {
        Op::Write {
            path,
            offset,
            len,
            byte,
        } => {
            // Never follow symlinks or open directories: they would diverge
            // only in how the test walks, not in the file system.
            let m = fs::symlink_metadata(at(path));
            if m.as_ref().is_ok_and(|m| !m.is_file()) {
                return Err(libc::EISDIR);
            }
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(at(path))
                .map_err(|e| e.raw_os_error().unwrap_or(-1))?;
            f.seek(SeekFrom::Start(*offset))
                .map_err(|e| e.raw_os_error().unwrap_or(-1))?;
            let data: Vec<u8> = (0..*len).map(|i| byte.wrapping_add(i as u8)).collect();
            io_result(f.write_all(&data))
        }
        Op::Truncate { path, size } => {
            if fs::symlink_metadata(at(path)).is_ok_and(|m| !m.is_file()) {
                return Err(libc::EISDIR);
            }
            let c = cstr(&at(path));
            // SAFETY: valid path.
            libc_result(unsafe { libc::truncate(c.as_ptr(), *size as i64) } as i64)
        }
        Op::Mkdir { path } => io_result(fs::create_dir(at(path))),
        Op::Rmdir { path } => io_result(fs::remove_dir(at(path))),
        Op::Unlink { path } => io_result(fs::remove_file(at(path))),
        Op::Rename { from, to, flags } => match renameat2(&at(from), &at(to), *flags) {
            0 => Ok(()),
            e => Err(e),
        },
        Op::Link { from, to } => io_result(fs::hard_link(at(from), at(to))),
        Op::Symlink { target, path } => io_result(std::os::unix::fs::symlink(target, at(path))),
        Op::Chmod { path, mode } => {
            if fs::symlink_metadata(at(path)).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(libc::ELOOP);
            }
            io_result(fs::set_permissions(
                at(path),
                fs::Permissions::from_mode(*mode),
            ))
        }
        Op::SetXattr { path, name, value } => set_xattr(&at(path), name, value, 0),
        Op::RemoveXattr { path, name } => remove_xattr(&at(path), name),
        Op::OpenTruncate { path } => {
            if fs::symlink_metadata(at(path)).is_ok_and(|m| !m.is_file()) {
                return Err(libc::EISDIR);
            }
            io_result(
                OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(at(path)),
            )
        }
        Op::Read { path } => {
            if fs::symlink_metadata(at(path)).is_ok_and(|m| !m.is_file()) {
                return Err(libc::EISDIR);
            }
            let mut data = Vec::new();
            io_result(fs::File::open(at(path)).and_then(|mut f| f.read_to_end(&mut data)))
        }
        Op::List { path } => io_result(fs::read_dir(at(path)).map(|d| d.count())),
        Op::Stat { path } => io_result(fs::symlink_metadata(at(path))),
        Op::Mkfifo { path } => {
            let c = cstr(&at(path));
            // SAFETY: valid path.
            libc_result(unsafe { libc::mkfifo(c.as_ptr(), 0o644) } as i64)
        }
        Op::CopyFile { from, to } => {
            for p in [from, to] {
                if fs::symlink_metadata(at(p)).is_ok_and(|m| !m.is_file()) {
                    return Err(libc::EISDIR);
                }
            }
            let src = fs::File::open(at(from)).map_err(|e| e.raw_os_error().unwrap_or(-1))?;
            let dst = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(at(to))
                .map_err(|e| e.raw_os_error().unwrap_or(-1))?;
            loop {
                // SAFETY: two open descriptors; null offsets use (and
                // advance) the files' own.
                let n = unsafe {
                    libc::copy_file_range(
                        src.as_raw_fd(),
                        std::ptr::null_mut(),
                        dst.as_raw_fd(),
                        std::ptr::null_mut(),
                        1 << 30,
                        0,
                    )
                };
                match n {
                    0 => return Ok(()),
                    n if n < 0 => return Err(errno()),
                    _ => {}
                }
            }
        }
    }
}

/// The mtime and ctime of each existing path, by inode (a file reached
/// by two names counts once), labelled with the first path naming it.
fn times(root: &Path, paths: &[PathBuf]) -> HashMap<u64, Times> {
    times_by(root, paths, |path| {
        let m = fs::symlink_metadata(path).ok()?;
        Some((
            m.ino(),
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec(),
        ))
    })
}

/// A path (relative to the root) and its mtime and ctime (seconds,
/// nanoseconds), by inode number.
type Times = (PathBuf, i64, i64, i64, i64);

/// [`times`] with `stat` telling a path's inode number, mtime and ctime.
fn times_by(
    root: &Path,
    paths: &[PathBuf],
    stat: impl Fn(&Path) -> Option<(u64, i64, i64, i64, i64)>,
) -> HashMap<u64, Times> {
    let mut out = HashMap::new();
    for rel in paths {
        if let Some((ino, ms, mn, cs, cn)) = stat(&root.join(rel)) {
            out.entry(ino).or_insert((rel.clone(), ms, mn, cs, cn));
        }
    }
    out
}

/// [`times`] by statx(2) with `AT_STATX_FORCE_SYNC`: what the daemon
/// says now, whatever the kernel has cached.
fn forced_times(root: &Path, paths: &[PathBuf]) -> HashMap<u64, Times> {
    times_by(root, paths, |path| {
        let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
        // SAFETY: a zeroed statx is a valid buffer for statx(2) to fill.
        let mut sx: libc::statx = unsafe { std::mem::zeroed() };
        // SAFETY: path is NUL-terminated and sx is a valid out buffer.
        let r = unsafe {
            libc::statx(
                libc::AT_FDCWD,
                path.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW | libc::AT_STATX_FORCE_SYNC,
                libc::STATX_BASIC_STATS,
                &mut sx,
            )
        };
        (r == 0).then(|| {
            let (m, c) = (sx.stx_mtime, sx.stx_ctime);
            (
                sx.stx_ino,
                m.tv_sec,
                i64::from(m.tv_nsec),
                c.tv_sec,
                i64::from(c.tv_nsec),
            )
        })
    })
}

/// tmpfs takes timestamps from the coarse clock: two changes within one
/// tick can get the same time, and a change would look like none. Wait
/// until the coarse clock is past every timestamp about to be compared.
fn wait_for_coarse_clock_past(before: &HashMap<u64, Times>) {
    let newest = before
        .values()
        .flat_map(|(_, ms, mn, cs, cn)| [(*ms, *mn), (*cs, *cn)])
        .max();
    let Some(newest) = newest else { return };
    loop {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: now is a valid timespec for clock_gettime to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut now) };
        if (now.tv_sec, now.tv_nsec) > newest {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(500));
    }
}

/// Which timestamps an operation changed: (path before, "mtime"/"ctime").
fn changed(
    before: &HashMap<u64, Times>,
    after: &HashMap<u64, Times>,
) -> BTreeSet<(PathBuf, &'static str)> {
    let mut out = BTreeSet::new();
    for (ino, (label, ms, mn, cs, cn)) in before {
        if let Some((_, ams, amn, acs, acn)) = after.get(ino) {
            if (ms, mn) != (ams, amn) {
                out.insert((label.clone(), "mtime"));
            }
            if (cs, cn) != (acs, acn) {
                out.insert((label.clone(), "ctime"));
            }
        }
    }
    out
}

fn assert_same(reference: &Path, subject: &Path, context: &str) {
    let (want, got) = (snapshot(reference), snapshot(subject));
    if want != got {
        let missing: Vec<_> = want.iter().filter(|w| !got.contains(w)).collect();
        let extra: Vec<_> = got.iter().filter(|g| !want.contains(g)).collect();
        panic!("{context}: trees differ\nreference only: {missing:#?}\nbetreefs only: {extra:#?}");
    }
}

#[test]
fn random_operations_match_tmpfs() {
    if !fuse_available() {
        return;
    }
    let seeds = env_u64("BETREEFS_DIFF_SEEDS", 3);
    let ops = env_u64("BETREEFS_DIFF_OPS", 3000);
    for seed in 0..seeds {
        let s = Scratch::new("diff");
        let reference = PathBuf::from(format!(
            "/dev/shm/betreefs-diff-{}-{seed}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&reference);
        fs::create_dir(&reference).unwrap();
        let image = s.0.join("img");
        mkfs(&image, "512M");
        // Seeds take turns with the transports.
        let transports = transports();
        let transport = transports[seed as usize % transports.len()];
        // Odd seeds run their first half with every unused entry the
        // kernel holds released as the releaser comes by (each 50 ms): the
        // kernel looks names up again between the operations.
        let releasing = seed % 2 == 1;
        let env: &[(&str, &str)] = if releasing {
            &[("BETREEFS_TEST_TABLE_LIMIT", "1")]
        } else {
            &[]
        };
        let mut m = Mount::start_with_env(&image, &s.0.join("mnt"), &[transport], env);
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut succeeded = run_ops(&reference, &m.dir, &mut rng, 0..ops / 2 + 1, seed);
        if releasing {
            let released = fuse_counter(&m.dir, "released_entries");
            assert!(released > 0, "seed {seed}: no entry was released");
            eprintln!("seed {seed}: {released} entries released in the first half");
        }
        // Remount half-way: everything must come back the same.
        m = m.remount(&[]);
        assert_same(&reference, &m.dir, &format!("seed {seed} after remount"));
        succeeded += run_ops(&reference, &m.dir, &mut rng, ops / 2 + 1..ops, seed);
        assert_same(&reference, &m.dir, &format!("seed {seed} at the end"));
        // The workload must mostly do things, not mostly fail.
        assert!(
            succeeded * 3 > ops,
            "seed {seed}: only {succeeded} of {ops} operations succeeded"
        );
        eprintln!(
            "seed {seed}: {succeeded} of {ops} operations succeeded; {} entries",
            snapshot(&reference).len()
        );
        m.unmount();
        assert_fsck_clean(&image, &format!("seed {seed}"));
        fs::remove_dir_all(&reference).unwrap();
    }
}

/// Applies operations number `range` of the sequence `rng` draws (from
/// what `reference` holds) to `reference` and to `subject`: results and
/// the timestamps marked for update must agree, and the trees every 500
/// operations. How many succeeded.
fn run_ops(
    reference: &Path,
    subject: &Path,
    rng: &mut SmallRng,
    range: std::ops::Range<u64>,
    seed: u64,
) -> u64 {
    let mut succeeded = 0;
    for i in range {
        let op = random_op(rng, reference);
        let affected = op.affected();
        // truncate(2) to the size a file has already: POSIX and ext4 or
        // XFS mark nothing, while tmpfs marks both times when the file
        // has pages (it runs its page truncation anyway). betreefs
        // follows POSIX; such operations are not compared.
        let same_size_truncate = matches!(&op, Op::Truncate { path, size }
            if fs::symlink_metadata(reference.join(path)).is_ok_and(|m| m.is_file() && m.len() == *size));
        let (ref_before, sub_before) = (times(reference, &affected), times(subject, &affected));
        wait_for_coarse_clock_past(&ref_before);
        let want = apply(reference, &op);
        let got = apply(subject, &op);
        assert_eq!(got, want, "seed {seed} op {i}: {op:?}");
        let (ref_after, sub_after) = (times(reference, &affected), times(subject, &affected));
        let want_marked = changed(&ref_before, &ref_after);
        let got_marked = changed(&sub_before, &sub_after);
        if got_marked != want_marked && !same_size_truncate {
            // Asked of the daemon again, past the kernel's cache: tells a
            // stale cached attribute from a wrong one in the daemon.
            eprintln!(
                "reference before {ref_before:?}\nafter {ref_after:?}\n\
                 betreefs before {sub_before:?}\nafter {sub_after:?}\n\
                 betreefs from the daemon now {:?}",
                forced_times(subject, &affected)
            );
        }
        assert!(
            got_marked == want_marked || same_size_truncate,
            "seed {seed} op {i}: {op:?} ({want:?}) marked other timestamps for update:\n\
             betreefs {got_marked:?}\ntmpfs {want_marked:?}"
        );
        succeeded += u64::from(got.is_ok());
        if i % 500 == 499 {
            assert_same(reference, subject, &format!("seed {seed} after op {i}"));
        }
    }
    succeeded
}

/// What a client process of [`concurrent_clients_match_tmpfs`] does.
const MODE_OWN_DIRECTORY: &str = "own-directory";
const MODE_RACING: &str = "racing";

/// Several client processes on one mount at once. First each works in its
/// own directory against its own reference on tmpfs (every result,
/// timestamp and tree compared as in [`random_operations_match_tmpfs`]),
/// before and after a remount, through each transport; then all of them
/// race on the same few names, where results depend on the interleaving:
/// no request may fail with an error the operation cannot give, and the
/// tree must come back the same after a remount and pass fsck — twice,
/// the second time with the kernel told to drop every unused entry as it
/// goes.
#[test]
fn concurrent_clients_match_tmpfs() {
    if is_client_process() {
        return run_client();
    }
    if !fuse_available() {
        return;
    }
    let clients = env_u64("BETREEFS_DIFF_CLIENTS", 4);
    let ops = env_u64("BETREEFS_DIFF_CLIENT_OPS", 1500);
    let s = Scratch::new("diff-clients");
    let image = s.0.join("img");
    mkfs(&image, "512M");
    let references = PathBuf::from(format!(
        "/dev/shm/betreefs-diff-clients-{}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&references);
    fs::create_dir(&references).unwrap();
    let mut m = Mount::start(&image, &s.0.join("mnt"), &[]);
    let run = |m: &Mount, mode: &str, round: u64| {
        let spawned = (0..clients)
            .map(|k| {
                let (subject, reference) = if mode == MODE_RACING {
                    (m.dir.join("shared"), PathBuf::new())
                } else {
                    (
                        m.dir.join(format!("c{k}")),
                        references.join(format!("c{k}")),
                    )
                };
                let vars = [
                    ("BETREEFS_CLIENT_MODE", mode.to_string()),
                    ("BETREEFS_CLIENT_SUBJECT", subject.display().to_string()),
                    ("BETREEFS_CLIENT_REFERENCE", reference.display().to_string()),
                    ("BETREEFS_CLIENT_SEED", (round * 1000 + k).to_string()),
                    ("BETREEFS_CLIENT_OPS", ops.to_string()),
                ];
                let log = s.0.join(format!("client-{mode}-{round}-{k}.log"));
                spawn_client("concurrent_clients_match_tmpfs", &vars, &log)
            })
            .collect();
        wait_for_clients(spawned, &format!("{mode} round {round}"));
    };
    for k in 0..clients {
        fs::create_dir(m.dir.join(format!("c{k}"))).unwrap();
        fs::create_dir(references.join(format!("c{k}"))).unwrap();
    }
    for (round, transport) in transports().into_iter().enumerate() {
        m = m.remount(&[transport]);
        for k in 0..clients {
            let name = format!("c{k}");
            assert_same(&references.join(&name), &m.dir.join(&name), &name);
        }
        run(&m, MODE_OWN_DIRECTORY, round as u64);
        for k in 0..clients {
            let name = format!("c{k}");
            assert_same(&references.join(&name), &m.dir.join(&name), &name);
        }
    }
    fs::create_dir(m.dir.join("shared")).unwrap();
    run(&m, MODE_RACING, 0);
    let before = snapshot(&m.dir);
    // A second racing round with every unused entry the kernel holds
    // released as the releaser comes by (each 50 ms): names are dropped
    // and looked up again while the clients create, rename and remove
    // them.
    m = m.remount_with_env(&[], &[("BETREEFS_TEST_TABLE_LIMIT", "1")]);
    let after = snapshot(&m.dir);
    assert!(
        before == after,
        "the racing clients' tree changed across a remount"
    );
    run(&m, MODE_RACING, 1);
    let released = fuse_counter(&m.dir, "released_entries");
    assert!(
        released > 0,
        "no entry was released in the second racing round"
    );
    eprintln!("{clients} clients: {released} entries released in the second racing round");
    let before = snapshot(&m.dir);
    m = m.remount(&[]);
    let after = snapshot(&m.dir);
    assert!(
        before == after,
        "the racing clients' tree changed across a remount after entries were released"
    );
    eprintln!(
        "{clients} clients: {} entries after the racing round",
        after.len()
    );
    m.unmount();
    assert_fsck_clean(&image, "after the concurrent clients");
    fs::remove_dir_all(&references).unwrap();
}

/// The client side of [`concurrent_clients_match_tmpfs`].
fn run_client() {
    let subject = PathBuf::from(client_var("BETREEFS_CLIENT_SUBJECT"));
    let seed: u64 = client_var("BETREEFS_CLIENT_SEED").parse().unwrap();
    let ops: u64 = client_var("BETREEFS_CLIENT_OPS").parse().unwrap();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mode = client_var("BETREEFS_CLIENT_MODE");
    if mode == MODE_OWN_DIRECTORY {
        let reference = PathBuf::from(client_var("BETREEFS_CLIENT_REFERENCE"));
        let succeeded = run_ops(&reference, &subject, &mut rng, 0..ops, seed);
        assert!(
            succeeded * 3 > ops,
            "seed {seed}: only {succeeded} of {ops} operations succeeded"
        );
        assert_same(&reference, &subject, &format!("seed {seed} at the end"));
        return;
    }
    assert_eq!(mode, MODE_RACING);
    // What these operations can give when another process changes the
    // names between (or during) the steps of one: anything else (EIO,
    // ESTALE, ENOTCONN...) is the file system's failure.
    const RACE_ERRNOS: &[i32] = &[
        libc::ENOENT,
        libc::EEXIST,
        libc::ENOTEMPTY,
        libc::ENOTDIR,
        libc::EISDIR,
        libc::EINVAL,
        libc::ENODATA,
        libc::ELOOP,
        libc::EPERM,
    ];
    let mut succeeded = 0;
    for i in 0..ops {
        let (dirs, others) = live_listing(&subject);
        // No FIFOs: a racing open could find one where it checked a file
        // and wait for a writer forever.
        let op = loop {
            match random_op_among(&mut rng, &dirs, &others) {
                Op::Mkfifo { .. } => continue,
                op => break op,
            }
        };
        match apply(&subject, &op) {
            Ok(()) => succeeded += 1,
            Err(e) => assert!(
                RACE_ERRNOS.contains(&e),
                "seed {seed} op {i}: {op:?} failed with errno {e}"
            ),
        }
    }
    assert!(
        succeeded * 5 > ops,
        "seed {seed}: only {succeeded} of {ops} racing operations succeeded"
    );
}

/// [`listing`] of a tree other processes are changing: what vanishes
/// while it is walked is left out.
fn live_listing(root: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut dirs = vec![PathBuf::new()];
    let mut others = Vec::new();
    let mut i = 0;
    while i < dirs.len() {
        if let Ok(entries) = fs::read_dir(root.join(&dirs[i])) {
            for e in entries.flatten() {
                let rel = dirs[i].join(e.file_name());
                match e.file_type() {
                    Ok(t) if t.is_dir() => dirs.push(rel),
                    Ok(_) => others.push(rel),
                    Err(_) => {}
                }
            }
        }
        i += 1;
    }
    (dirs, others)
}
