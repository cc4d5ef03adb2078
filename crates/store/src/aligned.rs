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
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only allow reads of plain bytes.
unsafe impl Sync for AlignedBuf {}

/// Large buffers given back by [`AlignedBuf`]'s drop, kept for the next
/// read or node write of the same size. A node read into fresh memory pays a page fault
/// and a kernel page clear per 4 KiB before the device writes it: 37% of
/// the mount daemon's cycles in a cold sequential read. Recycled buffers
/// are already mapped.
struct Pool {
    buffers: Vec<Pooled>,
    bytes: usize,
}

/// A pooled allocation of `len` bytes made with [`AlignedBuf::layout`].
struct Pooled {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a pooled allocation is owned by the pool alone until it is
// handed out again, like a Vec<u8> moved between threads.
unsafe impl Send for Pooled {}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    buffers: Vec::new(),
    bytes: 0,
});

/// Buffers smaller than this go back to the allocator (which recycles
/// small chunks well).
const POOL_MIN_LEN: usize = 128 << 10;
/// At most this much memory waits in the pool.
const POOL_MAX_BYTES: usize = 64 << 20;

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

impl AlignedBuf {
    /// A buffer of `len` bytes rounded up to whole blocks whose contents
    /// are unspecified (bytes of an earlier buffer, or zeros): for reads,
    /// which overwrite all of it. Reuses a recycled buffer of that size
    /// when there is one.
    pub fn for_overwrite(len: usize) -> Self {
        let len = len.div_ceil(BLOCK_SIZE).max(1) * BLOCK_SIZE;
        Self::take_pooled(len).unwrap_or_else(|| Self::zeroed(len))
    }

    /// A recycled buffer of exactly `len` bytes (a whole number of blocks).
    fn take_pooled(len: usize) -> Option<Self> {
        if len < POOL_MIN_LEN {
            return None;
        }
        let mut pool = pool();
        let i = pool.buffers.iter().rposition(|b| b.len == len)?;
        let b = pool.buffers.swap_remove(i);
        pool.bytes -= b.len;
        Some(AlignedBuf {
            ptr: b.ptr,
            len: b.len,
        })
    }

    /// A zeroed buffer of `len` bytes rounded up to whole blocks (at least one).
    pub fn zeroed(len: usize) -> Self {
        let len = len.div_ceil(BLOCK_SIZE).max(1) * BLOCK_SIZE;
        let layout = Self::layout(len);
        // SAFETY: layout has non-zero size (at least one block).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len }
    }

    /// A buffer holding `data` followed by zero padding to a whole block.
    /// Only the padding is zeroed: for a node of megabytes, zeroing it all
    /// first (what an aligned zeroed allocation does) doubles the cost.
    pub fn from_slice(data: &[u8]) -> Self {
        let len = data.len().div_ceil(BLOCK_SIZE).max(1) * BLOCK_SIZE;
        if let Some(mut buf) = Self::take_pooled(len) {
            buf[..data.len()].copy_from_slice(data);
            buf[data.len()..].fill(0);
            return buf;
        }
        let layout = Self::layout(len);
        // SAFETY: layout has non-zero size (at least one block).
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        // SAFETY: the allocation holds `len >= data.len()` bytes; the copy
        // and the fill below initialise every one of them before any
        // slice over them exists, and `data` cannot overlap a fresh block.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.as_ptr(), data.len());
            std::ptr::write_bytes(ptr.as_ptr().add(data.len()), 0, len - data.len());
        }
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        match Layout::from_size_align(len, BLOCK_SIZE) {
            Ok(layout) => layout,
            // Only reachable for lengths near isize::MAX, which no caller asks for.
            Err(_) => panic!("aligned buffer of {len} bytes is not allocatable"),
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr points to len initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr points to len initialised bytes owned exclusively by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len >= POOL_MIN_LEN {
            let mut pool = pool();
            if pool.bytes + self.len <= POOL_MAX_BYTES {
                pool.bytes += self.len;
                pool.buffers.push(Pooled {
                    ptr: self.ptr,
                    len: self.len,
                });
                return;
            }
        }
        // SAFETY: ptr was allocated with exactly this layout in `zeroed`
        // or `from_slice` (pooled buffers come from those too).
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
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
        // A zeroed buffer is zeroed even when the pool has one of its size.
        drop(b);
        assert!(AlignedBuf::zeroed(len).iter().all(|&x| x == 0));
        assert_eq!(AlignedBuf::for_overwrite(100).len(), BLOCK_SIZE);
        assert!(pool().bytes <= POOL_MAX_BYTES);
    }
}
