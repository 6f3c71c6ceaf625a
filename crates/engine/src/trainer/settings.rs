//! What the loop needs besides the workload, one part per concern, and what it derives from
//! them: the strategy's [`Setup`], the data-parallel degree, the micro-batches of a step.

use std::path::PathBuf;

use burn::prelude::*;

use crate::comm::Processes;
use crate::comm::watch::WatchConfig;
use crate::config::{
    DdpConfig, DistConfig, GroupConfig, LoaderConfig, MonitorConfig, OptimConfig, PipelineConfig,
    PrecisionConfig, RecomputeConfig, RootConfig, ScheduleConfig, StrategyKind, TrainConfig,
};
use crate::precision::Policy;
use crate::strategy::Setup;

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
    /// The mesh's tensor-parallel ranks per group and the data-parallel replicas asked
    /// (`[parallel]`).
    pub mesh: crate::config::ParallelConfig,
    /// Stages and micro-batches (with the `pipeline` strategy).
    pub pipeline: PipelineConfig,
    /// The outer loop (with the `diloco` strategy).
    pub diloco: crate::config::DilocoConfig,
    /// The processes of the run (each runs `devices`).
    pub processes: Processes,
    /// Deadlines, flight records, collective checks and stragglers.
    pub dist: DistConfig,
    /// Ranks each of the user's devices runs as (CPU per-core sub-replicas,
    /// `cores.rs`); 1 otherwise.
    pub sub_replicas: usize,
    /// What the start-up table says of how CPU devices use their cores.
    pub cores: Option<String>,
    /// The cores CPU ranks share (`hardware.cpu_cores`, or the machine's).
    pub cpu_cores: usize,
    /// `hardware.memory_limit_mib` where it bounds the process's resident memory (on the CPU;
    /// on a GPU it bounds each device's memory, and is `None` here): what a run keeps under
    /// ([`crate::heap::hold_under`]).
    pub memory_limit_mib: Option<f64>,
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
    /// Drop the last incomplete global batch of each epoch (`false` from a config: the
    /// program's data says, [`RunInfo::drop_last`](crate::RunInfo::drop_last)).
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
    /// Loader threads per rank and how far ahead they build (`data.workers`,
    /// `data.prefetch`).
    pub loader: LoaderConfig,
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
        let strategy = config.strategy_on(devices.len() * processes.count);
        let cpu = accelerator.starts_with("cpu");
        Self {
            train: config.train.clone(),
            optim: config.optim.clone(),
            schedule: config.schedule.clone(),
            seed: config.run.seed,
            drop_last: false,
            parallel: ParallelSettings {
                split_cpu_threads: cpu,
                devices,
                accelerator,
                strategy,
                bucket_mb: config.ddp.bucket_mb,
                sync_batchnorm: config.ddp.sync_batchnorm,
                mesh: config.parallel.clone(),
                pipeline: config.pipeline.clone(),
                diloco: config.diloco.clone(),
                processes,
                dist: config.dist.clone(),
                sub_replicas: 1,
                cores: None,
                cpu_cores: config.hardware.cores(),
                memory_limit_mib: config.hardware.memory_limit_mib.filter(|_| cpu),
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
            loader: config.loader,
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

    /// What the strategy is checked, described and built with.
    pub fn setup(&self) -> Setup {
        let p = &self.parallel;
        Setup {
            kind: p.strategy,
            rules: crate::strategy::rules(p.strategy),
            dimensions: &crate::strategy::DIMENSIONS,
            world: (self.world() / self.tp()).max(1),
            tp: self.tp(),
            ranks: self.world(),
            dp: p.mesh.dp,
            policy: Policy::new(&self.precision),
            recompute: self.recompute.clone(),
            ddp: DdpConfig {
                bucket_mb: p.bucket_mb,
                sync_batchnorm: p.sync_batchnorm,
            },
            own: crate::strategy::Own::of(p.strategy, &p.pipeline, &p.diloco),
            overlap: p.dist.overlap.resolve(p.processes.count),
        }
    }

    /// Ranks of one tensor-parallel group (1: none).
    pub fn tp(&self) -> usize {
        self.parallel.mesh.tp.max(1)
    }

    /// Ranks per replica of the model: a pipeline's stages times a tensor-parallel group's
    /// ranks (1 for plain data parallelism).
    pub fn stages(&self) -> usize {
        self.setup().stages() * self.tp()
    }

    /// Ranks that draw their own samples: the data-parallel degree (every rank, or one
    /// replica of `stages` ranks).
    pub fn data_world(&self) -> usize {
        self.world() / self.stages()
    }

    /// The data-parallel rank of `rank` (the ranks of one replica — a pipeline's stages, a
    /// tensor-parallel group — share one, and are consecutive).
    pub fn data_rank(&self, rank: usize) -> usize {
        rank / self.stages()
    }

    /// The data-parallel degree the user asked for: [`TrainerSettings::data_world`] with a
    /// device's per-core sub-replicas counted as the one device they are (learning-rate
    /// scaling and the summary count devices, not cores).
    pub fn device_data_world(&self) -> usize {
        self.data_world() / self.parallel.sub_replicas.max(1)
    }

    /// How these settings ask the collectives to be watched.
    pub fn watch_config(&self) -> WatchConfig {
        let d = &self.parallel.dist;
        let seconds = |s: f64| (s > 0.0).then(|| std::time::Duration::from_secs_f64(s));
        WatchConfig {
            timeout: seconds(d.timeout_s),
            startup_timeout: seconds(d.startup_timeout_s),
            entries: d.flight_entries,
            check: d.check_collectives,
            flight_dir: Some(self.output.run_dir.join("flight")),
            process: self.parallel.processes.index,
        }
    }

    /// Micro-batches per optimizer step: the accumulation, times a pipeline's micro-batches.
    pub fn micro_batches(&self) -> usize {
        self.train.accumulate * self.setup().flush()
    }
}
