//! The harness end to end, as CI runs it: the quick scale against tmpfs
//! and ext4 (no timing is asserted), and an interrupted run that must
//! leave no mount, loop device or file behind. Needs root (loop devices,
//! mounts, drop_caches); skipped with a message otherwise.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BENCH: &str = env!("CARGO_BIN_EXE_betreefs-bench");

fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root");
        return false;
    }
    for tool in ["mkfs.ext4", "losetup", "rsync", "git", "tar"] {
        if Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool}"))
            .output()
            .map_or(true, |o| !o.status.success())
        {
            panic!("{tool} is missing: CI installs it (.ci/run)");
        }
    }
    true
}

/// A scratch directory of this test's own.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(format!(
        "/var/tmp/betreefs-bench-test-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Nothing of a run under `workdir` is left: no mount, no loop device, no
/// file.
fn assert_nothing_left(workdir: &Path) {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let prefix = workdir.to_string_lossy().to_string();
    assert!(
        !mounts.contains(&prefix),
        "a mount is left under {prefix}:\n{mounts}"
    );
    let loops = Command::new("losetup").arg("-l").output().unwrap();
    let loops = String::from_utf8_lossy(&loops.stdout);
    assert!(!loops.contains(&prefix), "a loop device is left:\n{loops}");
    let left: Vec<_> = std::fs::read_dir(workdir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(
        left.is_empty(),
        "files left in {}: {left:?}",
        workdir.display()
    );
}

#[test]
fn quick_scale_against_tmpfs_and_ext4() {
    if !can_run() {
        return;
    }
    let base = scratch("quick");
    let (work, out) = (base.join("work"), base.join("out"));
    std::fs::create_dir_all(&work).unwrap();
    let status = Command::new(BENCH)
        .args(["--scale", "quick", "--fs", "tmpfs,ext4", "--out"])
        .arg(&out)
        .arg("--workdir")
        .arg(&work)
        .status()
        .unwrap();
    assert!(status.success(), "betreefs-bench failed: {status}");
    assert_nothing_left(&work);

    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["scale"], "quick");
    assert_eq!(json["file_systems"], serde_json::json!(["tmpfs", "ext4"]));
    assert!(json["results"]["errors"].as_array().unwrap().is_empty());
    let rows = json["results"]["rows"].as_array().unwrap();
    for suite in ["micro", "source", "app", "ioamp"] {
        let in_suite: Vec<&Value> = rows.iter().filter(|r| r["suite"] == suite).collect();
        assert!(
            in_suite.len() >= 4,
            "suite {suite} has {} rows",
            in_suite.len()
        );
        for row in in_suite {
            let values = row["values"].as_object().unwrap();
            // Figures read from the device under the file system: none for
            // tmpfs.
            let of_device = suite == "ioamp"
                || row["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("device stalls taken out"));
            let expected: &[&str] = if of_device {
                &["ext4"]
            } else {
                &["tmpfs", "ext4"]
            };
            for fs in expected {
                let v = values.get(*fs).and_then(|v| v[0].as_f64());
                assert!(
                    v.is_some_and(|v| v.is_finite() && v >= 0.0),
                    "{suite} / {} / {fs}: {v:?}",
                    row["name"]
                );
            }
            // tmpfs has no device: no IO-amplification figures.
            if of_device {
                assert!(values.get("tmpfs").is_none());
            }
        }
    }
    // The device's stalls during the write + fsync beside an untar: a
    // window's length for ext4 (zero when it never stalled), none for tmpfs.
    let stalls = rows
        .iter()
        .find(|r| r["suite"] == "device stalls")
        .expect("device stall row");
    assert!(stalls["values"]["ext4"][0]
        .as_f64()
        .is_some_and(|v| v >= 0.0));
    assert!(stalls["values"].get("tmpfs").is_none());
    // Device counters saw the overwrites: at least the user's bytes.
    let total = rows
        .iter()
        .find(|r| r["name"] == "4 KiB overwrite + fsync: written in all")
        .expect("overwrite row");
    assert!(total["values"]["ext4"][0].as_f64().unwrap() >= 1.0);
    for series in ["tokubench", "rename", "unlink", "write_amp"] {
        assert!(
            json["results"]["series"][series]["points"]["ext4"]
                .as_array()
                .is_some_and(|p| !p.is_empty()),
            "{series}"
        );
    }

    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    for heading in [
        "## micro",
        "## source",
        "## app",
        "## ioamp",
        "## Device stalls",
        "| micro | unit | tmpfs | ext4 |",
        "| device stalls | unit | ext4 |",
    ] {
        assert!(md.contains(heading), "results.md lacks {heading:?}");
    }
    for png in ["tokubench.png", "rename.png", "unlink.png", "write-amp.png"] {
        let bytes = std::fs::read(out.join(png)).unwrap_or_else(|e| panic!("{png}: {e}"));
        assert!(
            bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
            "{png} is not a PNG"
        );
        assert!(md.contains(&format!("![{png}]({png})")));
    }
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn an_interrupted_run_leaves_nothing_behind() {
    if !can_run() {
        return;
    }
    let base = scratch("interrupt");
    let (work, out) = (base.join("work"), base.join("out"));
    std::fs::create_dir_all(&work).unwrap();
    // Many rounds, so the run is certainly still going when interrupted.
    let mut child = Command::new(BENCH)
        .args([
            "--scale", "quick", "--fs", "ext4", "--suite", "micro", "--rounds", "100", "--out",
        ])
        .arg(&out)
        .arg("--workdir")
        .arg(&work)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    // Wait for a figure from inside a mounted file system.
    let start = Instant::now();
    loop {
        let line = lines.next().expect("the run ended early").unwrap();
        if line.contains("sequential write:") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no figure within 2 minutes"
        );
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        mounts.contains(&*work.to_string_lossy()),
        "nothing mounted mid-run"
    );
    // SAFETY: signalling the child this test started.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    // Keep draining stderr so the child never blocks on a full pipe.
    let drain = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let status = child.wait().unwrap();
    let said = drain.join().unwrap().join("\n");
    assert_eq!(
        status.code(),
        Some(130),
        "exit status {status}; stderr:\n{said}"
    );
    assert!(said.contains("interrupted"), "{said}");
    assert_nothing_left(&work);
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_workdir_without_room_is_refused_up_front() {
    if !can_run() {
        return;
    }
    let base = scratch("room");
    let small = base.join("small");
    std::fs::create_dir_all(&small).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"])
        .arg(&small)
        .status()
        .unwrap();
    assert!(mounted.success());
    let out = Command::new(BENCH)
        .args([
            "--scale", "quick", "--fs", "ext4", "--suite", "micro", "--out",
        ])
        .arg(base.join("out"))
        .arg("--workdir")
        .arg(&small)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let left: Vec<_> = std::fs::read_dir(&small).unwrap().collect();
    assert!(Command::new("umount")
        .arg(&small)
        .status()
        .unwrap()
        .success());
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("MiB free") && stderr.contains("--workdir"),
        "{stderr}"
    );
    assert!(
        left.is_empty(),
        "the refused run wrote into the work directory"
    );
    std::fs::remove_dir_all(&base).unwrap();
}
