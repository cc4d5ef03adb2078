//! Flipped bytes in every on-disk structure give a typed error naming the
//! problem — never a panic, never silently wrong data.

mod common;

use std::sync::Arc;

use betreefs_engine::btt::{BlockTable, Slot};
use betreefs_engine::format::{decode_header, decode_meta, meta_end, HEADER_BYTES};
use betreefs_engine::node::NodeBody;
use betreefs_engine::{EngineError, KeySpace, Store};
use betreefs_store::{crc32c_of, MemDevice, StoreError, Superblock, BLOCK_SIZE, FORMAT_VERSION};
use common::{scan_all, small_options};

/// A closed store with trees a few levels deep in both key spaces.
fn populated_image() -> Vec<u8> {
    let (dev, store) = common::mem_store(32 << 20, small_options());
    for i in 0..3000u32 {
        let ks = if i % 4 == 0 {
            KeySpace::Meta
        } else {
            KeySpace::Data
        };
        store
            .put(
                ks,
                format!("dir\x01sub\x00file{i:05}").as_bytes(),
                &[i as u8; 150],
            )
            .unwrap();
    }
    store.close().unwrap();
    dev.current_image()
}

/// Opens the image and reads everything; returns the first error.
fn read_everything(image: Vec<u8>) -> Result<(), EngineError> {
    let store = Store::open_on(Arc::new(MemDevice::from_image(image)), small_options())?;
    for ks in KeySpace::ALL {
        for item in store.range(ks, b"", None) {
            item?;
        }
    }
    store.verify()?;
    Ok(())
}

fn expect_error(image: Vec<u8>, what: &str, accept: impl Fn(&EngineError) -> bool) {
    let outcome = std::panic::catch_unwind(|| read_everything(image));
    match outcome {
        Err(_) => panic!("{what}: panicked instead of returning an error"),
        Ok(Ok(())) => panic!("{what}: corruption went unnoticed"),
        Ok(Err(e)) => assert!(accept(&e), "{what}: unexpected error {e}"),
    }
}

#[test]
fn flipped_bytes_in_every_node_are_reported() {
    let image = populated_image();
    let dev = MemDevice::from_image(image.clone());
    let sb = Superblock::read_newest(&dev).unwrap();
    let table_at = (sb.layout.extent_offset(sb.btt)) as usize;
    let table = BlockTable::decode(&image[table_at..table_at + sb.btt.len as usize]).unwrap();
    let nodes: Vec<_> = table.extents().collect();
    // Where each node sits, from walking the trees: its header is checked
    // against the bounds its parent gives it.
    let forge = common::forge::Forge::new(image.clone());
    let bounds_of: std::collections::HashMap<u64, betreefs_engine::node::Bounds> = KeySpace::ALL
        .iter()
        .flat_map(|&ks| forge.nodes(ks))
        .map(|found| (found.num, found.bounds))
        .collect();
    assert!(
        nodes.len() > 10,
        "the tree should have many nodes, has {}",
        nodes.len()
    );
    let mut checked = 0;
    for (num, extent) in nodes {
        let Slot::OnDisk { crc, .. } = table.get(num) else {
            unreachable!()
        };
        let at = sb.layout.extent_offset(extent) as usize;
        let node_bytes = &image[at..at + extent.len as usize];
        let bounds = &bounds_of[&num];
        let mut targets = vec![0, 8, 30, 61];
        if let Ok(h) = decode_header(node_bytes, crc, num, bounds) {
            targets.push(HEADER_BYTES + h.meta_len as usize / 2);
            if let Ok(node) = decode_meta(&h, &node_bytes[HEADER_BYTES..meta_end(&h)], bounds) {
                if let NodeBody::Leaf(leaf) = node.body {
                    for b in leaf.basements.iter().take(2) {
                        let loc = b.loc.unwrap();
                        targets.push((loc.offset + loc.len / 2) as usize);
                    }
                }
            }
        }
        for offset in targets {
            let mut bad = image.clone();
            bad[at + offset] ^= 0x20;
            expect_error(bad, &format!("node {num} byte {offset}"), |e| {
                matches!(e, EngineError::CorruptNode { .. })
            });
            checked += 1;
        }
    }
    assert!(checked > 40);
}

