//! Crash simulation: the device loses power at a chosen write, unsynced
//! writes are dropped (or torn, or partly kept as a volatile cache might),
//! and recovery must give a state that (1) holds everything synced before
//! the crash and (2) equals the model after some prefix of the operations.

mod common;

use std::sync::Arc;

use betreefs_engine::{KeySpace, Store};
use betreefs_store::{CrashMode, MemDevice};
use common::{dump, random_batch, small_options, Model};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Returns whether the device failed before the workload ended.
fn crash_once(seed: u64) -> bool {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (dev, store) = common::mem_store(32 << 20, small_options());
    let crash_after = rng.gen_range(0..60);
    dev.fail_after_writes(crash_after);
    let mut models = vec![Model::default()];
    let mut synced = 0usize;
    for _ in 0..rng.gen_range(20..500) {
        let batch = random_batch(&mut rng);
        let mut next = models.last().cloned().unwrap_or_default();
        next.apply(&batch);
        models.push(next);
        if store.write(&batch).is_err() {
            break;
        }
        match rng.gen_range(0..30) {
            0..=5 => {
                if store.sync().is_err() {
                    break;
                }
                synced = models.len() - 1;
            }
            6 => {
                if store.checkpoint().is_err() {
                    break;
                }
                synced = models.len() - 1;
            }
            _ => {}
        }
    }
    let crashed_mid_workload = dev.has_crashed();
    dev.power_off();
    let mode = match rng.gen_range(0..3) {
        0 => CrashMode::DropUnsynced,
        1 => CrashMode::TearLast {
            sectors_kept: rng.gen_range(0..8),
        },
        _ => CrashMode::KeepSome { mask: rng.gen() },
    };
    let image = dev.crash_image(mode);
    drop(store);

    let context = format!("seed {seed}, crash after {crash_after} writes, {mode:?}");
    let restarted = MemDevice::from_image(image);
    let recovered = Store::open_on(Arc::new(restarted.clone()), small_options())
        .unwrap_or_else(|e| panic!("{context}: recovery failed: {e}"));
    recovered
        .verify()
        .unwrap_or_else(|e| panic!("{context}: tree invalid after recovery: {e}"));
    let state = dump(&recovered);
    let prefix = (synced..models.len()).find(|&p| models[p] == state);
    assert!(
        prefix.is_some(),
        "{context}: recovered state matches no prefix at or after the last sync ({synced} of {} operations)",
        models.len() - 1
    );

    // Life goes on after recovery, and a second crash loses nothing synced.
    let mut model = state;
    for _ in 0..30 {
        let batch = random_batch(&mut rng);
        recovered.write(&batch).expect("write after recovery");
        model.apply(&batch);
    }
    recovered.sync().expect("sync after recovery");
    restarted.power_off();
    let again = MemDevice::from_image(restarted.crash_image(CrashMode::DropUnsynced));
    drop(recovered);
    let second = Store::open_on(Arc::new(again), small_options())
        .unwrap_or_else(|e| panic!("{context}: second recovery: {e}"));
    assert!(
        dump(&second) == model,
        "{context}: second crash lost synced writes"
    );
    crashed_mid_workload
}

#[test]
fn recovery_after_crash_at_random_writes() {
    let seeds: u64 = common::env_count("BETREEFS_CRASH_SEEDS", 300);
    let crashed = (0..seeds).filter(|&seed| crash_once(seed)).count();
    // Most runs must really lose power in the middle, or the test tests little.
    assert!(
        crashed as u64 * 2 > seeds,
        "only {crashed} of {seeds} runs crashed mid-workload"
    );
    eprintln!("{crashed} of {seeds} runs crashed mid-workload");
}

#[test]
fn crash_during_checkpoint_keeps_previous_checkpoint() {
    for crash_after in 0..40 {
        let (dev, store) = common::mem_store(32 << 20, small_options());
        for i in 0..2000u32 {
            store
                .put(KeySpace::Data, &i.to_be_bytes(), &[7; 64])
                .unwrap();
        }
        store.sync().unwrap();
        dev.fail_after_writes(crash_after);
        let _ = store.checkpoint();
        dev.power_off();
        let image = dev.crash_image(CrashMode::TearLast {
            sectors_kept: (crash_after % 8) as usize,
        });
        drop(store);
        let recovered =
            Store::open_on(Arc::new(MemDevice::from_image(image)), small_options()).unwrap();
        recovered.verify().unwrap();
        assert_eq!(
            common::scan_all(&recovered, KeySpace::Data).len(),
            2000,
            "crash after {crash_after}"
        );
    }
}
