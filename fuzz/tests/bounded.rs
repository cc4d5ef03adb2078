//! The bounded fuzz run of CI: every target, a few thousand inputs each
//! (the image target fewer), no panic. The long run is documented in
//! fuzz/src/main.rs and its figures in the closing notes.

#[test]
fn every_target_survives_a_bounded_run() {
    betreefs_fuzz::quiet_panics();
    let per_target: u64 = std::env::var("BETREEFS_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let mut failures = Vec::new();
    for t in betreefs_fuzz::TARGETS {
        let inputs = if t.name == "image" {
            (per_target / 100).max(20)
        } else {
            per_target
        };
        let outcome = betreefs_fuzz::run(t, inputs, 7);
        assert!(outcome.inputs >= inputs);
        for (input, message) in outcome.panics {
            failures.push(format!("{}: {message} on {} bytes", t.name, input.len()));
        }
    }
    let _ = std::panic::take_hook();
    assert!(failures.is_empty(), "{failures:#?}");
}
