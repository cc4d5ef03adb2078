//! A full device: writes get a no-space error, the store stays consistent,
//! deletes still work, and after them writes succeed again.

mod common;

use std::sync::Arc;

use betreefs_engine::{KeySpace, Options, Store};
use common::{scan_all, small_options};

/// Both ways of flushing: by the writers, and by the engine's thread
/// (which stands aside when space runs low).
fn flushing_modes() -> [Options; 2] {
    [
        small_options(),
        Options {
            background_flush: true,
            ..small_options()
        },
    ]
}

#[test]
fn full_device_refuses_writes_then_recovers_after_deletes() {
    for options in flushing_modes() {
        refuse_writes_then_recover_after_deletes(options);
    }
}

fn refuse_writes_then_recover_after_deletes(options: Options) {
    let (dev, store) = common::mem_store(12 << 20, options);
    let value = vec![0x5a; 1000];
    let mut written = 0u32;
    let err = loop {
        match store.put(KeySpace::Data, &written.to_be_bytes(), &value) {
            Ok(_) => written += 1,
            Err(e) => break e,
        }
        assert!(written < 100_000, "a 12 MiB device cannot hold 100 MB");
    };
    assert!(err.is_no_space(), "expected no space, got {err}");
    assert!(
        written > 3000,
        "only {written} KiB-sized values fit in 12 MiB"
    );
    store.verify().unwrap();
    assert_eq!(scan_all(&store, KeySpace::Data).len(), written as usize);
    // Still refusing, still consistent.
    assert!(store
        .put(KeySpace::Meta, b"more", &value)
        .unwrap_err()
        .is_no_space());
    store.sync().unwrap();
    // A delete that also rewrites a small record (an unlink updating its
    // directory) is let into the reserve.
    let mut unlink = betreefs_engine::WriteBatch::new();
    unlink
        .delete(KeySpace::Data, &0u32.to_be_bytes())
        .put(KeySpace::Meta, b"parent", &[1; 100]);
    store
        .write(&unlink)
        .expect("a delete with a small record fits the reserve");

    // Deletes are accepted on a full device and give the space back.
    store
        .range_delete(
            KeySpace::Data,
            &0u32.to_be_bytes(),
            &(written / 2).to_be_bytes(),
        )
        .unwrap();
    for i in 0..1000u32 {
        store
            .put(KeySpace::Meta, &i.to_be_bytes(), &value)
            .expect("space freed by the delete");
    }
    store.close().unwrap();

    let reopened = Store::open_on(Arc::new(dev), small_options()).unwrap();
    reopened.verify().unwrap();
    assert_eq!(
        scan_all(&reopened, KeySpace::Data).len(),
        (written - written / 2) as usize
    );
    assert_eq!(scan_all(&reopened, KeySpace::Meta).len(), 1001);
}

/// On a full device, a long run of deletes (each rewriting a small record,
/// as an unlink rewrites its directory) fills the log; the checkpoint that
/// frees it must find room by reclaiming what the deletes freed, so no
/// delete is ever refused.
#[test]
fn deletes_on_a_full_device_survive_a_full_log() {
    for options in flushing_modes() {
        deletes_survive_a_full_log(options);
    }
}

fn deletes_survive_a_full_log(options: Options) {
    let (_dev, store) = common::mem_store(12 << 20, options);
    let value = vec![0x5a; 1000];
    let mut written = 0u32;
    while store
        .put(KeySpace::Data, &written.to_be_bytes(), &value)
        .is_ok()
    {
        written += 1;
        assert!(written < 100_000);
    }
    for round in 0..4 {
        for i in 0..written {
            let mut unlink = betreefs_engine::WriteBatch::new();
            unlink.delete(KeySpace::Data, &i.to_be_bytes()).put(
                KeySpace::Meta,
                b"directory",
                &[round as u8; 200],
            );
            store
                .write(&unlink)
                .unwrap_or_else(|e| panic!("delete {i} in round {round} refused: {e}"));
        }
    }
    store.verify().unwrap();
    assert!(scan_all(&store, KeySpace::Data).is_empty());
    store
        .put(KeySpace::Data, b"again", &value)
        .expect("space is back");
}
