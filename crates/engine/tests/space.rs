//! A full device: writes get a no-space error, the store stays consistent,
//! deletes still work, and after them writes succeed again.

mod common;

use std::sync::Arc;

use betreefs_engine::{KeySpace, Options, Store};
use betreefs_store::MemDevice;
use common::{scan_all, small_options};
use rand::{rngs::SmallRng, Rng, SeedableRng};

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

/// Fill with values under random keys until refused, delete half of them
/// at random, fill again, over and over: every refill must find room
/// again. Counted in node-sized runs, a fragmented device held no run for
/// the leaves the deletes rewrote (their basements, each beginning on a
/// block, made images of three times a node) and the device stayed full
/// for good.
#[test]
fn space_freed_by_random_deletes_is_found_again_cycle_after_cycle() {
    let seeds = common::env_count("BETREEFS_SPACE_SEEDS", 4);
    for options in flushing_modes() {
        for seed in 0..seeds {
            refill_after_random_deletes(options.clone(), seed);
        }
    }
}

/// What the random-key tests below hold: key to value.
type Live = std::collections::BTreeMap<Vec<u8>, Vec<u8>>;

/// Puts values of 1-3000 bytes under random keys until a put is refused
/// (which must be for space); returns the bytes written.
fn fill_until_refused(store: &Store, rng: &mut SmallRng, live: &mut Live, context: &str) -> u64 {
    let mut bytes = 0;
    let err = loop {
        let key: u64 = rng.gen();
        let value = vec![key as u8; rng.gen_range(1..3000)];
        match store.put(KeySpace::Data, &key.to_be_bytes(), &value) {
            Ok(_) => {
                bytes += value.len() as u64;
                live.insert(key.to_be_bytes().to_vec(), value);
            }
            Err(e) => break e,
        }
    };
    assert!(err.is_no_space(), "{context}: {err}");
    bytes
}

/// Deletes each key of `live` with even odds.
fn delete_random_half(store: &Store, rng: &mut SmallRng, live: &mut Live, context: &str) {
    live.retain(|key, _| {
        let keep = rng.gen_bool(0.5);
        if !keep {
            store
                .delete(KeySpace::Data, key)
                .unwrap_or_else(|e| panic!("{context}: delete: {e}"));
        }
        keep
    });
}

fn refill_after_random_deletes(options: Options, seed: u64) {
    const DEVICE: u64 = 12 << 20;
    let (_dev, store) = common::mem_store(DEVICE, options);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut live = Live::new();
    for cycle in 0..4 {
        let context = format!("seed {seed} cycle {cycle}");
        let bytes = fill_until_refused(&store, &mut rng, &mut live, &context);
        // Half the data was deleted before every refill: a refill that
        // finds less than a tenth of the device has lost what was freed.
        assert!(
            bytes > DEVICE / 10,
            "{context}: {bytes} bytes written after deleting half"
        );
        store.verify().unwrap();
        delete_random_half(&store, &mut rng, &mut live, &context);
    }
    let expected: Vec<&Vec<u8>> = live.keys().collect();
    let found = scan_all(&store, KeySpace::Data);
    let found: Vec<&Vec<u8>> = found.iter().map(|(k, _)| k).collect();
    assert_eq!(found, expected, "seed {seed}: the keys left");
}

/// A crash on a full device: filled until refused, half deleted, synced,
/// then the power cut. The store opens again (its log's replay makes
/// dirty nodes that the first checkpoint must place on a device with no
/// room but the reserve), holds every synced key, and takes writes again
/// once more is deleted.
#[test]
fn a_full_device_opens_after_a_crash_and_takes_writes_after_deletes() {
    for options in flushing_modes() {
        for seed in 0..2 {
            reopen_full_after_crash(options.clone(), seed);
        }
    }
}

fn reopen_full_after_crash(options: Options, seed: u64) {
    const DEVICE: u64 = 12 << 20;
    let (dev, store) = common::mem_store(DEVICE, options.clone());
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut live = Live::new();
    let context = format!("seed {seed}");
    fill_until_refused(&store, &mut rng, &mut live, &context);
    delete_random_half(&store, &mut rng, &mut live, &context);
    store.sync().unwrap();
    let image = dev.crash_image(betreefs_store::CrashMode::DropUnsynced);
    drop(store);
    let store = Store::open_on(Arc::new(MemDevice::from_image(image)), options)
        .unwrap_or_else(|e| panic!("seed {seed}: opening the full device after a crash: {e}"));
    store.verify().unwrap();
    let found: Live = scan_all(&store, KeySpace::Data).into_iter().collect();
    assert!(
        found == live,
        "seed {seed}: the synced keys after the crash"
    );
    let keys: Vec<Vec<u8>> = live.keys().cloned().collect();
    for key in &keys[..keys.len() / 2] {
        store.delete(KeySpace::Data, key).unwrap();
    }
    let mut written = 0u64;
    while written < DEVICE / 10 {
        store
            .put(KeySpace::Meta, &written.to_be_bytes(), &[1; 1000])
            .unwrap_or_else(|e| {
                panic!("seed {seed}: a write after deletes, {written} bytes in: {e}")
            });
        written += 1000;
    }
    store.close().unwrap();
}

