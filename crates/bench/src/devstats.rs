//! Device-level IO counters, read the same way for every file system:
//! from the block statistics of the loop device it sits on
//! (`/sys/block/loopN/stat`, see the kernel's Documentation/block/stat.rst);
//! the blocks an operation wrote, from digests of the image taken while
//! the file system is unmounted; and space in use from statvfs.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

/// Bytes the device read and wrote (sectors are 512 bytes in this file
/// whatever the device's block size).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IoCounters {
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ios: u64,
    pub write_ios: u64,
}

impl IoCounters {
    /// Parses the first fields of a block device's `stat` file: read IOs,
    /// read merges, read sectors, read ticks, write IOs, write merges,
    /// write sectors, ...
    pub fn parse(text: &str) -> Result<IoCounters> {
        let fields = stat_fields(text, 7)?;
        Ok(IoCounters {
            read_ios: fields[0],
            read_bytes: fields[2] * 512,
            write_ios: fields[4],
            write_bytes: fields[6] * 512,
        })
    }

    /// Reads the counters of a device such as `/dev/loop3`.
    pub fn of_device(dev: &str) -> Result<IoCounters> {
        Self::parse(&read_stat(&stat_path(dev))?)
    }

    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &IoCounters) -> IoCounters {
        IoCounters {
            read_bytes: self.read_bytes.saturating_sub(earlier.read_bytes),
            write_bytes: self.write_bytes.saturating_sub(earlier.write_bytes),
            read_ios: self.read_ios.saturating_sub(earlier.read_ios),
            write_ios: self.write_ios.saturating_sub(earlier.write_ios),
        }
    }
}

/// Where the block statistics of a device such as `/dev/loop3` are.
pub fn stat_path(dev: &str) -> String {
    format!("/sys/block/{}/stat", dev.trim_start_matches("/dev/"))
}

/// The text of a block statistics file (see [`stat_path`]).
pub fn read_stat(path: &str) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {path}"))
}

/// The fields of a block device's `stat` line, at least `at_least` of them.
pub fn stat_fields(text: &str, at_least: usize) -> Result<Vec<u64>> {
    let fields: Vec<u64> = text
        .split_whitespace()
        .map(|f| f.parse::<u64>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("not a block stat line: {text:?}"))?;
    anyhow::ensure!(fields.len() >= at_least, "short block stat line: {text:?}");
    Ok(fields)
}

fn statvfs(dir: &Path) -> Result<libc::statvfs> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
    // SAFETY: statvfs writes into the zeroed struct we pass; the path is a
    // valid C string.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("statvfs {}", dir.display()));
        }
        Ok(st)
    }
}

/// Bytes in use on the file system mounted at `dir`, as statvfs reports
/// them (blocks minus free blocks).
pub fn space_used(dir: &Path) -> Result<u64> {
    let st = statvfs(dir)?;
    Ok((st.f_blocks - st.f_bfree) * st.f_frsize)
}

/// Bytes an unprivileged writer could still put on the file system
/// holding `dir`.
pub fn space_available(dir: &Path) -> Result<u64> {
    let st = statvfs(dir)?;
    Ok(st.f_bavail * st.f_frsize)
}

/// The CRC32C of every 4 KiB block of an image that holds data (holes are
/// skipped with SEEK_DATA/SEEK_HOLE). Two digests taken while the file
/// system is unmounted tell which blocks were written in between: the
/// IO-amplification study's space cost ("unique disk locations written").
/// A block rewritten with identical contents is not seen, so this is a
/// lower bound.
#[derive(Debug, Default)]
pub struct BlockDigest {
    blocks: HashMap<u64, u32>,
}

const DIGEST_BLOCK: u64 = 4096;

