//! `train plot`: PNG charts of a run's `metrics.jsonl`.
//!
//! Five charts: `loss.png` (training and validation loss against the step), `metrics.png`
//! (the step's named metrics, when it logs any), `throughput.png` (samples or tokens per
//! second, each window and smoothed, against the step), `memory.png`
//! and `utilization.png` (the system monitor's samples against the time since the start); and,
//! for a pipeline run, `schedule.png`: the last recorded flush as a timeline, one row per
//! stage and a box per micro-batch's forward or backward, the idle time left white. A
//! chart whose data the run did not record is skipped, and the caller is told why. Text is
//! drawn with a typeface compiled into the binary, so no system fonts are needed.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::metrics::{SYSTEM_SPLIT, read_metrics};

/// Smallest and largest width or height accepted, in pixels.
pub const SIZE_RANGE: std::ops::RangeInclusive<u32> = 200..=8000;

/// What `plot_run` did for one chart.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The chart was written to this file.
    Written(PathBuf),
    /// The chart was skipped: its name and why.
    Skipped(&'static str, String),
}

/// Draws the charts of the run in `run_dir` into `out_dir` (created if missing), each
/// `width` × `height` pixels; `log_y` draws the loss and metrics charts' values on a
/// logarithmic axis (values that are not positive are left out and counted in the legend).
pub fn plot_run(
    run_dir: &Path,
    out_dir: &Path,
    width: u32,
    height: u32,
    log_y: bool,
) -> Result<Vec<Outcome>> {
    for (flag, v) in [("--width", width), ("--height", height)] {
        if !SIZE_RANGE.contains(&v) {
            return Err(Error::config(format!(
                "{flag} {v}: expected {} to {} pixels",
                SIZE_RANGE.start(),
                SIZE_RANGE.end()
            )));
        }
    }
    let metrics_path = run_dir.join("metrics.jsonl");
    if !metrics_path.is_file() {
        return Err(Error::Io(format!(
            "{}: not found; is {} a run directory written with the `jsonl` sink?",
            metrics_path.display(),
            run_dir.display()
        )));
    }
    let records = read_metrics(&metrics_path)?;
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    register_font();
    let charts = [
        loss_chart(&records),
        metrics_chart(&records),
        throughput_chart(&records),
        memory_chart(&records),
        utilization_chart(&records),
    ];
    let mut outcomes = Vec::new();
    let schedule = out_dir.join("schedule.png");
    outcomes.push(
        match schedule_timeline(&records, &schedule, width, height)? {
            true => Outcome::Written(schedule),
            false => Outcome::Skipped(
                "schedule",
                "no pipeline schedule was recorded (strategy \"pipeline\" records one)".into(),
            ),
        },
    );
    for chart in charts {
        match chart {
            Ok(chart) => {
                let chart = if log_y && matches!(chart.name, "loss" | "metrics") {
                    chart.log_y()
                } else {
                    chart
                };
                let path = out_dir.join(format!("{}.png", chart.name));
                draw(&chart, &path, width, height)?;
                outcomes.push(Outcome::Written(path));
            }
            Err(skipped) => outcomes.push(skipped),
        }
    }
    Ok(outcomes)
}

const FONT: &str = "sans-serif";

