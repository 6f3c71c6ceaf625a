//! `RootConfig`: every section of the engine's config, read from a TOML table and checked
//! section by section, then across sections.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::finetune::{ExportConfig, FinetuneConfig};
use super::hardware::{HardwareConfig, MonitorConfig};
use super::init::InitConfig;
use super::names::{bad, one_line, refusal};
use super::optim::{
    GroupConfig, OptimConfig, OptimizerKind, ScheduleConfig, check_optim, is_group_name,
};
use super::overrides::{Origin, read_source};
use super::parallel::{
    DdpConfig, DilocoConfig, DistConfig, ParallelConfig, PipelineConfig, StrategyConfig,
};
use super::precision::{PrecisionConfig, PrecisionMode, RecomputeConfig, RecomputeMode};
use super::train::{LoaderConfig, RunConfig, TrainConfig};
use crate::error::{Error, Result};

/// The engine's configuration: every section but a program's own `[model]` and `[data]` (see
/// `kiln::UserConfig`). Each component receives only its own section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RootConfig {
    /// Naming, seeding and output location of the run.
    pub run: RunConfig,
    /// Loop settings: length, batch, logging, validation, checkpoints.
    pub train: TrainConfig,
    /// The optimizer.
    pub optim: OptimConfig,
    /// The learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// Accelerator and devices.
    pub hardware: HardwareConfig,
    /// How one step's work is split across the devices.
    pub strategy: StrategyConfig,
    /// The device mesh: data × tensor × pipeline ranks.
    pub parallel: ParallelConfig,
    /// Pipeline parallelism (with `strategy.name = "pipeline"`).
    pub pipeline: PipelineConfig,
    /// DiLoCo's outer loop (with `strategy.name = "diloco"`).
    pub diloco: DilocoConfig,
    /// Data-parallel settings.
    pub ddp: DdpConfig,
    /// Deadlines of collectives, the flight recorder, collective checks and stragglers.
    pub dist: DistConfig,
    /// Monitoring: where metrics go.
    pub monitor: MonitorConfig,
    /// Numeric precision of replicas, master weights and gradient reduction.
    pub precision: PrecisionConfig,
    /// Activation checkpointing (recomputation during backward).
    pub recompute: RecomputeConfig,
    /// The weights a new run starts from (a file another run, Burn or PyTorch wrote).
    #[serde(skip_serializing_if = "InitConfig::is_default")]
    pub init: InitConfig,
    /// Frozen parts of the model and LoRA adapters.
    #[serde(skip_serializing_if = "FinetuneConfig::is_default")]
    pub finetune: FinetuneConfig,
    /// How the final weights are written.
    #[serde(skip_serializing_if = "ExportConfig::is_default")]
    pub export: ExportConfig,
    /// The optimizer and schedule of each parameter group of a model that steps several
    /// optimizers (`[groups.generator.optim]`); each inherits `[optim]` and `[schedule]` key
    /// by key. A group the model names and this omits uses `[optim]` and `[schedule]` as
    /// they are.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub groups: std::collections::BTreeMap<String, GroupConfig>,
    /// `data.workers` and `data.prefetch`: kiln's two keys of a program's `[data]` (read and
    /// written there by `kiln::UserConfig`).
    #[serde(skip)]
    pub loader: LoaderConfig,
}

