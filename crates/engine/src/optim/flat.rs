//! The optimizer every strategy steps: Burn's per-tensor AdamW or SGD applied to one flat shard.
//!
//! A rank's optimizer sees one 1-D tensor of parameters (its shard of the
//! [`FlatLayout`], the whole space for `single` and `ddp`) and the
//! matching 1-D gradient, and keeps the state of that shard only. The update is Burn's own
//! [`AdamW`] / [`Sgd`] math ([`burn::optim::Optimizer::step`]), which is element-wise, so
//! stepping a flat shard gives every element the value stepping its tensor would. Weight decay
//! applies to matrices only: the optimizers are built without it and the decay is applied
//! with a per-element mask in exactly the arithmetic Burn uses (AdamW multiplies the parameter
//! by `1 − lr·λ` before the update; SGD adds `λ·w` to the gradient).
//!
//! The state leaves its shard in a canonical layout ([`OptimState`]: every parameter's state
//! under its module path, in its own shape), which is what checkpoints hold, so that any
//! strategy and world size can resume it.

use std::collections::BTreeMap;

use burn::optim::momentum::{MomentumConfig, MomentumState};
use burn::optim::{
    AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, Optimizer, RecordState, Sgd, SgdConfig,
    SgdState, StateSink,
};
use burn::prelude::*;
use burn::store::burn_pack::Scalar;
use burn::tensor::FloatDType;

use super::fused;
use super::guard::{self, Pending};
use crate::config::{OptimConfig, OptimizerKind, name_of};
use crate::error::{Error, Result};
use crate::params::{FlatLayout, dtype_bytes};

enum Rule {
    Adamw {
        optim: AdamW,
        state: Option<Box<AdamWState<1>>>,
    },
    Sgd {
        optim: Sgd,
        state: Option<Box<SgdState<1>>>,
    },
}

/// A shard's state tensors: `(leaf name, values)`.
pub type StateTensors = Vec<(String, Vec<f32>)>;
/// Scalars of an optimizer state, by name.
pub type Scalars = BTreeMap<String, Scalar>;

/// One rank's optimizer over its flat shard; see the module documentation.
pub struct FlatOptimizer {
    kind: OptimizerKind,
    rule: Rule,
    weight_decay: f64,
    /// Shard elements that decay; `None` when nothing does.
    decay: Option<Tensor<1, Bool>>,
    /// The same on the host, for the fused AdamW loop.
    decay_flags: Option<Vec<bool>>,
    /// AdamW's constants, for the fused loop and the GPU kernel.
    adam: fused::Adam,
    len: usize,
    dtype: FloatDType,
    device: Device,
    /// Steps decided on the device that the host has not read yet ([`Self::step_guarded`]).
    pending: Pending,
}

/// One AdamW update on a CubeCL device as one kernel ([`kiln_models::cube::adamw`]): the new
/// parameters and state from `params`, `grads` and the state (none before the first step) at
/// learning rate `lr`; `decay` marks the decayed elements, which are multiplied by
/// `1 − decay_rate` first, in Burn's arithmetic as the CPU's fused loop has it. `guard`: the
/// step decided on the device, with `back` steps pending (`super::guard`).
fn cube_step(
    adam: fused::Adam,
    lr: f64,
    decay_rate: f64,
    (params, grads): (Tensor<1>, Tensor<1>),
    decay: Option<Tensor<1, Bool>>,
    state: Option<AdamWState<1>>,
    guard: Option<(Tensor<1>, usize)>,
) -> (Tensor<1>, AdamWState<1>) {
    let (time, m, v) = match state {
        Some(s) => (
            s.momentum.time + 1,
            s.momentum.moment_1,
            s.momentum.moment_2,
        ),
        None => (1, params.zeros_like(), params.zeros_like()),
    };
    let step = kiln_models::cube::AdamStep {
        beta_1: adam.beta_1,
        beta_2: adam.beta_2,
        epsilon: adam.epsilon,
        lr: lr as f32,
        correction_1: fused::correction(adam.beta_1, time),
        correction_2: fused::correction(adam.beta_2, time),
        decay_factor: (1.0 - decay_rate) as f32,
        decays: decay.is_some(),
        guarded: guard.is_some(),
    };
    let device = params.device();
    let guard = guard.map(|(g, back)| (g, guard::corrections(adam, time, back, &device)));
    let (out, m, v) = kiln_models::cube::adamw(params, grads, (m, v), decay, guard, step);
    (out, AdamWState::new(AdaptiveMomentumState::new(time, m, v)))
}

