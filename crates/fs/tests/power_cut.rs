//! Power cuts under the file system: random operations through
//! `FileSystem` on the simulated device, with fsyncs, until the device
//! loses power at a random write (unsynced writes dropped, the last one
//! torn, or any subset of them kept, as a volatile cache may). After
//! reopening, every file and entry fsync'd before the cut must be there,
//! and the tree must equal the one after some prefix of the operations —
//! at or after the last fsync. A kill -9 of the daemon cannot test this:
//! it never loses a write the daemon already issued.
//!
//! BETREEFS_POWER_CUT_SEEDS sets how many runs (default 120).

use std::collections::BTreeMap;
use std::sync::Arc;

use betreefs_engine::{Options, Store};
use betreefs_fs::{
    AtimePolicy, Caller, Errno, FileSystem, Operations, RenameFlags, SetAttr, ROOT_INO,
};
use betreefs_store::{CrashMode, MemDevice};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const ME: Caller = Caller::new(0, 0);

fn options() -> Options {
    Options {
        node_size: 64 << 10,
        basement_size: 8 << 10,
        cache_bytes: 1 << 20,
        log_flush_interval: None,
        checkpoint_interval: None,
        log_bytes: Some(1 << 20),
        ..Options::default()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    Dir,
    File(Vec<u8>),
    Link(Vec<u8>),
}

/// The whole tree: path (names from the root) -> what is there.
type Tree = BTreeMap<Vec<Vec<u8>>, Entry>;

const NAMES: [&[u8]; 5] = [b"a", b"b", b"c", b"\x01d", b"e\xff"];

fn resolve(fs: &FileSystem, path: &[Vec<u8>]) -> Result<u64, Errno> {
    path.iter()
        .try_fold(ROOT_INO, |ino, name| fs.lookup(ino, name).map(|a| a.ino))
}

fn split(path: &[Vec<u8>]) -> (&[Vec<u8>], &[u8]) {
    let (name, parent) = path.split_last().expect("not the root");
    (parent, name)
}

fn random_path(rng: &mut SmallRng, tree: &Tree) -> Vec<Vec<u8>> {
    let dirs: Vec<&Vec<Vec<u8>>> = tree
        .iter()
        .filter(|(_, e)| **e == Entry::Dir)
        .map(|(p, _)| p)
        .collect();
    let root = Vec::new();
    let parent = if dirs.is_empty() || rng.gen_bool(0.3) {
        &root
    } else {
        dirs[rng.gen_range(0..dirs.len())]
    };
    let mut p = parent.clone();
    p.push(NAMES[rng.gen_range(0..NAMES.len())].to_vec());
    p
}

/// Applies one random operation to the file system and, when it
/// succeeds, to the model. An operation made of two batches (a create,
/// then the write into the new file) pushes the model between them onto
/// `steps`: a power cut may keep the first batch and lose the second.
/// Returns Err when the device failed.
fn random_op(
    rng: &mut SmallRng,
    fs: &FileSystem,
    tree: &mut Tree,
    steps: &mut Vec<Tree>,
) -> Result<(), Errno> {
    let path = random_path(rng, tree);
    let (parent_path, name) = split(&path);
    let Ok(parent) = resolve(fs, parent_path) else {
        return Ok(());
    };
    let exists = tree.get(&path).cloned();
    let result = match rng.gen_range(0..11) {
        0..=3 => {
            // Create or overwrite part of a file.
            let offset = rng.gen_range(0..20_000u64);
            let len = rng.gen_range(1..40_000usize);
            let data: Vec<u8> = (0..len)
                .map(|i| (i as u8).wrapping_mul(rng.gen()))
                .collect();
            match exists {
                Some(Entry::File(mut old)) => {
                    let ino = resolve(fs, &path)?;
                    let fh = fs.open(ino, libc::O_WRONLY, None)?;
                    let r = fs.write(ino, fh, offset, &data, None);
                    fs.release(fh)?;
                    r?;
                    let end = offset as usize + len;
                    if old.len() < end {
                        old.resize(end, 0);
                    }
                    old[offset as usize..end].copy_from_slice(&data);
                    tree.insert(path, Entry::File(old));
                    Ok(())
                }
                None => {
                    let (attr, fh) = fs.create(parent, name, 0o644, 0, ME)?;
                    let r = fs.write(attr.ino, fh, 0, &data, None);
                    fs.release(fh)?;
                    // The creation is one batch, the write the next.
                    tree.insert(path.clone(), Entry::File(Vec::new()));
                    steps.push(tree.clone());
                    r?;
                    tree.insert(path, Entry::File(data));
                    Ok(())
                }
                Some(_) => Ok(()),
            }
        }
        4 => match exists {
            Some(Entry::File(mut old)) => {
                let size = rng.gen_range(0..30_000u64);
                let ino = resolve(fs, &path)?;
                fs.setattr(
                    ino,
                    &SetAttr {
                        size: Some(size),
                        ..SetAttr::default()
                    },
                )?;
                old.resize(size as usize, 0);
                tree.insert(path, Entry::File(old));
                Ok(())
            }
            _ => Ok(()),
        },
        5 => match exists {
            None => {
                fs.mkdir(parent, name, 0o755, ME)?;
                tree.insert(path, Entry::Dir);
                Ok(())
            }
            _ => Ok(()),
        },
        6 => match exists {
            Some(Entry::Dir) => match fs.rmdir(parent, name) {
                Err(Errno::ENOTEMPTY) => Ok(()),
                r => {
                    r?;
                    tree.remove(&path);
                    Ok(())
                }
            },
            Some(_) => {
                fs.unlink(parent, name)?;
                tree.remove(&path);
                Ok(())
            }
            None => Ok(()),
        },
        7 => match exists {
            None => {
                let target = format!("t{}", rng.gen::<u16>()).into_bytes();
                fs.symlink(parent, name, &target, ME)?;
                tree.insert(path, Entry::Link(target));
                Ok(())
            }
            _ => Ok(()),
        },
        8 => {
            // Clone a directory's tree to a fresh name: a mkdir, then
            // one batch filling it.
            let to = random_path(rng, tree);
            if exists != Some(Entry::Dir) || tree.contains_key(&to) || to.starts_with(&path) {
                return Ok(());
            }
            let (to_parent_path, to_name) = split(&to);
            let Ok(to_parent) = resolve(fs, to_parent_path) else {
                return Ok(());
            };
            let src = resolve(fs, &path)?;
            let dst = fs.mkdir(to_parent, to_name, 0o700, ME)?.ino;
            tree.insert(to.clone(), Entry::Dir);
            steps.push(tree.clone());
            fs.clone_tree_into(src, dst, ME)?;
            let copied: Vec<_> = tree
                .range(path.clone()..)
                .take_while(|(p, _)| p.starts_with(&path))
                .filter(|(p, _)| p.len() > path.len())
                .map(|(p, e)| (p.clone(), e.clone()))
                .collect();
            for (p, e) in copied {
                let mut q = to.clone();
                q.extend_from_slice(&p[path.len()..]);
                tree.insert(q, e);
            }
            Ok(())
        }
        _ => {
            // Rename anything onto a fresh name (subtrees move along).
            let to = random_path(rng, tree);
            if exists.is_none() || tree.contains_key(&to) || to.starts_with(&path) {
                return Ok(());
            }
            let (to_parent_path, to_name) = split(&to);
            let Ok(to_parent) = resolve(fs, to_parent_path) else {
                return Ok(());
            };
            fs.rename(parent, name, to_parent, to_name, RenameFlags::default())?;
            let moved: Vec<_> = tree
                .range(path.clone()..)
                .take_while(|(p, _)| p.starts_with(&path))
                .map(|(p, e)| (p.clone(), e.clone()))
                .collect();
            for (p, e) in moved {
                tree.remove(&p);
                let mut q = to.clone();
                q.extend_from_slice(&p[path.len()..]);
                tree.insert(q, e);
            }
            Ok(())
        }
    };
    result
}

/// Reads the whole tree back through the file system.
fn read_tree(fs: &FileSystem) -> Tree {
    let mut tree = Tree::new();
    let mut todo = vec![(Vec::<Vec<u8>>::new(), ROOT_INO)];
    while let Some((path, ino)) = todo.pop() {
        let mut names = Vec::new();
        fs.readdir(ino, 0, false, &mut |e| {
            if e.name != b"." && e.name != b".." {
                names.push(e.name.to_vec());
            }
            false
        })
        .expect("readdir");
        for name in names {
            let attr = fs.lookup(ino, &name).expect("lookup of a listed name");
            let mut p = path.clone();
            p.push(name);
            let entry = match attr.file_type() {
                libc::S_IFDIR => {
                    todo.push((p.clone(), attr.ino));
                    Entry::Dir
                }
                libc::S_IFLNK => Entry::Link(fs.readlink(attr.ino).expect("readlink")),
                _ => Entry::File(
                    fs.read_to_vec(attr.ino, 0, attr.size as u32 + 1)
                        .expect("read"),
                ),
            };
            tree.insert(p, entry);
        }
    }
    tree
}

fn power_cut_once(seed: u64) -> bool {
    let mut rng = SmallRng::seed_from_u64(seed);
    let dev = MemDevice::new(48 << 20);
    let store = Store::create_on(Arc::new(dev.clone()), options()).unwrap();
    FileSystem::format(&store, ME).unwrap();
    let fs = FileSystem::mount(store, AtimePolicy::Noatime).unwrap();
    dev.fail_after_writes(rng.gen_range(1..120));
    let mut tree = Tree::new();
    let mut states = vec![tree.clone()];
    let mut synced = 0;
    for _ in 0..rng.gen_range(20..300) {
        let mut steps = Vec::new();
        let outcome = random_op(&mut rng, &fs, &mut tree, &mut steps);
        // Every state between two batches is a candidate too, also the
        // one a failed op leaves in the model (a create before its write).
        steps.push(tree.clone());
        for step in steps {
            if states.last() != Some(&step) {
                states.push(step);
            }
        }
        if outcome.is_err() {
            break;
        }
        match rng.gen_range(0..12) {
            0 => {
                if fs.fsync().is_err() {
                    break;
                }
                synced = states.len() - 1;
            }
            1 if fs.store().checkpoint().is_err() => break,
            _ => {}
        }
    }
    let crashed = dev.has_crashed();
    dev.power_off();
    let mode = CrashMode::from_random(rng.gen());
    let image = dev.crash_image(mode);
    drop(fs);
    let context = format!("seed {seed}, {mode:?}");
    let store = Store::open_on(Arc::new(MemDevice::from_image(image)), options())
        .unwrap_or_else(|e| panic!("{context}: recovery failed: {e}"));
    let fs = FileSystem::mount(store, AtimePolicy::Noatime)
        .unwrap_or_else(|e| panic!("{context}: mount failed: {e}"));
    let state = read_tree(&fs);
    assert!(
        states[synced..].contains(&state),
        "{context}: the tree after the power cut is no state at or after the last fsync \
         ({} of {} states); it has {} paths",
        synced,
        states.len() - 1,
        state.len()
    );
    let report = betreefs_fs::fsck::check(fs.store(), |_| {}).unwrap();
    assert!(report.is_clean(), "{context}: fsck {:?}", report.problems);
    crashed
}

#[test]
fn power_cuts_lose_nothing_fsynced_and_keep_a_prefix() {
    let seeds = std::env::var("BETREEFS_POWER_CUT_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120u64);
    let crashed = (0..seeds).filter(|&s| power_cut_once(s)).count();
    assert!(
        crashed as u64 * 2 > seeds,
        "only {crashed} of {seeds} runs lost power mid-workload"
    );
}
