//! Whole images mutated as storage damages them — flipped bits, swapped
//! blocks, truncation, gaps in the log (dropped, duplicated, swapped and
//! re-lengthed records) — then opened and read end to end as a mount does.
//! Each mutant must be recovered (every file right), refused with a typed
//! error, or give EIO where data is damaged: never wrong data without an
//! error, never a panic. `fsck` must report every mutant whose reads fail.
//!
//! CI runs a bounded number; BETREEFS_MUTANTS sets how many per class and
//! BETREEFS_MUTATION_PATHS how many paths the base images hold (the
//! acceptance run: 1500 mutants of a 256 MiB image with ~4500 paths).

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use betreefs_engine::btt::BlockTable;
use betreefs_engine::{Options, Store};
use betreefs_fs::{AtimePolicy, Caller, FileSystem, Operations, ROOT_INO};
use betreefs_store::{CrashMode, MemDevice, Superblock, BLOCK_SIZE, LOG_RECORD_OVERHEAD_BYTES};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const ME: Caller = Caller::new(0, 0);

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn options() -> Options {
    Options {
        node_size: 256 << 10,
        basement_size: 32 << 10,
        cache_bytes: 8 << 20,
        log_flush_interval: None,
        checkpoint_interval: None,
        ..Options::default()
    }
}

/// What a path should hold.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Expect {
    Dir,
    File(Vec<u8>),
    Link(Vec<u8>),
}

type Tree = BTreeMap<Vec<Vec<u8>>, Expect>;

/// Builds a file system of `paths` paths; returns the image and what it
/// holds. `crashed`: the image is taken after a power cut with the last
/// part of the work in the log only (synced, not checkpointed).
fn base_image(paths: u64, crashed: bool, seed: u64) -> (Vec<u8>, Tree) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let bytes = match paths {
        0..=1000 => 48 << 20,
        1001..=2000 => 96 << 20,
        _ => 256 << 20,
    };
    let dev = MemDevice::new(bytes);
    let store = Store::create_on(Arc::new(dev.clone()), options()).unwrap();
    FileSystem::format(&store, ME).unwrap();
    let fs = FileSystem::mount(store, AtimePolicy::Noatime).unwrap();
    let mut tree: Tree = BTreeMap::new();
    let mut dirs: Vec<(Vec<Vec<u8>>, u64)> = vec![(Vec::new(), ROOT_INO)];
    for i in 0..paths {
        let (parent_path, parent) = dirs[rng.gen_range(0..dirs.len())].clone();
        let name = format!("n{i:05}-{}", rng.gen::<u16>()).into_bytes();
        let mut path = parent_path.clone();
        path.push(name.clone());
        match rng.gen_range(0..10) {
            0 if path.len() < 5 => {
                let ino = fs.mkdir(parent, &name, 0o755, ME).unwrap().ino;
                dirs.push((path.clone(), ino));
                tree.insert(path, Expect::Dir);
            }
            1 => {
                let target = format!("target-{i}").into_bytes();
                fs.symlink(parent, &name, &target, ME).unwrap();
                tree.insert(path, Expect::Link(target));
            }
            _ => {
                let len = match rng.gen_range(0..20) {
                    0 => rng.gen_range(20_000..300_000),
                    _ => rng.gen_range(0..9000),
                };
                let data: Vec<u8> = (0..len).map(|j| (i as usize * 7 + j * 13) as u8).collect();
                let (attr, fh) = fs.create(parent, &name, 0o644, 0, ME).unwrap();
                fs.write(attr.ino, fh, 0, &data, None).unwrap();
                fs.release(fh).unwrap();
                tree.insert(path, Expect::File(data));
            }
        }
        // Checkpoints now and then, so a crashed image has both nodes and
        // a log to replay.
        if i % 700 == 699 {
            fs.store().checkpoint().unwrap();
        }
    }
    fs.fsync().unwrap();
    if crashed {
        dev.power_off();
        let image = dev.crash_image(CrashMode::DropUnsynced);
        drop(fs);
        (image, tree)
    } else {
        fs.close().unwrap();
        (dev.current_image(), tree)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// Every path reads back right.
    Recovered,
    /// Opening or mounting failed with a typed error.
    Refused,
    /// Some reads failed with an error; nothing read was wrong.
    Detected,
    /// A read returned wrong data, or a name was missing or extra, with no error.
    SilentlyWrong,
    Panicked,
}

fn show(path: &[Vec<u8>]) -> String {
    path.iter()
        .map(|n| n.escape_ascii().to_string())
        .collect::<Vec<_>>()
        .join("/")
}

/// Looks a path up from the root.
fn resolve(fs: &FileSystem, path: &[Vec<u8>]) -> Result<u64, i32> {
    let mut ino = ROOT_INO;
    for name in path {
        ino = fs.lookup(ino, name).map_err(|e| e.0)?.ino;
    }
    Ok(ino)
}

