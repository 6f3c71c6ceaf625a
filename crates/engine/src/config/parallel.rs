//! `[strategy]`, `[pipeline]`, `[ddp]`, `[diloco]` and `[dist]`: how a step's work is split over
//! ranks, and the clocks and checks of the collectives between them.

use serde::{Deserialize, Serialize};

use super::names::{bad, name_of, switch};
use crate::error::Result;

/// Parallel strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum StrategyKind {
    /// `single` for one device, `ddp` for more.
    #[default]
    Auto,
    /// One device.
    Single,
    /// Data parallel: one replica per device, gradients averaged every step.
    Ddp,
    /// ZeRO stage 1: as `ddp`, with the optimizer state sharded over the devices.
    Zero1,
    /// ZeRO stage 2: gradients and optimizer state sharded; each block's gradients are
    /// reduce-scattered as its backward ends.
    Zero2,
    /// ZeRO stage 3 (FSDP): parameters, gradients and optimizer state sharded; each block's
    /// parameters are gathered for its forward and backward only.
    Zero3,
    /// Pipeline parallelism: the model's blocks cut into `pipeline.stages` stages, one device
    /// each, fed micro-batches; several pipelines are data-parallel replicas.
    Pipeline,
    /// DiLoCo: the ranks of each island (by default, each process) train as `ddp` every step;
    /// the islands average their progress every `diloco.inner_steps` steps through an outer
    /// Nesterov SGD step.
    Diloco,
}

impl StrategyKind {
    /// The strategy for `devices` devices: `auto` is `single` for one device, `ddp` for more.
    pub fn resolve(self, devices: usize) -> StrategyKind {
        match self {
            StrategyKind::Auto if devices > 1 => StrategyKind::Ddp,
            StrategyKind::Auto => StrategyKind::Single,
            s => s,
        }
    }
}

/// `[strategy]`: how one step's work is split across the devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct StrategyConfig {
    /// `auto` (`single` for one device, `ddp` for more), `single`, `ddp`, `zero1`, `zero2`,
    /// `zero3`, `pipeline` or `diloco`. Default `auto`.
    pub name: StrategyKind,
}

/// `[parallel]`: the device mesh — data × tensor × pipeline ranks. Ranks are laid out with the
/// tensor-parallel groups innermost: ranks `g·tp .. (g+1)·tp` are one group, the neighbouring
/// devices of one process (under MPI, one process's devices where `tp` divides them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// Data-parallel replicas. Left out, it is what the devices leave: `devices / (tp × pp)`;
    /// given, it must be that.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp: Option<usize>,
    /// Tensor-parallel ranks: each Linear pair of a block split over `tp` neighbouring devices
    /// (Megatron's column- and row-parallel Linears), for a model that says how it is cut.
    /// Default 1.
    pub tp: usize,
    /// Pipeline stages: the same as `pipeline.stages` with `strategy.name = "pipeline"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pp: Option<usize>,
    /// How the data dimension shards the model: the ZeRO stage, 0 (`ddp`: nothing sharded)
    /// to 3 (`zero3`: parameters, gradients and optimizer state); the same as naming the
    /// strategy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<u8>,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            dp: None,
            tp: 1,
            pp: None,
            shard: None,
        }
    }
}

impl ParallelConfig {
    /// Rejects a dimension of 0 and a stage past 3.
    pub fn check(&self) -> Result<()> {
        if self.tp == 0 {
            return bad("parallel.tp", "must be at least 1, got 0".into());
        }
        if self.dp == Some(0) {
            return bad("parallel.dp", "must be at least 1, got 0".into());
        }
        if self.pp == Some(0) {
            return bad("parallel.pp", "must be at least 1, got 0".into());
        }
        if let Some(s) = self.shard
            && s > 3
        {
            return bad(
                "parallel.shard",
                format!("is a ZeRO stage, 0 (ddp) to 3 (zero3), got {s}"),
            );
        }
        Ok(())
    }

    /// The strategy the data and pipeline dimensions name (`parallel.shard`, `parallel.pp`)
    /// beside `named` (`strategy.name`), or why they disagree.
    pub fn strategy(&self, named: StrategyKind) -> Result<StrategyKind> {
        let by_shard = self.shard.map(|s| match s {
            0 => StrategyKind::Auto,
            1 => StrategyKind::Zero1,
            2 => StrategyKind::Zero2,
            _ => StrategyKind::Zero3,
        });
        let by_pp = self.pp.filter(|&s| s > 1).map(|_| StrategyKind::Pipeline);
        let mut kind = named;
        for (key, implied) in [("parallel.shard", by_shard), ("parallel.pp", by_pp)] {
            let Some(implied) = implied else { continue };
            let agrees = kind == StrategyKind::Auto
                || kind == implied
                || (implied == StrategyKind::Auto
                    && matches!(kind, StrategyKind::Single | StrategyKind::Ddp));
            if !agrees {
                bad(
                    key,
                    format!(
                        "names the strategy {:?}, but the strategy is already {:?}; give one",
                        name_of(&implied),
                        name_of(&kind)
                    ),
                )?;
            }
            if kind == StrategyKind::Auto {
                kind = implied;
            }
        }
        Ok(kind)
    }
}

