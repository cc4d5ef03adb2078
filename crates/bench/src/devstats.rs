//! Device-level IO counters, read the same way for every file system:
//! from the block statistics of the loop device it sits on
//! (`/sys/block/loopN/stat`, see the kernel's Documentation/block/stat.rst),
//! and space in use from statvfs.

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
        let fields: Vec<u64> = text
            .split_whitespace()
            .map(|f| f.parse::<u64>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("not a block stat line: {text:?}"))?;
        anyhow::ensure!(fields.len() >= 7, "short block stat line: {text:?}");
        Ok(IoCounters {
            read_ios: fields[0],
            read_bytes: fields[2] * 512,
            write_ios: fields[4],
            write_bytes: fields[6] * 512,
        })
    }

    /// Reads the counters of a device such as `/dev/loop3`.
    pub fn of_device(dev: &str) -> Result<IoCounters> {
        let name = dev.trim_start_matches("/dev/");
        let path = format!("/sys/block/{name}/stat");
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        Self::parse(&text)
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

/// Bytes in use on the file system mounted at `dir`, as statvfs reports
/// them (blocks minus free blocks).
pub fn space_used(dir: &Path) -> Result<u64> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
    // SAFETY: statvfs writes into the zeroed struct we pass; the path is a
    // valid C string.
    let st = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("statvfs {}", dir.display()));
        }
        st
    };
    Ok((st.f_blocks - st.f_bfree) * st.f_frsize)
}

#[cfg(test)]
mod tests {
    use super::*;

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
