//! AdamW's update of a flat f32 shard on the CPU as one loop over its elements.
//!
//! Burn's AdamW makes about a dozen whole-shard tensors per step (each moment scaled, the
//! gradient squared, the corrections, the square root, the quotient, the decay factor), each
//! a pass over memory and an allocation; here each element is read once and its parameter and
//! moments written once. The arithmetic is Burn's, operation for operation and in f32 (what
//! [`burn::optim::AdamW`] does with its element-wise ops, `weight_decay` 0 and kiln's decay
//! mask applied first, as [`super::FlatOptimizer`] builds it), so the result is the same bits;
//! the tests hold it to that. It runs where the fused kernels do (Flex, f32,
//! `hardware.fused_kernels` on); on a CubeCL GPU the same arithmetic runs as one CubeCL kernel
//! (`kiln_models::cube::adamw`, stepped from `flat.rs`); elsewhere Burn's optimizer steps.

use burn::backend::DispatchDevice;
use burn::optim::{AdamWState, AdaptiveMomentumState};
use burn::prelude::*;
use burn::tensor::FloatDType;

/// AdamW's constants, as Burn's `AdamWConfig` holds them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Adam {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
}

/// Whether a shard in `dtype` on `device` (without autodiff) steps through the fused loop.
pub(super) fn here(dtype: FloatDType, device: &Device) -> bool {
    kiln_models::fused::enabled()
        && dtype == FloatDType::F32
        && matches!(device.as_dispatch(), DispatchDevice::Flex(_))
}

/// AdamW's bias correction `1 − βᵗ` of step `t`, in f32 as Burn computes it.
pub(super) fn correction(beta: f32, t: usize) -> f32 {
    1f32 - beta.powi(t as i32)
}

/// Whether a step decided on the device was taken, read on the host (the CPU's reads wait
/// for nothing): its guard, `[taken, skipped]` (`super::guard`).
pub(super) struct Guarded {
    pub taken: bool,
    /// Steps skipped since the host last read them: the step's corrections are those of the
    /// count of steps less these.
    pub skipped: usize,
}

impl Guarded {
    /// The guard's values.
    pub fn read(guard: Tensor<1>) -> Self {
        let v: Vec<f32> = guard
            .into_data()
            .convert::<f32>()
            .try_to_vec()
            .unwrap_or_default();
        Self {
            taken: v.first().is_some_and(|t| *t != 0.0),
            skipped: v.get(1).map_or(0, |s| *s as usize),
        }
    }
}

/// One update: the new parameters and state from `params`, `grads` and the state (none before
/// the first step) at learning rate `lr`; `decay` holds the mask of decayed elements and
/// their factor `1 − lr·λ` (in f64, as kiln computes it). `guard`: a step decided on the
/// device, left undone (the state's count still counts it) when not taken.
pub(super) fn step(
    adam: Adam,
    lr: f64,
    decay: Option<(&[bool], f64)>,
    (params, grads): (Tensor<1>, Tensor<1>),
    state: Option<AdamWState<1>>,
    guard: Option<Guarded>,
) -> (Tensor<1>, AdamWState<1>) {
    let device = params.device();
    let len = params.dims()[0];
    let mut p = params.into_data();
    let g = grads.into_data();
    let (time, mut m, mut v) = match state {
        Some(s) => (
            s.momentum.time + 1,
            s.momentum.moment_1.into_data(),
            s.momentum.moment_2.into_data(),
        ),
        None => {
            let zeros = || TensorData::new(vec![0.0f32; len], [len]);
            (1, zeros(), zeros())
        }
    };
    let tensor = |data: TensorData| Tensor::<1>::from_data(data, &device);
    let skipped = match guard {
        Some(Guarded { taken: false, .. }) => {
            let state = AdaptiveMomentumState::new(time, tensor(m), tensor(v));
            return (tensor(p), AdamWState::new(state));
        }
        Some(Guarded { skipped, .. }) => skipped,
        None => 0,
    };
    update(
        adam,
        Slices {
            p: p.as_mut_slice::<f32>().expect("f32 parameters"),
            g: g.as_slice::<f32>().expect("f32 gradients"),
            m: m.as_mut_slice::<f32>().expect("f32 first moments"),
            v: v.as_mut_slice::<f32>().expect("f32 second moments"),
        },
        time - skipped,
        lr,
        decay,
    );
    let state = AdaptiveMomentumState::new(time, tensor(m), tensor(v));
    (tensor(p), AdamWState::new(state))
}

/// The shard's buffers, updated in place (`g` read only).
struct Slices<'a> {
    p: &'a mut [f32],
    g: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
}

