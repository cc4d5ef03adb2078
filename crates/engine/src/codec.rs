//! Bounds-checked little-endian and LEB128 encoding shared by every
//! engine-level on-disk structure. Decoding never panics: a short or
//! malformed input is a [`DecodeError`].

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(pub String);

pub type DecodeResult<T> = Result<T, DecodeError>;

/// Where encoded bytes go: a growing buffer ([`Encoder`]), a count of
/// them ([`Measure`]), or a slice of the size counted ([`SliceWriter`]) —
/// so a node image is encoded straight into its device buffer, measured
/// first, instead of into a vector grown by doubling and copied.
pub trait Sink {
    fn put(&mut self, b: &[u8]);
    fn u8(&mut self, v: u8) {
        self.put(&[v]);
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }
    /// LEB128.
    fn varint(&mut self, mut v: u64) {
        let mut bytes = [0u8; 10];
        let mut n = 0;
        for byte in bytes.iter_mut() {
            n += 1;
            if v < 0x80 {
                *byte = v as u8;
                break;
            }
            *byte = (v as u8) | 0x80;
            v >>= 7;
        }
        self.put(bytes.get(..n).unwrap_or_default());
    }
    /// Length-prefixed bytes.
    fn bytes(&mut self, b: &[u8]) {
        self.varint(b.len() as u64);
        self.put(b);
    }
}

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
}

impl Sink for Encoder {
    fn put(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
}

/// Counts the bytes an encoding takes.
#[derive(Default)]
pub struct Measure(pub usize);

impl Sink for Measure {
    fn put(&mut self, b: &[u8]) {
        self.0 += b.len();
    }
    fn varint(&mut self, v: u64) {
        self.0 += varint_len(v);
    }
}

/// Writes an encoding into a slice sized by a [`Measure`] of it.
pub struct SliceWriter<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> SliceWriter<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        SliceWriter { buf, pos: 0 }
    }
    pub fn written(&self) -> usize {
        self.pos
    }
}

impl Sink for SliceWriter<'_> {
    fn put(&mut self, b: &[u8]) {
        let end = self.pos + b.len();
        let Some(to) = self.buf.get_mut(self.pos..end) else {
            panic!(
                "encoding invariant: {end} bytes written to a slice measured at {}",
                self.buf.len()
            );
        };
        to.copy_from_slice(b);
        self.pos = end;
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

    proptest::proptest! {
        /// The three sinks agree: a measure counts what an encoder
        /// writes, and a slice of that size takes exactly the same bytes.
        #[test]
        fn sinks_agree(values in proptest::collection::vec((proptest::prelude::any::<u64>(), proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40)), 0..50)) {
            fn encode(sink: &mut impl Sink, values: &[(u64, Vec<u8>)]) {
                for (v, b) in values {
                    sink.varint(*v);
                    sink.varint(*v >> (v % 64));
                    sink.bytes(b);
                    sink.u32(*v as u32);
                    sink.u8(*v as u8);
                }
            }
            let mut encoder = Encoder::default();
            encode(&mut encoder, &values);
            let mut measure = Measure::default();
            encode(&mut measure, &values);
            proptest::prop_assert_eq!(measure.0, encoder.buf.len());
            let mut slice = vec![0u8; measure.0];
            let mut writer = SliceWriter::new(&mut slice);
            encode(&mut writer, &values);
            proptest::prop_assert_eq!(writer.written(), slice.len());
            proptest::prop_assert_eq!(&slice, &encoder.buf);
            let mut d = Decoder::new(&encoder.buf);
            for (v, b) in &values {
                proptest::prop_assert_eq!(d.varint().unwrap(), *v);
                proptest::prop_assert_eq!(d.varint().unwrap(), *v >> (v % 64));
                proptest::prop_assert_eq!(d.bytes().unwrap(), &b[..]);
                proptest::prop_assert_eq!(d.u32().unwrap(), *v as u32);
                proptest::prop_assert_eq!(d.u8().unwrap(), *v as u8);
            }
            proptest::prop_assert!(d.is_empty());
        }
    }
}
