//! A program's own training command line: one call in its `main` gives it kiln's `train`
//! command line (every flag, `--config`, `--set`, `--resume`, `--print-config`, `devices`
//! and `plot`) around its own model and data.
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

use clap::{CommandFactory, FromArgMatches};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::cli::{Flags, PlotArgs};
use crate::config::{RootConfig, one_line};
use crate::error::{Error, Result};
use crate::run::{RunInfo, RunOptions, train_workload};
use crate::trainer::Workload;

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

impl<M, D> UserConfig<M, D>
where
    M: Serialize + DeserializeOwned,
    D: Serialize + DeserializeOwned,
{
    /// Builds the config from a TOML table; `origin` names its source in errors. A missing
    /// `[model]` or `[data]` is read as an empty section (the type's defaults, or its error).
    pub fn from_table(mut table: toml::Table, origin: &str) -> Result<Self> {
        let mut take = |name: &str| {
            table
                .remove(name)
                .unwrap_or_else(|| toml::Value::Table(toml::Table::new()))
        };
        let model = take("model");
        let data = take("data");
        Ok(Self {
            model: section(model, "model", origin)?,
            data: section(data, "data", origin)?,
            kiln: RootConfig::from_table(table, origin)?,
        })
    }

    /// The program's sections as TOML values: what a run directory's `config.toml` keeps
    /// beside kiln's.
    pub fn sections(&self) -> Vec<(String, toml::Value)> {
        vec![
            ("model".to_string(), to_value(&self.model)),
            ("data".to_string(), to_value(&self.data)),
        ]
    }

    /// The whole config as TOML text.
    pub fn to_toml(&self) -> String {
        let mut table: toml::Table =
            toml::from_str(&self.kiln.to_toml()).expect("a config's TOML reads back");
        table.remove("model");
        table.remove("data");
        for (name, value) in self.sections() {
            table.insert(name, value);
        }
        toml::to_string_pretty(&table).expect("a table serialises")
    }
}

/// A section as a TOML value (a type TOML cannot hold reads as an empty section).
fn to_value<T: Serialize>(v: &T) -> toml::Value {
    toml::Value::try_from(v).unwrap_or_else(|_| toml::Value::Table(toml::Table::new()))
}

/// Section `name` of `origin` as a `T`, with kiln's one-line errors: the dotted key, and what
/// was expected. Keys `T` does not know are errors even where `T` does not deny them.
pub fn section<T: DeserializeOwned>(value: toml::Value, name: &str, origin: &str) -> Result<T> {
    let key = |path: &str| {
        if path.is_empty() || path == "." {
            name.to_string()
        } else {
            format!("{name}.{path}")
        }
    };
    let mut unknown = Vec::new();
    let parsed: std::result::Result<T, _> = serde_path_to_error::deserialize(
        serde_ignored::Deserializer::new(value, &mut |path: serde_ignored::Path<'_>| {
            unknown.push(path.to_string())
        }),
    );
    let parsed = parsed.map_err(|e| {
        let path = e.path().to_string();
        let inner = crate::config::humanize(&one_line(e.inner()), &path);
        Error::config(format!("{origin}: key `{}`: {inner}", key(&path)))
    })?;
    if let Some(path) = unknown.first() {
        let field = path.rsplit('.').next().unwrap_or(path);
        return Err(Error::config(format!(
            "{origin}: key `{}`: unknown field `{field}`",
            key(path)
        )));
    }
    Ok(parsed)
}

/// A program's own command line; see the module documentation.
#[derive(Debug, Clone)]
pub struct App<'a> {
    /// The program's name (in `--help` and the start-up table).
    pub name: &'a str,
    /// One line about it.
    pub about: &'a str,
    /// The TOML recipe used when no `--config` is given.
    pub recipe: &'a str,
}

/// Commands besides training, in a program's own command line.
#[derive(Debug, clap::Subcommand)]
pub enum AppCommand {
    /// List the devices kiln can see and what `--accelerator auto` would choose.
    Devices,
    /// Draw a run's metrics as PNG charts (loss, named metrics, throughput, memory).
    Plot(PlotArgs),
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

impl<'a> App<'a> {
    /// A program `name` that trains from `[model]`/`[data]` defaults and kiln's when no
    /// `--config` is given.
    pub fn new(name: &'a str, about: &'a str) -> Self {
        Self {
            name,
            about,
            recipe: "",
        }
    }

    /// The same program with `recipe` (TOML text, e.g. `include_str!` of a file in
    /// `configs/`) as its default config.
    pub fn recipe(self, recipe: &'a str) -> Self {
        Self { recipe, ..self }
    }

    /// Parses `args` (the program's name first).
    pub fn parse<I, T>(&self, args: I) -> std::result::Result<AppArgs, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let command = AppArgs::command()
            .name(self.name.to_owned())
            .about(self.about.to_owned());
        let matches = command.try_get_matches_from(args)?;
        AppArgs::from_arg_matches(&matches)
    }

    /// The config `flags` describe, and how the run should start.
    pub fn resolve<M, D>(&self, flags: &Flags) -> Result<(UserConfig<M, D>, RunOptions)>
    where
        M: Serialize + DeserializeOwned,
        D: Serialize + DeserializeOwned,
    {
        let (table, origin, options) =
            flags.resolve_table(self.recipe, &format!("{}'s built-in recipe", self.name))?;
        Ok((UserConfig::from_table(table, &origin)?, options))
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
        crate::cli::quiet_worker_panics();
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
        let args = match self.parse(args) {
            Ok(args) => args,
            Err(e) => {
                let _ = e.print();
                return if e.use_stderr() { 2 } else { 0 };
            }
        };
        match &args.command {
            Some(AppCommand::Devices) => return crate::cli::print_devices(),
            Some(AppCommand::Plot(plot)) => return crate::cli::print_plot(plot),
            None => {}
        }
        crate::cli::run_training(|| {
            let (config, options) = self.resolve::<M, D>(&args.flags)?;
            if args.flags.print_config {
                print!("{}", config.to_toml());
                return Ok(None);
            }
            let workload = build(&config)?;
            let info = RunInfo {
                model: self.name.to_string(),
                rows: Vec::new(),
                builtin_sections: false,
                sections: config.sections(),
            };
            train_workload(&config.kiln, &options, &workload, info, |_| Ok(())).map(Some)
        })
    }
}
