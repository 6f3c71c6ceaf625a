//! Strategies: what one optimizer step does across ranks.
//!
//! The training loop talks to a [`Strategy`] only: it hands it each micro-batch, asks it for
//! an optimizer step, and for the whole model when it evaluates or checkpoints. Each strategy
//! owns its rank's share of the model (replica or shard), where gradients go, where optimizer
//! state lives, and how its state leaves and re-enters a checkpoint:
//!
//! | strategy | parameters per rank | gradients per rank | optimizer state per rank |
//! |---|---|---|---|
//! | [`single`] | all | all | all |
//! | [`ddp`] | all | all, all-reduced on the last micro-step | all |
//! | [`zero1`] | all | all, all-reduced on the last micro-step | its shard |
//! | [`zero2`] | all | its shard: each block's reduce-scattered as its backward ends | its shard |
//! | [`zero3`] | its shard + the gathered units | as zero2 | its shard |
//!
//! Every strategy steps a [`FlatOptimizer`](crate::optim::FlatOptimizer) over its shard of one
//! [`FlatLayout`](crate::params::FlatLayout) (the whole space for `single` and `ddp`), so there
//! is one optimizer path and one checkpoint format ([`OptimState`]).

mod core;
pub mod ddp;
pub mod groups;
pub mod pipeline;
pub mod single;
pub mod zero1;
pub mod zero2;
pub mod zero3;

use burn::module::Module;
use burn::prelude::*;
use kiln_models::{BlockStack, StepOutput};
use serde::Serialize;

use crate::comm::Collective;
use crate::config::{OptimConfig, PrecisionConfig, RecomputeConfig, StrategyKind};
use crate::error::Result;
use crate::optim::OptimState;
use crate::params::{FlatLayout, dtype_bytes};
use crate::precision::{LossScaler, compute_dtype, is_mixed, is_true_low};

pub(crate) use self::core::Core;

/// The [`Strategy`] methods every strategy answers from its `core` alone: the optimizer
/// state in and out of the canonical layout, the memory counts and the time in collectives.
macro_rules! answered_by_core {
    () => {
        fn optimizer_state(&mut self) -> $crate::error::Result<Option<$crate::optim::OptimState>> {
            self.core.optimizer_state()
        }

        fn load_optimizer_state(
            &mut self,
            state: &$crate::optim::OptimState,
        ) -> $crate::error::Result<()> {
            self.core.load_optimizer_state(state)
        }

        fn memory(&self) -> $crate::strategy::Memory {
            self.core.memory
        }

        fn take_sync_seconds(&mut self) -> f64 {
            self.core.take_sync_seconds()
        }

        fn nonfinite(&self) -> bool {
            self.core.nonfinite
        }
    };
}
use answered_by_core;

/// What one optimizer step does across ranks; see the module documentation. Collective
/// methods (all but [`Strategy::replicated_values`], [`Strategy::memory`] and
/// [`Strategy::take_sync_seconds`]) must be called by every rank in the same order.
pub trait Strategy<M, B> {
    /// Prepares an optimizer step (the compute copy of a lower precision; ZeRO-3 gathers the
    /// parameters that stay gathered for the whole step).
    fn begin_step(&mut self) -> Result<()>;
    /// Forward and backward of the `count` micro-batches of one optimizer step, each taken
    /// from `batches` when the strategy needs it (a pipeline stage that neither embeds nor
    /// scores takes none). `objective` turns a micro-batch's mean loss into what is
    /// differentiated. Returns the outputs (detached, the loss in f32) of the micro-batches
    /// this rank scored.
    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = B>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>>;
    /// Reduces what is left to reduce, unscales and checks the gradients (with a scaler),
    /// clips them to `clip` and steps the optimizer at `lr`. Returns whether it stepped (a
    /// scaler skips steps whose gradients overflowed, on every rank alike).
    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool>;
    /// The whole model in its master dtype, its buffers (BatchNorm statistics) brought up to
    /// date and averaged over ranks: what every rank evaluates and rank 0 saves.
    fn full_model(&mut self) -> Result<M>;
    /// The optimizer state in the canonical layout, on rank 0 (`None` elsewhere).
    fn optimizer_state(&mut self) -> Result<Option<OptimState>>;
    /// Takes this rank's part of a canonical optimizer state.
    fn load_optimizer_state(&mut self, state: &OptimState) -> Result<()>;
    /// Every optimizer's canonical state by parameter group, on rank 0: one entry named `""`
    /// for a model with one optimizer.
    fn optimizer_states(&mut self) -> Result<Option<Vec<(String, OptimState)>>> {
        Ok(self.optimizer_state()?.map(|s| vec![(String::new(), s)]))
    }
    /// Takes this rank's part of every group's canonical optimizer state.
    fn load_optimizer_states(&mut self, states: &[(String, OptimState)]) -> Result<()> {
        match states {
            [(name, state)] if name.is_empty() => self.load_optimizer_state(state),
            _ => Err(crate::error::Error::checkpoint(format!(
                "the checkpoint holds the optimizer states of groups {:?}, but this model \
                 steps one optimizer",
                states.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
            ))),
        }
    }
    /// Makes parameter group `group` the one that the next [`Strategy::begin_step`],
    /// [`Strategy::micro_steps`] and [`Strategy::optimizer_step`] train (models with several
    /// optimizers; every other strategy has group 0 alone).
    fn select_group(&mut self, group: usize) -> Result<()> {
        if group == 0 {
            Ok(())
        } else {
            Err(crate::error::Error::Worker(format!(
                "this strategy steps one optimizer; there is no group {group}"
            )))
        }
    }
    /// Fails if the ranks that must hold the same parameters (replicas, tied copies) differ
    /// by even one bit.
    fn check_replicas(&mut self, step: usize) -> Result<()>;
    /// What this strategy adds to a log line (called on every rank when one is due; rank 0's
    /// answer is written).
    fn report(&mut self) -> Result<Report> {
        Ok(Report::default())
    }
    /// The bytes this rank holds, now and at their peaks.
    fn memory(&self) -> Memory;
    /// Seconds spent in collectives since the last call.
    fn take_sync_seconds(&mut self) -> f64;
    /// Whether the last optimizer step was refused because a gradient was not finite (with no
    /// loss scaler to take it as an overflow).
    fn nonfinite(&self) -> bool;
}

