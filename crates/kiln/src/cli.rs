//! The training command line's parts, shared by every program built on [`App`](crate::App)
//! (kiln's own `train` among them): flags for the common knobs, `--set` for any config key,
//! `devices`, `plot`, and how a run is started and reported.

use std::io::Write;
use std::path::PathBuf;

use kiln_engine::config::{Accelerator, PrecisionMode, StrategyKind, apply_override};
use kiln_engine::error::{Error, Result};
use kiln_engine::run::{RunOptions, RunResult, resolve_resume};

/// The flags of a training command line, kiln's `train` and a program's own alike.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Flags {
    /// TOML run config (default: the built-in recipe).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Number of devices (`4`) or a list of device indices (`0,2,3`).
    #[arg(long, value_name = "N|LIST")]
    pub devices: Option<String>,
    /// Parallel strategy.
    #[arg(long, value_enum)]
    pub strategy: Option<StrategyKind>,
    /// The device mesh: `tp=2` (tensor-parallel ranks per group), `dp=2,tp=2` (dp checked
    /// against the devices), `shard=3` (the data dimension's ZeRO stage), `pp=2` (pipeline
    /// stages); the `[parallel]` keys.
    #[arg(long, value_name = "DIM=N,...")]
    pub mesh: Option<String>,
    /// Kind of device.
    #[arg(long, value_enum)]
    pub accelerator: Option<Accelerator>,
    /// Passes over the training set.
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Stop after this many optimizer steps.
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// Samples per device per micro-step (the effective batch is printed at start).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Micro-steps accumulated per optimizer step.
    #[arg(long)]
    pub accumulate: Option<usize>,
    /// Numeric precision (`precision.mode`).
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionMode>,
    /// Activation checkpointing: `none`, `balanced`, `blocks` or `blocks:every=K`.
    #[arg(long, value_name = "MODE")]
    pub recompute: Option<String>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Seed of initialisation and data order.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Run name: the run directory is `runs/NAME`.
    #[arg(long)]
    pub name: Option<String>,
    /// The run's own directory (overrides `--name`).
    #[arg(long, value_name = "PATH")]
    pub run_dir: Option<PathBuf>,
    /// Continue a run from its newest checkpoint (a run directory or a checkpoint directory).
    #[arg(long, value_name = "PATH")]
    pub resume: Option<PathBuf>,
    /// Override any config key: `--set optim.lr=3e-4` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Print the resolved config as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// `train plot`: charts of a run's `metrics.jsonl`.
#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// The run directory.
    #[command(flatten)]
    pub run: RunDir,
    /// Where the PNGs go (default: RUN_DIR/plots).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Width of each chart in pixels.
    #[arg(long, default_value_t = 1000)]
    pub width: u32,
    /// Height of each chart in pixels.
    #[arg(long, default_value_t = 600)]
    pub height: u32,
    /// Draw the loss and metrics charts on a logarithmic y axis.
    #[arg(long)]
    pub log_y: bool,
}

/// `train eval`: a model on the config's validation set.
#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// A run directory: its config, and its exported model as the weights (`model.safetensors`
    /// in the run's `export.format`). Without it, the weights are the config's `init.from`
    /// (`--set init.from=FILE`).
    #[arg(long, value_name = "RUN_DIR")]
    pub run: Option<PathBuf>,
    /// The config and devices, as for training.
    #[command(flatten)]
    pub flags: Flags,
}

