//! `[precision]` and `[recompute]`: the dtypes of replicas, master weights and reductions, and
//! activation checkpointing.

use serde::{Deserialize, Serialize};

use super::names::{bad, name_of};
use crate::error::Result;

/// Numeric precision, with the meanings Lightning gives these names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum PrecisionMode {
    /// Everything in f32.
    #[serde(rename = "32", alias = "32-true")]
    #[cfg_attr(feature = "clap", value(name = "32", alias = "32-true"))]
    F32,
    /// Replicas compute in bf16; f32 master weights and optimizer state.
    #[serde(rename = "bf16-mixed")]
    #[cfg_attr(feature = "clap", value(name = "bf16-mixed"))]
    Bf16Mixed,
    /// Replicas compute in f16 with a dynamic loss scaler; f32 master weights and optimizer
    /// state.
    #[serde(rename = "16-mixed")]
    #[cfg_attr(feature = "clap", value(name = "16-mixed"))]
    F16Mixed,
    /// Weights, optimizer state and compute all in bf16.
    #[serde(rename = "bf16-true")]
    #[cfg_attr(feature = "clap", value(name = "bf16-true"))]
    Bf16True,
    /// Weights, optimizer state and compute all in f16.
    #[serde(rename = "16-true")]
    #[cfg_attr(feature = "clap", value(name = "16-true"))]
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

impl RecomputeConfig {
    /// Rejects a recomputation interval of 0.
    pub fn check(&self) -> Result<()> {
        if self.every == 0 {
            return bad("recompute.every", "must be at least 1, got 0".into());
        }
        Ok(())
    }
}
