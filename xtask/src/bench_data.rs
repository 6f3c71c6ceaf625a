//! `cargo xtask bench data`: the built-in ConvNet on a decode-heavy image folder (Fashion-MNIST
//! written as JPEGs, upscaled, and read back at the model's input size with random crops and
//! flips), with `data.workers` = 0 and the counts asked for: samples/s and the share of the
//! step the rank waited for data (`pct_data`). Within a round the worker counts alternate;
//! medians over rounds are compared with `workers = 0`, side by side.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bench_policies::built_train;
use crate::common::{
    Result, TempDir, each_flag, json_number, median, positive, positives, run_quietly, target_dir,
};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    workers: Vec<usize>,
    /// Side of the JPEGs written.
    size: usize,
    /// Side the model reads them at.
    input: usize,
    train: usize,
    batch: usize,
    sets: Vec<String>,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 30,
        rounds: 2,
        workers: vec![1, 2],
        size: 640,
        input: 64,
        train: 1500,
        batch: 32,
        sets: Vec::new(),
    };
    each_flag(rest, |flag, value| {
        let number = |raw: &str| positive(flag, raw);
        match flag {
            "--steps" => o.steps = number(&value()?)?,
            "--rounds" => o.rounds = number(&value()?)?,
            "--size" => o.size = number(&value()?)?,
            "--input" => o.input = number(&value()?)?,
            "--train" => o.train = number(&value()?)?,
            "--batch" => o.batch = number(&value()?)?,
            "--workers" => {
                o.workers = positives(flag, &value()?)?;
            }
            "--set" => o.sets.push(value()?),
            other => {
                return Err(format!(
                    "bench data: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --workers N[,N...], --size PX, --input PX, --train N, --batch N, --set \
                     KEY=VALUE)"
                ));
            }
        }
        Ok(())
    })?;
    Ok(o)
}

/// One run's figures: medians over its logged steps after the first.
#[derive(Clone, Copy)]
struct Figures {
    samples_per_sec: f64,
    pct_data: f64,
    step_ms: f64,
    data_ms: f64,
    compute_ms: f64,
}