#[test]
fn corrupt_block_table_is_refused_at_open() {
    let image = populated_image();
    let sb = Superblock::read_newest(&MemDevice::from_image(image.clone())).unwrap();
    let at = sb.layout.extent_offset(sb.btt) as usize;
    for offset in [0, 5, 20, sb.btt.len as usize - 1] {
        let mut bad = image.clone();
        bad[at + offset] ^= 1;
        expect_error(bad, "block table", |e| {
            matches!(e, EngineError::CorruptBlockTable(_))
        });
    }
}

#[test]
fn corrupt_superblocks_and_foreign_images_are_refused() {
    let image = populated_image();
    let mut both = image.clone();
    both[20] ^= 1;
    both[BLOCK_SIZE + 20] ^= 1;
    expect_error(both, "both superblocks", |e| {
        matches!(e, EngineError::Store(StoreError::CorruptSuperblock(_)))
    });

    // One damaged copy falls back to the other, which still opens.
    let mut one = image.clone();
    let newest = Superblock::read_newest(&MemDevice::from_image(image.clone())).unwrap();
    let slot = (newest.generation % 2) as usize;
    one[slot * BLOCK_SIZE + 70] ^= 1;
    let fallback = Store::open_on(Arc::new(MemDevice::from_image(one)), small_options());
    assert!(fallback.is_ok() || matches!(fallback, Err(EngineError::CorruptNode { .. })));

    expect_error(vec![0; 16 << 20], "zeroed image", |e| {
        matches!(e, EngineError::Store(StoreError::NotBetreefs(_)))
    });
    let noise: Vec<u8> = (0..16u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    expect_error(noise, "random bytes", |e| {
        matches!(e, EngineError::Store(StoreError::NotBetreefs(_)))
    });

    let mut newer = image.clone();
    for slot in 0..2 {
        let block = &mut newer[slot * BLOCK_SIZE..(slot + 1) * BLOCK_SIZE];
        block[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        let crc = crc32c_of(&[&block[..BLOCK_SIZE - 4]]);
        block[BLOCK_SIZE - 4..].copy_from_slice(&crc.to_le_bytes());
    }
    expect_error(newer, "newer format", |e| {
        matches!(e, EngineError::Store(StoreError::UnsupportedVersion { .. }))
    });
}

#[test]
fn a_damaged_log_record_in_the_middle_is_a_hole() {
    let (dev, store) = common::mem_store(32 << 20, small_options());
    // Each record flushed on its own, as an fsync after every write does.
    for i in 0..20u32 {
        store
            .put(KeySpace::Meta, &i.to_be_bytes(), &[3; 40])
            .unwrap();
        store.sync().unwrap();
    }
    let sb = Superblock::read_newest(&dev).unwrap();
    let image = dev.current_image();
    drop(store);
    // Record 1 starts at the log head; damage its payload.
    let at = (sb.layout.log_offset + sb.log_head % sb.layout.log_bytes) as usize + 25;
    let mut bad = image.clone();
    bad[at] ^= 1;
    expect_error(bad.clone(), "log record", |e| {
        matches!(e, EngineError::Store(StoreError::LogHole(_)))
    });
    // Read-only, it opens with what precedes the hole and says so.
    let ro = Store::open_on(
        Arc::new(MemDevice::from_image(bad)),
        betreefs_engine::Options {
            read_only: true,
            ..small_options()
        },
    )
    .unwrap();
    assert!(ro.recovery().hole.is_some());
    assert_eq!(scan_all(&ro, KeySpace::Meta).len(), 0);
    // The undamaged image recovers all 20 records.
    let ok = Store::open_on(Arc::new(MemDevice::from_image(image)), small_options()).unwrap();
    assert_eq!(scan_all(&ok, KeySpace::Meta).len(), 20);
    assert_eq!(ok.recovery().replayed_records, 20);
}
