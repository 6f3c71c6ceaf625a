//! A program's own training command line: one call in its `main` gives it kiln's `train`
//! command line (every flag, `--config`, `--set`, `--resume`, `--print-config`, `devices`
//! and `plot`) around its own model and data. kiln's own `train` is such a program
//! ([`crate::builtin`]).
//!
//! The program's `[model]` and `[data]` sections are its own serde types; every other section
//! is kiln's. Both are checked the same way: an unknown key or a value of the wrong type is one
//! line naming the file and the dotted key.
//!
//! ```ignore
//! fn main() {
//!     // `build` makes the program's `Workload` from its config (`UserConfig<MyModel, MyData>`).
//!     kiln::App::new("mytrain", "Train my model")
//!         .recipe(include_str!("../configs/mytrain.toml"))
//!         .main(build);
//! }
//! ```

use std::ffi::OsString;
use std::path::Path;
use std::rc::Rc;

use clap::{CommandFactory, FromArgMatches};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::cli::{EvalArgs, Flags, FlightArgs, PlanArgs, PlotArgs};
use kiln_engine::config::{LoaderConfig, Origin, RootConfig, one_line, read_source, section};
use kiln_engine::error::{Error, Result};
use kiln_engine::run::{RunInfo, RunOptions, RunResult, train_workload};
use kiln_engine::strategy::Setup;
use kiln_engine::trainer::Workload;

/// A program's whole config: its own `[model]` and `[data]`, and kiln's sections.
#[derive(Debug, Clone, PartialEq)]
pub struct UserConfig<M, D> {
    /// The program's `[model]` section.
    pub model: M,
    /// The program's `[data]` section.
    pub data: D,
    /// Every other section: run, train, optim, schedule, groups, hardware, strategy, …
    pub kiln: RootConfig,
}

/// Whether `message` refuses an unknown top-level key (`…: key `name`: unknown field …`, a key
/// without a dot): a section the config does not have.
fn unknown_section(message: &str) -> bool {
    message
        .split_once(": key `")
        .and_then(|(_, rest)| rest.split_once("`: unknown field `"))
        .is_some_and(|(key, _)| !key.contains('.'))
}

