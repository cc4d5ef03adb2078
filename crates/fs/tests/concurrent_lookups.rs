//! Lookups and listings read the entries (and the inodes hard links name)
//! without the inode table's lock: while one waits for the device, other
//! requests go on, and what it found is kept only if no write came
//! meanwhile.

mod common;

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

use betreefs_engine::{Options, Store};
use betreefs_fs::{AtimePolicy, Errno, FileSystem, FsResult, Operations, RenameFlags, ROOT_INO};
use betreefs_store::{finishes_within, HeldReads, MemDevice};
use common::ME;

/// No read-ahead: the tests choose what is cached.
fn options() -> Options {
    Options {
        read_ahead: false,
        ..common::options()
    }
}

/// An image with a root directory of many entries (the metadata tree
/// has several leaves), `small` among them, and `victim`, a second name
/// (a hard link) of `target`: its inode is kept by number, away from
/// the entries.
fn image() -> Vec<u8> {
    build_image(|fs| {
        for i in 0..1500 {
            // After `victim` in key order, before the inode's record.
            let name = format!("z-filler-{i:05}-{}", "x".repeat(40));
            fs.mknod(ROOT_INO, name.as_bytes(), 0o100644, 0, ME)
                .unwrap();
        }
        common::write_file(fs, ROOT_INO, b"small", b"small");
        let target = common::write_file(fs, ROOT_INO, b"target", b"target");
        fs.link(target, ROOT_INO, b"victim").unwrap();
    })
}

/// A fresh file system made by `fill`, everything pushed down to the
/// leaves (a query reads its leaf), as an image.
fn build_image(fill: impl FnOnce(&FileSystem)) -> Vec<u8> {
    let dev = MemDevice::new(64 << 20);
    let store = Store::create_on(Arc::new(dev.clone()), options()).unwrap();
    FileSystem::format(&store, ME).unwrap();
    let fs = FileSystem::mount(store, AtimePolicy::Relatime).unwrap();
    fill(&fs);
    fs.store().compact().unwrap();
    fs.close().unwrap();
    dev.current_image()
}

/// `image` mounted on a device whose reads one thread can hold.
fn mount_held(image: &[u8], atime: AtimePolicy) -> (Arc<HeldReads>, Arc<FileSystem>) {
    let device = Arc::new(HeldReads::new(MemDevice::from_image(image.to_vec())));
    let store = Store::open_on(device.clone(), options()).unwrap();
    let fs = Arc::new(FileSystem::mount(store, atime).unwrap());
    (device, fs)
}

/// The image mounted on a device whose reads one thread can hold, with
/// `small` looked up (in the table, its entry's leaf cached).
fn cold_mount(image: &[u8]) -> (Arc<HeldReads>, Arc<FileSystem>, u64) {
    let (device, fs) = mount_held(image, AtimePolicy::Relatime);
    let small = fs.lookup(ROOT_INO, b"small").unwrap().ino;
    (device, fs, small)
}

/// A request on a thread of its own whose device reads are held: the
/// thread, the announcements of its reads and their go.
type Held<T> = (std::thread::JoinHandle<T>, Receiver<u64>, Sender<()>);

/// A lookup of `victim` on another thread, every device read of which is
/// held once made: the thread, the announcements of its reads and their
/// go (one message lets one read go; dropping it lets them all).
fn held_lookup(device: &Arc<HeldReads>, fs: &Arc<FileSystem>) -> Held<FsResult<u64>> {
    let fs = fs.clone();
    spawn_held(device, move || {
        fs.lookup(ROOT_INO, b"victim").map(|attr| attr.ino)
    })
}

/// `f` on a thread of its own, every device read of which is held once
/// made.
fn spawn_held<T: Send + 'static>(
    device: &Arc<HeldReads>,
    f: impl FnOnce() -> T + Send + 'static,
) -> Held<T> {
    let (arrived, held) = channel();
    let (go, wait) = channel();
    let device = device.clone();
    let thread = std::thread::spawn(move || {
        device.hold_reads_of_this_thread(arrived, wait);
        f()
    });
    (thread, held, go)
}

/// A listing of `dir` (readdirplus with `plus`) on another thread, as
/// [`held_lookup`]: its names, or its error.
fn held_listing(
    device: &Arc<HeldReads>,
    fs: &Arc<FileSystem>,
    dir: u64,
    plus: bool,
) -> Held<FsResult<Vec<Vec<u8>>>> {
    let fs = fs.clone();
    spawn_held(device, move || {
        let mut names = Vec::new();
        fs.readdir(dir, 0, plus, &mut |entry| {
            names.push(entry.name.to_vec());
            false
        })
        .map(|()| names)
    })
}

