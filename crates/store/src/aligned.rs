use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

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

impl AlignedBuf {
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
        // SAFETY: ptr was allocated with exactly this layout in `zeroed`.
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
}
