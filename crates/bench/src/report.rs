//! Figures, their medians and ratios, and the Markdown tables.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

/// Which way a figure improves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    Lower,
    Higher,
}

/// One row of a suite's table: a figure for each file system, one value
/// per round.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub suite: String,
    pub name: String,
    pub unit: String,
    pub better: Better,
    pub values: BTreeMap<String, Vec<f64>>,
}

/// A curve per file system (for the plots), e.g. cumulative files/s over
/// files created.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Series {
    pub x_label: String,
    pub y_label: String,
    /// Names of the x values 0, 1, 2, ... when x is a category.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub categories: Vec<String>,
    pub points: BTreeMap<String, Vec<(f64, f64)>>,
}

/// Every figure of a run.
#[derive(Debug, Default, Serialize)]
pub struct Results {
    pub rows: Vec<Row>,
    pub series: BTreeMap<String, Series>,
    /// FUSE requests per operation by opcode: row, file system, opcode,
    /// one value per round.
    pub request_mix: BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<f64>>>>,
    /// Failures of a suite on a file system (the run goes on without it).
    pub errors: Vec<String>,
}

/// A figure within this fraction of the best is in the "compleat" band.
pub const COMPLEAT: f64 = 0.85;
/// A figure below this fraction of the best is marked as far behind.
pub const FAR_BEHIND: f64 = 0.30;

impl Results {
    /// Adds one value of one round.
    pub fn record(
        &mut self,
        suite: &str,
        name: &str,
        unit: &str,
        better: Better,
        fs: &str,
        value: f64,
    ) {
        let row = match self
            .rows
            .iter_mut()
            .position(|r| r.suite == suite && r.name == name)
        {
            Some(i) => &mut self.rows[i],
            None => {
                self.rows.push(Row {
                    suite: suite.to_string(),
                    name: name.to_string(),
                    unit: unit.to_string(),
                    better,
                    values: BTreeMap::new(),
                });
                self.rows.last_mut().expect("just pushed")
            }
        };
        row.values.entry(fs.to_string()).or_default().push(value);
    }

    /// Adds one round's requests of one opcode per operation.
    pub fn record_request_mix(&mut self, row: &str, fs: &str, opcode: &str, per_op: f64) {
        self.request_mix
            .entry(row.to_string())
            .or_default()
            .entry(fs.to_string())
            .or_default()
            .entry(opcode.to_string())
            .or_default()
            .push(per_op);
    }

    /// The request mix as a Markdown table: for each workload and FUSE
    /// file system, the median requests per operation of each opcode,
    /// most frequent first.
    pub fn request_mix_markdown(&self, order: &[String]) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "| workload | file system | requests per operation |");
        let _ = writeln!(out, "|---|---|---|");
        for (row, per_fs) in &self.request_mix {
            for fs in order {
                let Some(mix) = per_fs.get(fs) else { continue };
                let mut ops: Vec<(&str, f64)> = mix
                    .iter()
                    .filter_map(|(op, v)| Some((op.as_str(), median(v)?)))
                    .filter(|(_, m)| *m >= 0.005)
                    .collect();
                ops.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
                let cells: Vec<String> = ops
                    .iter()
                    .map(|(op, m)| format!("{op} {}", format_value(*m)))
                    .collect();
                let _ = writeln!(out, "| {row} | {fs} | {} |", cells.join(", "));
            }
        }
        out
    }

    /// Sets the curve of one file system (the last round's wins).
    pub fn set_series(
        &mut self,
        name: &str,
        x_label: &str,
        y_label: &str,
        fs: &str,
        points: Vec<(f64, f64)>,
    ) {
        let series = self.series.entry(name.to_string()).or_default();
        series.x_label = x_label.to_string();
        series.y_label = y_label.to_string();
        series.points.insert(fs.to_string(), points);
    }

    /// Names the x values of a series whose x is a category.
    pub fn set_categories(&mut self, name: &str, categories: Vec<String>) {
        self.series.entry(name.to_string()).or_default().categories = categories;
    }

    pub fn suites(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for row in &self.rows {
            if !out.contains(&row.suite) {
                out.push(row.suite.clone());
            }
        }
        out
    }

    /// The Markdown table of one suite: each file system's median and its
    /// fraction of the best file system's figure in that row.
    /// `counts_as_best` says which file systems may be the best (nullfuse
    /// keeps no data, so it never is).
    pub fn markdown(
        &self,
        suite: &str,
        order: &[String],
        counts_as_best: &dyn Fn(&str) -> bool,
    ) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "| {suite} | unit | {} |", order.join(" | "));
        let _ = writeln!(out, "|---|---|{}", "---:|".repeat(order.len()));
        for row in self.rows.iter().filter(|r| r.suite == suite) {
            let medians: Vec<Option<f64>> = order
                .iter()
                .map(|fs| row.values.get(fs).and_then(|v| median(v)))
                .collect();
            let best = best_of(
                row.better,
                order
                    .iter()
                    .zip(&medians)
                    .filter(|(fs, _)| counts_as_best(fs))
                    .filter_map(|(_, m)| *m),
            );
            let cells: Vec<String> = medians
                .iter()
                .map(|m| match (m, best) {
                    (Some(v), Some(b)) => {
                        let f = fraction_of_best(*v, b, row.better);
                        format!(
                            "{} ({}){}",
                            format_value(*v),
                            format_percent(f),
                            band_mark(f)
                        )
                    }
                    (Some(v), None) => format_value(*v),
                    (None, _) => "–".to_string(),
                })
                .collect();
            let _ = writeln!(
                out,
                "| {} | {} | {} |",
                row.name,
                row.unit,
                cells.join(" | ")
            );
        }
        out
    }
}

