//! `cargo xtask bench links`: the GPT recipe across two machines on one box — two network
//! namespaces joined by a veth link (`scripts/two-hosts`), one `mpirun` rank in each, one
//! device per rank — at each link rate asked for (unshaped, or shaped with a token bucket), per
//! strategy (`diloco` in one process as two islands of one device, as across the hosts),
//! against the same strategy in one process with two devices: step time, the share
//! of the step spent in synchronisation (`pct_sync`), and the bytes the link carried per step.
//! With `--rounds N` the whole sequence runs N times, in-process and across the hosts in turn,
//! and the table gives each figure's median (this box's step times drift by ±15 % over
//! minutes: ratios of runs taken far apart are noise). Needs root, iproute2 and OpenMPI; builds kiln with the `mpi` feature.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::common::{Result, TempDir, each_flag, json_number, median, positive, run_quietly};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    rates: Vec<String>,
    strategies: Vec<String>,
    config: String,
    sets: Vec<String>,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 20,
        rounds: 1,
        rates: vec!["unshaped".into(), "10gbit".into(), "1gbit".into()],
        strategies: vec![
            "ddp".into(),
            "zero2".into(),
            "zero3".into(),
            "diloco".into(),
        ],
        config: "configs/gpt-text.toml".into(),
        sets: Vec::new(),
    };
    each_flag(rest, |flag, value| {
        let list = |raw: String| raw.split(',').map(|s| s.trim().to_string()).collect();
        match flag {
            "--steps" => o.steps = positive(flag, &value()?)?,
            "--rounds" => o.rounds = positive(flag, &value()?)?,
            "--rates" => o.rates = list(value()?),
            "--strategies" => o.strategies = list(value()?),
            "--config" => o.config = value()?,
            "--set" => o.sets.push(value()?),
            other => {
                return Err(format!(
                    "bench links: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --rates unshaped,10gbit,1gbit, --strategies ddp,zero2,zero3,diloco, --config FILE, \
                     --set KEY=VALUE)"
                ));
            }
        }
        Ok(())
    })?;
    Ok(o)
}

/// One run's figures.
#[derive(Clone, Copy)]
struct Figures {
    step_ms: f64,
    pct_sync: f64,
    /// Bytes both ends of the link sent, per step (start-up included); none in one process.
    mb_per_step: Option<f64>,
}

/// Takes the two-host test bed down when dropped (also on an error).
struct TestBed<'a> {
    script: &'a Path,
}

impl TestBed<'_> {
    fn run(&self, args: &[&str]) -> Result<std::process::Output> {
        Command::new(self.script)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.script.display()))
    }

    /// Bytes the link's two ends have sent so far.
    fn sent(&self) -> Result<u64> {
        let mut total = 0;
        for (ns, dev) in [("kiln-a", "kiln-va"), ("kiln-b", "kiln-vb")] {
            let out = Command::new("ip")
                .args(["netns", "exec", ns, "cat"])
                .arg(format!("/sys/class/net/{dev}/statistics/tx_bytes"))
                .output()
                .map_err(|e| format!("cannot read {dev}'s counters: {e}"))?;
            total += String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("{dev}: no tx_bytes counter"))?;
        }
        Ok(total)
    }
}

impl Drop for TestBed<'_> {
    fn drop(&mut self) {
        let _ = self.run(&["down"]);
    }
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| format!("cannot run id: {e}"))?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Err("bench links makes network namespaces: run it as root".into());
    }
    let train = crate::bench_mpi::built_mpi_train(root, false)?;
    let script = root.join("scripts/two-hosts");
    let temp = TempDir::new("bench-links")?;
    println!(
        "bench links: {} for {} steps, one device per rank; links {:?}; strategies {:?}",
        o.config, o.steps, o.rates, o.strategies
    );
    // runs[link][strategy]: every round's figures; link 0 is one process with two devices.
    let links: Vec<String> = std::iter::once("in-process, 2 devices".to_string())
        .chain(o.rates.iter().map(|r| format!("two hosts, {r}")))
        .collect();
    let mut runs = vec![vec![Vec::<Figures>::new(); o.strategies.len()]; links.len()];
    for round in 1..=o.rounds {
        for (s, strategy) in o.strategies.iter().enumerate() {
            let dir = temp.path().join(format!("local-{strategy}-{round}"));
            run_quietly(
                Command::new(&train)
                    .args(train_args(o, strategy, &dir, "2"))
                    .current_dir(root),
                strategy,
            )?;
            let f = figures(&dir, None)?;
            println!(
                "  round {round}  in-process, 2 devices   {strategy:<6} {:>7.1} ms/step  sync \
                 {:>4.1}%",
                f.step_ms, f.pct_sync
            );
            runs[0][s].push(f);
        }
        for (r, rate) in o.rates.iter().enumerate() {
            let bed = TestBed { script: &script };
            let figs = over_link(
                &bed,
                &train,
                o,
                rate,
                &temp.path().join(format!("{rate}-{round}")),
            )?;
            for (s, f) in figs.into_iter().enumerate() {
                println!(
                    "  round {round}  two hosts, {rate:<12} {:<6} {:>7.1} ms/step  sync \
                     {:>4.1}%  {:>6.2} MB on the link per step",
                    o.strategies[s],
                    f.step_ms,
                    f.pct_sync,
                    f.mb_per_step.unwrap_or(0.0)
                );
                runs[r + 1][s].push(f);
            }
        }
    }
    print_table(o, &links, &runs);
    Ok(())
}

