//! The typed root config: one TOML file, one section per component, dotted overrides.
//!
//! Loading goes file → TOML value → `--set` overrides applied to the value → typed config, so
//! that an override of an unknown key or of the wrong type fails exactly like a bad file does,
//! with the dotted key in the message.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The engine's configuration: every section but a program's own `[model]` and `[data]` (see
/// [`UserConfig`](crate::UserConfig)). Each component receives only its own section.
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
    /// The optimizer and schedule of each parameter group of a model that steps several
    /// optimizers (`[groups.generator.optim]`); each inherits `[optim]` and `[schedule]` key
    /// by key. A group the model names and this omits uses `[optim]` and `[schedule]` as
    /// they are.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub groups: std::collections::BTreeMap<String, GroupConfig>,
    /// `data.workers` and `data.prefetch`: kiln's two keys of a program's `[data]` (read and
    /// written there by [`UserConfig`](crate::UserConfig)).
    #[serde(skip)]
    pub loader: LoaderConfig,
}

/// `data.workers`, `data.prefetch`: who builds the training batches, and how far ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoaderConfig {
    /// Loader threads per rank that build the coming batches (reading, decoding, augmenting);
    /// 0 builds each batch on the rank's own thread when the step needs it. The batches are
    /// the same bits whatever the count. Default 0.
    pub workers: usize,
    /// With workers, how many optimizer steps of batches are built ahead of the rank (the
    /// memory bound: `prefetch` × micro-batches per step). Default 2.
    pub prefetch: usize,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        Self {
            workers: 0,
            prefetch: 2,
        }
    }
}

impl LoaderConfig {
    /// The keys of `[data]` that are kiln's.
    pub const KEYS: [&'static str; 2] = ["workers", "prefetch"];

    /// Rejects values that parse but cannot work, naming the key.
    pub fn check(&self) -> Result<()> {
        if self.prefetch == 0 {
            return bad(
                "data.prefetch",
                "must be at least 1 (steps of batches built ahead by the loader workers)".into(),
            );
        }
        if self.workers > 256 {
            return bad(
                "data.workers",
                format!(
                    "{} loader threads per rank is more than kiln allows (256)",
                    self.workers
                ),
            );
        }
        Ok(())
    }
}

/// `[groups.<name>]`: one parameter group's optimizer and schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct GroupConfig {
    /// The group's optimizer (what it does not set comes from `[optim]`).
    pub optim: OptimConfig,
    /// The group's learning-rate schedule (what it does not set comes from `[schedule]`).
    pub schedule: ScheduleConfig,
}

/// Numeric precision, with the meanings Lightning gives these names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum PrecisionMode {
    /// Everything in f32.
    #[serde(rename = "32", alias = "32-true")]
    #[value(name = "32", alias = "32-true")]
    F32,
    /// Replicas compute in bf16; f32 master weights and optimizer state.
    #[serde(rename = "bf16-mixed")]
    #[value(name = "bf16-mixed")]
    Bf16Mixed,
    /// Replicas compute in f16 with a dynamic loss scaler; f32 master weights and optimizer
    /// state.
    #[serde(rename = "16-mixed")]
    #[value(name = "16-mixed")]
    F16Mixed,
    /// Weights, optimizer state and compute all in bf16.
    #[serde(rename = "bf16-true")]
    #[value(name = "bf16-true")]
    Bf16True,
    /// Weights, optimizer state and compute all in f16.
    #[serde(rename = "16-true")]
    #[value(name = "16-true")]
    F16True,
}

/// The dtype gradients travel in during the all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReduceDtype {
    /// Full precision (default).
    F32,
    /// bf16: half the bytes; each rank's contribution is rounded to bf16, the sum is taken in
    /// f32 in rank order and rounded to bf16.
    Bf16,
}

/// Whether a loss scaler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScalerKind {
    /// A dynamic scaler for `16-mixed`, none otherwise.
    Auto,
    /// Dynamic loss scaling (only with `16-mixed`).
    Dynamic,
    /// No loss scaling.
    None,
}

