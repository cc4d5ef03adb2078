//! Bounds-checked little-endian and LEB128 encoding shared by every
//! engine-level on-disk structure. Decoding never panics: a short or
//! malformed input is a [`DecodeError`].

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(pub String);

pub type DecodeResult<T> = Result<T, DecodeError>;

#[derive(Default)]
pub struct Encoder {
    pub buf: Vec<u8>,
}

impl Encoder {
    pub fn with_capacity(n: usize) -> Self {
        Encoder {
            buf: Vec::with_capacity(n),
        }
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }
    /// Length-prefixed bytes.
    pub fn bytes(&mut self, b: &[u8]) {
        self.varint(b.len() as u64);
        self.buf.extend_from_slice(b);
    }
}

/// Bytes a varint of `v` takes.
pub fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

pub struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Decoder { buf, pos: 0 }
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }
    pub fn take(&mut self, n: usize) -> DecodeResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(DecodeError(format!(
                "needs {n} bytes at offset {} but only {} remain",
                self.pos,
                self.remaining()
            )));
        }
        let out = self
            .buf
            .get(self.pos..self.pos + n)
            .ok_or_else(|| DecodeError(format!("needs {n} bytes at offset {}", self.pos)))?;
        self.pos += n;
        Ok(out)
    }
    pub fn u8(&mut self) -> DecodeResult<u8> {
        self.take(1)?
            .first()
            .copied()
            .ok_or_else(|| DecodeError("needs a byte".into()))
    }
    pub fn u32(&mut self) -> DecodeResult<u32> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    pub fn u64(&mut self) -> DecodeResult<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    pub fn varint(&mut self) -> DecodeResult<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8()?;
            v |= ((byte & 0x7f) as u64) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError("varint longer than 10 bytes".into()))
    }
    /// A length that must fit in what remains (guards allocations).
    pub fn len(&mut self) -> DecodeResult<usize> {
        let n = self.varint()?;
        if n > self.remaining() as u64 {
            return Err(DecodeError(format!(
                "length {n} exceeds the {} bytes left",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }
    pub fn bytes(&mut self) -> DecodeResult<&'a [u8]> {
        let n = self.len()?;
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut e = Encoder::default();
        e.varint(300);
        e.bytes(b"abc");
        e.u64(u64::MAX);
        e.varint(u64::MAX);
        assert_eq!(varint_len(300), 2);
        let mut d = Decoder::new(&e.buf);
        assert_eq!(d.varint().unwrap(), 300);
        assert_eq!(d.bytes().unwrap(), b"abc");
        assert_eq!(d.u64().unwrap(), u64::MAX);
        assert_eq!(d.varint().unwrap(), u64::MAX);
        assert!(d.is_empty());
        for cut in 0..e.buf.len() {
            let mut d = Decoder::new(&e.buf[..cut]);
            let ok = d
                .varint()
                .and_then(|_| d.bytes().map(|_| ()))
                .and_then(|_| d.u64())
                .and_then(|_| d.varint());
            assert!(ok.is_err());
        }
    }
}