impl FlatOptimizer {
    /// An optimizer for a shard of `decay.len()` elements in `dtype` on `device` (without
    /// autodiff); `decay[i]` says whether element `i` is weight-decayed.
    pub fn new(config: &OptimConfig, decay: &[bool], dtype: FloatDType, device: &Device) -> Self {
        let device = device.clone().without_autodiff();
        let rule = match config.name {
            OptimizerKind::Adamw => Rule::Adamw {
                optim: AdamWConfig::new()
                    .with_beta_1(config.beta1 as f32)
                    .with_beta_2(config.beta2 as f32)
                    .with_epsilon(config.eps as f32)
                    .with_weight_decay(0.0)
                    .build(),
                state: None,
            },
            OptimizerKind::Sgd => Rule::Sgd {
                optim: SgdConfig::new()
                    .with_momentum((config.momentum > 0.0).then_some(MomentumConfig {
                        momentum: config.momentum,
                        dampening: 0.0,
                        nesterov: config.nesterov,
                    }))
                    .build(),
                state: None,
            },
        };
        let len = decay.len();
        let any = decay.iter().any(|d| *d);
        let decay_flags = (config.weight_decay > 0.0 && any).then(|| decay.to_vec());
        let decay = decay_flags
            .clone()
            .map(|flags| Tensor::<1, Bool>::from_data(TensorData::new(flags, [len]), &device));
        Self {
            kind: config.name,
            rule,
            weight_decay: config.weight_decay,
            decay,
            decay_flags,
            adam: fused::Adam {
                beta_1: config.beta1 as f32,
                beta_2: config.beta2 as f32,
                epsilon: config.eps as f32,
            },
            len,
            dtype,
            device,
            pending: Pending::default(),
        }
    }