/// Reads every expected path and lists every directory.
fn read_all(fs: &FileSystem, tree: &Tree) -> Outcome {
    let mut errors = 0;
    let mut wrong = Vec::new();
    for (path, want) in tree {
        let ino = match resolve(fs, path) {
            Ok(0) => {
                errors += 1;
                continue;
            }
            Ok(ino) => ino,
            Err(e) if e == libc::ENOENT => {
                wrong.push(format!("{} missing", show(path)));
                continue;
            }
            Err(_) => {
                errors += 1;
                continue;
            }
        };
        let got = match want {
            Expect::Dir => fs.getattr(ino).map(|a| a.is_dir()).map(|d| d.then_some(())),
            Expect::File(data) => fs
                .read_to_vec(ino, 0, data.len() as u32 + 1)
                .map(|d| (d == *data).then_some(())),
            Expect::Link(t) => fs.readlink(ino).map(|d| (d == *t).then_some(())),
        };
        match got {
            Ok(Some(())) => {}
            Ok(None) => wrong.push(format!("{} differs", show(path))),
            Err(_) => errors += 1,
        }
    }
    // Listings: no name missing or extra.
    let mut dirs: Vec<&Vec<Vec<u8>>> = tree
        .iter()
        .filter(|(_, e)| **e == Expect::Dir)
        .map(|(p, _)| p)
        .collect();
    let root = Vec::new();
    dirs.push(&root);
    for dir in dirs {
        let Ok(ino) = resolve(fs, dir) else {
            continue;
        };
        let mut names = Vec::new();
        let listed = fs.readdir(ino, 0, false, &mut |e| {
            if e.name != b"." && e.name != b".." {
                names.push(e.name.to_vec());
            }
            false
        });
        if listed.is_err() {
            errors += 1;
            continue;
        }
        let expected: Vec<Vec<u8>> = tree
            .keys()
            .filter(|p| p.len() == dir.len() + 1 && p.starts_with(dir))
            .map(|p| p[dir.len()].clone())
            .collect();
        names.sort();
        if names != expected {
            wrong.push(format!("listing of {} differs", show(dir)));
        }
    }
    if !wrong.is_empty() {
        eprintln!(
            "silently wrong ({}): {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(3)]
        );
        Outcome::SilentlyWrong
    } else if errors > 0 {
        Outcome::Detected
    } else {
        Outcome::Recovered
    }
}

fn open_and_read(image: Vec<u8>, tree: &Tree) -> Outcome {
    let run = || {
        let store = match Store::open_on(Arc::new(MemDevice::from_image(image)), options()) {
            Ok(s) => s,
            Err(_) => return Outcome::Refused,
        };
        let fs = match FileSystem::mount(store, AtimePolicy::Noatime) {
            Ok(fs) => fs,
            Err(_) => return Outcome::Refused,
        };
        read_all(&fs, tree)
    };
    std::panic::catch_unwind(AssertUnwindSafe(run)).unwrap_or(Outcome::Panicked)
}

/// fsck's verdict (read-only): whether it reports anything.
fn fsck_reports(image: Vec<u8>) -> bool {
    let run = || {
        let ro = Options {
            read_only: true,
            ..options()
        };
        let Ok(store) = Store::open_on(Arc::new(MemDevice::from_image(image)), ro) else {
            return true;
        };
        let recovery = store.recovery().clone();
        if recovery.hole.is_some() || recovery.damaged_superblock.is_some() {
            return true;
        }
        match store.verify() {
            Ok(v) if v.unreachable.is_empty() => {}
            _ => return true,
        }
        match betreefs_fs::fsck::check(&store, |_| {}) {
            Ok(r) => !r.is_clean(),
            Err(_) => true,
        }
    };
    std::panic::catch_unwind(AssertUnwindSafe(run)).unwrap_or(true)
}

/// The byte ranges of an image worth mutating: both superblocks, the block
/// table, every node, and the log from the head on.
fn live_ranges(image: &[u8]) -> Vec<(usize, usize)> {
    let sb = Superblock::read_newest(&MemDevice::from_image(image.to_vec())).unwrap();
    let mut ranges = vec![(0, 2 * BLOCK_SIZE)];
    let btt_at = sb.layout.extent_offset(sb.btt) as usize;
    ranges.push((btt_at, sb.btt.len as usize));
    let btt = BlockTable::decode(&image[btt_at..btt_at + sb.btt.len as usize]).unwrap();
    for (_, extent) in btt.extents() {
        ranges.push((
            sb.layout.extent_offset(extent) as usize,
            extent.len as usize,
        ));
    }
    let log_at = (sb.layout.log_offset + sb.log_head % sb.layout.log_bytes) as usize;
    let log_end = (sb.layout.log_offset + sb.layout.log_bytes) as usize;
    ranges.push((log_at, (log_end - log_at).min(1 << 20)));
    ranges
}

/// Records of the log from the head: (offset in the image, length).
fn log_records(image: &[u8]) -> Vec<(usize, usize)> {
    let sb = Superblock::read_newest(&MemDevice::from_image(image.to_vec())).unwrap();
    let region = (sb.layout.log_offset as usize, sb.layout.log_bytes as usize);
    let mut pos = sb.log_head as usize;
    let mut out = Vec::new();
    loop {
        let at = region.0 + pos % region.1;
        let len = u32::from_le_bytes(image[at..at + 4].try_into().unwrap()) as usize;
        let epoch = u32::from_le_bytes(image[at + 8..at + 12].try_into().unwrap());
        let total = len + LOG_RECORD_OVERHEAD_BYTES;
        if len == 0 || epoch != sb.log_epoch || at + total > region.0 + region.1 {
            break;
        }
        out.push((at, total));
        pos += total;
    }
    out
}

