//! `cargo xtask bench links`: the GPT recipe across two machines on one box — two network
//! namespaces joined by a veth link (`scripts/two-hosts`), one `mpirun` rank in each, one
//! device per rank — at each link rate asked for (unshaped, or shaped with a token bucket), per
//! strategy (`diloco` in one process as two islands of one device, as across the hosts),
//! against the same strategy in one process with two devices: step time, the share
//! of the step spent in synchronisation (`pct_sync`), and the bytes the link carried per step.
//! With `--rounds N` the whole sequence runs N times, in-process and across the hosts in turn,
//! and the table gives each figure's median (this box's step times drift by ±15 % over
//! minutes: ratios of runs taken far apart are noise). With `--reference PYTHON`, PyTorch's
//! twin of each strategy that has one (`xtask/reference/gpt_char_torch.py`: DDP over gloo for
//! `ddp`, FSDP2 for `zero2`/`zero3`) runs beside kiln's in the same rounds: two processes on
//! this machine, and one in each namespace over the same link. Needs root, iproute2 and
//! OpenMPI; builds kiln with the `mpi` feature.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::common::{
    Result, TempDir, each_flag, json_number, median, positive, reference_ms_per_step, run_quietly,
};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    rates: Vec<String>,
    strategies: Vec<String>,
    config: String,
    sets: Vec<String>,
    /// The Python that runs PyTorch's twins, if asked.
    reference: Option<String>,
}

/// The recipe the PyTorch twins train (theirs is written for it).
const RECIPE: &str = "configs/gpt-text.toml";

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
        config: RECIPE.into(),
        sets: Vec::new(),
        reference: None,
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
            "--reference" => o.reference = Some(value()?),
            other => {
                return Err(format!(
                    "bench links: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --rates unshaped,10gbit,1gbit, --strategies ddp,zero2,zero3,diloco, --config FILE, \
                     --set KEY=VALUE, --reference PYTHON)"
                ));
            }
        }
        Ok(())
    })?;
    if o.reference.is_some() && o.config != RECIPE {
        return Err(format!(
            "bench links: --reference times PyTorch's twin of {RECIPE}, not of {}",
            o.config
        ));
    }
    Ok(o)
}

/// One run's figures.
#[derive(Clone, Copy)]
struct Figures {
    step_ms: f64,
    pct_sync: f64,
    /// Bytes both ends of the link sent, per step (start-up included); none in one process.
    mb_per_step: Option<f64>,
    /// PyTorch's twin's step on the same link, with `--reference`, where the strategy has one.
    torch_ms: Option<f64>,
}

/// Takes the two-host test bed down when dropped (also on an error).
struct TestBed<'a> {
    script: &'a Path,
}

