//! `[run]`, `[train]` and the data loader's keys: what a run is called, how long it trains, how
//! it logs, validates and checkpoints, and who builds its batches.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::names::bad;
use crate::error::Result;

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
    /// Write each checkpoint (but the run's last one) in the background: the step hands the
    /// gathered model and optimizer state to a writer and goes on, and the next checkpoint
    /// waits only for a write still going. A crash mid-write leaves the checkpoint before it
    /// the newest whole one. Default true.
    pub checkpoint_async: bool,
    /// How a checkpoint is written: `"gathered"` — the whole model and optimizer state
    /// gathered and written by rank 0 (`model.bpk`, `optimizer.bpk`) — or `"sharded"` — each
    /// rank writes the state it holds (its ZeRO shard, or its equal part of what replicas
    /// hold) in parallel, the step waiting only for a copy of it (`rank-N.bin`, `rest-N.bpk`).
    /// Either resumes under any strategy and world size. Default "gathered".
    pub checkpoint_format: CheckpointFormat,
    /// Clip gradients to this global L2 norm. Default: unset (no clipping).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_clip: Option<f64>,
    /// Steps whose gradients hold an infinity or NaN (without a loss scaler) that may be
    /// skipped, leaving the parameters as they were; one more stops the run with an error
    /// naming the step, rank and micro-batch. Default 0.
    pub skip_nonfinite: usize,
    /// When the host waits for the device. `"step"`: at every step — whether the gradient is
    /// finite is read at its step, and each step's time is split into compute and optimizer.
    /// `"log"`: only where a number must reach the host — a log line, a checkpoint, a
    /// validation, the run's end — with a step whose gradient is not finite skipped on the
    /// device and acted on (counted under `skip_nonfinite`, or the run stopped naming it) at
    /// the next of those, and the time split measured on log steps (the others' queued work
    /// counts as the log step's compute). `"log"` applies to a device alone in its group
    /// stepping AdamW in f32 without a loss scaler; elsewhere every step is read. `"auto"`:
    /// `"log"` on a GPU, `"step"` on the CPU (whose reads wait for nothing). Default "auto".
    pub host_waits: HostWaits,
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
            checkpoint_async: true,
            checkpoint_format: CheckpointFormat::Gathered,
            grad_clip: None,
            skip_nonfinite: 0,
            host_waits: HostWaits::Auto,
            checkpoint_on_signal: true,
            best_metric: None,
            early_stopping: None,
            check_replicas: false,
        }
    }
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

/// `train.checkpoint_format`: how a checkpoint is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointFormat {
    /// The whole model and optimizer state, gathered and written by rank 0.
    Gathered,
    /// Each rank writes what it holds, in parallel.
    Sharded,
}

/// `train.host_waits`: when the host waits for the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostWaits {
    /// `log` on a GPU, `step` on the CPU.
    Auto,
    /// At every step.
    Step,
    /// Where a number must reach the host: log lines, checkpoints, validations.
    Log,
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
