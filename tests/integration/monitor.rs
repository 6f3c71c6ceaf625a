//! Monitoring: the three metric sinks agree value for value, `train plot` draws PNGs of the
//! requested size, and a machine without NVML says so once and trains on.

use std::path::Path;

use kiln::builtin::train;
use kiln::run::RunOptions;
use serde_json::Value;

use crate::common::{assert_one_line_error, small_config, temp_dir, train_bin};
use crate::gpt::{gpt_config, text_file};

/// Whether two readings of one written number agree: serde_json's default float parser (no
/// `float_roundtrip`) may land one ULP away from the number the sinks wrote.
fn same_f64(a: f64, b: f64) -> bool {
    (a - b).abs() <= 2.0 * f64::EPSILON * a.abs().max(b.abs())
}

/// Every `(tag, step, value)` a record should put in a TensorBoard event file, in order.
fn expected_scalars(records: &[Value]) -> Vec<(String, i64, f32)> {
    let mut out = Vec::new();
    for r in records {
        let step = r["step"].as_i64().unwrap();
        let split = r["split"].as_str().unwrap();
        for (key, v) in r.as_object().unwrap() {
            if matches!(key.as_str(), "step" | "epoch" | "split") {
                continue;
            }
            if let Some(x) = v.as_f64() {
                out.push((format!("{split}/{key}"), step, x as f32));
            }
        }
    }
    out
}

/// Checks that every row of a CSV file holds exactly its JSONL record's values.
fn assert_csv_matches(path: &Path, records: &[&Value]) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), records.len(), "{}", path.display());
    for (row, record) in rows.iter().zip(records) {
        assert_eq!(row.len(), header.len());
        for (column, cell) in header.iter().zip(row) {
            let value = record.get(*column).unwrap_or(&Value::Null);
            match value {
                Value::Null => assert!(cell.is_empty(), "{column}: {cell:?} for null"),
                Value::String(s) => assert_eq!(cell, s, "{column}"),
                v => assert!(
                    same_f64(cell.parse::<f64>().unwrap(), v.as_f64().unwrap()),
                    "{} {column} at step {}: {cell} vs {v}",
                    path.display(),
                    record["step"]
                ),
            }
        }
        // Every value of the record has a column (system.csv holds only the system split).
        for key in record.as_object().unwrap().keys() {
            if key == "split" && record[key] == "system" {
                continue;
            }
            assert!(
                header.contains(&key.as_str()),
                "{} lacks {key}",
                path.display()
            );
        }
    }
}

#[test]
fn gpt_ddp_sinks_agree_on_every_scalar() {
    let dir = temp_dir("monitor-sinks");
    let text = text_file(&dir);
    let config = gpt_config(
        &dir.join("run"),
        &text,
        &[
            "hardware.devices=2",
            "train.max_steps=30",
            "train.log_every=5",
            "train.val_every=10",
            "monitor.interval_s=0.05",
            "monitor.peak_tflops=0.05",
            "monitor.sinks=[\"jsonl\", \"csv\", \"tensorboard\"]",
        ],
    );
    let run = train(&config, &RunOptions::default()).unwrap();
    let records = kiln::metrics::read_metrics(&run.dir.join("metrics.jsonl")).unwrap();
    let split = |s: &str| -> Vec<&Value> { records.iter().filter(|r| r["split"] == s).collect() };
    let (trains, vals, system) = (split("train"), split("val"), split("system"));
    assert_eq!(trains.len(), 6);
    assert_eq!(vals.len(), 3);
    assert!(!system.is_empty(), "no system samples");
    assert_eq!(trains.len() + vals.len() + system.len(), records.len());

    // The monitoring columns are there and hang together.
    for r in &trains {
        let rate = r["samples_per_sec"].as_f64().unwrap();
        let per_device = r["samples_per_sec_per_device"].as_f64().unwrap();
        assert!(same_f64(per_device, rate / 2.0));
        assert!(same_f64(r["tokens_per_sec"].as_f64().unwrap(), rate * 16.0));
        let mfu = r["mfu"].as_f64().unwrap();
        assert!(mfu > 0.0, "{r}");
        let pct: f64 = ["pct_data", "pct_compute", "pct_sync", "pct_optim"]
            .iter()
            .map(|k| r[k].as_f64().unwrap())
            .sum();
        assert!((pct - 100.0).abs() < 1e-9, "{pct}");
        assert!(r["samples_per_sec_ema"].as_f64().unwrap() > 0.0);
    }
    let last = system.last().unwrap();
    for key in [
        "time",
        "rss_mib",
        "cpu_util",
        "dev0_cpu_util",
        "dev1_cpu_util",
    ] {
        assert!(
            last[key].as_f64().is_some(),
            "system record lacks {key}: {last}"
        );
    }
    assert!(system.iter().all(|r| r["step"].as_u64().unwrap() <= 30));

    // CSV: metrics.csv for training and validation, system.csv for the samples.
    let logged: Vec<&Value> = records.iter().filter(|r| r["split"] != "system").collect();
    assert_csv_matches(&run.dir.join("metrics.csv"), &logged);
    assert_csv_matches(&run.dir.join("system.csv"), &system);

    // TensorBoard: the same scalars, in the same order, each the f32 of its JSON value.
    let events: Vec<_> = std::fs::read_dir(run.dir.join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(events.len(), 1);
    let read: Vec<(String, i64, f32)> = kiln::sinks::read_scalars(&events[0])
        .unwrap()
        .into_iter()
        .map(|s| (s.tag, s.step, s.value))
        .collect();
    let expected = expected_scalars(&records);
    assert_eq!(read.len(), expected.len());
    for (got, want) in read.iter().zip(&expected) {
        assert_eq!((&got.0, got.1), (&want.0, want.1));
        // The same f32, or (when the parsed f64 was a ULP off at an f32 rounding boundary)
        // its neighbour.
        let (a, b) = (got.2, want.2);
        assert!(
            a == b || (a - b).abs() <= f32::EPSILON * b.abs(),
            "{got:?} vs {want:?}"
        );
    }
    for tag in [
        "train/loss",
        "val/loss",
        "train/mfu",
        "train/lr",
        "system/dev1_cpu_util",
    ] {
        assert!(read.iter().any(|s| s.0 == tag), "no {tag}");
    }
}

/// Width and height of a PNG, decoding every pixel (so a truncated file fails), and whether
/// it holds more than one colour.
fn decode_png(path: &Path) -> (u32, u32, bool) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let bytes = &buf[..info.buffer_size()];
    let px = info.color_type.samples();
    let first = &bytes[..px];
    let varied = bytes.chunks(px).any(|p| p != first);
    (info.width, info.height, varied)
}

