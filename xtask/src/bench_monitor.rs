//! `cargo xtask bench monitor`: the same run with monitoring on and off, alternated.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::common::{Result, TempDir, build_release, json_number, median};

/// `bench monitor`: the same run with monitoring on and off.
#[derive(Debug, PartialEq)]
pub(crate) struct MonitorBench {
    /// Steps per run.
    pub(crate) steps: usize,
    /// Rounds of the two runs.
    pub(crate) rounds: usize,
    /// Devices of each run.
    pub(crate) devices: usize,
    /// The recipe.
    pub(crate) config: PathBuf,
}

impl MonitorBench {
    pub(crate) fn parse(rest: &[&str]) -> Result<Self> {
        let mut b = MonitorBench {
            steps: 60,
            rounds: 5,
            devices: 2,
            config: PathBuf::from("configs/gpt-text.toml"),
        };
        let mut words = rest.iter();
        while let Some(flag) = words.next() {
            let value = words
                .next()
                .ok_or_else(|| format!("bench monitor: {flag} needs a value"))?;
            let count = || {
                value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        format!("bench monitor: {flag} {value:?}: expected a count >= 1")
                    })
            };
            match *flag {
                "--steps" => b.steps = count()?,
                "--rounds" => b.rounds = count()?,
                "--devices" => b.devices = count()?,
                "--config" => b.config = PathBuf::from(value),
                _ => return Err(format!("bench monitor: unknown flag {flag:?}")),
            }
        }
        Ok(b)
    }
}

/// Trains the same run with monitoring on (the defaults: a sample every second, all three
/// sinks) and off (`monitor.interval_s = 0`, no sinks), alternating which goes first, and
/// compares the throughput each run reports in its `summary.json`.
pub(crate) fn run(root: &Path, b: &MonitorBench) -> Result<()> {
    let train = build_release(root, &["-p", "kiln", "--bin", "train"], "train")?.join("train");
    let temp = TempDir::new("bench-monitor")?;
    let arms: [(&str, &[&str]); 2] = [
        ("on", &[]),
        (
            "off",
            &["--set", "monitor.interval_s=0", "--set", "monitor.sinks=[]"],
        ),
    ];
    println!(
        "bench monitor: {} steps × {} devices of {}, {} rounds after one warm-up round",
        b.steps,
        b.devices,
        b.config.display(),
        b.rounds
    );
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut ratios = Vec::new();
    for round in 0..=b.rounds {
        let mut this = [0.0; 2];
        // Alternate the order so that a drift of the machine's speed favours neither arm.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for arm in order {
            let (name, flags) = arms[arm];
            let dir = temp.path().join(format!("{name}-{round}"));
            let out = Command::new(&train)
                .arg("--config")
                .arg(root.join(&b.config))
                .args(["--max-steps", &b.steps.to_string()])
                .args(["--devices", &b.devices.to_string()])
                .arg("--run-dir")
                .arg(&dir)
                .args(flags)
                .current_dir(root)
                .stdout(Stdio::null())
                .output()
                .map_err(|e| format!("cannot run {}: {e}", train.display()))?;
            if !out.status.success() {
                return Err(format!(
                    "train ({name}) failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let summary = dir.join("summary.json");
            let text =
                fs::read_to_string(&summary).map_err(|e| format!("{}: {e}", summary.display()))?;
            this[arm] = json_number(&text, "samples_per_sec")
                .ok_or_else(|| format!("{}: no samples_per_sec", summary.display()))?;
        }
        let label = if round == 0 { "warm-up" } else { "round" };
        println!(
            "{label:>7} {round}: on {:.2} samples/s, off {:.2} samples/s, on ÷ off {:.4}",
            this[0],
            this[1],
            this[0] / this[1]
        );
        if round > 0 {
            rates[0].push(this[0]);
            rates[1].push(this[1]);
            ratios.push(this[0] / this[1]);
        }
    }
    println!(
        "median: on {:.2} samples/s, off {:.2} samples/s; median of the rounds' on ÷ off {:.4} \
         (monitoring cost {:+.2} %)",
        median(&rates[0]),
        median(&rates[1]),
        median(&ratios),
        100.0 * (1.0 - median(&ratios))
    );
    Ok(())
}
