//! The training loop every strategy shares, and the launcher that starts it.
//!
//! [`fit`] is the launcher: it checks the settings and the model against the strategy's rules,
//! reads a checkpoint to resume from (`start.rs`), creates the group of ranks (one thread per
//! device, joined through a [`Collective`](crate::comm::Collective)) and starts one worker per
//! rank. The loop itself (`worker.rs`) is a step (`train_step`) and the components that decide
//! when they are due and act on the loop's [`LoopState`](crate::state::LoopState):
//! logging (`log.rs`), validation (`validate.rs`), checkpoints and snapshots
//! (`checkpointer.rs`), and the agreement on a stop signal. It talks to the collective and to a
//! [`Strategy`](crate::strategy::Strategy) through their traits only. Only rank 0 writes files.

mod checkpointer;
mod checks;
mod loader;
mod log;
mod plateau;
mod settings;
mod start;
mod validate;
mod worker;

use std::ops::Range;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::BlockStack;

use std::time::Duration;

use crate::comm::watch::WatchConfig;
use crate::comm::world_group;
use crate::config::TrainConfig;
use crate::data::DistributedSampler;
use crate::error::{Error, Result};
use crate::metrics::Summary;
use crate::monitor::{MonitorSetup, SystemMonitor};

pub use settings::{OutputSettings, ParallelSettings, TrainerSettings};
pub(crate) use start::same_samples_per_step;
pub(crate) use worker::loader_fault;
pub use worker::{FAULT_VAR, median};

