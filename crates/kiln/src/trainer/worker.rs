//! One rank's loop: a step, then whatever is due (a log line, validation, a checkpoint, a
//! snapshot, a stop). It talks to its [`Strategy`] and its [`Collective`] through their
//! traits only.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::prelude::*;
use kiln_models::StepOutput;

use super::checkpointer::Checkpointer;
use super::loader::{Feed, Plan};
use super::log::{Logger, LoggerParts, Scores, Times};
use super::plateau;
use super::start::Start;
use super::validate::Validator;
use super::{EventKind, TrainerSettings, Workload};
use crate::checkpoint;
use crate::comm::watch::{Recorder, Watchdog, watched};
use crate::comm::{Collective, pack};
use crate::config::{RecomputeMode, name_of};
use crate::data::DistributedSampler;
use crate::error::{Error, Result};
use crate::exec::draws;
use crate::metrics::{MetricsWriter, Progress, Summary};
use crate::monitor::{SystemMonitor, Throughput, peak_tflops, process_memory_mib};
use crate::optim::{Schedule, scaled_lr};
use crate::precision::Policy;
use crate::state::LoopState;
use crate::state::Plateau;
use crate::strategy::{self, Context, Setup, Strategy};

const ABORTED: &str = "stopped because ";

/// What a rank hands back: on the first rank of each process, the summary and the final model.
struct Outcome<M> {
    lead: Option<(Summary, M)>,
}

/// Whether `e` is a rank's report that another rank aborted the group.
fn is_abort_echo(e: &Error) -> bool {
    matches!(e, Error::Worker(m) if m.starts_with(ABORTED))
}

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
    let (comms, watchdog) = watched(comms, super::watch_config(settings), crate::comm::remote());
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
                    groups: start.groups.clone(),
                    sampler: sampler.clone(),
                    schedules: schedules.clone(),
                    micros: settings.micro_batches(),
                    data_rank: settings.data_rank(rank),
                    data_world: settings.data_world(),
                    total,
                    comm,
                    recorder: watchdog.recorder(local),
                    local,
                    device: match settings.recompute.mode {
                        RecomputeMode::Balanced => base.gradient_checkpointing(),
                        _ => base,
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
            std::process::exit(2);
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

/// One rank: its device, its view of the group, and what the loop reads.
pub(super) struct Worker<'a, W: Workload> {
    pub workload: &'a W,
    pub settings: &'a TrainerSettings,
    pub setup: Setup,
    pub policy: Policy,
    /// The model's parameter groups (none for a model with one optimizer).
    groups: Vec<String>,
    sampler: DistributedSampler,
    schedules: Vec<Schedule>,
    /// Micro-batches per optimizer step.
    micros: usize,
    /// This rank's data-parallel rank, and how many there are.
    data_rank: usize,
    data_world: usize,
    total: usize,
    pub comm: Box<dyn Collective + 'a>,
    /// The rank's flight recorder (its collectives are recorded by `comm`; its steps here).
    recorder: Arc<Recorder>,
    /// This rank's index among the ranks of its process (its device's index).
    local: usize,
    pub device: Device,
    /// The system monitor, on rank 0.
    monitor: Option<&'a SystemMonitor>,
    /// The model draws random numbers in its forward: each forward is seeded from (seed, rank,
    /// step) ([`crate::exec::draws`]).
    draws: bool,
}

