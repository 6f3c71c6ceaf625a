//! `cargo xtask bench zero`: step time and bytes per rank of `ddp`, `zero1`, `zero2` and `zero3`
//! on one recipe, at each device count asked for. Every measurement is its own `train` process;
//! within a round the strategies alternate, and medians over rounds are compared with `ddp` at
//! the same device count, side by side.

use std::path::Path;
use std::process::Command;

use crate::bench_policies::built_train;
use crate::common::{
    Result, TempDir, each_flag, json_array, json_number, median, positive, positives, run_quietly,
};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    devices: Vec<usize>,
    config: String,
    sets: Vec<String>,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 20,
        rounds: 2,
        devices: vec![2, 4],
        config: "configs/gpt-text.toml".into(),
        sets: Vec::new(),
    };
    each_flag(rest, |flag, value| {
        match flag {
            "--steps" => o.steps = positive(flag, &value()?)?,
            "--rounds" => o.rounds = positive(flag, &value()?)?,
            "--devices" => {
                o.devices = positives(flag, &value()?)?;
            }
            "--config" => o.config = value()?,
            "--set" => o.sets.push(value()?),
            other => {
                return Err(format!(
                    "bench zero: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --devices N[,N...], --config FILE, --set KEY=VALUE)"
                ));
            }
        }
        Ok(())
    })?;
    Ok(o)
}

const STRATEGIES: [&str; 4] = ["ddp", "zero1", "zero2", "zero3"];

/// One run's figures from its `summary.json` (rank 0's bytes).
#[derive(Clone, Copy)]
struct Figures {
    step_seconds: f64,
    params: f64,
    grads: f64,
    optim: f64,
    peak_rss: f64,
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let train = built_train(root)?;
    let temp = TempDir::new("bench-zero")?;
    let shown_sets: String = o.sets.iter().map(|s| format!(" --set {s}")).collect();
    println!(
        "bench zero: {} for {} steps, {} rounds, devices {:?}{shown_sets}",
        o.config, o.steps, o.rounds, o.devices
    );
    let mut results: Vec<Vec<Vec<Figures>>> =
        vec![vec![Vec::new(); STRATEGIES.len()]; o.devices.len()];
    for round in 0..o.rounds {
        for (d, devices) in o.devices.iter().enumerate() {
            for (i, strategy) in STRATEGIES.iter().enumerate() {
                let dir = temp.path().join(format!("n{devices}-{strategy}-r{round}"));
                run_quietly(
                    Command::new(&train)
                        .args(["--config", &o.config])
                        .args(["--max-steps", &o.steps.to_string()])
                        .args(["--devices", &devices.to_string()])
                        .args(["--strategy", strategy])
                        .arg("--run-dir")
                        .arg(&dir)
                        .args(["--set", "train.log_every=5"])
                        .args(o.sets.iter().flat_map(|s| ["--set", s.as_str()]))
                        .current_dir(root),
                    &format!("{strategy} on {devices} devices"),
                )?;
                let f = read_figures(&dir.join("summary.json"))?;
                println!(
                    "  round {round} N={devices} {strategy:<6} {:>8.1} ms/step  params {:>6.2} \
                     MiB  grads {:>6.2} MiB  optim {:>6.2} MiB  peak RSS {:>7.1} MiB",
                    f.step_seconds * 1e3,
                    mib(f.params),
                    mib(f.grads),
                    mib(f.optim),
                    f.peak_rss
                );
                results[d][i].push(f);
            }
        }
    }

    println!();
    println!(
        "| N | strategy | ms/step | step time ÷ ddp | params MiB/rank | grads MiB/rank | \
         optimizer MiB/rank | peak RSS MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (d, devices) in o.devices.iter().enumerate() {
        let med = |i: usize, f: fn(&Figures) -> f64| {
            median(&results[d][i].iter().map(f).collect::<Vec<_>>())
        };
        let base = med(0, |f| f.step_seconds);
        for (i, strategy) in STRATEGIES.iter().enumerate() {
            let step = med(i, |f| f.step_seconds);
            println!(
                "| {devices} | {strategy} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} |",
                step * 1e3,
                step / base,
                mib(med(i, |f| f.params)),
                mib(med(i, |f| f.grads)),
                mib(med(i, |f| f.optim)),
                med(i, |f| f.peak_rss),
            );
        }
    }
    if let Some(d) = o.devices.iter().position(|n| *n == 2) {
        let med = |i: usize| {
            median(
                &results[d][i]
                    .iter()
                    .map(|f| f.step_seconds)
                    .collect::<Vec<_>>(),
            )
        };
        let (ddp, zero2, zero3) = (med(0), med(2), med(3));
        println!();
        println!(
            "N = 2: zero2 ÷ ddp = {:.3} (goal ≤ 1.15), zero3 ÷ ddp = {:.3} (goal ≤ 1.5)",
            zero2 / ddp,
            zero3 / ddp
        );
    }
    Ok(())
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

/// The first number of the JSON array under `key`.
fn first_of_array(text: &str, key: &str) -> Option<f64> {
    json_array(text, key)?.first().copied()
}

fn read_figures(path: &Path) -> Result<Figures> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let missing = |key: &str| format!("{}: no number for {key:?}", path.display());
    let array = |key: &str| first_of_array(&text, key).ok_or_else(|| missing(key));
    Ok(Figures {
        step_seconds: json_number(&text, "step_seconds").ok_or_else(|| missing("step_seconds"))?,
        params: array("param_bytes_per_rank")?,
        grads: array("grad_bytes_per_rank")?,
        optim: array("optim_bytes_per_rank")?,
        peak_rss: json_number(&text, "peak_rss_mib").ok_or_else(|| missing("peak_rss_mib"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_arguments_and_reads_arrays() {
        let o = parse(&["--devices", "2,4,8", "--steps", "3"]).unwrap();
        assert_eq!(o.devices, vec![2, 4, 8]);
        assert_eq!(o.steps, 3);
        assert!(parse(&["--devices", "0"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
        let text = "{\n  \"grad_bytes_per_rank\": [\n    1234,\n    99\n  ]\n}";
        assert_eq!(first_of_array(text, "grad_bytes_per_rank"), Some(1234.0));
        assert_eq!(first_of_array(text, "nothing"), None);
    }
}
