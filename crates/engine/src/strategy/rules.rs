//! [`Rules`]: what a strategy allows, says of itself and expects to hold, before any rank
//! runs; [`Setup`], the settings it is asked with; [`ModelFacts`], what it sees of a model.

use burn::module::Module;
use kiln_models::BlockStack;

use crate::config::{
    DdpConfig, DilocoConfig, OptimConfig, OptimizerKind, PipelineConfig, RecomputeConfig,
    RecomputeMode, StrategyKind, name_of,
};
use crate::error::{Error, Result};
use crate::exec::Recompute;
use crate::params::{FlatLayout, has_buffers};
use crate::precision::Policy;

/// A strategy's contract with the rest of kiln, before any rank runs, in four parts that
/// different readers ask: the start-up checks ([`Checks`]), the start-up table and the
/// planner's list ([`Words`]), the planner's costs ([`Costs`]) and the shape of its step that
/// the loop and the builder need ([`Shape`]). What the step does is [`Strategy`]. Each
/// strategy file has one type implementing the four; the registry
/// ([`rules`](crate::strategy::rules())) finds it. Lightning Fabric's strategy classes own the
/// same: their checks, their description.
///
/// [`Strategy`]: crate::strategy::Strategy
pub trait Rules: Checks + Words + Costs + Shape {}

impl<T: Checks + Words + Costs + Shape> Rules for T {}

/// What a strategy refuses, before any rank runs: one line naming the key.
pub trait Checks: Sync {
    /// Refuses settings the strategy cannot run, whatever the model.
    fn check(&self, setup: &Setup) -> Result<()> {
        let _ = setup;
        Ok(())
    }
    /// Refuses a model the strategy cannot run.
    fn check_model(&self, model: &ModelFacts, setup: &Setup) -> Result<()> {
        let _ = (model, setup);
        Ok(())
    }
    /// Whether the strategy steps one optimizer only (it refuses a model with parameter
    /// groups).
    fn one_optimizer(&self) -> bool {
        true
    }
    /// Why a launcher may not restart it on other devices; `None`, the default, where it may.
    fn fixed_devices(&self) -> Option<&'static str> {
        None
    }
}

/// What a strategy says of itself: the start-up table's lines and the planner's words.
pub trait Words: Sync {
    /// The start-up table's line: the strategy and what it shards.
    fn describe(&self, setup: &Setup) -> String;
    /// The planner's words for the strategy with these settings: its name by default.
    fn words(&self, setup: &Setup) -> String {
        setup.name()
    }
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
}

/// What the planner (`plan/`) asks of a strategy, so that it composes its predictions without
/// naming one.
pub trait Costs: Sync {
    /// The bytes per rank the strategy is expected to hold at its peaks, as DeepSpeed's
    /// estimator gives them: computed from the layout (any shard count), before training.
    fn estimate(&self, layout: &FlatLayout, optim: &OptimConfig, setup: &Setup)
    -> Result<Estimate>;
    /// The ways the planner may run this strategy in `room` (none, the default: it is not a
    /// candidate there).
    fn variants(&self, room: &Room) -> Vec<Variant> {
        let _ = room;
        Vec::new()
    }
    /// The probe whose forward, backward and buffers stand for this strategy's: its own name
    /// by default (a strategy that steps as another, such as `zero1` as `ddp`, names that one).
    fn probe_as(&self, setup: &Setup) -> String {
        setup.name()
    }
    /// The collectives one optimizer step calls over a model of `floats` trainable floats
    /// (`local_ranks` of the world in this process), each timed by the planner on the run's
    /// group; none, the default, for a strategy that calls none.
    fn traffic(&self, setup: &Setup, floats: usize, local_ranks: usize) -> Vec<Traffic> {
        let _ = (setup, floats, local_ranks);
        Vec::new()
    }
    /// Micro-batches whose activations a rank holds at once, out of a flush (1 by default; a
    /// pipeline stage holds those in flight).
    fn in_flight(&self, setup: &Setup) -> usize {
        let _ = setup;
        1
    }
    /// Whether a rank's waits for its neighbours belong to its step (a pipeline's bubbles);
    /// `false` by default.
    fn waits_are_work(&self) -> bool {
        false
    }
    /// Whether a run under it takes the optimizer step of plain data parallelism (`false`
    /// for DiLoCo's outer loop), so that `--strategy auto` may choose it.
    fn same_step(&self) -> bool {
        true
    }
    /// Whether BatchNorm sees micro-batches of the strategy's own (a pipeline's) rather than
    /// the micro-batch asked; `--strategy auto` keeps such a model off it.
    fn own_micro_batches(&self) -> bool {
        false
    }
    /// How far it departs from plain data parallelism, for the planner's ties: 0 plain, then
    /// more shards, then other steps and stages.
    fn simplicity(&self) -> usize {
        0
    }
}

