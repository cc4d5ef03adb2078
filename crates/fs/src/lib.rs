//! The file system layer of betreefs ("northbound"): how paths become keys
//! in the engine's two key spaces. No FUSE types live here.
//!
//! This first part is the key schema ([`schema`]): full-path indexing with
//! the five invariants of `shared/DESIGN.md`, so that every directory's
//! subtree is one contiguous key range in both key spaces.

pub mod schema;
