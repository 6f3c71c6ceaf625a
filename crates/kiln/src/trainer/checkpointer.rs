//! Checkpoints and snapshots: when they are due, and writing them from the whole model
//! (gathered by every rank, written by rank 0).

use std::path::PathBuf;

use burn::module::Module;

use super::validate::Validator;
use super::workload::Workload;
use crate::checkpoint;
use crate::comm::Collective;
use crate::config::TrainConfig;
use crate::error::Result;
use crate::precision::Policy;
use crate::state::LoopState;
use crate::strategy::Strategy;

/// When checkpoints are taken and where they go.
pub(super) struct Checkpointer {
    run_dir: PathBuf,
    every: Option<usize>,
    keep: usize,
    /// The validation metric that picks the best checkpoint (every checkpoint is scored).
    best: Option<String>,
}

impl Checkpointer {
    pub fn new(train: &TrainConfig, run_dir: PathBuf) -> Self {
        Self {
            run_dir,
            every: train.checkpoint_every,
            keep: train.keep_checkpoints,
            best: train.best_metric.clone(),
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

    /// Writes the checkpoint of `state` (on rank 0) from the strategy's whole model and
    /// optimizer states, scored by `val` when it validated at this step; every rank takes
    /// part, and none runs ahead of a checkpoint that has not landed.
    pub fn save<M: burn::module::Module, B>(
        &self,
        strategy: &mut dyn Strategy<M, B>,
        state: &LoopState,
        val: &Validator,
        comm: &dyn Collective,
    ) -> Result<()> {
        let model = strategy.full_model()?;
        let optim = strategy.optimizer_states()?;
        if let Some(optim) = optim.filter(|_| comm.rank() == 0) {
            if let Some(holder) = crate::runlock::lost(&self.run_dir) {
                return Err(crate::error::Error::checkpoint(format!(
                    "{}: {} took this run's directory over (its lease had lapsed): this run \
                     stops rather than write into it",
                    self.run_dir.join(crate::runlock::LOCK_FILE).display(),
                    holder.describe()
                )));
            }
            let score = self.best.as_deref().and_then(|metric| {
                let value = val.score(metric, state.step)?;
                Some(checkpoint::Score { metric, value })
            });
            checkpoint::save(&self.run_dir, &model, &optim, state, self.keep, score)?;
        }
        comm.barrier()
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
