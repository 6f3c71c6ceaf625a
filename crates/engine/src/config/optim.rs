//! `[optim]`, `[schedule]` and `[groups.<name>]`: the optimizer and the learning-rate schedule,
//! of the whole model or of each parameter group.

use serde::{Deserialize, Serialize};

use super::train::MetricWatch;
use crate::error::{Error, Result};

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

/// `[groups.<name>]`: one parameter group's optimizer and schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct GroupConfig {
    /// The group's optimizer (what it does not set comes from `[optim]`).
    pub optim: OptimConfig,
    /// The group's learning-rate schedule (what it does not set comes from `[schedule]`).
    pub schedule: ScheduleConfig,
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
pub(super) fn check_optim(
    prefix: &str,
    optim: &OptimConfig,
    schedule: &ScheduleConfig,
) -> Result<()> {
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
