//! The one IO seam. Everything the engine reads or writes goes through a
//! [`Device`]; tests swap in a [`MemDevice`] that can lose unsynced writes,
//! tear the last one, or fail after a countdown.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::bytes::put_bytes;
use crate::{AlignedBuf, BLOCK_SIZE};

/// Block-granular storage. Offsets and lengths are multiples of
/// [`BLOCK_SIZE`]; buffers passed in are usually [`AlignedBuf`]s.
pub trait Device: Send + Sync {
    /// Size of the device in bytes.
    fn len_bytes(&self) -> u64;
    /// Fills `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// [`Device::read_at`] into the `len` bytes at `buf`, which need not
    /// be initialised: on success every one of them is written. A node
    /// read into fresh memory needs no fill before the device writes it
    /// (a zeroed allocation of megabytes is faulted in page by page for
    /// the kernel to clear). The default zeroes them and calls `read_at`.
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes, and nothing else
    /// may read or write them during the call.
    unsafe fn read_at_uninit(&self, buf: *mut u8, len: usize, offset: u64) -> io::Result<()> {
        // SAFETY: the caller gives `len` writable bytes at `buf`, used by
        // nothing else; zeroed, they are initialised for the slice.
        let slice = unsafe {
            std::ptr::write_bytes(buf, 0, len);
            std::slice::from_raw_parts_mut(buf, len)
        };
        self.read_at(slice, offset)
    }
    /// Writes `buf` at `offset`; durable only after [`Device::sync`].
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable.
    fn sync(&self) -> io::Result<()>;
}

fn check_aligned(len: usize, offset: u64) -> io::Result<()> {
    if !len.is_multiple_of(BLOCK_SIZE) || !offset.is_multiple_of(BLOCK_SIZE as u64) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unaligned IO: {len} bytes at offset {offset}"),
        ));
    }
    Ok(())
}

/// Takes an advisory lock so two processes never run a store on the same
/// image (it is released when the file is closed): exclusive to write,
/// shared to read (any number of readers, but not beside a writer).
fn lock(file: &File, exclusive: bool) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mode = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    // SAFETY: flock on a valid, owned file descriptor has no memory effects.
    let rc = unsafe { libc::flock(file.as_raw_fd(), mode | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            "the image is in use by another betreefs process",
        ));
    }
    Err(err)
}

/// A regular file or block device, opened with `O_DIRECT` so that the OS
/// page cache does not hold a second copy of what the node cache holds.
/// File systems that refuse `O_DIRECT` (tmpfs) fall back to buffered IO.
pub struct FileDevice {
    file: File,
    len: u64,
    direct: bool,
    read_only: bool,
    /// Test hook (debug builds): while this path exists, every read, write
    /// and sync fails with `EIO`, as a dying disk's would.
    fault_trigger: Option<std::path::PathBuf>,
}

/// The test hook's variable: `BETREEFS_TEST_FAULTY_WHILE=<path>`.
const FAULT_TRIGGER_VAR: &str = "BETREEFS_TEST_FAULTY_WHILE";

