//! `betreefs`: the command-line entry point.

mod clone_cmd;
mod daemon;
mod fs_cmds;
mod fsck;
mod image;
mod kv_bench;
mod unmount;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "betreefs",
    version,
    about = "A write-optimized file system on a B^e-tree"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Format an image file (created sparse) or a block device.
    Mkfs(fs_cmds::MkfsArgs),
    /// Mount an image (created with a default size when missing); returns
    /// once the mount answers. Unmount with `umount DIR` or
    /// `fusermount3 -u DIR`.
    Mount(daemon::MountArgs),
    /// Check an unmounted image without writing to it: checksums, tree
    /// and schema invariants; --repair fixes what can be fixed. Exit
    /// status as fsck(8): 0 clean, 1 corrected, 4 uncorrected, 8 error.
    Fsck(fsck::FsckArgs),
    /// Unmount and wait until the daemon has written its final checkpoint
    /// and exited (what `umount` does once `install-helper` ran).
    Umount(unmount::UmountArgs),
    /// Print a mounted file system's engine counters and amplification
    /// figures as JSON.
    Stats(fs_cmds::StatsArgs),
    /// Copy a directory tree on a mounted betreefs in one atomic step,
    /// sharing its data copy-on-write (root only): DST is made, and must
    /// not exist before.
    Clone(clone_cmd::CloneArgs),
    /// Install the mount(8), umount(8) and fsck(8) helpers, so that
    /// `mount -t fuse.betreefs IMAGE DIR`, fstab lines, a `umount` that
    /// waits for the final checkpoint and `fsck -t fuse.betreefs` work.
    InstallHelper(daemon::InstallHelperArgs),
    /// Mount a no-op FUSE file system (names and sizes kept in memory, data
    /// dropped) with betreefs's FUSE settings: the ceiling for benchmarks.
    Nullfuse(daemon::NullfuseArgs),
    /// Run a key-value benchmark (TRIAD WS1-WS3 and db_bench-style workloads)
    /// against the engine and print one JSON line of results.
    KvBench(kv_bench::Args),
}

/// How glibc should place large buffers (nodes are megabytes).
///
/// `Lean` sends buffers of 256 KiB and more straight to mmap and back to
/// the kernel when freed, and keeps at most 16 MiB of recycled IO buffers,
/// so the resident set stays close to the node cache (kv-bench's WS3 at
/// 1M keys and 2M operations with the 256 MiB cache: 455 MiB peak with the
/// 64 MiB pool, 384 MiB with 16 MiB, 378 MiB with none, at the same
/// speed). `Fast` keeps buffers up
/// to 8 MiB in the heap for reuse, and up to 128 MiB of free heap before
/// giving it back: every fresh page costs a fault and a kernel clear per
/// 4 KiB, which was 40% of the mount daemon's cycles in a sequential
/// write (148 -> 240 MB/s for 2 GiB in 1 MiB writes with the heap) and
/// still ~15% of a cold sequential read with a 16 MiB trim threshold
/// (~690 -> ~810 MB/s with 128 MiB). The daemon's resident set stays
/// near the cache plus that slack (~350-420 MB with the default 256 MiB
/// cache after reading 2 GiB).
#[derive(Clone, Copy)]
enum Allocator {
    Lean,
    Fast,
}

fn tune_allocator(mode: Allocator) {
    let (mmap_threshold, trim_threshold, pool) = match mode {
        Allocator::Lean => (256 << 10, 1 << 20, 16 << 20),
        Allocator::Fast => (8 << 20, 128 << 20, 64 << 20),
    };
    // SAFETY: mallopt only adjusts allocator parameters; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, mmap_threshold);
        libc::mallopt(libc::M_TRIM_THRESHOLD, trim_threshold);
    }
    betreefs_store::set_buffer_pool_limit(pool);
}

/// fsck's own command line (as `betreefs fsck` or `fsck.fuse.betreefs`),
/// so that usage errors exit 16 as fsck(8) expects.
#[derive(Parser)]
#[command(name = "fsck.fuse.betreefs")]
struct FsckCli {
    #[command(flatten)]
    args: fsck::FsckArgs,
}

fn run_fsck_helper(argv: &[String]) -> i32 {
    match FsckCli::try_parse_from(argv) {
        Ok(cli) => run_fsck(cli.args),
        Err(e) => {
            let _ = e.print();
            if e.use_stderr() {
                fsck::FSCK_USAGE
            } else {
                fsck::FSCK_CLEAN
            }
        }
    }
}

fn run_fsck(args: fsck::FsckArgs) -> i32 {
    fsck::run(args).unwrap_or_else(|e| {
        eprintln!("betreefs fsck: {e:#}");
        fsck::FSCK_OPERATIONAL
    })
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let serves_a_mount =
        argv.iter().any(|a| a == "mount") || argv.first().is_some_and(|a| a.contains("mount.fuse"));
    tune_allocator(if serves_a_mount {
        Allocator::Fast
    } else {
        Allocator::Lean
    });
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let invoked_as = argv
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let result = if invoked_as.starts_with("mount.") {
        daemon::run_helper(&argv[1..]).map(|()| 0)
    } else if invoked_as.starts_with("umount.") {
        unmount::run_helper(&argv[1..]).map(|()| 0)
    } else if invoked_as.starts_with("fsck.") {
        Ok(run_fsck_helper(&argv))
    } else if argv.get(1).is_some_and(|a| a == "fsck") {
        Ok(run_fsck_helper(&argv[1..]))
    } else {
        match Cli::parse().command {
            Command::Mkfs(args) => fs_cmds::run_mkfs(args).map(|()| 0),
            Command::Mount(args) => daemon::run_mount(args).map(|()| 0),
            Command::Fsck(args) => Ok(run_fsck(args)),
            Command::Umount(args) => unmount::run(args).map(|()| 0),
            Command::Stats(args) => fs_cmds::run_stats(args).map(|()| 0),
            Command::Clone(args) => clone_cmd::run(args).map(|()| 0),
            Command::InstallHelper(args) => daemon::run_install_helper(args).map(|()| 0),
            Command::Nullfuse(args) => daemon::run_nullfuse(args).map(|()| 0),
            Command::KvBench(args) => kv_bench::run(args).map(|()| 0),
        }
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("betreefs: {e:#}");
            std::process::exit(1);
        }
    }
}
