//! What the planner says: `train plan`'s table (or its JSON), the choice `--strategy auto`
//! makes, the refusal of a launch that needs more than its limit, and the figures a run keeps
//! in its summary.

use super::planner::{HEADROOM, Plan};
use super::predict::Prediction;
use crate::config::{RootConfig, name_of};
use crate::error::{Error, Result};
use crate::metrics::PlanRecord;
use crate::strategy::rules;

const MIB: f64 = 1024.0 * 1024.0;

/// Step times this close to the fastest count as equally fast when `--strategy auto` picks
/// (the planner's step-time error on `cargo xtask bench plan` is of this order).
pub const TIES: f64 = 0.10;

/// Rows of plans that fit `train plan` prints (then half as many that do not fit).
const SHOWN: usize = 16;

/// What `--strategy auto` chose, and why, for the start-up table.
#[derive(Debug, Clone)]
pub struct Choice {
    /// The config that runs the choice.
    pub config: RootConfig,
    /// The start-up table's words.
    pub words: String,
    /// Its prediction, for the run's summary.
    pub record: PlanRecord,
}

impl Plan {
    /// The plan of the config as it is (the only candidate of [`super::Scope::Own`]).
    pub fn own(&self) -> Option<&Prediction> {
        self.fitting.first().or(self.over.first())
    }

    /// The record of the config's own plan for its summary.
    pub fn record(&self) -> Option<PlanRecord> {
        self.own().map(|p| self.record_of(p))
    }

    /// Whether the config's own plan needs more than the limit (and
    /// `hardware.memory_limit_force` does not run it anyway).
    pub fn over_limit(&self, config: &RootConfig) -> bool {
        match (self.own(), self.limit_bytes) {
            (Some(own), Some(limit)) => {
                self.need(own) * (1.0 + HEADROOM) > limit && !config.hardware.memory_limit_force
            }
            _ => false,
        }
    }

    /// The refusal of a launch over its limit ([`Self::over_limit`]), naming the need, the
    /// limit and the fastest plan of `all` that fits, in the config's precision where one
    /// does (none: the smallest need of all).
    pub fn refusal(&self, config: &RootConfig, all: &Plan) -> Error {
        let need = self.own().map_or(0.0, |p| self.need(p));
        let advice = match all.pick(config, false).or(all.fitting.first()) {
            Some(p) => format!(
                "the fastest plan that fits needs {:.0} MiB: {}",
                all.need(p) / MIB,
                flags_or_same(p)
            ),
            None => all.smallest_words(),
        };
        Error::config(format!(
            "key `hardware.memory_limit_mib`: this run needs {:.0} MiB per {} (predicted; {:.0} \
             % more kept free for the prediction's error), more than the limit of {:.0} MiB \
             ({}); {advice} (set hardware.memory_limit_force = true to run it anyway)",
            need / MIB,
            self.what(),
            HEADROOM * 100.0,
            self.limit_bytes.unwrap_or(0.0) / MIB,
            self.limit_source,
        ))
    }

    /// `"no plan fits: the smallest needs … (flags)"`.
    fn smallest_words(&self) -> String {
        match self.over.first() {
            Some(p) => format!(
                "no plan fits: the smallest needs {}{:.0} MiB per {} ({})",
                if p.probed { "" } else { "at least " },
                self.need(p) / MIB,
                self.what(),
                flags_or_same(p)
            ),
            None => "no plan fits".to_string(),
        }
    }

    fn what(&self) -> &str {
        if self.memory == "process" {
            "process"
        } else {
            "device"
        }
    }