/// How many device reads a lookup of `victim` makes on a fresh mount.
fn reads_of_a_cold_lookup(image: &[u8]) -> usize {
    let (device, fs, _) = cold_mount(image);
    let (lookup, held, go) = held_lookup(&device, &fs);
    let reads = reads_until_done(&lookup, &held, &go);
    lookup.join().unwrap().expect("victim is there");
    reads
}

/// Lets every read of a held thread go, counting them, until it is done.
fn reads_until_done<T>(
    thread: &std::thread::JoinHandle<T>,
    held: &Receiver<u64>,
    go: &Sender<()>,
) -> usize {
    let mut reads = 0;
    while !thread.is_finished() {
        if held.recv_timeout(Duration::from_millis(20)).is_ok() {
            reads += 1;
            go.send(()).unwrap();
        }
    }
    reads
}

/// `f` on a thread of its own, which must return while the lookup waits.
fn completes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    finishes_within(Duration::from_secs(20), f)
        .unwrap_or_else(|| panic!("{what} waited for a lookup's device read"))
}

/// Lets a held request's first `reads - 1` reads go; at its last (the
/// inode's record, read after the entries) removes both names of
/// `target` in `dir` — the inode with them — then lets it go on.
fn remove_at_the_last_read(
    fs: &Arc<FileSystem>,
    dir: u64,
    reads: usize,
    held: &Receiver<u64>,
    go: Sender<()>,
) {
    for _ in 1..reads {
        held.recv_timeout(Duration::from_secs(20)).unwrap();
        go.send(()).unwrap();
    }
    held.recv_timeout(Duration::from_secs(20)).unwrap();
    let fs = fs.clone();
    completes("the unlinks", move || {
        fs.unlink(dir, b"victim").unwrap();
        fs.unlink(dir, b"target").unwrap();
    });
    drop(go);
}

#[test]
fn requests_go_on_while_a_lookup_waits_for_the_device() {
    let image = image();
    let (device, fs, small) = cold_mount(&image);
    let (lookup, held, go) = held_lookup(&device, &fs);
    held.recv_timeout(Duration::from_secs(20))
        .expect("the lookup reads from the device");
    {
        let fs = fs.clone();
        let attr = completes("a getattr", move || fs.getattr(small).unwrap());
        assert_eq!(attr.size, 5);
    }
    {
        let fs = fs.clone();
        completes("a lookup of a cached entry", move || {
            fs.lookup(ROOT_INO, b"small").unwrap()
        });
    }
    {
        let fs = fs.clone();
        completes("a create", move || {
            fs.mknod(ROOT_INO, b"new", 0o100644, 0, ME).unwrap()
        });
    }
    drop(go);
    let victim = lookup.join().unwrap().unwrap();
    assert_eq!(fs.lookup(ROOT_INO, b"target").unwrap().ino, victim);
}

/// The lookup has read the entry `victim` (a hard link) and waits for
/// the inode's record when both names are removed, the inode with them:
/// the lookup must not bring the file back (nor fail on the inode it no
/// longer finds), but see that it is gone.
#[test]
fn a_lookup_raced_by_the_removal_of_its_file_finds_it_gone() {
    let image = image();
    let reads = reads_of_a_cold_lookup(&image);
    // The entry's leaf is cached (`small` is next to it); the inode's
    // record is not.
    assert!(reads >= 1, "the lookup reads the inode's record");
    let (device, fs, _) = cold_mount(&image);
    let (lookup, held, go) = held_lookup(&device, &fs);
    remove_at_the_last_read(&fs, ROOT_INO, reads, &held, go);
    assert_eq!(lookup.join().unwrap(), Err(Errno::ENOENT));
    assert!(matches!(fs.lookup(ROOT_INO, b"victim"), Err(Errno::ENOENT)));
}

