//! Fuzzing betreefs's decoders on stable Rust.
//!
//! Every structure betreefs reads from disk or from its log has a target in
//! [`targets`]: superblock copies, the log (records and replay), the block
//! table, nodes (header, meta, basements and the checks on load), write
//! batches (and the merge functions they carry), the file system's records
//! and keys, and whole images opened and read end to end. [`run`] feeds each
//! target mutations ([`mutate`]) of real encodings and reports any panic
//! with the input that caused it. The `betreefs-fuzz` binary runs it for as
//! long as asked; CI runs a bounded number of inputs (`tests/bounded.rs`).

pub mod mutate;
pub mod targets;

use std::panic::AssertUnwindSafe;

use rand::{rngs::SmallRng, Rng, SeedableRng};

pub use targets::{Target, TARGETS};

/// What fuzzing one target found.
#[derive(Debug, Default)]
pub struct Outcome {
    pub inputs: u64,
    /// Inputs that made the target panic, with the panic's message.
    pub panics: Vec<(Vec<u8>, String)>,
}

/// Runs `target` on `inputs` mutated inputs (seeds first), from `seed`.
pub fn run(target: &Target, inputs: u64, seed: u64) -> Outcome {
    let seeds = (target.seeds)();
    let mut corpus = seeds.clone();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut outcome = Outcome::default();
    let check = |input: &[u8], outcome: &mut Outcome| {
        outcome.inputs += 1;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| (target.run)(input)));
        if let Err(payload) = result {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            if outcome.panics.len() < 20 {
                outcome.panics.push((input.to_vec(), message));
            }
        }
    };
    for s in &seeds {
        check(s, &mut outcome);
    }
    while outcome.inputs < inputs {
        let base = &corpus[rng.gen_range(0..corpus.len())];
        let mut input = base.clone();
        mutate::mutate(&mut rng, &mut input, &corpus);
        check(&input, &mut outcome);
        // Keep some mutants as bases: mutations compound, reaching
        // encodings several steps from any seed.
        if rng.gen_ratio(1, 16) {
            if corpus.len() < 256 {
                corpus.push(input);
            } else {
                let i = rng.gen_range(seeds.len()..corpus.len());
                corpus[i] = input;
            }
        }
    }
    outcome
}

/// Silences the default panic message while fuzzing (panics are caught and
/// reported with their input); returns the previous hook's restorer.
pub fn quiet_panics() {
    std::panic::set_hook(Box::new(|_| {}));
}
