//! Little-endian fields at fixed offsets of on-disk blocks, read without
//! ever indexing out of bounds: a field past the end reads as zero (the
//! structure's own checks then refuse it) and writing one is a no-op.

pub fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    if let Some(src) = b.get(at..at.saturating_add(4)) {
        raw.copy_from_slice(src);
    }
    u32::from_le_bytes(raw)
}

pub fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    if let Some(src) = b.get(at..at.saturating_add(8)) {
        raw.copy_from_slice(src);
    }
    u64::from_le_bytes(raw)
}

pub fn put_bytes(b: &mut [u8], at: usize, v: &[u8]) {
    debug_assert!(at + v.len() <= b.len(), "field past the end of its block");
    if let Some(dst) = b.get_mut(at..at.saturating_add(v.len())) {
        dst.copy_from_slice(v);
    }
}

pub fn put_le_u32(b: &mut [u8], at: usize, v: u32) {
    put_bytes(b, at, &v.to_le_bytes());
}

pub fn put_le_u64(b: &mut [u8], at: usize, v: u64) {
    put_bytes(b, at, &v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_past_the_end_read_zero() {
        let mut b = [0u8; 12];
        put_le_u64(&mut b, 4, u64::MAX);
        assert_eq!(le_u64(&b, 4), u64::MAX);
        assert_eq!(le_u32(&b, 0), 0);
        assert_eq!(le_u32(&b, 10), 0);
        assert_eq!(le_u64(&b, usize::MAX - 2), 0);
    }
}