    /// The plan `--strategy auto` runs among those that fit and compute what the config
    /// asks: its precision, not DiLoCo's outer loop (and, for a model with BatchNorm, the
    /// micro-batch asked and no pipeline, which change its statistics; `same_batch` asks that
    /// of any model);
    /// the fastest, where plans within `TIES` (10 %) of it (the planner's own error on step time)
    /// go to the simplest: the micro-batch asked, then fewer shards, then no recompute.
    pub fn pick(&self, config: &RootConfig, same_batch: bool) -> Option<&Prediction> {
        let allowed: Vec<&Prediction> = self
            .fitting
            .iter()
            .filter(|p| p.config.precision.mode == config.precision.mode)
            .filter(|p| rules(p.config.strategy.name).same_step())
            // A pipeline's micro-batches are BatchNorm's batches.
            .filter(|p| !same_batch || !rules(p.config.strategy.name).own_micro_batches())
            .filter(|p| {
                !same_batch
                    || (p.config.train.batch_size == config.train.batch_size
                        && p.config.train.accumulate == config.train.accumulate)
            })
            .collect();
        let best = allowed.first()?.samples_per_sec;
        allowed
            .into_iter()
            .filter(|p| p.samples_per_sec >= (1.0 - TIES) * best)
            .min_by_key(|p| simplicity(p, config))
    }

    /// `--strategy auto`'s choice from the plan of the config alone ([`super::Scope::Own`]): its
    /// plan where it fits; `None` where it does not (then every plan is weighed).
    pub fn asked_fits(&self, config: &RootConfig) -> Option<Choice> {
        let p = self.own()?;
        if self.over_limit(config) {
            return None;
        }
        let limit = match self.limit_bytes {
            Some(l) => format!("limit {:.0}", l / MIB),
            None => "no limit".to_string(),
        };
        Some(Choice {
            config: p.config.clone(),
            words: format!(
                "auto → {}: it fits ({:.0} MiB per {} predicted, {limit}); `train plan` weighs \
                 the others",
                p.strategy,
                self.need(p) / MIB,
                self.what()
            ),
            record: self.record_of(p),
        })
    }

    /// The choice for `--strategy auto`, or the refusal when nothing fits. The plan asked —
    /// the strategy `auto` is on the run's ranks (`ddp` on several) with the config's
    /// micro-batch, accumulation and recompute — runs wherever it
    /// fits: a choice by measured speed could differ between two launches of one command, and
    /// kiln keeps a command's numbers the same (the words name a plan predicted faster by more
    /// than `TIES`, for `--strategy` to take). Where it does not fit, the fastest plan that
    /// does ([`Self::pick`]).
    pub fn choose(&self, config: &RootConfig, buffers: bool) -> Result<Choice> {
        let plain = config.strategy_on(self.world);
        let asked = |o: &&Prediction| {
            o.config.strategy.name == plain
                && o.config.precision.mode == config.precision.mode
                && o.config.recompute.mode == config.recompute.mode
                && o.config.train.batch_size == config.train.batch_size
                && o.config.train.accumulate == config.train.accumulate
        };
        let what = self.what();
        let limit = self.limit_bytes.unwrap_or(0.0) / MIB;
        if let Some(p) = self.fitting.iter().find(asked) {
            let faster = self
                .pick(config, buffers)
                .filter(|f| f.samples_per_sec > p.samples_per_sec * (1.0 + TIES));
            let hint = match faster {
                Some(f) => format!(
                    "; predicted {:.0} % faster: {}",
                    (f.samples_per_sec / p.samples_per_sec - 1.0) * 100.0,
                    flags_or_same(f)
                ),
                None => String::new(),
            };
            return Ok(Choice {
                config: p.config.clone(),
                words: format!(
                    "auto → {}: it fits ({:.0} MiB per {what} predicted, limit {limit:.0}){hint}",
                    name_of(&plain),
                    self.need(p) / MIB
                ),
                record: self.record_of(p),
            });
        }
        let Some(p) = self.pick(config, buffers) else {
            return Err(Error::config(format!(
                "key `strategy.name`: \"auto\" found no plan within the limit of {limit:.0} MiB \
                 per {what} ({}); {}",
                self.limit_source,
                self.smallest_words()
            )));
        };
        let why = match self.over.iter().find(asked) {
            Some(d) => format!(
                "{} needs {:.0} MiB per {what}, limit {limit:.0}",
                name_of(&plain),
                self.need(d) / MIB
            ),
            None => format!(
                "the fastest that fits: {:.0} samples/s predicted, {:.0} MiB per {what}",
                p.samples_per_sec,
                self.need(p) / MIB
            ),
        };
        let flags = if p.flags.is_empty() {
            String::new()
        } else {
            format!(" ({})", p.flags.join(" "))
        };
        Ok(Choice {
            config: p.config.clone(),
            words: format!("auto → {}{flags}: {why}", p.strategy),
            record: self.record_of(p),
        })
    }

