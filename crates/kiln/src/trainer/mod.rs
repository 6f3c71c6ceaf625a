//! The training loop every strategy shares, and the launcher that starts it.
//!
//! [`fit`] is the launcher: it checks the settings against the model, reads a checkpoint to
//! resume from, creates the group of ranks (one thread per device, joined through a
//! [`Collective`](crate::comm::Collective)) and starts one [`worker`] per rank. The loop
//! itself ([`worker`]) talks to the collective and to a [`Strategy`](crate::strategy::Strategy)
//! through their traits only: it draws each rank's samples, hands the micro-batches to the
//! strategy, asks it for the optimizer step, logs, validates and checkpoints. Only rank 0
//! writes files.

mod worker;

use std::ops::Range;
use std::path::PathBuf;

use burn::module::Module;
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::FloatDType;
use kiln_models::BlockStack;

use crate::checkpoint::{self, LoopState};
use crate::comm::{Processes, world_group};
use crate::config::{
    GroupConfig, MonitorConfig, OptimConfig, PipelineConfig, PrecisionConfig, RecomputeConfig,
    RecomputeMode, RootConfig, ScheduleConfig, StrategyKind, TrainConfig, name_of,
};
use crate::data::DistributedSampler;
use crate::error::{Error, Result};
use crate::metrics::Summary;
use crate::monitor::{MonitorSetup, SystemMonitor};
use crate::params::{FlatLayout, has_buffers};
use crate::precision::{self, LossScaler, is_mixed};
use crate::strategy::block_ids;

pub use worker::{FAULT_VAR, median};

/// A model and its data, as the trainer sees them; nothing here knows about devices beyond
/// the one it is handed.
pub trait Workload: Sync {
    /// The model type: its forward pass as a stem, blocks and a head (see [`BlockStack`]).
    type Model: Module + BlockStack<Self::Batch> + 'static;
    /// One batch, already on a device.
    type Batch;
    /// A freshly initialised model on `device` (weights are then replaced by rank 0's).
    fn init_model(&self, device: &Device) -> Self::Model;
    /// Number of training samples.
    fn train_len(&self) -> usize;
    /// The training batch of `indices` on `device`.
    fn train_batch(&self, indices: &[usize], device: &Device) -> Self::Batch;
    /// The training batch of `indices` for optimizer step `step`, for workloads whose batches
    /// carry random numbers of their own (a GAN's noise): drawn from the sample's index and
    /// the step, they are the same whatever the devices. Defaults to
    /// [`Workload::train_batch`].
    fn train_batch_at(&self, indices: &[usize], step: usize, device: &Device) -> Self::Batch {
        let _ = step;
        self.train_batch(indices, device)
    }
    /// Number of evaluation samples.
    fn eval_len(&self) -> usize;
    /// The evaluation batch of samples `range` on `device`.
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> Self::Batch;
    /// `batch` with its float inputs in `dtype` (the compute dtype of a lower precision).
    fn cast_batch(&self, batch: Self::Batch, dtype: FloatDType) -> Self::Batch;
    /// The samples rank `rank` of `world` trains on at global micro-step `micro_step`
    /// (`step × accumulate + micro`), `batch` of them, for workloads that draw their own (text
    /// windows from seed and step). `None`, the default, uses the epoch-shuffled sampler.
    fn sample(
        &self,
        micro_step: usize,
        rank: usize,
        world: usize,
        batch: usize,
    ) -> Option<Vec<usize>> {
        let _ = (micro_step, rank, world, batch);
        None
    }
    /// Tokens in one sample, for workloads that count throughput in tokens.
    fn tokens_per_sample(&self) -> Option<usize> {
        None
    }
    /// Training FLOPs (forward and backward) of one sample, for models that count them; the
    /// model FLOPs utilization (MFU) is logged when this and a peak FLOP/s are known.
    fn flops_per_sample(&self) -> Option<f64> {
        None
    }
    /// Every how many optimizer steps [`Workload::snapshot`] runs, and after the last step
    /// (`Some(0)`: after the last step only); `None`, the default, never.
    fn snapshot_every(&self) -> Option<usize> {
        None
    }
    /// Writes what the workload shows of the model at `step` (a grid of generated images,
    /// reconstructions) into `run_dir`; called on rank 0 with the whole model, its weights in
    /// f32.
    fn snapshot(&self, step: usize, model: &Self::Model, run_dir: &std::path::Path) -> Result<()> {
        let _ = (step, model, run_dir);
        Ok(())
    }
}

