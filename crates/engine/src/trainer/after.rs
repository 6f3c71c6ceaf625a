//! The loop of a rank's steps, and what happens after a step as a list ([`after_step`]): each
//! part an [`AfterStep`] that the
//! loop calls in order with the step's [`StepEnd`] — the memory hold, the log line, the pages
//! handed back, validation and the watches it feeds, the epoch's end, the checkpoint, the
//! snapshot, the stop. What is due is decided first, the same on every rank ([`Due`]), so that
//! every part reads one decision.

use std::time::Instant;

use super::checkpointer::Checkpointer;
use super::loader::Feed;
use super::log::Logger;
use super::validate::Validator;
use super::worker::{Outcome, Ran, Worker};
use super::workload::{EventKind, Workload};
use crate::error::Result;
use crate::monitor::process_memory_mib;
use crate::state::LoopState;
use crate::strategy::Strategy;

impl<W: Workload> Worker<'_, W> {
    /// The steps of the run from `state` on, each followed by the parts of [`after_step`].
    pub(super) fn steps(
        &self,
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
        mut state: LoopState,
        feed: &mut Feed<'_, W>,
    ) -> Result<Outcome<W::Model>> {
        let mut log = self.logger(state.step);
        let mut kept = Kept {
            val: Validator::default(),
            saver: Checkpointer::new(&self.settings.train, self.settings.output.run_dir.clone()),
            wall: state.wall_seconds,
            started: Instant::now(),
            settled: state.step,
        };
        let start_rss_mib = process_memory_mib("VmRSS");
        let parts = after_step::<W>();
        let mut stopped = None;
        while state.step < self.steps.total {
            self.train_step(&mut state, feed, strategy, &mut log, &kept.saver)?;
            let last = state.step == self.steps.total;
            let due = self.due(&state, last, &log, &kept)?;
            let mut end = StepEnd {
                state: &mut state,
                strategy: &mut *strategy,
                log: &mut log,
                kept: &mut kept,
                last,
                due,
                early: None,
                stop: None,
            };
            for part in parts {
                part.after(self, &mut end)?;
            }
            if let Some(stop) = end.stop {
                stopped = Some(stop);
                break;
            }
        }
        // A write in flight lands before the run ends.
        kept.saver.wait()?;
        let (stopped_by, stopped_early) = match stopped {
            Some(Stopped::Signal(name)) => (Some(name), None),
            Some(Stopped::Early(reason)) => (None, Some(reason)),
            None => (None, None),
        };
        let ran = Ran {
            checkpoint_stalls: kept.saver.stalls(),
            heap_before_checkpoints: kept.saver.heap_before(),
            val: kept.val,
            wall: kept.wall,
            started: kept.started,
            start_rss_mib,
            stopped_by,
            stopped_early,
        };
        self.finish(strategy, state, log, ran)
    }

    /// What is due after the step that ended at `state`: the log line, the agreed signal (a
    /// collective: every rank decides the same), a checkpoint, a validation (one scores a
    /// checkpoint under `train.best_metric`), the epoch's end.
    fn due(&self, state: &LoopState, last: bool, log: &Logger, kept: &Kept) -> Result<Due> {
        let signal = self.agreed_signal(last)?;
        let save = kept.saver.due(state.step, last, signal.is_some());
        let epoch_end = state.step_in_epoch == self.steps.sampler.steps_per_epoch();
        let t = &self.settings.train;
        let scored = save && kept.saver.scored();
        Ok(Due {
            log: log.due(state.step, last),
            signal,
            save,
            validate: kept.val.due(state, t, epoch_end, last, scored),
            epoch_end,
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
            self.place.comm.all_gather(&mine)?
        } else {
            mine.to_vec()
        };
        Ok(all.iter().find(|s| **s > 0.0).map(|s| *s as i32))
    }
}