impl<M, D> UserConfig<M, D>
where
    M: Serialize + DeserializeOwned,
    D: Serialize + DeserializeOwned,
{
    /// Reads a config file (none: every section's defaults), applies `--set key=value`
    /// overrides and checks the result.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Self> {
        let (table, origin) = read_source(path, overrides)?;
        Self::from_source(table, &origin)
    }

    /// Builds the config from a TOML table; `origin` names its source in errors. A missing
    /// `[model]` or `[data]` is read as an empty section (the type's defaults, or its error).
    pub fn from_table(table: toml::Table, origin: &str) -> Result<Self> {
        Self::from_source(table, &Origin::file(origin))
    }

    /// [`UserConfig::from_table`], an error naming where the refused value came from: the
    /// file, or what the command line typed for its key.
    pub fn from_source(mut table: toml::Table, origin: &Origin) -> Result<Self> {
        let mut take = |name: &str| {
            table
                .remove(name)
                .unwrap_or_else(|| toml::Value::Table(toml::Table::new()))
        };
        let model = take("model");
        let mut data = take("data");
        // `data.workers` and `data.prefetch` are kiln's: every program's loader has them.
        let mut loader = toml::Table::new();
        if let toml::Value::Table(t) = &mut data {
            for key in LoaderConfig::KEYS {
                if let Some(v) = t.remove(key) {
                    loader.insert(key.to_string(), v);
                }
            }
        }
        let loader: LoaderConfig = section(toml::Value::Table(loader), "data", origin)?;
        let mut kiln = RootConfig::from_source(table, origin).map_err(|e| match e {
            // An unknown section (a key of no dot): kiln's are listed, and the program's two
            // are sections too.
            Error::Config(m) if unknown_section(&m) => {
                Error::Config(format!("{m}, and the program's `data`, `model`"))
            }
            e => e,
        })?;
        loader.check().map_err(|e| origin.name(e))?;
        kiln.loader = loader;
        Ok(Self {
            model: section(model, "model", origin)?,
            data: section(data, "data", origin).map_err(|e| match e {
                // The program's fields are listed; kiln's two are keys of `[data]` as well.
                Error::Config(m) if m.contains("unknown field") => {
                    Error::Config(format!("{m} (and kiln's `workers`, `prefetch`)"))
                }
                e => e,
            })?,
            kiln,
        })
    }

    /// The program's `[data]` with kiln's keys in it (`workers`, `prefetch`).
    fn data_value(&self) -> toml::Value {
        let mut data = to_value(&self.data);
        if let (toml::Value::Table(t), toml::Value::Table(own)) =
            (&mut data, to_value(&self.kiln.loader))
        {
            t.extend(own);
        }
        data
    }

    /// The program's sections as TOML values: what a run directory's `config.toml` keeps
    /// beside kiln's.
    pub fn sections(&self) -> Vec<(String, toml::Value)> {
        vec![
            ("model".to_string(), to_value(&self.model)),
            ("data".to_string(), self.data_value()),
        ]
    }

    /// The whole config as TOML text: `[run]`, the program's `[data]` and `[model]`, then
    /// kiln's other sections, each in its fields' order.
    pub fn to_toml(&self) -> String {
        #[derive(Serialize)]
        struct Own<'a, M> {
            data: toml::Value,
            model: &'a M,
        }
        let kiln = self.kiln.to_toml();
        let own = toml::to_string_pretty(&Own {
            data: self.data_value(),
            model: &self.model,
        })
        .expect("a program's sections serialise");
        // kiln's text opens with `[run]`, which holds no table of its own: the program's
        // sections go before the next header.
        match kiln.find("\n[") {
            Some(at) => format!("{}{own}{}", &kiln[..=at], &kiln[at..]),
            None => format!("{kiln}\n{own}"),
        }
    }
}

/// A section as a TOML value (a type TOML cannot hold reads as an empty section).
fn to_value<T: Serialize>(v: &T) -> toml::Value {
    toml::Value::try_from(v).unwrap_or_else(|_| toml::Value::Table(toml::Table::new()))
}

/// A subcommand of a program's own (`train sample`).
type Handler<'a> = Rc<dyn Fn(&clap::ArgMatches) -> Result<()> + 'a>;

/// A program's own command line; see the module documentation.
#[derive(Clone)]
pub struct App<'a> {
    /// The program's name (in `--help` and the start-up table).
    pub name: &'a str,
    /// One line about it.
    pub about: &'a str,
    /// The TOML recipe used when no `--config` is given.
    pub recipe: &'a str,
    /// How errors name the recipe (default: "NAME's built-in recipe").
    pub recipe_origin: Option<&'a str>,
    /// The version `--version` prints (none: no `--version`).
    pub version: Option<&'a str>,
    commands: Vec<(clap::Command, Handler<'a>)>,
}

