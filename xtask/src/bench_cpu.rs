//! `cargo xtask bench cpu`: the GPT recipe (batch 24), the Llama text recipe and the MNIST
//! ConvNet on one CPU device, with the per-core schedule (`hardware.cpu_split = "auto"`) and
//! without it (`"off"`), with the fused CPU kernels and without them
//! (`hardware.fused_kernels = false`: Burn's composed ops); the Llama (2 × 6) and the ConvNet
//! (2 × 32) on two devices under ddp, the GPT under ddp, zero2 and zero3 (2 × 12); and, given
//! a Python with PyTorch (`--reference PYTHON`), each of them in PyTorch: the GPT in
//! `xtask/reference/gpt_char_torch.py` (one process, or two ranks under DDP and FSDP2 over
//! gloo), the Llama in PyTorch + `transformers`
//! (`xtask/reference/llama_text_torch.py`, its config and tokenizer from kiln's run of the
//! round), the ConvNet in `xtask/reference/convnet_mnist_torch.py` (the models on two devices
//! as two ranks under DDP). Within a round every run
//! alternates; medians over rounds are compared side by side, each with the FLOP/s it achieved
//! (the model's own count, `summary.json` `flops_per_sample`) beside the machine's f32 GEMM
//! peak (`examples/gemm_peak.rs`, and PyTorch's `xtask/reference/gemm_torch.py`) measured at
//! the start.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::bench_policies::built_train;
use crate::common::{
    Result, TempDir, build_release, each_flag, json_number, median, positive,
    reference_ms_per_step, run_quietly,
};

/// What to measure.
pub struct Options {
    steps: usize,
    rounds: usize,
    reference: Option<String>,
    /// Only the recipes whose name contains this (any case).
    only: Option<String>,
}

impl Options {
    fn runs(&self, r: &Recipe) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| r.name.to_lowercase().contains(&o.to_lowercase()))
    }
}

pub fn parse(rest: &[&str]) -> Result<Options> {
    let mut o = Options {
        steps: 30,
        rounds: 2,
        reference: None,
        only: None,
    };
    each_flag(rest, |flag, value| {
        let number = |raw: &str| positive(flag, raw);
        match flag {
            "--steps" => o.steps = number(&value()?)?,
            "--rounds" => o.rounds = number(&value()?)?,
            "--reference" => o.reference = Some(value()?),
            "--only" => o.only = Some(value()?),
            other => {
                return Err(format!(
                    "bench cpu: unknown argument {other:?} (expected --steps N, --rounds N, \
                     --reference PYTHON, --only NAME)"
                ));
            }
        }
        Ok(())
    })?;
    Ok(o)
}

/// A recipe: its name, `train`'s arguments (devices and strategy included), the data it needs,
/// its samples per step, the variants it runs, and its PyTorch twin.
struct Recipe {
    name: &'static str,
    args: &'static [&'static str],
    variants: &'static [usize],
    data: &'static str,
    fetch: &'static str,
    batch: usize,
    reference: Option<Reference>,
}

/// A PyTorch script timing the same recipe: what it runs, its arguments, and whether it also
/// reads kiln's run of the round (`--run DIR`: the model's config and tokenizer).
struct Reference {
    label: &'static str,
    script: &'static str,
    args: &'static [&'static str],
    with_run: bool,
}

/// Every variant, for the recipes on one device.
const ALL: &[usize] = &[DEFAULT, COMPOSED, ONE_REPLICA];
/// `train`'s arguments and the PyTorch twin's of the GPT on two devices under `strategy`.
macro_rules! gpt_on_two {
    ($strategy:literal, $torch:literal) => {
        Recipe {
            name: concat!("GPT ", $strategy, ", 2 devices × 12"),
            args: &[
                "--config",
                "configs/gpt-text.toml",
                "--batch-size",
                "12",
                "--devices",
                "2",
                "--strategy",
                $strategy,
            ],
            variants: &[DEFAULT],
            data: "data/text/moby-dick.txt",
            fetch: "text",
            batch: 24,
            reference: Some(Reference {
                label: $torch,
                script: "xtask/reference/gpt_char_torch.py",
                args: &[
                    "--data",
                    "data/text/moby-dick.txt",
                    "--batch",
                    "24",
                    "--world",
                    "2",
                    "--mode",
                    $strategy,
                ],
                with_run: false,
            }),
        }
    };
}

