//! `cargo xtask bench pipeline`: step time, measured bubble and activation memory of a
//! two-stage pipeline under GPipe and 1F1B for several micro-batch counts, against one device
//! accumulating the same micro-batches. Every measurement is its own `train` process; within
//! a round the variants alternate, and medians over rounds are compared side by side.

use std::path::Path;
use std::process::Command;

use crate::bench_policies::built_train;
use crate::common::{
    Result, TempDir, each_flag, json_number, median, positive, positives, run_quietly,
};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    micro: Vec<usize>,
    config: String,
    sets: Vec<String>,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 12,
        rounds: 2,
        micro: vec![1, 2, 4, 8],
        config: "configs/gpt-text.toml".into(),
        sets: Vec::new(),
    };
    each_flag(rest, |flag, value| {
        match flag {
            "--steps" => o.steps = positive(flag, &value()?)?,
            "--rounds" => o.rounds = positive(flag, &value()?)?,
            "--micro" => {
                o.micro = positives(flag, &value()?)?;
            }
            "--config" => o.config = value()?,
            "--set" => o.sets.push(value()?),
            other => {
                return Err(format!(
                    "bench pipeline: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --micro M[,M...], --config FILE, --set KEY=VALUE)"
                ));
            }
        }
        Ok(())
    })?;
    Ok(o)
}

/// The variants at one micro-batch count: a label and the flags that select it.
fn variants(micro: usize) -> Vec<(String, Vec<String>)> {
    let m = micro.to_string();
    let mut out = vec![(
        "single".to_string(),
        vec![
            "--devices".into(),
            "1".into(),
            "--accumulate".into(),
            m.clone(),
        ],
    )];
    for schedule in ["gpipe", "1f1b"] {
        out.push((
            schedule.to_string(),
            vec![
                "--devices".into(),
                "2".into(),
                "--strategy".into(),
                "pipeline".into(),
                "--set".into(),
                "pipeline.stages=2".into(),
                "--set".into(),
                format!("pipeline.microbatches={m}"),
                "--set".into(),
                format!("pipeline.schedule={schedule:?}"),
            ],
        ));
    }
    out
}

/// One run's figures.
#[derive(Clone, Copy)]
struct Figures {
    step_seconds: f64,
    /// The pipeline's idle share, the median over logged windows (none for `single`).
    bubble: Option<f64>,
    ideal: Option<f64>,
    /// Peak RSS minus RSS at the start of training, MiB.
    activation: f64,
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let train = built_train(root)?;
    let temp = TempDir::new("bench-pipeline")?;
    let shown_sets: String = o.sets.iter().map(|s| format!(" --set {s}")).collect();
    println!(
        "bench pipeline: {} for {} steps, {} rounds, micro-batches {:?}, 2 stages{shown_sets}",
        o.config, o.steps, o.rounds, o.micro
    );
    let mut results: Vec<Vec<Vec<Figures>>> = vec![vec![Vec::new(); 3]; o.micro.len()];
    for round in 0..o.rounds {
        for (mi, &micro) in o.micro.iter().enumerate() {
            for (vi, (label, flags)) in variants(micro).iter().enumerate() {
                let dir = temp.path().join(format!("m{micro}-{label}-r{round}"));
                run_quietly(
                    Command::new(&train)
                        .args(["--config", &o.config])
                        .args(["--max-steps", &o.steps.to_string()])
                        .arg("--run-dir")
                        .arg(&dir)
                        .args(["--set", "train.log_every=2"])
                        .args(o.sets.iter().flat_map(|s| ["--set", s.as_str()]))
                        .args(flags)
                        .current_dir(root),
                    &format!("{label} with {micro} micro-batches"),
                )?;
                let f = read_figures(&dir)?;
                println!(
                    "  round {round} M={micro} {label:<6} {:>8.1} ms/step  bubble {}  \
                     activation {:>7.1} MiB",
                    f.step_seconds * 1e3,
                    f.bubble
                        .map_or("   -  ".to_string(), |b| format!("{:5.1} %", b * 100.0)),
                    f.activation
                );
                results[mi][vi].push(f);
            }
        }
    }

    println!();
    println!(
        "| M | schedule | ms/step | step time ÷ single | bubble measured | bubble ideal (K−1)/(M+K−1) | activation MiB (peak − start RSS) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (mi, &micro) in o.micro.iter().enumerate() {
        let med = |vi: usize, f: fn(&Figures) -> Option<f64>| {
            let v: Vec<f64> = results[mi][vi].iter().filter_map(f).collect();
            (!v.is_empty()).then(|| median(&v))
        };
        let base = med(0, |f| Some(f.step_seconds)).unwrap_or(f64::NAN);
        for (vi, (label, _)) in variants(micro).iter().enumerate() {
            let step = med(vi, |f| Some(f.step_seconds)).unwrap_or(f64::NAN);
            let pct =
                |x: Option<f64>| x.map_or("–".to_string(), |x| format!("{:.1} %", x * 100.0));
            println!(
                "| {micro} | {label} | {:.1} | {:.3} | {} | {} | {:.1} |",
                step * 1e3,
                step / base,
                pct(med(vi, |f| f.bubble)),
                pct(med(vi, |f| f.ideal)),
                med(vi, |f| Some(f.activation)).unwrap_or(f64::NAN),
            );
        }
    }
    if let Some(mi) = o.micro.iter().position(|m| *m == 8) {
        let act = |vi: usize| {
            median(
                &results[mi][vi]
                    .iter()
                    .map(|f| f.activation)
                    .collect::<Vec<_>>(),
            )
        };
        println!();
        println!(
            "M = 8: 1f1b activation ÷ gpipe = {:.3} (goal ≤ 0.6)",
            act(2) / act(1)
        );
    }
    Ok(())
}

fn read_figures(dir: &Path) -> Result<Figures> {
    let path = dir.join("summary.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let get = |key: &str| {
        json_number(&text, key).ok_or_else(|| format!("{}: no number for {key:?}", path.display()))
    };
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .map_err(|e| format!("{}: cannot read: {e}", dir.join("metrics.jsonl").display()))?;
    // The first window holds the start-up; the others are compared.
    let windows: Vec<&str> = metrics
        .lines()
        .filter(|l| l.contains("\"split\":\"train\""))
        .skip(1)
        .collect();
    let bubbles: Vec<f64> = windows
        .iter()
        .filter_map(|l| json_number(l, "bubble"))
        .collect();
    let ideal = windows.iter().find_map(|l| json_number(l, "bubble_ideal"));
    Ok(Figures {
        step_seconds: get("step_seconds")?,
        bubble: (!bubbles.is_empty()).then(|| median(&bubbles)),
        ideal,
        activation: get("peak_rss_mib")? - get("start_rss_mib")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_arguments() {
        let o = parse(&["--micro", "1,8", "--steps", "3"]).unwrap();
        assert_eq!(o.micro, vec![1, 8]);
        assert_eq!(o.steps, 3);
        assert!(parse(&["--micro", "0"]).is_err());
        assert!(parse(&["--nope"]).is_err());
        assert_eq!(variants(4).len(), 3);
    }
}