impl RootConfig {
    /// Reads a config file, applies `--set key=value` overrides and checks the result.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Self> {
        let (table, origin) = read_source(path, overrides)?;
        Self::from_source(table, &origin)
    }

    /// Builds the typed config from a TOML table; `origin` names the source in errors.
    pub fn from_table(table: toml::Table, origin: &str) -> Result<Self> {
        Self::from_source(table, &Origin::file(origin))
    }

    /// [`RootConfig::from_table`], an error naming where the refused value came from: the
    /// file, or what the command line typed for its key.
    pub fn from_source(mut table: toml::Table, origin: &Origin) -> Result<Self> {
        inherit_group_sections(&mut table);
        let de = toml::Value::Table(table);
        let mut config: RootConfig = serde_path_to_error::deserialize(de.clone()).map_err(|e| {
            let path = e.path().to_string();
            let inner = refusal::<RootConfig>(&de, &path, &one_line(e.inner()));
            Error::config(format!("{}: key `{path}`: {inner}", origin.of(&path)))
        })?;
        config.mesh_names().map_err(|e| origin.name(e))?;
        // A value that parses but cannot work names its source too.
        config.validate().map_err(|e| origin.name(e))?;
        Ok(config)
    }

    /// The strategy `auto` resolves to on `ranks` ranks: by the ranks the data dimension spans
    /// (`ranks / parallel.tp`).
    pub fn strategy_on(&self, ranks: usize) -> super::parallel::StrategyKind {
        let data = (ranks / self.parallel.tp.max(1)).max(1);
        self.strategy.name.resolve(data)
    }

    /// The strategy and stages that `[parallel]`'s `shard` and `pp` name, written into
    /// `strategy.name` and `pipeline.stages`, so that everything downstream reads one value.
    fn mesh_names(&mut self) -> Result<()> {
        self.parallel.check()?;
        self.strategy.name = self.parallel.strategy(self.strategy.name)?;
        if let Some(pp) = self.parallel.pp {
            if self.pipeline.stages != 1 && self.pipeline.stages != pp {
                return bad(
                    "parallel.pp",
                    format!(
                        "is {pp}, but pipeline.stages is {}; give one",
                        self.pipeline.stages
                    ),
                );
            }
            self.pipeline.stages = pp;
        }
        Ok(())
    }

    /// Rejects values that parse but cannot work, naming the key: each section's own checks,
    /// then what ties sections together. What a strategy refuses for a number of ranks is the
    /// strategy's to say (`strategy::Setup::check`), once the world is known.
    pub fn validate(&self) -> Result<()> {
        self.train.check()?;
        check_optim("", &self.optim, &self.schedule)?;
        for (name, group) in &self.groups {
            if !is_group_name(name) {
                return bad(
                    &format!("groups.{name}"),
                    "a group name is lower-case letters, digits, `_` and `-`".into(),
                );
            }
            check_optim(&format!("groups.{name}."), &group.optim, &group.schedule)?;
        }
        self.ddp.check()?;
        self.diloco.check()?;
        self.dist.check()?;
        self.precision.check()?;
        if self.ddp.sync_batchnorm && self.recompute.mode == RecomputeMode::Blocks {
            return bad(
                "ddp.sync_batchnorm",
                "runs the model segment by segment and cannot be combined with recompute.mode \
                 = \"blocks\" (use \"balanced\" or \"none\")"
                    .into(),
            );
        }
        self.check_f16_eps()?;
        self.recompute.check()?;
        self.monitor.check()?;
        self.hardware.check()?;
        self.pipeline.check(self.strategy.name)?;
        self.loader.check()?;
        self.init.check()?;
        self.finetune.check()?;
        self.export.check()?;
        self.run.check()
    }

    /// Under `16-true` AdamW's state lives in f16, whose smallest normal number is 6.1e-5:
    /// an epsilon below it flushes towards zero and the update divides by zero.
    fn check_f16_eps(&self) -> Result<()> {
        if self.precision.mode != PrecisionMode::F16True {
            return Ok(());
        }
        let optims = std::iter::once((String::new(), &self.optim)).chain(
            self.groups
                .iter()
                .map(|(name, g)| (format!("groups.{name}."), &g.optim)),
        );
        for (prefix, optim) in optims {
            if optim.name == OptimizerKind::Adamw && optim.eps < 6.1e-5 {
                return bad(
                    &format!("{prefix}optim.eps"),
                    format!(
                        "{} is below f16's smallest normal number (6.1e-5), and precision \
                         \"16-true\" keeps AdamW's state in f16, where its update would divide \
                         by zero; set {prefix}optim.eps >= 1e-4 or use precision \"16-mixed\"",
                        optim.eps
                    ),
                );
            }
        }
        Ok(())
    }

    /// The config as TOML text.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a RootConfig always serialises")
    }

    /// The run directory: `run.dir`, or `runs/<run.name>`.
    pub fn run_dir(&self) -> PathBuf {
        self.run
            .dir
            .clone()
            .unwrap_or_else(|| Path::new("runs").join(&self.run.name))
    }
}

