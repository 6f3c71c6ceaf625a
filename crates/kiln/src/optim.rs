//! Optimizer construction, the learning-rate schedule and gradient utilities (flat layout for
//! collectives, global-norm clipping).

use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;

use crate::config::{LrScaling, OptimConfig, OptimizerKind, ScheduleConfig, ScheduleKind};

/// Builds the configured optimizer for `model` (one per replica; every replica steps
/// identically). Weight decay applies to parameters of rank 2 and more (matrices, convolution
/// kernels, embeddings); biases and normalisation gains are not decayed.
pub fn build_optimizer<M: Module>(config: &OptimConfig, model: &M) -> ModuleOptimizer {
    let decayed = make_optimizer(config, config.weight_decay);
    if config.weight_decay == 0.0 {
        return decayed;
    }
    let vectors = vector_params(model);
    if vectors.is_empty() {
        return decayed;
    }
    let group = ParamGroup::from_ids(vectors);
    match config.name {
        OptimizerKind::Adamw => decayed.with_group(group, adamw(config, 0.0).build(), None),
        OptimizerKind::Sgd => decayed.with_group(group, sgd(config, 0.0).build(), None),
    }
}

fn make_optimizer(config: &OptimConfig, weight_decay: f64) -> ModuleOptimizer {
    match config.name {
        OptimizerKind::Adamw => adamw(config, weight_decay).init(),
        OptimizerKind::Sgd => sgd(config, weight_decay).init(),
    }
}

fn adamw(config: &OptimConfig, weight_decay: f64) -> AdamWConfig {
    AdamWConfig::new()
        .with_beta_1(config.beta1 as f32)
        .with_beta_2(config.beta2 as f32)
        .with_epsilon(config.eps as f32)
        .with_weight_decay(weight_decay as f32)
}

fn sgd(config: &OptimConfig, weight_decay: f64) -> SgdConfig {
    let momentum = (config.momentum > 0.0).then_some(MomentumConfig {
        momentum: config.momentum,
        dampening: 0.0,
        nesterov: config.nesterov,
    });
    let decay = (weight_decay > 0.0).then_some(WeightDecayConfig {
        penalty: weight_decay as f32,
    });
    SgdConfig::new()
        .with_momentum(momentum)
        .with_weight_decay(decay)
}

/// Ids of the trainable parameters of rank below 2.
fn vector_params<M: Module>(model: &M) -> Vec<ParamId> {
    struct Collect(Vec<ParamId>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if D < 2 && param.is_require_grad() {
                self.0.push(param.id);
            }
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

/// The peak learning rate after scaling by the samples per optimizer step.
pub fn scaled_lr(config: &OptimConfig, world: usize, accumulate: usize) -> f64 {
    let factor = (world * accumulate) as f64;
    match config.scale_lr {
        LrScaling::None => config.lr,
        LrScaling::Linear => config.lr * factor,
        LrScaling::Sqrt => config.lr * factor.sqrt(),
    }
}

/// Learning rate as a pure function of the step, so that it needs no saved state beyond the
/// step counter.
#[derive(Debug, Clone)]
pub struct Schedule {
    peak: f64,
    config: ScheduleConfig,
    total_steps: usize,
}

impl Schedule {
    /// A schedule peaking at `peak` over `total_steps` optimizer steps.
    pub fn new(peak: f64, config: &ScheduleConfig, total_steps: usize) -> Self {
        Self {
            peak,
            config: config.clone(),
            total_steps,
        }
    }

    /// The rate of optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        let warmup = self.config.warmup_steps;
        if step < warmup {
            return self.peak * (step + 1) as f64 / warmup as f64;
        }
        let min = self.peak * self.config.min_lr_ratio;
        let span = self.total_steps.saturating_sub(warmup).max(1);
        let t = ((step - warmup) as f64 / span as f64).min(1.0);
        match self.config.kind {
            ScheduleKind::Constant => self.peak,
            ScheduleKind::Linear => self.peak + (min - self.peak) * t,
            ScheduleKind::Cosine => {
                min + 0.5 * (self.peak - min) * (1.0 + (std::f64::consts::PI * t).cos())
            }
        }
    }
}

/// The order, shapes and sizes of a module's float parameters: how gradients are laid out
/// in one flat buffer for a collective.
#[derive(Debug, Clone, Default)]
pub struct ParamLayout {
    /// `(id, element count)` of every parameter, in module order.
    pub entries: Vec<(ParamId, usize)>,
    /// Total element count.
    pub total: usize,
}

impl ParamLayout {
    /// The layout of `module`'s trainable parameters.
    pub fn of<M: Module>(module: &M) -> Self {
        struct Collect(ParamLayout);
        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if !param.is_require_grad() {
                    return;
                }
                let n = param.shape().num_elements();
                self.0.entries.push((param.id, n));
                self.0.total += n;
            }
        }
        let mut c = Collect(ParamLayout::default());
        module.visit(&mut c);
        c.0
    }
}