    /// `train plan`'s table.
    pub fn print(&self, title: &str) {
        let what = self.what();
        let limit = match self.limit_bytes {
            Some(l) => format!(
                "limit {:.0} MiB per {what} ({}; a plan fits with {:.0} % to spare)",
                l / MIB,
                self.limit_source,
                HEADROOM * 100.0
            ),
            None => "no memory limit".to_string(),
        };
        println!(
            "plan: {title}, {} samples per step; {limit}; planned in {:.1} s (* = the settings \
             as given)",
            self.samples_per_step, self.seconds
        );
        println!("{}", self.measured.kept.words());
        println!(
            "{:>3}  {:<20} {:<10} {:<9} {:>9} {:>28} {:>10} {:>9} {:>9}",
            "#",
            "strategy",
            "precision",
            "recompute",
            "batch×acc",
            "per rank MiB (p+g+o+act)",
            format!("{what} MiB"),
            "step ms",
            "samples/s"
        );
        // The fastest plans, and the config's own wherever it ranks (marked `*`).
        let mut left = 0;
        for (i, p) in self.fitting.iter().enumerate() {
            let own = p.own;
            if i < SHOWN || own {
                let index = format!("{}{}", if own { "*" } else { "" }, i + 1);
                println!("{}", self.row(&index, p));
            } else {
                left += 1;
            }
        }
        if !self.over.is_empty() {
            println!("do not fit ({limit}):");
            for (i, p) in self.over.iter().enumerate() {
                if i < SHOWN / 2 || p.own {
                    let index = if p.own { "*" } else { "-" };
                    println!("{}", self.row(index, p));
                } else {
                    left += 1;
                }
            }
        }
        if left > 0 {
            println!("… and {left} more plans (train plan --json lists every one)");
        }
        if !self.refused.is_empty() {
            println!("not possible with these settings:");
            for (words, why) in &self.refused {
                println!("  {words}: {why}");
            }
        }
        if let Some(auto) = &self.auto {
            println!("--strategy auto (the default) would run: {auto}");
        }
        match self.fitting.first() {
            Some(best) => println!("fastest that fits: {}", flags_or_same(best)),
            None => println!("{}", self.smallest_words()),
        }
    }

    fn row(&self, index: &str, p: &Prediction) -> String {
        let parts = format!(
            "{:.1} ({:.1}+{:.1}+{:.1}+{:.1})",
            (p.params_bytes + p.grads_bytes + p.optim_bytes + p.activation_bytes) / MIB,
            p.params_bytes / MIB,
            p.grads_bytes / MIB,
            p.optim_bytes / MIB,
            p.activation_bytes / MIB
        );
        if !p.probed {
            return format!(
                "{index:>3}  {:<20} {:<10} {:<9} {:>9} {:>28} {:>10} {:>9} {:>9}",
                p.strategy,
                p.precision,
                p.recompute,
                format!("{}×{}", p.batch_size, p.accumulate),
                parts,
                format!("≥{:.0}", self.need(p) / MIB),
                "-",
                "-"
            );
        }
        format!(
            "{index:>3}  {:<20} {:<10} {:<9} {:>9} {:>28} {:>10.0} {:>9.1} {:>9.1}",
            p.strategy,
            p.precision,
            p.recompute,
            format!("{}×{}", p.batch_size, p.accumulate),
            parts,
            self.need(p) / MIB,
            p.step_seconds * 1000.0,
            p.samples_per_sec
        )
    }
}

