//! The launcher of the loop: [`check`] refuses what cannot run before anything is written,
//! [`fit_checked`] prepares the start, the monitor and the world group and runs the ranks.

use super::checks;
use super::ranks::run_all;
use super::settings::TrainerSettings;
use super::start;
use super::workload::Workload;
use crate::comm::world_group;
use crate::config::TrainConfig;
use crate::data::DistributedSampler;
use crate::error::{Error, Result};
use crate::metrics::Summary;
use crate::monitor::{MonitorSetup, SystemMonitor};

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
    crate::heap::keep_freed_pages();
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
    release_device_pages(&p.devices);

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
    // What the start-up freed on this thread (the probe's model, rank 0's weights read) goes
    // back to the system before the ranks start; the peaks counted from here are the
    // training's, not the planner's probes' (the peak before is kept for the summary).
    crate::heap::release_free();
    crate::monitor::restart_resident_peak();
    crate::heap::reset_peak();
    run_all(
        workload,
        settings,
        &sampler,
        total,
        comms,
        &start,
        monitor.as_ref(),
    )
}

/// Hands back to each of `devices` the pages its pools hold with nothing live on them, before
/// the ranks start. A GPU runtime's pools are per thread: the start-up's checks, its forward
/// and the planner's probes ran on threads of their own, and the pages they took stayed
/// reserved beside the ranks' own for the whole run (on WGPU, the GPU recipe at batch 4 held
/// 1,626 MiB for 433 in use; 561 with them handed back). The CPU keeps no pool: nothing
/// happens there.
fn release_device_pages(devices: &[burn::tensor::Device]) {
    for (i, device) in devices.iter().enumerate() {
        if devices[..i].contains(device) || device.memory_pool_usage().is_none() {
            continue;
        }
        // This thread's queued work done first (Burn syncs the calling thread's stream); a
        // page that work another thread left queued still holds stays.
        if device.sync().is_ok() {
            device.memory_cleanup();
        }
    }
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

    /// Whether the model draws random numbers in a training forward (its forwards are then
    /// seeded, one at a time).
    pub fn draws(&self) -> bool {
        self.draws
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
    checks::check_tp_draws::<W::Batch, _>(&model, &setup, draws)?;
    Ok(Checked { sampler, draws })
}

/// What [`check`] refuses of `settings` for `model` (one of `workload`'s), without the
/// devices' checks and the start-up probe: the planner weighs its candidates with it.
pub fn refusal<W: Workload>(
    workload: &W,
    model: &W::Model,
    settings: &TrainerSettings,
) -> Result<()> {
    let setup = settings.setup();
    setup.check()?;
    sampler(workload.train_len(), settings)?;
    checks::check_model::<W::Batch, _>(model, settings, &setup)
}
