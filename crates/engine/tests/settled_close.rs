//! A store closes with every root's buffers within a node's worth: the
//! final checkpoint applies what is staged and settles it. Closed over
//! it, the first write after the next open — unstaged, as every first
//! write is — settled the whole tree, whatever key space it wrote: a
//! file system's atime update on a cold read flushed the data tree's
//! root into a leaf it read first, and one cold 4 KiB read right after
//! mounting cost 2 MiB of device reads.

mod common;

use std::sync::Arc;

use betreefs_engine::{KeySpace, Options, Store, WriteBatch};
use betreefs_store::MemDevice;
use common::{mid_options, numbered_key as key};

/// [`mid_options`] with the roots cached at open, as the mount daemon's
/// warming leaves them: a root that is not cached is not settled.
fn options() -> Options {
    Options {
        warm_bytes: 1 << 20,
        ..mid_options()
    }
}

/// Forty sessions of small (staged) data writes, each stopping at a
/// different point of the staging bound: after every close the next open
/// finds each root within a node's worth, and a metadata write then
/// settles nothing and reads no leaf.
#[test]
fn a_closed_store_has_its_roots_settled() {
    let node = mid_options().node_size as u64;
    let dev = MemDevice::new(256 << 20);
    Store::create_on(Arc::new(dev.clone()), options())
        .unwrap()
        .close()
        .unwrap();
    let mut next = 0u32;
    for session in 0..40u32 {
        let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
        for _ in 0..(session * 7 % 23 + 5) {
            let mut batch = WriteBatch::new();
            for _ in 0..20 {
                batch.put(KeySpace::Data, &key(next), &[next as u8; 200]);
                next += 1;
            }
            store.write(&batch).unwrap();
        }
        store.close().unwrap();

        let store = Store::open_on(Arc::new(dev.clone()), options()).unwrap();
        let opened = store.stats();
        assert!(
            opened.flush_backlog_bytes <= node,
            "session {session}: a root holds {} bytes past the close (a node is {node})",
            opened.flush_backlog_bytes
        );
        store
            .put(KeySpace::Meta, b"atime", &session.to_le_bytes())
            .unwrap();
        let written = store.stats();
        assert_eq!(
            (written.settle_steps, written.leaves_read_for_flushes),
            (opened.settle_steps, opened.leaves_read_for_flushes),
            "session {session}: a metadata write after the open settled a root"
        );
        assert_eq!(
            store.get(KeySpace::Data, &key(next - 1)).unwrap(),
            Some(vec![(next - 1) as u8; 200])
        );
        store.close().unwrap();
    }
}