/// How the work is spread: devices, strategy, and the data-parallel knobs.
#[derive(Debug, Clone)]
pub struct ParallelSettings {
    /// One device per rank.
    pub devices: Vec<Device>,
    /// Accelerator name for the summary.
    pub accelerator: String,
    /// The strategy (resolved: `auto` is `single` for one device, `ddp` for more).
    pub strategy: StrategyKind,
    /// Size of one gradient bucket of the all-reduce, in MiB of f32.
    pub bucket_mb: f64,
    /// Synchronise BatchNorm batch statistics across ranks.
    pub sync_batchnorm: bool,
    /// Limit CPU ranks to their share of the cores (one rayon pool each).
    pub split_cpu_threads: bool,
    /// Stages and micro-batches (with the `pipeline` strategy).
    pub pipeline: PipelineConfig,
    /// The processes of the run (each runs `devices`).
    pub processes: Processes,
}

/// Where the run's output goes and how it is shown.
#[derive(Debug, Clone)]
pub struct OutputSettings {
    /// Where rank 0 writes metrics and checkpoints.
    pub run_dir: PathBuf,
    /// Checkpoint directory to continue from.
    pub resume_from: Option<PathBuf>,
    /// Metric sinks, the system monitor's interval, the peak FLOP/s and the smoothing.
    pub monitor: MonitorConfig,
    /// Show progress (a bar on a terminal, log lines otherwise) on rank 0.
    pub progress: bool,
}

/// What the loop needs besides the workload, one part per concern.
#[derive(Debug, Clone)]
pub struct TrainerSettings {
    /// Loop settings.
    pub train: TrainConfig,
    /// Optimizer settings.
    pub optim: OptimConfig,
    /// Learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Drop the last incomplete global batch of each epoch.
    pub drop_last: bool,
    /// Devices and strategy.
    pub parallel: ParallelSettings,
    /// Precision policy.
    pub precision: PrecisionConfig,
    /// Activation checkpointing.
    pub recompute: RecomputeConfig,
    /// Run directory, resume point, monitoring and display.
    pub output: OutputSettings,
    /// The optimizer and schedule of each parameter group (models with several optimizers).
    pub groups: std::collections::BTreeMap<String, GroupConfig>,
}

impl TrainerSettings {
    /// The settings `config` describes, for one rank per device of `devices`, writing into
    /// `run_dir`: a fresh run, without progress display (set `output.resume_from` and
    /// `output.progress` to change that).
    pub fn from_config(
        config: &RootConfig,
        devices: Vec<Device>,
        accelerator: String,
        run_dir: PathBuf,
    ) -> Self {
        let processes = crate::comm::processes();
        let strategy = config
            .strategy
            .name
            .resolve(devices.len() * processes.count);
        Self {
            train: config.train.clone(),
            optim: config.optim.clone(),
            schedule: config.schedule.clone(),
            seed: config.run.seed,
            drop_last: config.data.drop_last,
            parallel: ParallelSettings {
                split_cpu_threads: accelerator.starts_with("cpu"),
                devices,
                accelerator,
                strategy,
                bucket_mb: config.ddp.bucket_mb,
                sync_batchnorm: config.ddp.sync_batchnorm,
                pipeline: config.pipeline.clone(),
                processes: crate::comm::processes(),
            },
            precision: config.precision.clone(),
            recompute: config.recompute.clone(),
            output: OutputSettings {
                run_dir,
                resume_from: None,
                monitor: config.monitor.clone(),
                progress: false,
            },
            groups: config.groups.clone(),
        }
    }

    /// The optimizer of parameter group `name` (`[optim]` for a group the config omits).
    pub fn group_optim(&self, name: &str) -> &OptimConfig {
        self.groups.get(name).map_or(&self.optim, |g| &g.optim)
    }

    /// The schedule of parameter group `name` (`[schedule]` for a group the config omits).
    pub fn group_schedule(&self, name: &str) -> &ScheduleConfig {
        self.groups
            .get(name)
            .map_or(&self.schedule, |g| &g.schedule)
    }

    /// Number of ranks: this process's devices times the processes.
    pub fn world(&self) -> usize {
        self.parallel.devices.len() * self.parallel.processes.count
    }

    /// Pipeline stages per replica (1 unless the strategy is `pipeline`).
    pub fn stages(&self) -> usize {
        if self.parallel.strategy == StrategyKind::Pipeline {
            self.parallel.pipeline.stages
        } else {
            1
        }
    }

    /// Ranks that draw their own samples: the data-parallel degree (every rank, or one
    /// pipeline of `stages` ranks).
    pub fn data_world(&self) -> usize {
        self.world() / self.stages()
    }

