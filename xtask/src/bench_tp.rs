//! `cargo xtask bench tp`: tensor parallelism against data parallelism at the same global
//! batch on one recipe — `ddp` on N devices of batch B against tensor-parallel groups of T
//! (`--mesh tp=T`, N / T groups of batch B · T) — each its own `train` process, alternated
//! within a round, medians over rounds: step time, parameter bytes per rank, and the floats
//! each group all-reduced per step (the log's) against the ones predicted (the summary's).

use std::path::Path;
use std::process::Command;

use crate::bench_policies::built_train;
use crate::common::{
    Result, TempDir, each_flag, json_array, json_number, median, positive, run_quietly,
};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    devices: usize,
    tp: usize,
    config: String,
    sets: Vec<String>,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 30,
        rounds: 3,
        devices: 2,
        tp: 2,
        config: "configs/gpt-text.toml".into(),
        sets: Vec::new(),
    };
    each_flag(rest, |flag, value| {
        match flag {
            "--steps" => o.steps = positive(flag, &value()?)?,
            "--rounds" => o.rounds = positive(flag, &value()?)?,
            "--devices" => o.devices = positive(flag, &value()?)?,
            "--tp" => o.tp = positive(flag, &value()?)?,
            "--config" => o.config = value()?,
            "--set" => o.sets.push(value()?),
            other => {
                return Err(format!(
                    "bench tp: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --devices N, --tp T, --config FILE, --set KEY=VALUE)"
                ));
            }
        }
        Ok(())
    })?;
    if o.tp < 2 || !o.devices.is_multiple_of(o.tp) {
        return Err(format!(
            "bench tp: --tp {} must be at least 2 and divide --devices {}",
            o.tp, o.devices
        ));
    }
    Ok(o)
}