/// The order in which a pipeline stage runs its micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PipelineSchedule {
    /// Every micro-batch's forward, then every backward.
    Gpipe,
    /// One forward, one backward (PipeDream-flush): stage s warms up with K−1−s forwards,
    /// then alternates, so it holds at most K micro-batches of activations.
    #[serde(rename = "1f1b")]
    OneFOneB,
}

/// `[pipeline]`: the cut of the model into stages and the micro-batches that flow through it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineConfig {
    /// Stages each pipeline is cut into (one device each); must divide the device count, and
    /// `devices / stages` pipelines train as data-parallel replicas. Default 1.
    pub stages: usize,
    /// Micro-batches of `train.batch_size` samples per pipeline flush; an optimizer step runs
    /// `train.accumulate` flushes. Default 1 (plain model parallelism).
    pub microbatches: usize,
    /// `gpipe` or `1f1b`. Default `1f1b`.
    pub schedule: PipelineSchedule,
    /// The first block of every stage but the first (K − 1 increasing block indices); unset
    /// cuts the blocks into stages of balanced parameter counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuts: Option<Vec<usize>>,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            stages: 1,
            microbatches: 1,
            schedule: PipelineSchedule::OneFOneB,
            cuts: None,
        }
    }
}

impl PipelineConfig {
    /// Rejects stage and micro-batch counts of 0, cuts that do not cut, and pipeline settings
    /// under a strategy (`strategy`) that is not `pipeline`.
    pub fn check(&self, strategy: StrategyKind) -> Result<()> {
        if self.stages == 0 {
            return bad("pipeline.stages", "must be at least 1, got 0".into());
        }
        if self.microbatches == 0 {
            return bad("pipeline.microbatches", "must be at least 1, got 0".into());
        }
        let pipelined = strategy == StrategyKind::Pipeline;
        if !pipelined && (self.stages > 1 || self.microbatches > 1 || self.cuts.is_some()) {
            return bad(
                "pipeline",
                format!(
                    "[pipeline] settings apply to strategy.name = \"pipeline\", but the strategy \
                     is {:?}",
                    name_of(&strategy)
                ),
            );
        }
        if let Some(cuts) = &self.cuts
            && (cuts.len() + 1 != self.stages
                || cuts.first() == Some(&0)
                || cuts.windows(2).any(|w| w[0] >= w[1]))
        {
            return bad(
                "pipeline.cuts",
                format!(
                    "must hold the first block of every stage but the first: {} increasing \
                     indices from 1, got {cuts:?}",
                    self.stages - 1
                ),
            );
        }
        Ok(())
    }
}

/// `[ddp]`: data-parallel settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DdpConfig {
    /// Size of one gradient bucket of the all-reduce, in MiB of f32 gradients. Default 25.
    pub bucket_mb: f64,
    /// Compute BatchNorm batch statistics over the global batch of every replica during
    /// training (otherwise each replica uses its own batch). Default false.
    pub sync_batchnorm: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            bucket_mb: 25.0,
            sync_batchnorm: false,
        }
    }
}

impl DdpConfig {
    /// Rejects a bucket size that cannot work.
    pub fn check(&self) -> Result<()> {
        if self.bucket_mb.is_nan() || self.bucket_mb <= 0.0 {
            return bad(
                "ddp.bucket_mb",
                format!("must be a positive size in MiB, got {}", self.bucket_mb),
            );
        }
        Ok(())
    }
}

/// `[diloco]`: the outer loop of `strategy.name = "diloco"` (Douillard et al., 2023, "DiLoCo:
/// Distributed Low-Communication Training of Language Models").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DilocoConfig {
    /// Optimizer steps each island takes on its own between two outer steps (H). Default 20.
    pub inner_steps: usize,
    /// The outer optimizer's learning rate (Nesterov SGD on the averaged pseudo-gradient, the
    /// parameters at the last outer step minus the parameters now). Default 0.7.
    pub outer_lr: f64,
    /// The outer optimizer's (Nesterov) momentum; 0 for none. Default 0.9.
    pub outer_momentum: f64,
    /// Islands: groups of consecutive ranks that train as `ddp` among themselves and meet the
    /// other islands only at outer steps. 0 = one per process (the ranks of one machine are
    /// one island). Must divide the number of ranks. Default 0.
    pub islands: usize,
}