impl super::kept::Keeping {
    /// One line on where the plan's measurements come from and go.
    pub fn words(&self) -> String {
        let file = self.file.as_ref().map(|f| f.display().to_string());
        match (file, &self.notice) {
            (_, Some(notice)) => format!("measurements: {notice}"),
            (Some(file), None) if self.reused => {
                let age = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
                    .saturating_sub(self.since);
                format!(
                    "measurements: read back from {file} (measured {} ago; \
                     hardware.plan_cache = false measures again)",
                    age_words(age)
                )
            }
            (Some(file), None) => {
                format!("measurements: measured now where not kept, kept in {file}")
            }
            (None, None) => "measurements: measured now".to_string(),
        }
    }
}

/// `age` seconds in the largest unit that fits (`3 d`, `5 h`, `12 min`, `40 s`).
fn age_words(age: u64) -> String {
    match age {
        a if a >= 86_400 => format!("{} d", a / 86_400),
        a if a >= 3600 => format!("{} h", a / 3600),
        a if a >= 60 => format!("{} min", a / 60),
        a => format!("{a} s"),
    }
}

impl Plan {
    /// The summary's record of `p`, naming the kept measurements it read back whole (on the
    /// CPU, where the run's own peak is the figure predicted).
    fn record_of(&self, p: &Prediction) -> PlanRecord {
        let kept = &self.measured.kept;
        PlanRecord {
            peak_rss_mib: p.process_bytes / MIB,
            peak_device_mib: p.device_bytes / MIB,
            step_seconds: p.step_seconds,
            kept: (self.measured.cpu && kept.reused)
                .then(|| kept.file.clone())
                .flatten(),
            kept_check: None,
        }
    }
}

/// A plan's flags, or words saying it is the config as given.
fn flags_or_same(p: &Prediction) -> String {
    if p.flags.is_empty() {
        "the settings as given".to_string()
    } else {
        p.flags.join(" ")
    }
}

