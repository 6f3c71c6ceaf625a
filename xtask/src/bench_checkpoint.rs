//! `cargo xtask bench checkpoint`: how long a checkpoint holds the steps up — gathered and
//! written on the step's path (`train.checkpoint_async = false`), gathered and written in the
//! background, and sharded (`train.checkpoint_format = "sharded"`: each rank copies its share
//! and writes it in the background) — on a GPT widened to ~50 M parameters, under ddp and zero3
//! on 2 devices, against the time of copying a rank's own state in memory (the parameters and
//! optimizer state it holds: all of them under ddp, its shard under zero3, as the sharded
//! checkpoint's files measure them), timed in the same run. Every measurement is its own `train`
//! process; within a round the settings alternate; the stall of a run is the median of its
//! checkpoints but the last (which every run writes before it ends).

use std::path::Path;
use std::process::Command;

use crate::bench_policies::built_train;
use crate::common::{
    Result, TempDir, each_flag, json_array, json_number, median, positive, run_quietly,
};

/// What to measure.
pub struct Options {
    steps: usize,
    every: usize,
    rounds: usize,
    config: String,
    sets: Vec<String>,
}

/// The GPT recipe widened: 16 layers of width 512 (50.4 M parameters), a short context.
const WIDE: [&str; 6] = [
    "model.gpt.n_layer=16",
    "model.gpt.n_embd=512",
    "model.gpt.n_head=8",
    "model.gpt.block_size=32",
    "train.batch_size=2",
    "train.val_every=100000",
];

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 16,
        every: 4,
        rounds: 2,
        config: "configs/gpt-text.toml".into(),
        sets: Vec::new(),
    };
    each_flag(rest, |flag, value| {
        match flag {
            "--steps" => o.steps = positive(flag, &value()?)?,
            "--every" => o.every = positive(flag, &value()?)?,
            "--rounds" => o.rounds = positive(flag, &value()?)?,
            "--config" => o.config = value()?,
            "--set" => o.sets.push(value()?),
            other => {
                return Err(format!(
                    "bench checkpoint: unknown argument {other:?} (expected --steps N, --every \
                     N, --rounds N, --config FILE, --set KEY=VALUE)"
                ));
            }
        }
        Ok(())
    })?;
    if o.steps < 2 * o.every {
        return Err(format!(
            "bench checkpoint: --steps {} must be at least twice --every {} (a checkpoint \
             before the last one)",
            o.steps, o.every
        ));
    }
    Ok(o)
}

const STRATEGIES: [&str; 2] = ["ddp", "zero3"];
/// How a checkpoint is written: its words, `train.checkpoint_async`, `train.checkpoint_format`.
const MODES: [(&str, &str, &str); 3] = [
    ("gathered, on the step's path", "false", "gathered"),
    ("gathered, in the background", "true", "gathered"),
    ("sharded, in the background", "true", "sharded"),
];

/// One run's figures.
#[derive(Clone)]
struct Figures {
    /// The stall of each checkpoint but the last, seconds.
    stalls: Vec<f64>,
    step_seconds: f64,
    wall_seconds: f64,
    /// A sharded run's rank 0: the bytes of its own state, and the seconds copying them takes.
    own: Option<(u64, f64)>,
    /// MiB the checkpoints added to the process's heap peak (its peak at the end less its
    /// peak as the first checkpoint began).
    heap_added_mib: f64,
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let train = built_train(root)?;
    let temp = TempDir::new("bench-checkpoint")?;
    let sets: Vec<&str> = WIDE
        .iter()
        .copied()
        .chain(o.sets.iter().map(String::as_str))
        .collect();
    println!(
        "bench checkpoint: {} --set {} for {} steps, a checkpoint every {}, {} rounds, 2 devices",
        o.config,
        sets.join(" --set "),
        o.steps,
        o.every,
        o.rounds
    );
    let mut results = vec![vec![Vec::<Figures>::new(); MODES.len()]; STRATEGIES.len()];
    for round in 0..o.rounds {
        for (s, strategy) in STRATEGIES.iter().enumerate() {
            for (m, (mode, value, format)) in MODES.iter().enumerate() {
                let dir = temp
                    .path()
                    .join(format!("{strategy}-{value}-{format}-r{round}"));
                run_quietly(
                    Command::new(&train)
                        .args(["--config", &o.config])
                        .args(["--max-steps", &o.steps.to_string()])
                        .args(["--devices", "2", "--strategy", strategy])
                        .arg("--run-dir")
                        .arg(&dir)
                        .args(["--set", &format!("train.checkpoint_every={}", o.every)])
                        .args(["--set", &format!("train.checkpoint_async={value}")])
                        .args(["--set", &format!("train.checkpoint_format={format:?}")])
                        .args(["--set", "train.log_every=2"])
                        .args(sets.iter().flat_map(|s| ["--set", s]))
                        .current_dir(root),
                    &format!("{strategy}, checkpoints {mode}"),
                )?;
                let mut f = read_figures(&dir.join("summary.json"))?;
                if *format == "sharded" {
                    let bytes = own_state_bytes(&dir, strategy)?;
                    f.own = Some((bytes, copy_seconds(bytes)));
                }
                let shown: Vec<String> = f.stalls.iter().map(|s| format!("{s:.3}")).collect();
                let own = f.own.map_or(String::new(), |(bytes, secs)| {
                    format!(
                        "; own state {:.0} MB copied in {:.3} s",
                        bytes as f64 / 1e6,
                        secs
                    )
                });
                println!(
                    "  round {round} {strategy:<5} {mode:<28} stalls [{}] s, {:.1} ms/step, \
                     {:.1} s in all, heap peak +{:.0} MiB{own}",
                    shown.join(", "),
                    f.step_seconds * 1e3,
                    f.wall_seconds,
                    f.heap_added_mib
                );
                results[s][m].push(f);
            }
            // Each run's checkpoints take disk space: drop them once read.
            let _ = std::fs::remove_dir_all(temp.path());
            std::fs::create_dir_all(temp.path()).map_err(|e| e.to_string())?;
        }
    }
    println!();
    println!(
        "| strategy | checkpoint | stall per checkpoint (s) | ms/step | run (s) | stall ÷ \
         gathered on the path | rank 0's own state (MB) | copying it (s) | stall ÷ copy | heap \
         peak added (MiB) | ÷ the 2 ranks' own states |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (s, strategy) in STRATEGIES.iter().enumerate() {
        let stall = |m: usize| {
            let all: Vec<f64> = results[s][m]
                .iter()
                .flat_map(|f| f.stalls.clone())
                .collect();
            median(&all)
        };
        let base = stall(0);
        for (m, (mode, _, _)) in MODES.iter().enumerate() {
            let med =
                |f: fn(&Figures) -> f64| median(&results[s][m].iter().map(f).collect::<Vec<_>>());
            let added = med(|f| f.heap_added_mib);
            let own = if results[s][m].iter().all(|f| f.own.is_some()) {
                let bytes = med(|f| f.own.map_or(0.0, |o| o.0 as f64));
                let copy = med(|f| f.own.map_or(0.0, |o| o.1));
                let states_mib = 2.0 * bytes / (1024.0 * 1024.0);
                format!(
                    "{:.0} | {copy:.3} | {:.2} | {added:.0} | {:.2}",
                    bytes / 1e6,
                    stall(m) / copy,
                    added / states_mib
                )
            } else {
                format!("– | – | – | {added:.0} | –")
            };
            println!(
                "| {strategy} | {mode} | {:.3} | {:.1} | {:.1} | {:.3} | {own} |",
                stall(m),
                med(|f| f.step_seconds) * 1e3,
                med(|f| f.wall_seconds),
                stall(m) / base
            );
        }
    }
    Ok(())
}

