//! Byte-level mutations of valid encodings, in the manner of libFuzzer's
//! and AFL's havoc stage: flips, interesting values, length tweaks,
//! insertions, deletions, duplicated and spliced runs.

use rand::Rng;

/// Values that sit on the edges decoders test: zero, all ones, sign
/// boundaries, and lengths just past common limits.
const INTERESTING_U32: [u32; 12] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x1000,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_fffe,
    0xffff_ffff,
    128 * 1024 + 1,
];

/// The largest input a mutation may grow to.
pub const MAX_INPUT: usize = 1 << 20;

/// Applies one to four mutations to `input`; `corpus` provides runs to
/// splice in.
pub fn mutate(rng: &mut impl Rng, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    for _ in 0..rng.gen_range(1..=4) {
        mutate_once(rng, input, corpus);
    }
    input.truncate(MAX_INPUT);
}

fn mutate_once(rng: &mut impl Rng, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    let len = input.len();
    let at = |rng: &mut dyn rand::RngCore| if len == 0 { 0 } else { rng.gen_range(0..len) };
    match rng.gen_range(0..10) {
        // A bit flip.
        0 if len > 0 => {
            let i = at(rng);
            input[i] ^= 1 << rng.gen_range(0..8);
        }
        // A random byte.
        1 if len > 0 => {
            let i = at(rng);
            input[i] = rng.gen();
        }
        // An interesting 32-bit value (a length, a count, an offset).
        2 if len >= 4 => {
            let i = rng.gen_range(0..=len - 4);
            let v = INTERESTING_U32[rng.gen_range(0..INTERESTING_U32.len())];
            input[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        // A small change to a 32-bit little-endian number.
        3 if len >= 4 => {
            let i = rng.gen_range(0..=len - 4);
            let mut raw = [0u8; 4];
            raw.copy_from_slice(&input[i..i + 4]);
            let v = u32::from_le_bytes(raw)
                .wrapping_add(rng.gen_range(0..64))
                .wrapping_sub(32);
            input[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        // A varint byte turned into a long continuation.
        4 if len > 0 => {
            let i = at(rng);
            input[i] |= 0x80;
        }
        // Random bytes inserted.
        5 => {
            let i = if len == 0 { 0 } else { rng.gen_range(0..=len) };
            let n = rng.gen_range(1..=16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            input.splice(i..i, bytes);
        }
        // A run deleted.
        6 if len > 0 => {
            let i = at(rng);
            let n = rng.gen_range(1..=(len - i).min(64));
            input.drain(i..i + n);
        }
        // A run duplicated in place.
        7 if len > 0 => {
            let i = at(rng);
            let n = rng.gen_range(1..=(len - i).min(64));
            let run = input[i..i + n].to_vec();
            input.splice(i..i, run);
        }
        // Truncated.
        8 if len > 0 => {
            let keep = at(rng);
            input.truncate(keep);
        }
        // A run of another input spliced over.
        _ => {
            if corpus.is_empty() {
                return;
            }
            let other = &corpus[rng.gen_range(0..corpus.len())];
            if other.is_empty() {
                return;
            }
            let from = rng.gen_range(0..other.len());
            let n = rng.gen_range(1..=(other.len() - from).min(256));
            let to = if len == 0 { 0 } else { rng.gen_range(0..len) };
            let end = (to + n).min(len);
            input.splice(to..end, other[from..from + n].iter().copied());
        }
    }
}
