//! Lookups read the entry (and the inode a hard link names) without the
//! inode table's lock: while one waits for the device, other requests go
//! on, and what it found is kept only if no write came meanwhile.

mod common;

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

use betreefs_engine::{Options, Store};
use betreefs_fs::{AtimePolicy, Errno, FileSystem, FsResult, Operations, ROOT_INO};
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
    let dev = MemDevice::new(64 << 20);
    let store = Store::create_on(Arc::new(dev.clone()), options()).unwrap();
    FileSystem::format(&store, ME).unwrap();
    let fs = FileSystem::mount(store, AtimePolicy::Relatime).unwrap();
    for i in 0..1500 {
        // After `victim` in key order, before the inode's record.
        let name = format!("z-filler-{i:05}-{}", "x".repeat(40));
        fs.mknod(ROOT_INO, name.as_bytes(), 0o100644, 0, ME)
            .unwrap();
    }
    common::write_file(&fs, ROOT_INO, b"small", b"small");
    let target = common::write_file(&fs, ROOT_INO, b"target", b"target");
    fs.link(target, ROOT_INO, b"victim").unwrap();
    // Everything down in the leaves: a lookup reads its leaf.
    fs.store().compact().unwrap();
    fs.close().unwrap();
    dev.current_image()
}

/// The image mounted on a device whose reads one thread can hold, with
/// `small` looked up (in the table, its entry's leaf cached).
fn cold_mount(image: &[u8]) -> (Arc<HeldReads>, Arc<FileSystem>, u64) {
    let device = Arc::new(HeldReads::new(MemDevice::from_image(image.to_vec())));
    let store = Store::open_on(device.clone(), options()).unwrap();
    let fs = Arc::new(FileSystem::mount(store, AtimePolicy::Relatime).unwrap());
    let small = fs.lookup(ROOT_INO, b"small").unwrap().ino;
    (device, fs, small)
}

/// A lookup of `victim` on another thread, every device read of which is
/// held once made: the thread, the announcements of its reads and their
/// go (one message lets one read go; dropping it lets them all).
fn held_lookup(
    device: &Arc<HeldReads>,
    fs: &Arc<FileSystem>,
) -> (
    std::thread::JoinHandle<FsResult<u64>>,
    Receiver<u64>,
    Sender<()>,
) {
    let (arrived, held) = channel();
    let (go, wait) = channel();
    let (device, fs) = (device.clone(), fs.clone());
    let lookup = std::thread::spawn(move || {
        device.hold_reads_of_this_thread(arrived, wait);
        fs.lookup(ROOT_INO, b"victim").map(|attr| attr.ino)
    });
    (lookup, held, go)
}

/// How many device reads a lookup of `victim` makes on a fresh mount.
fn reads_of_a_cold_lookup(image: &[u8]) -> usize {
    let (device, fs, _) = cold_mount(image);
    let (lookup, held, go) = held_lookup(&device, &fs);
    let mut reads = 0;
    while !lookup.is_finished() {
        if held.recv_timeout(Duration::from_millis(20)).is_ok() {
            reads += 1;
            go.send(()).unwrap();
        }
    }
    lookup.join().unwrap().expect("victim is there");
    reads
}

/// `f` on a thread of its own, which must return while the lookup waits.
fn completes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    finishes_within(Duration::from_secs(20), f)
        .unwrap_or_else(|| panic!("{what} waited for a lookup's device read"))
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
    for _ in 1..reads {
        held.recv_timeout(Duration::from_secs(20)).unwrap();
        go.send(()).unwrap();
    }
    // The last read: the inode's record, the entry found before it.
    held.recv_timeout(Duration::from_secs(20)).unwrap();
    {
        let fs = fs.clone();
        completes("the unlinks", move || {
            fs.unlink(ROOT_INO, b"victim").unwrap();
            fs.unlink(ROOT_INO, b"target").unwrap();
        });
    }
    drop(go);
    assert_eq!(lookup.join().unwrap(), Err(Errno::ENOENT));
    assert!(matches!(fs.lookup(ROOT_INO, b"victim"), Err(Errno::ENOENT)));
}
