use betreefs_engine::EngineError;

/// A POSIX error number, what every file-system operation fails with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    pub const ENOENT: Errno = Errno(libc::ENOENT);
    pub const EEXIST: Errno = Errno(libc::EEXIST);
    pub const ENOTDIR: Errno = Errno(libc::ENOTDIR);
    pub const EISDIR: Errno = Errno(libc::EISDIR);
    pub const ENOTEMPTY: Errno = Errno(libc::ENOTEMPTY);
    pub const EINVAL: Errno = Errno(libc::EINVAL);
    pub const EIO: Errno = Errno(libc::EIO);
    pub const ENOSPC: Errno = Errno(libc::ENOSPC);
    pub const ENAMETOOLONG: Errno = Errno(libc::ENAMETOOLONG);
    pub const ENODATA: Errno = Errno(libc::ENODATA);
    pub const ERANGE: Errno = Errno(libc::ERANGE);
    pub const E2BIG: Errno = Errno(libc::E2BIG);
    pub const EPERM: Errno = Errno(libc::EPERM);
    pub const EACCES: Errno = Errno(libc::EACCES);
    pub const ENXIO: Errno = Errno(libc::ENXIO);
    pub const ESTALE: Errno = Errno(libc::ESTALE);
    pub const EBADF: Errno = Errno(libc::EBADF);
    pub const EOPNOTSUPP: Errno = Errno(libc::EOPNOTSUPP);
    pub const EFBIG: Errno = Errno(libc::EFBIG);
    pub const EMLINK: Errno = Errno(libc::EMLINK);
    pub const EROFS: Errno = Errno(libc::EROFS);
}

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

impl std::error::Error for Errno {}

impl From<EngineError> for Errno {
    /// A full device is ENOSPC; a change too large for one log record
    /// (a clone of a huge tree) is EFBIG, refused before anything was
    /// written; anything else the engine reports is an I/O error for the
    /// caller, and is logged here with its detail.
    fn from(e: EngineError) -> Errno {
        if e.is_no_space() {
            return Errno::ENOSPC;
        }
        if e.is_too_large() {
            tracing::warn!("engine: {e}");
            return Errno::EFBIG;
        }
        if matches!(e, EngineError::ReadOnly) {
            return Errno::EROFS;
        }
        tracing::error!("engine: {e}");
        Errno::EIO
    }
}

pub type FsResult<T> = Result<T, Errno>;
