//! The end of a rank's step, after its gradients are reduced: unscaled, checked for a value
//! that is not finite (on the host, or for a rank alone on the device: `optim/guard.rs`),
//! clipped to the global norm, and the optimizer's update of the rank's shard.

use std::time::Instant;

use burn::prelude::*;

use super::kit::RankKit;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::precision::LossScaler;

/// A function of the gradient giving the global sum of squares.
pub(crate) type SquaresFn<'n> = Box<dyn FnOnce(&Tensor<1>) -> Result<f32> + 'n>;

/// Where the global gradient norm of clipping comes from.
pub(crate) enum Norm<'n> {
    /// The rank's gradient is the whole gradient.
    Local,
    /// This tensor (on the device) is the whole averaged gradient, of which the rank steps a
    /// shard: the norm is taken over it exactly as `ddp` takes it, so that `zero1` clips by
    /// the same factor to the bit.
    Whole(Box<Tensor<1>>),
    /// Every rank holds a shard: the squares are summed per shard and all-reduced.
    Shards,
    /// This function of the (unscaled) gradient gives the global sum of squares (a pipeline
    /// stage adds its part to the other stages').
    Squares(SquaresFn<'n>),
}

/// The factor, on the device, that clips a gradient whose whole is `whole` to the L2 norm `max`.
fn clip_factor(whole: Tensor<1>, max: f64) -> Tensor<1> {
    let total = whole.square().sum();
    (total.sqrt().add_scalar(1e-6).recip() * max).clamp_max(1.0)
}