    /// The data-parallel rank of `rank` (a pipeline's stages share one; a pipeline's ranks are
    /// consecutive).
    pub fn data_rank(&self, rank: usize) -> usize {
        rank / self.stages()
    }

    /// Micro-batches per optimizer step: the accumulation, times the pipeline's micro-batches.
    pub fn micro_batches(&self) -> usize {
        let per_flush = if self.parallel.strategy == StrategyKind::Pipeline {
            self.parallel.pipeline.microbatches
        } else {
            1
        };
        self.train.accumulate * per_flush
    }
}

/// How many optimizer steps a run of this length takes.
pub fn total_steps(train: &TrainConfig, steps_per_epoch: usize) -> usize {
    let by_epochs = train.epochs * steps_per_epoch;
    match train.max_steps {
        Some(max) if train.epochs == 0 => max,
        Some(max) => max.min(by_epochs),
        None => by_epochs,
    }
}

/// What the workers start from: rank 0's weights, where the loop stands, and the optimizer
/// state to continue.
pub(crate) struct Start {
    /// Every rank builds its own module and loads these weights into it, so that ranks share
    /// no Burn `RunningState`.
    pub weights: ModuleRecord,
    pub state: LoopState,
    /// By parameter group (`""` alone for a model with one optimizer).
    pub optim: Option<Vec<(String, crate::optim::OptimState)>>,
}