/// `[precision]`: compute dtype, master weights, gradient-reduction dtype and loss scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrecisionConfig {
    /// `"32"`, `"bf16-mixed"`, `"16-mixed"`, `"bf16-true"` or `"16-true"`. Default `"32"`.
    pub mode: PrecisionMode,
    /// Dtype of the gradient all-reduce: `f32` (default) or `bf16`.
    pub reduce_dtype: ReduceDtype,
    /// `auto` (dynamic for `16-mixed`), `dynamic` or `none`. Default `auto`.
    pub scaler: ScalerKind,
    /// Initial loss scale of the dynamic scaler. Default 65536 (2^16).
    pub init_scale: f64,
    /// Clean steps after which the scale doubles. Default 2000.
    pub growth_interval: usize,
}

impl Default for PrecisionConfig {
    fn default() -> Self {
        Self {
            mode: PrecisionMode::F32,
            reduce_dtype: ReduceDtype::F32,
            scaler: ScalerKind::Auto,
            init_scale: 65536.0,
            growth_interval: 2000,
        }
    }
}

impl PrecisionConfig {
    /// Whether the dynamic loss scaler runs.
    pub fn uses_scaler(&self) -> bool {
        match self.scaler {
            ScalerKind::Auto => self.mode == PrecisionMode::F16Mixed,
            ScalerKind::Dynamic => true,
            ScalerKind::None => false,
        }
    }
}

/// What activation checkpointing recomputes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecomputeMode {
    /// Keep every activation (default).
    None,
    /// Burn's device-wide checkpointing: memory-bound operations are recomputed.
    Balanced,
    /// The model's blocks: every `every`-th block keeps only its input and runs its forward
    /// again during backward (the last block keeps its activations, which the backward needs
    /// first).
    Blocks,
}

/// `[recompute]`: activation checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecomputeConfig {
    /// `none` (default), `balanced` or `blocks`.
    pub mode: RecomputeMode,
    /// With `blocks`: recompute blocks 0, K, 2K, …; the others keep their activations.
    /// Default 1 (every block).
    pub every: usize,
}

impl Default for RecomputeConfig {
    fn default() -> Self {
        Self {
            mode: RecomputeMode::None,
            every: 1,
        }
    }
}

/// Where metrics records are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SinkKind {
    /// `metrics.jsonl`, one JSON object per line.
    Jsonl,
    /// `metrics.csv`.
    Csv,
    /// TensorBoard event files under `tb/`.
    Tensorboard,
}

/// `[monitor]`: monitoring settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorConfig {
    /// Metric sinks: any of `jsonl`, `csv`, `tensorboard`. Default all three.
    pub sinks: Vec<SinkKind>,
    /// Seconds between two samples of the system monitor (memory, CPU and GPU utilization,
    /// power); 0 turns the sampler off. Default 1.
    pub interval_s: f64,
    /// Peak dense FLOP/s of one device, in TFLOP/s, for the model FLOPs utilization (MFU).
    /// Default: unset, taken from kiln's table of known GPUs where the device is in it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
    /// Weight of the history in the smoothed throughput (an exponential moving average over
    /// logging windows): 0 keeps only the newest window. Default 0.8.
    pub smoothing: f64,
    /// GPU utilization and power through NVML: `true` asks for them (and says when they cannot
    /// be had), `false` does not try; unset samples what NVML offers and says nothing on a
    /// machine without it. Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<bool>,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            sinks: vec![SinkKind::Jsonl, SinkKind::Csv, SinkKind::Tensorboard],
            interval_s: 1.0,
            peak_tflops: None,
            smoothing: 0.8,
            gpu: None,
        }
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

/// `dist.overlap`: whether gradients are reduced beside the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
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

/// `[run]`: naming, seeding and output location.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Run name; the run directory is `runs/<name>` unless `dir` is set. Default `"default"`.
    pub name: String,
    /// Explicit run directory, overriding `runs/<name>`. Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// Seed of model initialisation and data order. Default 42.
    pub seed: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: "default".into(),
            dir: None,
            seed: 42,
        }
    }
}