impl RankKit<'_> {
    /// After the gradients are reduced: unscales them and checks them for overflow (with a
    /// scaler, on every rank alike), clips them to the global norm `clip` (taken as `norm`
    /// says) and steps the optimizer. `grads` is the shard's f32 gradient, `params` its
    /// parameters. Returns the new parameters, or `None` when the step is skipped.
    pub fn finish(
        &mut self,
        grads: Tensor<1>,
        params: Tensor<1>,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
        norm: Norm<'_>,
    ) -> Result<Option<Tensor<1>>> {
        let mut grads = grads;
        if let Some(tp) = &self.tp
            && !tp.summed.is_empty()
        {
            grads = self.sum_parts(grads)?;
        }
        self.deferred = self.on_device
            && scaler.is_none()
            && matches!(norm, Norm::Local)
            && self.optimizer.guardable();
        if self.deferred {
            return Ok(Some(self.finish_on_device(grads, params, lr, clip)));
        }
        let unscale = scaler.as_ref().map(|sc| (1.0 / sc.scale) as f32);
        if let Some(u) = unscale {
            grads = grads.mul_scalar(u);
        }
        // Every rank holds a shard of the same averaged gradient (or all of it): one flag,
        // summed over ranks, decides for every rank alike. A loss scaler takes an overflow as
        // the sign to lower its scale; without one, a non-finite gradient is the run's problem
        // (the loop stops, or skips as `train.skip_nonfinite` allows).
        let total: f32 = grads.clone().abs().sum().into_scalar();
        let mut flag = vec![f32::from(u8::from(!total.is_finite()))];
        self.timed(|c| c.all_reduce(&mut flag, ReduceOp::Sum))?;
        let tp = self.tp.as_ref().map(|t| (t.comm, t.weights.clone()));
        if let Some((group, _)) = &tp {
            // The other parts of the model are the other ranks' of the group.
            self.timed(|_| group.all_reduce(&mut flag, ReduceOp::Sum))?;
        }
        let finite = flag[0] == 0.0;
        self.nonfinite = !finite && scaler.is_none();
        if let Some(sc) = scaler {
            if !sc.update(finite) {
                return Ok(None);
            }
        } else if !finite {
            return Ok(None);
        }
        if let (Some(max), Some((group, weights))) = (clip, tp) {
            // The squares of the rank's shard, then of every shard of its part (or of every
            // stage of its pipeline), then of every part; what every rank of the group holds
            // whole is weighted to count once.
            let mut squares = match norm {
                Norm::Squares(total) => {
                    let started = Instant::now();
                    let weighted = grads.clone() * weights.sqrt();
                    let s = total(&weighted)?;
                    self.sync_seconds += started.elapsed().as_secs_f64();
                    vec![s]
                }
                _ => {
                    let weighted = grads.clone().square() * weights;
                    let mut s = vec![weighted.sum().into_scalar::<f32>()];
                    if self.layout.shards > 1 {
                        self.timed(|c| c.all_reduce(&mut s, ReduceOp::Sum))?;
                    }
                    s
                }
            };
            self.timed(|_| group.all_reduce(&mut squares, ReduceOp::Sum))?;
            let factor = (max as f32 / (squares[0].sqrt() + 1e-6)).min(1.0);
            grads = grads.mul_scalar(factor);
        } else if let Some(max) = clip {
            // On the device: the factor is a tensor, never read back.
            let factor = |whole: Tensor<1>| clip_factor(whole, max);
            grads = match norm {
                Norm::Local => {
                    let f = factor(grads.clone());
                    grads * f
                }
                Norm::Whole(whole) => {
                    let whole = *whole;
                    let whole = match unscale {
                        Some(u) => whole.mul_scalar(u),
                        None => whole,
                    };
                    grads * factor(whole)
                }
                Norm::Shards => {
                    let mut squares = vec![grads.clone().square().sum().into_scalar::<f32>()];
                    self.timed(|c| c.all_reduce(&mut squares, ReduceOp::Sum))?;
                    let factor = (max as f32 / (squares[0].sqrt() + 1e-6)).min(1.0);
                    grads.mul_scalar(factor)
                }
                Norm::Squares(total) => {
                    let started = Instant::now();
                    let squares = total(&grads)?;
                    self.sync_seconds += started.elapsed().as_secs_f64();
                    let factor = (max as f32 / (squares.sqrt() + 1e-6)).min(1.0);
                    grads.mul_scalar(factor)
                }
            };
        }
        let out = self.optimizer.step(lr, params, grads);
        self.memory.optim.set(self.optimizer.state_bytes());
        self.memory.note();
        Ok(Some(out))
    }

    /// [`Self::finish`] for a rank alone, without a scaler, when the optimizer can be told on
    /// the device whether to step: whether the gradient is finite stays on the device, where
    /// the update leaves every parameter as it was when it is not, and the host reads it later
    /// with the other steps' ([`Self::take_skipped`]).
    fn finish_on_device(
        &mut self,
        grads: Tensor<1>,
        params: Tensor<1>,
        lr: f64,
        clip: Option<f64>,
    ) -> Tensor<1> {
        // As the host's check: the sum of magnitudes is finite. Burn's test reads the bits, as
        // it must where kernels are compiled for fast arithmetic (WGPU on llvmpipe folded
        // `x − x == 0` to true for a NaN).
        let taken = grads.clone().abs().sum().is_finite().float();
        let grads = match clip {
            Some(max) => {
                let f = clip_factor(grads.clone(), max);
                grads * f
            }
            None => grads,
        };
        self.nonfinite = false;
        let out = self.optimizer.step_guarded(lr, params, grads, taken);
        self.memory.optim.set(self.optimizer.state_bytes());
        self.memory.note();
        out
    }

    /// The optimizer steps since the last call whose gradient the device found not finite and
    /// skipped, by position (0: the first since then); empty where each step's check is read
    /// at the step ([`RankKit::nonfinite`]).
    pub fn take_skipped(&mut self) -> Vec<usize> {
        self.optimizer.settle()
    }

    /// `grads` with the runs the tensor-parallel group sums ([`TpNorm::summed`]) summed over
    /// it: every rank of the group holds the same shard of the same layout.
    fn sum_parts(&mut self, grads: Tensor<1>) -> Result<Tensor<1>> {
        let Some(tp) = &self.tp else {
            return Ok(grads);
        };
        let (group, summed) = (tp.comm, tp.summed.clone());
        let parts: Vec<Tensor<1>> = summed
            .iter()
            .map(|r| grads.clone().slice(r.clone()))
            .collect();
        let mut values: Vec<f32> = Tensor::cat(parts, 0)
            .try_into_vec_as::<f32>()
            .map_err(|e| Error::Worker(format!("a gradient's parts could not be read: {e:?}")))?;
        self.timed(|_| group.all_reduce(&mut values, ReduceOp::Sum))?;
        let mut grads = grads;
        let mut at = 0;
        for r in summed {
            let n = r.len();
            let part = Tensor::<1>::from_data(
                TensorData::new(values[at..at + n].to_vec(), [n]),
                &self.inner,
            )
            .cast(grads.dtype());
            grads = grads.slice_assign(r, part);
            at += n;
        }
        Ok(grads)
    }
}
