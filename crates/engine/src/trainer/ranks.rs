//! The ranks of this process: one worker thread each, started together, waited for with a
//! clock, their results reduced to the failure that started it all or rank 0's summary.

use std::time::Duration;

use super::faults::is_abort_echo;
use super::settings::TrainerSettings;
use super::start::Start;
use super::worker::{Outcome, Place, Steps, Worker};
use super::workload::Workload;
use crate::comm::Collective;
use crate::comm::watch::{Watchdog, watched};
use crate::config::RecomputeMode;
use crate::data::DistributedSampler;
use crate::error::{Error, Result};
use crate::metrics::Summary;
use crate::monitor::SystemMonitor;
use crate::optim::{Schedule, scaled_lr};

/// Starts one worker thread per rank of `comms`, waits for all of them and returns rank 0's
/// summary (with every rank's memory figures) and final model, or the error that started a
/// failure.
pub(super) fn run_all<W: Workload>(
    workload: &W,
    settings: &TrainerSettings,
    sampler: &DistributedSampler,
    total: usize,
    comms: Vec<Box<dyn Collective>>,
    start: &Start,
    monitor: Option<&SystemMonitor>,
) -> Result<(Summary, W::Model)> {
    // Every collective of the run is numbered, recorded and watched against its deadline.
    let (comms, watchdog) = watched(comms, settings.watch_config(), crate::comm::remote());
    let watchdog = &watchdog;
    let setup = settings.setup();
    let schedules = schedules(settings, &start.groups, total);
    let results: Vec<Result<Outcome<W::Model>>> = std::thread::scope(|scope| {
        // Each worker says when it returns, so that the wait below ends at once.
        let (finished, returns) = std::sync::mpsc::channel::<()>();
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(local, comm)| {
                let rank = comm.rank();
                let base = settings.parallel.devices[local].clone().autodiff();
                let worker = Worker {
                    workload,
                    settings,
                    policy: setup.policy.clone(),
                    setup: setup.clone(),
                    steps: Steps {
                        groups: start.groups.clone(),
                        sampler: sampler.clone(),
                        schedules: schedules.clone(),
                        micros: settings.micro_batches(),
                        total,
                    },
                    place: Place {
                        comm,
                        recorder: watchdog.recorder(local),
                        local,
                        device: match settings.recompute.mode {
                            RecomputeMode::Balanced => base.gradient_checkpointing(),
                            _ => base,
                        },
                        data_rank: settings.data_rank(rank),
                        data_world: settings.data_world(),
                    },
                    monitor: monitor.filter(|_| rank == 0),
                    draws: start.draws,
                };
                let finished = finished.clone();
                std::thread::Builder::new()
                    .name(format!("kiln-worker-{rank}"))
                    .spawn_scoped(scope, move || {
                        let outcome = worker.run_guarded(start);
                        let _ = finished.send(());
                        outcome
                    })
                    .expect("spawn a worker thread")
            })
            .collect();
        drop(finished);
        wait_or_exit(&handles, &returns, watchdog);
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Worker("a worker thread died".into())))
            })
            .collect()
    });

    // Report the failure that started it all, not the ranks it aborted.
    let mut lead = None;
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(out) => {
                if out.lead.is_some() {
                    lead = out.lead;
                }
            }
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        let origin = errors.iter().position(|e| !is_abort_echo(e)).unwrap_or(0);
        return Err(errors.swap_remove(origin));
    }
    lead.ok_or_else(|| Error::Worker("the process's first rank returned no result".into()))
}

/// Seconds a worker has to return after the run began to fail (a deadline, another rank's
/// failure) before the process ends without it.
const GRACE: Duration = Duration::from_secs(5);

/// Waits for every worker thread. A worker that has not returned [`GRACE`] after the run began
/// to fail is stuck where nothing can reach it (a hung rank): the process then ends with the
/// run's error line, exit code 2, rather than wait forever.
fn wait_or_exit<T>(
    handles: &[std::thread::ScopedJoinHandle<'_, T>],
    returns: &std::sync::mpsc::Receiver<()>,
    watchdog: &Watchdog,
) {
    let mut returned = 0;
    while returned < handles.len() {
        if let Some((since, why)) = watchdog.failed()
            && since > GRACE
        {
            let stuck: Vec<String> = handles
                .iter()
                .enumerate()
                .filter(|(_, h)| !h.is_finished())
                .map(|(local, _)| format!("rank {}", watchdog.recorder(local).rank()))
                .collect();
            eprintln!(
                "error: {why}; {} did not stop within {} s of it, so the process ends",
                stuck.join(", "),
                GRACE.as_secs()
            );
            std::process::exit(crate::error::failure_code());
        }
        match returns.recv_timeout(Duration::from_millis(50)) {
            Ok(()) => returned += 1,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            // Every worker is gone (one that died without a word is reported by its join).
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
}

/// One learning-rate schedule per optimizer (per parameter group, or one).
fn schedules(settings: &TrainerSettings, groups: &[String], total: usize) -> Vec<Schedule> {
    let phases = groups.len().max(1);
    (0..phases)
        .map(|g| {
            let name = groups.get(g).map_or("", String::as_str);
            let optim = settings.group_optim(name);
            let peak = scaled_lr(
                optim,
                settings.device_data_world(),
                settings.micro_batches(),
            );
            Schedule::new(peak, settings.group_schedule(name), total)
        })
        .collect()
}
