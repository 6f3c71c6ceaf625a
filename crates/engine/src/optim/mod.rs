//! The optimizer and the learning-rate schedule.
//!
//! Every strategy steps a [`FlatOptimizer`] over its shard of the flat parameter space.
//! [`build_optimizer`] builds Burn's own per-tensor optimizer with the same settings, which the
//! flat optimizer is tested against and the burn-train comparison bench uses.

pub mod flat;
mod fused;
mod guard;
mod share;

pub use flat::{FlatOptimizer, OptimState, Scalars};
pub use share::{
    Cut, Piece, Share, Source, optim_tensor, param_dtypes, part_name, path_of, rest_record,
    tensor_ids,
};

use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::prelude::*;

use crate::config::{LrScaling, OptimConfig, OptimizerKind, ScheduleConfig, ScheduleKind};

/// Builds Burn's per-tensor optimizer with the configured settings for `model`. Weight decay applies to parameters of rank 2 and more (matrices, convolution
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

/// Learning rate as a pure function of the step (and, for reduce-on-plateau, of the number
/// of reductions so far, which the loop state saves), so that a resumed run needs nothing
/// else to continue it.
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
        self.lr_after(step, 0)
    }

    /// The rate of optimizer step `step` (0-based) after a reduce-on-plateau schedule has
    /// reduced it `reductions` times (other kinds ignore them).
    pub fn lr_after(&self, step: usize, reductions: u32) -> f64 {
        let warmup = self.config.warmup_steps;
        if step < warmup {
            return self.peak * (step + 1) as f64 / warmup as f64;
        }
        let min = self.peak * self.config.min_lr_ratio;
        let span = self.total_steps.saturating_sub(warmup).max(1);
        let t = ((step - warmup) as f64 / span as f64).min(1.0);
        let decayed = |times: f64| (self.peak * self.config.gamma.powf(times)).max(min);
        match self.config.kind {
            ScheduleKind::Constant => self.peak,
            ScheduleKind::Linear => self.peak + (min - self.peak) * t,
            ScheduleKind::Cosine => {
                min + 0.5 * (self.peak - min) * (1.0 + (std::f64::consts::PI * t).cos())
            }
            ScheduleKind::Step => decayed(((step - warmup) / self.config.step_size) as f64),
            ScheduleKind::Plateau => decayed(f64::from(reductions)),
        }
    }

    /// The validation metric this schedule watches (reduce-on-plateau), if any.
    pub fn plateau(&self) -> Option<&crate::config::MetricWatch> {
        (self.config.kind == ScheduleKind::Plateau).then_some(&self.config.plateau)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_decay_and_plateau_reductions_stop_at_the_floor() {
        let step = ScheduleConfig {
            kind: ScheduleKind::Step,
            warmup_steps: 2,
            step_size: 10,
            gamma: 0.5,
            min_lr_ratio: 0.2,
            ..ScheduleConfig::default()
        };
        let s = Schedule::new(1.0, &step, 100);
        assert_eq!(s.lr(1), 1.0);
        assert_eq!(s.lr(11), 1.0);
        assert_eq!(s.lr(12), 0.5);
        assert_eq!(s.lr(22), 0.25);
        assert_eq!(s.lr(32), 0.2, "the floor");
        let plateau = ScheduleConfig {
            kind: ScheduleKind::Plateau,
            ..step
        };
        let p = Schedule::new(2.0, &plateau, 100);
        assert_eq!(p.lr_after(50, 0), 2.0);
        assert_eq!(p.lr_after(50, 1), 1.0);
        assert_eq!(p.lr_after(50, 9), 0.4);
        assert!(p.plateau().is_some() && s.plateau().is_none());
    }

    #[test]
    fn schedules_warm_up_and_decay_to_the_floor() {
        let cfg = ScheduleConfig {
            kind: ScheduleKind::Cosine,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            ..ScheduleConfig::default()
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
                ..ScheduleConfig::default()
            },
            100,
        );
        assert!((lin.lr(50) - 1.0).abs() < 1e-12);
        let c = Schedule::new(3.0, &ScheduleConfig::default(), 100);
        assert_eq!(c.lr(99), 3.0);
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