impl EvalArgs {
    /// The training flags of this evaluation: the run's config and exported weights, with the
    /// flags given on top.
    pub fn flags(&self) -> Result<Flags> {
        let mut flags = self.flags.clone();
        if flags.resume.is_some() {
            return Err(Error::config(
                "train eval: --resume continues training; evaluate a run with --run RUN_DIR"
                    .to_string(),
            ));
        }
        let Some(run) = &self.run else {
            return Ok(flags);
        };
        let config = run.join("config.toml");
        let (table, _) = kiln_engine::config::read_table(Some(&config), &[])?;
        let format = table
            .get("export")
            .and_then(|e| e.get("format"))
            .and_then(|f| f.as_str())
            .unwrap_or("kiln")
            .to_string();
        // `model.safetensors` of an "hf" export is kiln's layout (the PyTorch one is in hf/).
        let format = if format == "hf" {
            "kiln".into()
        } else {
            format
        };
        // The run's own starting point is replaced by what it exported.
        let mut set = vec![
            format!("init.from={:?}", run.display().to_string()),
            format!("init.format={format:?}"),
            "init.rename=[]".to_string(),
            "init.partial=false".to_string(),
        ];
        // A Hugging Face checkpoint's architecture was read from its config.json: the run
        // kept what it resolved (`model.toml`), which describes the exported weights.
        let kind = table.get("model").and_then(|m| m.get("kind"));
        if flags.config.is_none() && kind.and_then(|k| k.as_str()) == Some("hf") {
            let (spec, _) = kiln_engine::config::read_table(Some(&run.join("model.toml")), &[])?;
            let model = spec.get("model").and_then(|m| m.as_table());
            let resolved = model.and_then(|m| m.get("kind")).and_then(|k| k.as_str());
            if let (Some(model), Some(resolved)) = (model, resolved) {
                set.push(format!("model.kind={resolved:?}"));
                if let Some(shape) = model.get(resolved) {
                    set.push(format!("model.{resolved}={shape}"));
                }
            }
        }
        if flags.config.is_none() {
            flags.config = Some(config);
        }
        set.append(&mut flags.set);
        flags.set = set;
        Ok(flags)
    }
}

/// `train plan`: the config and devices as for training.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Print the plan as JSON (every candidate's prediction and what was measured).
    #[arg(long)]
    pub json: bool,
    /// The config and devices, as for training.
    #[command(flatten)]
    pub flags: Flags,
}

/// `train flight` and `train checkpoints`: a run directory.
#[derive(Debug, clap::Args)]
pub struct FlightArgs {
    /// The run directory.
    #[command(flatten)]
    pub run: RunDir,
}

/// A run directory, given as `RUN_DIR` or as `--run RUN_DIR` (as `sample`, `chat`, `answer`
/// and `eval` take it).
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct RunDir {
    /// The run directory.
    #[arg(value_name = "RUN_DIR")]
    run: Option<PathBuf>,
    /// The run directory (the same as RUN_DIR).
    #[arg(long = "run", id = "run_flag", value_name = "RUN_DIR")]
    flag: Option<PathBuf>,
}

impl RunDir {
    /// `dir`, as if given as RUN_DIR.
    pub fn new(dir: PathBuf) -> Self {
        Self {
            run: Some(dir),
            flag: None,
        }
    }

    /// The directory, however it was given.
    pub fn path(&self) -> &std::path::Path {
        self.run
            .as_deref()
            .or(self.flag.as_deref())
            .expect("clap requires RUN_DIR or --run")
    }
}

/// Runs `train plot`: one line per chart, written or skipped.
pub fn plot(args: &PlotArgs) -> Result<Vec<String>> {
    let run = args.run.path();
    let out = args.out.clone().unwrap_or_else(|| run.join("plots"));
    let outcomes = crate::plot::plot_run(run, &out, args.width, args.height, args.log_y)?;
    Ok(outcomes
        .into_iter()
        .map(|o| match o {
            crate::plot::Outcome::Written(path) => format!("wrote {}", path.display()),
            crate::plot::Outcome::Skipped(name, why) => format!("skipped {name}.png: {why}"),
        })
        .collect())
}

