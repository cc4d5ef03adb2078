//! Seeded random operations applied to a mounted betreefs and to a
//! reference directory on tmpfs: every result and errno must agree, and
//! the two trees (paths, types, sizes, modes, link counts, contents,
//! symlink targets, xattrs) must be identical at checkpoints along the way
//! and after a remount.
//!
//! BETREEFS_DIFF_SEEDS (default 3) and BETREEFS_DIFF_OPS (default 3000)
//! make it run longer.

mod common;

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
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
}

fn random_op(rng: &mut SmallRng, reference: &Path) -> Op {
    let (dirs, others) = listing(reference);
    let any: Vec<PathBuf> = dirs.iter().skip(1).chain(&others).cloned().collect();
    let new_path = |rng: &mut SmallRng| pick(rng, &dirs).join(name(rng));
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
        92..=97 => Op::SetXattr {
            path: existing(rng),
            name: pick(rng, &["user.a", "user.b", "user.long.name"]).to_string(),
            value: vec![rng.gen(); rng.gen_range(0..300)],
        },
        _ => Op::RemoveXattr {
            path: existing(rng),
            name: pick(rng, &["user.a", "user.b"]).to_string(),
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
    }
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
        let mut m = Mount::start(&image, &s.0.join("mnt"), &[]);
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut succeeded = 0;
        for i in 0..ops {
            let op = random_op(&mut rng, &reference);
            let want = apply(&reference, &op);
            let got = apply(&m.dir, &op);
            assert_eq!(got, want, "seed {seed} op {i}: {op:?}");
            succeeded += u64::from(got.is_ok());
            if i % 500 == 499 {
                assert_same(&reference, &m.dir, &format!("seed {seed} after op {i}"));
            }
            if i == ops / 2 {
                // Remount half-way: everything must come back the same.
                let (img, dir) = (m.image.clone(), m.dir.clone());
                m.unmount();
                m = Mount::start(&img, &dir, &[]);
                assert_same(&reference, &m.dir, &format!("seed {seed} after remount"));
            }
        }
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
