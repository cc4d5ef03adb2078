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
