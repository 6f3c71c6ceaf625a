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

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

use crate::config::{PrecisionConfig, PrecisionMode, name_of};
use crate::error::{Error, Result};

/// The dtype replicas compute in under `mode`.
pub fn compute_dtype(mode: PrecisionMode) -> FloatDType {
    match mode {
        PrecisionMode::F32 => FloatDType::F32,
        PrecisionMode::Bf16Mixed | PrecisionMode::Bf16True => FloatDType::BF16,
        PrecisionMode::F16Mixed | PrecisionMode::F16True => FloatDType::F16,
    }
}

/// Whether `mode` keeps f32 master weights apart from a low-precision compute copy.
pub fn is_mixed(mode: PrecisionMode) -> bool {
    matches!(mode, PrecisionMode::Bf16Mixed | PrecisionMode::F16Mixed)
}

/// Whether `mode` keeps the parameters themselves (and so the optimizer state) in a low dtype.
pub fn is_true_low(mode: PrecisionMode) -> bool {
    matches!(mode, PrecisionMode::Bf16True | PrecisionMode::F16True)
}

/// Fails with a clear message when `device` cannot compute in the dtype `config` asks for.
pub fn check_device(config: &PrecisionConfig, device: &Device, label: &str) -> Result<()> {
    let dtype = compute_dtype(config.mode);
    if dtype != FloatDType::F32 && !device.supports_dtype(dtype) {
        return Err(Error::config(format!(
            "key `precision.mode`: {:?} computes in {dtype:?}, which device {label} does not \
             support for arithmetic; use precision \"32\"{}",
            name_of(&config.mode),
            if dtype == FloatDType::BF16 {
                " or \"16-mixed\""
            } else {
                ""
            }
        )));
    }
    Ok(())
}

/// `module` with its trained parameters (and, with `buffers`, its other float tensors) in
/// `dtype`: fresh leaves with the same parameter ids, so that gradients computed on the copy
/// are keyed like the original's.
///
/// Buffers are Burn `RunningState`s, which clones share and which mapping changes in place:
/// casting them changes the original's too, so mixed precision leaves them alone.
pub fn cast_params<M: Module>(module: M, dtype: FloatDType, buffers: bool) -> M {
    struct Cast {
        dtype: FloatDType,
        buffers: bool,
    }
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let trained = param.is_require_grad();
            if !trained && !self.buffers {
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
    module.map(&mut Cast { dtype, buffers })
}

/// Converts every gradient in `grads` to the dtype of its parameter in `module` (the master
/// copy), multiplying by `scale` on the way when given; returns the sum of the absolute values
/// of all gradients when `measure` (infinite or NaN when any gradient is), for the loss
/// scaler's overflow check.
pub fn to_master_grads<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    scale: Option<f32>,
    measure: bool,
) -> (GradientsParams, Option<Tensor<1>>) {
    struct Convert<'a> {
        grads: &'a mut GradientsParams,
        scale: Option<f32>,
        measure: bool,
        total: Option<Tensor<1>>,
    }
    impl ModuleVisitor for Convert<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                return;
            }
            let Some(g) = self.grads.remove::<D>(param.id) else {
                return;
            };
            let mut g = g.cast(FloatDType::from(param.val().dtype()));
            if let Some(s) = self.scale {
                g = g.mul_scalar(s);
            }
            if self.measure {
                let part = g.clone().cast(FloatDType::F32).abs().sum();
                self.total = Some(match self.total.take() {
                    Some(t) => t + part,
                    None => part,
                });
            }
            self.grads.register::<D>(param.id, g);
        }
    }
    let mut c = Convert {
        grads: &mut grads,
        scale,
        measure,
        total: None,
    };
    module.visit(&mut c);
    let total = c.total;
    (grads, total)
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