/// The median of a set of rounds (the mean of the middle two for an even
/// count); None for no values.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

fn best_of(better: Better, values: impl Iterator<Item = f64>) -> Option<f64> {
    values.reduce(|a, b| match better {
        Better::Lower => a.min(b),
        Better::Higher => a.max(b),
    })
}

/// How a figure compares with the best one: 1.0 is the best, 0.5 half as
/// good (twice the time, or half the throughput).
pub fn fraction_of_best(value: f64, best: f64, better: Better) -> f64 {
    match better {
        Better::Lower if value <= 0.0 => 1.0,
        Better::Lower => (best / value).min(1.0),
        Better::Higher if best <= 0.0 => 1.0,
        Better::Higher => (value / best).min(1.0),
    }
}

/// ✓ marks the compleat band (at least 85% of the best), ✗ a figure under
/// 30% of the best.
pub fn band_mark(fraction: f64) -> &'static str {
    if fraction >= COMPLEAT {
        " ✓"
    } else if fraction < FAR_BEHIND {
        " ✗"
    } else {
        ""
    }
}

fn format_percent(fraction: f64) -> String {
    let p = fraction * 100.0;
    if p == 0.0 || p >= 10.0 {
        format!("{p:.0}%")
    } else if p >= 0.1 {
        format!("{p:.1}%")
    } else {
        format!("{p:.2}%")
    }
}

/// Three significant digits, without exponent notation for everyday sizes.
pub fn format_value(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".to_string()
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 1e-6 {
        let digits = (2 - a.log10().floor() as i32).max(0) as usize;
        format!("{v:.digits$}")
    } else {
        format!("{v:.2e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn fractions_and_bands() {
        assert_eq!(fraction_of_best(2.0, 1.0, Better::Lower), 0.5);
        assert_eq!(fraction_of_best(50.0, 100.0, Better::Higher), 0.5);
        assert_eq!(fraction_of_best(0.0, 0.0, Better::Lower), 1.0);
        assert_eq!(fraction_of_best(5.0, 0.0, Better::Lower), 0.0);
        assert_eq!(band_mark(0.9), " ✓");
        assert_eq!(band_mark(0.85), " ✓");
        assert_eq!(band_mark(0.5), "");
        assert_eq!(band_mark(0.29), " ✗");
    }

    #[test]
    fn values_keep_three_significant_digits() {
        assert_eq!(format_value(47.83), "47.8");
        assert_eq!(format_value(1234.5), "1234");
        assert_eq!(format_value(0.01234), "0.0123");
        assert_eq!(format_value(0.5), "0.500");
        assert_eq!(format_value(2.0), "2.00");
        assert_eq!(format_value(0.0), "0");
        assert_eq!(format_value(3.91e-4), "0.000391");
        assert_eq!(format_value(2e-9), "2.00e-9");
    }

    #[test]
    fn table_ratios_exclude_file_systems_that_keep_no_data() {
        let mut r = Results::default();
        for (fs, v) in [("ext4", 2.0), ("betreefs", 4.0), ("nullfuse", 0.5)] {
            r.record("micro", "seq write", "s", Better::Lower, fs, v);
        }
        r.record("micro", "files/s", "1/s", Better::Higher, "ext4", 100.0);
        r.record("micro", "files/s", "1/s", Better::Higher, "betreefs", 20.0);
        r.record("micro", "files/s", "1/s", Better::Higher, "betreefs", 40.0);
        let order: Vec<String> = ["betreefs", "nullfuse", "ext4"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let md = r.markdown("micro", &order, &|fs| fs != "nullfuse");
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines[0], "| micro | unit | betreefs | nullfuse | ext4 |");
        assert_eq!(
            lines[2],
            "| seq write | s | 4.00 (50%) | 0.500 (100%) ✓ | 2.00 (100%) ✓ |"
        );
        // betreefs's median of two rounds is 30: 30% of the best.
        assert_eq!(
            lines[3],
            "| files/s | 1/s | 30.0 (30%) | – | 100 (100%) ✓ |"
        );
    }
}
