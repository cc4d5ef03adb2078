//! Several threads writing, reading, scanning and syncing at once, with the
//! background flusher and checkpoints running.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use betreefs_engine::{KeySpace, Store};
use betreefs_store::MemDevice;
use common::small_options;
use rand::{rngs::SmallRng, Rng, SeedableRng};

#[test]
fn threads_share_one_store() {
    let rounds: u64 = common::env_count("BETREEFS_STRESS_ROUNDS", 1);
    for round in 0..rounds {
        share_one_store(round);
    }
}

fn share_one_store(round: u64) {
    let mut options = small_options();
    options.log_flush_interval = Some(Duration::from_millis(5));
    options.checkpoint_interval = Some(Duration::from_millis(50));
    // A node per turn: writers run between the checkpoint's encoding turns.
    options.checkpoint_turn_bytes = 1;
    // And background flushing, a part of a buffer per turn.
    options.background_flush = true;
    options.flush_turn_bytes = 1;
    let (dev, store) = common::mem_store(64 << 20, options.clone());
    let store = Arc::new(store);
    let workers: Vec<_> = (0..4u8)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t as u64 + 100 * round);
                let mut mine = BTreeMap::new();
                for i in 0..3000u32 {
                    let key = [t, rng.gen_range(0..200u8), rng.gen()].to_vec();
                    match rng.gen_range(0..10) {
                        0..=5 => {
                            let v = vec![t; rng.gen_range(1..200)];
                            store.put(KeySpace::Data, &key, &v).unwrap();
                            mine.insert(key, v);
                        }
                        6 => {
                            store.delete(KeySpace::Data, &key).unwrap();
                            mine.remove(&key);
                        }
                        7 => assert_eq!(
                            store.get(KeySpace::Data, &key).unwrap(),
                            mine.get(&key).cloned()
                        ),
                        8 => {
                            let got: Vec<_> = store
                                .range(KeySpace::Data, &[t], Some(&[t + 1]))
                                .collect::<Result<_, _>>()
                                .unwrap();
                            let want: Vec<_> = mine.clone().into_iter().collect();
                            if got != want {
                                let have: BTreeMap<_, _> = got.iter().cloned().collect();
                                let extra: Vec<_> = have.keys().filter(|k| !mine.contains_key(*k)).take(4).collect();
                                let missing: Vec<_> = mine.keys().filter(|k| !have.contains_key(*k)).take(4).collect();
                                let wrong: Vec<_> = mine.iter().filter(|(k, v)| have.get(*k).is_some_and(|h| h != *v)).map(|(k, _)| k).take(4).collect();
                                panic!("thread {t} op {i}: scan got {} entries, expected {}; extra {extra:?} missing {missing:?} wrong {wrong:?}; verify: {:?}", got.len(), want.len(), store.verify());
                            }
                        }
                        _ => {
                            if i % 7 == 0 {
                                store.sync().unwrap();
                            }
                        }
                    }
                }
                mine
            })
        })
        .collect();
    let mut expected = BTreeMap::new();
    for w in workers {
        expected.extend(w.join().unwrap());
    }
    assert!(store.stats().checkpoints > 1);
    store.sync().unwrap();
    let image = dev.current_image();
    drop(store);
    let reopened = Store::open_on(Arc::new(MemDevice::from_image(image)), small_options()).unwrap();
    let all: BTreeMap<_, _> = common::scan_all(&reopened, KeySpace::Data)
        .into_iter()
        .collect();
    assert_eq!(all, expected);
}