impl<W: Workload> Worker<'_, W> {
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// Runs the worker, turning an error or a panic into an abort of the whole group so that
    /// no other rank waits forever. The rank's loader threads live in a scope around it: the
    /// abort is said before the scope waits for them, so that one stuck in the workload's code
    /// is ended with the process (`wait_or_exit`) rather than holding the rank.
    fn run_guarded(self, start: &Start) -> Result<Outcome<W::Model>> {
        let rank = self.rank();
        let pool = (self.settings.parallel.split_cpu_threads && self.world() > 1).then(|| {
            let cores = self.settings.parallel.cpu_cores;
            rayon::ThreadPoolBuilder::new()
                .num_threads((cores / self.world()).max(1))
                .thread_name(move |i| format!("kiln-worker-{rank}-pool-{i}"))
                .build()
                .expect("build a rayon pool")
        });
        std::thread::scope(|scope| {
            let body = AssertUnwindSafe(|| match &pool {
                Some(pool) => pool.install(|| self.run(start, scope)),
                None => self.run(start, scope),
            });
            let outcome = match std::panic::catch_unwind(body) {
                Ok(result) => result,
                Err(payload) => Err(Error::Worker(format!(
                    "rank {rank} panicked: {}",
                    crate::panics::panic_message(&payload)
                ))),
            };
            if let Err(e) = &outcome
                && !is_abort_echo(e)
            {
                self.comm
                    .abort(&format!("{ABORTED}rank {rank} failed: {e}"));
            }
            outcome
        })
    }

    /// The loop: a step, then each component that is due after it; the rank's batches come
    /// from loader threads spawned in `scope` (none with `data.workers = 0`), which stop when
    /// the loop ends.
    fn run<'scope>(
        &'scope self,
        start: &Start,
        scope: &'scope std::thread::Scope<'scope, '_>,
    ) -> Result<Outcome<W::Model>> {
        let mut strategy = self.strategy(start)?;
        let strategy = strategy.as_mut();
        let state = start.state.clone();
        let plan = Plan::new(
            self.sampler.clone(),
            &state,
            self.micros,
            self.groups.len(),
            self.data_rank,
            self.data_world,
            self.settings.train.batch_size,
            self.settings.seed,
            self.total,
        );
        let loader = self.settings.loader;
        let workers = if strategy.takes_batches() {
            loader.workers
        } else {
            0
        };
        let d = &self.settings.parallel.dist;
        let deadline = (d.timeout_s > 0.0).then(|| Duration::from_secs_f64(d.timeout_s));
        let mut feed = Feed::start(
            scope,
            self.workload,
            plan,
            self.device.clone(),
            workers,
            loader.prefetch,
            self.rank(),
            deadline,
        );
        self.steps(strategy, state, &mut feed)
    }

    /// The steps of the run from `state` on, each followed by the components that are due.
    fn steps(
        &self,
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
        mut state: LoopState,
        feed: &mut Feed<'_, W>,
    ) -> Result<Outcome<W::Model>> {
        let mut log = self.logger(state.step);
        let mut val = Validator::default();
        let saver = Checkpointer::new(&self.settings.train, self.settings.output.run_dir.clone());
        let start_rss_mib = process_memory_mib("VmRSS");
        let (wall, started) = (state.wall_seconds, Instant::now());
        let (mut stopped_by, mut stopped_early) = (None, None);
        while state.step < self.total {
            self.train_step(&mut state, feed, strategy, &mut log)?;
            let last = state.step == self.total;
            if log.due(state.step, last) {
                let logged = log.log(&state, strategy)?;
                self.notify(EventKind::Logged, &state, &logged, strategy)?;
            }
            let signal = self.agreed_signal(last)?;
            let save = saver.due(state.step, last, signal.is_some());
            let epoch_end = state.step_in_epoch == self.sampler.steps_per_epoch();
            let t = &self.settings.train;
            let mut early = None;
            if val.due(&state, t, epoch_end, last, save && saver.scored()) {
                let t0 = Instant::now();
                let (scores, metrics) = self.validate(&strategy.full_model()?)?;
                val.record(state.step, scores);
                log.validation(&state, scores, &metrics)?;
                early = self.watch(&mut state, scores, &metrics)?;
                let mut values = vec![("loss".to_string(), scores.0)];
                values.extend(scores.1.map(|a| ("accuracy".to_string(), a)));
                values.extend(metrics);
                self.notify(EventKind::Validated, &state, &values, strategy)?;
                // Validation time does not count against training throughput.
                log.exclude(t0.elapsed().as_secs_f64());
            }
            if epoch_end {
                self.notify(EventKind::EpochEnd, &state, &[], strategy)?;
            }
            // Early stopping ends the run with a checkpoint.
            if save || (early.is_some() && !last) {
                let t0 = Instant::now();
                state.wall_seconds = wall + started.elapsed().as_secs_f64();
                saver.save(strategy, &state, &val, self.comm.as_ref())?;
                log.exclude(t0.elapsed().as_secs_f64());
            }
            if Checkpointer::snapshot_due(self.workload, state.step, last) {
                let t0 = Instant::now();
                let lead = self.rank() == 0;
                saver.snapshot(self.workload, strategy, state.step, &self.policy, lead)?;
                log.exclude(t0.elapsed().as_secs_f64());
            }
            if let Some(signal) = signal {
                // No rank leaves before rank 0's checkpoint is on disk: a launcher takes the job
                // down when its first process exits.
                if self.world() > 1 {
                    self.comm.barrier()?;
                }
                stopped_by = Some(crate::signal::name(signal));
                break;
            }
            if let Some(reason) = early
                && !last
            {
                stopped_early = Some(reason);
                break;
            }
        }
        let ran = Ran {
            val,
            wall,
            started,
            start_rss_mib,
            stopped_by,
            stopped_early,
        };
        self.finish(strategy, state, log, ran)
    }

    /// Runs the workload's callback for `kind` if it asked for it: every rank builds the
    /// whole model (ZeRO-3 and a pipeline gather it), rank 0 calls it.
    fn notify(
        &self,
        kind: EventKind,
        state: &LoopState,
        metrics: &[(String, f64)],
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
    ) -> Result<()> {
        if !self.workload.events().contains(&kind) {
            return Ok(());
        }
        let model = strategy.full_model()?;
        if self.rank() != 0 {
            return Ok(());
        }
        let event = super::Event {
            kind,
            step: state.step,
            epoch: state.epoch,
            metrics,
        };
        let model = self.policy.export(model).valid();
        self.workload.on_event(&event, &model)
    }

    /// Feeds a validation to the run's watches: a reduce-on-plateau schedule that acts lowers
    /// its group's rate from the next step on; early stopping that acts returns why the run
    /// stops. Every rank sees the same values, so every rank decides the same.
    fn watch(
        &self,
        state: &mut LoopState,
        scores: Scores,
        named: &[(String, f64)],
    ) -> Result<Option<String>> {
        let step = state.step;
        for (g, schedule) in self.schedules.iter().enumerate() {
            let Some(w) = schedule.plateau() else {
                continue;
            };
            let key = match self.groups.get(g) {
                Some(name) => format!("groups.{name}.schedule.plateau"),
                None => "schedule.plateau".to_string(),
            };
            let value = plateau::value(w, &key, scores, named)?;
            if state.plateaus.len() < self.schedules.len() {
                state
                    .plateaus
                    .resize(self.schedules.len(), Plateau::default());
            }
            let watch = &mut state.plateaus[g];
            if watch.observe(w, value, step) && self.settings.output.progress {
                let lr = schedule.lr_after(step, watch.acted);
                say!(
                    "step {step}: {}; the learning rate{} is now {lr:.3e}",
                    watch.reason(w),
                    self.groups
                        .get(g)
                        .map_or(String::new(), |n| format!(" of group {n}"))
                );
            }
        }
        let Some(w) = &self.settings.train.early_stopping else {
            return Ok(None);
        };
        let value = plateau::value(w, "train.early_stopping", scores, named)?;
        let early = state.early.get_or_insert_default();
        Ok(early.observe(w, value, step).then(|| early.reason(w)))
    }

    /// One optimizer step: each parameter group's micro-steps and update in turn (one group
    /// for most models), a later group seeing what an earlier one stepped.
    fn train_step(
        &self,
        state: &mut LoopState,
        feed: &mut Feed<'_, W>,
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
        log: &mut Logger,
    ) -> Result<()> {
        let t = &self.settings.train;
        if state.step_in_epoch == self.sampler.steps_per_epoch() {
            state.epoch += 1;
            state.step_in_epoch = 0;
        }
        let lrs: Vec<f64> = self
            .schedules
            .iter()
            .enumerate()
            .map(|(g, s)| {
                let reductions = state.plateaus.get(g).map_or(0, |p| p.acted);
                self.workload
                    .lr(g, state.step, s.lr_after(state.step, reductions))
            })
            .collect();
        state.lr = lrs[0];
        let micros = self.micros;
        let objective = objective(micros, state.scaler.as_ref().map(|s| s.scale as f32));
        for (phase, &lr) in lrs.iter().enumerate() {
            let t0 = Instant::now();
            if lrs.len() > 1 {
                strategy.select_group(phase)?;
            }
            strategy.begin_step()?;
            // The strategy takes each micro-batch when it needs it; building it, or waiting
            // for the loader threads to, is data time.
            let mut data = 0.0;
            let step = state.step;
            let mut batches = (0..micros).map(|micro| {
                let t0 = Instant::now();
                let batch = feed.take(step, phase, micro).map(|b| {
                    self.policy
                        .cast_batch(b, |b, dtype| self.workload.cast_batch(b, dtype))
                });
                data += t0.elapsed().as_secs_f64();
                batch
            });
            if self.draws {
                let seed = self.settings.seed;
                draws::begin(seed, self.rank(), state.step, phase, &self.device);
            }
            let outs = strategy.micro_steps(&mut batches, micros, &objective);
            draws::end();
            let outs = outs?;
            drop(batches);
            if let Some(Fault::Slow(pause)) = self.fault(state.step + 1, true) {
                // A straggler: its compute takes longer.
                std::thread::sleep(pause);
            }
            // Collectives inside the micro-steps (ZeRO's reduce-scatters and gathers) count as
            // synchronisation, not compute.
            let inside = strategy.take_sync_seconds();
            let compute = t0.elapsed().as_secs_f64() - data - inside;
            let t2 = Instant::now();
            strategy.optimizer_step(lr, state.scaler.as_mut(), t.grad_clip)?;
            let sync = strategy.take_sync_seconds();
            let optim = t2.elapsed().as_secs_f64() - sync;
            let times = Times {
                data,
                compute,
                sync: inside + sync,
                optim,
            };
            log.add(phase, lr, &outs, times);
            if strategy.nonfinite() {
                self.nonfinite(state.step + 1, phase, &outs, log)?;
            }
        }
        state.step += 1;
        state.step_in_epoch += 1;
        state.samples += self.sampler.samples_per_step() as u64;
        log.step_done(state.step, self.sampler.samples_per_step());
        self.recorder.step_done();
        if t.check_replicas && self.world() > 1 {
            strategy.check_replicas(state.step)?;
        }
        match self.fault(state.step, false) {
            Some(Fault::Panic) => {
                panic!("injected failure after step {} ({FAULT_VAR})", state.step)
            }
            Some(Fault::Hang) => loop {
                // The rank stops making progress, as a stuck kernel or a deadlock would.
                std::thread::sleep(Duration::from_secs(3600));
            },
            _ => {}
        }
        Ok(())
    }

    /// The fault injected into this rank at `step` (a straggler's slowness from that step on,
    /// when `ongoing`).
    fn fault(&self, step: usize, ongoing: bool) -> Option<Fault> {
        let (rank, at, fault) = injected_fault()?;
        let due = match fault {
            Fault::Slow(_) if ongoing => step >= at,
            Fault::Slow(_) => false,
            _ => !ongoing && step == at,
        };
        (rank == self.rank() && due).then_some(fault)
    }

    /// This rank's strategy around its own module with rank 0's weights (in the master
    /// dtype), holding the optimizer state to continue.
    fn strategy(&self, start: &Start) -> Result<Box<dyn Strategy<W::Model, W::Batch> + '_>> {
        // Each rank builds its own module (so that no Burn state is shared between ranks) and
        // takes rank 0's weights; the throwaway initialisation still draws random numbers,
        // hence the lock.
        let model = kiln_models::with_rng(|| {
            kiln_models::materialized(self.workload.init_model(&self.device))
        });
        let model = self
            .policy
            .master_model(model.load_record(start.weights.clone()));
        let s = self.settings;
        let groups = s.groups.iter();
        let ctx = Context::new(
            &self.setup,
            self.comm.as_ref(),
            self.device.clone(),
            s.optim.clone(),
            groups
                .map(|(name, g)| (name.clone(), g.optim.clone()))
                .collect(),
        );
        let mut strategy = strategy::build(self.setup.kind, model, ctx)?;
        if let Some(optim) = &start.optim {
            strategy.load_optimizer_states(optim)?;
        }
        Ok(strategy)
    }

    /// The logger of this rank: rank 0 writes and shows.
    fn logger(&self, step: usize) -> Logger<'_> {
        let s = self.settings;
        let lead = self.rank() == 0;
        let device_name = s.parallel.devices[0].identity().map(|i| i.name);
        let monitor = &s.output.monitor;
        if let Some(m) = self.monitor {
            m.set_step(step);
        }
        Logger::new(LoggerParts {
            comm: self.comm.as_ref(),
            groups: self.groups.clone(),
            every: s.train.log_every,
            writer: lead
                .then(|| MetricsWriter::open(&s.output.run_dir, &monitor.sinks, Some(step))),
            progress: (lead && s.output.progress).then(|| Progress::new(self.total, step)),
            throughput: Throughput::new(
                self.world(),
                self.workload.tokens_per_sample(),
                self.workload.flops_per_sample(),
                peak_tflops(monitor.peak_tflops, device_name.as_deref()),
                monitor.smoothing,
            ),
            monitor: self.monitor,
            count_skips: s.train.skip_nonfinite > 0,
            stragglers: (self.setup.stages() == 1).then_some(s.parallel.dist.straggler_margin),
        })
    }

    /// The signal every rank agrees to stop at after this step, with a checkpoint (a signal
    /// reaches processes and threads at different moments).
    fn agreed_signal(&self, last: bool) -> Result<Option<i32>> {
        if !self.settings.train.checkpoint_on_signal || last {
            return Ok(None);
        }
        // Every rank's signal (0: none); the run stops when one has one and names the first
        // rank's, the same on every rank.
        let mine = [crate::signal::requested().map_or(0.0, |sig| sig as f32)];
        let all = if self.world() > 1 {
            self.comm.all_gather(&mine)?
        } else {
            mine.to_vec()
        };
        Ok(all.iter().find(|s| **s > 0.0).map(|s| *s as i32))
    }

    /// A step whose gradients were not finite (every rank saw the same flag): within
    /// `train.skip_nonfinite` it is skipped (the parameters stay as they were), past it the
    /// run stops, before anything is written for this step.
    fn nonfinite(
        &self,
        step: usize,
        phase: usize,
        outs: &[StepOutput],
        log: &mut Logger,
    ) -> Result<()> {
        let allowed = self.settings.train.skip_nonfinite;
        if log.skipped < allowed {
            log.skipped += 1;
            return Ok(());
        }
        let bad = outs
            .iter()
            .position(|o| !o.loss.clone().into_scalar::<f32>().is_finite())
            .map_or(-1.0, |m| m as f32);
        let all = self.comm.all_gather(&[bad])?;
        let at: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, m)| **m >= 0.0)
            .map(|(r, m)| format!("rank {r} micro-batch {}", *m as usize))
            .collect();
        let mut what = if at.is_empty() {
            "a non-finite gradient (every loss was finite)".to_string()
        } else {
            format!("a non-finite loss ({})", at.join(", "))
        };
        if let Some(group) = self.groups.get(phase) {
            what = format!("{what} in parameter group {group:?}");
        }
        let kept = checkpoint::list(&self.settings.output.run_dir)
            .pop()
            .map_or("none was written".to_string(), |(_, d)| {
                format!("{} is intact", d.display())
            });
        Err(Error::Training(format!(
            "step {step}: {what}; the step was not taken and the newest checkpoint {kept} \
             (train.skip_nonfinite = {allowed} lets a run skip such steps)"
        )))
    }

    /// After the last step (or a stop): the final validation if none ran at this step, the
    /// memory figures of every rank, and on the process's first rank the summary and the
    /// model as it leaves the run (f32).
    fn finish(
        &self,
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
        state: LoopState,
        mut log: Logger,
        ran: Ran,
    ) -> Result<Outcome<W::Model>> {
        let s = self.settings;
        let model = strategy.full_model()?;
        let mut last_val = ran.val.last;
        let step = state.step;
        if ran.val.at != Some(step)
            && self.workload.eval_len() > 0
            && step > 0
            && ran.stopped_by.is_none()
        {
            last_val = Some(self.validate(&model)?.0);
        }
        log.finish();
        let wall = ran.wall + ran.started.elapsed().as_secs_f64();
        let m = strategy.memory();
        let pool = m.pool_peak.unwrap_or(u64::MAX);
        let counts = [m.params.peak, m.grads.peak, m.optim.peak, m.total_peak].map(|c| c as u64);
        let mut mine = counts.to_vec();
        mine.push(pool);
        let memories = pack::gather_counts(self.comm.as_ref(), &mine)?;
        if self.local != 0 {
            return Ok(Outcome { lead: None });
        }
        let per_rank = |i: usize| memories.iter().map(|m| m[i] as usize).collect();
        let summary = Summary {
            steps: step,
            epochs: step as f64 / self.sampler.steps_per_epoch() as f64,
            final_train_loss: log.last_loss,
            val_loss: last_val.map(|v| v.0),
            val_accuracy: last_val.and_then(|v| v.1),
            wall_seconds: wall,
            samples_per_sec: state.samples as f64 / wall.max(1e-9),
            devices: self.world() / s.parallel.sub_replicas.max(1),
            sub_replicas: s.parallel.sub_replicas.max(1),
            strategy: self.setup.name(),
            precision: self.policy.name(),
            accelerator: s.parallel.accelerator.clone(),
            recompute: name_of(&s.recompute.mode),
            step_seconds: super::median(&mut log.step_times),
            start_rss_mib: ran.start_rss_mib,
            peak_rss_mib: process_memory_mib("VmHWM"),
            param_bytes_per_rank: per_rank(0),
            grad_bytes_per_rank: per_rank(1),
            optim_bytes_per_rank: per_rank(2),
            peak_bytes_per_rank: per_rank(3),
            pool_peak_bytes_per_rank: memories
                .iter()
                .map(|m| (m[4] != u64::MAX).then_some(m[4]))
                .collect(),
            processes: s.parallel.processes.count,
            stopped_by: ran.stopped_by,
            stopped_early: ran.stopped_early,
        };
        // The exported model is f32 whatever the training precision.
        let model = self.policy.export(model);
        Ok(Outcome {
            lead: Some((summary, model.valid())),
        })
    }
}

