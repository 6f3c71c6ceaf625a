//! One rank's run: its strategy built, its loader started, then the loop (`after.rs`: a
//! step, then the parts after it in order). It talks to its [`Strategy`] and its
//! [`Collective`] through their traits only.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::DispatchDevice;
use burn::module::Module;
use burn::prelude::*;

use super::faults::{ABORTED, is_abort_echo, with_injected_fault};
use super::loader::{Feed, Jobs};
use super::log::{Logger, LoggerParts, Scores};
use super::plateau;
use super::settings::TrainerSettings;
use super::start::{Resumed, Start};
use super::validate::{self, Validator};
use super::workload::{Event, EventKind, Workload};
use crate::comm::Collective;
use crate::comm::watch::Recorder;
use crate::config::HostWaits;
use crate::data::DistributedSampler;
use crate::error::{Error, Result};
use crate::metrics::{MetricsWriter, Progress, Summary};
use crate::monitor::{SystemMonitor, Throughput, peak_tflops};
use crate::optim::Schedule;
use crate::precision::Policy;
use crate::state::LoopState;
use crate::state::Plateau;
use crate::strategy::{self, Context, Mesh, Setup, Strategy};

/// What a rank hands back: on the first rank of each process, the summary and the final model.
pub(super) struct Outcome<M> {
    pub(super) lead: Option<(Summary, M)>,
}

/// One rank: what it trains (the workload, the settings, the strategy's setup, the precision
/// policy), what its loop steps through ([`Steps`]), where it stands ([`Place`]).
pub(super) struct Worker<'a, W: Workload> {
    pub(super) workload: &'a W,
    pub(super) settings: &'a TrainerSettings,
    pub(super) setup: Setup,
    pub(super) policy: Policy,
    pub(super) steps: Steps,
    pub(super) place: Place<'a>,
    /// The system monitor, on rank 0.
    pub(super) monitor: Option<&'a SystemMonitor>,
    /// The model draws random numbers in its forward: each forward is seeded from (seed, rank,
    /// step) ([`crate::exec::draws`]).
    pub(super) draws: bool,
}

/// What a rank's loop steps through: the same on every rank.
pub(super) struct Steps {
    /// The model's parameter groups (none for a model with one optimizer).
    pub(super) groups: Vec<String>,
    /// Which samples each step takes.
    pub(super) sampler: DistributedSampler,
    /// Each group's learning-rate schedule.
    pub(super) schedules: Vec<Schedule>,
    /// Micro-batches per optimizer step.
    pub(super) micros: usize,
    /// The run's last step.
    pub(super) total: usize,
}

/// Where a rank stands: its group, its device, its share of the data.
pub(super) struct Place<'a> {
    pub(super) comm: Box<dyn Collective + 'a>,
    /// The rank's flight recorder (its collectives are recorded by `comm`; its steps here).
    pub(super) recorder: Arc<Recorder>,
    /// This rank's index among the ranks of its process (its device's index).
    pub(super) local: usize,
    pub(super) device: Device,
    /// This rank's data-parallel rank, and how many there are.
    pub(super) data_rank: usize,
    pub(super) data_world: usize,
}

