use crate::{StoreError, StoreResult};

/// The unit of every IO and of allocation in the node region.
pub const BLOCK_SIZE: usize = 4096;
const BLOCK: u64 = BLOCK_SIZE as u64;

/// Smallest image we agree to format: two superblocks, a 1 MiB log and a
/// node region large enough for a handful of nodes.
const MIN_DEVICE_BYTES: u64 = 8 << 20;

/// A contiguous run of bytes in the node region.
///
/// `block` counts 4 KiB blocks from the start of the node region; `len` is
/// the number of meaningful bytes (the extent occupies `len` rounded up to
/// whole blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Extent {
    pub block: u64,
    pub len: u32,
}

impl Extent {
    pub fn blocks(&self) -> u64 {
        (self.len as u64).div_ceil(BLOCK).max(1)
    }
}

/// Where the regions of an image lie, in bytes from the start of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub device_bytes: u64,
    pub log_offset: u64,
    pub log_bytes: u64,
    pub nodes_offset: u64,
    pub nodes_bytes: u64,
}

impl Layout {
    /// Plans the regions of a new image. The log gets `log_bytes` if given,
    /// else 1/16 of the device clamped to [1 MiB, 512 MiB]: large enough that
    /// checkpoints are driven by the timer rather than by a full log on
    /// ordinary workloads, small enough that replay after a crash is quick.
    pub fn plan(device_bytes: u64, log_bytes: Option<u64>) -> StoreResult<Layout> {
        let device_bytes = device_bytes / BLOCK * BLOCK;
        if device_bytes < MIN_DEVICE_BYTES {
            return Err(StoreError::DeviceTooSmall {
                bytes: device_bytes,
                minimum: MIN_DEVICE_BYTES,
            });
        }
        let log_bytes = log_bytes
            .unwrap_or(device_bytes / 16)
            .clamp(1 << 20, 512 << 20)
            .min(device_bytes / 4)
            / BLOCK
            * BLOCK;
        let log_offset = 2 * BLOCK;
        let nodes_offset = log_offset + log_bytes;
        Ok(Layout {
            device_bytes,
            log_offset,
            log_bytes,
            nodes_offset,
            nodes_bytes: device_bytes - nodes_offset,
        })
    }

    pub fn node_blocks(&self) -> u64 {
        self.nodes_bytes / BLOCK
    }

    /// Device byte offset of an extent in the node region.
    pub fn extent_offset(&self, extent: Extent) -> u64 {
        self.nodes_offset + extent.block * BLOCK
    }

    /// Checks that the regions fit the device and each other.
    pub fn validate(&self, actual_device_bytes: u64) -> Result<(), String> {
        let aligned = [
            self.log_offset,
            self.log_bytes,
            self.nodes_offset,
            self.nodes_bytes,
        ]
        .iter()
        .all(|v| v % BLOCK == 0);
        if !aligned {
            return Err("region boundaries are not block aligned".into());
        }
        if self.log_offset != 2 * BLOCK || self.nodes_offset != self.log_offset + self.log_bytes {
            return Err("regions overlap or leave gaps".into());
        }
        if self.log_bytes < BLOCK * 4 {
            return Err("log region too small".into());
        }
        if self.nodes_offset + self.nodes_bytes != self.device_bytes {
            return Err("node region does not end at the end of the image".into());
        }
        if self.device_bytes > actual_device_bytes {
            return Err(format!(
                "image claims {} bytes but the device holds only {}",
                self.device_bytes, actual_device_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_is_valid_and_clamped() {
        let layout = Layout::plan(4 << 30, None).unwrap();
        assert_eq!(layout.log_bytes, 256 << 20);
        layout.validate(4 << 30).unwrap();
        let small = Layout::plan(8 << 20, None).unwrap();
        assert_eq!(small.log_bytes, 1 << 20);
        small.validate(8 << 20).unwrap();
        assert!(Layout::plan(1 << 20, None).is_err());
        assert!(layout.validate(1 << 30).is_err());
    }
}
