//! The FUSE front end: the kernel protocol (`include/uapi/linux/fuse.h`,
//! written here from the header: [`abi`], [`request`]) carried over
//! `/dev/fuse` or io_uring ([`session`], [`uring`]), each request becoming
//! one call on [`Operations`] ([`dispatch`]), so betreefs and nullfuse are
//! served by the same code. The mount is tuned to remove round trips
//! (docs/design.md, "The FUSE front end"):
//! - readdirplus, so a directory scan fills the kernel's dentry and inode
//!   caches from the same range scan (0.6 §3.3);
//! - 1 MiB requests (`max_pages`), several request threads each reading
//!   the device on a cloned descriptor, or one io_uring queue per CPU
//!   (`-o transport=`, io_uring when the kernel offers it);
//! - `HANDLE_KILLPRIV_V2` (the daemon clears set-ID bits and capabilities
//!   as the kernel would, so the kernel stops asking for them), FLUSH and
//!   OPENDIR answered ENOSYS (no FLUSH at close, no OPENDIR/RELEASEDIR,
//!   listings cached across opens), stateless readdir cookies;
//! - names cached for an hour and attributes for 10 s ([`ENTRY_TTL`],
//!   [`TTL`]), negative entries cached too: the daemon is the only writer
//!   of its image, and every change goes through the kernel, which
//!   invalidates what a change affects;
//! - `keep_cache` on open for the same reason;
//! - no kernel writeback cache by default (`-o writeback` turns it on):
//!   measured after the round-trip cuts it leaves untar unchanged and slows
//!   tokubench and rm -rf (an extra WRITE and SETATTR at close, a SETATTR
//!   at unlink), and it turns a partial-page write into a read of that page
//!   first — what a write-optimized file system exists to avoid;
//! - `default_permissions`: the kernel checks modes against the caller.
//!
//! Why each choice, with figures: docs/design.md, "The FUSE front end".

use std::time::Duration;

pub mod abi;
mod after_reply;
pub mod dispatch;
pub mod guard;
pub mod mount;
pub mod nullfuse;
pub mod request;
pub mod session;
pub mod stats;
pub mod uring;

pub use guard::RequestGuard;
pub use mount::MountFlags;
pub use session::{mount, ActiveTransport, Session};
pub use stats::RequestStats;

/// How long the kernel may cache attributes.
pub(crate) const TTL: Duration = Duration::from_secs(10);
/// How long the kernel may cache a name, found or absent. Names change
/// only through the kernel (the daemon is its image's only writer and
/// renames, links and removes nothing behind it), so a name needs no
/// revalidation: with 10 s, a walk over a tree read more than 10 s
/// earlier (rm -rf after a tar of it) sent one LOOKUP per entry again.
pub(crate) const ENTRY_TTL: Duration = Duration::from_secs(3600);
/// Largest read or write request.
pub const MAX_REQUEST: u32 = 1 << 20;

/// How requests travel between the kernel and the daemon.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// io_uring when the kernel offers it, else `/dev/fuse`.
    #[default]
    Auto,
    /// `/dev/fuse` reads and writes only.
    DevFuse,
    /// io_uring, or the mount fails with the reason.
    Uring,
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Transport::Auto),
            "devfuse" => Ok(Transport::DevFuse),
            "uring" => Ok(Transport::Uring),
            _ => Err(format!("transport={s}: expected auto, devfuse or uring")),
        }
    }
}

/// Mount settings.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Shown as the mount's source (e.g. the image path).
    pub fs_name: String,
    /// Threads reading and answering requests on `/dev/fuse`.
    pub threads: usize,
    /// Let other users in (as root, the default).
    pub allow_other: bool,
    /// Kernel mount flags (ro, nosuid, nodev, noexec, noatime...).
    pub flags: MountFlags,
    /// Let the kernel cache writes and send them in large requests (see the
    /// module documentation for why this is off by default).
    pub writeback_cache: bool,
    pub transport: Transport,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            fs_name: "betreefs".into(),
            threads: 2,
            allow_other: is_root(),
            flags: MountFlags::default(),
            writeback_cache: false,
            transport: Transport::default(),
        }
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
