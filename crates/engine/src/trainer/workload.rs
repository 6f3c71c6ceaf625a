//! [`Workload`]: a model and its data as the trainer sees them, and the events a workload's
//! callbacks see.

use std::ops::Range;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::BlockStack;

use crate::error::Result;

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
    /// The samples of slot `slot` of `slots` at optimizer step `step`, `batch` of them, for
    /// workloads that draw their own (text windows from seed and step). A step's samples are
    /// `slots × batch`, cut into `slots` equal parts, one per (micro-batch, data-parallel rank)
    /// pair (`slot = micro × ranks + rank`): a workload whose samples are a function of the step
    /// and of their position in it gives every step the same samples however it is split
    /// into devices and accumulation — which a restart on fewer devices relies on. `None`, the
    /// default, uses the epoch-shuffled sampler, which has the same property.
    fn sample(&self, step: usize, slot: usize, slots: usize, batch: usize) -> Option<Vec<usize>> {
        let _ = (step, slot, slots, batch);
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
