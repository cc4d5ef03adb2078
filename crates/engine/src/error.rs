use betreefs_store::StoreError;

/// Everything the engine can report.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("corrupt node {num} (tree {tree}): {reason}")]
    CorruptNode { tree: u8, num: u64, reason: String },
    #[error("corrupt block translation table: {0}")]
    CorruptBlockTable(String),
    #[error("corrupt log record {seq}: {reason}")]
    CorruptLogRecord { seq: u64, reason: String },
    #[error("key of {0} bytes exceeds the limit of {limit} bytes", limit = crate::MAX_KEY_BYTES)]
    KeyTooLarge(usize),
    #[error("value of {0} bytes exceeds the limit of {limit} bytes", limit = crate::MAX_VALUE_BYTES)]
    ValueTooLarge(usize),
    #[error("unknown merge function {0}; register it before opening the store")]
    UnknownMergeFunction(u8),
    #[error("no space left on the device")]
    NoSpace,
    #[error("invalid message: {0}")]
    InvalidMessage(String),
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error("the store failed earlier and refuses writes until reopened: {0}")]
    Failed(String),
    #[error("the store is open read-only")]
    ReadOnly,
}

impl EngineError {
    /// Whether this comes from the device: an IO error, or something read
    /// back that is not what was written (a failing disk either way). The
    /// file system's `errors=` policy acts on these.
    pub fn is_device_fault(&self) -> bool {
        matches!(
            self,
            EngineError::Store(
                StoreError::Io { .. }
                    | StoreError::CorruptSuperblock(_)
                    | StoreError::CorruptLog { .. }
            ) | EngineError::CorruptNode { .. }
                | EngineError::CorruptBlockTable(_)
                | EngineError::CorruptLogRecord { .. }
        )
    }

    /// Whether a write was refused because its batch exceeds what one log
    /// record carries (a quarter of the log region); nothing was written.
    pub fn is_too_large(&self) -> bool {
        matches!(self, EngineError::Store(StoreError::RecordTooLarge { .. }))
    }

    /// Whether this is the device-full condition (the store stays usable).
    pub fn is_no_space(&self) -> bool {
        matches!(
            self,
            EngineError::NoSpace | EngineError::Store(StoreError::NoSpace { .. })
        )
    }
}

pub type EngineResult<T> = Result<T, EngineError>;