/// `[train]`: loop length, batch, logging, validation and checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Number of passes over the training set. Default 10.
    pub epochs: usize,
    /// Stop after this many optimizer steps even if epochs remain. Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<usize>,
    /// Samples per device per micro-step. Default 32.
    pub batch_size: usize,
    /// Micro-steps whose gradients are accumulated before each optimizer step. Default 1.
    pub accumulate: usize,
    /// Log training metrics every this many optimizer steps. Default 10.
    pub log_every: usize,
    /// Validate every this many steps, in addition to every epoch end. Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_every: Option<usize>,
    /// Write a checkpoint every this many steps (and always at the end). Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<usize>,
    /// How many step checkpoints to keep (oldest are deleted). Default 3.
    pub keep_checkpoints: usize,
    /// Clip gradients to this global L2 norm. Default: unset (no clipping).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_clip: Option<f64>,
    /// Steps whose gradients hold an infinity or NaN (without a loss scaler) that may be
    /// skipped, leaving the parameters as they were; one more stops the run with an error
    /// naming the step, rank and micro-batch. Default 0.
    pub skip_nonfinite: usize,
    /// On the first SIGINT/SIGTERM, finish the step in flight on every rank, write a
    /// checkpoint and stop (a second signal stops at once). Default true.
    pub checkpoint_on_signal: bool,
    /// Keep the checkpoint with the best validation `val_loss` (lowest) or `val_accuracy`
    /// (highest) besides the newest `keep_checkpoints`; validation then runs at every
    /// checkpoint. Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub best_metric: Option<String>,
    /// Stop when a validation metric has not improved for `patience` validations in a row,
    /// with a checkpoint (`[train.early_stopping]`). Default: unset.
    pub early_stopping: Option<MetricWatch>,
    /// Assert after every step that all replicas hold identical parameters (slow; for tests;
    /// `zero3` keeps no replicas, so there it checks nothing).
    /// Default false.
    pub check_replicas: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            epochs: 10,
            max_steps: None,
            batch_size: 32,
            accumulate: 1,
            log_every: 10,
            val_every: None,
            checkpoint_every: None,
            keep_checkpoints: 3,
            grad_clip: None,
            skip_nonfinite: 0,
            checkpoint_on_signal: true,
            best_metric: None,
            early_stopping: None,
            check_replicas: false,
        }
    }
}

/// Which optimizer to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    /// AdamW (decoupled weight decay).
    Adamw,
    /// Stochastic gradient descent with optional momentum.
    Sgd,
}

/// How the learning rate scales with the number of samples per optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LrScaling {
    /// Use `optim.lr` as given.
    None,
    /// Multiply by world size × accumulation.
    Linear,
    /// Multiply by the square root of world size × accumulation.
    Sqrt,
}

/// `[optim]`: the optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// `adamw` or `sgd`. Default `adamw`.
    pub name: OptimizerKind,
    /// Peak learning rate. Default 1e-3.
    pub lr: f64,
    /// Weight decay (decoupled for AdamW, L2 for SGD). Default 0.
    pub weight_decay: f64,
    /// SGD momentum (0 disables it). Default 0.9.
    pub momentum: f64,
    /// SGD Nesterov momentum. Default false.
    pub nesterov: bool,
    /// AdamW first-moment decay. Default 0.9.
    pub beta1: f64,
    /// AdamW second-moment decay. Default 0.999.
    pub beta2: f64,
    /// AdamW epsilon. Default 1e-8.
    pub eps: f64,
    /// Scale `lr` with world size × accumulation: `none`, `linear` or `sqrt`. Default `none`.
    pub scale_lr: LrScaling,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            name: OptimizerKind::Adamw,
            lr: 1e-3,
            weight_decay: 0.0,
            momentum: 0.9,
            nesterov: false,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            scale_lr: LrScaling::None,
        }
    }
}

