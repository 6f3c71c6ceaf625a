//! Strategies: what one optimizer step does across ranks, and what each one allows.
//!
//! Each strategy lives in its own file and owns two things:
//! - its **rules** ([`Rules`]): the settings and models it refuses (one line naming the key),
//!   its start-up line, the bytes per rank it expects, and how many ranks and micro-batches
//!   one replica takes. The launcher, the start-up table and the loop ask [`Setup`], which asks
//!   the registry ([`rules`]); nothing outside this folder names a concrete strategy;
//! - its **step** ([`Strategy`]): the loop hands it each micro-batch, asks it for an optimizer
//!   step, and for the whole model when it evaluates or checkpoints. It owns its rank's share of
//!   the model (replica or shard), where gradients go, where optimizer state lives, and how
//!   its state leaves and re-enters a checkpoint:
//!
//! | strategy | parameters per rank | gradients per rank | optimizer state per rank |
//! |---|---|---|---|
//! | [`single`] | all | all | all |
//! | [`ddp`] | all | all, all-reduced on the last micro-step | all |
//! | [`zero1`] | all | all, all-reduced on the last micro-step | its shard |
//! | [`zero2`] | all | its shard: each block's reduce-scattered as its backward ends | its shard |
//! | [`zero3`] | its shard + the gathered units | as zero2 | its shard |
//! | [`pipeline`] | its stage's | its stage's, averaged with the same stage's | its stage's |
//!
//! The replicated strategies (`single`, `ddp`, `zero1`, `zero2`) share one step
//! (`replica::Replicated`) and differ only in their `replica::Reduction`. Every strategy
//! steps a [`FlatOptimizer`](crate::optim::FlatOptimizer) over its shard of one
//! [`FlatLayout`] (the whole space for `single` and `ddp`), so there is one optimizer path and
//! one checkpoint format ([`OptimState`]).
//!
//! Adding a strategy: a file here with a type implementing [`Rules`] (and [`Strategy`], or a
//! `replica::Reduction`), one arm in [`rules`] and one in [`build`], and a variant of
//! [`StrategyKind`].

mod core;
mod courier;
pub mod ddp;
pub mod diloco;
pub mod groups;
pub mod pipeline;
mod replica;
pub mod single;
pub mod zero1;
pub mod zero2;
pub mod zero3;

use burn::module::Module;
use burn::prelude::*;
use kiln_models::{BlockStack, StepOutput};
use serde::Serialize;