impl<W: Workload> Worker<'_, W> {
    pub fn rank(&self) -> usize {
        self.place.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.place.comm.world_size()
    }

    /// Whether the host waits for the device at every step (`train.host_waits`; `auto`: on
    /// the CPU, whose reads wait for nothing, not on a GPU).
    pub fn waits_each_step(&self) -> bool {
        match self.settings.train.host_waits {
            HostWaits::Step => true,
            HostWaits::Log => false,
            HostWaits::Auto => matches!(
                self.place.device.clone().without_autodiff().as_dispatch(),
                DispatchDevice::Flex(_)
            ),
        }
    }

    /// Validates `model` on this rank's shard of the evaluation set.
    pub(super) fn validate(&self, model: &W::Model) -> Result<(Scores, Vec<(String, f64)>)> {
        validate::validate(
            self.workload,
            model,
            &self.policy,
            self.place.comm.as_ref(),
            &self.place.device,
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
                self.place
                    .comm
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
        let mesh = Mesh::split(self.place.comm.as_ref(), self.setup.tp)?;
        let mut strategy = self.strategy(start, mesh.as_ref())?;
        // What building the strategy freed goes back to the system before the steps: the
        // resident memory the steps grow from is what the planner counted from.
        crate::heap::release_free();
        let strategy = strategy.as_mut();
        let state = start.state.clone();
        let jobs = Jobs::new(
            self.steps.sampler.clone(),
            &state,
            self.steps.micros,
            self.steps.groups.len(),
            self.place.data_rank,
            self.place.data_world,
            self.settings.train.batch_size,
            self.settings.seed,
            self.steps.total,
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
            self.place.device.clone(),
            workers,
            loader.prefetch,
            self.rank(),
            deadline,
        );
        self.steps(strategy, state, &mut feed)
    }

    /// Runs the workload's callback for `kind` if it asked for it: every rank builds the
    /// whole model (ZeRO-3 and a pipeline gather it), rank 0 calls it.
    pub(super) fn notify(
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
    pub(super) fn watch(
        &self,
        state: &mut LoopState,
        scores: Scores,
        named: &[(String, f64)],
    ) -> Result<Option<String>> {
        let step = state.step;
        for (g, schedule) in self.steps.schedules.iter().enumerate() {
            let Some(w) = schedule.plateau() else {
                continue;
            };
            let key = match self.steps.groups.get(g) {
                Some(name) => format!("groups.{name}.schedule.plateau"),
                None => "schedule.plateau".to_string(),
            };
            let value = plateau::value(w, &key, scores, named)?;
            if state.plateaus.len() < self.steps.schedules.len() {
                state
                    .plateaus
                    .resize(self.steps.schedules.len(), Plateau::default());
            }
            let watch = &mut state.plateaus[g];
            if watch.observe(w, value, step) && self.settings.output.progress {
                let lr = schedule.lr_after(step, watch.acted);
                say!(
                    "step {step}: {}; the learning rate{} is now {lr:.3e}",
                    watch.reason(w),
                    self.steps
                        .groups
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

    /// This rank's strategy around its own module with rank 0's weights (in the master
    /// dtype), holding the optimizer state to continue; in a mesh, around its part of the
    /// module, over its data-parallel group.
    fn strategy<'s>(
        &'s self,
        start: &Start,
        mesh: Option<&'s Mesh>,
    ) -> Result<Box<dyn Strategy<W::Model, W::Batch> + 's>> {
        // Each rank builds its own module (so that no Burn state is shared between ranks) and
        // takes rank 0's weights; the throwaway initialisation still draws random numbers,
        // hence the lock.
        let model = kiln_models::with_rng(|| {
            kiln_models::materialized(self.workload.init_model(&self.place.device))
        });
        let model = self
            .policy
            .master_model(model.load_record(start.weights.clone()));
        let s = self.settings;
        let groups = s.groups.iter();
        let comm = mesh.map_or(self.place.comm.as_ref(), Mesh::data);
        let mut ctx = Context::new(
            &self.setup,
            comm,
            self.place.device.clone(),
            s.optim.clone(),
            groups
                .map(|(name, g)| (name.clone(), g.optim.clone()))
                .collect(),
        );
        if let Some(mesh) = mesh {
            ctx.tp = Some(mesh.place::<W::Batch, _>(&model)?);
        }
        ctx.decide_on_device = !self.waits_each_step();
        let mut strategy = strategy::build(self.setup.kind, model, ctx)?;
        match &start.optim {
            Some(Resumed::Whole(states)) => strategy.load_optimizer_states(states)?,
            Some(Resumed::Sharded {
                source,
                groups,
                params,
            }) => {
                if *params {
                    strategy.load_param_shards(source)?;
                }
                strategy.load_optimizer_shards(source, groups)?;
                source.release();
            }
            None => {}
        }
        let phases = self.steps.groups.len().max(1);
        Ok(with_injected_fault(
            strategy,
            self.rank(),
            start.state.step,
            phases,
        ))
    }

    /// The logger of this rank: rank 0 writes and shows.
    pub(super) fn logger(&self, step: usize) -> Logger<'_> {
        let s = self.settings;
        let lead = self.rank() == 0;
        let device_name = s.parallel.devices[0].identity().map(|i| i.name);
        let monitor = &s.output.monitor;
        if let Some(m) = self.monitor {
            m.set_step(step);
        }
        Logger::new(LoggerParts {
            comm: self.place.comm.as_ref(),
            groups: self.steps.groups.clone(),
            every: s.train.log_every,
            writer: lead
                .then(|| MetricsWriter::open(&s.output.run_dir, &monitor.sinks, Some(step))),
            progress: (lead && s.output.progress).then(|| Progress::new(self.steps.total, step)),
            // Per device: replicas sharing one (per-core sub-replicas, several on a card)
            // share its peak.
            throughput: Throughput::new(
                self.world() / s.parallel.sub_replicas.max(1),
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
    /// The process's heap peak as the first checkpoint began.
    pub(super) heap_before_checkpoints: Option<usize>,
}
