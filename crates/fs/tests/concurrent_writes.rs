//! A writer lets the inode table's lock go while the store takes its
//! batch (docs/design.md, "The table's lock and the write order"):
//! requests that need the table alone complete meanwhile, and requests
//! that read the store wait until the batch is in and the table updated.

mod common;

use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use betreefs_engine::Store;
use betreefs_fs::{AtimePolicy, Errno, FileSystem, Operations, ROOT_INO};
use betreefs_store::{finishes_within, HeldReads, MemDevice};
use common::ME;

const WAIT: Duration = Duration::from_secs(20);

fn big_contents() -> Vec<u8> {
    (0..256 << 10).map(|i| (i / 4096) as u8).collect()
}

/// A file system holding a 1 MiB file (a data tree of a root over
/// leaves) and `files`, mounted again with nothing cached on a device
/// whose reads a thread can hold.
fn cold_mount(files: &[(&[u8], &[u8])]) -> (Arc<HeldReads>, Arc<FileSystem>) {
    let dev = MemDevice::new(64 << 20);
    let store = Store::create_on(Arc::new(dev.clone()), common::options()).unwrap();
    FileSystem::format(&store, ME).unwrap();
    let fs = FileSystem::mount(store, AtimePolicy::Relatime).unwrap();
    common::write_file(&fs, ROOT_INO, b"filler", &vec![7; 1 << 20]);
    for (name, data) in files {
        common::write_file(&fs, ROOT_INO, name, data);
    }
    fs.close().unwrap();
    let device = Arc::new(HeldReads::new(dev));
    let store = Store::open_on(device.clone(), common::options()).unwrap();
    let fs = Arc::new(FileSystem::mount(store, AtimePolicy::Relatime).unwrap());
    (device, fs)
}

/// Runs `f` on a thread whose device reads are each held until the
/// returned sender is dropped (announced on the receiver).
fn spawn_held<T: Send + 'static>(
    device: &Arc<HeldReads>,
    fs: &Arc<FileSystem>,
    f: impl FnOnce(&FileSystem) -> T + Send + 'static,
) -> (JoinHandle<T>, Receiver<u64>, Sender<()>) {
    let (arrived, held) = channel();
    let (go, wait) = channel::<()>();
    let (fs, device) = (fs.clone(), device.clone());
    let thread = std::thread::spawn(move || {
        device.hold_reads_of_this_thread(arrived, wait);
        f(&fs)
    });
    (thread, held, go)
}

/// A writer held inside the store's write (at a device read of the
/// node its batch goes into, on a cold mount): a getattr, a release, a
/// lookup of a name the table knows absent and a getxattr of a file known
/// to have no extended attribute complete; a lookup that reads the store
/// waits, and once the writer is let go finds what it wrote.
#[test]
fn table_requests_go_on_while_a_writers_batch_goes_in() {
    let (device, fs) = cold_mount(&[]);
    let small = common::write_file(&fs, ROOT_INO, b"small", b"0123");
    let dir = fs.mkdir(ROOT_INO, b"dir", 0o755, ME).unwrap().ino;
    let (big, big_fh) = fs.create(ROOT_INO, b"big", 0o644, 0, ME).unwrap();
    let small_fh = fs.open(small, libc::O_RDONLY, None).unwrap();

    let (writer, held, go) = spawn_held(&device, &fs, move |fs| {
        fs.write(big.ino, big_fh, 0, &big_contents(), None)
    });
    held.recv_timeout(WAIT)
        .expect("the big write reads a node of the data tree");

    let table_alone = {
        let fs = fs.clone();
        finishes_within(WAIT, move || {
            let size = fs.getattr(small).map(|a| a.size);
            let released = fs.release(small_fh);
            let absent = fs.lookup(dir, b"nothing").map(|a| a.ino);
            let xattr = fs.getxattr(small, b"security.capability");
            (size, released, absent, xattr)
        })
    };
    let (size, released, absent, xattr) =
        table_alone.expect("requests of the table alone wait for the writer's batch");
    assert_eq!(size, Ok(4));
    assert_eq!(released, Ok(()));
    assert_eq!(absent, Err(Errno::ENOENT));
    assert_eq!(xattr, Err(Errno::ENODATA));

    // A lookup reads the store and the table together: not while the
    // store may be ahead of the table.
    let (found, lookup_done) = channel();
    {
        let fs = fs.clone();
        std::thread::spawn(move || {
            let _ = found.send(fs.lookup(ROOT_INO, b"big").map(|a| a.size));
        });
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        lookup_done.try_recv(),
        Err(TryRecvError::Empty),
        "a lookup read the store while a write was in flight"
    );
    drop(go);
    let written = writer.join().unwrap();
    assert_eq!(written, Ok(256 << 10));
    let size = lookup_done
        .recv_timeout(WAIT)
        .expect("the lookup completes");
    assert_eq!(size, Ok(256 << 10));
    assert_eq!(
        fs.read_to_vec(big.ino, 0, 256 << 10).unwrap(),
        big_contents()
    );
    fs.release(big_fh).unwrap();
}

/// The last close of a file whose unlink is in flight — planned while the
/// file was open, so its data is kept under the inode key for that close
/// to free — comes while the unlink's batch goes in, sees the file still
/// named and returns at once; the unlink, once its batch is in, finds the
/// file closed and frees it: nothing of it is left, no orphan counted.
#[test]
fn a_last_close_racing_an_unlink_leaves_nothing_behind() {
    let (device, fs) = cold_mount(&[(b"victim", &[9; 64 << 10])]);
    let victim = fs.lookup(ROOT_INO, b"victim").unwrap().ino;
    let fh = fs.open(victim, libc::O_RDONLY, None).unwrap();
    let files_before = fs.statfs().inodes;

    let (unlink, held, go) = spawn_held(&device, &fs, |fs| fs.unlink(ROOT_INO, b"victim"));
    held.recv_timeout(WAIT)
        .expect("the unlink's batch (a move of the open file's data) reads a node");
    let released = {
        let fs = fs.clone();
        finishes_within(WAIT, move || fs.release(fh))
    };
    assert_eq!(released, Some(Ok(())));
    drop(go);
    assert_eq!(unlink.join().unwrap(), Ok(()));
    assert_eq!(fs.lookup(ROOT_INO, b"victim"), Err(Errno::ENOENT));
    assert_eq!(
        fs.statfs().inodes,
        files_before - 1,
        "the unlinked file was not freed"
    );
}
