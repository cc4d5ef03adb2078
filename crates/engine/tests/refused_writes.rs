//! Refusing writes at run time (a remount read-only of the file system).

mod common;

use std::sync::Arc;

use betreefs_engine::{KeySpace, Store};
use common::{mem_store, small_options};

/// A remount read-only: writes are refused, reads and checkpoints go on,
/// and what was written before is in the image without its log (a power
/// cut right after loses nothing); then writes are taken again.
#[test]
fn refused_writes_leave_a_whole_image_and_can_resume() {
    let (dev, store) = mem_store(32 << 20, small_options());
    store.put(KeySpace::Meta, b"before", b"1").unwrap();
    store.set_writes_refused(true).unwrap();
    assert!(store.writes_refused());
    let err = store.put(KeySpace::Meta, b"during", b"2").unwrap_err();
    assert!(
        matches!(err, betreefs_engine::EngineError::ReadOnly),
        "{err}"
    );
    assert_eq!(
        store.get(KeySpace::Meta, b"before").unwrap().as_deref(),
        Some(&b"1"[..])
    );
    store.checkpoint().unwrap();
    // Power cut while refusing writes: the checkpoint holds everything.
    let image = dev.crash_image(betreefs_store::CrashMode::DropUnsynced);
    let reopened = Store::open_on(
        Arc::new(betreefs_store::MemDevice::from_image(image)),
        small_options(),
    )
    .unwrap();
    assert_eq!(
        reopened.get(KeySpace::Meta, b"before").unwrap().as_deref(),
        Some(&b"1"[..])
    );
    assert_eq!(reopened.get(KeySpace::Meta, b"during").unwrap(), None);
    drop(reopened);
    store.set_writes_refused(false).unwrap();
    store.put(KeySpace::Meta, b"after", b"3").unwrap();
    store.close().unwrap();
}