/// `train`'s arguments for one run of `strategy` on `devices` devices into `dir`.
fn train_args(o: &Options, strategy: &str, dir: &Path, devices: &str) -> Vec<String> {
    let mut a: Vec<String> = [
        "--config",
        &o.config,
        "--max-steps",
        &o.steps.to_string(),
        "--devices",
        devices,
        "--strategy",
        strategy,
        "--run-dir",
        &dir.display().to_string(),
        "--set",
        "train.log_every=5",
        "--set",
        "monitor.interval_s=0",
    ]
    .map(String::from)
    .to_vec();
    if strategy == "diloco" && devices == "2" {
        // The same two islands as across the two hosts (one per process there).
        a.extend(["--set".to_string(), "diloco.islands=2".to_string()]);
    }
    for s in &o.sets {
        a.extend(["--set".to_string(), s.clone()]);
    }
    a
}

/// Every strategy's figures across the two hosts with the link at `rate`: the bed brought up
/// (shaped unless `unshaped`), one `mpirun` per strategy, the bytes the link carried counted.
fn over_link(
    bed: &TestBed<'_>,
    train: &Path,
    o: &Options,
    rate: &str,
    dirs: &Path,
) -> Result<Vec<Figures>> {
    let _ = bed.run(&["down"]);
    let mut up = vec!["up"];
    if rate != "unshaped" {
        up.push(rate);
    }
    let out = bed.run(&up)?;
    if !out.status.success() {
        return Err(format!(
            "two-hosts up {rate}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let mut figs = Vec::with_capacity(o.strategies.len());
    for strategy in &o.strategies {
        let dir = dirs.join(strategy);
        let before = bed.sent()?;
        let mut a = vec!["mpirun".to_string(), train.display().to_string()];
        a.extend(train_args(o, strategy, &dir, "1"));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let out = bed.run(&a)?;
        if !out.status.success() {
            return Err(format!(
                "{strategy} over a {rate} link: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let bytes = bed.sent()? - before;
        figs.push(figures(&dir, Some(bytes as f64 / 1e6 / o.steps as f64))?);
    }
    Ok(figs)
}

/// The table of every link and strategy: medians over the rounds, ranges, the ratio to the
/// in-process run, the sync share and the bytes on the link.
fn print_table(o: &Options, links: &[String], runs: &[Vec<Vec<Figures>>]) {
    let step = |figs: &[Figures]| median(&figs.iter().map(|f| f.step_ms).collect::<Vec<_>>());
    println!();
    println!(
        "| link | strategy | ms/step (median of {}; range) | ÷ in-process | time in sync | MB on \
         the link per step (start-up included) |",
        o.rounds
    );
    println!("|---|---|---|---|---|---|");
    for (link, per_strategy) in links.iter().zip(runs) {
        for (s, (strategy, figs)) in o.strategies.iter().zip(per_strategy).enumerate() {
            let (lo, hi) = figs.iter().fold((f64::MAX, f64::MIN), |(lo, hi), f| {
                (lo.min(f.step_ms), hi.max(f.step_ms))
            });
            let sync = median(&figs.iter().map(|f| f.pct_sync).collect::<Vec<_>>());
            let mb: Vec<f64> = figs.iter().filter_map(|f| f.mb_per_step).collect();
            println!(
                "| {link} | {strategy} | {:.1} ({lo:.0}–{hi:.0}) | {:.2} | {sync:.1} % | {} |",
                step(figs),
                step(figs) / step(&runs[0][s]),
                if mb.is_empty() {
                    "–".to_string()
                } else {
                    format!("{:.2}", median(&mb))
                }
            );
        }
    }
}

/// A run's median step time (`summary.json`) and median sync share (its training records
/// after the first).
fn figures(dir: &Path, mb_per_step: Option<f64>) -> Result<Figures> {
    let summary_path = dir.join("summary.json");
    let summary = std::fs::read_to_string(&summary_path)
        .map_err(|e| format!("{}: cannot read: {e}", summary_path.display()))?;
    let step = json_number(&summary, "step_seconds")
        .ok_or_else(|| format!("{}: no step_seconds", summary_path.display()))?;
    let metrics_path = dir.join("metrics.jsonl");
    let metrics = std::fs::read_to_string(&metrics_path)
        .map_err(|e| format!("{}: cannot read: {e}", metrics_path.display()))?;
    let sync: Vec<f64> = metrics
        .lines()
        .filter(|l| l.contains("\"split\":\"train\""))
        .skip(1)
        .filter_map(|l| json_number(l, "pct_sync"))
        .collect();
    Ok(Figures {
        step_ms: step * 1e3,
        pct_sync: median(&sync),
        mb_per_step,
    })
}
