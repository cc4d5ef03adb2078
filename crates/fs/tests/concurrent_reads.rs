//! Reads of file data hold the inode table's lock only to look the file
//! up and afterwards: while one waits for the device, other requests go
//! on, and a read that a write or a rename raced with is made again.

mod common;

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

use betreefs_engine::{Options, Store};
use betreefs_fs::{AtimePolicy, FileSystem, Operations, RenameFlags, ROOT_INO};
use betreefs_store::{finishes_within, HeldReads, MemDevice};
use common::ME;

/// A file of a few leaves: the data tree is a root over leaves, so a read
/// of a file finds everything above its leaf cached once another file was
/// read. No read-ahead: the tests choose what is cached.
fn options() -> Options {
    Options {
        read_ahead: false,
        ..common::options()
    }
}

const BIG_BYTES: usize = 256 << 10;

fn big_contents(version: u8) -> Vec<u8> {
    (0..BIG_BYTES).map(|i| (i / 4096) as u8 ^ version).collect()
}

fn write_file(fs: &FileSystem, name: &[u8], data: &[u8]) -> u64 {
    common::write_file(fs, ROOT_INO, name, data)
}

/// A file system holding `small` (4 KiB) and `big`, mounted again on a
/// device whose reads a thread can hold; `small` is read, so the data
/// tree's root is cached and `big`'s leaves are not.
fn cold_mount() -> (Arc<HeldReads>, Arc<FileSystem>, u64, u64) {
    let dev = MemDevice::new(64 << 20);
    let store = Store::create_on(Arc::new(dev.clone()), options()).unwrap();
    FileSystem::format(&store, ME).unwrap();
    let fs = FileSystem::mount(store, AtimePolicy::Relatime).unwrap();
    let small = write_file(&fs, b"small", &[b's'; 4096]);
    let big = write_file(&fs, b"big", &big_contents(0));
    fs.close().unwrap();
    let device = Arc::new(HeldReads::new(dev));
    let store = Store::open_on(device.clone(), options()).unwrap();
    let fs = Arc::new(FileSystem::mount(store, AtimePolicy::Relatime).unwrap());
    assert_eq!(fs.lookup(ROOT_INO, b"small").unwrap().ino, small);
    assert_eq!(fs.lookup(ROOT_INO, b"big").unwrap().ino, big);
    assert_eq!(fs.read_to_vec(small, 0, 4096).unwrap(), vec![b's'; 4096]);
    (device, fs, small, big)
}

/// A read of `len` bytes of `ino` at `offset` on another thread, every
/// device read of which is held once made: returns the thread, the
/// announcements of its reads, and the go (dropping it lets them all go).
fn held_read(
    device: &Arc<HeldReads>,
    fs: &Arc<FileSystem>,
    ino: u64,
    offset: u64,
    len: usize,
) -> (std::thread::JoinHandle<Vec<u8>>, Receiver<u64>, Sender<()>) {
    let (arrived, held) = channel();
    let (go, wait) = channel();
    let (device, fs) = (device.clone(), fs.clone());
    let reader = std::thread::spawn(move || {
        device.hold_reads_of_this_thread(arrived, wait);
        let mut buf = vec![0; len];
        let n = fs.read(ino, offset, &mut buf).unwrap();
        buf.truncate(n);
        buf
    });
    held.recv_timeout(Duration::from_secs(20))
        .expect("the read goes to the device");
    (reader, held, go)
}

/// Runs `f` on another thread and gives its result, or fails the test if
/// it has not returned within a generous bound (it would be waiting for
/// the held read).
fn completes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    finishes_within(Duration::from_secs(20), f)
        .unwrap_or_else(|| panic!("{what} waited for another read's device read"))
}

#[test]
fn requests_go_on_while_a_read_waits_for_the_device() {
    let (device, fs, small, big) = cold_mount();
    let at = 128 << 10;
    let (reader, held, go) = held_read(&device, &fs, big, at as u64, 64 << 10);

    let attr = {
        let fs = fs.clone();
        completes("a getattr", move || fs.getattr(small).unwrap())
    };
    assert_eq!(attr.size, 4096);
    let data = {
        let fs = fs.clone();
        completes("a read of another file", move || {
            fs.read_to_vec(small, 0, 4096).unwrap()
        })
    };
    assert_eq!(data, vec![b's'; 4096]);
    {
        let fs = fs.clone();
        completes("a write to another file", move || {
            let fh = fs.open(small, libc::O_RDWR, None).unwrap();
            fs.write(small, fh, 0, b"new", None).unwrap();
            fs.release(fh).unwrap();
        });
    }
    drop((held, go));
    assert_eq!(reader.join().unwrap(), big_contents(0)[at..at + (64 << 10)]);
    assert_eq!(&fs.read_to_vec(small, 0, 3).unwrap(), b"new");
    assert!(fs.store().stats().leaves_read_unlocked > 0);
}

/// The file being read is renamed away and a new file takes its name (and
/// so the keys the read is reading) while the read waits: the read still
/// returns the renamed file's bytes.
#[test]
fn a_read_that_a_rename_raced_with_reads_the_file_it_was_asked_for() {
    let (device, fs, _, big) = cold_mount();
    let at = 128 << 10;
    let (reader, held, go) = held_read(&device, &fs, big, at as u64, 64 << 10);
    {
        let fs = fs.clone();
        completes("a rename and a new file", move || {
            fs.rename(ROOT_INO, b"big", ROOT_INO, b"moved", RenameFlags::default())
                .unwrap();
            write_file(&fs, b"big", &big_contents(0x5a));
        });
    }
    drop((held, go));
    assert_eq!(reader.join().unwrap(), big_contents(0)[at..at + (64 << 10)]);
    assert_eq!(fs.lookup(ROOT_INO, b"moved").unwrap().ino, big);
}

/// The file being read is overwritten while the read waits for a leaf
/// after the one it began in (cached, so already copied): the read
/// returns the new bytes, not old ones followed by new ones.
#[test]
fn a_read_that_a_write_raced_with_returns_the_new_bytes() {
    let (device, fs, _, big) = cold_mount();
    let at = 128 << 10;
    // Caches the leaf holding `at` from there to its end (a read across
    // basements reads the rest of its leaf), not the next one.
    assert_eq!(
        fs.read_to_vec(big, at as u64, 16 << 10).unwrap(),
        big_contents(0)[at..at + (16 << 10)]
    );
    let (reader, held, go) = held_read(&device, &fs, big, at as u64, 64 << 10);
    {
        let fs = fs.clone();
        completes("a write to the file", move || {
            let fh = fs.open(big, libc::O_RDWR, None).unwrap();
            fs.write(big, fh, 0, &big_contents(0x33), None).unwrap();
            fs.release(fh).unwrap();
        });
    }
    drop((held, go));
    assert_eq!(
        reader.join().unwrap(),
        big_contents(0x33)[at..at + (64 << 10)]
    );
}
