//! Drawing a chart into a PNG: the compiled-in typeface, colours, axes and their ticks.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use kiln_engine::error::{Error, Result};

use super::charts::Chart;
use crate::plot::charts::Series;

pub(super) const FONT: &str = "sans-serif";

pub(super) fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid TrueType font shipped with the crate; a failure would leave
        // text undrawn and surface as a drawing error naming the file.
        let _ = plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            epaint_default_fonts::UBUNTU_LIGHT,
        );
    });
}

pub(super) const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// Axis range with a margin, never empty.
pub(super) fn range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    if hi - lo < 1e-12 {
        hi = lo + lo.abs().max(1.0) * 0.1;
    }
    let pad = (hi - lo) * 0.05;
    (if from_zero && lo >= 0.0 { lo } else { lo - pad }, hi + pad)
}

/// An axis label: whole numbers plainly, others with three significant digits.
pub(super) fn tick(v: f64) -> String {
    if (v == v.round() && v.abs() < 1e15) || v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        let decimals = (2 - v.abs().log10().floor() as i32).clamp(0, 6) as usize;
        let s = format!("{v:.decimals$}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

pub(super) fn draw(chart: &Chart, path: &Path, width: u32, height: u32) -> Result<()> {
    let fail =
        |e: &dyn std::fmt::Display| Error::Io(format!("{}: cannot draw: {e}", path.display()));
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    paint(chart, &root).map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))
}

pub(super) fn paint<DB: DrawingBackend>(
    chart: &Chart,
    root: &DrawingArea<DB, Shift>,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let points = || chart.series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = range(points().map(|p| p.0), false);
    let (y0, y1) = range(points().map(|p| p.1), chart.from_zero);
    let scale = (root.dim_in_pixel().1 as f64 / 600.0).clamp(0.5, 4.0);
    let px = |x: f64| (x * scale).round() as i32;
    let mut c = ChartBuilder::on(root)
        .caption(&chart.title, (FONT, px(26.0)))
        .margin(px(16.0))
        .x_label_area_size(px(48.0))
        .y_label_area_size(px(72.0))
        .build_cartesian_2d(x0..x1, y0..y1)?;
    c.configure_mesh()
        .x_desc(chart.x_label)
        .y_desc(chart.y_label.as_str())
        .label_style((FONT, px(15.0)))
        .axis_desc_style((FONT, px(17.0)))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(205, 205, 205))
        .x_labels(8)
        .y_labels(8)
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(if chart.log_y { 10f64.powf(*v) } else { *v }))
        .draw()?;
    let stroke = px(2.5).max(1) as u32;
    // Faint series first, so that the others are drawn over them.
    let mut order: Vec<(usize, &Series)> = chart.series.iter().enumerate().collect();
    order.sort_by_key(|(_, s)| !s.faint);
    for (i, s) in order {
        if s.points.is_empty() {
            continue;
        }
        let color = COLORS[i % COLORS.len()];
        let style = if s.faint {
            color.mix(0.35).stroke_width(stroke.div_ceil(2))
        } else {
            color.stroke_width(stroke)
        };
        c.draw_series(LineSeries::new(s.points.iter().copied(), style))?
            .label(s.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        // Sparse series (validation, a short run's few samples) get a dot per point, so that
        // a single point is seen too.
        if s.dots || s.points.len() <= 30 {
            let r = px(3.5).max(2);
            c.draw_series(s.points.iter().map(|&p| Circle::new(p, r, color.filled())))?;
        }
    }
    c.configure_series_labels()
        .label_font((FONT, px(15.0)))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}
