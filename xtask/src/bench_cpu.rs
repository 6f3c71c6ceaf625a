//! `cargo xtask bench cpu`: one CPU device, the GPT recipe (batch 24) and the MNIST ConvNet,
//! with the per-core schedule (`hardware.cpu_split = "auto"`) and without it (`"off"`), and,
//! given a Python with PyTorch (`--reference PYTHON`), the same GPT recipe in PyTorch
//! (`xtask/reference/gpt_char_torch.py`). Within a round every run alternates; medians over
//! rounds are compared side by side.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::bench_policies::built_train;
use crate::{Result, TempDir, each_flag, json_number, median, positive, run_quietly};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    reference: Option<String>,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 30,
        rounds: 2,
        reference: None,
    };
    each_flag(rest, |flag, value| {
        let number = |raw: &str| positive(flag, raw);
        match flag {
            "--steps" => o.steps = number(&value()?)?,
            "--rounds" => o.rounds = number(&value()?)?,
            "--reference" => o.reference = Some(value()?),
            other => {
                return Err(format!(
                    "bench cpu: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --reference PYTHON)"
                ));
            }
        }
        Ok(())
    })?;
    Ok(o)
}

/// A recipe: its name, `train`'s arguments, the data it needs, and its samples per step.
struct Recipe {
    name: &'static str,
    args: &'static [&'static str],
    data: &'static str,
    fetch: &'static str,
    batch: usize,
}

const RECIPES: [Recipe; 2] = [
    Recipe {
        name: "GPT (configs/gpt-text.toml, batch 24)",
        args: &["--config", "configs/gpt-text.toml", "--batch-size", "24"],
        data: "data/text/moby-dick.txt",
        fetch: "text",
        batch: 24,
    },
    Recipe {
        name: "ConvNet (configs/mnist-convnet.toml, batch 64)",
        args: &["--config", "configs/mnist-convnet.toml"],
        data: "data/mnist",
        fetch: "mnist",
        batch: 64,
    },
];

const SCHEDULES: [&str; 2] = ["auto", "off"];

pub fn run(root: &Path, o: &Options) -> Result<()> {
    for r in &RECIPES {
        if !root.join(r.data).exists() {
            return Err(format!(
                "{} is missing: run `cargo xtask fetch-data {}` first",
                r.data, r.fetch
            ));
        }
    }
    let train = built_train(root)?;
    let temp = TempDir::new("bench-cpu")?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "bench cpu: one device on {cores} cores, {} steps, {} rounds; hardware.cpu_split = \
         \"auto\" (per-core sub-replicas) against \"off\" (one replica){}",
        o.steps,
        o.rounds,
        if o.reference.is_some() {
            ", and PyTorch on the GPT"
        } else {
            ""
        }
    );
    // ms/step per recipe and schedule, and PyTorch's.
    let mut kiln: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); SCHEDULES.len()]; RECIPES.len()];
    let mut torch = Vec::new();
    for round in 0..o.rounds {
        for (i, r) in RECIPES.iter().enumerate() {
            for (j, schedule) in SCHEDULES.iter().enumerate() {
                let dir = temp.path().join(format!("{i}-{schedule}-{round}"));
                let mut args: Vec<String> = r.args.iter().map(|a| a.to_string()).collect();
                args.extend(
                    [
                        "--max-steps",
                        &o.steps.to_string(),
                        "--devices",
                        "1",
                        "--run-dir",
                        &dir.display().to_string(),
                        "--set",
                        &format!("hardware.cpu_split={schedule:?}"),
                        "--set",
                        "train.log_every=10",
                        "--set",
                        "monitor.interval_s=0",
                    ]
                    .map(String::from),
                );
                run_quietly(
                    Command::new(&train).args(&args).current_dir(root),
                    &format!("{} ({schedule})", r.name),
                )?;
                let path = dir.join("summary.json");
                let summary = std::fs::read_to_string(&path)
                    .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
                let step = json_number(&summary, "step_seconds")
                    .ok_or_else(|| format!("{}: no step_seconds", path.display()))?;
                println!(
                    "  round {round} {:<46} {schedule:<4} {:>7.1} ms/step",
                    r.name,
                    step * 1e3
                );
                kiln[i][j].push(step * 1e3);
            }
        }
        if let Some(python) = &o.reference {
            let out = Command::new(python)
                .arg("xtask/reference/gpt_char_torch.py")
                .args(["--data", "data/text/moby-dick.txt", "--batch", "24"])
                .args(["--steps", &o.steps.to_string()])
                .current_dir(root)
                .stderr(Stdio::piped())
                .output()
                .map_err(|e| format!("cannot run {python}: {e}"))?;
            let text = String::from_utf8_lossy(&out.stdout);
            let ms = json_number(&text, "ms_per_step").ok_or_else(|| {
                format!(
                    "the PyTorch reference printed no ms_per_step: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            })?;
            println!(
                "  round {round} {:<46} {:>12.1} ms/step",
                "PyTorch, the GPT recipe", ms
            );
            torch.push(ms);
        }
    }
    println!();
    println!(
        "| recipe | one device | ms/step | samples/s | speed ÷ cpu_split off | speed ÷ PyTorch |"
    );
    println!("|---|---|---|---|---|---|");
    for (i, r) in RECIPES.iter().enumerate() {
        let off = median(&kiln[i][1]);
        for (j, schedule) in SCHEDULES.iter().enumerate() {
            let ms = median(&kiln[i][j]);
            let vs_torch = if i == 0 && !torch.is_empty() {
                format!("{:.2}", median(&torch) / ms)
            } else {
                "–".to_string()
            };
            println!(
                "| {} | cpu_split {schedule} | {ms:.1} | {:.1} | {:.2} | {vs_torch} |",
                r.name,
                r.batch as f64 * 1e3 / ms,
                off / ms
            );
        }
    }
    if !torch.is_empty() {
        let ms = median(&torch);
        println!(
            "| GPT in PyTorch (xtask/reference/gpt_char_torch.py) | {cores} threads | {ms:.1} | \
             {:.1} | – | 1.00 |",
            24.0 * 1e3 / ms
        );
    }
    Ok(())
}