impl Flags {
    /// The TOML table these flags describe (the config file, or `recipe` when none is
    /// given, with every flag and `--set` applied), the name of its source for errors, and
    /// how the run should start.
    pub fn resolve_table(
        &self,
        recipe: &str,
        recipe_name: &str,
    ) -> Result<(toml::Table, kiln_engine::config::Origin, RunOptions)> {
        let mut options = RunOptions {
            verbose: true,
            explicit_dir: self.run_dir.is_some(),
            ..RunOptions::default()
        };
        let mut config_path = self.config.clone();
        let mut run_dir = self.run_dir.clone();
        if let Some(resume) = &self.resume {
            let (dir, checkpoint) = resolve_resume(resume)?;
            if config_path.is_none() {
                config_path = Some(dir.join("config.toml"));
            }
            run_dir = Some(dir);
            options.resume_from = Some(checkpoint);
        }
        let (mut table, mut origin) = match &config_path {
            Some(p) => kiln_engine::config::read_source(Some(p), &[])?,
            None => {
                let table = toml::from_str(recipe).map_err(|e| {
                    Error::config(format!(
                        "{recipe_name}: invalid TOML: {}",
                        kiln_engine::config::one_line(&e)
                    ))
                })?;
                (table, kiln_engine::config::Origin::file(recipe_name))
            }
        };
        self.apply(&mut table, &mut origin, run_dir.as_deref())?;
        Ok((table, origin, options))
    }

    /// Writes every flag that was given, then every `--set`, into `table`, noting each in
    /// `origin` as the user typed it; `run_dir` is the run's directory (`--run-dir`, or the
    /// run being resumed).
    fn apply(
        &self,
        table: &mut toml::Table,
        origin: &mut kiln_engine::config::Origin,
        run_dir: Option<&std::path::Path>,
    ) -> Result<()> {
        let flag_of: [(&str, &str); 17] = [
            ("hardware.devices", "--devices"),
            ("strategy.name", "--strategy"),
            ("parallel.dp", "--mesh"),
            ("parallel.tp", "--mesh"),
            ("parallel.pp", "--mesh"),
            ("parallel.shard", "--mesh"),
            ("hardware.accelerator", "--accelerator"),
            ("precision.mode", "--precision"),
            ("recompute.mode", "--recompute"),
            ("recompute.every", "--recompute"),
            ("train.epochs", "--epochs"),
            ("train.max_steps", "--max-steps"),
            ("train.batch_size", "--batch-size"),
            ("train.accumulate", "--accumulate"),
            ("optim.lr", "--lr"),
            ("run.seed", "--seed"),
            ("run.name", "--name"),
        ];
        let mut set = |key: &str, value: toml::Value| {
            // `run.dir` comes from --run-dir or --resume: its errors name the file's key.
            if let Some((_, flag)) = flag_of.iter().find(|(k, _)| *k == key) {
                let shown = value.as_str().map_or(value.to_string(), str::to_string);
                origin.note(key, format!("{flag} {shown}"));
            }
            let mut node = &mut *table;
            let parts: Vec<&str> = key.split('.').collect();
            for part in &parts[..parts.len() - 1] {
                node = node
                    .entry(part.to_string())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                    .as_table_mut()
                    .expect("flag sections are tables");
            }
            node.insert(parts[parts.len() - 1].to_string(), value);
        };
        if let Some(d) = &self.devices {
            set("hardware.devices", parse_devices(d)?);
        }
        if let Some(s) = self.strategy {
            set("strategy.name", enum_value(&s));
        }
        if let Some(m) = &self.mesh {
            for (dim, n) in parse_mesh(m)? {
                set(&format!("parallel.{dim}"), toml::Value::Integer(n));
            }
        }
        if let Some(a) = self.accelerator {
            set("hardware.accelerator", enum_value(&a));
        }
        if let Some(p) = self.precision {
            set("precision.mode", enum_value(&p));
        }
        if let Some(r) = &self.recompute {
            let (mode, every) = parse_recompute(r)?;
            set("recompute.mode", toml::Value::String(mode));
            if let Some(k) = every {
                set("recompute.every", toml::Value::Integer(k));
            }
        }
        let ints = [
            ("train.epochs", self.epochs),
            ("train.max_steps", self.max_steps),
            ("train.batch_size", self.batch_size),
            ("train.accumulate", self.accumulate),
        ];
        for (key, v) in ints {
            if let Some(v) = v {
                set(key, toml::Value::Integer(v as i64));
            }
        }
        if let Some(lr) = self.lr {
            set("optim.lr", toml::Value::Float(lr));
        }
        if let Some(seed) = self.seed {
            set("run.seed", toml::Value::Integer(seed as i64));
        }
        if let Some(name) = &self.name {
            set("run.name", toml::Value::String(name.clone()));
        }
        if let Some(dir) = run_dir {
            set("run.dir", toml::Value::String(dir.display().to_string()));
        }
        for o in &self.set {
            let key = apply_override(table, o)?;
            origin.note(&key, format!("--set {}", o.trim()));
        }
        Ok(())
    }
}