/// One run's figures.
#[derive(Clone, Copy, Default)]
struct Figures {
    step_seconds: f64,
    params: f64,
    peak_rss: f64,
    /// Measured and predicted floats per step, and the seconds in the group's all-reduces
    /// (tensor-parallel runs only).
    floats: f64,
    predicted: f64,
    tp_seconds: f64,
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let train = built_train(root)?;
    let temp = TempDir::new("bench-tp")?;
    let batch = batch_of(root, o)?;
    let shown_sets: String = o.sets.iter().map(|s| format!(" --set {s}")).collect();
    println!(
        "bench tp: {} for {} steps, {} rounds, {} devices: ddp at batch {batch} per device \
         against tp = {} at batch {} per group{shown_sets}",
        o.config,
        o.steps,
        o.rounds,
        o.devices,
        o.tp,
        batch * o.tp
    );
    let runs = [
        ("ddp", batch, String::new()),
        ("tp", batch * o.tp, format!("tp={}", o.tp)),
    ];
    let mut results: Vec<Vec<Figures>> = vec![Vec::new(); runs.len()];
    for round in 0..o.rounds {
        for (i, (name, b, mesh)) in runs.iter().enumerate() {
            let dir = temp.path().join(format!("{name}-r{round}"));
            let mut c = Command::new(&train);
            c.args(["--config", &o.config])
                .args(["--max-steps", &o.steps.to_string()])
                .args(["--devices", &o.devices.to_string()])
                .args(["--batch-size", &b.to_string()])
                .arg("--run-dir")
                .arg(&dir)
                .args([
                    "--set",
                    "train.log_every=5",
                    "--set",
                    "hardware.cpu_split=\"off\"",
                ])
                .args(o.sets.iter().flat_map(|s| ["--set", s.as_str()]))
                .current_dir(root);
            if mesh.is_empty() {
                c.args(["--strategy", "ddp"]);
            } else {
                c.args(["--mesh", mesh]);
            }
            run_quietly(&mut c, &format!("{name} on {} devices", o.devices))?;
            let f = read_figures(&dir)?;
            println!(
                "  round {round} {name:<3} {:>8.1} ms/step  params {:>6.2} MiB/rank  tp floats \
                 {:>10.0}/step (predicted {:>10.0}), {:>6.1} ms/step in the group's all-reduces",
                f.step_seconds * 1e3,
                f.params / (1024.0 * 1024.0),
                f.floats,
                f.predicted,
                f.tp_seconds * 1e3
            );
            results[i].push(f);
        }
    }
    let med =
        |i: usize, f: fn(&Figures) -> f64| median(&results[i].iter().map(f).collect::<Vec<_>>());
    println!();
    println!(
        "| run | ms/step | ÷ ddp | params MiB/rank | peak RSS MiB | tp floats/step measured | \
         predicted | ms/step in tp all-reduces |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let base = med(0, |f| f.step_seconds);
    for (i, (_, b, mesh)) in runs.iter().enumerate() {
        let words = if mesh.is_empty() {
            format!("ddp, {} × batch {b}", o.devices)
        } else {
            format!("tp = {}, {} group(s) × batch {b}", o.tp, o.devices / o.tp)
        };
        println!(
            "| {words} | {:.1} | {:.3} | {:.3} | {:.1} | {:.0} | {:.0} | {:.1} |",
            med(i, |f| f.step_seconds) * 1e3,
            med(i, |f| f.step_seconds) / base,
            med(i, |f| f.params) / (1024.0 * 1024.0),
            med(i, |f| f.peak_rss),
            med(i, |f| f.floats),
            med(i, |f| f.predicted),
            med(i, |f| f.tp_seconds) * 1e3,
        );
    }
    Ok(())
}

/// The batch per device the recipe's config (or a `--set train.batch_size`) gives.
fn batch_of(root: &Path, o: &Options) -> Result<usize> {
    let from_sets = o
        .sets
        .iter()
        .rev()
        .find_map(|s| s.strip_prefix("train.batch_size="))
        .map(str::to_string);
    let raw = match from_sets {
        Some(b) => b,
        None => {
            let path = root.join(&o.config);
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
            text.lines()
                .map(str::trim)
                .find_map(|l| l.strip_prefix("batch_size").map(|r| r.trim_start()))
                .and_then(|r| r.strip_prefix('='))
                .map(|r| r.trim().to_string())
                .ok_or_else(|| format!("{}: no train.batch_size", path.display()))?
        }
    };
    positive("train.batch_size", &raw)
}

fn read_figures(dir: &Path) -> Result<Figures> {
    let path = dir.join("summary.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let missing = |key: &str| format!("{}: no number for {key:?}", path.display());
    let number = |key: &str| json_number(&text, key).ok_or_else(|| missing(key));
    let mut f = Figures {
        step_seconds: number("step_seconds")?,
        params: json_array(&text, "param_bytes_per_rank")
            .and_then(|a| a.first().copied())
            .ok_or_else(|| missing("param_bytes_per_rank"))?,
        peak_rss: number("peak_rss_mib")?,
        ..Figures::default()
    };
    if let Some(predicted) = json_number(&text, "tp_floats_predicted") {
        f.predicted = predicted;
        // The last training record's: the steps since the line before it.
        let log = dir.join("metrics.jsonl");
        let lines = std::fs::read_to_string(&log)
            .map_err(|e| format!("{}: cannot read: {e}", log.display()))?;
        let last = lines
            .lines()
            .rfind(|l| l.contains("\"tp_floats_per_step\""))
            .ok_or_else(|| format!("{}: no tp_floats_per_step", log.display()))?;
        f.floats = json_number(last, "tp_floats_per_step").unwrap_or(0.0);
        f.tp_seconds = json_number(last, "tp_seconds_per_step").unwrap_or(0.0);
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_arguments() {
        let o = parse(&["--devices", "4", "--tp", "2", "--steps", "3"]).unwrap();
        assert_eq!((o.devices, o.tp, o.steps), (4, 2, 3));
        assert!(parse(&["--devices", "3", "--tp", "2"]).is_err());
        assert!(parse(&["--tp", "1"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
    }
}
