//! `cargo xtask bench plan`: the planner against what happened. Every run of kiln records the
//! planner's prediction for its own settings (`summary.json` `plan`) beside what it measured
//! (`peak_rss_mib`, `step_seconds`); this runs a grid — the GPT recipe and the MNIST ConvNet;
//! ddp, zero1, zero2, zero3 and pipeline; recompute none and blocks; 32 and bf16-mixed; 1, 2
//! and 4 devices; two processes under `mpirun`; the GAN and the autoencoder of
//! `crates/generative`, programs of their own on kiln's library — and prints each prediction,
//! the measurement and the error, with their median and worst.

use std::path::Path;
use std::process::Command;

use crate::bench_mpi::built_mpi_train;
use crate::common::{
    Result, TempDir, build_release, each_flag, json_number, median, positive, run_quietly,
};

/// What to measure.
pub struct Options {
    steps: usize,
    only: Option<String>,
    /// `hardware.memory_limit_mib` for every run (under a limit a run forgoes transparent
    /// huge pages, and holds what the planner predicted more closely).
    limit: Option<usize>,
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 30,
        only: None,
        limit: None,
    };
    each_flag(rest, |flag, value| {
        match flag {
            "--steps" => o.steps = positive(flag, &value()?)?,
            "--only" => o.only = Some(value()?),
            "--limit" => o.limit = Some(positive(flag, &value()?)?),
            other => {
                return Err(format!(
                    "bench plan: unknown argument {other:?} (expected --steps N, --only TEXT, \
                     --limit MIB)"
                ));
            }
        }
        Ok(())
    })?;
    Ok(o)
}

/// One configuration of the grid: its words, processes, the program (`train`, or a binary of
/// `crates/generative`) and its flags.
struct Case {
    name: String,
    processes: usize,
    program: &'static str,
    args: Vec<String>,
}

fn case(name: &str, processes: usize, config: &str, flags: &str) -> Case {
    let mut args = vec!["--config".to_string(), config.to_string()];
    args.extend(flags.split_whitespace().map(str::to_string));
    Case {
        name: name.to_string(),
        processes,
        program: "train",
        args,
    }
}

/// A case of `program`, a binary of `crates/generative`.
fn generative(name: &str, program: &'static str, config: &str, flags: &str) -> Case {
    Case {
        program,
        ..case(name, 1, config, flags)
    }
}

/// The grid.
fn grid() -> Vec<Case> {
    let gpt = "configs/gpt-text.toml";
    let cnn = "configs/mnist-convnet.toml";
    let bf16 = "--set precision.mode=\"bf16-mixed\"";
    let blocks = "--set recompute.mode=\"blocks\"";
    let pipe = "--strategy pipeline --set pipeline.stages=2 --set pipeline.microbatches=2";
    let mut g = vec![
        case("gpt 1 device", 1, gpt, "--devices 1"),
        case(
            "gpt 1 device bf16-mixed",
            1,
            gpt,
            &format!("--devices 1 {bf16}"),
        ),
        case("gpt 2 ddp", 1, gpt, "--devices 2 --strategy ddp"),
        case(
            "gpt 2 ddp blocks",
            1,
            gpt,
            &format!("--devices 2 --strategy ddp {blocks}"),
        ),
        case(
            "gpt 2 ddp bf16-mixed",
            1,
            gpt,
            &format!("--devices 2 --strategy ddp {bf16}"),
        ),
        case(
            "gpt 2 ddp 3×4",
            1,
            gpt,
            "--devices 2 --strategy ddp --set train.batch_size=3 --set train.accumulate=4",
        ),
        case("gpt 2 zero1", 1, gpt, "--devices 2 --strategy zero1"),
        case("gpt 2 zero2", 1, gpt, "--devices 2 --strategy zero2"),
        case("gpt 2 zero3", 1, gpt, "--devices 2 --strategy zero3"),
        case(
            "gpt 2 zero3 blocks",
            1,
            gpt,
            &format!("--devices 2 --strategy zero3 {blocks}"),
        ),
        case("gpt 2 pipeline 2×2", 1, gpt, &format!("--devices 2 {pipe}")),
        case(
            "gpt 2 pipeline 2×4 gpipe",
            1,
            gpt,
            "--devices 2 --strategy pipeline --set pipeline.stages=2 --set pipeline.microbatches=4 --set pipeline.schedule=\"gpipe\" --set train.batch_size=6",
        ),
        case("gpt 4 ddp", 1, gpt, "--devices 4 --strategy ddp"),
        case("gpt 4 zero2", 1, gpt, "--devices 4 --strategy zero2"),
        case(
            "gpt 4 zero3 bf16-mixed",
            1,
            gpt,
            &format!("--devices 4 --strategy zero3 {bf16}"),
        ),
        case("gpt 4 pipeline 2×2", 1, gpt, &format!("--devices 4 {pipe}")),
        case(
            "gpt 2 processes × 1 ddp",
            2,
            gpt,
            "--devices 1 --strategy ddp",
        ),
        case("convnet 1 device", 1, cnn, "--devices 1"),
        case("convnet 2 ddp", 1, cnn, "--devices 2 --strategy ddp"),
        case("convnet 2 zero1", 1, cnn, "--devices 2 --strategy zero1"),
        case("convnet 2 zero3", 1, cnn, "--devices 2 --strategy zero3"),
        case("convnet 2 zero2", 1, cnn, "--devices 2 --strategy zero2"),
        case("convnet 4 ddp", 1, cnn, "--devices 4 --strategy ddp"),
        generative(
            "gan 1 device",
            "gan",
            "configs/gan-mnist.toml",
            "--devices 1",
        ),
        generative(
            "gan 2 ddp",
            "gan",
            "configs/gan-mnist.toml",
            "--devices 2 --strategy ddp",
        ),
        generative(
            "autoencoder 1 device",
            "autoencoder",
            "configs/autoencoder-mnist.toml",
            "--devices 1",
        ),
        generative(
            "autoencoder 2 zero1",
            "autoencoder",
            "configs/autoencoder-mnist.toml",
            "--devices 2 --strategy zero1",
        ),
    ];
    for c in &mut g {
        // No validation or checkpoint inside the measured steps; the planner measures on
        // every run (its kept measurements would make every row's prediction the first's).
        c.args.extend(
            [
                "--set",
                "hardware.plan_cache=false",
                "--set",
                "train.val_every=100000",
                "--set",
                "train.checkpoint_every=100000",
                "--set",
                "train.log_every=5",
            ]
            .map(str::to_string),
        );
    }
    g
}