#[test]
fn requests_go_on_while_a_listing_waits_for_the_device() {
    let image = image();
    let (device, fs, small) = cold_mount(&image);
    let (listing, held, go) = held_listing(&device, &fs, ROOT_INO, false);
    held.recv_timeout(Duration::from_secs(20))
        .expect("the listing reads from the device");
    {
        let fs = fs.clone();
        let attr = completes("a getattr", move || fs.getattr(small).unwrap());
        assert_eq!(attr.size, 5);
    }
    {
        let fs = fs.clone();
        completes("a create", move || {
            fs.mknod(ROOT_INO, b"new", 0o100644, 0, ME).unwrap()
        });
    }
    drop(go);
    let names = listing.join().unwrap().unwrap();
    // "." and "..", and every entry: `new` may or may not be in it.
    assert!(names.len() >= 1500 + 3 + 2, "{} names", names.len());
    assert!(names.iter().any(|n| n == b"victim"));
}

/// An image with a directory `d` holding `small`, and `target` with a
/// second name `victim` (a hard link: its inode is kept by number, and
/// readdirplus reads it for the attributes), and many entries whose keys
/// lie on either side of the inode's (in the root and in `c`): its
/// record is in a leaf of its own, not cached after mounting.
fn linked_image() -> Vec<u8> {
    build_image(|fs| {
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
        common::write_file(fs, d, b"small", b"small");
        let target = common::write_file(fs, d, b"target", b"target");
        fs.link(target, d, b"victim").unwrap();
        // In key order: the root's entries (`d`'s, then fillers), inodes
        // by number, the file system's own records, `c`'s entries
        // (fillers), `d`'s.
        let c = fs.mkdir(ROOT_INO, b"c", 0o755, ME).unwrap().ino;
        for dir in [ROOT_INO, c] {
            for i in 0..1500 {
                let name = format!("z-filler-{i:05}-{}", "x".repeat(40));
                fs.mknod(dir, name.as_bytes(), 0o100644, 0, ME).unwrap();
            }
        }
    })
}

/// `linked_image` mounted with `d` looked up; `d`'s number. No access
/// times: a listing's own write (of `d`'s atime) would read nodes too.
fn mount_with_d(image: &[u8]) -> (Arc<HeldReads>, Arc<FileSystem>, u64) {
    let (device, fs) = mount_held(image, AtimePolicy::Noatime);
    let d = fs.lookup(ROOT_INO, b"d").unwrap().ino;
    (device, fs, d)
}

/// A readdirplus has read the entries of `d` and waits for the record
/// of `target`'s inode when both its names are removed (and the inode
/// with them): the listing must not show them, nor fail on the inode it
/// no longer finds.
#[test]
fn a_listing_raced_by_the_removal_of_a_file_does_not_show_it() {
    let image = linked_image();
    let reads = {
        let (device, fs, d) = mount_with_d(&image);
        let (listing, held, go) = held_listing(&device, &fs, d, true);
        let reads = reads_until_done(&listing, &held, &go);
        let names = listing.join().unwrap().unwrap();
        assert!(names.iter().any(|n| n == b"victim"));
        reads
    };
    assert!(reads >= 1, "the listing reads the inode");
    let (device, fs, d) = mount_with_d(&image);
    let (listing, held, go) = held_listing(&device, &fs, d, true);
    remove_at_the_last_read(&fs, d, reads, &held, go);
    let names = listing.join().unwrap().unwrap();
    assert!(names.iter().any(|n| n == b"small"));
    assert!(
        !names.iter().any(|n| n == b"victim" || n == b"target"),
        "a removed file listed"
    );
    assert!(matches!(fs.lookup(d, b"victim"), Err(Errno::ENOENT)));
}

/// A listing of `d` waits for the device when `d` is renamed and a new
/// directory takes its old name: what it lists must be `d`'s entries,
/// under its new name, not the newcomer's.
#[test]
fn a_listing_raced_by_the_rename_of_its_directory_lists_that_directory() {
    let image = linked_image();
    let (device, fs, d) = mount_with_d(&image);
    let (listing, held, go) = held_listing(&device, &fs, d, false);
    held.recv_timeout(Duration::from_secs(20))
        .expect("the listing reads the entries");
    {
        let fs = fs.clone();
        completes("the rename and the newcomer", move || {
            fs.rename(ROOT_INO, b"d", ROOT_INO, b"d2", RenameFlags::default())
                .unwrap();
            let newcomer = fs.mkdir(ROOT_INO, b"d", 0o755, ME).unwrap().ino;
            fs.mknod(newcomer, b"imposter", 0o100644, 0, ME).unwrap();
        });
    }
    drop(go);
    let names = listing.join().unwrap().unwrap();
    assert!(names.iter().any(|n| n == b"small"), "{names:?}");
    assert!(!names.iter().any(|n| n == b"imposter"), "{names:?}");
}
