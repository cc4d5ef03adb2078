use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Mutex;

use crate::BLOCK_SIZE;

/// A zero-initialised byte buffer aligned to [`BLOCK_SIZE`], as `O_DIRECT`
/// requires. Its length is always a whole number of blocks.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes allocated (at least `len`, all initialised): a size class for
    /// large buffers, so that recycled ones fit the next request.
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only allow reads of plain bytes.
unsafe impl Sync for AlignedBuf {}

/// Large allocations given back by [`AlignedBuf`]'s drop, by size class,
/// kept for the next read or node write. A node read into fresh memory
/// pays a page fault and a kernel page clear per 4 KiB before the device
/// writes it: 37% of the mount daemon's cycles in a cold sequential read.
/// Recycled buffers are already mapped. Reads and node writes vary in
/// length, so large buffers are allocated in size classes
/// ([`capacity_for`]), each wasting at most an eighth of its buffer.
struct Pool {
    /// (capacity, allocation), all initialised.
    buffers: Vec<(usize, NonNull<u8>)>,
    bytes: usize,
}

// SAFETY: a pooled allocation is owned by the pool alone until it is
// handed out again, like a Vec<u8> moved between threads.
unsafe impl Send for Pool {}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    buffers: Vec::new(),
    bytes: 0,
});

/// Buffers smaller than this are allocated exactly and go back to the
/// allocator (which recycles small chunks well).
const POOL_MIN_LEN: usize = 128 << 10;
/// At most this much memory waits in the pool by default.
const POOL_MAX_BYTES: usize = 64 << 20;

/// The pool's limit now (see [`set_buffer_pool_limit`]).
static POOL_LIMIT: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(POOL_MAX_BYTES);

/// How much memory recycled IO buffers may hold while idle (default
/// 64 MiB). A process that must stay close to its node cache (the
/// key-value benchmarks) sets it lower; the mount daemon keeps the default,
/// which made cold sequential reads ~2x faster.
pub fn set_buffer_pool_limit(bytes: usize) {
    POOL_LIMIT.store(bytes, std::sync::atomic::Ordering::Relaxed);
    let mut pool = pool();
    while pool.bytes > bytes {
        let Some((cap, ptr)) = pool.buffers.pop() else {
            break;
        };
        pool.bytes -= cap;
        // SAFETY: pooled buffers were allocated with exactly this layout.
        unsafe { alloc::dealloc(ptr.as_ptr(), AlignedBuf::layout(cap)) }
    }
}

/// How much memory recycled IO buffers hold now.
pub fn buffer_pool_bytes() -> usize {
    pool().bytes
}

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `len` rounded up to whole blocks (at least one).
fn block_len(len: usize) -> usize {
    len.div_ceil(BLOCK_SIZE).max(1) * BLOCK_SIZE
}

/// The allocation size of a buffer of `len` (whole-block) bytes: large
/// ones in classes an eighth of a power of two apart, so that a buffer
/// kept while its node is cached (a leaf's values stay where they were
/// read) wastes at most an eighth of itself, not the half that classes of
/// powers of two did.
fn capacity_for(len: usize) -> usize {
    if len >= POOL_MIN_LEN {
        let highest_bit = 1usize << (usize::BITS - 1 - len.leading_zeros());
        let step = (highest_bit / 8).max(BLOCK_SIZE);
        len.div_ceil(step) * step
    } else {
        len
    }
}

impl AlignedBuf {
    /// A buffer of `len` bytes rounded up to whole blocks whose contents
    /// are unspecified (bytes of an earlier buffer, or zeros): for reads,
    /// which overwrite all of it. Reuses a recycled buffer when there is
    /// one of its size class.
    pub fn for_overwrite(len: usize) -> Self {
        let len = block_len(len);
        Self::take_pooled(len).unwrap_or_else(|| Self::zeroed(len))
    }

    /// A recycled buffer for `len` (whole-block) bytes: the smallest
    /// pooled one of its size class or up to a quarter larger (leaves
    /// vary in size, and a buffer kept while its leaf is cached returns to
    /// the pool in another class than the next read asks for).
    fn take_pooled(len: usize) -> Option<Self> {
        let cap = capacity_for(len);
        if cap < POOL_MIN_LEN {
            return None;
        }
        let mut pool = pool();
        let fits = |c: usize| c >= cap && c <= cap + cap / 4;
        // From the last given back (the likeliest still in the CPU's
        // caches); the first smallest wins.
        let (i, _) = pool
            .buffers
            .iter()
            .enumerate()
            .rev()
            .filter(|(_, b)| fits(b.0))
            .min_by_key(|(_, b)| b.0)?;
        let (cap, ptr) = pool.buffers.swap_remove(i);
        pool.bytes -= cap;
        Some(AlignedBuf { ptr, len, cap })
    }