/// Shape of the learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// Constant learning rate.
    Constant,
    /// Cosine decay to `min_lr_ratio × lr` at the last step.
    Cosine,
    /// Linear decay to `min_lr_ratio × lr` at the last step.
    Linear,
    /// Step decay: the rate times `gamma` every `step_size` steps (not below
    /// `min_lr_ratio × lr`).
    Step,
    /// Reduce on plateau: the rate times `gamma` each time the validation metric of
    /// `schedule.plateau` has not improved for `patience` validations in a row (not below
    /// `min_lr_ratio × lr`).
    Plateau,
}

/// `[schedule]`: learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleConfig {
    /// `constant`, `cosine` or `linear`. Default `constant`.
    pub kind: ScheduleKind,
    /// Steps of linear warmup from 0 to the peak rate. Default 0.
    pub warmup_steps: usize,
    /// Final rate as a fraction of the peak (cosine and linear), and the floor of step decay
    /// and reduce-on-plateau. Default 0.1.
    pub min_lr_ratio: f64,
    /// Steps between two decays of `step`. Default 1000.
    pub step_size: usize,
    /// The factor of each decay (`step`, `plateau`). Default 0.1.
    pub gamma: f64,
    /// The validation metric `plateau` watches.
    pub plateau: MetricWatch,
}

/// A validation metric a run watches (`train.early_stopping`, `schedule.plateau`): its name,
/// which way is better, and what counts as an improvement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricWatch {
    /// `val_loss`, `val_accuracy` or `val_NAME` for a metric the model's step names.
    /// Default `val_loss`.
    pub metric: String,
    /// `min` (lower is better), `max`, or `auto`: `max` for accuracy, `min` otherwise.
    /// Default `auto`.
    pub mode: MetricMode,
    /// Validations in a row without an improvement before acting. Default 3.
    pub patience: usize,
    /// How much a value must beat the best by to count as an improvement. Default 0.
    pub min_delta: f64,
}

impl Default for MetricWatch {
    fn default() -> Self {
        Self {
            metric: "val_loss".into(),
            mode: MetricMode::Auto,
            patience: 3,
            min_delta: 0.0,
        }
    }
}

impl MetricWatch {
    /// Whether a higher value is better.
    pub fn maximize(&self) -> bool {
        match self.mode {
            MetricMode::Max => true,
            MetricMode::Min => false,
            MetricMode::Auto => self.metric.ends_with("accuracy"),
        }
    }

    /// Rejects a watch that cannot work; `key` is where it is configured.
    pub fn check(&self, key: &str) -> Result<()> {
        if !self.metric.starts_with("val_") || self.metric.len() == 4 {
            return bad(
                &format!("{key}.metric"),
                format!(
                    "expected a validation metric (\"val_loss\", \"val_accuracy\" or \
                     \"val_NAME\"), got {:?}",
                    self.metric
                ),
            );
        }
        if self.patience == 0 {
            return bad(
                &format!("{key}.patience"),
                "must be at least 1, got 0".into(),
            );
        }
        if !(self.min_delta.is_finite() && self.min_delta >= 0.0) {
            return bad(
                &format!("{key}.min_delta"),
                format!("must be a number >= 0, got {}", self.min_delta),
            );
        }
        Ok(())
    }
}

/// Which way a watched metric improves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MetricMode {
    /// `max` for a name ending in `accuracy`, `min` otherwise.
    Auto,
    /// Lower is better.
    Min,
    /// Higher is better.
    Max,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            kind: ScheduleKind::Constant,
            warmup_steps: 0,
            min_lr_ratio: 0.1,
            step_size: 1000,
            gamma: 0.1,
            plateau: MetricWatch::default(),
        }
    }
}

/// Which kind of device replicas run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Accelerator {
    /// CUDA when built with the `cuda` feature, otherwise the CPU.
    Auto,
    /// Burn's Flex CPU backend; N devices are N replicas, one thread each.
    Cpu,
    /// WGPU adapters (Vulkan, Metal, DX12, WebGPU).
    Wgpu,
    /// CUDA GPUs (needs the `cuda` feature).
    Cuda,
}

/// Parallel strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
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

/// Number of devices, or an explicit list of device indices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceList {
    /// The first N devices.
    Count(usize),
    /// These device indices.
    List(Vec<usize>),
}