    /// Elements of the shard.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One update of `params` with `grads` (both the shard's, in the optimizer's dtype) at
    /// learning rate `lr`; returns the new parameters.
    pub fn step(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> Tensor<1> {
        self.update(lr, params, grads, None)
    }

    /// Whether [`Self::step_guarded`] can step this shard: AdamW in f32 through the CPU's
    /// fused loop or the GPU kernel.
    pub fn guardable(&self) -> bool {
        matches!(self.rule, Rule::Adamw { .. })
            && self.dtype == FloatDType::F32
            && (fused::here(self.dtype, &self.device)
                || kiln_models::cube::adamw_here(self.dtype.into(), &self.device))
    }

    /// [`Self::step`] where whether the step is taken is decided on the device: `taken` (`[1]`,
    /// 1 or 0) leaves every element as it was when 0, without the host reading it. The host
    /// learns which steps were skipped from [`Self::settle`]. Only where
    /// [`Self::guardable`].
    pub fn step_guarded(
        &mut self,
        lr: f64,
        params: Tensor<1>,
        grads: Tensor<1>,
        taken: Tensor<1>,
    ) -> Tensor<1> {
        assert!(
            self.guardable(),
            "a guarded step of an optimizer without one"
        );
        let guard = self.pending.add(taken.cast(FloatDType::F32));
        let back = self.pending.len();
        self.update(lr, params, grads, Some((guard, back)))
    }

    /// The guarded steps since the last call that the device skipped, by position (0: the
    /// first since then): read once, and forgotten from AdamW's count of steps taken.
    pub fn settle(&mut self) -> Vec<usize> {
        let skipped = self.pending.settle();
        if let Rule::Adamw { state, .. } = &mut self.rule
            && let Some(s) = state
        {
            s.momentum.time -= skipped.len();
            // Every step so far refused: no state, as a refusal on the host leaves it.
            if s.momentum.time == 0 {
                *state = None;
            }
        }
        skipped
    }

    /// [`Self::step`], guarded when `guard` is given (with the steps pending).
    fn update(
        &mut self,
        lr: f64,
        params: Tensor<1>,
        grads: Tensor<1>,
        guard: Option<(Tensor<1>, usize)>,
    ) -> Tensor<1> {
        let params = params.cast(self.dtype);
        let grads = grads.cast(self.dtype);
        match &mut self.rule {
            Rule::Adamw { optim, state } => {
                let decay_rate = lr * self.weight_decay;
                if fused::here(self.dtype, &self.device) {
                    let decay = (self.decay_flags.as_deref())
                        .filter(|_| decay_rate != 0.0)
                        .map(|flags| (flags, 1.0 - decay_rate));
                    let before = state.take().map(|s| *s);
                    let guard = guard.map(|(g, _)| fused::Guarded::read(g));
                    let (out, next) =
                        fused::step(self.adam, lr, decay, (params, grads), before, guard);
                    *state = Some(Box::new(next));
                    return out;
                }
                if kiln_models::cube::adamw_here(params.dtype(), &self.device) {
                    let decay = self.decay.clone().filter(|_| decay_rate != 0.0);
                    let before = state.take().map(|s| *s);
                    let (out, next) = cube_step(
                        self.adam,
                        lr,
                        decay_rate,
                        (params, grads),
                        decay,
                        before,
                        guard,
                    );
                    *state = Some(Box::new(next));
                    return out;
                }
                let params = match &self.decay {
                    Some(mask) if decay_rate != 0.0 => {
                        let factor = Tensor::<1>::ones([self.len], &self.device)
                            .cast(self.dtype)
                            .mask_fill(mask.clone(), 1.0 - decay_rate);
                        params * factor
                    }
                    _ => params,
                };
                let (out, next) = optim.step(lr, params, grads, state.take().map(|s| *s));
                *state = next.map(Box::new);
                out
            }
            Rule::Sgd { optim, state } => {
                let grads = match &self.decay {
                    Some(mask) => {
                        let penalty = Tensor::<1>::zeros([self.len], &self.device)
                            .cast(self.dtype)
                            .mask_fill(mask.clone(), self.weight_decay as f32);
                        (params.clone() * penalty).add(grads)
                    }
                    None => grads,
                };
                let (out, next) = optim.step(lr, params, grads, state.take().map(|s| *s));
                *state = next.map(Box::new);
                out
            }
        }
    }

    /// Bytes the state holds now (nothing before the first step).
    pub fn state_bytes(&self) -> usize {
        let tensors = match &self.rule {
            Rule::Adamw { state, .. } => state
                .as_ref()
                .map_or(0, |s| 2 + usize::from(s.momentum.max_moment_2.is_some())),
            Rule::Sgd { state, .. } => state
                .as_ref()
                .map_or(0, |s| usize::from(s.momentum.is_some())),
        };
        tensors * self.len * dtype_bytes(self.dtype)
    }

    /// The shard's state: its tensors (shard-length vectors, by leaf name) and its scalars.
    pub fn export(&self) -> (StateTensors, Scalars) {
        let mut sink = StateSink::default();
        match &self.rule {
            Rule::Adamw { state: Some(s), .. } => s.state_flatten("", &mut sink),
            Rule::Sgd { state: Some(s), .. } => s.state_flatten("", &mut sink),
            _ => {}
        }
        let tensors = sink
            .tensors
            .into_iter()
            .map(|(name, data)| (name, data.convert::<f32>().iter::<f32>().collect()))
            .collect();
        (tensors, sink.scalars.into_iter().collect())
    }

    /// A part of the shard's state, read to the host: AdamW's moments each taken through
    /// `part` on the device first (so that only the part is copied), SGD's velocity read whole
    /// and cut by `host_part`. Named and valued as [`Self::export`] names them.
    pub fn export_part(
        &self,
        part: &dyn Fn(Tensor<1>) -> Tensor<1>,
        host_part: &dyn Fn(Vec<f32>) -> Vec<f32>,
    ) -> (StateTensors, Scalars) {
        match &self.rule {
            Rule::Adamw { state: Some(s), .. } if s.momentum.max_moment_2.is_none() => {
                let m = &s.momentum;
                let read = |t: &Tensor<1>| crate::params::host_f32(part(t.clone()));
                let tensors = vec![
                    ("momentum.moment_1".to_string(), read(&m.moment_1)),
                    ("momentum.moment_2".to_string(), read(&m.moment_2)),
                ];
                let scalars = [("momentum.time".to_string(), Scalar::from(m.time))].into();
                (tensors, scalars)
            }
            _ => {
                let (tensors, scalars) = self.export();
                let tensors = tensors
                    .into_iter()
                    .map(|(name, v)| (name, host_part(v)))
                    .collect();
                (tensors, scalars)
            }
        }
    }

    /// Replaces the state with `tensors` (shard-length vectors by leaf name, as
    /// [`Self::export`] names them) and `scalars`; no tensors means no state yet. The state is
    /// rebuilt in the optimizer's dtype (bf16 under `bf16-true`).
    pub fn import(&mut self, tensors: StateTensors, scalars: Scalars) -> Result<()> {
        let mut by_name: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        for (name, values) in tensors {
            if values.len() != self.len {
                return Err(Error::checkpoint(format!(
                    "optimizer state {name:?} holds {} values for a shard of {}",
                    values.len(),
                    self.len
                )));
            }
            by_name.insert(name, values);
        }
        self.pending = Pending::default();
        if by_name.is_empty() {
            match &mut self.rule {
                Rule::Adamw { state, .. } => *state = None,
                Rule::Sgd { state, .. } => *state = None,
            }
            return Ok(());
        }
        let kind = name_of(&self.kind);
        let (len, dtype, device) = (self.len, self.dtype, self.device.clone());
        let mut take = |leaf: &str| {
            by_name
                .remove(leaf)
                .map(|v| Tensor::<1>::from_data(TensorData::new(v, [len]), &device).cast(dtype))
                .ok_or_else(|| {
                    Error::checkpoint(format!("the {kind} optimizer state lacks {leaf:?}"))
                })
        };
        match &mut self.rule {
            Rule::Adamw { state, .. } => {
                let m1 = take("momentum.moment_1")?;
                let m2 = take("momentum.moment_2")?;
                let time = scalars
                    .get("momentum.time")
                    .and_then(|s| u64::try_from(*s).ok())
                    .ok_or_else(|| {
                        Error::checkpoint(format!(
                            "the {kind} optimizer state lacks its step count \"momentum.time\""
                        ))
                    })?;
                *state = Some(Box::new(AdamWState::new(AdaptiveMomentumState::new(
                    time as usize,
                    m1,
                    m2,
                ))));
            }
            Rule::Sgd { state, .. } => {
                let velocity = take("momentum.velocity")?;
                *state = Some(Box::new(SgdState::new(Some(MomentumState::new(velocity)))));
            }
        }
        if let Some(extra) = by_name.keys().next() {
            return Err(Error::checkpoint(format!(
                "the {kind} optimizer state holds {extra:?}, which {kind} does not keep"
            )));
        }
        Ok(())
    }

    /// The optimizer's kind.
    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }
}

