//! Pieces the file-system tests share.
#![allow(dead_code)]

use betreefs_engine::Options;
use betreefs_fs::{Caller, FileSystem, Operations};

pub const ME: Caller = Caller::new(1000, 1000);

/// Small nodes and basements, no background threads: a few files make a
/// tree of several levels, and nothing runs but what a test does.
pub fn options() -> Options {
    Options {
        node_size: 64 << 10,
        basement_size: 8 << 10,
        cache_bytes: 4 << 20,
        log_flush_interval: None,
        checkpoint_interval: None,
        ..Options::default()
    }
}

/// [`options`], and nodes as `betreefs mkfs` sizes them for a small
/// device (256 KiB, basements of an eighth).
pub fn option_sets() -> [Options; 2] {
    [
        options(),
        Options {
            node_size: 256 << 10,
            basement_size: 32 << 10,
            cache_bytes: 8 << 20,
            ..options()
        },
    ]
}

/// A count from the environment (to run a test longer), or `default`.
pub fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Creates `name` in `dir` holding `data`; its inode number.
pub fn write_file(fs: &FileSystem, dir: u64, name: &[u8], data: &[u8]) -> u64 {
    let (attr, fh) = fs.create(dir, name, 0o644, 0, ME).unwrap();
    assert_eq!(
        fs.write(attr.ino, fh, 0, data, None).unwrap() as usize,
        data.len()
    );
    fs.release(fh).unwrap();
    attr.ino
}
