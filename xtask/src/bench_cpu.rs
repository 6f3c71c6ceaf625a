//! `cargo xtask bench cpu`: one CPU device, the GPT recipe (batch 24), the Llama text recipe
//! and the MNIST ConvNet, with the per-core schedule (`hardware.cpu_split = "auto"`) and
//! without it (`"off"`), with the fused CPU kernels and without them
//! (`hardware.fused_kernels = false`: Burn's composed ops), and, given a Python with PyTorch (`--reference PYTHON`), the same GPT
//! recipe in PyTorch (`xtask/reference/gpt_char_torch.py`) and the same Llama in PyTorch +
//! `transformers` (`xtask/reference/llama_text_torch.py`, its config and tokenizer from
//! kiln's run of the round). Within a round every run alternates; medians over rounds are
//! compared side by side.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::bench_policies::built_train;
use crate::common::{Result, TempDir, each_flag, json_number, median, positive, run_quietly};

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

/// A recipe: its name, `train`'s arguments, the data it needs, its samples per step, and its
/// PyTorch twin.
struct Recipe {
    name: &'static str,
    args: &'static [&'static str],
    data: &'static str,
    fetch: &'static str,
    batch: usize,
    reference: Option<Reference>,
}

/// A PyTorch script timing the same recipe: its arguments, and whether it also reads kiln's
/// run of the round (`--run DIR`: the model's config and tokenizer).
struct Reference {
    script: &'static str,
    args: &'static [&'static str],
    with_run: bool,
}

const RECIPES: [Recipe; 3] = [
    Recipe {
        name: "GPT (configs/gpt-text.toml, batch 24)",
        args: &["--config", "configs/gpt-text.toml", "--batch-size", "24"],
        data: "data/text/moby-dick.txt",
        fetch: "text",
        batch: 24,
        reference: Some(Reference {
            script: "xtask/reference/gpt_char_torch.py",
            args: &["--data", "data/text/moby-dick.txt", "--batch", "24"],
            with_run: false,
        }),
    },
    Recipe {
        name: "Llama (configs/llama-text.toml, batch 12)",
        args: &["--config", "configs/llama-text.toml"],
        data: "data/text/moby-dick.txt",
        fetch: "text",
        batch: 12,
        reference: Some(Reference {
            script: "xtask/reference/llama_text_torch.py",
            args: &[
                "--data",
                "data/text/moby-dick.txt",
                "--batch",
                "12",
                "--context",
                "64",
            ],
            with_run: true,
        }),
    },
    Recipe {
        name: "ConvNet (configs/mnist-convnet.toml, batch 64)",
        args: &["--config", "configs/mnist-convnet.toml"],
        data: "data/mnist",
        fetch: "mnist",
        batch: 64,
        reference: None,
    },
];

/// The settings compared: a label and `train`'s `--set`s. The first is the default.
const VARIANTS: [(&str, [&str; 2]); 3] = [
    (
        "cpu_split auto",
        ["hardware.cpu_split=\"auto\"", "hardware.fused_kernels=true"],
    ),
    (
        "composed ops",
        [
            "hardware.cpu_split=\"auto\"",
            "hardware.fused_kernels=false",
        ],
    ),
    (
        "cpu_split off",
        ["hardware.cpu_split=\"off\"", "hardware.fused_kernels=true"],
    ),
];
// The variants' indices: the default, Burn's composed ops, one replica.
const DEFAULT: usize = 0;
const COMPOSED: usize = 1;
const ONE_REPLICA: usize = 2;

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
         \"auto\" (per-core sub-replicas) against \"off\" (one replica), the fused CPU \
         kernels against Burn's composed ops{}",
        o.steps,
        o.rounds,
        if o.reference.is_some() {
            ", and PyTorch on the GPT and the Llama"
        } else {
            ""
        }
    );
    // ms/step per recipe and schedule, and PyTorch's.
    let mut kiln: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); VARIANTS.len()]; RECIPES.len()];
    let mut torch: Vec<Vec<f64>> = vec![Vec::new(); RECIPES.len()];
    for round in 0..o.rounds {
        for (i, r) in RECIPES.iter().enumerate() {
            for (j, (variant, sets)) in VARIANTS.iter().enumerate() {
                let dir = temp.path().join(format!("{i}-{j}-{round}"));
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
                        sets[0],
                        "--set",
                        sets[1],
                        "--set",
                        "train.log_every=10",
                        "--set",
                        "monitor.interval_s=0",
                    ]
                    .map(String::from),
                );
                run_quietly(
                    Command::new(&train).args(&args).current_dir(root),
                    &format!("{} ({variant})", r.name),
                )?;
                let path = dir.join("summary.json");
                let summary = std::fs::read_to_string(&path)
                    .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
                let step = json_number(&summary, "step_seconds")
                    .ok_or_else(|| format!("{}: no step_seconds", path.display()))?;
                println!(
                    "  round {round} {:<46} {variant:<14} {:>7.1} ms/step",
                    r.name,
                    step * 1e3
                );
                kiln[i][j].push(step * 1e3);
            }
        }
        if let Some(python) = &o.reference {
            for (i, r) in RECIPES.iter().enumerate() {
                let Some(reference) = &r.reference else {
                    continue;
                };
                let run_dir = temp.path().join(format!("{i}-{DEFAULT}-{round}"));
                let ms = reference_ms(root, python, reference, o.steps, &run_dir)?;
                println!(
                    "  round {round} {:<46} {:>12.1} ms/step",
                    format!("PyTorch, {}", r.name),
                    ms
                );
                torch[i].push(ms);
            }
        }
    }
    print_table(&kiln, &torch, cores);
    Ok(())
}

