//! [`plot_run`]: every chart of a run, each written or skipped with the reason.

use std::path::Path;

use kiln_engine::error::{Error, Result};
use kiln_engine::metrics::read_metrics;

use super::charts::{
    Outcome, loss_chart, memory_chart, metrics_chart, throughput_chart, utilization_chart,
};
use super::draw::register_font;
use super::timeline::schedule_timeline;
use crate::plot::draw::draw;

/// Smallest and largest width or height accepted, in pixels.
pub const SIZE_RANGE: std::ops::RangeInclusive<u32> = 200..=8000;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::charts::device_keys;
    use crate::plot::draw::range;
    use crate::plot::draw::tick;
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