/// What the loop leaves for [`Worker::finish`] besides the state and the log.
struct Ran {
    val: Validator,
    /// Seconds of training before this run (a resumed run's), and when this one started.
    wall: f64,
    started: Instant,
    start_rss_mib: Option<f64>,
    stopped_by: Option<String>,
    /// Why early stopping ended the run, if it did.
    stopped_early: Option<String>,
}

/// What a micro-batch's backward differentiates: its mean loss divided by the micro-batches of
/// the step, times the loss scale.
fn objective(micros: usize, scale: Option<f32>) -> impl Fn(Tensor<1>) -> Tensor<1> {
    move |loss: Tensor<1>| {
        let loss = if micros > 1 {
            loss.div_scalar(micros as f32)
        } else {
            loss
        };
        match scale {
            Some(scale) => loss.mul_scalar(scale),
            None => loss,
        }
    }
}

/// The environment variable that injects a fault into one rank, to test how a run ends (a test
/// facility, in-process and across processes): `KILN_FAULT_INJECT=rank:step` panics after that
/// step, `rank:step:hang` stops making progress after it, `rank:step:slow=MS` adds MS
/// milliseconds of compute to every step from that one on (a straggler), and
/// `rank:step:loader-hang` / `rank:step:loader-panic` make a loader thread of the rank
/// (`data.workers` > 0) hang or panic building that step's batch.
pub const FAULT_VAR: &str = "KILN_FAULT_INJECT";