/// What a strategy adds to a log line: fields of the training record, and records of its own.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Fields added to the training record.
    pub fields: Vec<(String, serde_json::Value)>,
    /// Further records (each with its own `split`).
    pub records: Vec<serde_json::Map<String, serde_json::Value>>,
}

/// Runs `count` micro-batches from `batches` one at a time through `step`, collecting their
/// outputs with the losses in f32.
pub(crate) fn one_by_one<B>(
    batches: &mut dyn Iterator<Item = B>,
    count: usize,
    mut step: impl FnMut(B) -> Result<StepOutput>,
) -> Result<Vec<StepOutput>> {
    let mut outs = Vec::with_capacity(count);
    for batch in batches.take(count) {
        outs.push(scored(step(batch)?));
    }
    Ok(outs)
}

/// A detached micro-batch output as the loop keeps it: the loss in f32.
pub(crate) fn scored(out: StepOutput) -> StepOutput {
    StepOutput {
        loss: out.loss.cast(burn::tensor::FloatDType::F32),
        ..out
    }
}

/// What a strategy is built from besides the model.
#[derive(Clone)]
pub struct Context<'a> {
    /// This rank's view of the group.
    pub comm: &'a dyn Collective,
    /// The rank's device, with autodiff (and Burn's checkpointing for `balanced`).
    pub device: Device,
    /// Precision policy.
    pub precision: PrecisionConfig,
    /// Activation checkpointing.
    pub recompute: RecomputeConfig,
    /// Synchronise BatchNorm statistics over ranks.
    pub sync_batchnorm: bool,
    /// The optimizer.
    pub optim: OptimConfig,
    /// Elements of one gradient bucket of an all-reduce.
    pub bucket_elements: usize,
    /// Stages, micro-batches and schedule (with the `pipeline` strategy).
    pub pipeline: crate::config::PipelineConfig,
    /// The optimizer of each parameter group of a model with several (by group name; a group
    /// not here uses `optim`).
    pub group_optims: std::collections::BTreeMap<String, OptimConfig>,
}

/// The ids of every block's parameters.
pub fn block_ids<B, M: BlockStack<B>>(model: &M) -> Vec<Vec<burn::module::ParamId>> {
    (0..model.num_blocks())
        .map(|i| model.block_params(i))
        .collect()
}

/// Builds strategy `kind` (resolved: not `auto`) for this rank around `model`, a full replica
/// in its master dtype with rank 0's weights.
pub fn build<'a, B: 'a, M>(
    kind: StrategyKind,
    model: M,
    ctx: Context<'a>,
) -> Result<Box<dyn Strategy<M, B> + 'a>>
where
    M: BlockStack<B> + Module + 'static,
{
    let blocks = block_ids(&model);
    let layout = |shards: usize| FlatLayout::new(&model, &blocks, shards);
    let world = ctx.comm.world_size();
    if !model.param_groups().is_empty() {
        // Checked at start (`trainer::check_policies`): only the replicated strategies take a
        // step with several optimizers.
        let reduce = match kind {
            StrategyKind::Auto | StrategyKind::Single => false,
            StrategyKind::Ddp => true,
            other => {
                return Err(crate::error::Error::config(format!(
                    "key `strategy.name`: {:?} cannot step a model with several optimizers",
                    crate::config::name_of(&other)
                )));
            }
        };
        let whole = Core::new(ctx.clone(), layout(1));
        return Ok(Box::new(groups::Groups::new(model, whole, ctx, reduce)?));
    }
    Ok(match kind {
        StrategyKind::Auto | StrategyKind::Single => {
            let core = Core::new(ctx, layout(1));
            Box::new(single::Single::new(model, core))
        }
        StrategyKind::Ddp => {
            let core = Core::new(ctx, layout(1));
            Box::new(ddp::Ddp::new(model, core))
        }
        StrategyKind::Zero1 => {
            let core = Core::new(ctx, layout(world));
            Box::new(zero1::Zero1::new(model, core))
        }
        StrategyKind::Zero2 => {
            let core = Core::new(ctx, layout(world));
            Box::new(zero2::Zero2::new(model, core))
        }
        StrategyKind::Zero3 => {
            let core = Core::new(ctx, layout(world));
            Box::new(zero3::Zero3::new(model, core)?)
        }
        StrategyKind::Pipeline => Box::new(pipeline::Pipeline::new(model, &blocks, ctx)?),
    })
}