/// An optimizer state in the canonical layout: every parameter's state under its module path.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimState {
    /// The optimizer that keeps it.
    pub kind: OptimizerKind,
    /// `(parameter path, leaf name, shape, values)`: one tensor per parameter and state leaf
    /// (`momentum.moment_1`, …), in the parameter's shape.
    pub tensors: Vec<(String, String, Vec<usize>, Vec<f32>)>,
    /// Scalars shared by every parameter (AdamW's step count).
    pub scalars: BTreeMap<String, Scalar>,
}

impl OptimState {
    /// The canonical state of `layout`'s parameters from canonical leaf vectors (each the
    /// whole space, unpadded, in layout order).
    pub fn from_leaves(
        kind: OptimizerKind,
        layout: &FlatLayout,
        leaves: Vec<(String, Vec<f32>)>,
        scalars: BTreeMap<String, Scalar>,
    ) -> Self {
        let mut tensors = Vec::new();
        for (leaf, values) in &leaves {
            let mut base = 0;
            for unit in &layout.units {
                for e in &layout.entries[unit.entries.clone()] {
                    let start = base + e.offset;
                    tensors.push((
                        e.path.clone(),
                        leaf.clone(),
                        e.shape.clone(),
                        values[start..start + e.numel].to_vec(),
                    ));
                }
                base += unit.len;
            }
        }
        Self {
            kind,
            tensors,
            scalars,
        }
    }