/// The update of step `time` (1 for the first, whose moments start from the gradient alone).
fn update(adam: Adam, s: Slices, time: usize, lr: f64, decay: Option<(&[bool], f64)>) {
    let Adam {
        beta_1,
        beta_2,
        epsilon,
    } = adam;
    let n = s.p.len();
    assert!(
        s.g.len() == n && s.m.len() == n && s.v.len() == n,
        "a shard of {n} parameters with {} gradients and moments of {} and {}",
        s.g.len(),
        s.m.len(),
        s.v.len()
    );
    let (factor_1, factor_2) = (1.0 - beta_1, 1.0 - beta_2);
    let correction_1 = correction(beta_1, time);
    let correction_2 = correction(beta_2, time);
    let lr = lr as f32;
    let first = time == 1;
    let decay = decay.map(|(mask, factor)| {
        assert_eq!(mask.len(), n, "a decay mask of {} for {n}", mask.len());
        (mask, factor as f32)
    });
    for i in 0..n {
        let g = s.g[i];
        let (m, v) = if first {
            (g * factor_1, (g * g) * factor_2)
        } else {
            (
                s.m[i] * beta_1 + g * factor_1,
                s.v[i] * beta_2 + (g * g) * factor_2,
            )
        };
        s.m[i] = m;
        s.v[i] = v;
        let delta = (m / correction_1) / ((v / correction_2).sqrt() + epsilon);
        let p = match decay {
            Some((mask, factor)) if mask[i] => s.p[i] * factor,
            _ => s.p[i],
        };
        s.p[i] = p - delta * lr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::optim::{AdamWConfig, Optimizer};

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn bits(t: &Tensor<1>) -> Vec<u32> {
        let data = t.to_data();
        let v = data.as_slice::<f32>().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Burn's AdamW as `FlatOptimizer` runs it without the fused loop: the decay factor first.
    fn burn_step(
        adam: Adam,
        lr: f64,
        decay: Option<(&[bool], f64)>,
        params: Tensor<1>,
        grads: Tensor<1>,
        state: Option<AdamWState<1>>,
    ) -> (Tensor<1>, AdamWState<1>) {
        let optim = AdamWConfig::new()
            .with_beta_1(adam.beta_1)
            .with_beta_2(adam.beta_2)
            .with_epsilon(adam.epsilon)
            .with_weight_decay(0.0)
            .build();
        let device = params.device();
        let params = match decay {
            Some((mask, factor)) => {
                let n = mask.len();
                let mask =
                    Tensor::<1, Bool>::from_data(TensorData::new(mask.to_vec(), [n]), &device);
                params * Tensor::<1>::ones([n], &device).mask_fill(mask, factor)
            }
            None => params,
        };
        let (out, state) = optim.step(lr, params, grads, state);
        (out, state.expect("a state"))
    }

    #[test]
    fn the_fused_update_is_burns_adamw_to_the_bit() {
        let device = Device::flex();
        let n = 1037;
        let adam = Adam {
            beta_1: 0.9,
            beta_2: 0.99,
            epsilon: 1e-8,
        };
        let mask: Vec<bool> = (0..n).map(|i| i % 3 != 0).collect();
        let tensor = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [n]), &device);
        let (mut fused_p, mut burn_p) = (tensor(values(n, 1, 0.5)), tensor(values(n, 1, 0.5)));
        let (mut fused_s, mut burn_s) = (None, None);
        for step_no in 0..6u64 {
            // Gradients from tiny to large, some exactly zero; the decay off on one step.
            let mut g = values(n, 10 + step_no, 10f32.powi(step_no as i32 - 3));
            g[5] = 0.0;
            let lr = 1e-3 * (step_no + 1) as f64;
            let factor = 1.0 - lr * 0.1;
            let decay = (step_no != 2).then_some((mask.as_slice(), factor));
            let (p, s) = step(adam, lr, decay, (fused_p, tensor(g.clone())), fused_s, None);
            let (q, r) = burn_step(adam, lr, decay, burn_p, tensor(g), burn_s);
            assert_eq!(bits(&p), bits(&q), "parameters after step {}", step_no + 1);
            assert_eq!(s.momentum.time, r.momentum.time);
            assert_eq!(bits(&s.momentum.moment_1), bits(&r.momentum.moment_1));
            assert_eq!(bits(&s.momentum.moment_2), bits(&r.momentum.moment_2));
            (fused_p, burn_p, fused_s, burn_s) = (p, q, Some(s), Some(r));
        }
    }
}
