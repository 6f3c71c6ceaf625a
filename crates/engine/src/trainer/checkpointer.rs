//! Checkpoints and snapshots: when they are due, and writing them — gathered (the whole model
//! and optimizer state gathered by every rank, written by rank 0) or sharded (each rank's
//! share copied on the step's thread and written by the rank in parallel, rank 0 sealing the
//! checkpoint once every rank's share is there).

use std::cell::RefCell;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use burn::module::Module;

use super::validate::Validator;
use super::workload::Workload;
use crate::checkpoint;
use crate::comm::Collective;
use crate::config::{CheckpointFormat, TrainConfig};
use crate::error::{Error, Result};
use crate::precision::Policy;
use crate::state::LoopState;
use crate::strategy::Strategy;

/// When checkpoints are taken, where they go, and the write in flight.
pub(super) struct Checkpointer {
    run_dir: PathBuf,
    every: Option<usize>,
    keep: usize,
    /// The validation metric that picks the best checkpoint (every checkpoint is scored).
    best: Option<String>,
    /// Whether checkpoints but the last are written in the background
    /// (`train.checkpoint_async`).
    background: bool,
    /// Whether each rank writes its own share (`train.checkpoint_format`).
    sharded: bool,
    /// Set when the run ends with a write in flight: rank 0 stops waiting for shares that
    /// do not come.
    cancel: Arc<AtomicBool>,
    /// The background write in flight: its step and its thread.
    writing: RefCell<Option<(usize, JoinHandle<Result<PathBuf>>)>>,
    /// Each checkpoint's time on the step's path (gathering, waiting for the write before it,
    /// writing where that is not in the background), in seconds.
    stalls: RefCell<Vec<f64>>,
    /// The process's heap peak as the first checkpoint began.
    heap_before: std::cell::Cell<Option<usize>>,
}

impl Checkpointer {
    pub fn new(train: &TrainConfig, run_dir: PathBuf) -> Self {
        Self {
            run_dir,
            every: train.checkpoint_every,
            keep: train.keep_checkpoints,
            best: train.best_metric.clone(),
            background: train.checkpoint_async,
            sharded: train.checkpoint_format == CheckpointFormat::Sharded,
            cancel: Arc::new(AtomicBool::new(false)),
            writing: RefCell::new(None),
            stalls: RefCell::new(Vec::new()),
            heap_before: std::cell::Cell::new(None),
        }
    }

    /// Whether a checkpoint is due after `step`: every `train.checkpoint_every` steps, after
    /// the last one, and when a signal stops the run.
    pub fn due(&self, step: usize, last: bool, signalled: bool) -> bool {
        self.every.is_some_and(|n| step.is_multiple_of(n)) || last || signalled
    }

    /// Whether checkpoints are scored by a validation (`train.best_metric`).
    pub fn scored(&self) -> bool {
        self.best.is_some()
    }

