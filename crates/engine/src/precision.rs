//! The precision policy the trainer applies around a model and its optimizer.
//!
//! Burn 0.22 has no autocast: a module computes in the dtype of its parameters. kiln therefore
//! applies precision from outside the model:
//! - *mixed* (`bf16-mixed`, `16-mixed`): the optimizer owns f32 **master** parameters (and so
//!   f32 optimizer state); before each step the replica's compute copy is cast from them
//!   ([`cast_params`]) with the same parameter ids, the batch is cast to the compute dtype, and
//!   the gradients, which come out in the compute dtype, are converted to f32 before the
//!   update;
//! - *true* (`bf16-true`, `16-true`): the parameters themselves (and the optimizer state built
//!   from their gradients) are in the low dtype;
//! - `16-mixed` adds a dynamic [`LossScaler`].
//!
//! The models compute their loss in f32 whatever the logits' dtype (softmax and log in 16-bit
//! floats lose too much), which is the one place where autocast would also widen.

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

use crate::config::{PrecisionConfig, PrecisionMode, ReduceDtype, name_of};
use crate::error::{Error, Result};
use crate::params::dtype_bytes;

/// The dtype replicas compute in under `mode`.
pub fn compute_dtype(mode: PrecisionMode) -> FloatDType {
    match mode {
        PrecisionMode::F32 => FloatDType::F32,
        PrecisionMode::Bf16Mixed | PrecisionMode::Bf16True => FloatDType::BF16,
        PrecisionMode::F16Mixed | PrecisionMode::F16True => FloatDType::F16,
    }
}

/// The precision of a run as one value, decided once from `[precision]`: the dtypes, and
/// every step of the policy that touches a model, a batch or the optimizer (Lightning's
/// precision plugin). Nothing else in kiln branches on the mode.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    config: PrecisionConfig,
    /// The dtype replicas compute in.
    pub compute: FloatDType,
    /// The dtype of the parameters the optimizer steps, and so of its state: f32, or the low
    /// dtype of a `-true` precision.
    pub master: FloatDType,
    /// Whether f32 master weights are kept apart from a compute copy cast from them every step
    /// (`bf16-mixed`, `16-mixed`).
    pub mixed: bool,
}

impl Policy {
    /// The policy `config` describes.
    pub fn new(config: &PrecisionConfig) -> Self {
        let mode = config.mode;
        let compute = compute_dtype(mode);
        let low_master = matches!(mode, PrecisionMode::Bf16True | PrecisionMode::F16True);
        Self {
            config: config.clone(),
            compute,
            master: if low_master { compute } else { FloatDType::F32 },
            mixed: matches!(mode, PrecisionMode::Bf16Mixed | PrecisionMode::F16Mixed),
        }
    }

    /// The `[precision]` section this policy was made from.
    pub fn config(&self) -> &PrecisionConfig {
        &self.config
    }

    /// The mode's name as the config spells it.
    pub fn name(&self) -> String {
        name_of(&self.config.mode)
    }

    /// The dtype gradients travel in when they are reduced.
    pub fn reduce_dtype(&self) -> ReduceDtype {
        self.config.reduce_dtype
    }

    /// Whether the parameters themselves live in a low dtype (`-true`).
    pub fn low_master(&self) -> bool {
        self.master != FloatDType::F32
    }

    /// A fresh loss scaler, when the policy scales the loss (`16-mixed`).
    pub fn scaler(&self) -> Option<LossScaler> {
        self.config
            .uses_scaler()
            .then(|| LossScaler::new(self.config.init_scale, self.config.growth_interval))
    }

    /// A rank's module as it trains: under `-true` its parameters and buffers in the low
    /// dtype, otherwise as it is (f32).
    pub fn master_model<M: Module>(&self, model: M) -> M {
        if self.low_master() {
            cast_params(model, self.master, true)
        } else {
            model
        }
    }

    /// The compute copy of `master` for one step (mixed precision), with the master's
    /// parameter ids; `None` when the master computes itself.
    pub fn compute_copy<M: Module>(&self, master: &M) -> Option<M> {
        self.mixed
            .then(|| cast_params(master.clone(), self.compute, false))
    }

    /// The trained parameters' flat vector `flat` (f32 masters) cast to the compute dtype in
    /// one cast (mixed precision), from which the next compute copy's parameters are views;
    /// `None` when the master computes itself.
    pub fn compute_flat(&self, flat: &Tensor<1>) -> Option<Tensor<1>> {
        self.mixed.then(|| flat.clone().cast(self.compute))
    }

    /// `batch` with its float inputs in the compute dtype, `cast` doing the casting (the
    /// workload knows which of its tensors are floats).
    pub fn cast_batch<B>(&self, batch: B, cast: impl FnOnce(B, FloatDType) -> B) -> B {
        if self.compute == FloatDType::F32 {
            batch
        } else {
            cast(batch, self.compute)
        }
    }

    /// The module evaluation runs: the precision the ranks train in.
    pub fn eval_model<M: Module>(&self, model: &M) -> M {
        self.compute_copy(model).unwrap_or_else(|| model.clone())
    }

    /// `model` as it leaves the run (exported, snapshotted): f32 whatever the training
    /// precision.
    pub fn export<M: Module>(&self, model: M) -> M {
        if self.low_master() {
            cast_params(model, FloatDType::F32, true)
        } else {
            model
        }
    }

