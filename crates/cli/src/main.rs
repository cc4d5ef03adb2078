//! `betreefs`: the command-line entry point.

mod kv_bench;

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
    /// Run a key-value benchmark (TRIAD WS1-WS3 and db_bench-style workloads)
    /// against the engine and print one JSON line of results.
    KvBench(kv_bench::Args),
}

/// Large buffers (nodes are megabytes) go straight to mmap and back to the
/// kernel when freed; glibc's adaptive threshold would otherwise keep them
/// in the heap and inflate the resident set far beyond the node cache.
fn tune_allocator() {
    // SAFETY: mallopt only adjusts allocator parameters; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
    }
}

fn main() {
    tune_allocator();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::KvBench(args) => kv_bench::run(args),
    };
    if let Err(e) = result {
        eprintln!("betreefs: {e:#}");
        std::process::exit(1);
    }
}