/// The gradients of `module`'s trainable parameters as flat tensors, one per parameter in
/// [`ParamLayout`] order (zeros where a parameter got no gradient).
pub fn grads_to_parts<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    device: &Device,
) -> Vec<Tensor<1>> {
    struct Flatten<'a> {
        grads: &'a mut GradientsParams,
        parts: Vec<Tensor<1>>,
        device: &'a Device,
    }
    impl ModuleVisitor for Flatten<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                return;
            }
            let n = param.shape().num_elements();
            let part = match self.grads.remove::<D>(param.id) {
                Some(g) => g.reshape([n]),
                None => Tensor::zeros([n], self.device),
            };
            self.parts.push(part);
        }
    }
    let mut f = Flatten {
        grads,
        parts: Vec::new(),
        device,
    };
    module.visit(&mut f);
    f.parts
}

/// Per-parameter gradients from flat parts in [`ParamLayout`] order (the inverse of
/// [`grads_to_parts`]).
pub fn parts_to_grads<M: Module>(module: &M, parts: Vec<Tensor<1>>) -> GradientsParams {
    struct Unflatten {
        parts: std::vec::IntoIter<Tensor<1>>,
        grads: GradientsParams,
    }
    impl ModuleVisitor for Unflatten {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                return;
            }
            let part = self.parts.next().expect("one part per trainable parameter");
            self.grads
                .register::<D>(param.id, part.reshape(param.shape()));
        }
    }
    let mut u = Unflatten {
        parts: parts.into_iter(),
        grads: GradientsParams::new(),
    };
    module.visit(&mut u);
    u.grads
}

/// Groups consecutive parameters of `layout` into buckets of at most `bucket_elements`
/// elements (a larger parameter gets a bucket of its own); returns index ranges into the
/// layout's entries.
pub fn buckets(layout: &ParamLayout, bucket_elements: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut size = 0;
    for (i, (_, n)) in layout.entries.iter().enumerate() {
        if i > start && size + n > bucket_elements {
            out.push(start..i);
            start = i;
            size = 0;
        }
        size += n;
    }
    if start < layout.entries.len() {
        out.push(start..layout.entries.len());
    }
    out
}