fn enum_value<T: serde::Serialize>(v: &T) -> toml::Value {
    toml::Value::try_from(v).expect("enums serialise to strings")
}

/// `--mesh dp=2,tp=2`: each dimension named once, with its size.
fn parse_mesh(raw: &str) -> Result<Vec<(&'static str, i64)>> {
    let mut dims: Vec<(&'static str, i64)> = Vec::new();
    for part in raw.split(',').map(str::trim) {
        let bad = |why: &str| {
            Error::config(format!(
                "--mesh {raw:?}: {why}; expected DIM=N pairs separated by commas, DIM one of \
                 dp, tp, pp, shard (e.g. dp=2,tp=2)"
            ))
        };
        let (dim, n) = part
            .split_once('=')
            .ok_or_else(|| bad(&format!("{part:?} has no `=`")))?;
        let dim = ["dp", "tp", "pp", "shard"]
            .into_iter()
            .find(|d| *d == dim.trim())
            .ok_or_else(|| bad(&format!("{:?} is not a dimension", dim.trim())))?;
        let n: i64 = n
            .trim()
            .parse()
            .ok()
            .filter(|n| *n >= 0)
            .ok_or_else(|| bad(&format!("{dim}={:?} is not a count", n.trim())))?;
        if dims.iter().any(|(d, _)| *d == dim) {
            return Err(bad(&format!("{dim} is given twice")));
        }
        dims.push((dim, n));
    }
    Ok(dims)
}

/// `--recompute none|balanced|blocks|blocks:every=K`: the mode and K when given.
fn parse_recompute(raw: &str) -> Result<(String, Option<i64>)> {
    let bad = || {
        Error::config(format!(
            "--recompute {raw:?}: expected none, balanced, blocks or blocks:every=K (K >= 1)"
        ))
    };
    let (mode, rest) = match raw.split_once(':') {
        Some((m, r)) => (m.trim(), Some(r.trim())),
        None => (raw.trim(), None),
    };
    if !["none", "balanced", "blocks"].contains(&mode) {
        return Err(bad());
    }
    let every = match rest {
        None => None,
        Some(r) if mode == "blocks" => {
            let k = r
                .strip_prefix("every=")
                .and_then(|k| k.trim().parse::<i64>().ok())
                .filter(|k| *k >= 1)
                .ok_or_else(bad)?;
            Some(k)
        }
        Some(_) => return Err(bad()),
    };
    Ok((mode.to_string(), every))
}

/// `--devices 4` or `--devices 0,2,3`.
fn parse_devices(raw: &str) -> Result<toml::Value> {
    let bad = || {
        Error::config(format!(
            "--devices {raw:?}: expected a device count (e.g. 4) or a list of indices (e.g. 0,2,3)"
        ))
    };
    if raw.contains(',') {
        let list: std::result::Result<Vec<toml::Value>, _> = raw
            .split(',')
            .map(|p| p.trim().parse::<i64>().map(toml::Value::Integer))
            .collect();
        Ok(toml::Value::Array(list.map_err(|_| bad())?))
    } else {
        raw.trim()
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .map(toml::Value::Integer)
            .ok_or_else(bad)
    }
}

/// `devices`: prints the hardware report; returns the exit code.
pub(crate) fn print_devices() -> i32 {
    // A runtime that fails to start is reported in the list, its panic kept off the terminal.
    let report = kiln_engine::run::devices_report();
    for line in report {
        println!("{line}");
    }
    0
}

/// `plot`: draws the charts and prints what was written; returns the exit code.
pub(crate) fn print_plot(args: &PlotArgs) -> i32 {
    match plot(args) {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            kiln_engine::error::exit::REFUSED
        }
    }
}

