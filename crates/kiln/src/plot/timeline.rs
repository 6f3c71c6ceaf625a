//! A pipeline's last recorded flush as a timeline: one row per stage, a box per micro-batch's
//! forward or backward.

use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

use kiln_engine::error::{Error, Result};

use super::draw::COLORS;
use crate::plot::draw::FONT;
use crate::plot::draw::tick;

/// Draws the last `schedule` record of `records` into `path`; `false` when there is none.
pub(super) fn schedule_timeline(
    records: &[Value],
    path: &Path,
    width: u32,
    height: u32,
) -> Result<bool> {
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