/// Scales all gradients so that their global L2 norm is at most `max_norm`. Stays on the
/// device: the scale factor is a tensor, never read back.
pub fn clip_global_norm<M: Module>(
    module: &M,
    grads: GradientsParams,
    max_norm: f64,
) -> GradientsParams {
    struct SumSquares<'a> {
        grads: &'a GradientsParams,
        total: Option<Tensor<1>>,
    }
    impl ModuleVisitor for SumSquares<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let s = g.square().sum();
                self.total = Some(match self.total.take() {
                    Some(t) => t + s,
                    None => s,
                });
            }
        }
    }
    struct Scale {
        grads: GradientsParams,
        factor: Tensor<1>,
    }
    impl ModuleVisitor for Scale {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                let f = self.factor.clone().reshape([1usize; D]);
                self.grads.register::<D>(param.id, g * f);
            }
        }
    }
    let mut s = SumSquares {
        grads: &grads,
        total: None,
    };
    module.visit(&mut s);
    let Some(total) = s.total else {
        return grads;
    };
    let factor = (total.sqrt().add_scalar(1e-6).recip() * max_norm).clamp_max(1.0);
    let mut scale = Scale { grads, factor };
    module.visit(&mut scale);
    scale.grads
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_warm_up_and_decay_to_the_floor() {
        let cfg = ScheduleConfig {
            kind: ScheduleKind::Cosine,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
        };
        let s = Schedule::new(1.0, &cfg, 110);
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-9);
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
        let lin = Schedule::new(
            2.0,
            &ScheduleConfig {
                kind: ScheduleKind::Linear,
                warmup_steps: 0,
                min_lr_ratio: 0.0,
            },
            100,
        );
        assert!((lin.lr(50) - 1.0).abs() < 1e-12);
        let c = Schedule::new(3.0, &ScheduleConfig::default(), 100);
        assert_eq!(c.lr(99), 3.0);
    }

    #[test]
    fn buckets_cover_every_parameter_in_order() {
        let layout = ParamLayout {
            entries: [5, 3, 10, 1, 1]
                .iter()
                .map(|&n| (ParamId::new(), n))
                .collect(),
            total: 20,
        };
        assert_eq!(buckets(&layout, 8), vec![0..2, 2..3, 3..5]);
        assert_eq!(buckets(&layout, 100), vec![0..5]);
        assert_eq!(buckets(&layout, 1), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
        assert!(buckets(&ParamLayout::default(), 8).is_empty());
    }

    #[test]
    fn clipping_scales_to_the_global_norm_and_leaves_small_gradients_alone() {
        use burn::nn::{Linear, LinearConfig};
        let device = Device::flex().autodiff();
        let layer: Linear = LinearConfig::new(2, 2).init(&device);
        let grads_with = |value: f32| {
            let mut g = GradientsParams::new();
            g.register::<2>(layer.weight.id, Tensor::full([2, 2], value, &device));
            let bias = layer.bias.as_ref().unwrap();
            g.register::<1>(bias.id, Tensor::full([2], value, &device));
            g
        };
        let norm = |g: &GradientsParams| -> f32 {
            let w: f32 = g
                .get::<2>(layer.weight.id)
                .unwrap()
                .square()
                .sum()
                .into_scalar();
            let b: f32 = g
                .get::<1>(layer.bias.as_ref().unwrap().id)
                .unwrap()
                .square()
                .sum()
                .into_scalar();
            (w + b).sqrt()
        };
        // Six elements of 2.0: global norm sqrt(24) ≈ 4.9, clipped to 1.
        let clipped = clip_global_norm(&layer, grads_with(2.0), 1.0);
        assert!((norm(&clipped) - 1.0).abs() < 1e-4, "{}", norm(&clipped));
        // Six elements of 0.1: norm ≈ 0.245, below the limit, unchanged.
        let kept = clip_global_norm(&layer, grads_with(0.1), 1.0);
        assert!((norm(&kept) - 0.24495).abs() < 1e-4, "{}", norm(&kept));
    }

    #[test]
    fn lr_scaling() {
        let mut c = OptimConfig {
            lr: 0.1,
            ..OptimConfig::default()
        };
        assert_eq!(scaled_lr(&c, 4, 2), 0.1);
        c.scale_lr = LrScaling::Linear;
        assert!((scaled_lr(&c, 4, 2) - 0.8).abs() < 1e-12);
        c.scale_lr = LrScaling::Sqrt;
        assert!((scaled_lr(&c, 4, 1) - 0.2).abs() < 1e-12);
    }
}