impl FileDevice {
    /// Creates (or truncates) a sparse image file of `len` bytes, readable
    /// and writable by its owner only: the image holds every file's bytes,
    /// whatever their permissions.
    pub fn create_file(path: &Path, len: u64) -> io::Result<FileDevice> {
        use std::os::unix::fs::PermissionsExt;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)?;
        // Never truncate an image another process is using.
        lock(&file, true)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        file.set_len(0)?;
        file.set_len(len)?;
        drop(file);
        Self::open(path)
    }

    /// Uses only the first `len` bytes of the device (a file system
    /// smaller than its block device); a larger `len` changes nothing.
    pub fn limited_to(mut self, len: u64) -> FileDevice {
        self.len = self.len.min(len);
        self
    }

    /// Opens an existing image file or block device.
    pub fn open(path: &Path) -> io::Result<FileDevice> {
        Self::open_with(path, false)
    }

    /// Opens an image for reading only: the file is opened `O_RDONLY` (an
    /// image on read-only media works) and every write is refused.
    pub fn open_read_only(path: &Path) -> io::Result<FileDevice> {
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, read_only: bool) -> io::Result<FileDevice> {
        let open = |direct: bool| {
            let mut options = OpenOptions::new();
            options.read(true).write(!read_only);
            if direct {
                options.custom_flags(libc::O_DIRECT);
            }
            options.open(path)
        };
        let (file, direct) = match open(true) {
            Ok(file) => (file, true),
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(path = %path.display(), "O_DIRECT refused; using buffered IO");
                (open(false)?, false)
            }
            Err(err) => return Err(err),
        };
        lock(&file, !read_only)?;
        let meta = file.metadata()?;
        let len = if meta.file_type().is_block_device() {
            use std::io::Seek;
            let mut f = &file;
            f.seek(io::SeekFrom::End(0))?
        } else {
            meta.len()
        };
        let fault_trigger = if cfg!(debug_assertions) {
            std::env::var_os(FAULT_TRIGGER_VAR).map(std::path::PathBuf::from)
        } else {
            None
        };
        Ok(FileDevice {
            file,
            len,
            direct,
            read_only,
            fault_trigger,
        })
    }

    fn injected_fault(&self) -> io::Result<()> {
        match &self.fault_trigger {
            Some(trigger) if trigger.exists() => Err(io::Error::from_raw_os_error(libc::EIO)),
            _ => Ok(()),
        }
    }

    fn bounce_needed(&self, ptr: *const u8) -> bool {
        self.direct && !(ptr as usize).is_multiple_of(BLOCK_SIZE)
    }

    /// Fills the `len` bytes at `buf`, initialised or not, from `offset`
    /// (both [`Device::read_at`] and [`Device::read_at_uninit`]): every one
    /// of them is written when it succeeds. A buffer O_DIRECT cannot take
    /// (not block-aligned) is read through an aligned bounce buffer.
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes, and nothing else may
    /// read or write them during the call.
    unsafe fn read_exact_into(&self, buf: *mut u8, len: usize, offset: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        check_aligned(len, offset)?;
        self.injected_fault()?;
        if self.bounce_needed(buf) {
            let mut bounce = AlignedBuf::for_overwrite(len);
            self.file.read_exact_at(&mut bounce, offset)?;
            // SAFETY: `bounce` holds `len` bytes (a whole number of blocks
            // already) in another allocation; `buf` takes `len` (the
            // caller's promise).
            unsafe { std::ptr::copy_nonoverlapping(bounce.as_ptr(), buf, len) };
            return Ok(());
        }
        let mut done = 0;
        while done < len {
            let at = libc::off_t::try_from(offset + done as u64)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset past off_t"))?;
            // SAFETY: `buf + done` is valid for writes of `len - done`
            // bytes (the caller's promise), at most what pread writes.
            let n =
                unsafe { libc::pread(self.file.as_raw_fd(), buf.add(done).cast(), len - done, at) };
            match n {
                0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "read past the end of the device",
                    ))
                }
                n if n > 0 => done += n as usize,
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

impl Device for FileDevice {
    fn len_bytes(&self) -> u64 {
        self.len
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // SAFETY: a slice is valid for writes of its length, and the
        // `&mut` borrow keeps anything else from using it.
        unsafe { self.read_exact_into(buf.as_mut_ptr(), buf.len(), offset) }
    }

    unsafe fn read_at_uninit(&self, buf: *mut u8, len: usize, offset: u64) -> io::Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.read_exact_into(buf, len, offset) }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_aligned(buf.len(), offset)?;
        if self.read_only {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        self.injected_fault()?;
        if offset + buf.len() as u64 > self.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "write past the end of the device",
            ));
        }
        if self.bounce_needed(buf.as_ptr()) {
            return self.file.write_all_at(&AlignedBuf::from_slice(buf), offset);
        }
        self.file.write_all_at(buf, offset)
    }

    fn sync(&self) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        self.injected_fault()?;
        self.file.sync_data()
    }
}

/// What survives a simulated crash of a [`MemDevice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashMode {
    /// Only synced writes survive.
    DropUnsynced,
    /// Synced writes survive, plus a prefix of whole 512-byte sectors of the
    /// last unsynced write (a torn write).
    TearLast { sectors_kept: usize },
    /// Synced writes survive, plus every unsynced write whose bit is set in
    /// `mask` (bit i = the i-th unsynced write, modulo 64): writes reordered
    /// by a volatile cache.
    KeepSome { mask: u64 },
}