    /// A buffer of `len` bytes rounded up to whole blocks, filled by
    /// `fill` (given its address and that length: bytes valid for writes
    /// that nothing else uses while it runs): a recycled buffer
    /// when one of its size class is pooled, else fresh memory that is
    /// not zeroed first — the device writes it, and a zeroed allocation of
    /// megabytes is purged and faulted back in page by page for the kernel
    /// to clear (half of the read-ahead threads' time in a cold sequential
    /// read, whose leaves outgrow the pool). The error of `fill`, if any.
    ///
    /// # Safety
    /// When `fill` returns `Ok`, it must have written every one of the
    /// bytes it was given.
    pub unsafe fn filled_by<E>(
        len: usize,
        fill: impl FnOnce(*mut u8, usize) -> Result<(), E>,
    ) -> Result<Self, E> {
        let len = block_len(len);
        if let Some(mut buf) = Self::take_pooled(len) {
            // Initialised already: an error leaves it whole for the pool.
            fill(buf.as_mut_ptr(), len)?;
            return Ok(buf);
        }
        let cap = capacity_for(len);
        let ptr = Self::allocate(cap, false);
        // SAFETY: the bytes past `len`, up to `cap`, are inside the
        // allocation: zeroed, so that a recycled buffer is initialised
        // whole (the pool's rule), as `fill` will make the rest.
        unsafe { std::ptr::write_bytes(ptr.as_ptr().add(len), 0, cap - len) };
        match fill(ptr.as_ptr(), len) {
            Ok(()) => Ok(AlignedBuf { ptr, len, cap }),
            Err(e) => {
                // SAFETY: allocated just above with this layout, and no
                // slice over its bytes was ever made.
                unsafe { alloc::dealloc(ptr.as_ptr(), Self::layout(cap)) };
                Err(e)
            }
        }
    }

    /// A zeroed buffer of `len` bytes rounded up to whole blocks (at least one).
    pub fn zeroed(len: usize) -> Self {
        let len = block_len(len);
        let cap = capacity_for(len);
        AlignedBuf {
            ptr: Self::allocate(cap, true),
            len,
            cap,
        }
    }

    /// A fresh allocation of `cap` bytes, zeroed when asked.
    fn allocate(cap: usize, zeroed: bool) -> NonNull<u8> {
        let layout = Self::layout(cap);
        // SAFETY: layout has non-zero size (at least one block).
        let raw = unsafe {
            if zeroed {
                alloc::alloc_zeroed(layout)
            } else {
                alloc::alloc(layout)
            }
        };
        NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout))
    }

    /// A buffer holding `data` followed by zero padding to a whole block.
    /// Only the padding is zeroed: for a node of megabytes, zeroing it all
    /// first (what an aligned zeroed allocation does) doubles the cost.
    pub fn from_slice(data: &[u8]) -> Self {
        // SAFETY: the fill writes every byte it is given (`data`, then
        // zeros to the whole block: `n` is `data.len()` rounded up), and
        // `data` cannot overlap a buffer no one else holds.
        let filled = unsafe {
            Self::filled_by(data.len(), |ptr, n| {
                std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len());
                std::ptr::write_bytes(ptr.add(data.len()), 0, n - data.len());
                Ok::<(), std::convert::Infallible>(())
            })
        };
        let Ok(buf) = filled;
        buf
    }

    /// The bytes allocated for this buffer (its length or more).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    fn layout(cap: usize) -> Layout {
        match Layout::from_size_align(cap, BLOCK_SIZE) {
            Ok(layout) => layout,
            // Only reachable for lengths near isize::MAX, which no caller asks for.
            Err(_) => panic!("aligned buffer of {cap} bytes is not allocatable"),
        }
    }
}

