//! The file system layer of betreefs ("northbound"): POSIX operations over
//! the engine's two key spaces, with full-path keys. No FUSE types live
//! here; `betreefs-fuse` adapts [`FileSystem`] to the kernel.
//!
//! - [`schema`]: how paths become keys (the five invariants of
//!   docs/design.md, so that every directory's subtree is one range);
//! - [`record`]: the stored records (file-system format version 2);
//! - [`fs`]: the operations and the table of inodes the kernel holds;
//! - [`acl`]: POSIX ACLs kept consistent with modes, and inherited;
//! - [`ops`]: the operations a FUSE front end needs ([`Operations`]) and
//!   their types;
//! - [`fsck`]: the offline checker.

#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

pub mod acl;
pub mod error;
pub mod fs;
pub mod fsck;
pub mod ops;
mod plan;
pub mod record;
pub mod schema;

pub use error::{Errno, FsResult};
pub use fs::{
    dir_cookie, mode_without_privileges, AtimePolicy, Caller, DirEntry, FileSystem, FsStats, Ino,
    RenameFlags, SetAttr, SetTime, CAPABILITY_XATTR, ROOT_INO, XATTR_ACL_KILL_SGID,
};
pub use ops::Operations;