impl std::fmt::Debug for App<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("name", &self.name)
            .field("about", &self.about)
            .field("recipe_origin", &self.recipe_origin)
            .field("version", &self.version)
            .field(
                "commands",
                &self
                    .commands
                    .iter()
                    .map(|(c, _)| c.get_name().to_string())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Commands besides training, in a program's own command line.
#[derive(Debug, clap::Subcommand)]
pub enum AppCommand {
    /// List the devices kiln can see and what `--accelerator auto` would choose.
    Devices,
    /// Draw a run's metrics as PNG charts (loss, named metrics, throughput, memory).
    Plot(PlotArgs),
    /// Say where each rank was from a run's flight records, and which rank is behind.
    Flight(FlightArgs),
    /// List a run's checkpoints: step, files, whether each verifies, the best one.
    Checkpoints(FlightArgs),
    /// Evaluate a model on the config's validation set without training: a run (`--run
    /// RUN_DIR`, its exported model) or the config's `init.from`, on the configured devices.
    Eval(EvalArgs),
    /// Predict, before a run, each strategy × precision × recompute × micro-batch's memory
    /// per device and process and its step time, on these devices; the fastest that fits
    /// first, with its flags.
    Plan(PlanArgs),
    /// Run training and start it again after a failure, on the hosts that answer, with the
    /// same samples per step (`train launch --run-dir DIR [--hosts ...] -- TRAIN_ARGS`).
    Launch(crate::launcher::LaunchArgs),
    /// Print a completion script for a shell: `source <(train completions bash)`, or write it
    /// where the shell looks (`train completions zsh > ~/.zfunc/_train`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff): `train man > train.1; man ./train.1`.
    Man,
}

/// A program's parsed command line.
#[derive(Debug, clap::Parser)]
#[command(args_conflicts_with_subcommands = true)]
pub struct AppArgs {
    /// Something other than training.
    #[command(subcommand)]
    pub command: Option<AppCommand>,
    /// The training flags.
    #[command(flatten)]
    pub flags: Flags,
}

/// What a command line asked for.
enum Parsed<'h, 'a> {
    /// A program's own subcommand, with its arguments.
    Own(&'h Handler<'a>, clap::ArgMatches),
    /// Training, `devices` or `plot`.
    Kiln(Box<AppArgs>),
}

impl<'a> App<'a> {
    /// A program `name` that trains from `[model]`/`[data]` defaults and kiln's when no
    /// `--config` is given.
    pub fn new(name: &'a str, about: &'a str) -> Self {
        Self {
            name,
            about,
            recipe: "",
            recipe_origin: None,
            version: None,
            commands: Vec::new(),
        }
    }

    /// The same program with `recipe` (TOML text, e.g. `include_str!` of a file in
    /// `configs/`) as its default config.
    pub fn recipe(self, recipe: &'a str) -> Self {
        Self { recipe, ..self }
    }

    /// The same program naming its built-in recipe `origin` in errors.
    pub fn recipe_origin(self, origin: &'a str) -> Self {
        Self {
            recipe_origin: Some(origin),
            ..self
        }
    }

    /// The same program with a `--version` that prints `version`.
    pub fn version(self, version: &'a str) -> Self {
        Self {
            version: Some(version),
            ..self
        }
    }

    /// The same program with a subcommand of its own: `name` takes the arguments `A` and runs
    /// `run` (an error is the program's one-line error, exit code 2).
    pub fn command<A>(
        mut self,
        name: &'static str,
        about: &'static str,
        run: impl Fn(A) -> Result<()> + 'a,
    ) -> Self
    where
        A: clap::Args + FromArgMatches,
    {
        let command = A::augment_args(clap::Command::new(name)).about(about);
        let handler: Handler<'a> =
            Rc::new(move |m: &clap::ArgMatches| run(A::from_arg_matches(m).map_err(clap_error)?));
        self.commands.push((command, handler));
        self
    }

    /// The program's clap command: kiln's flags and subcommands, and the program's own
    /// subcommands listed first.
    fn command_line(&self) -> clap::Command {
        let mut command = AppArgs::command()
            .name(self.name.to_owned())
            .about(self.about.to_owned());
        if let Some(v) = self.version {
            command = command.version(v.to_owned());
        }
        for (i, (own, _)) in self.commands.iter().enumerate() {
            command = command.subcommand(own.clone().display_order(i));
        }
        let first = self.commands.len();
        for (i, name) in [
            "devices",
            "plot",
            "flight",
            "checkpoints",
            "launch",
            "completions",
            "man",
        ]
        .into_iter()
        .enumerate()
        {
            command = command.mut_subcommand(name, |c| c.display_order(first + i));
        }
        command
    }

    /// Writes the program's manual page (roff) to standard output.
    fn print_man(&self) -> i32 {
        let man = clap_mangen::Man::new(self.command_line());
        match man.render(&mut std::io::stdout()) {
            Ok(()) => 0,
            // A reader that went away (`train man | head`) ends it.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 0,
            Err(e) => {
                eprintln!("error: cannot write the manual page: {e}");
                2
            }
        }
    }

    /// Writes the completion script for `shell` to standard output.
    fn print_completions(&self, shell: clap_complete::Shell) -> i32 {
        // Made in memory first: clap_complete panics on a failed write.
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut self.command_line(), self.name, &mut script);
        match std::io::Write::write_all(&mut std::io::stdout(), &script) {
            Ok(()) => 0,
            // A reader that went away (`train completions bash | grep -q …`) ends it.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 0,
            Err(e) => {
                eprintln!("error: cannot write the completion script: {e}");
                2
            }
        }
    }

    /// Parses `args` (the program's name first).
    pub fn parse<I, T>(&self, args: I) -> std::result::Result<AppArgs, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let matches = self.command_line().try_get_matches_from(args)?;
        AppArgs::from_arg_matches(&matches)
    }

    fn parse_all<I, T>(&self, args: I) -> std::result::Result<Parsed<'_, 'a>, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let matches = self.command_line().try_get_matches_from(args)?;
        if let Some((name, sub)) = matches.subcommand()
            && let Some((_, handler)) = self.commands.iter().find(|(c, _)| c.get_name() == name)
        {
            return Ok(Parsed::Own(handler, sub.clone()));
        }
        Ok(Parsed::Kiln(Box::new(AppArgs::from_arg_matches(&matches)?)))
    }

    /// The config `flags` describe, and how the run should start. Besides each section's
    /// checks, the strategy refuses what it cannot run on the ranks this launch gives it.
    pub fn resolve<M, D>(&self, flags: &Flags) -> Result<(UserConfig<M, D>, RunOptions)>
    where
        M: Serialize + DeserializeOwned,
        D: Serialize + DeserializeOwned,
    {
        self.resolve_checked(flags, &|_: &UserConfig<M, D>| Ok(()))
    }

    /// [`Self::resolve`], with `check` refusing what the program's own sections cannot run.
    fn resolve_checked<M, D>(
        &self,
        flags: &Flags,
        check: &dyn Fn(&UserConfig<M, D>) -> Result<()>,
    ) -> Result<(UserConfig<M, D>, RunOptions)>
    where
        M: Serialize + DeserializeOwned,
        D: Serialize + DeserializeOwned,
    {
        let default_origin = format!("{}'s built-in recipe", self.name);
        let origin = self.recipe_origin.unwrap_or(&default_origin);
        let (table, origin, options) = flags.resolve_table(self.recipe, origin)?;
        let config = UserConfig::from_source(table, &origin)?;
        check(&config).map_err(|e| origin.name(e))?;
        // The launcher's processes, each running the configured devices, are the world.
        let processes = kiln_engine::comm::Processes::from_env().count;
        let world = config.kiln.hardware.devices.indices().len() * processes;
        Setup::new(&config.kiln, world)
            .check()
            .map_err(|e| origin.name(e))?;
        Ok((config, options))
    }

    /// Runs the command line of this process and exits with its code (0 done, 2 error, 3
    /// stopped by a signal with a checkpoint).
    pub fn main<M, D, W>(&self, build: impl FnOnce(&UserConfig<M, D>) -> Result<W>) -> !
    where
        M: Serialize + DeserializeOwned,
        D: Serialize + DeserializeOwned,
        W: Workload,
        W::Model: burn::store::ModuleSnapshot,
    {
        kiln_engine::panics::quiet_worker_panics();
        std::process::exit(self.run(std::env::args_os(), build))
    }

    /// Runs the command line `args` (the program's name first); returns the exit code.
    pub fn run<M, D, W, I, T>(
        &self,
        args: I,
        build: impl FnOnce(&UserConfig<M, D>) -> Result<W>,
    ) -> i32
    where
        M: Serialize + DeserializeOwned,
        D: Serialize + DeserializeOwned,
        W: Workload,
        W::Model: burn::store::ModuleSnapshot,
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let train = |config: &UserConfig<M, D>, options: &RunOptions| {
            let workload = build(config)?;
            let info = RunInfo {
                model: self.name.to_string(),
                sections: config.sections(),
                ..RunInfo::default()
            };
            train_workload(&config.kiln, options, &workload, info, |_| Ok(()))
        };
        self.run_with(args, |_| Ok(()), train)
    }

    /// [`Self::main`] for a program that runs its training itself: `check` refuses what its
    /// own sections cannot run (before anything is printed or written), and `train` trains
    /// (usually through [`train_workload`], with the workload the config asks for).
    pub fn main_with<M, D>(
        &self,
        check: impl Fn(&UserConfig<M, D>) -> Result<()>,
        train: impl FnOnce(&UserConfig<M, D>, &RunOptions) -> Result<RunResult>,
    ) -> !
    where
        M: Serialize + DeserializeOwned,
        D: Serialize + DeserializeOwned,
    {
        kiln_engine::panics::quiet_worker_panics();
        std::process::exit(self.run_with(std::env::args_os(), check, train))
    }

    /// [`Self::main_with`] on the command line `args`; returns the exit code.
    pub fn run_with<M, D, I, T>(
        &self,
        args: I,
        check: impl Fn(&UserConfig<M, D>) -> Result<()>,
        train: impl FnOnce(&UserConfig<M, D>, &RunOptions) -> Result<RunResult>,
    ) -> i32
    where
        M: Serialize + DeserializeOwned,
        D: Serialize + DeserializeOwned,
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let args = match self.parse_all(args) {
            Ok(Parsed::Kiln(args)) => args,
            Ok(Parsed::Own(handler, matches)) => {
                return match handler(&matches) {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("error: {e}");
                        2
                    }
                };
            }
            Err(e) => {
                let _ = e.print();
                return if e.use_stderr() { 2 } else { 0 };
            }
        };
        match &args.command {
            Some(AppCommand::Devices) => return crate::cli::print_devices(),
            Some(AppCommand::Plot(plot)) => return crate::cli::print_plot(plot),
            Some(AppCommand::Flight(flight)) => return crate::cli::print_flight(flight),
            Some(AppCommand::Checkpoints(run)) => {
                return crate::cli::print_checkpoints(run.run.path());
            }
            Some(AppCommand::Launch(launch)) => return crate::launcher::run(launch),
            Some(AppCommand::Completions { shell }) => {
                return self.print_completions(*shell);
            }
            Some(AppCommand::Man) => return self.print_man(),
            Some(AppCommand::Eval(eval)) => {
                return crate::cli::run_training(|| {
                    let flags = eval.flags()?;
                    let (config, mut options) = self.resolve_checked::<M, D>(&flags, &check)?;
                    options.evaluate = true;
                    train(&config, &options).map(Some)
                });
            }
            Some(AppCommand::Plan(plan)) => {
                return crate::cli::run_training(|| {
                    let (config, mut options) =
                        self.resolve_checked::<M, D>(&plan.flags, &check)?;
                    options.plan = Some(plan.json);
                    options.verbose = false;
                    train(&config, &options).map(Some)
                });
            }
            None => {}
        }
        crate::cli::run_training(|| {
            let (config, options) = self.resolve_checked::<M, D>(&args.flags, &check)?;
            if args.flags.print_config {
                print!("{}", config.to_toml());
                return Ok(None);
            }
            train(&config, &options).map(Some)
        })
    }
}

/// A clap error as kiln's.
fn clap_error(e: clap::Error) -> Error {
    Error::config(one_line(&e.to_string()))
}