/// Bytes now and at the peak.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counter {
    /// Bytes held now.
    pub now: usize,
    /// The most held at once so far.
    pub peak: usize,
}

impl Counter {
    pub(crate) fn add(&mut self, bytes: usize) {
        self.now += bytes;
        self.peak = self.peak.max(self.now);
    }
    pub(crate) fn sub(&mut self, bytes: usize) {
        self.now = self.now.saturating_sub(bytes);
    }
    pub(crate) fn set(&mut self, bytes: usize) {
        self.now = bytes;
        self.peak = self.peak.max(bytes);
    }
}

/// What one rank holds of the model's training state, counted where the strategy allocates
/// and drops it: parameters (master and compute copies, gathered units), gradients (whole,
/// per unit, or the rank's shard) and optimizer state. Activations are not counted (the
/// memory pool and the process's resident memory show them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Memory {
    /// Parameter bytes.
    pub params: Counter,
    /// Gradient bytes.
    pub grads: Counter,
    /// Optimizer-state bytes.
    pub optim: Counter,
    /// The most the three held together.
    pub total_peak: usize,
    /// The most the device's memory pool had in use when sampled (after each micro-step and
    /// optimizer step), where the backend reports a pool.
    pub pool_peak: Option<u64>,
}

impl Memory {
    pub(crate) fn note(&mut self) {
        self.total_peak = self
            .total_peak
            .max(self.params.now + self.grads.now + self.optim.now);
    }
}

/// The bytes per rank a strategy is expected to hold at its peaks, as DeepSpeed's estimator
/// gives them: computed from the layout, before training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// Parameter bytes.
    pub params: usize,
    /// Gradient bytes.
    pub grads: usize,
    /// Optimizer-state bytes.
    pub optim: usize,
}

/// Optimizer-state tensors per parameter element.
fn state_tensors(optim: &OptimConfig) -> usize {
    match optim.name {
        crate::config::OptimizerKind::Adamw => 2,
        crate::config::OptimizerKind::Sgd => usize::from(optim.momentum > 0.0),
    }
}

/// The expected peak bytes per rank of `kind` over `world` ranks for a model laid out as
/// `layout` (any shard count), with ZeRO-3 recomputing as `recompute` says and a pipeline
/// cut as `pipeline` says (the heaviest stage's figures).
pub fn estimate(
    kind: StrategyKind,
    layout: &FlatLayout,
    world: usize,
    precision: &PrecisionConfig,
    optim: &OptimConfig,
    recompute: &RecomputeConfig,
    pipeline: &crate::config::PipelineConfig,
) -> Result<Estimate> {
    let sharded = layout.with_shards(world);
    let mode = precision.mode;
    let master = if is_true_low(mode) {
        compute_dtype(mode)
    } else {
        burn::tensor::FloatDType::F32
    };
    let mb = dtype_bytes(master);
    let full = layout.total();
    let compute_copy = if is_mixed(mode) {
        full * dtype_bytes(compute_dtype(mode))
    } else {
        0
    };
    let shard = sharded.shard_len;
    let state = state_tensors(optim);
    let gathered = |n: usize| {
        n * if is_mixed(mode) {
            dtype_bytes(compute_dtype(mode))
        } else {
            mb
        }
    };
    Ok(match kind {
        StrategyKind::Pipeline => {
            let stage =
                pipeline::stage_elements(layout, pipeline.stages, pipeline.cuts.as_deref())?;
            let copy = if is_mixed(mode) {
                stage * dtype_bytes(compute_dtype(mode))
            } else {
                0
            };
            Estimate {
                params: stage * mb + copy,
                grads: stage * 4,
                optim: state * stage * mb,
            }
        }
        StrategyKind::Auto | StrategyKind::Single | StrategyKind::Ddp => Estimate {
            params: full * mb + compute_copy,
            grads: full * 4,
            optim: state * full * mb,
        },
        StrategyKind::Zero1 => Estimate {
            params: full * mb + compute_copy,
            grads: full * 4,
            optim: state * shard * mb,
        },
        StrategyKind::Zero2 => Estimate {
            params: full * mb + compute_copy,
            grads: (shard + sharded.largest_unit()) * 4,
            optim: state * shard * mb,
        },
        StrategyKind::Zero3 => Estimate {
            params: shard * mb
                + gathered(zero3::gathered_peak(
                    &sharded,
                    zero3::recompute_for(recompute),
                )),
            grads: (shard + sharded.largest_unit()) * 4,
            optim: state * shard * mb,
        },
    })
}