/// The shape of a strategy's step, which the loop, the builder and the checkpoints need.
pub trait Shape: Sync {
    /// The strategy a device of this strategy runs its per-core sub-replicas under (a CPU
    /// device's `hardware.cpu_split`, `cores.rs`); `None`, the default, for a strategy
    /// that shards or stages over devices and keeps one replica per device.
    fn core_split(&self) -> Option<StrategyKind> {
        None
    }
    /// Which blocks the strategy's walk recomputes in the backward: what `[recompute]` asks,
    /// by default.
    fn recomputes(&self, setup: &Setup) -> Recompute {
        setup.walk_recompute()
    }
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
    /// [`Strategy::load_optimizer_states`](crate::strategy::Strategy::load_optimizer_states) under that name); `None`, the default, for none.
    fn own_state(&self) -> Option<&'static str> {
        None
    }
    /// Whether a rank of this strategy reads its own ranges of the trained (and frozen)
    /// parameters from a sharded checkpoint
    /// ([`Strategy::load_param_shards`](crate::strategy::Strategy::load_param_shards)), so that
    /// the model every rank starts from is read without them: a strategy whose ranks hold a
    /// shard of the parameters. `false`, the default: every rank starts from the whole model.
    fn reads_own_params(&self) -> bool {
        false
    }
}

/// A dimension of the mesh around the data dimension's strategy (tensor parallelism): what it
/// refuses and how the start-up table words the strategy inside it. [`Setup`] asks each one
/// the registry lists, after the mesh's own checks and before the strategy's.
pub trait Dimension: Sync {
    /// Ranks along it in these settings (1: not used; then nothing else is asked).
    fn size(&self, setup: &Setup) -> usize;
    /// Refuses settings it cannot run; one line naming the key.
    fn check(&self, setup: &Setup) -> Result<()>;
    /// The start-up table's line for the strategy's line `inside` it.
    fn describe(&self, setup: &Setup, inside: String) -> String;
    /// The start-up table's words for how `per_step` samples make one step inside it.
    fn batch_line(&self, setup: &Setup, batch: usize, accumulate: usize, per_step: usize)
    -> String;
}

/// Where the planner would run a strategy: the ranks, the processes, the devices of each
/// process and the model's blocks.
#[derive(Debug, Clone, Copy)]
pub struct Room {
    /// Ranks in all.
    pub world: usize,
    /// Processes.
    pub processes: usize,
    /// Devices of each process.
    pub devices: usize,
    /// Blocks the model describes.
    pub blocks: usize,
}

/// One way to run a strategy, as the planner weighs it.
#[derive(Debug, Clone)]
pub struct Variant {
    /// The strategy.
    pub kind: StrategyKind,
    /// Ranks one replica of the model takes.
    pub stages: usize,
    /// Micro-batches of one flush.
    pub microbatches: usize,
    /// Its `[pipeline]` section (the default for a strategy that has none).
    pub pipeline: PipelineConfig,
    /// Its words in the planner's table.
    pub words: String,
}

impl Variant {
    /// The strategy `kind` with no settings of its own.
    pub fn plain(kind: StrategyKind) -> Self {
        Self {
            kind,
            stages: 1,
            microbatches: 1,
            pipeline: PipelineConfig::default(),
            words: name_of(&kind),
        }
    }
}

/// A collective of a step's traffic (see [`Costs::traffic`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// All-reduce of the floats.
    AllReduce,
    /// Reduce-scatter of the floats (each rank keeps its part).
    ReduceScatter,
    /// All-gather into the floats (each rank gives its part).
    AllGather,
}

/// One collective a step calls: `times` calls of `op` over `floats` floats every `every`
/// steps, on every micro-batch or once per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    /// The collective.
    pub op: Op,
    /// Floats per call.
    pub floats: usize,
    /// Calls.
    pub times: usize,
    /// Every how many steps (1: every step).
    pub every: usize,
    /// Whether the calls repeat on every micro-batch of the step.
    pub per_micro_batch: bool,
}

impl Traffic {
    /// `op` over `floats`, once a step.
    pub fn once(op: Op, floats: usize) -> Self {
        Self {
            op,
            floats,
            times: 1,
            every: 1,
            per_micro_batch: false,
        }
    }

    /// `times` calls of `op` over `floats` on every micro-batch.
    pub fn per_micro_batch(op: Op, floats: usize, times: usize) -> Self {
        Self {
            op,
            floats,
            times,
            every: 1,
            per_micro_batch: true,
        }
    }
}

impl std::fmt::Debug for dyn Rules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A strategy's rules are known by its kind, which `Setup` prints beside them.
        f.write_str("Rules")
    }
}

impl std::fmt::Debug for dyn Dimension {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dimension")
    }
}

/// A strategy's own section of the config: the settings only it reads, in one value, so that
/// nothing between the config and the strategy passes another's around.
#[derive(Debug, Clone, PartialEq)]
pub enum Own {
    /// A strategy without a section of its own (`single`, `ddp`, `zero1`–`zero3`: the data
    /// dimension's `[ddp]` and `dist.overlap` are every data strategy's).
    None,
    /// `[pipeline]`: stages, micro-batches, schedule and cuts.
    Pipeline(PipelineConfig),
    /// `[diloco]`: the outer loop.
    Diloco(DilocoConfig),
}