impl TestBed<'_> {
    /// kiln-a's address on the link (`scripts/two-hosts`).
    const ADDRESS_A: &'static str = "10.231.7.1";

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
            let mut f = figures(&dir, None)?;
            f.torch_ms = twin(o, root, strategy, None)?;
            println!(
                "  round {round}  in-process, 2 devices   {strategy:<6} {:>7.1} ms/step  sync \
                 {:>4.1}%{}",
                f.step_ms,
                f.pct_sync,
                said(f.torch_ms)
            );
            runs[0][s].push(f);
        }
        for (r, rate) in o.rates.iter().enumerate() {
            let bed = TestBed { script: &script };
            let figs = over_link(
                root,
                &bed,
                &train,
                o,
                rate,
                &temp.path().join(format!("{rate}-{round}")),
            )?;
            for (s, f) in figs.into_iter().enumerate() {
                println!(
                    "  round {round}  two hosts, {rate:<12} {:<6} {:>7.1} ms/step  sync \
                     {:>4.1}%  {:>6.2} MB on the link per step{}",
                    o.strategies[s],
                    f.step_ms,
                    f.pct_sync,
                    f.mb_per_step.unwrap_or(0.0),
                    said(f.torch_ms)
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
    root: &Path,
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
        let mut f = figures(&dir, Some(bytes as f64 / 1e6 / o.steps as f64))?;
        f.torch_ms = twin(o, root, strategy, Some(bed))?;
        figs.push(f);
    }
    Ok(figs)
}

/// PyTorch's name for `strategy`'s twin (`gpt_char_torch.py --mode`), where it has one.
fn torch_mode(strategy: &str) -> Option<&str> {
    matches!(strategy, "ddp" | "zero2" | "zero3").then_some(strategy)
}

/// PyTorch's twin of `strategy` (see [`twin_once`]), run a second time after a failure: gloo
/// now and then ends a process with "terminate called without an active exception" as it
/// starts or leaves (seen once in about thirty runs of FSDP2 on two processes here).
fn twin(
    o: &Options,
    root: &Path,
    strategy: &str,
    bed: Option<&TestBed<'_>>,
) -> Result<Option<f64>> {
    twin_once(o, root, strategy, bed).or_else(|e| {
        println!(
            "  ({} — running it again)",
            e.lines().next().unwrap_or_default()
        );
        twin_once(o, root, strategy, bed)
    })
}

/// PyTorch's twin of `strategy` (with `--reference`, where it has one): two processes on this
/// machine (`bed` none), or rank 0 in kiln-a and rank 1 in kiln-b over the bed's link, as
/// `gpt_char_torch.py` times them (the median of the slowest rank's steps).
fn twin_once(
    o: &Options,
    root: &Path,
    strategy: &str,
    bed: Option<&TestBed<'_>>,
) -> Result<Option<f64>> {
    let (Some(python), Some(mode)) = (&o.reference, torch_mode(strategy)) else {
        return Ok(None);
    };
    let steps = o.steps.to_string();
    let args = [
        "xtask/reference/gpt_char_torch.py",
        "--data",
        "data/text/moby-dick.txt",
        "--batch",
        "24",
        "--world",
        "2",
        "--mode",
        mode,
        "--steps",
        &steps,
    ];
    let what = format!("PyTorch's {mode}");
    let out = match bed {
        None => Command::new(python)
            .args(args)
            .current_dir(root)
            .output()
            .map_err(|e| format!("cannot run {python}: {e}"))?,
        Some(_) => {
            // One rank per namespace, gloo over the link (rank 0's address is kiln-a's).
            let rank = |ns: &str, dev: &str, r: &str| {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "env"])
                    .arg(format!("MASTER_ADDR={}", TestBed::ADDRESS_A))
                    .arg("MASTER_PORT=29517")
                    .arg(format!("GLOO_SOCKET_IFNAME={dev}"))
                    .arg(python)
                    .args(args)
                    .args(["--rank", r])
                    .current_dir(root);
                c
            };
            let mut other = rank("kiln-b", "kiln-vb", "1")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start {what}'s rank 1: {e}"))?;
            // Its standard error read as it comes (a full pipe would stop it, and rank 0 with
            // it), and kept for a failure's words.
            let mut pipe = other.stderr.take().expect("piped");
            let said = std::thread::spawn(move || {
                let mut text = String::new();
                let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
                text
            });
            let out = rank("kiln-a", "kiln-va", "0").output();
            if !out.as_ref().is_ok_and(|o| o.status.success()) {
                // Rank 1 would wait for a rank 0 that is gone, or join the next try's.
                let _ = other.kill();
            }
            let status = other.wait().map_err(|e| format!("{what}'s rank 1: {e}"))?;
            let said = said.join().unwrap_or_default();
            let out = out.map_err(|e| format!("cannot run {what}'s rank 0: {e}"))?;
            if out.status.success() && !status.success() {
                return Err(format!("{what}'s rank 1 failed: {}", said.trim()));
            }
            out
        }
    };
    if !out.status.success() {
        return Err(format!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    reference_ms_per_step(&what, &out).map(Some)
}

/// A progress line's words for PyTorch's step, if there is one.
fn said(torch_ms: Option<f64>) -> String {
    torch_ms.map_or(String::new(), |ms| format!("  PyTorch {ms:>6.1} ms/step"))
}

/// The table of every link and strategy: medians over the rounds, ranges, the ratio to the
/// in-process run, the sync share and the bytes on the link.
fn print_table(o: &Options, links: &[String], runs: &[Vec<Vec<Figures>>]) {
    let step = |figs: &[Figures]| median(&figs.iter().map(|f| f.step_ms).collect::<Vec<_>>());
    // PyTorch's median, where every round has one.
    let torch = |figs: &[Figures]| {
        let ms: Vec<f64> = figs.iter().filter_map(|f| f.torch_ms).collect();
        (!ms.is_empty() && ms.len() == figs.len()).then(|| median(&ms))
    };
    let twins = o.reference.is_some();
    println!();
    println!(
        "| link | strategy | ms/step (median of {}; range) | ÷ in-process | time in sync | MB on \
         the link per step (start-up included) |{}",
        o.rounds,
        if twins {
            " PyTorch ms/step | PyTorch ÷ its in-process |"
        } else {
            ""
        }
    );
    println!(
        "|---|---|---|---|---|---|{}",
        if twins { "---|---|" } else { "" }
    );
    for (link, per_strategy) in links.iter().zip(runs) {
        for (s, (strategy, figs)) in o.strategies.iter().zip(per_strategy).enumerate() {
            let (lo, hi) = figs.iter().fold((f64::MAX, f64::MIN), |(lo, hi), f| {
                (lo.min(f.step_ms), hi.max(f.step_ms))
            });
            let sync = median(&figs.iter().map(|f| f.pct_sync).collect::<Vec<_>>());
            let mb: Vec<f64> = figs.iter().filter_map(|f| f.mb_per_step).collect();
            let theirs = match (torch(figs), torch(&runs[0][s])) {
                (Some(ms), Some(home)) => format!(" {ms:.1} | {:.2} |", ms / home),
                _ if twins => " – | – |".to_string(),
                _ => String::new(),
            };
            println!(
                "| {link} | {strategy} | {:.1} ({lo:.0}–{hi:.0}) | {:.2} | {sync:.1} % | {} |{theirs}",
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
        torch_ms: None,
    })
}
