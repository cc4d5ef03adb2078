//! Pieces the file-system tests share.
#![allow(dead_code)]

use std::sync::Arc;

use betreefs_engine::{Options, Store};
use betreefs_fs::{AtimePolicy, Caller, FileSystem, Operations};
use betreefs_store::MemDevice;

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

/// A file system formatted on a new in-memory device of `bytes`.
pub fn format_fs(bytes: u64, options: &Options) -> (MemDevice, FileSystem) {
    let dev = MemDevice::new(bytes);
    let store = Store::create_on(Arc::new(dev.clone()), options.clone()).unwrap();
    FileSystem::format(&store, ME).unwrap();
    (
        dev,
        FileSystem::mount(store, AtimePolicy::Relatime).unwrap(),
    )
}

/// The file system on `dev`, opened and mounted.
pub fn mount_fs(dev: &MemDevice, options: &Options, context: &str) -> FileSystem {
    let store = Store::open_on(Arc::new(dev.clone()), options.clone())
        .unwrap_or_else(|e| panic!("{context}: opening the store: {e}"));
    FileSystem::mount(store, AtimePolicy::Relatime).unwrap()
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