/// A fault the variable injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Panic,
    Hang,
    Slow(Duration),
    /// A loader thread of the rank stops making progress building the step's batch.
    LoaderHang,
    /// A loader thread of the rank panics building the step's batch.
    LoaderPanic,
}

/// The fault injected into `rank`'s loader threads as they build the batches of step `step`
/// (1-based): `true` hangs, `false` panics.
pub(crate) fn loader_fault(rank: usize, step: usize) -> Option<bool> {
    match injected_fault()? {
        (r, at, Fault::LoaderHang) if r == rank && at == step => Some(true),
        (r, at, Fault::LoaderPanic) if r == rank && at == step => Some(false),
        _ => None,
    }
}

/// The `(rank, step, fault)` the variable asks for, if it does.
fn injected_fault() -> Option<(usize, usize, Fault)> {
    static FAULT: std::sync::OnceLock<Option<(usize, usize, Fault)>> = std::sync::OnceLock::new();
    *FAULT.get_or_init(|| {
        let raw = std::env::var(FAULT_VAR).ok()?;
        let mut parts = raw.split(':').map(str::trim);
        let rank = parts.next()?.parse().ok()?;
        let step = parts.next()?.parse().ok()?;
        let fault = match parts.next() {
            None => Fault::Panic,
            Some("hang") => Fault::Hang,
            Some("loader-hang") => Fault::LoaderHang,
            Some("loader-panic") => Fault::LoaderPanic,
            Some(slow) => {
                let ms = slow.strip_prefix("slow=")?.parse().ok()?;
                Fault::Slow(Duration::from_millis(ms))
            }
        };
        Some((rank, step, fault))
    })
}

/// The median of `values` (sorted in place), `None` when empty.
pub fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}