/// One part of what happens after a step.
pub(super) trait AfterStep<W: Workload> {
    /// Does its part at the end of the step `end` describes.
    fn after(&self, worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()>;
}

/// The parts, in the order they run after every step.
pub(super) fn after_step<'a, W: Workload + 'a>() -> [&'a dyn AfterStep<W>; 9] {
    [
        &Settle,
        &HoldMemory,
        &LogLine,
        &HandBackPages,
        &Validation,
        &EpochEnd,
        &Checkpoint,
        &Snapshot,
        &Stop,
    ]
}

/// What is due after a step: decided before any part runs, the same on every rank.
pub(super) struct Due {
    /// A log line.
    pub(super) log: bool,
    /// The signal every rank agreed to stop at, with a checkpoint.
    pub(super) signal: Option<i32>,
    /// A checkpoint.
    pub(super) save: bool,
    /// A validation.
    pub(super) validate: bool,
    /// The step ended an epoch.
    pub(super) epoch_end: bool,
}

/// What the parts keep from step to step: the validations' record, the checkpoints, the
/// clock.
pub(super) struct Kept {
    pub(super) val: Validator,
    pub(super) saver: Checkpointer,
    /// Seconds of training before this run (a resumed run's), and when this one started.
    pub(super) wall: f64,
    pub(super) started: Instant,
    /// The step after which the host last read what the device decided (`train.host_waits =
    /// "log"`).
    pub(super) settled: usize,
}

/// Why the run stops before its last step.
pub(super) enum Stopped {
    /// A signal, by name.
    Signal(String),
    /// Early stopping, and why.
    Early(String),
}

/// One step's end, as the parts see it.
pub(super) struct StepEnd<'s, 'w, W: Workload> {
    pub(super) state: &'s mut LoopState,
    pub(super) strategy: &'s mut dyn Strategy<W::Model, W::Batch>,
    pub(super) log: &'s mut Logger<'w>,
    pub(super) kept: &'s mut Kept,
    /// The run's last step.
    pub(super) last: bool,
    pub(super) due: Due,
    /// Why early stopping ends the run, once a validation said so.
    pub(super) early: Option<String>,
    /// Set by [`Stop`]: the run ends after this step.
    pub(super) stop: Option<Stopped>,
}

/// Under `train.host_waits = "log"`, before anything after the step reads the device or leaves
/// the window's clock (a log line, a validation, a checkpoint, a snapshot, the epoch's end, the
/// run's end): the host waits for the queued steps and reads which the device refused
/// ([`Worker::settle`]), so that a refused step is acted on before anything is written for a
/// step after it, and the queued work counts as training time, not as validation's.
struct Settle;

/// The most steps the device decides before the host reads them, whatever else is due.
const SETTLE_EVERY: usize = 256;

impl<W: Workload> AfterStep<W> for Settle {
    fn after(&self, worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        let due = &end.due;
        let step = end.state.step;
        // At least every SETTLE_EVERY steps: the flags and AdamW's table of corrections
        // grow with the steps not read.
        let reads = due.log
            || step - end.kept.settled >= SETTLE_EVERY
            || due.save
            || due.validate
            || due.signal.is_some()
            || due.epoch_end
            || end.last
            || Checkpointer::snapshot_due(worker.workload, step, end.last);
        if worker.waits_each_step() || !reads {
            return Ok(());
        }
        let from = std::mem::replace(&mut end.kept.settled, step);
        worker.settle(end.strategy, (from, step), end.log, &end.kept.saver)
    }
}

/// Under `hardware.memory_limit_mib`, past the limit ÷ (1 + HEADROOM) at a step's end —
/// where a plan that just fits ends — the pages the allocator keeps go back (on the CPU).
struct HoldMemory;

impl<W: Workload> AfterStep<W> for HoldMemory {
    fn after(&self, worker: &Worker<'_, W>, _end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        let limit = worker.settings.parallel.memory_limit_mib;
        if let Some(threshold) = limit.map(|l| l / (1.0 + crate::config::HEADROOM)) {
            crate::heap::hold_under(process_memory_mib("VmRSS"), threshold);
        }
        Ok(())
    }
}

/// The window's log line, and the workload's callback for it.
struct LogLine;

impl<W: Workload> AfterStep<W> for LogLine {
    fn after(&self, worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        if end.due.log {
            let logged = end.log.log(end.state, end.strategy)?;
            worker.notify(EventKind::Logged, end.state, &logged, end.strategy)?;
        }
        Ok(())
    }
}

/// Before a validation, a checkpoint or the run's end (its export) the allocator's kept pages
/// go back, so that what they allocate lands where the steps' pages were, not on top of them:
/// a run's peak is its steps', the one the planner predicts. Kept, the pages put the GPT's
/// zero2 peak after its last step, 239–279 MiB over five launches against 247 in its steps; a
/// zero3 run under a limit beside a build went over it there (227–232 MiB, every step's end
/// under the threshold). The steps after a validation fault their pages in once more.
struct HandBackPages;

impl<W: Workload> AfterStep<W> for HandBackPages {
    fn after(&self, _worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        if end.due.validate || end.due.save || end.last {
            crate::heap::release_free();
        }
        Ok(())
    }
}

/// A validation on the rank's shard, its record, the watches it feeds (a plateau's rate,
/// early stopping) and the workload's callback; its time is left out of the throughput.
struct Validation;

impl<W: Workload> AfterStep<W> for Validation {
    fn after(&self, worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        if !end.due.validate {
            return Ok(());
        }
        let t0 = Instant::now();
        let (scores, metrics) = worker.validate(&end.strategy.full_model()?)?;
        end.kept.val.record(end.state.step, scores);
        end.log.validation(end.state, scores, &metrics)?;
        end.early = worker.watch(end.state, scores, &metrics)?;
        let mut values = vec![("loss".to_string(), scores.0)];
        values.extend(scores.1.map(|a| ("accuracy".to_string(), a)));
        values.extend(metrics);
        worker.notify(EventKind::Validated, end.state, &values, end.strategy)?;
        end.log.exclude(t0.elapsed().as_secs_f64());
        Ok(())
    }
}

/// The workload's callback at an epoch's end.
struct EpochEnd;

impl<W: Workload> AfterStep<W> for EpochEnd {
    fn after(&self, worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        if end.due.epoch_end {
            worker.notify(EventKind::EpochEnd, end.state, &[], end.strategy)?;
        }
        Ok(())
    }
}

/// The checkpoint when one is due — and when early stopping ends the run, which ends with
/// one; its stall is left out of the throughput.
struct Checkpoint;

impl<W: Workload> AfterStep<W> for Checkpoint {
    fn after(&self, worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        if !(end.due.save || (end.early.is_some() && !end.last)) {
            return Ok(());
        }
        let k = &mut *end.kept;
        end.state.wall_seconds = k.wall + k.started.elapsed().as_secs_f64();
        let final_one = end.last || end.due.signal.is_some() || end.early.is_some();
        let comm = worker.place.comm.as_ref();
        let stall = k
            .saver
            .save(end.strategy, end.state, &k.val, comm, final_one)?;
        end.log.exclude(stall);
        Ok(())
    }
}

/// The workload's snapshot of the whole model, on rank 0.
struct Snapshot;

impl<W: Workload> AfterStep<W> for Snapshot {
    fn after(&self, worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        if !Checkpointer::snapshot_due(worker.workload, end.state.step, end.last) {
            return Ok(());
        }
        let t0 = Instant::now();
        let lead = worker.rank() == 0;
        let (step, policy) = (end.state.step, &worker.policy);
        (end.kept.saver).snapshot(worker.workload, end.strategy, step, policy, lead)?;
        end.log.exclude(t0.elapsed().as_secs_f64());
        Ok(())
    }
}

/// The run stops after this step at an agreed signal (its checkpoint written), or when early
/// stopping acted before the last step.
struct Stop;

impl<W: Workload> AfterStep<W> for Stop {
    fn after(&self, worker: &Worker<'_, W>, end: &mut StepEnd<'_, '_, W>) -> Result<()> {
        if let Some(signal) = end.due.signal {
            // No rank leaves before rank 0's checkpoint is on disk: a launcher takes the job
            // down when its first process exits.
            if worker.world() > 1 {
                worker.place.comm.barrier()?;
            }
            end.stop = Some(Stopped::Signal(crate::signal::name(signal)));
        } else if let Some(reason) = end.early.take()
            && !end.last
        {
            end.stop = Some(Stopped::Early(reason));
        }
        Ok(())
    }
}