#[test]
fn train_plot_draws_pngs_of_the_requested_size() {
    let dir = temp_dir("monitor-plot");
    let run_dir = dir.join("run");
    let config = small_config(
        &run_dir,
        &[
            "hardware.devices=2",
            "train.max_steps=40",
            "train.val_every=10",
            "monitor.interval_s=0.05",
        ],
    );
    train(&config, &RunOptions::default()).unwrap();
    let out = train_bin(
        &dir,
        &[
            "plot", "run", "--out", "charts", "--width", "640", "--height", "360",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in ["loss", "throughput", "memory", "utilization"] {
        let path = dir.join("charts").join(format!("{name}.png"));
        assert!(
            stdout.contains(&format!(
                "wrote {}",
                Path::new("charts").join(format!("{name}.png")).display()
            )),
            "{stdout}"
        );
        let (w, h, varied) = decode_png(&path);
        assert_eq!((w, h), (640, 360), "{name}");
        assert!(varied, "{name}.png is one flat colour");
    }

    // Without system samples the system charts are skipped, with the reason.
    let quiet = dir.join("quiet");
    let config = small_config(&quiet, &["monitor.interval_s=0", "train.max_steps=3"]);
    train(&config, &RunOptions::default()).unwrap();
    let out = train_bin(&dir, &["plot", "quiet"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("skipped memory.png: no system samples"),
        "{stdout}"
    );
    let (w, h, _) = decode_png(&quiet.join("plots").join("loss.png"));
    assert_eq!((w, h), (1000, 600));

    let out = train_bin(&dir, &["plot", "no-such-run"]);
    assert_one_line_error(&out, &["no-such-run", "metrics.jsonl"]);
    let out = train_bin(&dir, &["plot", "run", "--width", "10"]);
    assert_one_line_error(&out, &["--width 10"]);
}

#[test]
fn a_machine_without_nvml_says_so_once_when_asked_and_trains_on() {
    let dir = temp_dir("monitor-nvml");
    let out = train_bin(
        &dir,
        &[
            "--max-steps",
            "4",
            "--set",
            "monitor.interval_s=0.05",
            "--set",
            "monitor.gpu=true",
            "--name",
            "n",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let notices: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("monitor: NVML"))
        .collect();
    assert_eq!(notices.len(), 1, "{stdout}");
    // This machine and CI have no NVIDIA driver; one that has it names the GPUs instead.
    if notices[0].contains("unavailable") {
        assert!(
            notices[0].ends_with("GPU utilization/power not sampled"),
            "{}",
            notices[0]
        );
    }
    assert!(dir.join("runs/n/summary.json").is_file());
    // Plain log lines (stdout is not a terminal) carry the ETA and the devices' line.
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("step") && l.contains("eta")),
        "{stdout}"
    );
}

#[test]
fn the_train_program_counts_its_heap_below_its_resident_memory() {
    let dir = temp_dir("heap");
    let run = dir.join("run");
    let out = train_bin(
        &dir,
        &[
            "--max-steps",
            "3",
            "--set",
            &format!("run.dir={:?}", run.display().to_string()),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    let heap = summary["peak_heap_mib"]
        .as_f64()
        .expect("the train binary counts its heap");
    assert!(heap > 0.5, "{heap} MiB");
    if let Some(rss) = summary["peak_rss_mib"].as_f64() {
        assert!(heap < rss, "heap {heap} MiB, resident {rss} MiB");
        // The peak before training (the planner's probe of the run's plan, the data read) is
        // kept apart from the training's.
        let startup = summary["startup_peak_rss_mib"]
            .as_f64()
            .expect("a startup peak beside the training's");
        assert!(startup > 0.0, "{summary}");
    }
    // A program without kiln's allocator (this test binary) has no figure.
    assert_eq!(kiln::heap::peak(), None);
}
