//! `cargo xtask bench policies`: peak memory and step time of one recipe under each recompute
//! and precision policy. Every measurement is a separate `train` process (peak resident memory
//! is a per-process high-water mark), the variants alternate within each round, and the
//! medians over rounds are compared side by side.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::common::{Result, TempDir, build_release, each_flag, json_number, median, positive};

/// What to measure.
pub struct Options {
    /// Optimizer steps per run.
    steps: usize,
    /// Runs of every variant.
    rounds: usize,
    /// The recipe.
    config: String,
    /// Extra `--set` overrides for every run.
    sets: Vec<String>,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 40,
        rounds: 2,
        config: "configs/gpt-text.toml".into(),
        sets: Vec::new(),
    };
    each_flag(rest, |flag, value| {
        match flag {
            "--steps" => o.steps = positive(flag, &value()?)?,
            "--rounds" => o.rounds = positive(flag, &value()?)?,
            "--config" => o.config = value()?,
            "--set" => o.sets.push(value()?),
            other => {
                return Err(format!(
                    "bench policies: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --config FILE, --set KEY=VALUE)"
                ));
            }
        }
        Ok(())
    })?;
    Ok(o)
}

/// The variants: a label and the flags that select it. The first is the base the others are
/// compared with.
const VARIANTS: [(&str, &[&str]); 5] = [
    ("32, recompute none", &[]),
    ("32, recompute balanced", &["--recompute", "balanced"]),
    ("32, recompute blocks", &["--recompute", "blocks"]),
    ("bf16-mixed, recompute none", &["--precision", "bf16-mixed"]),
    ("16-mixed, recompute none", &["--precision", "16-mixed"]),
];

/// One run's figures from its `summary.json`.
#[derive(Clone, Copy)]
struct Figures {
    step_seconds: f64,
    start_rss: f64,
    peak_rss: f64,
    val_loss: f64,
}

/// Builds the `train` binary (release) and returns its path, so that every measurement runs
/// the same build and nothing is rebuilt in between.
pub fn built_train(root: &Path) -> Result<std::path::PathBuf> {
    let train = build_release(root, &["--bin", "train"], "the train binary")?.join("train");
    if !train.is_file() {
        return Err(format!("{}: the train binary is missing", train.display()));
    }
    Ok(train)
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let train = built_train(root)?;
    let temp = TempDir::new("bench-policies")?;
    let shown_sets: String = o.sets.iter().map(|s| format!(" --set {s}")).collect();
    println!(
        "bench policies: {} for {} steps, {} rounds{shown_sets}",
        o.config, o.steps, o.rounds
    );
    let mut results: Vec<Vec<Figures>> = vec![Vec::new(); VARIANTS.len()];
    for round in 0..o.rounds {
        for (i, (label, flags)) in VARIANTS.iter().enumerate() {
            let dir = temp.path().join(format!("v{i}-r{round}"));
            let mut command = Command::new(&train);
            command
                .args(["--config", &o.config])
                .args(["--max-steps", &o.steps.to_string()])
                .arg("--run-dir")
                .arg(&dir)
                .args(["--set", "train.log_every=5"])
                .args(o.sets.iter().flat_map(|s| ["--set", s.as_str()]))
                .args(*flags)
                .current_dir(root)
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            let out = command
                .output()
                .map_err(|e| format!("cannot run train: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "{label}: train failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let f = read_figures(&dir.join("summary.json"))?;
            println!(
                "  round {round} {label:<28} {:>8.1} ms/step  peak {:>7.1} MiB  start {:>7.1} MiB",
                f.step_seconds * 1e3,
                f.peak_rss,
                f.start_rss
            );
            results[i].push(f);
        }
    }

    let med =
        |i: usize, f: fn(&Figures) -> f64| median(&results[i].iter().map(f).collect::<Vec<_>>());
    println!();
    println!(
        "| variant | ms/step | step time vs base | peak RSS MiB | activation MiB (peak − start) | activation vs base | val loss |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, (label, _)) in VARIANTS.iter().enumerate() {
        let step = med(i, |f| f.step_seconds);
        let act = med(i, |f| f.peak_rss - f.start_rss);
        let base_step = med(0, |f| f.step_seconds);
        let base_act = med(0, |f| f.peak_rss - f.start_rss);
        println!(
            "| {label} | {:.1} | {:+.1} % | {:.1} | {act:.1} | {:+.1} % | {:.4} |",
            step * 1e3,
            (step / base_step - 1.0) * 100.0,
            med(i, |f| f.peak_rss),
            (act / base_act - 1.0) * 100.0,
            med(i, |f| f.val_loss),
        );
    }
    Ok(())
}

fn read_figures(path: &Path) -> Result<Figures> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let get = |key: &str| {
        json_number(&text, key).ok_or_else(|| {
            format!(
                "{}: no number for {key:?} (is this a Linux machine?)",
                path.display()
            )
        })
    };
    Ok(Figures {
        step_seconds: get("step_seconds")?,
        start_rss: get("start_rss_mib")?,
        peak_rss: get("peak_rss_mib")?,
        val_loss: get("val_loss")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects_arguments() {
        let o = parse(&["--steps", "10", "--set", "train.batch_size=4"]).unwrap();
        assert_eq!((o.steps, o.rounds), (10, 2));
        assert_eq!(o.sets, vec!["train.batch_size=4".to_string()]);
        assert!(parse(&["--steps", "0"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
        assert!(parse(&["--rounds"]).is_err());
    }
}