    /// The canonical leaf vectors of `layout`'s parameters; an error names the first parameter
    /// that is missing, has another shape, or that the model does not have.
    pub fn leaves(&self, layout: &FlatLayout) -> Result<Vec<(String, Vec<f32>)>> {
        let mut by_leaf: BTreeMap<&str, ByParam> = BTreeMap::new();
        for (path, leaf, shape, values) in &self.tensors {
            by_leaf
                .entry(leaf.as_str())
                .or_default()
                .insert(path.as_str(), (shape, values));
        }
        let mut out = Vec::new();
        for (leaf, params) in by_leaf {
            let mut values = Vec::with_capacity(layout.total());
            for unit in &layout.units {
                for e in &layout.entries[unit.entries.clone()] {
                    let Some((shape, v)) = params.get(e.path.as_str()) else {
                        return Err(Error::checkpoint(format!(
                            "the optimizer state has no {leaf:?} for parameter `{}`: it was \
                             saved for another model",
                            e.path
                        )));
                    };
                    if **shape != e.shape || v.len() != e.numel {
                        return Err(Error::checkpoint(format!(
                            "the optimizer state of parameter `{}` has shape {shape:?}, the \
                             model's parameter {:?}",
                            e.path, e.shape
                        )));
                    }
                    values.extend_from_slice(v);
                }
            }
            if let Some(extra) = params
                .keys()
                .find(|p| !layout.entries.iter().any(|e| e.path == **p))
            {
                return Err(Error::checkpoint(format!(
                    "the optimizer state holds parameter `{extra}`, which the model does not \
                     have: it was saved for another model"
                )));
            }
            out.push((leaf.to_string(), values));
        }
        Ok(out)
    }
}

