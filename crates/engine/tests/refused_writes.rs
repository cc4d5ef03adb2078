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

/// A device that fails a write: the store refuses writes from then on,
/// the fault observer hears of it once, and reads go on from what the
/// store holds.
#[test]
fn a_failed_write_refuses_writes_tells_the_observer_and_keeps_reads() {
    use std::sync::Mutex;
    let (dev, store) = mem_store(32 << 20, small_options());
    store.put(KeySpace::Meta, b"synced", b"1").unwrap();
    store.sync().unwrap();
    let heard: Arc<Mutex<Vec<(String, bool)>>> = Arc::default();
    let log = heard.clone();
    store.set_fault_observer(Arc::new(move |e, refusing| {
        assert!(e.is_device_fault(), "{e}");
        log.lock().unwrap().push((e.to_string(), refusing));
    }));
    dev.fail_after_writes(0);
    store.put(KeySpace::Meta, b"unsynced", b"2").unwrap();
    assert!(store.sync().is_err(), "the log write fails");
    let err = store.put(KeySpace::Meta, b"after", b"3").unwrap_err();
    assert!(
        matches!(err, betreefs_engine::EngineError::Failed(_)),
        "{err}"
    );
    assert!(store.sync().is_err(), "a later fsync still reports it");
    {
        let heard = heard.lock().unwrap();
        assert_eq!(heard.len(), 1, "{heard:?}");
        assert!(heard[0].1, "the store refuses writes");
    }
    assert_eq!(
        store.get(KeySpace::Meta, b"synced").unwrap().as_deref(),
        Some(&b"1"[..])
    );
    let keys: Vec<_> = store
        .range(KeySpace::Meta, b"", None)
        .map(|r| r.unwrap().0)
        .collect();
    assert!(keys.contains(&b"synced".to_vec()), "{keys:?}");
}