/// The bytes of the parameters and optimizer state rank 0 of a sharded run in `dir` holds: all
/// of them under a strategy whose ranks replicate them (the ranks' files together), its own
/// shard under zero3 (its file).
fn own_state_bytes(dir: &Path, strategy: &str) -> Result<u64> {
    let checkpoints = dir.join("checkpoints");
    let newest = std::fs::read_dir(&checkpoints)
        .map_err(|e| format!("{}: {e}", checkpoints.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .max()
        .ok_or_else(|| format!("{}: no checkpoint", checkpoints.display()))?;
    let mut bytes = 0;
    for entry in std::fs::read_dir(&newest)
        .map_err(|e| format!("{}: {e}", newest.display()))?
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let counted = if strategy == "zero3" {
            name == "rank-00000.bin"
        } else {
            name.starts_with("rank-") && name.ends_with(".bin")
        };
        if counted {
            bytes += entry.metadata().map_err(|e| e.to_string())?.len();
        }
    }
    Ok(bytes)
}

/// Seconds to copy `bytes` bytes of f32 values in memory into a new buffer (the median of 5,
/// after one to fault the source in).
fn copy_seconds(bytes: u64) -> f64 {
    let source: Vec<f32> = (0..bytes / 4).map(|i| i as f32).collect();
    let mut times = Vec::with_capacity(5);
    for _ in 0..6 {
        let t = std::time::Instant::now();
        let copy = source.clone();
        times.push(t.elapsed().as_secs_f64());
        std::hint::black_box(copy);
    }
    median(&times[1..])
}

fn read_figures(path: &Path) -> Result<Figures> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let missing = |key: &str| format!("{}: no number for {key:?}", path.display());
    let mut stalls =
        json_array(&text, "checkpoint_stall_s").ok_or_else(|| missing("checkpoint_stall_s"))?;
    // The last checkpoint is written before the run ends, in either setting.
    stalls.pop();
    Ok(Figures {
        stalls,
        step_seconds: json_number(&text, "step_seconds").ok_or_else(|| missing("step_seconds"))?,
        wall_seconds: json_number(&text, "wall_seconds").ok_or_else(|| missing("wall_seconds"))?,
        own: None,
        heap_added_mib: json_number(&text, "peak_heap_mib")
            .ok_or_else(|| missing("peak_heap_mib"))?
            - json_number(&text, "peak_heap_before_checkpoints_mib")
                .ok_or_else(|| missing("peak_heap_before_checkpoints_mib"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_arguments_and_reads_the_stalls() {
        let o = parse(&["--steps", "12", "--every", "3"]).unwrap();
        assert_eq!((o.steps, o.every), (12, 3));
        assert!(parse(&["--steps", "5", "--every", "3"]).is_err());
        assert!(parse(&["--bogus"]).is_err());
        let text = "{\n  \"checkpoint_stall_s\": [\n    1.5,\n    0.25\n  ],\n  \"x\": 1\n}";
        assert_eq!(
            json_array(text, "checkpoint_stall_s"),
            Some(vec![1.5, 0.25])
        );
        assert_eq!(json_array(text, "nothing"), None);
    }
}