fn register_font() {
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

/// One line of a chart.
struct Series {
    label: String,
    points: Vec<(f64, f64)>,
    /// Draw the points as dots too (sparse series such as validation).
    dots: bool,
    /// Drawn thin and pale, behind the others.
    faint: bool,
}

struct Chart {
    name: &'static str,
    title: String,
    x_label: &'static str,
    y_label: String,
    series: Vec<Series>,
    /// Force the y axis to start at zero.
    from_zero: bool,
    /// The points' y values are log10 of the values (the axis is labelled with the values).
    log_y: bool,
}

impl Chart {
    /// The chart on a logarithmic y axis: each point's y as its log10; a point whose value is
    /// not positive cannot be drawn there and is left out, its series' label says how many.
    fn log_y(mut self) -> Self {
        for s in &mut self.series {
            let before = s.points.len();
            s.points = s
                .points
                .iter()
                .filter(|p| p.1 > 0.0)
                .map(|&(x, y)| (x, y.log10()))
                .collect();
            let left_out = before - s.points.len();
            if left_out > 0 {
                s.label += &format!(" ({left_out} values ≤ 0 not drawn)");
            }
        }
        self.y_label += " (log scale)";
        self.from_zero = false;
        self.log_y = true;
        self
    }
}

type Built = std::result::Result<Chart, Outcome>;

fn values(records: &[Value], split: &str, x: &str, y: &str) -> Vec<(f64, f64)> {
    records
        .iter()
        .filter(|r| r["split"] == split)
        .filter_map(|r| Some((r.get(x)?.as_f64()?, r.get(y)?.as_f64()?)))
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .collect()
}

fn series(label: &str, points: Vec<(f64, f64)>) -> Series {
    Series {
        label: label.to_string(),
        points,
        dots: false,
        faint: false,
    }
}

fn loss_chart(records: &[Value]) -> Built {
    let train = values(records, "train", "step", "loss");
    let val = values(records, "val", "step", "loss");
    if train.is_empty() && val.is_empty() {
        return Err(Outcome::Skipped("loss", "no loss was logged".into()));
    }
    let mut s = vec![series("train", train)];
    s.push(Series {
        dots: true,
        ..series("validation", val)
    });
    Ok(Chart {
        name: "loss",
        title: "Loss".into(),
        x_label: "step",
        y_label: "loss".into(),
        series: s,
        from_zero: false,
        log_y: false,
    })
}

/// The step's named metrics (listed in each record's `metrics`), training as lines and
/// validation as dots.
fn metrics_chart(records: &[Value]) -> Built {
    let mut names: Vec<String> = Vec::new();
    for r in records {
        for n in r["metrics"].as_array().into_iter().flatten() {
            if let Some(n) = n.as_str()
                && !names.iter().any(|m| m == n)
            {
                names.push(n.to_string());
            }
        }
    }
    if names.is_empty() {
        return Err(Outcome::Skipped(
            "metrics",
            "the step logged no named metrics".into(),
        ));
    }
    let mut s = Vec::new();
    for name in &names {
        let train = values(records, "train", "step", name);
        if !train.is_empty() {
            s.push(series(name, train));
        }
        let val = values(records, "val", "step", name);
        if !val.is_empty() {
            s.push(Series {
                dots: true,
                ..series(&format!("{name} (validation)"), val)
            });
        }
    }
    Ok(Chart {
        name: "metrics",
        title: "Metrics".into(),
        x_label: "step",
        y_label: "value".into(),
        series: s,
        from_zero: false,
        log_y: false,
    })
}

fn throughput_chart(records: &[Value]) -> Built {
    let unit = if records.iter().any(|r| r.get("tokens_per_sec").is_some()) {
        "tokens"
    } else {
        "samples"
    };
    let raw = values(records, "train", "step", &format!("{unit}_per_sec"));
    if raw.is_empty() {
        return Err(Outcome::Skipped(
            "throughput",
            "no training throughput was logged".into(),
        ));
    }
    let smooth = values(records, "train", "step", &format!("{unit}_per_sec_ema"));
    Ok(Chart {
        name: "throughput",
        title: format!("Throughput ({unit}/s, all devices)"),
        x_label: "step",
        y_label: format!("{unit}/s"),
        series: vec![
            Series {
                faint: !smooth.is_empty(),
                ..series("each logging window", raw)
            },
            series("smoothed", smooth),
        ],
        from_zero: true,
        log_y: false,
    })
}

/// The system records' keys `dev<i>_<suffix>`, in device order.
fn device_keys(records: &[Value], suffix: &str) -> Vec<(String, String)> {
    let mut keys: Vec<(usize, String)> = records
        .iter()
        .filter(|r| r["split"] == SYSTEM_SPLIT)
        .filter_map(Value::as_object)
        .flat_map(|r| r.keys())
        .filter_map(|k| {
            let i = k.strip_prefix("dev")?.strip_suffix(suffix)?.parse().ok()?;
            Some((i, k.clone()))
        })
        .collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .map(|(i, k)| (format!("dev{i}"), k))
        .collect()
}

fn system_chart(
    records: &[Value],
    name: &'static str,
    title: &str,
    y_label: &str,
    process: &[(&str, &str)],
    per_device: &[(&str, &str)],
) -> Built {
    if !records.iter().any(|r| r["split"] == SYSTEM_SPLIT) {
        return Err(Outcome::Skipped(
            name,
            "no system samples (monitor.interval_s = 0, or the run ended before the first)".into(),
        ));
    }
    let mut s: Vec<Series> = process
        .iter()
        .map(|(key, label)| series(label, values(records, SYSTEM_SPLIT, "time", key)))
        .collect();
    for (suffix, what) in per_device {
        for (dev, key) in device_keys(records, suffix) {
            let label = format!("{dev} {what}");
            s.push(series(&label, values(records, SYSTEM_SPLIT, "time", &key)));
        }
    }
    s.retain(|x| !x.points.is_empty());
    if s.is_empty() {
        return Err(Outcome::Skipped(
            name,
            "the system samples hold none of its values".into(),
        ));
    }
    Ok(Chart {
        name,
        title: title.into(),
        x_label: "seconds since start",
        y_label: y_label.into(),
        series: s,
        from_zero: true,
        log_y: false,
    })
}

fn memory_chart(records: &[Value]) -> Built {
    system_chart(
        records,
        "memory",
        "Memory",
        "MiB",
        &[
            ("rss_mib", "process resident"),
            ("rss_peak_mib", "process peak"),
        ],
        &[
            ("_mem_in_use_mib", "in use (Burn pool)"),
            ("_mem_reserved_mib", "reserved (Burn pool)"),
            ("_gpu_mem_used_mib", "used (NVML)"),
        ],
    )
}

fn utilization_chart(records: &[Value]) -> Built {
    system_chart(
        records,
        "utilization",
        "Utilization",
        "% busy",
        &[
            ("cpu_util", "process CPU (all cores)"),
            ("host_cpu_util", "machine CPU (all cores)"),
        ],
        &[
            ("_cpu_util", "CPU (its cores)"),
            ("_gpu_util", "GPU (NVML)"),
        ],
    )
}

const COLORS: [RGBColor; 8] = [
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
fn range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
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
fn tick(v: f64) -> String {
    if (v == v.round() && v.abs() < 1e15) || v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        let decimals = (2 - v.abs().log10().floor() as i32).clamp(0, 6) as usize;
        let s = format!("{v:.decimals$}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn draw(chart: &Chart, path: &Path, width: u32, height: u32) -> Result<()> {
    let fail =
        |e: &dyn std::fmt::Display| Error::Io(format!("{}: cannot draw: {e}", path.display()));
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    paint(chart, &root).map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))
}

fn paint<DB: DrawingBackend>(
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

/// Draws the last `schedule` record of `records` into `path`; `false` when there is none.
fn schedule_timeline(records: &[Value], path: &Path, width: u32, height: u32) -> Result<bool> {
    let Some(r) = records.iter().rev().find(|r| r["split"] == "schedule") else {
        return Ok(false);
    };
    let ops: Vec<(usize, bool, u64, f64, f64)> = r["ops"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|op| {
            Some((
                op[0].as_u64()? as usize,
                op[1] == "F",
                op[2].as_u64()?,
                op[3].as_f64()? * 1e3,
                op[4].as_f64()? * 1e3,
            ))
        })
        .collect();
    let stages = r["stages"].as_u64().unwrap_or(1) as usize;
    let end = ops.iter().map(|o| o.4).fold(0.0, f64::max).max(1e-3);
    let busy: f64 = ops.iter().map(|o| o.4 - o.3).sum();
    let idle = 1.0 - busy / (stages as f64 * end);
    let title = format!(
        "{} schedule, {stages} stages, {} micro-batches (step {}): idle {:.0} %, ideal {:.0} %",
        r["schedule"].as_str().unwrap_or("pipeline"),
        r["microbatches"],
        r["step"],
        idle * 100.0,
        100.0 * (stages - 1) as f64
            / (r["microbatches"].as_f64().unwrap_or(1.0) + stages as f64 - 1.0)
    );
    let fail =
        |e: &dyn std::fmt::Display| Error::Io(format!("{}: cannot draw: {e}", path.display()));
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    let drawn = (|| -> std::result::Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let scale = (height as f64 / 600.0).clamp(0.5, 4.0);
        let px = |x: f64| (x * scale).round() as i32;
        let mut c = ChartBuilder::on(&root)
            .caption(&title, (FONT, px(22.0)))
            .margin(px(16.0))
            .x_label_area_size(px(48.0))
            .y_label_area_size(px(72.0))
            .build_cartesian_2d(0.0..end * 1.02, stages as f64 - 0.5..-0.5)?;
        c.configure_mesh()
            .x_desc("milliseconds since the flush started")
            .y_desc("stage")
            .label_style((FONT, px(15.0)))
            .axis_desc_style((FONT, px(17.0)))
            .disable_y_mesh()
            .light_line_style(RGBColor(235, 235, 235))
            .y_labels(stages.max(2))
            .y_label_formatter(&|v| {
                if (v - v.round()).abs() < 1e-6 && *v >= 0.0 {
                    format!("{}", v.round() as usize)
                } else {
                    String::new()
                }
            })
            .x_label_formatter(&|v| tick(*v))
            .draw()?;
        let (forward, backward) = (COLORS[0], COLORS[1]);
        for &(s, is_forward, m, a, b) in &ops {
            let color = if is_forward { forward } else { backward };
            let y = s as f64;
            c.draw_series(std::iter::once(Rectangle::new(
                [(a, y - 0.38), (b, y + 0.38)],
                color.mix(0.85).filled(),
            )))?;
            c.draw_series(std::iter::once(Rectangle::new(
                [(a, y - 0.38), (b, y + 0.38)],
                WHITE.stroke_width(1),
            )))?;
            // A label where the box is wide enough to hold one.
            if (b - a) / end > 0.025 {
                let label = format!("{}{m}", if is_forward { "F" } else { "B" });
                c.draw_series(std::iter::once(Text::new(
                    label,
                    ((a + b) / 2.0, y),
                    (FONT, px(14.0)).into_font().color(&WHITE).pos(
                        plotters::style::text_anchor::Pos::new(
                            plotters::style::text_anchor::HPos::Center,
                            plotters::style::text_anchor::VPos::Center,
                        ),
                    ),
                )))?;
            }
        }
        for (label, color) in [("forward", forward), ("backward", backward)] {
            c.draw_series(std::iter::once(Rectangle::new(
                [(0.0, -1.0), (0.0, -1.0)],
                color.filled(),
            )))?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], color.filled()));
        }
        c.configure_series_labels()
            .label_font((FONT, px(15.0)))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
        root.present()?;
        Ok(())
    })();
    drawn.map_err(|e| fail(&e))?;
    Ok(true)
}