impl CrashMode {
    /// One of the three modes, chosen by a random value (for tests that
    /// crash at random: which mode, which sectors or writes survive).
    pub fn from_random(r: u64) -> CrashMode {
        match r % 3 {
            0 => CrashMode::DropUnsynced,
            1 => CrashMode::TearLast {
                sectors_kept: ((r >> 8) % 8) as usize,
            },
            _ => CrashMode::KeepSome {
                mask: r.rotate_left(17).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            },
        }
    }
}

struct MemState {
    durable: Vec<u8>,
    current: Vec<u8>,
    unsynced: Vec<(u64, Vec<u8>)>,
    writes: u64,
    syncs: u64,
    fail_after_writes: Option<u64>,
    /// A write to lose: the `countdown`-th next write starting in `range`
    /// is acknowledged but never stored (a lost or misdirected write).
    lose: Option<LoseWrite>,
    lost_writes: u64,
    crashed: bool,
}

struct LoseWrite {
    range: std::ops::Range<u64>,
    countdown: u64,
}

/// An in-memory device for tests that remembers which writes were synced,
/// so a crash can be simulated at any IO.
#[derive(Clone)]
pub struct MemDevice {
    state: Arc<Mutex<MemState>>,
}

impl MemDevice {
    pub fn new(len: u64) -> MemDevice {
        Self::from_image(vec![0; len as usize])
    }