/// A promise of space is kept on a full device: space promised first
/// (as fallocate promises it), other writes fill the device until refused
/// and a few small records are rewritten after (a file's attributes as it
/// is closed), then the promise is drawn on in full, write by write.
/// Every drawing write must be taken: fill writes stop with twice the
/// reserve a drawing write needs still free in image-sized runs.
///
/// The nodes are sized as `betreefs mkfs` sizes them for such a device (a
/// 256th of it, 256 KiB at least, basements of an eighth); the mount
/// writes dirty nodes back on a thread of its own. Under the fuse crate,
/// a 128 MiB mount refused the write into its preallocated range about
/// one run in eight under load: fill writes had stopped with four nodes
/// more in runs than drawing writes needed, and what the fill's last
/// writes dirtied took more.
#[test]
fn a_promise_is_kept_when_other_writes_fill_the_device() {
    for background_write_back in [false, true] {
        for (device, promise) in [(64u64 << 20, 4u64 << 20), (128 << 20, 8 << 20)] {
            for value_len in [4096usize, 128 << 10] {
                let node = (device / 256).max(256 << 10) as usize;
                let options = Options {
                    node_size: node,
                    basement_size: node / 8,
                    cache_bytes: 16 << 20,
                    background_write_back,
                    ..small_options()
                };
                draw_on_a_promise_after_filling(options, device, promise, value_len);
            }
        }
    }
}

fn draw_on_a_promise_after_filling(options: Options, device: u64, promise: u64, value_len: usize) {
    use betreefs_engine::{Reservation, WriteBatch};
    let context = format!(
        "device {device}, promise {promise}, values of {value_len} bytes, \
         write-back thread {}",
        options.background_write_back
    );
    let (_dev, store) = common::mem_store(device, options);
    let mut promising = WriteBatch::new();
    promising.put(KeySpace::Meta, b"promise", &promise.to_be_bytes());
    store
        .write_reserving(
            &promising,
            Reservation {
                take: promise,
                release: 0,
            },
        )
        .unwrap_or_else(|e| panic!("{context}: promising: {e}"));
    let value = vec![0xa5; value_len];
    let mut filled = 0u32;
    let err = loop {
        let mut batch = WriteBatch::new();
        let key = [b"fill".as_slice(), &filled.to_be_bytes()].concat();
        batch
            .put(KeySpace::Data, &key, &value)
            .put(KeySpace::Meta, &key, &filled.to_be_bytes());
        match store.write(&batch) {
            Ok(_) => filled += 1,
            Err(e) => break e,
        }
    };
    assert!(err.is_no_space(), "{context}: filling ended with {err}");
    assert!(
        u64::from(filled) * value_len as u64 > device / 2,
        "{context}: only {filled} values fit"
    );
    // Unlinks rewriting a directory's record are let into the reserve.
    for i in 0..32u32 {
        let mut unlink = WriteBatch::new();
        let key = [b"fill".as_slice(), &i.to_be_bytes()].concat();
        unlink
            .delete(KeySpace::Data, &key)
            .put(KeySpace::Meta, b"directory", &i.to_be_bytes());
        store
            .write(&unlink)
            .unwrap_or_else(|e| panic!("{context}: unlink {i}: {e}"));
    }
    let chunk = vec![0x5a; 64 << 10];
    let mut drawn = 0u64;
    while drawn < promise {
        let take = (promise - drawn).min(chunk.len() as u64);
        let mut batch = WriteBatch::new();
        batch
            .put(
                KeySpace::Data,
                &[b"promised".as_slice(), &drawn.to_be_bytes()].concat(),
                &chunk[..take as usize],
            )
            .put(KeySpace::Meta, b"promised size", &drawn.to_be_bytes());
        store
            .write_reserving(
                &batch,
                Reservation {
                    take: 0,
                    release: take,
                },
            )
            .unwrap_or_else(|e| panic!("{context}: drawing on the promise, {drawn} bytes in: {e}"));
        drawn += take;
    }
    store
        .sync()
        .unwrap_or_else(|e| panic!("{context}: sync: {e}"));
    store.verify().unwrap();
    store.close().unwrap();
}