impl DeviceList {
    /// The device indices this selects.
    pub fn indices(&self) -> Vec<usize> {
        match self {
            DeviceList::Count(n) => (0..*n).collect(),
            DeviceList::List(l) => l.clone(),
        }
    }
}

/// `[hardware]`: accelerator and devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HardwareConfig {
    /// `auto`, `cpu`, `wgpu` or `cuda`. Default `auto`.
    pub accelerator: Accelerator,
    /// How many devices (an integer) or which ones (a list of indices). Default 1.
    pub devices: DeviceList,
    /// On the CPU accelerator, how a device uses its cores: `auto` runs its batch as per-core
    /// sub-replicas (each a one-thread replica with its share of the batch, gradients
    /// averaged as one device — the schedule data parallelism uses across devices); `off`
    /// runs one replica whose kernels spread over the cores. Default `auto`.
    pub cpu_split: CpuSplit,
    /// On the CPU accelerator, the cores the devices share. Default: every core the machine
    /// offers the process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_cores: Option<usize>,
}

impl HardwareConfig {
    /// The cores CPU devices share: `cpu_cores`, or every core the process may use.
    pub fn cores(&self) -> usize {
        self.cpu_cores.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }
}

/// `hardware.cpu_split`: how a CPU device uses its cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpuSplit {
    /// Per-core sub-replicas where they fit (see [`HardwareConfig::cpu_split`]).
    Auto,
    /// One replica per device.
    Off,
}

impl Default for HardwareConfig {
    fn default() -> Self {
        Self {
            accelerator: Accelerator::Auto,
            devices: DeviceList::Count(1),
            cpu_split: CpuSplit::Auto,
            cpu_cores: None,
        }
    }
}

impl RootConfig {
    /// Reads a config file, applies `--set key=value` overrides and checks the result.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Self> {
        let (table, origin) = read_table(path, overrides)?;
        Self::from_table(table, &origin)
    }

    /// Builds the typed config from a TOML table; `origin` names the source in errors.
    pub fn from_table(mut table: toml::Table, origin: &str) -> Result<Self> {
        inherit_group_sections(&mut table);
        let de = toml::Value::Table(table);
        let config: RootConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = humanize(&one_line(e.inner()), &path);
            Error::config(format!("{origin}: key `{path}`: {inner}"))
        })?;
        // A value that parses but cannot work names its source too.
        config.validate().map_err(|e| with_origin(e, origin))?;
        Ok(config)
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

/// The TOML table of the config file at `path` (none: an empty table) with `overrides`
/// applied, and the name of its source for errors.
pub fn read_table(path: Option<&Path>, overrides: &[String]) -> Result<(toml::Table, String)> {
    let (mut table, origin) = match path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| Error::config(format!("{}: cannot read: {e}", p.display())))?;
            let table: toml::Table = toml::from_str(&text).map_err(|e| {
                Error::config(format!("{}: invalid TOML: {}", p.display(), one_line(&e)))
            })?;
            (table, p.display().to_string())
        }
        None => (toml::Table::new(), "built-in defaults".to_string()),
    };
    for o in overrides {
        apply_override(&mut table, o)?;
    }
    Ok((table, origin))
}

/// `e` (a refusal of a value) named after its source, `origin`.
pub fn with_origin(e: Error, origin: &str) -> Error {
    match e {
        Error::Config(m) => Error::config(format!("{origin}: {m}")),
        other => other,
    }
}

/// A refusal of `key`'s value.
fn bad(key: &str, msg: String) -> Result<()> {
    Err(Error::config(format!("key `{key}`: {msg}")))
}