/// Fills every `[groups.<name>.optim]` and `[groups.<name>.schedule]` with the keys of the
/// root `[optim]` and `[schedule]` it does not set. Anything that is not a table is left for
/// the typed parse to report.
fn inherit_group_sections(table: &mut toml::Table) {
    let roots: Vec<(&str, toml::Table)> = ["optim", "schedule"]
        .into_iter()
        .map(|key| {
            let base = match table.get(key) {
                Some(toml::Value::Table(t)) => t.clone(),
                _ => toml::Table::new(),
            };
            (key, base)
        })
        .collect();
    let Some(toml::Value::Table(groups)) = table.get_mut("groups") else {
        return;
    };
    for (_, group) in groups.iter_mut() {
        let toml::Value::Table(group) = group else {
            continue;
        };
        for (key, base) in &roots {
            let own = group
                .entry(key.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if let toml::Value::Table(own) = own {
                for (k, v) in base {
                    own.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StrategyKind;
    use crate::config::{CpuSplit, Overlap};

    fn load(overrides: &[&str]) -> Result<RootConfig> {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        RootConfig::load(None, &o)
    }

    #[test]
    fn a_refused_value_names_its_source_and_an_enum_its_names() {
        let e = load(&["train.epochs=2", "dist.overlap=1"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "--set dist.overlap=1: key `dist.overlap`: expected one of \"auto\", \"on\", \
                 \"off\" (or true, false), got integer `1`"
            ),
            "{e}"
        );
        let e = load(&["monitor.sinks=[\"jsonl\", 3]"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("monitor.sinks[1]"), "{e}");
        assert!(e.contains("\"jsonl\""), "{e}");
        let e = load(&["strategy.name=\"zero4\""]).unwrap_err().to_string();
        assert!(
            e.contains("unknown variant `zero4`, expected one of \"auto\""),
            "{e}"
        );
        // A check after parsing names the source of its key too.
        let e = load(&["train.batch_size=0"]).unwrap_err().to_string();
        assert!(
            e.starts_with("config error: --set train.batch_size=0: key `train.batch_size`"),
            "{e}"
        );
        let on = load(&["dist.overlap=true", "hardware.cpu_split=false"]).unwrap();
        assert_eq!(
            (on.dist.overlap, on.hardware.cpu_split),
            (Overlap::On, CpuSplit::Off)
        );
        let origin = {
            let mut o = Origin::file("f.toml");
            o.note("optim", "--set optim={lr=1}".into());
            o
        };
        assert_eq!(origin.of("optim.lr"), "--set optim={lr=1}");
        assert_eq!(origin.of("optimizer"), "f.toml");
    }

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = load(&[]).unwrap();
        let back: RootConfig = toml::from_str(&c.to_toml()).unwrap();
        assert_eq!(c, back);
    }

    #[test]
    fn overrides_parse_toml_values_and_fall_back_to_strings() {
        // The built-in recipes' [data] and [model] keys: `builtin::tests`.
        let c = load(&[
            "train.epochs=3",
            "optim.lr=0.5",
            "run.dir=/some/path",
            "hardware.devices=[0, 2]",
        ])
        .unwrap();
        assert_eq!(c.train.epochs, 3);
        assert_eq!(c.optim.lr, 0.5);
        assert_eq!(c.run.dir.as_deref(), Some(Path::new("/some/path")));
        assert_eq!(c.hardware.devices.indices(), vec![0, 2]);
    }

    #[test]
    fn unknown_key_names_the_key() {
        let e = load(&["train.epoch=3"]).unwrap_err().to_string();
        assert!(e.contains("train.epoch"), "{e}");
        assert!(!e.contains('\n'));
    }

    #[test]
    fn wrong_type_names_the_key_and_the_expectation() {
        let e = load(&["train.batch_size=\"big\""]).unwrap_err().to_string();
        assert!(e.contains("train.batch_size"), "{e}");
        assert!(e.contains("integer") || e.contains("usize"), "{e}");
    }

    #[test]
    fn impossible_values_are_rejected() {
        for (o, key) in [
            ("hardware.devices=0", "hardware.devices"),
            ("train.batch_size=0", "train.batch_size"),
            ("optim.lr=-1", "optim.lr"),
            ("optim.momentum=1.5", "optim.momentum"),
            ("train.max_steps=0", "train.max_steps"),
            ("monitor.interval_s=-1", "monitor.interval_s"),
            ("monitor.peak_tflops=0", "monitor.peak_tflops"),
            ("monitor.smoothing=1", "monitor.smoothing"),
            (
                "hardware.replicas_per_device=0",
                "hardware.replicas_per_device",
            ),
        ] {
            let e = load(&[o]).unwrap_err().to_string();
            assert!(e.contains(key), "{o}: {e}");
        }
        // Several replicas on a device are a GPU's; the CPU splits its devices per core.
        let e = load(&[
            "hardware.accelerator=\"cpu\"",
            "hardware.replicas_per_device=2",
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("hardware.replicas_per_device") && e.contains("cpu_split"),
            "{e}"
        );
        assert!(
            load(&[
                "hardware.accelerator=\"wgpu\"",
                "hardware.replicas_per_device=2"
            ])
            .is_ok()
        );
    }

    #[test]
    fn auto_strategy_follows_device_count() {
        // What strategies refuse for a number of ranks: `strategy::tests`.
        let strategy = |o: &[&str]| {
            let c = load(o).unwrap();
            c.strategy.name.resolve(c.hardware.devices.indices().len())
        };
        assert_eq!(strategy(&[]), StrategyKind::Single);
        assert_eq!(strategy(&["hardware.devices=2"]), StrategyKind::Ddp);
        assert_eq!(
            strategy(&["hardware.devices=2", "strategy.name=\"zero3\""]),
            StrategyKind::Zero3
        );
    }

    #[test]
    fn malformed_override_is_an_error() {
        assert!(load(&["train.epochs"]).is_err());
        assert!(load(&["train..epochs=1"]).is_err());
        assert!(load(&["train.epochs.x=1"]).is_err());
    }
}