/// A run's prediction and measurement.
struct Row {
    name: String,
    rss: (f64, f64),
    step: (f64, f64),
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let train = built_mpi_train(root, false)?;
    let release = build_release(
        root,
        &["-p", "kiln-generative", "--bins"],
        "the GAN and the autoencoder",
    )?;
    let temp = TempDir::new("bench-plan")?;
    println!(
        "bench plan: {} steps per run; the planner's figures for each run's own settings \
         (summary.json `plan`) against the run's peak RSS and median step time",
        o.steps
    );
    let mut rows = Vec::new();
    for (i, c) in grid().into_iter().enumerate() {
        if o.only
            .as_ref()
            .is_some_and(|t| !c.name.contains(t.as_str()))
        {
            continue;
        }
        let dir = temp.path().join(format!("case-{i}"));
        let program = match c.program {
            "train" => train.clone(),
            other => release.join(other),
        };
        let mut command = if c.processes > 1 {
            let mut m = Command::new("mpirun");
            m.args(["--allow-run-as-root", "--oversubscribe", "-np"])
                .arg(c.processes.to_string())
                .arg(&program);
            m
        } else {
            Command::new(&program)
        };
        if let Some(limit) = o.limit {
            command.args(["--set", &format!("hardware.memory_limit_mib={limit}")]);
        }
        run_quietly(
            command
                .args(&c.args)
                .args(["--max-steps", &o.steps.to_string()])
                .arg("--run-dir")
                .arg(&dir)
                .current_dir(root),
            &c.name,
        )?;
        let path = dir.join("summary.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        let plan_at = text
            .find("\"plan\"")
            .ok_or_else(|| format!("{}: no \"plan\" record", path.display()))?;
        let (plan, own) = (&text[plan_at..], &text[..plan_at]);
        let number = |t: &str, key: &str| {
            json_number(t, key).ok_or_else(|| format!("{}: no number for {key:?}", path.display()))
        };
        let row = Row {
            name: c.name.clone(),
            rss: (number(plan, "peak_rss_mib")?, number(own, "peak_rss_mib")?),
            step: (number(plan, "step_seconds")?, number(own, "step_seconds")?),
        };
        println!(
            "  {:<28} peak RSS {:>7.1} predicted {:>7.1} MiB ({:+5.1}%)   step {:>7.1} predicted \
             {:>7.1} ms ({:+5.1}%)",
            row.name,
            row.rss.1,
            row.rss.0,
            error(row.rss) * 100.0,
            row.step.1 * 1e3,
            row.step.0 * 1e3,
            error(row.step) * 100.0
        );
        rows.push(row);
    }
    print_table(&rows);
    Ok(())
}

/// The grid's table, the errors' median and worst, and the run furthest above its prediction.
fn print_table(rows: &[Row]) {
    println!();
    println!("| configuration | peak RSS MiB | predicted | error | ms/step | predicted | error |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.1} | {:.1} | {:+.1}% | {:.1} | {:.1} | {:+.1}% |",
            r.name,
            r.rss.1,
            r.rss.0,
            error(r.rss) * 100.0,
            r.step.1 * 1e3,
            r.step.0 * 1e3,
            error(r.step) * 100.0
        );
    }
    let summary = |f: fn(&Row) -> (f64, f64)| {
        let errors: Vec<f64> = rows.iter().map(|r| error(f(r)).abs()).collect();
        let worst = errors.iter().copied().fold(0.0, f64::max);
        (median(&errors), worst)
    };
    let (m_med, m_worst) = summary(|r| r.rss);
    // The run furthest above its prediction: a plan fits a limit with kiln's
    // `config::HEADROOM` (10 %) to spare, so no run may sit more than that over it.
    let under = rows.iter().map(|r| error(r.rss)).fold(0.0f64, f64::min);
    let (t_med, t_worst) = summary(|r| r.step);
    println!();
    println!(
        "{} configurations: peak memory error median {:.1}%, worst {:.1}% (goal: every run \
         within 10%); step time error median {:.1}%, worst {:.1}% (goal: every run within 25%)",
        rows.len(),
        m_med * 100.0,
        m_worst * 100.0,
        t_med * 100.0,
        t_worst * 100.0
    );
    println!(
        "memory predicted below the run by at most {:.1}% (a plan fits a limit with 10% to \
         spare: {})",
        -under * 100.0,
        if under >= -0.10 {
            "every run within it"
        } else {
            "a run past it"
        }
    );
}

/// The prediction's error relative to the measurement.
fn error((predicted, measured): (f64, f64)) -> f64 {
    predicted / measured - 1.0
}