/// A model and its data, as the trainer sees them; nothing here knows about devices beyond
/// the one it is handed.
pub trait Workload: Sync {
    /// The model type: its forward pass as a stem, blocks and a head (see [`BlockStack`]).
    type Model: Module + BlockStack<Self::Batch> + 'static;
    /// One batch, already on a device (loader threads build it and hand it to the rank,
    /// hence `Send`; Burn's tensors are).
    type Batch: Send;
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
    /// The training batch of `indices` for step `step`, for data that can fail to load (a
    /// file that does not decode): its error ends the run, naming the file, like any rank's
    /// failure. This is what the trainer calls, on the rank's thread or on a loader thread
    /// (`data.workers`); it must be a function of its arguments (and of
    /// [`sample_rng`](crate::data::sample_rng)), so that any number of workers gives the same
    /// bits. Defaults to [`Workload::train_batch_at`].
    fn try_train_batch(
        &self,
        indices: &[usize],
        step: usize,
        device: &Device,
    ) -> Result<Self::Batch> {
        Ok(self.train_batch_at(indices, step, device))
    }
    /// Number of evaluation samples.
    fn eval_len(&self) -> usize;
    /// The evaluation batch of samples `range` on `device`.
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> Self::Batch;
    /// The evaluation batch of `range`, for data that can fail to load. Defaults to
    /// [`Workload::eval_batch`].
    fn try_eval_batch(&self, range: Range<usize>, device: &Device) -> Result<Self::Batch> {
        Ok(self.eval_batch(range, device))
    }
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
    /// The learning rate of optimizer step `step` (0-based) for parameter group `group` (0
    /// for a model with one optimizer), given `scheduled`, the rate `[schedule]` gives it: a
    /// schedule of the workload's own, as any function of the step. It must depend on its
    /// arguments only, so that a resumed run steps with the same rates. Defaults to
    /// `scheduled`.
    fn lr(&self, group: usize, step: usize, scheduled: f64) -> f64 {
        let _ = (group, step);
        scheduled
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
    /// Rows of the start-up table that describe the workload (`("data", "…")`), after
    /// kiln's own; none by default.
    fn describe(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Drop the last incomplete global batch of an epoch instead of wrapping around to the
    /// epoch's first samples (a program's own `data.drop_last`); `false` by default.
    fn drop_last(&self) -> bool {
        false
    }
    /// The events [`Workload::on_event`] is called for; none, the default.
    fn events(&self) -> &[EventKind] {
        &[]
    }
    /// A callback: called on rank 0 at each event of [`Workload::events`] with what was just
    /// logged and the whole model (its weights in f32, in evaluation mode). An error ends the
    /// run like any rank's failure.
    fn on_event(&self, event: &Event<'_>, model: &Self::Model) -> Result<()> {
        let _ = (event, model);
        Ok(())
    }
    /// Writes what the workload shows of the model at `step` (a grid of generated images,
    /// reconstructions) into `run_dir`; called on rank 0 with the whole model, its weights in
    /// f32.
    fn snapshot(&self, step: usize, model: &Self::Model, run_dir: &std::path::Path) -> Result<()> {
        let _ = (step, model, run_dir);
        Ok(())
    }
}

/// When a workload's callback runs ([`Workload::on_event`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// After a step whose training metrics were logged (every `train.log_every` steps and
    /// the last).
    Logged,
    /// After a validation.
    Validated,
    /// After the last step of an epoch (and its validation).
    EpochEnd,
}

/// What a workload's callback sees.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    /// Which event.
    pub kind: EventKind,
    /// Optimizer steps taken.
    pub step: usize,
    /// The epoch of the step.
    pub epoch: usize,
    /// The values just logged, means over the ranks: after a logged step `loss`, `lr`,
    /// `samples_per_sec` and the step's named metrics; after a validation `loss`, `accuracy`
    /// (for a model that counts correct predictions) and its named and whole-set metrics;
    /// nothing at an epoch's end.
    pub metrics: &'a [(String, f64)],
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

/// The sampler of a run: every data-parallel rank's samples of every step. A step that needs
/// more samples than the set holds (with `drop_last`) is an error naming the batch.
pub fn sampler(train_len: usize, settings: &TrainerSettings) -> Result<DistributedSampler> {
    let t = &settings.train;
    let sampler = DistributedSampler::new(
        train_len,
        settings.seed,
        settings.data_world(),
        t.batch_size,
        settings.micro_batches(),
        settings.drop_last,
    );
    if sampler.steps_per_epoch() == 0 {
        return Err(Error::config(format!(
            "key `train.batch_size`: one step needs {} samples (batch {} × {} data-parallel \
             ranks × {} micro-batches) but the training set holds {train_len} and \
             data.drop_last is set",
            sampler.samples_per_step(),
            t.batch_size,
            settings.data_world(),
            settings.micro_batches(),
        )));
    }
    Ok(sampler)
}

/// Trains `workload` as `settings` say and returns the summary and the final model: [`check`],
/// then [`fit_checked`].
pub fn fit<W: Workload>(workload: &W, settings: &TrainerSettings) -> Result<(Summary, W::Model)> {
    let checked = check(workload, settings)?;
    fit_checked(workload, settings, checked)
}

/// [`fit`] for a launcher that has run [`check`] on these settings already (before it created
/// the run directory): the refusals and the start-up probe do not run twice.
pub fn fit_checked<W: Workload>(
    workload: &W,
    settings: &TrainerSettings,
    checked: Checked,
) -> Result<(Summary, W::Model)> {
    let setup = settings.setup();
    let sampler = checked.sampler;
    let total = total_steps(&settings.train, sampler.steps_per_epoch());
    let p = &settings.parallel;
    let run_dir = &settings.output.run_dir;
    let first_process = p.processes.index == 0;
    if first_process {
        std::fs::create_dir_all(run_dir).map_err(|e| Error::io(run_dir, e))?;
    }
    let start = start::prepare(workload, settings, &setup, &sampler, checked.draws)?;

    // Rank 0 drains the system monitor into the sinks; dropping it stops the thread, on
    // failure too.
    let monitor = (first_process && settings.output.monitor.interval_s > 0.0).then(|| {
        SystemMonitor::start(MonitorSetup {
            interval: std::time::Duration::from_secs_f64(settings.output.monitor.interval_s),
            devices: p.devices.clone(),
            cpu_replicas: p.split_cpu_threads && settings.world() > 1,
            gpu: settings.output.monitor.gpu,
        })
    });
    if let Some(notice) = monitor.as_ref().and_then(SystemMonitor::notice)
        && settings.output.progress
    {
        say!("{notice}");
    }
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

/// A run that passed [`check`]: its sampler, and whether its model draws random numbers in
/// a training forward.
pub struct Checked {
    sampler: DistributedSampler,
    draws: bool,
}

impl Checked {
    /// Samples per optimizer step over all data-parallel ranks.
    pub fn samples_per_step(&self) -> usize {
        self.sampler.samples_per_step()
    }
}

/// What [`fit`] refuses of `settings` and of `workload`'s model — the strategy's, the
/// sampler's, the devices', the model's and the start-up probe's refusals — checked without
/// writing anything: a launcher calls it before it creates the run directory, so that a
/// refused run leaves nothing behind, and hands the result to [`fit_checked`].
pub fn check<W: Workload>(workload: &W, settings: &TrainerSettings) -> Result<Checked> {
    let setup = settings.setup();
    setup.check()?;
    let sampler = sampler(workload.train_len(), settings)?;
    let p = &settings.parallel;
    for (i, device) in p.devices.iter().enumerate() {
        let label = match device.identity() {
            Some(who) => format!("{i} ({})", who.name),
            None => format!("{i} ({})", p.accelerator),
        };
        setup.policy.check_device(device, &label)?;
    }
    let device = p.devices[0].clone().autodiff();
    // Materialised under the lock: a parameter Burn initialises lazily, later, outside it,
    // would draw from the process-wide random state while another run seeds its own model.
    let model = kiln_models::with_rng(|| kiln_models::materialized(workload.init_model(&device)));
    checks::check_model::<W::Batch, _>(&model, settings, &setup)?;
    let draws = start::probe(workload, settings, &setup)?;
    Ok(Checked { sampler, draws })
}

/// How `settings` ask the collectives to be watched.
pub(super) fn watch_config(settings: &TrainerSettings) -> WatchConfig {
    let d = &settings.parallel.dist;
    let seconds = |s: f64| (s > 0.0).then(|| Duration::from_secs_f64(s));
    WatchConfig {
        timeout: seconds(d.timeout_s),
        startup_timeout: seconds(d.startup_timeout_s),
        entries: d.flight_entries,
        check: d.check_collectives,
        flight_dir: Some(settings.output.run_dir.join("flight")),
        process: settings.parallel.processes.index,
    }
}

/// The float values of a module's parameters and buffers, one vector per tensor, for
/// comparing runs (kept here for callers of the trainer).
pub use crate::params::parameter_values;
