//! The progress display: a bar of phases started, the phase running, and
//! a line per figure (also when stderr is not a terminal).

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::report::format_value;

pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(total_phases: u64) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total_phases), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("[{elapsed_precise}] {bar:30} {pos}/{len} phases  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.enable_steady_tick(Duration::from_millis(500));
        Progress { bar }
    }

    /// A phase starts.
    pub fn phase(&self, fs: &str, suite: &str, phase: &str) {
        self.bar.inc(1);
        self.bar.set_message(format!("{fs} · {suite} · {phase}"));
    }

    /// Something other than a phase is going on (setup, teardown).
    pub fn status(&self, text: &str) {
        self.bar.set_message(text.to_string());
    }

    /// A figure is in.
    pub fn figure(&self, fs: &str, suite: &str, name: &str, unit: &str, value: f64) {
        self.line(&format!(
            "{fs:>9} {suite:<7} {name}: {} {unit}",
            format_value(value)
        ));
    }

    /// Prints a line above the bar.
    pub fn line(&self, text: &str) {
        self.bar.suspend(|| eprintln!("{text}"));
    }

    pub fn position(&self) -> u64 {
        self.bar.position()
    }

    /// Sets the phases done, e.g. after a suite that failed half-way or
    /// did not apply, so the bar still ends full.
    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
