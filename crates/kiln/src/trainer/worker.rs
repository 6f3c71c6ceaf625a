//! One rank's loop: a step, then whatever is due (a log line, validation, a checkpoint, a
//! snapshot, a stop). It talks to its [`Strategy`] and its [`Collective`] through their
//! traits only.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::prelude::*;

use super::checkpointer::Checkpointer;
use super::faults::{ABORTED, Fault, injected_fault, is_abort_echo};
use super::loader::{Feed, Jobs};
use super::log::{Logger, LoggerParts, Scores};
use super::plateau;
use super::settings::TrainerSettings;
use super::start::Start;
use super::validate::{self, Validator};
use super::workload::{Event, EventKind, Workload};
use crate::comm::Collective;
use crate::comm::watch::Recorder;
use crate::data::DistributedSampler;
use crate::error::{Error, Result};
use crate::metrics::{MetricsWriter, Progress, Summary};
use crate::monitor::{SystemMonitor, Throughput, peak_tflops, process_memory_mib};
use crate::optim::Schedule;
use crate::precision::Policy;
use crate::state::LoopState;
use crate::state::Plateau;
use crate::strategy::{self, Context, Setup, Strategy};

/// What a rank hands back: on the first rank of each process, the summary and the final model.
pub(super) struct Outcome<M> {
    pub(super) lead: Option<(Summary, M)>,
}

/// One rank: its device, its view of the group, and what the loop reads.
pub(super) struct Worker<'a, W: Workload> {
    pub(super) workload: &'a W,
    pub(super) settings: &'a TrainerSettings,
    pub(super) setup: Setup,
    pub(super) policy: Policy,
    /// The model's parameter groups (none for a model with one optimizer).
    pub(super) groups: Vec<String>,
    pub(super) sampler: DistributedSampler,
    pub(super) schedules: Vec<Schedule>,
    /// Micro-batches per optimizer step.
    pub(super) micros: usize,
    /// This rank's data-parallel rank, and how many there are.
    pub(super) data_rank: usize,
    pub(super) data_world: usize,
    pub(super) total: usize,
    pub(super) comm: Box<dyn Collective + 'a>,
    /// The rank's flight recorder (its collectives are recorded by `comm`; its steps here).
    pub(super) recorder: Arc<Recorder>,
    /// This rank's index among the ranks of its process (its device's index).
    pub(super) local: usize,
    pub(super) device: Device,
    /// The system monitor, on rank 0.
    pub(super) monitor: Option<&'a SystemMonitor>,
    /// The model draws random numbers in its forward: each forward is seeded from (seed, rank,
    /// step) ([`crate::exec::draws`]).
    pub(super) draws: bool,
}

impl<W: Workload> Worker<'_, W> {
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// Validates `model` on this rank's shard of the evaluation set.
    pub(super) fn validate(&self, model: &W::Model) -> Result<(Scores, Vec<(String, f64)>)> {
        validate::validate(
            self.workload,
            model,
            &self.policy,
            self.comm.as_ref(),
            &self.device,
            self.settings.train.batch_size,
        )
    }

    /// Runs the worker, turning an error or a panic into an abort of the whole group so that
    /// no other rank waits forever. The rank's loader threads live in a scope around it: the
    /// abort is said before the scope waits for them, so that one stuck in the workload's code
    /// is ended with the process (`wait_or_exit`) rather than holding the rank.
    pub(super) fn run_guarded(self, start: &Start) -> Result<Outcome<W::Model>> {
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
                crate::error::note_failure(e);
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
        // What building the strategy freed goes back to the system before the steps: the
        // resident memory the steps grow from is what the planner counted from.
        crate::heap::release_free();
        let strategy = strategy.as_mut();
        let state = start.state.clone();
        let jobs = Jobs::new(
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
            jobs,
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
        // Past `hardware.memory_limit_mib` ÷ (1 + HEADROOM) at a step's end — where a jobs that
        // just fits ends — the pages the allocator keeps go back (on the CPU).
        let hold = self
            .settings
            .parallel
            .memory_limit_mib
            .map(|limit| limit / (1.0 + crate::config::HEADROOM));
        while state.step < self.total {
            self.train_step(&mut state, feed, strategy, &mut log, &saver)?;
            if let Some(threshold) = hold {
                crate::heap::hold_under(process_memory_mib("VmRSS"), threshold);
            }
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
            let validate = val.due(&state, t, epoch_end, last, save && saver.scored());
            if validate || save || last {
                // What a validation, a checkpoint or the run's end (its export) allocates lands
                // where the steps' kept pages were, not on top of them: a run's peak is its
                // steps', the one the planner predicts. Kept, the pages put the GPT's zero2
                // peak after its last step, 239–279 MiB over five launches against 247 in its
                // steps; a zero3 run under a limit beside a build went over it there (227–232
                // MiB, every step's end under the threshold). The steps after a validation
                // fault their pages in once more.
                crate::heap::release_free();
            }
            if validate {
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
                state.wall_seconds = wall + started.elapsed().as_secs_f64();
                let final_one = last || signal.is_some() || early.is_some();
                let stall = saver.save(strategy, &state, &val, self.comm.as_ref(), final_one)?;
                log.exclude(stall);
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
        // A write in flight lands before the run ends.
        saver.wait()?;
        let ran = Ran {
            val,
            wall,
            started,
            start_rss_mib,
            stopped_by,
            stopped_early,
            checkpoint_stalls: saver.stalls(),
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
        let event = Event {
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

    /// The fault injected into this rank at `step` (a straggler's slowness from that step on,
    /// when `ongoing`).
    pub(super) fn fault(&self, step: usize, ongoing: bool) -> Option<Fault> {
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
}

/// What the loop leaves for [`Worker::finish`] besides the state and the log.
pub(super) struct Ran {
    pub(super) val: Validator,
    /// Seconds of training before this run (a resumed run's), and when this one started.
    pub(super) wall: f64,
    pub(super) started: Instant,
    pub(super) start_rss_mib: Option<f64>,
    pub(super) stopped_by: Option<String>,
    /// Why early stopping ended the run, if it did.
    pub(super) stopped_early: Option<String>,
    /// Each checkpoint's seconds on the step's path.
    pub(super) checkpoint_stalls: Vec<f64>,
}