use crate::comm::Collective;
use crate::config::{
    DdpConfig, DilocoConfig, OptimConfig, OptimizerKind, PipelineConfig, RecomputeConfig,
    RecomputeMode, RootConfig, StrategyKind, name_of,
};
use crate::error::{Error, Result};
use crate::exec::Recompute;
use crate::optim::OptimState;
use crate::params::{FlatLayout, has_buffers};
use crate::precision::{LossScaler, Policy};

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
/// methods (all but [`Strategy::memory`], [`Strategy::take_sync_seconds`] and
/// [`Strategy::nonfinite`]) must be called by every rank in the same order.
pub trait Strategy<M, B> {
    /// Prepares an optimizer step (the compute copy of a lower precision; ZeRO-3 gathers the
    /// parameters that stay gathered for the whole step).
    fn begin_step(&mut self) -> Result<()>;
    /// Forward and backward of the `count` micro-batches of one optimizer step, each taken
    /// from `batches` when the strategy needs it (a pipeline stage that neither embeds nor
    /// scores takes none). `objective` turns a micro-batch's mean loss into what is
    /// differentiated. A batch that could not be built (an error item: a file that does not
    /// decode) ends the step with its error. Returns the outputs (detached, the loss in f32)
    /// of the micro-batches this rank scored.
    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>>;
    /// Whether [`Strategy::micro_steps`] takes batches on this rank (a pipeline's middle
    /// stages take none): the loop's loader builds batches ahead only for ranks that take them.
    fn takes_batches(&self) -> bool {
        true
    }
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
            _ => Err(Error::checkpoint(format!(
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
            Err(Error::Worker(format!(
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

/// The settings strategies are checked, described, estimated and built with, resolved once
/// from the config and the world: what the loop's settings hold for them, and nothing else.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The strategy (resolved: never `auto`).
    pub kind: StrategyKind,
    /// Number of ranks.
    pub world: usize,
    /// The precision policy.
    pub policy: Policy,
    /// Activation checkpointing.
    pub recompute: RecomputeConfig,
    /// Gradient buckets and synchronised BatchNorm.
    pub ddp: DdpConfig,
    /// The pipeline's stages, micro-batches and schedule.
    pub pipeline: PipelineConfig,
    /// DiLoCo's outer loop.
    pub diloco: DilocoConfig,
    /// Reduce gradients beside the backward (`dist.overlap`).
    pub overlap: bool,
}

impl Setup {
    /// The setup `config` describes for `world` ranks (`auto` resolved by the world).
    pub fn new(config: &RootConfig, world: usize) -> Self {
        Self {
            kind: config.strategy.name.resolve(world),
            world,
            policy: Policy::new(&config.precision),
            recompute: config.recompute.clone(),
            ddp: config.ddp.clone(),
            pipeline: config.pipeline.clone(),
            diloco: config.diloco.clone(),
            overlap: config.dist.overlap.resolve(crate::comm::processes().count),
        }
    }

    /// The strategy's rules.
    pub fn rules(&self) -> &'static dyn Rules {
        rules(self.kind)
    }

    /// The strategy's name as the config spells it.
    pub fn name(&self) -> String {
        name_of(&self.kind)
    }

    /// Refuses what the strategy cannot run with these settings, whatever the model.
    pub fn check(&self) -> Result<()> {
        self.rules().check(self)
    }

    /// Refuses a model the strategy cannot run (several optimizers where it steps one, a
    /// model without the blocks it needs).
    pub fn check_model(&self, model: &ModelFacts) -> Result<()> {
        let rules = self.rules();
        if !model.groups.is_empty() && rules.one_optimizer() {
            return Err(Error::config(format!(
                "key `strategy.name`: {:?} shards or splits one optimizer's step, but this model \
                 steps {} optimizers ({}); use \"ddp\" or \"single\"",
                self.name(),
                model.groups.len(),
                model.groups.join(", ")
            )));
        }
        rules.check_model(model, self)
    }

    /// Ranks that one replica of the model takes (a pipeline's stages; 1 otherwise).
    pub fn stages(&self) -> usize {
        self.rules().stages(self)
    }

    /// Micro-batches one accumulation step runs (a pipeline's flush; 1 otherwise).
    pub fn flush(&self) -> usize {
        self.rules().flush(self)
    }

    /// The start-up table's line for the strategy.
    pub fn describe(&self) -> String {
        self.rules().describe(self)
    }

    /// The start-up table's words for activation checkpointing under this strategy.
    pub fn recompute_line(&self) -> String {
        self.rules().recompute_line(self)
    }

    /// The start-up table's words for how `per_step` samples make one step: `batch` per
    /// micro-batch, `accumulate` accumulation steps.
    pub fn batch_line(&self, batch: usize, accumulate: usize, per_step: usize) -> String {
        self.rules().batch_line(self, batch, accumulate, per_step)
    }

    /// The expected peak bytes per rank for a model laid out as `layout` (any shard count),
    /// with `optim`'s state.
    pub fn estimate(&self, layout: &FlatLayout, optim: &OptimConfig) -> Result<Estimate> {
        self.rules().estimate(layout, optim, self)
    }

    /// Which blocks the block walk recomputes, as `[recompute]` says (Burn's `balanced` is the
    /// device's business and walks nothing).
    pub fn walk_recompute(&self) -> Recompute {
        match self.recompute.mode {
            RecomputeMode::Blocks => Recompute::Blocks {
                every: self.recompute.every,
            },
            RecomputeMode::None | RecomputeMode::Balanced => Recompute::Keep,
        }
    }
}

/// What a strategy's rules see of a model: its blocks, its parameter groups and its layout.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    /// Blocks its [`BlockStack`] describes.
    pub blocks: usize,
    /// Whether a block run twice gives the same result (no dropout).
    pub deterministic: bool,
    /// Whether it has buffers (BatchNorm running statistics).
    pub buffers: bool,
    /// Its parameter groups' names (none for a model with one optimizer).
    pub groups: Vec<String>,
    /// Its trainable parameters in one shard: the parameters outside every block, then each
    /// block.
    pub layout: FlatLayout,
}

impl ModelFacts {
    /// The facts of `model`.
    pub fn of<B, M: BlockStack<B> + Module>(model: &M) -> Self {
        Self {
            blocks: model.num_blocks(),
            deterministic: model.blocks_deterministic(),
            buffers: has_buffers(model),
            groups: model.param_groups().into_iter().map(|g| g.name).collect(),
            layout: FlatLayout::new(model, &block_ids(model), 1),
        }
    }
}

/// What a strategy allows, says of itself and expects to hold, before any rank runs (Lightning
/// Fabric's strategy classes own the same: their checks, their description). Each strategy
/// file has one type implementing it; [`rules`] finds it.
pub trait Rules: Sync {
    /// The strategy a device of this strategy runs its per-core sub-replicas under (a CPU
    /// device's `hardware.cpu_split`, [`crate::cores`]); `None`, the default, for a strategy
    /// that shards or stages over devices and keeps one replica per device.
    fn core_split(&self) -> Option<StrategyKind> {
        None
    }
    /// Refuses settings the strategy cannot run, whatever the model; one line naming the key.
    fn check(&self, setup: &Setup) -> Result<()> {
        let _ = setup;
        Ok(())
    }
    /// Refuses a model the strategy cannot run; one line naming the key.
    fn check_model(&self, model: &ModelFacts, setup: &Setup) -> Result<()> {
        let _ = (model, setup);
        Ok(())
    }
    /// Whether the strategy steps one optimizer only (it refuses a model with parameter
    /// groups).
    fn one_optimizer(&self) -> bool {
        true
    }
    /// The start-up table's line: the strategy and what it shards.
    fn describe(&self, setup: &Setup) -> String;
    /// The start-up table's words for activation checkpointing under this strategy.
    fn recompute_line(&self, setup: &Setup) -> String {
        let r = &setup.recompute;
        match r.mode {
            RecomputeMode::Blocks if r.every > 1 => {
                format!("recompute every {}th block", r.every)
            }
            m => format!("recompute {}", name_of(&m)),
        }
    }
    /// The start-up table's words for how `per_step` samples make one step: `batch` per
    /// micro-batch, `accumulate` accumulation steps.
    fn batch_line(
        &self,
        setup: &Setup,
        batch: usize,
        accumulate: usize,
        per_step: usize,
    ) -> String {
        format!(
            "{batch} per device × {} devices × {accumulate} accumulation = {per_step} per step",
            setup.world
        )
    }
    /// The bytes per rank the strategy is expected to hold at its peaks, as DeepSpeed's
    /// estimator gives them: computed from the layout (any shard count), before training.
    fn estimate(&self, layout: &FlatLayout, optim: &OptimConfig, setup: &Setup)
    -> Result<Estimate>;
    /// Ranks one replica of the model takes.
    fn stages(&self, setup: &Setup) -> usize {
        let _ = setup;
        1
    }
    /// Micro-batches one accumulation step runs.
    fn flush(&self, setup: &Setup) -> usize {
        let _ = setup;
        1
    }
    /// The name of the state the strategy keeps in checkpoints beside the model's optimizer
    /// states (`optimizer.<name>.bpk`, read on resume when present and handed to
    /// [`Strategy::load_optimizer_states`] under that name); `None`, the default, for none.
    fn own_state(&self) -> Option<&'static str> {
        None
    }
}

/// The rules of strategy `kind` (`auto` as `single`: resolve it first by the world).
pub fn rules(kind: StrategyKind) -> &'static dyn Rules {
    match kind {
        StrategyKind::Auto | StrategyKind::Single => &single::Single,
        StrategyKind::Ddp => &ddp::Ddp,
        StrategyKind::Zero1 => &zero1::Zero1,
        StrategyKind::Zero2 => &zero2::Zero2,
        StrategyKind::Zero3 => &zero3::Zero3,
        StrategyKind::Pipeline => &pipeline::Pipeline,
        StrategyKind::Diloco => &diloco::Diloco,
    }
}

/// Runs `count` micro-batches from `batches` one at a time through `step`, collecting their
/// outputs with the losses in f32.
pub(crate) fn one_by_one<B>(
    batches: &mut dyn Iterator<Item = Result<B>>,
    count: usize,
    mut step: impl FnMut(B) -> Result<StepOutput>,
) -> Result<Vec<StepOutput>> {
    let mut outs = Vec::with_capacity(count);
    for batch in batches.take(count) {
        outs.push(scored(step(batch?)?));
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

/// What one rank's strategy is built from besides the model: resolved values, no config
/// sections beyond the strategy's own.
#[derive(Clone)]
pub struct Context<'a> {
    /// This rank's view of the group.
    pub comm: &'a dyn Collective,
    /// The rank's device, with autodiff (and Burn's checkpointing for `balanced`).
    pub device: Device,
    /// The precision policy.
    pub policy: Policy,
    /// Which blocks the block walk recomputes.
    pub recompute: Recompute,
    /// Synchronise BatchNorm statistics over ranks.
    pub sync_batchnorm: bool,
    /// Elements of one gradient bucket of an all-reduce.
    pub bucket_elements: usize,
    /// Stages, micro-batches and schedule (the `pipeline` strategy's own section).
    pub pipeline: PipelineConfig,
    /// The outer loop (the `diloco` strategy's own section).
    pub diloco: DilocoConfig,
    /// Reduce gradients beside the backward (`dist.overlap`).
    pub overlap: bool,
    /// The optimizer.
    pub optim: OptimConfig,
    /// The optimizer of each parameter group of a model with several (by group name; a group
    /// not here uses `optim`).
    pub group_optims: std::collections::BTreeMap<String, OptimConfig>,
}

impl<'a> Context<'a> {
    /// The context of the rank `comm` on `device` under `setup`, stepping `optim` (and
    /// `group_optims` for a model with parameter groups).
    pub fn new(
        setup: &Setup,
        comm: &'a dyn Collective,
        device: Device,
        optim: OptimConfig,
        group_optims: std::collections::BTreeMap<String, OptimConfig>,
    ) -> Self {
        Self {
            comm,
            device,
            policy: setup.policy.clone(),
            recompute: setup.walk_recompute(),
            sync_batchnorm: setup.ddp.sync_batchnorm,
            bucket_elements: (setup.ddp.bucket_mb * 1024.0 * 1024.0 / 4.0).max(1.0) as usize,
            pipeline: setup.pipeline.clone(),
            diloco: setup.diloco.clone(),
            overlap: setup.overlap,
            optim,
            group_optims,
        }
    }
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
    use replica::Replicated;
    let blocks = block_ids(&model);
    let layout = |shards: usize| FlatLayout::new(&model, &blocks, shards);
    let world = ctx.comm.world_size();
    let grouped = !model.param_groups().is_empty();
    Ok(match kind {
        // A model with several optimizers steps one group at a time (checked at start: only
        // these two take one).
        StrategyKind::Auto | StrategyKind::Single if grouped => {
            let whole = Core::new(ctx.clone(), layout(1));
            Box::new(groups::Groups::new(model, whole, ctx, false)?)
        }
        StrategyKind::Ddp if grouped => {
            let whole = Core::new(ctx.clone(), layout(1));
            Box::new(groups::Groups::new(model, whole, ctx, true)?)
        }
        _ if grouped => {
            return Err(Error::config(format!(
                "key `strategy.name`: {:?} cannot step a model with several optimizers",
                name_of(&kind)
            )));
        }
        StrategyKind::Auto | StrategyKind::Single => {
            let core = Core::new(ctx, layout(1));
            Box::new(Replicated::new(model, core, single::Single))
        }
        StrategyKind::Ddp => {
            let core = Core::new(ctx, layout(1));
            Box::new(Replicated::new(model, core, ddp::Ddp))
        }
        StrategyKind::Zero1 => {
            let core = Core::new(ctx, layout(world));
            Box::new(Replicated::new(model, core, zero1::Zero1))
        }
        StrategyKind::Zero2 => {
            let core = Core::new(ctx, layout(world));
            Box::new(Replicated::new(model, core, zero2::Zero2))
        }
        StrategyKind::Zero3 => {
            let core = Core::new(ctx, layout(world));
            Box::new(zero3::Sharded::new(model, core)?)
        }
        StrategyKind::Pipeline => Box::new(pipeline::Stage::new(model, &blocks, ctx)?),
        StrategyKind::Diloco => {
            let whole = layout(1);
            Box::new(diloco::Islands::new(model, whole, ctx)?)
        }
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

/// The bytes per rank a strategy is expected to hold at its peaks (see [`Rules::estimate`]).
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
pub(crate) fn state_tensors(optim: &OptimConfig) -> usize {
    match optim.name {
        OptimizerKind::Adamw => 2,
        OptimizerKind::Sgd => usize::from(optim.momentum > 0.0),
    }
}

/// The estimate of a strategy that holds every parameter (and a compute copy), `grads`
/// gradient elements and the optimizer state of `state` elements.
pub(crate) fn replicated_estimate(
    layout: &FlatLayout,
    optim: &OptimConfig,
    setup: &Setup,
    grads: usize,
    state: usize,
) -> Estimate {
    let full = layout.total();
    let p = &setup.policy;
    Estimate {
        params: p.master_bytes(full) + p.compute_copy_bytes(full),
        grads: grads * 4,
        optim: state_tensors(optim) * p.master_bytes(state),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(overrides: &[&str], processes: usize) -> Result<()> {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        let config = RootConfig::load(None, &o)?;
        let world = config.hardware.devices.indices().len() * processes;
        Setup::new(&config, world).check()
    }

    #[test]
    fn strategies_refuse_what_they_cannot_run() {
        assert!(setup(&["hardware.devices=2"], 1).is_ok());
        let e = setup(&["hardware.devices=2", "strategy.name=\"single\""], 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("strategy.name") && e.contains("2 are selected"),
            "{e}"
        );
        // Two processes of one device each are two ranks.
        assert!(setup(&["strategy.name=\"single\""], 2).is_err());
        let e = setup(&["strategy.name=\"zero3\"", "ddp.sync_batchnorm=true"], 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ddp.sync_batchnorm") && e.contains("zero3"),
            "{e}"
        );
        let e = setup(
            &[
                "hardware.devices=2",
                "strategy.name=\"pipeline\"",
                "pipeline.stages=3",
            ],
            1,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("pipeline.stages") && e.contains("divide"), "{e}");
    }
}