impl Own {
    /// Strategy `kind`'s own section out of the sections a config holds.
    pub fn of(kind: StrategyKind, pipeline: &PipelineConfig, diloco: &DilocoConfig) -> Self {
        match kind {
            StrategyKind::Pipeline => Own::Pipeline(pipeline.clone()),
            StrategyKind::Diloco => Own::Diloco(diloco.clone()),
            _ => Own::None,
        }
    }

    /// `[pipeline]`: asked only by the pipeline's rules and stages, which the registry gives
    /// a pipeline's setup alone.
    pub(crate) fn pipeline(&self) -> &PipelineConfig {
        match self {
            Own::Pipeline(p) => p,
            other => unreachable!("the pipeline's section asked of {other:?}"),
        }
    }

    /// `[diloco]`: asked only by DiLoCo's rules and islands, which the registry gives a
    /// DiLoCo setup alone.
    pub(crate) fn diloco(&self) -> &DilocoConfig {
        match self {
            Own::Diloco(d) => d,
            other => unreachable!("DiLoCo's section asked of {other:?}"),
        }
    }
}

/// The settings strategies are checked, described, estimated and built with, resolved once
/// from the config and the world: what the loop's settings hold for them, and nothing else.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The strategy (resolved: never `auto`).
    pub kind: StrategyKind,
    /// Its rules, from the registry ([`rules`](crate::strategy::rules)).
    pub rules: &'static dyn Rules,
    /// The mesh's other dimensions, from the registry.
    pub dimensions: &'static [&'static dyn Dimension],
    /// Ranks the strategy spans: every rank of the run over `tp` (one rank per tensor-parallel
    /// group; all of them without one).
    pub world: usize,
    /// Ranks of one tensor-parallel group (`parallel.tp`; 1: none).
    pub tp: usize,
    /// Every rank of the run.
    pub ranks: usize,
    /// The data-parallel replicas asked (`parallel.dp`), checked against what the ranks leave.
    pub dp: Option<usize>,
    /// The precision policy.
    pub policy: Policy,
    /// Activation checkpointing.
    pub recompute: RecomputeConfig,
    /// Gradient buckets and synchronised BatchNorm.
    pub ddp: DdpConfig,
    /// The strategy's own section, if it has one: the one value its settings reach it in.
    pub own: Own,
    /// Reduce gradients beside the backward (`dist.overlap`).
    pub overlap: bool,
}

impl Setup {
    /// The strategy's rules.
    pub fn rules(&self) -> &'static dyn Rules {
        self.rules
    }

    /// The strategy's name as the config spells it.
    pub fn name(&self) -> String {
        name_of(&self.kind)
    }

    /// Refuses what the strategy cannot run with these settings, whatever the model: the mesh
    /// first, then the strategy's rules.
    pub fn check(&self) -> Result<()> {
        for d in self.used_dimensions() {
            d.check(self)?;
        }
        let replicas = self.world / self.stages();
        if let Some(dp) = self.dp
            && dp != replicas
        {
            return Err(Error::config(format!(
                "key `parallel.dp`: is {dp}, but {} ranks with tp = {} and {} pipeline stages \
                leave {replicas} data-parallel replicas; leave dp out to take what the \
                devices leave",
                self.ranks,
                self.tp,
                self.stages()
            )));
        }
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

    /// The planner's words for the strategy (a pipeline's stages, micro-batches and schedule).
    pub fn words(&self) -> String {
        self.rules().words(self)
    }

    /// The start-up table's line for the strategy (and the tensor-parallel groups inside it).
    pub fn describe(&self) -> String {
        let line = self.rules().describe(self);
        self.used_dimensions()
            .fold(line, |inside, d| d.describe(self, inside))
    }

    /// The dimensions of the mesh these settings use (size above 1).
    fn used_dimensions(&self) -> impl Iterator<Item = &'static dyn Dimension> + '_ {
        self.dimensions.iter().copied().filter(|d| d.size(self) > 1)
    }

    /// The start-up table's words for activation checkpointing under this strategy.
    pub fn recompute_line(&self) -> String {
        self.rules().recompute_line(self)
    }

    /// The start-up table's words for how `per_step` samples make one step: `batch` per
    /// micro-batch, `accumulate` accumulation steps.
    pub fn batch_line(&self, batch: usize, accumulate: usize, per_step: usize) -> String {
        if let Some(d) = self.used_dimensions().last() {
            return d.batch_line(self, batch, accumulate, per_step);
        }
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
    /// The floats a tensor-parallel group all-reduces per step, as the model predicts them
    /// (`TensorParallel::tp_floats` × micro-batches); `None` without a group or a prediction.
    pub tp_floats: Option<usize>,
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
            tp_floats: None,
        }
    }
}

/// The ids of every block's parameters.
pub fn block_ids<B, M: BlockStack<B>>(model: &M) -> Vec<Vec<burn::module::ParamId>> {
    (0..model.num_blocks())
        .map(|i| model.block_params(i))
        .collect()
}

/// The bytes per rank a strategy is expected to hold at its peaks (see [`Costs::estimate`]).
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