/// `flight`: prints where each rank was and which is behind; returns the exit code.
pub(crate) fn print_flight(args: &FlightArgs) -> i32 {
    match kiln_engine::flight::report(args.run.path()) {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            kiln_engine::error::exit::REFUSED
        }
    }
}

/// `checkpoints`: one line per checkpoint of `run` (newest last) saying whether its files
/// verify; returns the exit code (0 when one verifies, the one a resume would start from; 2
/// when none does or there are none).
pub(crate) fn print_checkpoints(run: &std::path::Path) -> i32 {
    match kiln_engine::checkpoint::report(run) {
        Ok((lines, whole)) => {
            for line in lines {
                println!("{line}");
            }
            if whole.is_some() {
                kiln_engine::error::exit::DONE
            } else {
                eprintln!("error: {}: no checkpoint is whole", run.display());
                kiln_engine::error::exit::REFUSED
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            kiln_engine::error::exit::REFUSED
        }
    }
}

/// Starts the processes (MPI under a launcher) and the signal handlers, runs `train` (which
/// returns `None` when it only printed the config) and reports how the run ended; returns the
/// exit code ([`kiln_engine::error::exit`]): 0 done, 2 refused, 3 stopped by a signal with a
/// checkpoint, 4 failed while running, 5 diverged.
pub(crate) fn run_training(train: impl FnOnce() -> Result<Option<RunResult>>) -> i32 {
    // Under a launcher with several processes, MPI starts here (or the run is refused).
    let _processes = match kiln_engine::comm::start(kiln_engine::comm::Processes::from_env()) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("error: {e}");
            return kiln_engine::error::exit::REFUSED;
        }
    };
    kiln_engine::signal::install();
    let mut stopped = false;
    let launched = _processes.is_some();
    let outcome = train().map(|result| {
        let Some(result) = result else {
            return;
        };
        stopped = result.summary.stopped_by.is_some();
        if stopped && launched {
            // A launcher taking the job down stops reading its output: the last lines must not
            // keep the process from leaving (they are dropped if the pipe is full).
            unblock_output();
        }
        if kiln_engine::comm::processes().index != 0 {
            return;
        }
        let s = &result.summary;
        if let Some(signal) = &s.stopped_by {
            let program = std::env::args()
                .next()
                .and_then(|p| {
                    std::path::Path::new(&p)
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                })
                .unwrap_or_else(|| "train".to_string());
            say!(
                "stopped by {signal} after step {}: checkpoint written; continue with `{program} \
                 --resume {}`",
                s.steps,
                result.dir.display()
            );
            return;
        }
        if result.evaluated {
            return;
        }
        if let Some(reason) = &s.stopped_early {
            say!(
                "stopped early after step {}: {reason}; checkpoint written",
                s.steps
            );
        }
        let acc = s.val_accuracy.map_or(String::new(), |a| {
            format!(", val accuracy {:.2}%", a * 100.0)
        });
        say!(
            "done: {} steps in {:.1}s ({:.0} samples/s), val loss {}{acc} → {}",
            s.steps,
            s.wall_seconds,
            s.samples_per_sec,
            s.val_loss.map_or("n/a".into(), |l| format!("{l:.4}")),
            result.dir.display()
        );
    });
    match outcome {
        Ok(()) if stopped && launched => {
            // Every rank has stopped at one step and the checkpoint is written: leave now. A
            // launcher that was itself signalled (mpirun on SIGTERM) is taking the job down,
            // and MPI's finalize would wait for it until it kills the process.
            let _ = std::io::stdout().flush();
            let _ = std::io::stderr().flush();
            // SAFETY: `_exit` ends the process at once, after the flushes above.
            unsafe { libc::_exit(kiln_engine::signal::STOPPED_EXIT_CODE) }
        }
        Ok(()) if stopped => kiln_engine::signal::STOPPED_EXIT_CODE,
        Ok(()) => kiln_engine::error::exit::DONE,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}

/// Makes writes to stdout and stderr return at once when their pipe is full (the line is
/// then lost) instead of waiting for a reader.
fn unblock_output() {
    for fd in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        // SAFETY: F_GETFL/F_SETFL on the process's own standard descriptors; a failure leaves
        // the descriptor as it was.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
    }
}