/// How simple a plan is to run: the micro-batch asked (the same data order and rounding), then
/// fewer shards and stages, then no recompute.
fn simplicity(p: &Prediction, asked: &RootConfig) -> (usize, usize, usize) {
    let c = &p.config;
    let batch = usize::from(
        c.train.batch_size != asked.train.batch_size
            || c.train.accumulate != asked.train.accumulate,
    );
    let strategy = rules(c.strategy.name).simplicity();
    let recompute = usize::from(name_of(&c.recompute.mode) != "none");
    (batch, strategy, recompute)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RecomputeMode, StrategyKind};
    use crate::plan::predict::Measured;

    fn prediction(kind: StrategyKind, mib: f64, rate: f64) -> Prediction {
        let mut config = RootConfig::load(None, &["train.batch_size=8".into()]).unwrap();
        config.strategy.name = kind;
        config.recompute.mode = RecomputeMode::None;
        Prediction {
            strategy: name_of(&kind),
            precision: "32".into(),
            recompute: "none".into(),
            batch_size: 8,
            accumulate: 1,
            ranks: 2,
            params_bytes: 0.0,
            grads_bytes: 0.0,
            optim_bytes: 0.0,
            activation_bytes: 0.0,
            device_bytes: mib * MIB / 2.0,
            process_bytes: mib * MIB,
            step_seconds: 1.0 / rate,
            compute_seconds: 0.0,
            update_seconds: 0.0,
            comm_seconds: 0.0,
            samples_per_sec: rate,
            flags: vec![format!("--strategy {}", name_of(&kind))],
            own: false,
            probed: true,
            config,
        }
    }

    fn plan(limit_mib: f64, all: Vec<Prediction>) -> Plan {
        let (mut fitting, mut over): (Vec<_>, Vec<_>) = all
            .into_iter()
            .partition(|p| p.process_bytes * (1.0 + HEADROOM) <= limit_mib * MIB);
        fitting.sort_by(|a, b| b.samples_per_sec.total_cmp(&a.samples_per_sec));
        over.sort_by(|a, b| a.process_bytes.total_cmp(&b.process_bytes));
        Plan {
            world: 2,
            samples_per_step: 16,
            memory: "process".into(),
            limit_bytes: Some(limit_mib * MIB),
            limit_source: "hardware.memory_limit_mib".into(),
            fitting,
            over,
            refused: Vec::new(),
            auto: None,
            measured: Measured::default(),
            seconds: 0.0,
        }
    }

    fn three() -> Vec<Prediction> {
        vec![
            prediction(StrategyKind::Ddp, 300.0, 100.0),
            prediction(StrategyKind::Zero2, 250.0, 98.0),
            prediction(StrategyKind::Zero3, 200.0, 80.0),
        ]
    }

    #[test]
    fn auto_runs_the_fastest_plan_that_fits_and_says_why() {
        let config = RootConfig::load(None, &["train.batch_size=8".into()]).unwrap();
        let choice = plan(280.0, three()).choose(&config, false).unwrap();
        assert_eq!(choice.config.strategy.name, StrategyKind::Zero2);
        assert!(
            choice.words.starts_with(
                "auto → zero2 (--strategy zero2): ddp needs 300 MiB per process, limit 280"
            ),
            "{}",
            choice.words
        );
        // The plan asked runs where it fits, naming one predicted faster by more than TIES.
        let asked = config.clone();
        let mut all = three();
        all.push(prediction(StrategyKind::Zero1, 300.0, 101.0));
        let choice = plan(1000.0, all.clone()).choose(&asked, false).unwrap();
        assert_eq!(choice.config.strategy.name, StrategyKind::Ddp);
        assert!(
            choice.words.starts_with("auto → ddp: it fits (300 MiB"),
            "{}",
            choice.words
        );
        all.push(prediction(StrategyKind::Zero3, 250.0, 125.0));
        let choice = plan(1000.0, all).choose(&asked, false).unwrap();
        assert_eq!(choice.config.strategy.name, StrategyKind::Ddp);
        assert!(
            choice
                .words
                .ends_with("predicted 25 % faster: --strategy zero3"),
            "{}",
            choice.words
        );
        // Where it does not fit, within 10 % of the fastest, the simpler plan.
        let mut all = three();
        all.push(prediction(StrategyKind::Zero1, 250.0, 101.0));
        let choice = plan(280.0, all).choose(&asked, false).unwrap();
        assert_eq!(choice.config.strategy.name, StrategyKind::Zero1);
        // Nothing fits: refused, naming the smallest need.
        let e = plan(100.0, three())
            .choose(&config, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no plan fits: the smallest needs 200 MiB per process (--strategy zero3)"),
            "{e}"
        );
    }

    #[test]
    fn a_run_over_its_limit_is_refused_naming_the_fastest_plan_that_fits() {
        let config = RootConfig::load(None, &[]).unwrap();
        let own = plan(280.0, vec![prediction(StrategyKind::Ddp, 300.0, 100.0)]);
        assert!(own.over_limit(&config));
        let e = own.refusal(&config, &plan(280.0, three())).to_string();
        assert!(
            e.contains("this run needs 300 MiB per process (predicted; 10 %"),
            "{e}"
        );
        assert!(
            e.contains("the fastest plan that fits needs 250 MiB: --strategy zero2"),
            "{e}"
        );
        let forced = RootConfig::load(None, &["hardware.memory_limit_force=true".into()]).unwrap();
        assert!(!own.over_limit(&forced));
        assert_eq!(own.record().unwrap().peak_rss_mib, 300.0);
    }
}