    /// A device whose durable and current contents are `image`.
    pub fn from_image(image: Vec<u8>) -> MemDevice {
        MemDevice {
            state: Arc::new(Mutex::new(MemState {
                current: image.clone(),
                durable: image,
                unsynced: Vec::new(),
                writes: 0,
                syncs: 0,
                fail_after_writes: None,
                lose: None,
                lost_writes: 0,
                crashed: false,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, MemState> {
        // A panic while holding this lock can only come from a test assertion;
        // the state itself is always consistent, so keep using it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After `n` more successful writes the device "loses power": every
    /// later write and sync fails with EIO and nothing more reaches it.
    pub fn fail_after_writes(&self, n: u64) {
        let mut state = self.lock();
        state.fail_after_writes = Some(state.writes + n);
    }

    /// The `countdown`-th next write (0: the next one) that starts inside
    /// `range` will be acknowledged but never stored: the device drops it
    /// silently, as a firmware bug or a misdirected write does.
    pub fn lose_write(&self, range: std::ops::Range<u64>, countdown: u64) {
        self.lock().lose = Some(LoseWrite { range, countdown });
    }

    /// How many writes [`MemDevice::lose_write`] has dropped.
    pub fn lost_writes(&self) -> u64 {
        self.lock().lost_writes
    }

    /// Loses power now.
    pub fn power_off(&self) {
        self.lock().crashed = true;
    }

    pub fn has_crashed(&self) -> bool {
        self.lock().crashed
    }

    /// The contents a restart would find after a crash now.
    pub fn crash_image(&self, mode: CrashMode) -> Vec<u8> {
        let state = self.lock();
        let mut image = state.durable.clone();
        match mode {
            CrashMode::DropUnsynced => {}
            CrashMode::TearLast { sectors_kept } => {
                if let Some((offset, data)) = state.unsynced.last() {
                    let keep = (sectors_kept * 512).min(data.len());
                    put_bytes(
                        &mut image,
                        *offset as usize,
                        data.get(..keep).unwrap_or_default(),
                    );
                }
            }
            CrashMode::KeepSome { mask } => {
                for (i, (offset, data)) in state.unsynced.iter().enumerate() {
                    if mask & (1 << (i % 64)) != 0 {
                        put_bytes(&mut image, *offset as usize, data);
                    }
                }
            }
        }
        image
    }

    /// The current contents, as if everything had been synced.
    pub fn current_image(&self) -> Vec<u8> {
        self.lock().current.clone()
    }

    /// Applies `f` to the durable and current contents alike (corruption tests).
    pub fn mutate(&self, f: impl Fn(&mut [u8])) {
        let mut state = self.lock();
        f(&mut state.current);
        f(&mut state.durable);
    }
}

/// A device for concurrency tests: a [`MemDevice`] whose reads by one
/// chosen thread are each announced once made and then held until the
/// test lets them go — a request with its bytes in hand, stopped before
/// it uses them, while the test shows what other requests can do.
pub struct HeldReads {
    inner: MemDevice,
    hold: Mutex<Option<ReadHold>>,
}

#[derive(Clone)]
struct ReadHold {
    thread: std::thread::ThreadId,
    arrived: std::sync::mpsc::Sender<u64>,
    go: Arc<Mutex<std::sync::mpsc::Receiver<()>>>,
}

impl HeldReads {
    pub fn new(inner: MemDevice) -> HeldReads {
        HeldReads {
            inner,
            hold: Mutex::new(None),
        }
    }

    /// Holds every read the calling thread makes from now on: each, once
    /// made, sends its offset on `arrived` and waits for a message on
    /// `go` — or for `go`'s sender to be dropped, after which the thread's
    /// reads go on freely.
    pub fn hold_reads_of_this_thread(
        &self,
        arrived: std::sync::mpsc::Sender<u64>,
        go: std::sync::mpsc::Receiver<()>,
    ) {
        *self.hold.lock().unwrap_or_else(|e| e.into_inner()) = Some(ReadHold {
            thread: std::thread::current().id(),
            arrived,
            go: Arc::new(Mutex::new(go)),
        });
    }
}

impl Device for HeldReads {
    fn len_bytes(&self) -> u64 {
        self.inner.len_bytes()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)?;
        let hold = self.hold.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(hold) = hold.filter(|h| h.thread == std::thread::current().id()) {
            // The test may have stopped listening: then go on.
            if hold.arrived.send(offset).is_ok() {
                let _ = hold.go.lock().unwrap_or_else(|e| e.into_inner()).recv();
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)
    }

    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
}

/// Runs `f` on a thread of its own and gives its result if it returns
/// within `limit` — for concurrency tests that show a request does not
/// wait for another one held somewhere (the thread is left behind if it
/// does not return).
pub fn finishes_within<T: Send + 'static>(
    limit: std::time::Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (done, result) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    result.recv_timeout(limit).ok()
}

fn power_lost() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl Device for MemDevice {
    fn len_bytes(&self) -> u64 {
        self.lock().current.len() as u64
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_aligned(buf.len(), offset)?;
        let state = self.lock();
        let at = offset as usize;
        let Some(src) = state.current.get(at..at + buf.len()) else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past end",
            ));
        };
        buf.copy_from_slice(src);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_aligned(buf.len(), offset)?;
        let mut state = self.lock();
        if state.crashed {
            return Err(power_lost());
        }
        let at = offset as usize;
        if at + buf.len() > state.current.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "write past end",
            ));
        }
        if state.fail_after_writes == Some(state.writes) {
            // The write in flight when power fails: it may be torn.
            state.crashed = true;
            state.unsynced.push((offset, buf.to_vec()));
            return Err(power_lost());
        }
        state.writes += 1;
        if let Some(lose) = &mut state.lose {
            if lose.range.contains(&offset) {
                if lose.countdown == 0 {
                    state.lose = None;
                    state.lost_writes += 1;
                    return Ok(());
                }
                lose.countdown -= 1;
            }
        }
        put_bytes(&mut state.current, at, buf);
        state.unsynced.push((offset, buf.to_vec()));
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut state = self.lock();
        if state.crashed {
            return Err(power_lost());
        }
        let unsynced = std::mem::take(&mut state.unsynced);
        for (offset, data) in unsynced {
            put_bytes(&mut state.durable, offset as usize, &data);
        }
        state.syncs += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_device_crash_modes() {
        let dev = MemDevice::new(64 * 1024);
        let block = |b: u8| vec![b; BLOCK_SIZE];
        dev.write_at(&block(1), 0).unwrap();
        dev.sync().unwrap();
        dev.write_at(&block(2), 4096).unwrap();
        dev.write_at(&block(3), 8192).unwrap();
        let dropped = dev.crash_image(CrashMode::DropUnsynced);
        assert_eq!(dropped[0], 1);
        assert_eq!(dropped[4096], 0);
        let torn = dev.crash_image(CrashMode::TearLast { sectors_kept: 2 });
        assert_eq!(torn[8192 + 1023], 3);
        assert_eq!(torn[8192 + 1024], 0);
        assert_eq!(torn[4096], 0);
        let some = dev.crash_image(CrashMode::KeepSome { mask: 0b10 });
        assert_eq!((some[4096], some[8192]), (0, 3));
        dev.fail_after_writes(1);
        dev.write_at(&block(4), 12288).unwrap();
        assert!(dev.write_at(&block(5), 16384).is_err());
        assert!(dev.sync().is_err());
        assert!(dev.has_crashed());
        let torn = dev.crash_image(CrashMode::TearLast { sectors_kept: 8 });
        assert_eq!(torn[16384], 5);
    }