impl BlockDigest {
    pub fn of_image(path: &Path) -> Result<BlockDigest> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let fd = file.as_raw_fd();
        // SAFETY: advice on a descriptor we own; pages the loop device
        // wrote around the cache must not be read stale.
        unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
        let len = file.metadata()?.len();
        let mut digest = BlockDigest::default();
        let mut buf = vec![0u8; 1 << 20];
        let mut pos: u64 = 0;
        while pos < len {
            // SAFETY: lseek on a descriptor we own.
            let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::ENXIO) {
                    break; // no data after pos
                }
                return Err(err).context("SEEK_DATA");
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            if hole < 0 {
                return Err(std::io::Error::last_os_error()).context("SEEK_HOLE");
            }
            let mut at = data as u64 / DIGEST_BLOCK * DIGEST_BLOCK;
            let end = (hole as u64).min(len);
            while at < end {
                let n = ((end - at).min(buf.len() as u64) as usize).div_ceil(DIGEST_BLOCK as usize)
                    * DIGEST_BLOCK as usize;
                let n = n.min((len - at) as usize);
                file.read_exact_at(&mut buf[..n], at)
                    .with_context(|| format!("reading {}", path.display()))?;
                for (i, block) in buf[..n].chunks(DIGEST_BLOCK as usize).enumerate() {
                    digest
                        .blocks
                        .insert(at / DIGEST_BLOCK + i as u64, crc32c::crc32c(block));
                }
                at += n as u64;
            }
            pos = end.max(pos + 1);
        }
        Ok(digest)
    }

    /// Bytes in blocks whose contents differ from `earlier` (a hole
    /// counting as zeros).
    pub fn written_since(&self, earlier: &BlockDigest) -> u64 {
        // A hole reads as zeros, and the image's own file system may turn
        // holes into zeroed blocks (ext4 zeroes out a fragmented unwritten
        // extent): such blocks were not written by the file system under
        // test.
        let zero = crc32c::crc32c(&[0u8; DIGEST_BLOCK as usize]);
        let changed = self
            .blocks
            .iter()
            .filter(|(block, crc)| earlier.blocks.get(block).copied().unwrap_or(zero) != **crc)
            .count() as u64;
        changed * DIGEST_BLOCK
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_see_the_blocks_written_between_them() {
        let path =
            std::env::temp_dir().join(format!("betreefs-bench-digest-{}", std::process::id()));
        let f = File::create(&path).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[7u8; 8192], 1 << 20).unwrap();
        f.write_all_at(&[9u8; 4096], 32 << 20).unwrap();
        f.sync_all().unwrap();
        let before = BlockDigest::of_image(&path).unwrap();
        assert!(before.blocks.len() >= 3, "{}", before.blocks.len());
        // One block rewritten with other bytes, one with the same bytes,
        // one block in a hole, one extending the file, and zeros into a
        // hole (not a change: a hole reads as zeros).
        f.write_all_at(&[8u8; 4096], 1 << 20).unwrap();
        f.write_all_at(&[7u8; 4096], (1 << 20) + 4096).unwrap();
        f.write_all_at(&[1u8; 4096], 48 << 20).unwrap();
        f.write_all_at(&[2u8; 100], 64 << 20).unwrap();
        f.write_all_at(&[0u8; 8192], 16 << 20).unwrap();
        f.sync_all().unwrap();
        let after = BlockDigest::of_image(&path).unwrap();
        assert_eq!(after.written_since(&before), 3 * 4096);
        assert_eq!(after.written_since(&after), 0);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn parses_a_kernel_stat_line() {
        let line = "    1370        0   99688     286      256       12    20480     1057        0     1944     1344        0        0        0        0       10       1\n";
        let c = IoCounters::parse(line).unwrap();
        assert_eq!(c.read_ios, 1370);
        assert_eq!(c.read_bytes, 99688 * 512);
        assert_eq!(c.write_ios, 256);
        assert_eq!(c.write_bytes, 20480 * 512);
        let later = IoCounters {
            write_bytes: c.write_bytes + 4096,
            ..c
        };
        assert_eq!(later.since(&c).write_bytes, 4096);
        assert_eq!(c.since(&later).write_bytes, 0);
    }

    #[test]
    fn refuses_garbage() {
        assert!(IoCounters::parse("1 2 3").is_err());
        assert!(IoCounters::parse("a b c d e f g").is_err());
    }
}