/// Trains `workload` as `settings` say and returns the summary and the final model.
pub fn fit<W: Workload>(workload: &W, settings: &TrainerSettings) -> Result<(Summary, W::Model)> {
    let world = settings.world();
    let t = &settings.train;
    let sampler = DistributedSampler::new(
        workload.train_len(),
        settings.seed,
        settings.data_world(),
        t.batch_size,
        settings.micro_batches(),
        settings.drop_last,
    );
    let spe = sampler.steps_per_epoch();
    if spe == 0 {
        return Err(Error::config(format!(
            "key `train.batch_size`: one step needs {} samples (batch {} × {} data-parallel \
             ranks × {} micro-batches) but the training set holds {} and data.drop_last is set",
            sampler.samples_per_step(),
            t.batch_size,
            settings.data_world(),
            settings.micro_batches(),
            workload.train_len()
        )));
    }
    let total = total_steps(t, spe);
    let p = &settings.parallel;
    for (i, device) in p.devices.iter().enumerate() {
        let label = match device.identity() {
            Some(who) => format!("{i} ({})", who.name),
            None => format!("{i} ({})", p.accelerator),
        };
        precision::check_device(&settings.precision, device, &label)?;
    }
    let run_dir = &settings.output.run_dir;
    let first_process = p.processes.index == 0;
    if first_process {
        std::fs::create_dir_all(run_dir).map_err(|e| Error::io(run_dir, e))?;
    }

    // Rank 0's initial weights (or the checkpoint's) are what every rank starts from.
    let main_device = p.devices[0].clone().autodiff();
    // Seeding and initialisation happen under kiln-models' random-number lock, so that runs
    // sharing the process cannot interleave their draws.
    let mut initial = kiln_models::with_rng(|| {
        main_device.seed(settings.seed);
        kiln_models::materialized(workload.init_model(&main_device))
    });
    let mut state = LoopState {
        step: 0,
        epoch: 0,
        step_in_epoch: 0,
        seed: settings.seed,
        world_size: world,
        samples_per_step: sampler.samples_per_step(),
        lr: 0.0,
        samples: 0,
        wall_seconds: 0.0,
        scaler: settings.precision.uses_scaler().then(|| {
            LossScaler::new(
                settings.precision.init_scale,
                settings.precision.growth_interval,
            )
        }),
    };
    check_policies::<W::Batch, _>(&initial, settings)?;
    let mut optim = None;
    if let Some(dir) = &settings.output.resume_from {
        // Checkpoint writers killed mid-write leave temporary directories; they go now.
        if first_process {
            let removed = checkpoint::remove_stale(run_dir)?;
            if !removed.is_empty() {
                println!(
                    "removed {} temporary checkpoint director{} that a killed writer left: {}",
                    removed.len(),
                    if removed.len() == 1 { "y" } else { "ies" },
                    removed
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        let saved = checkpoint::read_state(dir)?;
        if saved.samples_per_step != sampler.samples_per_step() {
            return Err(Error::checkpoint(format!(
                "{}: checkpoint took {} samples per step, this run takes {} (batch × devices × \
                 accumulation must match to continue the same data order)",
                dir.display(),
                saved.samples_per_step,
                sampler.samples_per_step()
            )));
        }
        initial = checkpoint::load_model(dir, initial)?;
        // Fail before the workers start if an optimizer state does not fit the model.
        let groups = kiln_models::TrainStep::<W::Batch>::param_groups(&initial);
        let parts: Vec<(String, FlatLayout, String)> = if groups.is_empty() {
            let layout = FlatLayout::new(&initial, &block_ids(&initial), 1);
            vec![(String::new(), layout, "optim.name".to_string())]
        } else {
            groups
                .iter()
                .map(|g| {
                    let layout = FlatLayout::of_params(&initial, &g.params, 1);
                    (
                        g.name.clone(),
                        layout,
                        format!("groups.{}.optim.name", g.name),
                    )
                })
                .collect()
        };
        let mut states = Vec::with_capacity(parts.len());
        for (group, layout, key) in parts {
            let loaded = checkpoint::load_group_optimizer(dir, &group)?;
            let file = dir.join(checkpoint::optim_file(&group));
            loaded.leaves(&layout).map_err(|e| match e {
                Error::Checkpoint(m) => Error::checkpoint(format!("{}: {m}", file.display())),
                other => other,
            })?;
            let wanted = settings.group_optim(&group).name;
            if loaded.kind != wanted {
                return Err(Error::checkpoint(format!(
                    "{}: the optimizer state is {}'s, but {key} = {:?}",
                    file.display(),
                    name_of(&loaded.kind),
                    name_of(&wanted)
                )));
            }
            states.push((group, loaded));
        }
        optim = Some(states);
        let fresh = state.scaler.take();
        state = saved;
        state.seed = settings.seed;
        // A checkpoint of a run without a scaler continues with a fresh one, and a run that
        // no longer scales drops it.
        let saved = state.scaler.take();
        state.scaler = fresh.map(|fresh| saved.unwrap_or(fresh));
        state.world_size = world;
    }

    // Rank 0 drains the system monitor into the sinks; dropping it stops the thread, on
    // failure too.
    let monitor = (first_process && settings.output.monitor.interval_s > 0.0).then(|| {
        SystemMonitor::start(MonitorSetup {
            interval: std::time::Duration::from_secs_f64(settings.output.monitor.interval_s),
            devices: p.devices.clone(),
            cpu_replicas: p.split_cpu_threads && world > 1,
            gpu: settings.output.monitor.gpu,
        })
    });
    if let Some(notice) = monitor.as_ref().and_then(SystemMonitor::notice)
        && settings.output.progress
    {
        println!("{notice}");
    }

    let start = Start {
        weights: initial.into_record(),
        state,
        optim,
    };
    let comms = world_group(p.devices.len())?;
    worker::run_all(
        workload,
        settings,
        &sampler,
        total,
        comms,
        &start,
        monitor.as_ref(),
    )
}

/// Rejects precision, recompute and strategy settings that cannot work with `model`, before
/// any worker starts.
fn check_policies<B, M: BlockStack<B> + Module>(model: &M, s: &TrainerSettings) -> Result<()> {
    check_groups(model, s)?;
    if is_mixed(s.precision.mode) && has_buffers(model) {
        return Err(Error::config(format!(
            "key `precision.mode`: {:?} keeps f32 master weights apart from a low-precision \
             copy, but this model has buffers (BatchNorm running statistics), which Burn shares \
             between the two and updates in the compute dtype; use precision \"32\" or a \
             \"-true\" precision, or a model without BatchNorm",
            name_of(&s.precision.mode)
        )));
    }
    if model.num_blocks() == 0 {
        let needs = if s.parallel.strategy == StrategyKind::Zero3 {
            Some((
                "strategy.name",
                "\"zero3\" gathers the model block by block",
                "use strategy \"zero2\"",
            ))
        } else if s.parallel.sync_batchnorm && s.world() > 1 {
            Some((
                "ddp.sync_batchnorm",
                "synchronised BatchNorm cuts the model around the norms of its blocks",
                "turn ddp.sync_batchnorm off",
            ))
        } else {
            None
        };
        if let Some((key, why, instead)) = needs {
            return Err(Error::config(format!(
                "key `{key}`: {why}, but this model describes no blocks (its BlockStack's \
                 num_blocks is 0); describe the blocks, or {instead}"
            )));
        }
    }
    if s.parallel.strategy == StrategyKind::Pipeline {
        let layout = FlatLayout::new(model, &block_ids(model), 1);
        crate::strategy::pipeline::stage_elements(
            &layout,
            s.parallel.pipeline.stages,
            s.parallel.pipeline.cuts.as_deref(),
        )?;
    }
    let blocks_recomputed =
        s.recompute.mode == RecomputeMode::Blocks || s.parallel.strategy == StrategyKind::Zero3;
    if s.recompute.mode == RecomputeMode::Blocks && model.num_blocks() == 0 {
        return Err(Error::config(
            "key `recompute.mode`: \"blocks\" recomputes the model's blocks, but this model \
             has none; use \"balanced\" or \"none\""
                .to_string(),
        ));
    }
    if blocks_recomputed && !model.blocks_deterministic() {
        let key = if s.recompute.mode == RecomputeMode::Blocks {
            "key `recompute.mode`: \"blocks\" runs"
        } else {
            "key `strategy.name`: \"zero3\" recomputes each block in its backward, which runs"
        };
        return Err(Error::config(format!(
            "{key} each block twice and needs both runs to agree, but this model draws random \
             numbers in its blocks (dropout > 0); set the model's dropout to 0{}",
            if s.recompute.mode == RecomputeMode::Blocks {
                " or use recompute \"balanced\""
            } else {
                " or use strategy \"zero2\""
            }
        )));
    }
    Ok(())
}

/// Checks a model's parameter groups (if it has any) against the settings: names that the
/// config knows, every trainable parameter in exactly one group, and only what a step with
/// several optimizers can run.
fn check_groups<B, M: BlockStack<B> + Module>(model: &M, s: &TrainerSettings) -> Result<()> {
    let groups = model.param_groups();
    let names: Vec<&str> = groups.iter().map(|g| g.name.as_str()).collect();
    if groups.is_empty() {
        if let Some(name) = s.groups.keys().next() {
            return Err(Error::config(format!(
                "key `groups.{name}`: this model steps one optimizer and has no parameter groups \
                 (its TrainStep::param_groups is empty); configure it in [optim]"
            )));
        }
        return Ok(());
    }
    for name in s.groups.keys() {
        if !names.contains(&name.as_str()) {
            return Err(Error::config(format!(
                "key `groups.{name}`: the model has no parameter group {name:?} (its groups: {})",
                names.join(", ")
            )));
        }
    }
    let trainable = crate::params::trainable_params(model);
    let mut owner: std::collections::HashMap<burn::module::ParamId, &str> = Default::default();
    for g in &groups {
        if !crate::config::is_group_name(&g.name) {
            return Err(Error::config(format!(
                "parameter group {:?}: a group name is lower-case letters, digits, `_` and `-`",
                g.name
            )));
        }
        if names.iter().filter(|n| **n == g.name).count() > 1 {
            return Err(Error::config(format!(
                "parameter group {:?} is named twice in TrainStep::param_groups",
                g.name
            )));
        }
        for id in &g.params {
            let Some((_, path, _)) = trainable.iter().find(|(t, _, _)| t == id) else {
                continue;
            };
            if let Some(other) = owner.insert(*id, &g.name) {
                return Err(Error::config(format!(
                    "parameter `{path}` is in parameter groups {other:?} and {:?}; each \
                     parameter belongs to one optimizer",
                    g.name
                )));
            }
        }
    }
    if let Some((_, path, _)) = trainable.iter().find(|(id, _, _)| !owner.contains_key(id)) {
        return Err(Error::config(format!(
            "parameter `{path}` is trainable but in no parameter group ({}); add it to one, or \
             freeze it",
            names.join(", ")
        )));
    }
    let refuse = |key: &str, what: String, instead: &str| {
        Err(Error::config(format!(
            "key `{key}`: {what}, but this model steps {} optimizers ({}); {instead}",
            groups.len(),
            names.join(", ")
        )))
    };
    match s.parallel.strategy {
        StrategyKind::Auto | StrategyKind::Single | StrategyKind::Ddp => {}
        other => {
            return refuse(
                "strategy.name",
                format!(
                    "{:?} shards or splits one optimizer's step",
                    name_of(&other)
                ),
                "use \"ddp\" or \"single\"",
            );
        }
    }
    if s.recompute.mode == RecomputeMode::Blocks {
        return refuse(
            "recompute.mode",
            "\"blocks\" walks one loss block by block".into(),
            "use \"balanced\" or \"none\"",
        );
    }
    if s.parallel.sync_batchnorm && s.world() > 1 {
        return refuse(
            "ddp.sync_batchnorm",
            "synchronised BatchNorm walks one loss block by block".into(),
            "turn it off",
        );
    }
    if s.precision.uses_scaler() {
        return refuse(
            "precision.mode",
            "\"16-mixed\" scales one loss with one dynamic scaler".into(),
            "use \"bf16-mixed\" or \"32\"",
        );
    }
    Ok(())
}

/// The float values of a module's parameters and buffers, one vector per tensor, for
/// comparing runs (kept here for callers of the trainer).
pub use crate::params::parameter_values;