/// Its length and allocation, not its bytes (a node's worth).
impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr points to cap >= len initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr points to cap >= len initialised bytes owned
        // exclusively by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap >= POOL_MIN_LEN {
            let mut pool = pool();
            let limit = POOL_LIMIT.load(std::sync::atomic::Ordering::Relaxed);
            if pool.bytes + self.cap <= limit {
                pool.bytes += self.cap;
                pool.buffers.push((self.cap, self.ptr));
                return;
            }
        }
        // SAFETY: ptr was allocated with exactly this layout (its
        // capacity) in `zeroed` or `from_slice`; pooled buffers come from
        // those too.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_padded() {
        let buf = AlignedBuf::from_slice(b"hello");
        assert_eq!(buf.len(), BLOCK_SIZE);
        assert_eq!(buf.as_ptr() as usize % BLOCK_SIZE, 0);
        assert_eq!(&buf[..5], b"hello");
        assert!(buf[5..].iter().all(|&b| b == 0));
        assert_eq!(AlignedBuf::zeroed(BLOCK_SIZE + 1).len(), 2 * BLOCK_SIZE);
        let big: Vec<u8> = (0..3 * BLOCK_SIZE + 7)
            .map(|i| (i % 251) as u8 + 1)
            .collect();
        let buf = AlignedBuf::from_slice(&big);
        assert_eq!(buf.len(), 4 * BLOCK_SIZE);
        assert_eq!(&buf[..big.len()], &big[..]);
        assert!(buf[big.len()..].iter().all(|&b| b == 0));
        assert_eq!(AlignedBuf::from_slice(&[]).len(), BLOCK_SIZE);
    }

    #[test]
    fn large_buffers_are_recycled_and_small_ones_are_not() {
        let len = POOL_MIN_LEN * 3;
        let mut a = AlignedBuf::for_overwrite(len);
        assert_eq!(a.len(), len);
        a.fill(0xab);
        let ptr = a.as_ptr() as usize;
        drop(a);
        // Another test may take it first; then a fresh buffer comes back.
        let b = AlignedBuf::for_overwrite(len);
        assert_eq!(b.len(), len);
        assert_eq!(b.as_ptr() as usize % BLOCK_SIZE, 0);
        if b.as_ptr() as usize == ptr {
            assert!(
                b.iter().all(|&x| x == 0xab),
                "a recycled buffer keeps its bytes"
            );
        }
        // A slightly smaller request is in the same size class, and sees
        // only its own length.
        let ptr = b.as_ptr() as usize;
        drop(b);
        let c = AlignedBuf::for_overwrite(len - BLOCK_SIZE);
        assert_eq!(c.len(), len - BLOCK_SIZE);
        if c.as_ptr() as usize == ptr {
            assert_eq!(c.cap, capacity_for(len));
        }
        // A zeroed buffer is zeroed even when the pool has one of its size.
        drop(c);
        assert!(AlignedBuf::zeroed(len).iter().all(|&x| x == 0));
        assert_eq!(AlignedBuf::for_overwrite(100).len(), BLOCK_SIZE);
        assert!(pool().bytes <= POOL_MAX_BYTES);
        // A buffer built from a slice is initialised past its length (a
        // recycled one exposes those bytes to its next user).
        let d = AlignedBuf::from_slice(&[7u8; 200 << 10]);
        assert_eq!(d.len(), 200 << 10);
        assert_eq!(d.cap, 208 << 10);
        // SAFETY: cap bytes are allocated and, by from_slice, initialised.
        let whole = unsafe { std::slice::from_raw_parts(d.as_ptr(), d.cap) };
        assert!(whole[200 << 10..].iter().all(|&x| x == 0));
    }

    /// A buffer filled by its user from fresh memory: what the filler
    /// wrote, the bytes past its length zeroed (the pool hands them to the
    /// next user), and the filler's error returned.
    #[test]
    fn filled_buffers_hold_what_was_written() {
        // A size class no other test here uses (1 MiB for 1000 KiB), so
        // that the buffer is fresh unless this test ran before.
        let len = 1000 << 10;
        // SAFETY: the filler writes all `n` bytes it is given.
        let buf = unsafe {
            AlignedBuf::filled_by(len, |ptr, n| {
                assert_eq!(n, len);
                std::ptr::write_bytes(ptr, 0x5a, n);
                Ok::<(), std::io::Error>(())
            })
        }
        .unwrap();
        assert_eq!(buf.len(), len);
        assert!(buf.iter().all(|&x| x == 0x5a));
        assert_eq!(buf.cap, capacity_for(len));
        // SAFETY: cap bytes are allocated and, by filled_by, initialised.
        let whole = unsafe { std::slice::from_raw_parts(buf.as_ptr(), buf.cap) };
        assert!(whole[len..].iter().all(|&x| x == 0));
        drop(buf);
        // SAFETY: a filler that fails owes no bytes.
        let failed =
            unsafe { AlignedBuf::filled_by(len, |_, _| Err(std::io::Error::other("device gone"))) };
        assert_eq!(failed.map(|_| ()).unwrap_err().to_string(), "device gone");
        // SAFETY: as above.
        let small = unsafe {
            AlignedBuf::filled_by(10, |ptr, n| {
                std::ptr::write_bytes(ptr, 1, n);
                Ok::<(), std::io::Error>(())
            })
        }
        .unwrap();
        assert_eq!(small.len(), BLOCK_SIZE);
        assert!(small.iter().all(|&x| x == 1));
    }

    /// Large buffers waste at most an eighth of their length: a leaf's
    /// read buffer is kept while the leaf is cached.
    #[test]
    fn size_classes_waste_at_most_an_eighth() {
        for blocks in 1..2048 {
            let len = blocks * BLOCK_SIZE;
            let cap = capacity_for(len);
            assert!(cap >= len, "{len}: {cap}");
            assert!((cap - len) * 8 <= len, "{len} bytes in a class of {cap}");
            assert_eq!(cap % BLOCK_SIZE, 0);
        }
    }
}