impl Default for DilocoConfig {
    fn default() -> Self {
        Self {
            inner_steps: 20,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            islands: 0,
        }
    }
}

impl DilocoConfig {
    /// Rejects outer-loop values that cannot work.
    pub fn check(&self) -> Result<()> {
        if self.inner_steps == 0 {
            return bad(
                "diloco.inner_steps",
                "must be at least 1 (optimizer steps between outer steps)".into(),
            );
        }
        if !(self.outer_lr.is_finite() && self.outer_lr > 0.0) {
            return bad(
                "diloco.outer_lr",
                format!("must be a positive number, got {}", self.outer_lr),
            );
        }
        if !(0.0..1.0).contains(&self.outer_momentum) {
            return bad(
                "diloco.outer_momentum",
                format!("must be in [0, 1), got {}", self.outer_momentum),
            );
        }
        Ok(())
    }
}

/// `dist.overlap`: whether gradients are reduced beside the backward (`true` and `false` read
/// as `"on"` and `"off"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Overlap {
    /// When the run spans processes.
    #[default]
    Auto,
    /// Always (where the strategy and the model allow it).
    On,
    /// Never: every reduction after the backward.
    Off,
}

impl<'de> Deserialize<'de> for Overlap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let from_name = |name: &str| match name {
            "auto" => Some(Overlap::Auto),
            "on" => Some(Overlap::On),
            "off" => Some(Overlap::Off),
            _ => None,
        };
        switch(
            d,
            &["auto", "on", "off"],
            from_name,
            Overlap::On,
            Overlap::Off,
        )
    }
}

impl Overlap {
    /// Whether to overlap in a run of `processes` processes.
    pub fn resolve(self, processes: usize) -> bool {
        match self {
            Overlap::Auto => processes > 1,
            Overlap::On => true,
            Overlap::Off => false,
        }
    }
}

/// `[dist]`: how ranks that stop making progress are caught and named.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// Communication beside compute: `ddp` and `zero1` hand each block's gradients of a
    /// step's last micro-batch to a communication thread as soon as the block's backward is
    /// done and go on with the blocks below; `zero2` and `zero3` hand it their reduce-scatters
    /// (every micro-batch), and `zero3` the all-gather of the next block it needs, one block
    /// ahead (models with blocks; not with synchronised BatchNorm, whose backward has its own
    /// collectives). The same collectives in the same order: the same bits either way. `"auto"` overlaps when the run spans processes (a
    /// link to hide); in one process a reduction is memory traffic on the cores that compute,
    /// and overlapping it was measured slower on CPU. `"on"`, `"off"`. Default `"auto"`.
    pub overlap: Overlap,
    /// Seconds a rank may wait in one collective or transfer before the run ends with a line
    /// naming the ranks that did not arrive; 0 waits forever. Default 300.
    pub timeout_s: f64,
    /// The deadline of the collectives before a rank's first optimizer step is done (start-up,
    /// the first step's compilation and autotuning). Default 900.
    pub startup_timeout_s: f64,
    /// Collectives each rank's flight recorder keeps (written to `flight/rank-K.jsonl` on a
    /// deadline, a failure or SIGUSR1); 0 keeps none. Default 256.
    pub flight_entries: usize,
    /// Compare every collective's kind, group, sequence number, size and dtype across its ranks
    /// before it runs; a mismatch ends the run with one line naming both. Costs one extra
    /// collective per collective. Default false.
    pub check_collectives: bool,
    /// A rank whose compute time per step exceeds the median rank's by this fraction in three
    /// logging windows in a row is named on the console (`metrics.jsonl` has `slowest_rank`
    /// and `rank_skew` at every log line). Default 0.25.
    pub straggler_margin: f64,
}

impl Default for DistConfig {
    fn default() -> Self {
        Self {
            overlap: Overlap::Auto,
            timeout_s: 300.0,
            startup_timeout_s: 900.0,
            flight_entries: 256,
            check_collectives: false,
            straggler_margin: 0.25,
        }
    }
}

impl DistConfig {
    /// Rejects deadlines and margins that cannot work.
    pub fn check(&self) -> Result<()> {
        for (key, v) in [
            ("dist.timeout_s", self.timeout_s),
            ("dist.startup_timeout_s", self.startup_timeout_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(
                    key,
                    format!("must be a number of seconds >= 0 (0 waits forever), got {v}"),
                );
            }
        }
        if !(self.straggler_margin.is_finite() && self.straggler_margin > 0.0) {
            return bad(
                "dist.straggler_margin",
                format!(
                    "must be a positive fraction (0.25: 25 % slower than the median), got {}",
                    self.straggler_margin
                ),
            );
        }
        Ok(())
    }
}