impl TrainConfig {
    /// Rejects loop settings that cannot work.
    pub fn check(&self) -> Result<()> {
        if self.batch_size == 0 {
            return bad("train.batch_size", "must be at least 1, got 0".into());
        }
        if self.accumulate == 0 {
            return bad("train.accumulate", "must be at least 1, got 0".into());
        }
        if self.log_every == 0 {
            return bad("train.log_every", "must be at least 1, got 0".into());
        }
        if self.epochs == 0 && self.max_steps.is_none() {
            return bad(
                "train.epochs",
                "must be at least 1 when train.max_steps is unset".into(),
            );
        }
        for (key, v) in [
            ("train.max_steps", self.max_steps),
            ("train.val_every", self.val_every),
            ("train.checkpoint_every", self.checkpoint_every),
        ] {
            if v == Some(0) {
                return bad(key, "must be at least 1 (or left unset), got 0".into());
            }
        }
        if let Some(m) = &self.best_metric
            && !["val_loss", "val_accuracy"].contains(&m.as_str())
        {
            return bad(
                "train.best_metric",
                format!("expected \"val_loss\" or \"val_accuracy\", got {m:?}"),
            );
        }
        if let Some(w) = &self.early_stopping {
            w.check("train.early_stopping")?;
        }
        if let Some(c) = self.grad_clip
            && !(c.is_finite() && c > 0.0)
        {
            return bad(
                "train.grad_clip",
                format!("must be a positive number, got {c}"),
            );
        }
        Ok(())
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

impl PrecisionConfig {
    /// Rejects a loss scaler that does not apply, and scaler values that cannot work.
    pub fn check(&self) -> Result<()> {
        if self.scaler == ScalerKind::Dynamic && self.mode != PrecisionMode::F16Mixed {
            return bad(
                "precision.scaler",
                format!(
                    "a loss scaler only applies to precision \"16-mixed\" (bf16 has f32's \
                     exponent range, so its gradients do not underflow), got precision {:?}",
                    name_of(&self.mode)
                ),
            );
        }
        if !(self.init_scale.is_finite() && self.init_scale >= 1.0) {
            return bad(
                "precision.init_scale",
                format!("must be a finite number >= 1, got {}", self.init_scale),
            );
        }
        if self.growth_interval == 0 {
            return bad(
                "precision.growth_interval",
                "must be at least 1, got 0".into(),
            );
        }
        Ok(())
    }
}

impl RecomputeConfig {
    /// Rejects a recomputation interval of 0.
    pub fn check(&self) -> Result<()> {
        if self.every == 0 {
            return bad("recompute.every", "must be at least 1, got 0".into());
        }
        Ok(())
    }
}

impl MonitorConfig {
    /// Rejects sampling and throughput settings that cannot work.
    pub fn check(&self) -> Result<()> {
        if !(self.interval_s.is_finite() && self.interval_s >= 0.0) {
            return bad(
                "monitor.interval_s",
                format!(
                    "must be a number of seconds >= 0 (0 turns sampling off), got {}",
                    self.interval_s
                ),
            );
        }
        if let Some(p) = self.peak_tflops
            && !(p.is_finite() && p > 0.0)
        {
            return bad(
                "monitor.peak_tflops",
                format!("must be a positive number of TFLOP/s, got {p}"),
            );
        }
        if !(0.0..1.0).contains(&self.smoothing) {
            return bad(
                "monitor.smoothing",
                format!("must be in [0, 1), got {}", self.smoothing),
            );
        }
        Ok(())
    }
}

impl HardwareConfig {
    /// Rejects an empty device selection and a device named twice.
    pub fn check(&self) -> Result<()> {
        let devices = self.devices.indices();
        if devices.is_empty() {
            return bad(
                "hardware.devices",
                "must name at least one device (a count >= 1 or a non-empty list), got 0".into(),
            );
        }
        let mut sorted = devices.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != devices.len() {
            return bad(
                "hardware.devices",
                format!("lists a device twice: {devices:?}"),
            );
        }
        if self.cpu_cores == Some(0) {
            return bad(
                "hardware.cpu_cores",
                "must be at least 1 (or left unset for every core), got 0".into(),
            );
        }
        Ok(())
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

impl RunConfig {
    /// Rejects a run name that is not a plain directory name.
    pub fn check(&self) -> Result<()> {
        if self.name.is_empty() || self.name.contains(['/', '\\']) {
            return bad(
                "run.name",
                format!("must be a plain directory name, got {:?}", self.name),
            );
        }
        Ok(())
    }
}

/// Whether `name` can name a parameter group: lower-case letters, digits, `_` and `-`.
pub fn is_group_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// Rejects optimizer and schedule values that cannot work; `prefix` is the keys' section
/// (`""` or `"groups.generator."`).
fn check_optim(prefix: &str, optim: &OptimConfig, schedule: &ScheduleConfig) -> Result<()> {
    let bad = |key: &str, msg: String| Err(Error::config(format!("key `{prefix}{key}`: {msg}")));
    if !(optim.lr.is_finite() && optim.lr > 0.0) {
        return bad(
            "optim.lr",
            format!("must be a positive number, got {}", optim.lr),
        );
    }
    if optim.weight_decay.is_nan() || optim.weight_decay < 0.0 {
        return bad(
            "optim.weight_decay",
            format!("must be >= 0, got {}", optim.weight_decay),
        );
    }
    for (key, v) in [
        ("optim.momentum", optim.momentum),
        ("optim.beta1", optim.beta1),
        ("optim.beta2", optim.beta2),
    ] {
        if !(0.0..1.0).contains(&v) {
            return bad(key, format!("must be in [0, 1), got {v}"));
        }
    }
    if optim.eps.is_nan() || optim.eps <= 0.0 {
        return bad("optim.eps", format!("must be positive, got {}", optim.eps));
    }
    if !(0.0..=1.0).contains(&schedule.min_lr_ratio) {
        return bad(
            "schedule.min_lr_ratio",
            format!("must be in [0, 1], got {}", schedule.min_lr_ratio),
        );
    }
    if matches!(schedule.kind, ScheduleKind::Step | ScheduleKind::Plateau)
        && !(schedule.gamma > 0.0 && schedule.gamma < 1.0)
    {
        return bad(
            "schedule.gamma",
            format!("must be in (0, 1), got {}", schedule.gamma),
        );
    }
    if schedule.kind == ScheduleKind::Step && schedule.step_size == 0 {
        return bad("schedule.step_size", "must be at least 1, got 0".into());
    }
    if schedule.kind == ScheduleKind::Plateau {
        schedule
            .plateau
            .check(&format!("{prefix}schedule.plateau"))?;
    }
    Ok(())
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

/// Applies one `a.b.c=value` override to a TOML table. The value is read as a TOML value, and
/// as a plain string when it is not one.
pub fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let Some((key, raw)) = assignment.split_once('=') else {
        return Err(Error::config(format!(
            "--set {assignment:?}: expected KEY=VALUE, e.g. train.epochs=3"
        )));
    };
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(Error::config(format!(
            "--set {assignment:?}: the key must be dotted names, e.g. optim.lr"
        )));
    }
    let value = parse_value(raw.trim());
    let parts: Vec<&str> = key.split('.').collect();
    let mut node = table;
    for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
        let entry = node
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        node = match entry {
            toml::Value::Table(t) => t,
            _ => {
                return Err(Error::config(format!(
                    "--set {key}: `{}` is a value, not a section",
                    parts[..=i].join(".")
                )));
            }
        };
    }
    node.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

fn parse_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match toml::from_str::<toml::Table>(&doc) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

/// Serde's messages in a user's words: type names as kinds of value, without the location
/// that the caller already prints.
pub(crate) fn humanize(message: &str, path: &str) -> String {
    let mut m = message.replace(&format!(" in `{path}`"), "");
    for (rust, words) in [
        ("expected usize", "expected a non-negative integer"),
        ("expected u64", "expected a non-negative integer"),
        ("expected u32", "expected a non-negative integer"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
    ] {
        m = m.replace(rust, words);
    }
    m
}

/// The config spelling of an enum value (`"fashion-mnist"`, `"cosine"`).
pub fn name_of<T: Serialize>(v: &T) -> String {
    toml::Value::try_from(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A multi-line error message folded onto one line.
pub fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(overrides: &[&str]) -> Result<RootConfig> {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        RootConfig::load(None, &o)
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
        ] {
            let e = load(&[o]).unwrap_err().to_string();
            assert!(e.contains(key), "{o}: {e}");
        }
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