/// One state leaf's tensors by parameter path: `(shape, values)`.
type ByParam<'a> = BTreeMap<&'a str, (&'a Vec<usize>, &'a Vec<f32>)>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{FlatLayout, parameter_values, trainable_ids};
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    fn step_both(config: &OptimConfig, steps: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let device = Device::flex().autodiff();
        let net = kiln_models::with_rng(|| {
            device.seed(9);
            kiln_models::materialized(Net {
                a: LinearConfig::new(3, 4).init(&device),
                b: LinearConfig::new(4, 2).init(&device),
            })
        });
        let x = Tensor::<2>::from_data(
            TensorData::new((0..15).map(|i| i as f32 / 7.0).collect(), [5, 3]),
            &device,
        );
        let loss = |n: &Net| {
            n.b.forward(n.a.forward(x.clone()).tanh())
                .powf_scalar(2.0)
                .mean()
        };
        // Burn's own per-tensor optimizer, weight decay on matrices only.
        let mut reference = crate::optim::build_optimizer(config, &net);
        let mut burn_net = net.clone();
        // kiln's flat optimizer over the same parameters, in two shards stepped apart.
        let layout = FlatLayout::new(&net, &[trainable_ids(&net.b)], 2);
        let mut shards: Vec<FlatOptimizer> = (0..2)
            .map(|r| {
                FlatOptimizer::new(
                    config,
                    &layout.shard_decay_mask(r),
                    FloatDType::F32,
                    &device,
                )
            })
            .collect();
        let mut flat_net = net;
        let lr = 0.05;
        for _ in 0..steps {
            let grads = GradientsParams::from_grads(loss(&burn_net).backward(), &burn_net);
            burn_net = reference.step(lr, burn_net, grads);

            let mut grads = GradientsParams::from_grads(loss(&flat_net).backward(), &flat_net);
            let units: Vec<(Tensor<1>, Tensor<1>)> = (0..layout.units.len())
                .map(|u| {
                    (
                        layout.unit_values(&flat_net, u, FloatDType::F32, &device),
                        layout.unit_grads(&flat_net, &mut grads, u, FloatDType::F32, &device),
                    )
                })
                .collect();
            let mut new_units: Vec<Vec<Tensor<1>>> = vec![Vec::new(); units.len()];
            for (r, optim) in shards.iter_mut().enumerate() {
                let piece = |t: &Tensor<1>, u: usize| t.clone().slice(layout.piece_range(u, r));
                let params =
                    Tensor::cat((0..units.len()).map(|u| piece(&units[u].0, u)).collect(), 0);
                let g = Tensor::cat((0..units.len()).map(|u| piece(&units[u].1, u)).collect(), 0);
                let out = optim.step(lr, params, g);
                for (u, unit) in layout.units.iter().enumerate() {
                    new_units[u].push(
                        out.clone()
                            .slice(unit.shard_offset..unit.shard_offset + unit.piece),
                    );
                }
            }
            for (u, pieces) in new_units.into_iter().enumerate() {
                flat_net = layout.load_unit(
                    flat_net,
                    u,
                    Tensor::cat(pieces, 0),
                    FloatDType::F32,
                    &device,
                );
            }
        }
        (parameter_values(&burn_net), parameter_values(&flat_net))
    }

    #[test]
    fn flat_shards_step_exactly_like_burns_per_tensor_optimizer() {
        for config in [
            OptimConfig {
                weight_decay: 0.1,
                ..OptimConfig::default()
            },
            OptimConfig {
                name: OptimizerKind::Sgd,
                weight_decay: 0.01,
                momentum: 0.9,
                ..OptimConfig::default()
            },
            OptimConfig {
                name: OptimizerKind::Sgd,
                momentum: 0.0,
                nesterov: false,
                ..OptimConfig::default()
            },
        ] {
            let (burn, flat) = step_both(&config, 4);
            assert_eq!(burn, flat, "{:?}", config.name);
        }
    }

    #[test]
    fn state_round_trips_through_the_canonical_layout_at_any_shard_count() {
        let device = Device::flex().autodiff();
        let net = Net {
            a: LinearConfig::new(3, 4).init(&device),
            b: LinearConfig::new(4, 2).init(&device),
        };
        let layout = FlatLayout::new(&net, &[trainable_ids(&net.b)], 1);
        let config = OptimConfig::default();
        let mut one = FlatOptimizer::new(
            &config,
            &layout.shard_decay_mask(0),
            FloatDType::F32,
            &device,
        );
        let n = layout.shard_len;
        let params = Tensor::<1>::zeros([n], &device.clone().without_autodiff());
        let grads = Tensor::<1>::from_data(
            TensorData::new((0..n).map(|i| i as f32 - 10.0).collect(), [n]),
            &device.clone().without_autodiff(),
        );
        let _ = one.step(0.1, params, grads);
        assert_eq!(one.state_bytes(), 2 * n * 4);
        let (tensors, scalars) = one.export();
        let state = OptimState::from_leaves(config.name, &layout, tensors.clone(), scalars.clone());
        assert_eq!(state.leaves(&layout).unwrap(), tensors);
        // Re-cut for three shards: each imports its part.
        let three = layout.with_shards(3);
        for r in 0..3 {
            let mut o = FlatOptimizer::new(
                &config,
                &three.shard_decay_mask(r),
                FloatDType::F32,
                &device,
            );
            let parts = tensors
                .iter()
                .map(|(name, v)| (name.clone(), three.cut(v, r)))
                .collect();
            o.import(parts, scalars.clone()).unwrap();
            assert_eq!(o.state_bytes(), 2 * three.shard_len * 4);
        }
        // Another model's state is refused with the parameter named.
        let mut wrong = state.clone();
        wrong.tensors[0].0 = "c.weight".into();
        let e = wrong.leaves(&layout).unwrap_err().to_string();
        assert!(e.contains("a.weight") || e.contains("c.weight"), "{e}");
    }

    #[test]
    fn a_low_precision_state_resumes_in_its_dtype_to_the_bit() {
        let device = Device::flex();
        let n = 7;
        let values = |k: f32| {
            Tensor::<1>::from_data(
                TensorData::new((0..n).map(|i| (i as f32 - 3.0) * k).collect(), [n]),
                &device,
            )
            .cast(FloatDType::BF16)
        };
        for config in [
            OptimConfig::default(),
            OptimConfig {
                name: OptimizerKind::Sgd,
                ..OptimConfig::default()
            },
        ] {
            let mask = vec![true; n];
            let mut a = FlatOptimizer::new(&config, &mask, FloatDType::BF16, &device);
            let p = a.step(0.1, values(0.5), values(0.25));
            let (tensors, scalars) = a.export();
            let mut b = FlatOptimizer::new(&config, &mask, FloatDType::BF16, &device);
            b.import(tensors, scalars).unwrap();
            let next_a = a.step(0.1, p.clone(), values(-0.125));
            let next_b = b.step(0.1, p, values(-0.125));
            assert_eq!(next_b.dtype(), burn::tensor::DType::BF16);
            assert_eq!(
                crate::params::host_f32(next_a),
                crate::params::host_f32(next_b),
                "{:?}",
                config.name
            );
        }
    }
}