/// Writes greyscale images as one PNG grid, atomically: `pixels` holds `count` images of
/// `height × width` values in `[0, 1]` (clamped), one after another, drawn `columns` to a row
/// with a one-pixel gap, each pixel `scale` pixels wide. For a workload's snapshots (generated
/// samples, reconstructions).
pub fn save_image_grid(
    path: &Path,
    pixels: &[f32],
    height: usize,
    width: usize,
    columns: usize,
    scale: usize,
) -> Result<()> {
    let per = height * width;
    if per == 0 || columns == 0 || scale == 0 || !pixels.len().is_multiple_of(per) {
        return Err(Error::config(format!(
            "{}: an image grid needs whole images of {height}×{width} pixels, {columns} columns \
             and a scale of at least 1 ({} values given)",
            path.display(),
            pixels.len()
        )));
    }
    let count = pixels.len() / per;
    let rows = count.div_ceil(columns).max(1);
    let cell_w = width * scale + 1;
    let cell_h = height * scale + 1;
    let (w, h) = (columns * cell_w + 1, rows * cell_h + 1);
    // The gaps are mid-grey, so that white and black images both show their edges.
    let mut canvas = vec![96u8; w * h];
    for i in 0..count {
        let (r, c) = (i / columns, i % columns);
        for y in 0..height * scale {
            for x in 0..width * scale {
                let v = pixels[i * per + (y / scale) * width + x / scale];
                let at = (r * cell_h + 1 + y) * w + c * cell_w + 1 + x;
                canvas[at] = (v.clamp(0.0, 1.0) * 255.0).round() as u8;
            }
        }
    }
    let mut bytes = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut bytes, w as u32, h as u32);
        encoder.set_color(png::ColorType::Grayscale);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder
            .write_header()
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        writer
            .write_image_data(&canvas)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    crate::files::write_atomic(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ticks_are_short() {
        assert_eq!(tick(10.0), "10");
        assert_eq!(tick(0.5), "0.5");
        assert_eq!(tick(1.25), "1.25");
        assert_eq!(tick(0.0123456), "0.0123");
        assert_eq!(tick(1234.4), "1234");
        assert_eq!(tick(-2.5), "-2.5");
    }

    #[test]
    fn ranges_have_room_and_are_never_empty() {
        assert_eq!(range([2.0, 2.0].into_iter(), false), (1.99, 2.21));
        assert_eq!(range(std::iter::empty(), false), (0.0, 1.0));
        let (lo, hi) = range([10.0, 20.0].into_iter(), true);
        assert_eq!(lo, 0.0);
        assert!(hi > 20.0);
    }

    #[test]
    fn a_log_axis_draws_positive_values_and_says_what_it_left_out() {
        let records = vec![
            json!({"step": 1, "split": "train", "loss": 100.0}),
            json!({"step": 2, "split": "train", "loss": 0.01}),
            json!({"step": 3, "split": "train", "loss": 0.0}),
            json!({"step": 3, "split": "val", "loss": 1.0}),
        ];
        let chart = loss_chart(&records).unwrap().log_y();
        assert!(chart.log_y);
        assert_eq!(chart.series[0].points, [(1.0, 2.0), (2.0, -2.0)]);
        assert_eq!(chart.series[0].label, "train (1 values ≤ 0 not drawn)");
        assert_eq!(chart.series[1].points, [(3.0, 0.0)]);
        assert_eq!(chart.y_label, "loss (log scale)");
    }

    #[test]
    fn charts_without_data_are_skipped_with_a_reason() {
        let records = vec![json!({"step": 1, "split": "val", "loss": 2.0})];
        assert!(loss_chart(&records).is_ok());
        assert!(matches!(
            throughput_chart(&records),
            Err(Outcome::Skipped("throughput", _))
        ));
        let Err(Outcome::Skipped(_, why)) = memory_chart(&records) else {
            panic!("memory chart without system samples");
        };
        assert!(why.contains("monitor.interval_s"), "{why}");
    }

    #[test]
    fn device_series_are_found_in_device_order() {
        let records = vec![json!({
            "step": 1, "split": "system", "time": 1.0,
            "dev10_cpu_util": 5.0, "dev2_cpu_util": 50.0, "dev2_gpu_util": 7.0, "cpu_util": 9.0
        })];
        let keys: Vec<String> = device_keys(&records, "_cpu_util")
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        assert_eq!(keys, ["dev2", "dev10"]);
        let chart = utilization_chart(&records).unwrap();
        let labels: Vec<&str> = chart.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "process CPU (all cores)",
                "dev2 CPU (its cores)",
                "dev10 CPU (its cores)",
                "dev2 GPU (NVML)"
            ]
        );
    }

    #[test]
    fn the_schedule_is_drawn_from_its_record_and_skipped_without_one() {
        register_font();
        let dir = std::env::temp_dir().join(format!("kiln-plot-schedule-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("schedule.png");
        let record = json!({
            "split": "schedule", "step": 3, "stages": 2, "microbatches": 2,
            "schedule": "1f1b", "held": [2, 1],
            "ops": [[0, "F", 0, 0.0, 0.01], [0, "F", 1, 0.01, 0.02], [1, "F", 0, 0.011, 0.02],
                    [1, "B", 0, 0.02, 0.03], [0, "B", 0, 0.031, 0.04], [1, "F", 1, 0.03, 0.04],
                    [1, "B", 1, 0.04, 0.05], [0, "B", 1, 0.051, 0.06]]
        });
        assert!(!schedule_timeline(&[json!({"split": "train"})], &path, 600, 300).unwrap());
        assert!(schedule_timeline(&[record], &path, 600, 300).unwrap());
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
