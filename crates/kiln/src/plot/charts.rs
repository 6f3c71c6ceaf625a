//! The charts a run's records give: which series each draws, and why one is skipped.

use std::path::PathBuf;

use serde_json::Value;

use kiln_engine::metrics::SYSTEM_SPLIT;

/// What `plot_run` did for one chart.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The chart was written to this file.
    Written(PathBuf),
    /// The chart was skipped: its name and why.
    Skipped(&'static str, String),
}

/// One line of a chart.
pub(super) struct Series {
    pub(super) label: String,
    pub(super) points: Vec<(f64, f64)>,
    /// Draw the points as dots too (sparse series such as validation).
    pub(super) dots: bool,
    /// Drawn thin and pale, behind the others.
    pub(super) faint: bool,
}

pub(super) struct Chart {
    pub(super) name: &'static str,
    pub(super) title: String,
    pub(super) x_label: &'static str,
    pub(super) y_label: String,
    pub(super) series: Vec<Series>,
    /// Force the y axis to start at zero.
    pub(super) from_zero: bool,
    /// The points' y values are log10 of the values (the axis is labelled with the values).
    pub(super) log_y: bool,
}

impl Chart {
    /// The chart on a logarithmic y axis: each point's y as its log10; a point whose value is
    /// not positive cannot be drawn there and is left out, its series' label says how many.
    pub(super) fn log_y(mut self) -> Self {
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

pub(super) type Built = std::result::Result<Chart, Outcome>;

pub(super) fn values(records: &[Value], split: &str, x: &str, y: &str) -> Vec<(f64, f64)> {
    records
        .iter()
        .filter(|r| r["split"] == split)
        .filter_map(|r| Some((r.get(x)?.as_f64()?, r.get(y)?.as_f64()?)))
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .collect()
}

pub(super) fn series(label: &str, points: Vec<(f64, f64)>) -> Series {
    Series {
        label: label.to_string(),
        points,
        dots: false,
        faint: false,
    }
}

pub(super) fn loss_chart(records: &[Value]) -> Built {
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
pub(super) fn metrics_chart(records: &[Value]) -> Built {
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

pub(super) fn throughput_chart(records: &[Value]) -> Built {
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
pub(super) fn device_keys(records: &[Value], suffix: &str) -> Vec<(String, String)> {
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

pub(super) fn system_chart(
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

pub(super) fn memory_chart(records: &[Value]) -> Built {
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

pub(super) fn utilization_chart(records: &[Value]) -> Built {
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