/// The JPEG folder of the benchmark, written once into the target directory.
fn jpeg_folder(root: &Path, o: &Options) -> Result<PathBuf> {
    let idx = root.join("data/fashion-mnist");
    if !idx.is_dir() {
        return Err(format!(
            "{} is missing: run `cargo xtask fetch-data fashion-mnist` first",
            idx.display()
        ));
    }
    let out = target_dir(root)
        .join("bench-data")
        .join(format!("fashion-jpeg-{}px-{}", o.size, o.train));
    if out.join("test").is_dir() {
        return Ok(out);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let tmp = out.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    let status = Command::new(&cargo)
        .args(["run", "--release", "-q", "-p", "kiln-datasets", "--bin"])
        .args(["kiln-image-folder", "--", "--idx"])
        .arg(&idx)
        .arg("--out")
        .arg(&tmp)
        .args(["--size", &o.size.to_string(), "--jpeg", "90"])
        .args(["--train", &o.train.to_string(), "--test", "500"])
        .current_dir(root)
        .status()
        .map_err(|e| format!("cannot run kiln-image-folder: {e}"))?;
    if !status.success() {
        return Err(format!("writing the JPEG folder failed ({status})"));
    }
    std::fs::rename(&tmp, &out).map_err(|e| format!("{}: cannot rename: {e}", tmp.display()))?;
    Ok(out)
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let train = built_train(root)?;
    let folder = jpeg_folder(root, o)?;
    let temp = TempDir::new("bench-data")?;
    let mut counts = vec![0];
    counts.extend(o.workers.iter().copied().filter(|&w| w > 0));
    let shown_sets: String = o.sets.iter().map(|s| format!(" --set {s}")).collect();
    println!(
        "bench data: ConvNet on {} ({} JPEGs of {}×{} px, read at {}×{} with random crop and \
         flip), batch {}, {} steps, {} rounds, workers {:?}{shown_sets}",
        folder.display(),
        o.train,
        o.size,
        o.size,
        o.input,
        o.input,
        o.batch,
        o.steps,
        o.rounds,
        counts
    );
    let mut results: Vec<Vec<Figures>> = vec![Vec::new(); counts.len()];
    for round in 0..o.rounds {
        for (i, workers) in counts.iter().enumerate() {
            let dir = temp.path().join(format!("w{workers}-r{round}"));
            let mut args: Vec<String> = [
                "--max-steps",
                &o.steps.to_string(),
                "--batch-size",
                &o.batch.to_string(),
                "--devices",
                "1",
                "--run-dir",
                &dir.display().to_string(),
            ]
            .map(String::from)
            .to_vec();
            for set in [
                "data.dataset=\"image-folder\"".to_string(),
                format!("data.dir={:?}", folder.display().to_string()),
                format!("data.image_size=[{0}, {0}]", o.input),
                "data.augment=true".to_string(),
                format!("data.workers={workers}"),
                "model.convnet.channels=[8, 16]".to_string(),
                "train.log_every=5".to_string(),
            ]
            .into_iter()
            .chain(o.sets.iter().cloned())
            {
                args.extend(["--set".to_string(), set]);
            }
            run_quietly(
                Command::new(&train).args(&args).current_dir(root),
                &format!("workers = {workers}"),
            )?;
            let f = read_figures(&dir.join("metrics.jsonl"))?;
            println!(
                "  round {round} workers={workers} {:>7.1} samples/s  {:>7.1} ms/step (data \
                 {:>5.1} ms, compute {:>5.1} ms)  data {:>5.1}%",
                f.samples_per_sec, f.step_ms, f.data_ms, f.compute_ms, f.pct_data
            );
            results[i].push(f);
        }
    }
    println!();
    println!(
        "| data.workers | samples/s | ms/step | waiting for data, ms | compute, ms | pct_data | \
         throughput ÷ workers = 0 |"
    );
    println!("|---|---|---|---|---|---|---|");
    let med =
        |i: usize, f: fn(&Figures) -> f64| median(&results[i].iter().map(f).collect::<Vec<_>>());
    let base = med(0, |f| f.samples_per_sec);
    for (i, workers) in counts.iter().enumerate() {
        let rate = med(i, |f| f.samples_per_sec);
        println!(
            "| {workers} | {rate:.1} | {:.1} | {:.1} | {:.1} | {:.1} % | {:.2} |",
            med(i, |f| f.step_ms),
            med(i, |f| f.data_ms),
            med(i, |f| f.compute_ms),
            med(i, |f| f.pct_data),
            rate / base
        );
    }
    Ok(())
}

/// Medians over the run's training records after the first (which holds the start-up).
fn read_figures(path: &Path) -> Result<Figures> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let records: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("\"split\":\"train\""))
        .skip(1)
        .collect();
    let values = |key: &str| -> Result<Vec<f64>> {
        records
            .iter()
            .map(|r| {
                json_number(r, key).ok_or_else(|| format!("{}: no {key} in {r}", path.display()))
            })
            .collect()
    };
    if records.is_empty() {
        return Err(format!("{}: too few training records", path.display()));
    }
    let steps: Vec<f64> = values("time_data")?
        .iter()
        .zip(values("time_compute")?)
        .zip(values("time_sync")?)
        .zip(values("time_optim")?)
        .map(|(((d, c), s), o)| (d + c + s + o) * 1e3)
        .collect();
    let ms = |key: &str| -> Result<f64> {
        Ok(median(
            &values(key)?.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
        ))
    };
    Ok(Figures {
        samples_per_sec: median(&values("samples_per_sec")?),
        pct_data: median(&values("pct_data")?),
        step_ms: median(&steps),
        data_ms: ms("time_data")?,
        compute_ms: ms("time_compute")?,
    })
}
