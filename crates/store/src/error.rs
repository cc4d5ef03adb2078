use std::io;

/// Everything that can go wrong below the tree.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("I/O error during {context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("not a betreefs image: {0}")]
    NotBetreefs(String),
    #[error("image has format version {found}, this build reads up to {supported}")]
    UnsupportedVersion { found: u32, supported: u32 },
    #[error(
        "image has format version {found} of an earlier betreefs; this build reads only version \
         {supported} and there is no upgrade before 1.0: copy the files out with the betreefs \
         that made it, then mkfs anew"
    )]
    OlderVersion { found: u32, supported: u32 },
    #[error("corrupt superblock: {0}")]
    CorruptSuperblock(String),
    #[error("corrupt log record at log position {position}: {reason}")]
    CorruptLog { position: u64, reason: String },
    #[error(
        "the redo log has a hole: {0}; opening read-write would drop writes that were \
         acknowledged as durable. Open it read-only (mount -o ro) to copy the files out; \
         `betreefs fsck` describes the damage"
    )]
    LogHole(crate::LogHole),
    #[error("the redo log region is full ({used} of {capacity} bytes in use); a checkpoint must run first")]
    LogFull { used: u64, capacity: u64 },
    #[error("log record of {bytes} bytes exceeds the limit of {limit} bytes")]
    RecordTooLarge { bytes: u64, limit: u64 },
    #[error("no space left in the node region (needed {needed_bytes} contiguous bytes)")]
    NoSpace { needed_bytes: u64 },
    #[error("device too small: {bytes} bytes, at least {minimum} needed")]
    DeviceTooSmall { bytes: u64, minimum: u64 },
    #[error("the store failed earlier and refuses further writes: {0}")]
    Failed(String),
}

impl StoreError {
    pub fn io(context: &'static str, source: io::Error) -> Self {
        StoreError::Io { context, source }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;