/// The PyTorch twin's median ms/step (`run_dir`: kiln's run of the round, for a twin that
/// reads it).
fn reference_ms(
    root: &Path,
    python: &str,
    reference: &Reference,
    steps: usize,
    run_dir: &Path,
) -> Result<f64> {
    let mut command = Command::new(python);
    command
        .arg(reference.script)
        .args(reference.args)
        .args(["--steps", &steps.to_string()]);
    if reference.with_run {
        command.arg("--run").arg(run_dir);
    }
    let out = command
        .current_dir(root)
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    json_number(&text, "ms_per_step").ok_or_else(|| {
        format!(
            "{} printed no ms_per_step: {}",
            reference.script,
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })
}

/// The medians side by side: ms/step per recipe and schedule, and PyTorch's.
fn print_table(kiln: &[Vec<Vec<f64>>], torch: &[Vec<f64>], cores: usize) {
    println!();
    println!("CPU: {}", cpu_description());
    println!(
        "| recipe | one device | ms/step | samples/s | speed ÷ cpu_split off | speed ÷ composed \
         ops | speed ÷ PyTorch |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, r) in RECIPES.iter().enumerate() {
        let off = median(&kiln[i][ONE_REPLICA]);
        let composed = median(&kiln[i][COMPOSED]);
        for (j, (variant, _)) in VARIANTS.iter().enumerate() {
            let ms = median(&kiln[i][j]);
            let vs_torch = if !torch[i].is_empty() {
                format!("{:.2}", median(&torch[i]) / ms)
            } else {
                "–".to_string()
            };
            println!(
                "| {} | {variant} | {ms:.1} | {:.1} | {:.2} | {:.2} | {vs_torch} |",
                r.name,
                r.batch as f64 * 1e3 / ms,
                off / ms,
                composed / ms
            );
        }
    }
    for (i, r) in RECIPES.iter().enumerate() {
        let (Some(reference), false) = (&r.reference, torch[i].is_empty()) else {
            continue;
        };
        let ms = median(&torch[i]);
        println!(
            "| {} in PyTorch ({}) | {cores} threads | {ms:.1} | {:.1} | – | – | 1.00 |",
            r.name,
            reference.script,
            r.batch as f64 * 1e3 / ms
        );
    }
}

/// The CPU's model and the vector extensions that choose kiln's and PyTorch's kernels (from
/// `/proc/cpuinfo`; "unknown" elsewhere).
fn cpu_description() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let model = field("model name").unwrap_or_else(|| "unknown".into());
    let flags = field("flags").unwrap_or_default();
    let wanted = [
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
    ];
    let have: Vec<&str> = wanted
        .into_iter()
        .filter(|w| flags.split_whitespace().any(|f| f == *w))
        .collect();
    format!("{model}; vector extensions: {}", have.join(" "))
}
