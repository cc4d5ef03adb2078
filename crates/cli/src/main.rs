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

/// The allocator: jemalloc, because the mount daemon's memory must stay
/// within its budget (issue 11: resident ≤ the cache budget + 64 MiB).
/// The engine frees and allocates basements of ~128 KiB and node images of
/// megabytes all the time beside small long-lived allocations; glibc
/// either left 60-160 MiB free but fragmented in its heaps (with large
/// buffers kept in the heap: 360-490 MiB resident during an untar with
/// the default 256 MiB budget) or, sending them to mmap, paid a page
/// fault and a clear per 4 KiB on every reuse (sequential write 240 -> 143
/// MB/s, cold read ~800 -> ~520 MB/s). jemalloc's size classes reuse the
/// pages, and its decay gives back what stays free (283-317 MiB peak in
/// the same untar). The price: pages given back are faulted in again,
/// and a sequential write is ~15-25% slower than with glibc keeping 128
/// MiB of free heap. See docs/benchmarks/daemon-memory.md.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its first allocation (before `main`): a
/// background thread returns pages that stayed free for a quarter of a
/// second, at once (no lazy "muzzy" stage, whose pages would still count
/// as resident); four arenas, not four per CPU, as the daemon runs a
/// handful of threads and each arena keeps its own free pages.
#[export_name = "_rjem_malloc_conf"]
pub static MALLOC_CONF: &[u8; 69] =
    b"background_thread:true,narenas:4,dirty_decay_ms:250,muzzy_decay_ms:0\0";

/// Idle IO buffers kept for reuse by every command but the mount daemon
/// (which sizes its pool from its memory budget): kv-bench's WS3 at 1M
/// keys and 2M operations with the 256 MiB cache peaked at 455 MiB with a
/// 64 MiB pool, 384 MiB with 16 MiB, 378 MiB with none, at the same speed.
const IO_BUFFER_POOL: usize = 16 << 20;

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
    betreefs_store::set_buffer_pool_limit(IO_BUFFER_POOL);
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