    /// Bytes of `n` parameter elements in the master dtype.
    pub fn master_bytes(&self, n: usize) -> usize {
        n * dtype_bytes(self.master)
    }

    /// Bytes of the compute copy of `n` parameter elements (0 when there is none).
    pub fn compute_copy_bytes(&self, n: usize) -> usize {
        if self.mixed {
            n * dtype_bytes(self.compute)
        } else {
            0
        }
    }

    /// Bytes of `n` parameter elements gathered to compute with (ZeRO-3's units).
    pub fn compute_bytes(&self, n: usize) -> usize {
        n * dtype_bytes(if self.mixed {
            self.compute
        } else {
            self.master
        })
    }

    /// Fails with a clear message when `device` cannot compute in the policy's dtype.
    pub fn check_device(&self, device: &Device, label: &str) -> Result<()> {
        let dtype = self.compute;
        if dtype != FloatDType::F32 && !device.supports_dtype(dtype) {
            return Err(Error::config(format!(
                "key `precision.mode`: {:?} computes in {dtype:?}, which device {label} does not \
                 support for arithmetic; use precision \"32\"{}",
                self.name(),
                // Only where the device computes in f16 (llvmpipe does in neither).
                if dtype == FloatDType::BF16 && device.supports_dtype(FloatDType::F16) {
                    " or \"16-mixed\""
                } else {
                    ""
                }
            )));
        }
        Ok(())
    }

    /// Refuses a model the policy cannot run: mixed precision with buffers (BatchNorm running
    /// statistics), which Burn shares between the master and its compute copy.
    pub fn check_model(&self, has_buffers: bool) -> Result<()> {
        if self.mixed && has_buffers {
            return Err(Error::config(format!(
                "key `precision.mode`: {:?} keeps f32 master weights apart from a low-precision \
                 copy, but this model has buffers (BatchNorm running statistics), which Burn \
                 shares between the two and updates in the compute dtype; use precision \"32\" \
                 or a \"-true\" precision, or a model without BatchNorm",
                self.name()
            )));
        }
        Ok(())
    }

    /// The start-up table's words for the policy; `reduced` when gradients are reduced
    /// between this process's devices.
    pub fn describe(&self, reduced: bool) -> String {
        let mut line = self.name();
        if self.mixed {
            line += " (f32 master weights and optimizer state)";
        }
        if self.config.uses_scaler() {
            line += &format!(", dynamic loss scale from {}", self.config.init_scale);
        }
        if reduced {
            line += &format!(
                ", gradients reduced in {}",
                name_of(&self.config.reduce_dtype)
            );
        }
        line
    }
}

/// `module` with its parameters, trained and frozen (and, with `buffers`, its running state)
/// in `dtype`: fresh leaves with the same parameter ids, so that gradients computed on the copy
/// are keyed like the original's.
///
/// Buffers are Burn `RunningState`s, which clones share and which mapping changes in place:
/// casting them changes the original's too, so mixed precision leaves them alone.
///
/// A quantized parameter (QLoRA's frozen base) stays packed: it has no float dtype to cast,
/// and Burn's adapter dequantizes it straight to its factors' dtype when it composes the
/// weight, so a base under bf16 factors computes in bf16.
pub fn cast_params<M: Module>(module: M, dtype: FloatDType, buffers: bool) -> M {
    struct Cast {
        dtype: FloatDType,
        buffers: bool,
        running: std::collections::HashSet<burn::module::ParamId>,
    }
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let trained = param.is_require_grad();
            // Frozen parameters compute like trained ones; only buffers may stay.
            if !trained && !self.buffers && self.running.contains(&param.id) {
                return param;
            }
            if !param.dtype().is_float() {
                return param;
            }
            let dtype = self.dtype;
            param.map(|t| {
                t.set_require_grad(false)
                    .cast(dtype)
                    .set_require_grad(trained)
            })
        }
    }
    let running = if buffers {
        std::collections::HashSet::new()
    } else {
        crate::params::running_state_ids(&module)
    };
    module.map(&mut Cast {
        dtype,
        buffers,
        running,
    })
}

/// Dynamic loss scaling for f16: the loss is multiplied by `scale` before backward so that
/// small gradients do not flush to zero; gradients are divided by it before clipping and the
/// update. A step whose gradients hold an infinity or NaN is skipped and the scale halved;
/// after `growth_interval` clean steps in a row the scale doubles.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The current scale.
    pub scale: f64,
    /// Clean steps since the scale last changed.
    pub good_steps: usize,
    /// Steps skipped so far for overflow.
    pub skipped: usize,
    /// Clean steps after which the scale doubles.
    pub growth_interval: usize,
}

impl LossScaler {
    /// A scaler starting at `init_scale`.
    pub fn new(init_scale: f64, growth_interval: usize) -> Self {
        Self {
            scale: init_scale,
            good_steps: 0,
            skipped: 0,
            growth_interval,
        }
    }

    /// Records the outcome of a step: `finite` when every gradient was finite. Returns whether
    /// the optimizer may step.
    pub fn update(&mut self, finite: bool) -> bool {
        if finite {
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale *= 2.0;
                self.good_steps = 0;
            }
        } else {
            self.scale *= 0.5;
            self.good_steps = 0;
            self.skipped += 1;
        }
        finite
    }
}