    #[test]
    fn mem_device_loses_the_chosen_write() {
        let dev = MemDevice::new(64 * 1024);
        let block = |b: u8| vec![b; BLOCK_SIZE];
        dev.lose_write(8192..16384, 1);
        dev.write_at(&block(1), 8192).unwrap();
        dev.write_at(&block(2), 0).unwrap();
        dev.write_at(&block(3), 8192).unwrap();
        dev.write_at(&block(4), 12288).unwrap();
        dev.sync().unwrap();
        let image = dev.crash_image(CrashMode::DropUnsynced);
        assert_eq!((image[0], image[8192], image[12288]), (2, 1, 4));
        assert_eq!(dev.lost_writes(), 1);
    }

    #[test]
    fn file_device_round_trip_and_alignment() {
        let dir = std::env::temp_dir().join(format!("betreefs-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("img");
        let dev = FileDevice::create_file(&path, 1 << 20).unwrap();
        assert_eq!(dev.len_bytes(), 1 << 20);
        let buf = AlignedBuf::from_slice(b"betreefs");
        dev.write_at(&buf, 8192).unwrap();
        dev.sync().unwrap();
        let mut back = AlignedBuf::zeroed(BLOCK_SIZE);
        dev.read_at(&mut back, 8192).unwrap();
        assert_eq!(&back[..8], b"betreefs");
        // An unaligned heap buffer goes through a bounce buffer.
        let mut plain = vec![0u8; BLOCK_SIZE + 1];
        dev.read_at(&mut plain[1..], 8192).unwrap();
        assert_eq!(&plain[1..9], b"betreefs");
        assert!(dev.write_at(&buf[..100], 0).is_err());
        assert!(dev.write_at(&buf, 1 << 20).is_err());
        // A second opener is refused while the first holds the image.
        let err = FileDevice::open(&path).err().unwrap();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        assert!(FileDevice::open_read_only(&path).is_err());
        drop(dev);
        // Readers share the image, and keep writers out.
        let r1 = FileDevice::open_read_only(&path).unwrap();
        let r2 = FileDevice::open_read_only(&path).unwrap();
        assert!(FileDevice::open(&path).is_err());
        let mut back = AlignedBuf::zeroed(BLOCK_SIZE);
        r2.read_at(&mut back, 8192).unwrap();
        assert_eq!(&back[..8], b"betreefs");
        assert!(r1.write_at(&back, 8192).is_err());
        assert!(r1.sync().is_err());
        drop((r1, r2));
        assert!(FileDevice::open(&path).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Reads into memory not initialised first: the file device's own
    /// loop of preads and the default (`MemDevice`) give every byte the
    /// device holds, and an error for a read past the end.
    #[test]
    fn reads_into_fresh_memory() {
        let dir = std::env::temp_dir().join(format!("betreefs-uninit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = FileDevice::create_file(&dir.join("img"), 1 << 20).unwrap();
        let mem = MemDevice::new(1 << 20);
        let data: Vec<u8> = (0..3 * BLOCK_SIZE).map(|i| (i % 253) as u8 + 1).collect();
        let at = 4 * BLOCK_SIZE as u64;
        let devices: [&dyn Device; 2] = [&file, &mem];
        for dev in devices {
            dev.write_at(&AlignedBuf::from_slice(&data), at).unwrap();
            // SAFETY: read_at_uninit writes every byte it is given when it
            // succeeds; the pointer and length are filled_by's.
            let back = unsafe {
                AlignedBuf::filled_by(data.len(), |ptr, n| dev.read_at_uninit(ptr, n, at))
            }
            .unwrap();
            assert_eq!(&back[..], &data[..]);
            let end = (1 << 20) - BLOCK_SIZE as u64;
            // SAFETY: as above.
            let past = unsafe {
                AlignedBuf::filled_by(2 * BLOCK_SIZE, |ptr, n| dev.read_at_uninit(ptr, n, end))
            };
            assert!(past.is_err());
        }
        drop(file);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
