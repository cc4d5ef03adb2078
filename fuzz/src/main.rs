//! `betreefs-fuzz`: runs the fuzz targets for a given number of inputs.
//!
//! ```sh
//! cargo run --release -p betreefs-fuzz -- --inputs 1250000          # every target
//! cargo run --release -p betreefs-fuzz -- --target node --inputs 10000000
//! ```
//!
//! Inputs that panic are written to `--crashes` (default
//! `fuzz/crashes/<target>-<n>.bin`) and make the exit status 1.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;

#[derive(Parser)]
#[command(name = "betreefs-fuzz", about = "Fuzz betreefs's decoders")]
struct Args {
    /// One target (superblock, log, block-table, node, batch, record, key,
    /// image), or all of them.
    #[arg(long, default_value = "all")]
    target: String,
    /// Inputs per target (the image target, which opens a whole file
    /// system per input, runs a hundredth of them).
    #[arg(long, default_value_t = 100_000)]
    inputs: u64,
    /// Seed of the mutations.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where inputs that panic are written.
    #[arg(long, default_value = "fuzz/crashes")]
    crashes: PathBuf,
}

fn main() {
    let args = Args::parse();
    let targets: Vec<_> = betreefs_fuzz::TARGETS
        .iter()
        .filter(|t| args.target == "all" || args.target == t.name)
        .collect();
    if targets.is_empty() {
        eprintln!("betreefs-fuzz: no target named {}", args.target);
        std::process::exit(2);
    }
    betreefs_fuzz::quiet_panics();
    let mut total = 0;
    let mut panics = 0;
    for t in targets {
        let inputs = if t.name == "image" {
            (args.inputs / 100).max(10)
        } else {
            args.inputs
        };
        let started = Instant::now();
        let outcome = betreefs_fuzz::run(t, inputs, args.seed);
        total += outcome.inputs;
        println!(
            "{:<12} {:>10} inputs  {:>6.1} s  {} panics",
            t.name,
            outcome.inputs,
            started.elapsed().as_secs_f64(),
            outcome.panics.len()
        );
        for (i, (input, message)) in outcome.panics.iter().enumerate() {
            panics += 1;
            let _ = std::fs::create_dir_all(&args.crashes);
            let path = args.crashes.join(format!("{}-{i}.bin", t.name));
            let _ = std::fs::write(&path, input);
            println!("  panic: {message} (input in {})", path.display());
        }
    }
    println!("{total} inputs, {panics} panics");
    std::process::exit(i32::from(panics > 0));
}