const RECIPES: [Recipe; 8] = [
    Recipe {
        name: "GPT (configs/gpt-text.toml, batch 24)",
        args: &[
            "--config",
            "configs/gpt-text.toml",
            "--batch-size",
            "24",
            "--devices",
            "1",
        ],
        variants: ALL,
        data: "data/text/moby-dick.txt",
        fetch: "text",
        batch: 24,
        reference: Some(Reference {
            label: "one process, a thread per core",
            script: "xtask/reference/gpt_char_torch.py",
            args: &["--data", "data/text/moby-dick.txt", "--batch", "24"],
            with_run: false,
        }),
    },
    Recipe {
        name: "Llama (configs/llama-text.toml, batch 12)",
        args: &["--config", "configs/llama-text.toml", "--devices", "1"],
        variants: ALL,
        data: "data/text/moby-dick.txt",
        fetch: "text",
        batch: 12,
        reference: Some(Reference {
            label: "transformers' LlamaForCausalLM, a thread per core",
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
        args: &["--config", "configs/mnist-convnet.toml", "--devices", "1"],
        variants: ALL,
        data: "data/mnist",
        fetch: "mnist",
        batch: 64,
        reference: Some(Reference {
            label: "one process, a thread per core",
            script: "xtask/reference/convnet_mnist_torch.py",
            args: &["--data", "data/mnist", "--batch", "64"],
            with_run: false,
        }),
    },
    Recipe {
        name: "Llama ddp, 2 devices × 6",
        args: &[
            "--config",
            "configs/llama-text.toml",
            "--batch-size",
            "6",
            "--devices",
            "2",
            "--strategy",
            "ddp",
        ],
        variants: &[DEFAULT],
        data: "data/text/moby-dick.txt",
        fetch: "text",
        batch: 12,
        reference: Some(Reference {
            label: "transformers' LlamaForCausalLM, DDP over gloo, 2 ranks × 1 thread",
            script: "xtask/reference/llama_text_torch.py",
            args: &[
                "--data",
                "data/text/moby-dick.txt",
                "--batch",
                "12",
                "--context",
                "64",
                "--world",
                "2",
            ],
            with_run: true,
        }),
    },
    Recipe {
        name: "ConvNet ddp, 2 devices × 32",
        args: &[
            "--config",
            "configs/mnist-convnet.toml",
            "--batch-size",
            "32",
            "--devices",
            "2",
            "--strategy",
            "ddp",
        ],
        variants: &[DEFAULT],
        data: "data/mnist",
        fetch: "mnist",
        batch: 64,
        reference: Some(Reference {
            label: "DDP over gloo, 2 ranks × 1 thread",
            script: "xtask/reference/convnet_mnist_torch.py",
            args: &["--data", "data/mnist", "--batch", "64", "--world", "2"],
            with_run: false,
        }),
    },
    gpt_on_two!("ddp", "DDP over gloo, 2 ranks × 1 thread"),
    gpt_on_two!(
        "zero2",
        "FSDP2 reshard_after_forward=False over gloo, 2 ranks × 1 thread"
    ),
    gpt_on_two!(
        "zero3",
        "FSDP2 reshard_after_forward=True over gloo, 2 ranks × 1 thread"
    ),
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
    if !RECIPES.iter().any(|r| o.runs(r)) {
        let names: Vec<&str> = RECIPES.iter().map(|r| r.name).collect();
        return Err(format!(
            "bench cpu: --only {:?} names no recipe (they are: {})",
            o.only.as_deref().unwrap_or(""),
            names.join("; ")
        ));
    }
    for r in RECIPES.iter().filter(|r| o.runs(r)) {
        if !root.join(r.data).exists() {
            return Err(format!(
                "{} is missing: run `cargo xtask fetch-data {}` first",
                r.data, r.fetch
            ));
        }
    }
    let train = built_train(root)?;
    let gemm = built_gemm_peak(root)?;
    let temp = TempDir::new("bench-cpu")?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "bench cpu: {cores} cores, {} steps, {} rounds; one device with hardware.cpu_split = \
         \"auto\" (per-core sub-replicas) against \"off\" (one replica), the fused CPU \
         kernels against Burn's composed ops; the models on two devices{}",
        o.steps,
        o.rounds,
        if o.reference.is_some() {
            "; and each in PyTorch"
        } else {
            ""
        }
    );
    let peak = Peak::measure(&mut Command::new(&gemm), "kiln (Burn's Flex matmul, gemm)")?;
    let torch_peak = match &o.reference {
        Some(python) => Some(Peak::measure(
            Command::new(python)
                .arg("xtask/reference/gemm_torch.py")
                .current_dir(root),
            "PyTorch (torch.mm)",
        )?),
        None => None,
    };
    // ms/step per recipe and variant, the model's FLOPs per sample, and PyTorch's ms/step.
    let mut kiln: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); VARIANTS.len()]; RECIPES.len()];
    let mut flops: Vec<Option<f64>> = vec![None; RECIPES.len()];
    let mut torch: Vec<Vec<f64>> = vec![Vec::new(); RECIPES.len()];
    for round in 0..o.rounds {
        for (i, r) in RECIPES.iter().enumerate().filter(|(_, r)| o.runs(r)) {
            for &j in r.variants {
                let (variant, sets) = VARIANTS[j];
                let dir = temp.path().join(format!("{i}-{j}-{round}"));
                let mut args: Vec<String> = r.args.iter().map(|a| a.to_string()).collect();
                args.extend(
                    [
                        "--max-steps",
                        &o.steps.to_string(),
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
                flops[i] = json_number(&summary, "flops_per_sample");
                println!(
                    "  round {round} {:<46} {variant:<14} {:>7.1} ms/step",
                    r.name,
                    step * 1e3
                );
                kiln[i][j].push(step * 1e3);
            }
            if let (Some(python), Some(reference)) = (&o.reference, &r.reference) {
                let run_dir = temp.path().join(format!("{i}-{DEFAULT}-{round}"));
                let ms = reference_ms(root, python, reference, o.steps, &run_dir)?;
                println!(
                    "  round {round} {:<46} {:>22.1} ms/step",
                    format!("PyTorch, {}", r.name),
                    ms
                );
                torch[i].push(ms);
            }
        }
    }
    let table = Table {
        kiln,
        flops,
        torch,
        peak,
        torch_peak,
    };
    table.print();
    Ok(())
}

/// Builds the GEMM microbenchmark (release) and returns its path.
fn built_gemm_peak(root: &Path) -> Result<std::path::PathBuf> {
    let release = build_release(root, &["--example", "gemm_peak"], "the gemm_peak example")?;
    Ok(release.join("examples").join("gemm_peak"))
}

/// A machine's f32 GEMM peak in GFLOP/s, on one thread and on every core.
struct Peak {
    one_thread: f64,
    all_threads: f64,
}

impl Peak {
    /// Runs a microbenchmark that prints `gflops_one_thread` and `gflops_all_threads` as
    /// JSON, and says what it measured.
    fn measure(command: &mut Command, what: &str) -> Result<Peak> {
        let out = command
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("cannot run the GEMM peak of {what}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let field = |key: &str| {
            json_number(&text, key).ok_or_else(|| {
                format!(
                    "the GEMM peak of {what} printed no {key}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            })
        };
        let peak = Peak {
            one_thread: field("gflops_one_thread")?,
            all_threads: field("gflops_all_threads")?,
        };
        println!(
            "  f32 GEMM peak, {what}, 2048²: {:.1} GFLOP/s on one thread, {:.1} on every core",
            peak.one_thread, peak.all_threads
        );
        Ok(peak)
    }
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
    reference_ms_per_step(reference.script, &out)
}

/// What a bench run measured: per recipe, kiln's ms/step of each variant, the model's FLOPs
/// per sample, PyTorch's ms/step; and the two GEMM peaks.
struct Table {
    kiln: Vec<Vec<Vec<f64>>>,
    flops: Vec<Option<f64>>,
    torch: Vec<Vec<f64>>,
    peak: Peak,
    torch_peak: Option<Peak>,
}

impl Table {
    /// The medians side by side: ms/step per recipe and variant, PyTorch's, and the FLOP/s
    /// each achieved against its own library's GEMM peak on every core.
    fn print(&self) {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        println!();
        println!("CPU: {}", cpu_description());
        println!(
            "f32 GEMM peak on {cores} cores (2048², one product per core at once): kiln {:.1} \
             GFLOP/s{}",
            self.peak.all_threads,
            self.torch_peak.as_ref().map_or(String::new(), |t| format!(
                ", PyTorch {:.1} GFLOP/s (torch.mm on {cores} threads)",
                t.all_threads
            ))
        );
        println!(
            "| recipe | variant | ms/step | samples/s | GFLOP/s (% of the GEMM peak) | speed ÷ \
             cpu_split off | speed ÷ composed ops | speed ÷ PyTorch |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        let ratio = |a: &[f64], ms: f64| {
            if a.is_empty() {
                "–".to_string()
            } else {
                format!("{:.2}", median(a) / ms)
            }
        };
        for (i, r) in RECIPES.iter().enumerate() {
            // Recipes left out by --only have no times.
            for &j in r.variants.iter().filter(|&&j| !self.kiln[i][j].is_empty()) {
                let ms = median(&self.kiln[i][j]);
                println!(
                    "| {} | {} | {ms:.1} | {:.1} | {} | {} | {} | {} |",
                    r.name,
                    VARIANTS[j].0,
                    r.batch as f64 * 1e3 / ms,
                    self.achieved(i, ms, self.peak.all_threads),
                    ratio(&self.kiln[i][ONE_REPLICA], ms),
                    ratio(&self.kiln[i][COMPOSED], ms),
                    ratio(&self.torch[i], ms),
                );
            }
        }
        for (i, r) in RECIPES.iter().enumerate() {
            let (Some(reference), false) = (&r.reference, self.torch[i].is_empty()) else {
                continue;
            };
            let ms = median(&self.torch[i]);
            let peak = self.torch_peak.as_ref().map_or(f64::NAN, |p| p.all_threads);
            println!(
                "| {} in PyTorch ({}) | {} | {ms:.1} | {:.1} | {} | – | – | 1.00 |",
                r.name,
                reference.script,
                reference.label,
                r.batch as f64 * 1e3 / ms,
                self.achieved(i, ms, peak),
            );
        }
    }

    /// Recipe `i`'s GFLOP/s at `ms` per step and its share of `peak`; "–" for a model that
    /// counts no FLOPs.
    fn achieved(&self, i: usize, ms: f64, peak: f64) -> String {
        match self.flops[i] {
            Some(f) => {
                let gflops = f * RECIPES[i].batch as f64 / (ms * 1e-3) / 1e9;
                format!("{gflops:.1} ({:.0} %)", 100.0 * gflops / peak)
            }
            None => "–".to_string(),
        }
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