    /// Takes the checkpoint of `state` from the strategy's whole model and optimizer states,
    /// scored by `val` when it validated at this step; every rank takes part in gathering
    /// them. Rank 0 writes them: in the background (`train.checkpoint_async`), after the write
    /// before it has landed, or — for the run's `last` checkpoint, and with the setting off —
    /// before any rank goes on. Returns the seconds the checkpoint held the step up.
    pub fn save<M: burn::module::Module + 'static, B>(
        &self,
        strategy: &mut dyn Strategy<M, B>,
        state: &LoopState,
        val: &Validator,
        comm: &dyn Collective,
        last: bool,
    ) -> Result<f64> {
        if self.heap_before.get().is_none() {
            self.heap_before.set(crate::heap::peak());
        }
        if self.sharded {
            return self.save_sharded(strategy, state, val, comm, last);
        }
        let t0 = Instant::now();
        let model = strategy.full_model()?;
        let optim = strategy.optimizer_states()?;
        if let Some(optim) = optim.filter(|_| comm.rank() == 0) {
            self.still_ours()?;
            self.wait()?;
            let score = self.score(val, state.step);
            let step = state.step;
            // The record now, on the step's thread: the model's buffers are shared with the
            // training model, which the next steps update while a background write runs.
            let record = model.into_record();
            let (run_dir, keep, state) = (self.run_dir.clone(), self.keep, state.clone());
            let write = move || {
                if let Some(delay) = super::faults::write_delay(0, state.step) {
                    std::thread::sleep(delay);
                }
                checkpoint::save_record(&run_dir, record, &optim, &state, keep, scored(&score))
            };
            if self.background && !last {
                self.in_background(step, write)?;
            } else {
                write()?;
            }
        }
        comm.barrier()?;
        let stall = t0.elapsed().as_secs_f64();
        self.stalls.borrow_mut().push(stall);
        Ok(stall)
    }

    /// [`Self::save`] of a sharded checkpoint: rank 0 makes the checkpoint's temporary
    /// directory; every rank copies its share on the step's thread and writes it (in the
    /// background, as [`Self::save`] says), rank 0 then sealing and landing the checkpoint
    /// once every rank's share is on disk.
    fn save_sharded<M: burn::module::Module + 'static, B>(
        &self,
        strategy: &mut dyn Strategy<M, B>,
        state: &LoopState,
        val: &Validator,
        comm: &dyn Collective,
        last: bool,
    ) -> Result<f64> {
        let t0 = Instant::now();
        let (rank, world) = (comm.rank(), comm.world_size());
        // This rank's write before this one has landed (and rank 0's sealed that checkpoint).
        self.wait()?;
        if rank == 0 {
            self.still_ours()?;
            checkpoint::begin_sharded(&self.run_dir, state.step)?;
        }
        comm.barrier()?;
        let share = strategy.checkpoint_share()?;
        let score = self.score(val, state.step).filter(|_| rank == 0);
        let step = state.step;
        let tmp = checkpoint::sharded_tmp(&self.run_dir, step);
        let (run_dir, keep, state) = (self.run_dir.clone(), self.keep, state.clone());
        let cancel = self.cancel.clone();
        let kept_tmp = tmp.clone();
        let write = move || {
            if let Some(delay) = super::faults::write_delay(rank, state.step) {
                std::thread::sleep(delay);
            }
            let written = if super::faults::write_fails(rank, state.step) {
                Err(Error::checkpoint(format!(
                    "{}: injected failure of rank {rank}'s write ({})",
                    tmp.join(checkpoint::rank_file(rank)).display(),
                    super::faults::FAULT_VAR
                )))
            } else {
                checkpoint::write_share(&tmp, rank, world, share)
            };
            if let Err(e) = written {
                checkpoint::note_failure(&tmp, rank, &e);
                return Err(e);
            }
            if rank != 0 {
                return Ok(tmp);
            }
            let cancelled = || cancel.load(Ordering::Relaxed);
            checkpoint::finish_sharded(&run_dir, world, &state, keep, scored(&score), &cancelled)
        };
        if self.background && !last {
            self.in_background(step, write)?;
        } else {
            if let Err(e) = write() {
                // Nothing half-written stays (the run ends; the other ranks' writes fail too).
                if rank == 0 {
                    let _ = std::fs::remove_dir_all(&kept_tmp);
                }
                return Err(e);
            }
            // Rank 0 has landed it: no rank goes on before.
            comm.barrier()?;
        }
        let stall = t0.elapsed().as_secs_f64();
        self.stalls.borrow_mut().push(stall);
        Ok(stall)
    }

    /// Refuses to write into the run directory once another run took it over (its lease had
    /// lapsed).
    fn still_ours(&self) -> Result<()> {
        match crate::runlock::lost(&self.run_dir) {
            Some(holder) => Err(Error::checkpoint(format!(
                "{}: {} took this run's directory over (its lease had lapsed): this run stops \
                 rather than write into it",
                self.run_dir.join(crate::runlock::LOCK_FILE).display(),
                holder.describe()
            ))),
            None => Ok(()),
        }
    }

    /// The checkpoint's score by `train.best_metric`, when it validated at `step`.
    fn score(&self, val: &Validator, step: usize) -> Option<(String, f64)> {
        let metric = self.best.clone()?;
        let value = val.score(&metric, step)?;
        Some((metric, value))
    }

    /// Runs `write`, the write of step `step`'s checkpoint, on a thread of its own: the write
    /// in flight, which the next checkpoint and the end wait for.
    fn in_background(
        &self,
        step: usize,
        write: impl FnOnce() -> Result<PathBuf> + Send + 'static,
    ) -> Result<()> {
        let writer = std::thread::Builder::new()
            .name(format!("kiln-checkpoint-{step}"))
            .spawn(write)
            .map_err(|e| Error::io(&self.run_dir, e))?;
        *self.writing.borrow_mut() = Some((step, writer));
        Ok(())
    }

    /// Waits for the background write in flight, if one is; its error is the run's.
    pub fn wait(&self) -> Result<()> {
        let Some((step, writer)) = self.writing.borrow_mut().take() else {
            return Ok(());
        };
        match writer.join() {
            Ok(written) => written.map(|_| ()),
            Err(panic) => Err(Error::checkpoint(format!(
                "{}: the writer of step {step}'s checkpoint failed: {}",
                self.run_dir.display(),
                crate::panics::panic_message(&panic)
            ))),
        }
    }

    /// The process's heap peak as the first checkpoint began (`None` before one, or without
    /// kiln's allocator).
    pub fn heap_before(&self) -> Option<usize> {
        self.heap_before.get()
    }

    /// Each checkpoint's seconds on the step's path, in order.
    pub fn stalls(&self) -> Vec<f64> {
        self.stalls.borrow().clone()
    }

    /// Whether `workload`'s snapshot is due after `step`.
    pub fn snapshot_due<W: Workload>(workload: &W, step: usize, last: bool) -> bool {
        workload
            .snapshot_every()
            .is_some_and(|n| last || (n > 0 && step.is_multiple_of(n)))
    }

    /// Runs `workload`'s snapshot of the whole model (its weights in f32) on rank 0.
    pub fn snapshot<W: Workload>(
        &self,
        workload: &W,
        strategy: &mut dyn Strategy<W::Model, W::Batch>,
        step: usize,
        policy: &Policy,
        lead: bool,
    ) -> Result<()> {
        let model = strategy.full_model()?;
        if lead {
            let model = policy.export(model);
            workload.snapshot(step, &model.valid(), &self.run_dir)?;
        }
        Ok(())
    }
}

/// A score as the checkpoint store takes it.
fn scored(score: &Option<(String, f64)>) -> Option<checkpoint::Score<'_>> {
    score.as_ref().map(|(metric, value)| checkpoint::Score {
        metric,
        value: *value,
    })
}

impl Drop for Checkpointer {
    /// A run that fails while a checkpoint is being written still lands it: only a crash
    /// loses the write in flight, and then the checkpoint before it is the newest whole one.
    fn drop(&mut self) {
        // Rank 0 waits a little for the other ranks' shares, not for ranks that are gone.
        self.cancel.store(true, Ordering::Relaxed);
        if let Err(e) = self.wait() {
            eprintln!("warning: {e}");
        }
    }
}
