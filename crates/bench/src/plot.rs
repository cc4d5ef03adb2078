//! PNG plots like the papers' figures: tokubench cumulative throughput
//! over files created, rename and unlink time against file size, and
//! device bytes written per operation. Logarithmic axes are drawn by
//! plotting log values on linear axes and labelling them back.

use std::ops::Range;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::report::{format_value, Series};
use crate::suites::micro::human_size;

const FONT: &str = "sans-serif";
const FONT_FILES: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Loads the font the plots use (plotters draws text with ab_glyph and
/// needs one registered).
pub fn register_font() -> Result<()> {
    let path = FONT_FILES
        .iter()
        .find(|p| Path::new(p).exists())
        .ok_or_else(|| {
            anyhow!("no DejaVuSans.ttf found (apt-get install -y fonts-dejavu-core); plots skipped")
        })?;
    let bytes = std::fs::read(path).with_context(|| format!("reading {path}"))?;
    // The font must live as long as the process; it is loaded once.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font(FONT, FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{path}: not a usable font"))
}

/// How an axis maps values.
#[derive(Clone, Copy)]
pub enum Axis {
    Linear,
    /// log10, labelled with the value.
    Log10,
    /// log2 of a byte size, labelled as a size.
    LogBytes,
}

impl Axis {
    fn to_plot(self, v: f64) -> f64 {
        match self {
            Axis::Linear => v,
            Axis::Log10 => v.max(1e-9).log10(),
            Axis::LogBytes => v.max(1.0).log2(),
        }
    }

    fn label(self, v: f64) -> String {
        match self {
            Axis::Linear => format_value(v),
            Axis::Log10 => format_value(10f64.powf(v)),
            Axis::LogBytes => human_size(2f64.powf(v).round() as u64),
        }
    }
}

fn padded(min: f64, max: f64) -> (f64, f64) {
    if (max - min).abs() < 1e-9 {
        (min - 0.5, max + 0.5)
    } else {
        let pad = (max - min) * 0.05;
        (min - pad, max + pad)
    }
}

/// The chart every plot shares: size, caption, margins, and the legend
/// drawn after `body` has drawn the mesh and the series.
fn draw<'p>(
    path: &'p Path,
    title: &str,
    x: Range<f64>,
    y: Range<f64>,
    body: impl FnOnce(
        &mut ChartContext<'_, BitMapBackend<'p>, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    ) -> Result<()>,
) -> Result<()> {
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)?;
    body(&mut chart)?;
    chart
        .configure_series_labels()
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// One line per file system.
pub fn line_plot(path: &Path, title: &str, series: &Series, x: Axis, y: Axis) -> Result<()> {
    let pts: Vec<(f64, f64)> = series
        .points
        .values()
        .flatten()
        .map(|(a, b)| (x.to_plot(*a), y.to_plot(*b)))
        .collect();
    anyhow::ensure!(!pts.is_empty(), "nothing to plot for {title}");
    let (x0, x1) = padded(
        pts.iter().map(|p| p.0).fold(f64::MAX, f64::min),
        pts.iter().map(|p| p.0).fold(f64::MIN, f64::max),
    );
    let (y0, y1) = padded(
        pts.iter().map(|p| p.1).fold(f64::MAX, f64::min),
        pts.iter().map(|p| p.1).fold(f64::MIN, f64::max),
    );

    draw(path, title, x0..x1, y0..y1, |chart| {
        chart
            .configure_mesh()
            .x_desc(series.x_label.as_str())
            .y_desc(series.y_label.as_str())
            .x_label_formatter(&|v| x.label(*v))
            .y_label_formatter(&|v| y.label(*v))
            .label_style((FONT, 14))
            .draw()?;
        for (i, (fs, points)) in series.points.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let mapped: Vec<(f64, f64)> = points
                .iter()
                .map(|(a, b)| (x.to_plot(*a), y.to_plot(*b)))
                .collect();
            chart
                .draw_series(LineSeries::new(mapped.clone(), color.stroke_width(2)))?
                .label(fs.as_str())
                .legend(move |(lx, ly)| {
                    PathElement::new(vec![(lx, ly), (lx + 24, ly)], color.stroke_width(3))
                });
            chart.draw_series(
                mapped
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )?;
        }
        Ok(())
    })
}

/// Grouped bars: one group per category, one bar per file system, on a
/// log10 axis.
pub fn bar_plot(path: &Path, title: &str, series: &Series) -> Result<()> {
    let groups = series.categories.len();
    let systems: Vec<&String> = series.points.keys().collect();
    anyhow::ensure!(
        groups > 0 && !systems.is_empty(),
        "nothing to plot for {title}"
    );
    let values: Vec<f64> = series
        .points
        .values()
        .flatten()
        .map(|p| p.1)
        .filter(|v| *v > 0.0)
        .collect();
    let lo = values
        .iter()
        .copied()
        .fold(f64::MAX, f64::min)
        .max(1e-3)
        .log10()
        .floor();
    let hi = values
        .iter()
        .copied()
        .fold(f64::MIN, f64::max)
        .max(1e-3)
        .log10()
        .ceil()
        .max(lo + 1.0);

    draw(path, title, -0.5..groups as f64 - 0.5, lo..hi, |chart| {
        // Groups are centred on whole numbers, where the axis puts its labels.
        let category = |v: &f64| {
            let g = v.round();
            if (v - g).abs() < 0.01 && g >= 0.0 {
                series
                    .categories
                    .get(g as usize)
                    .cloned()
                    .unwrap_or_default()
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(groups + 1)
            .x_label_formatter(&category)
            .y_desc(series.y_label.as_str())
            .y_label_formatter(&|v| format_value(10f64.powf(*v)))
            .label_style((FONT, 14))
            .draw()?;
        let width = 0.8 / systems.len() as f64;
        for (j, fs) in systems.iter().enumerate() {
            let color = Palette99::pick(j).to_rgba();
            let bars = series.points[*fs]
                .iter()
                .filter(|(_, v)| *v > 0.0)
                .map(|(g, v)| {
                    let left = g - 0.4 + j as f64 * width;
                    Rectangle::new(
                        [(left, lo), (left + width * 0.9, v.log10())],
                        color.filled(),
                    )
                });
            chart
                .draw_series(bars)?
                .label(fs.as_str())
                .legend(move |(lx, ly)| {
                    Rectangle::new([(lx, ly - 6), (lx + 18, ly + 6)], color.filled())
                });
        }
        Ok(())
    })
}
