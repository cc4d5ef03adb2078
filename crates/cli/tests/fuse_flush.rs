//! `-o flush=inline|background` on a real mount: who moves messages down
//! the engine's trees. By default every writer flushes for itself and no
//! flusher runs; with `background` a thread of the engine does, in turns
//! (its counters move, writers have a backlog bound). Either way the
//! files read back whole after a remount.

mod common;

use std::io::Write;
use std::process::Command;

use common::{engine_counter, formatted, Mount};

/// 48 MiB in 1 MiB writes and 2,000 small files: several nodes' worth of
/// messages through both trees' roots.
fn write_workload(mount: &Mount) -> Vec<u8> {
    let block: Vec<u8> = (0..1u32 << 20).map(|i| (i % 253) as u8).collect();
    let mut file = std::fs::File::create(mount.path("big")).unwrap();
    for _ in 0..48 {
        file.write_all(&block).unwrap();
    }
    file.sync_all().unwrap();
    std::fs::create_dir(mount.path("small")).unwrap();
    for i in 0..2_000u32 {
        std::fs::write(mount.path(&format!("small/f{i:05}")), i.to_le_bytes()).unwrap();
    }
    block
}

fn check_workload(mount: &Mount, block: &[u8]) {
    let big = std::fs::read(mount.path("big")).unwrap();
    assert_eq!(big.len(), 48 * block.len());
    assert!(big.chunks(block.len()).all(|c| c == block));
    for i in (0..2_000u32).step_by(97) {
        assert_eq!(
            std::fs::read(mount.path(&format!("small/f{i:05}"))).unwrap(),
            i.to_le_bytes()
        );
    }
}

#[test]
fn background_and_inline_flushing_both_keep_every_byte() {
    if !common::fuse_available() {
        return;
    }
    for (option, background) in [(Some("flush=background"), true), (None, false)] {
        let (_scratch, image, dir) = formatted("flush", "1G");
        let options: Vec<&str> = option.into_iter().collect();
        let mount = Mount::start(&image, &dir, &options);
        let block = write_workload(&mount);
        let bound = engine_counter(&mount.dir, "flush_backlog_bound_bytes");
        let turns = engine_counter(&mount.dir, "flush_turns");
        let flushes = engine_counter(&mount.dir, "flushes");
        assert!(flushes > 0, "{option:?}: nothing flushed");
        if background {
            assert!(
                bound > 0 && turns > 0,
                "background: bound {bound}, {turns} turns"
            );
        } else {
            assert_eq!((bound, turns), (0, 0), "the default, inline");
        }
        check_workload(&mount, &block);
        mount.unmount();
        let mount = Mount::start(&image, &dir, &options);
        check_workload(&mount, &block);
        mount.unmount();
    }
}

#[test]
fn an_unknown_flush_mode_is_refused_by_name() {
    if !common::fuse_available() {
        return;
    }
    let (_scratch, image, dir) = formatted("flush-bad", "1G");
    let out = Command::new(common::binary())
        .arg("mount")
        .arg(&image)
        .arg(&dir)
        .args(["-o", "flush=sideways"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("flush= needs background or inline"),
        "{stderr}"
    );
    assert!(!common::is_mounted(&dir));
}