fn mutate(image: &[u8], class: &str, rng: &mut SmallRng) -> Option<Vec<u8>> {
    let mut m = image.to_vec();
    match class {
        "flip" => {
            let ranges = live_ranges(image);
            for _ in 0..rng.gen_range(1..=4) {
                let (at, len) = ranges[rng.gen_range(0..ranges.len())];
                let i = at + rng.gen_range(0..len.max(1));
                m[i] ^= 1 << rng.gen_range(0..8);
            }
        }
        "swap" => {
            let ranges = live_ranges(image);
            let block = |rng: &mut SmallRng| {
                let (at, len) = ranges[rng.gen_range(0..ranges.len())];
                (at + rng.gen_range(0..len.max(1))) / BLOCK_SIZE * BLOCK_SIZE
            };
            let (a, b) = (block(rng), block(rng));
            if a == b {
                return None;
            }
            let saved = m[a..a + BLOCK_SIZE].to_vec();
            m.copy_within(b..b + BLOCK_SIZE, a);
            m[b..b + BLOCK_SIZE].copy_from_slice(&saved);
        }
        "truncate" => {
            let keep = rng.gen_range(1..image.len() as u64) as usize;
            m.truncate(keep / 512 * 512);
        }
        "log-gap" => {
            let records = log_records(image);
            if records.len() < 3 {
                return None;
            }
            let i = rng.gen_range(1..records.len() - 1);
            let (at, len) = records[i];
            match rng.gen_range(0..4) {
                // Dropped: a lost write leaves stale bytes.
                0 => m[at..at + len].fill(0),
                // Duplicated: the previous record written again here.
                1 => {
                    let (p, plen) = records[i - 1];
                    let n = plen.min(len);
                    m.copy_within(p..p + n, at);
                }
                // Swapped with the next one, when they are of one length.
                2 => {
                    let (n_at, n_len) = records[i + 1];
                    if n_len != len {
                        return None;
                    }
                    let saved = m[at..at + len].to_vec();
                    m.copy_within(n_at..n_at + len, at);
                    m[n_at..n_at + len].copy_from_slice(&saved);
                }
                // A changed length field.
                _ => {
                    let new_len = (len as u32 - LOG_RECORD_OVERHEAD_BYTES as u32)
                        .wrapping_add(rng.gen_range(1..64));
                    m[at..at + 4].copy_from_slice(&new_len.to_le_bytes());
                }
            }
        }
        _ => unreachable!(),
    }
    Some(m)
}

#[test]
fn mutated_images_never_serve_wrong_data_or_panic() {
    let per_class = env("BETREEFS_MUTANTS", 15);
    let paths = env("BETREEFS_MUTATION_PATHS", 800);
    let mut totals: BTreeMap<(&str, Outcome), u64> = BTreeMap::new();
    let mut unreported = 0;
    for crashed in [false, true] {
        let (image, tree) = base_image(paths, crashed, 7 + crashed as u64);
        assert_eq!(
            open_and_read(image.clone(), &tree),
            Outcome::Recovered,
            "the unmutated image (crashed {crashed})"
        );
        assert!(!fsck_reports(image.clone()), "fsck of the unmutated image");
        let mut rng = SmallRng::seed_from_u64(99 + crashed as u64);
        for class in ["flip", "swap", "truncate", "log-gap"] {
            if class == "log-gap" && !crashed {
                continue;
            }
            let mut done = 0;
            let mut attempts = 0;
            while done < per_class && attempts < per_class * 10 {
                attempts += 1;
                let Some(mutant) = mutate(&image, class, &mut rng) else {
                    continue;
                };
                done += 1;
                let outcome = open_and_read(mutant.clone(), &tree);
                if outcome >= Outcome::SilentlyWrong {
                    eprintln!("{class} mutant (crashed {crashed}): {outcome:?}");
                    if let Ok(dir) = std::env::var("BETREEFS_MUTANT_DIR") {
                        let name = format!("{dir}/{class}-{crashed}-{done}.img");
                        std::fs::write(name, &mutant).unwrap();
                    }
                }
                *totals.entry((class, outcome)).or_default() += 1;
                if matches!(outcome, Outcome::Detected | Outcome::Refused) && !fsck_reports(mutant)
                {
                    unreported += 1;
                }
            }
        }
    }
    eprintln!("mutation outcomes: {totals:?}; reads failed but fsck clean: {unreported}");
    let bad: u64 = totals
        .iter()
        .filter(|((_, o), _)| matches!(o, Outcome::SilentlyWrong | Outcome::Panicked))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(bad, 0, "silently wrong or panicking mutants: {totals:?}");
    assert_eq!(unreported, 0, "fsck must report what the mount cannot read");
}
