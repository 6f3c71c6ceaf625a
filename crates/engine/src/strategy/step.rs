//! [`Strategy`]: what one rank's step does across ranks, as the loop calls it.

use burn::prelude::*;
use kiln_models::StepOutput;

use super::memory::Memory;
use crate::error::{Error, Result};
use crate::optim::{OptimState, Share, Source};
use crate::precision::LossScaler;

/// What one optimizer step does across ranks; see the module documentation. Collective
/// methods (all but [`Strategy::memory`], [`Strategy::take_sync_seconds`] and
/// [`Strategy::nonfinite`]) must be called by every rank in the same order.
pub trait Strategy<M, B> {
    /// Prepares an optimizer step (the compute copy of a lower precision; ZeRO-3 gathers the
    /// parameters that stay gathered for the whole step).
    fn begin_step(&mut self) -> Result<()>;
    /// Forward and backward of the `count` micro-batches of one optimizer step, each taken
    /// from `batches` when the strategy needs it (a pipeline stage that neither embeds nor
    /// scores takes none). `objective` turns a micro-batch's mean loss into what is
    /// differentiated. A batch that could not be built (an error item: a file that does not
    /// decode) ends the step with its error. Returns the outputs (detached, the loss in f32)
    /// of the micro-batches this rank scored.
    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>>;
    /// Whether [`Strategy::micro_steps`] takes batches on this rank (a pipeline's middle
    /// stages take none): the loop's loader builds batches ahead only for ranks that take them.
    fn takes_batches(&self) -> bool {
        true
    }
    /// Reduces what is left to reduce, unscales and checks the gradients (with a scaler),
    /// clips them to `clip` and steps the optimizer at `lr`. Returns whether it stepped (a
    /// scaler skips steps whose gradients overflowed, on every rank alike).
    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool>;
    /// The whole model in its master dtype, its buffers (BatchNorm statistics) brought up to
    /// date and averaged over ranks: what every rank evaluates and rank 0 saves.
    fn full_model(&mut self) -> Result<M>;
    /// The optimizer state in the canonical layout, on rank 0 (`None` elsewhere).
    fn optimizer_state(&mut self) -> Result<Option<OptimState>>;
    /// Takes this rank's part of a canonical optimizer state.
    fn load_optimizer_state(&mut self, state: &OptimState) -> Result<()>;
    /// Every optimizer's canonical state by parameter group, on rank 0: one entry named `""`
    /// for a model with one optimizer.
    fn optimizer_states(&mut self) -> Result<Option<Vec<(String, OptimState)>>> {
        Ok(self.optimizer_state()?.map(|s| vec![(String::new(), s)]))
    }
    /// Takes this rank's part of every group's canonical optimizer state.
    fn load_optimizer_states(&mut self, states: &[(String, OptimState)]) -> Result<()> {
        match states {
            [(name, state)] if name.is_empty() => self.load_optimizer_state(state),
            _ => Err(Error::checkpoint(format!(
                "the checkpoint holds the optimizer states of groups {:?}, but this model \
                 steps one optimizer",
                states.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
            ))),
        }
    }
    /// This rank's share of a sharded checkpoint, copied to the host (collective): by default
    /// the whole model and every optimizer's canonical state on the rank that gathers them
    /// (nothing elsewhere) — what a gathered checkpoint holds; a strategy whose ranks hold
    /// the state in parts gives each rank its own part instead.
    fn checkpoint_share(&mut self) -> Result<Share>
    where
        M: burn::module::Module,
    {
        let model = self.full_model()?;
        Ok(match self.optimizer_states()? {
            Some(states) => Share::whole(model, states),
            None => Share::default(),
        })
    }
    /// Takes this rank's part of the optimizer states of `groups` (`""`: the model's one
    /// optimizer; a strategy's own state under its name) from a sharded checkpoint: by
    /// default each read whole, as a gathered checkpoint gives them; a strategy whose ranks
    /// hold the state in parts reads only its ranges.
    fn load_optimizer_shards(&mut self, source: &dyn Source, groups: &[String]) -> Result<()> {
        let states = groups
            .iter()
            .map(|g| Ok((g.clone(), source.canonical(g)?)))
            .collect::<Result<Vec<_>>>()?;
        self.load_optimizer_states(&states)
    }
    /// Takes this rank's ranges of the parameters from a sharded checkpoint, for a strategy
    /// that [reads its own](crate::strategy::Shape::reads_own_params) (its ranks started from
    /// a model without them); nothing, by default: the rank started from the whole model.
    fn load_param_shards(&mut self, _source: &dyn Source) -> Result<()> {
        Ok(())
    }
    /// Makes parameter group `group` the one that the next [`Strategy::begin_step`],
    /// [`Strategy::micro_steps`] and [`Strategy::optimizer_step`] train (models with several
    /// optimizers; every other strategy has group 0 alone).
    fn select_group(&mut self, group: usize) -> Result<()> {
        if group == 0 {
            Ok(())
        } else {
            Err(Error::Worker(format!(
                "this strategy steps one optimizer; there is no group {group}"
            )))
        }
    }
    /// Fails if the ranks that must hold the same parameters (replicas, tied copies) differ
    /// by even one bit.
    fn check_replicas(&mut self, step: usize) -> Result<()>;
    /// What this strategy adds to a log line (called on every rank when one is due; rank 0's
    /// answer is written).
    fn report(&mut self) -> Result<Report> {
        Ok(Report::default())
    }
    /// The bytes this rank holds, now and at their peaks.
    fn memory(&self) -> Memory;
    /// Seconds spent in collectives since the last call.
    fn take_sync_seconds(&mut self) -> f64;
    /// Whether the last optimizer step was refused because a gradient was not finite (with no
    /// loss scaler to take it as an overflow).
    fn nonfinite(&self) -> bool;
    /// The optimizer steps since the last call that were refused on the device for a gradient
    /// that was not finite, by position (0: the first step since then), read once: where the
    /// check is not read at each step (a rank alone with the context's `decide_on_device`);
    /// empty where [`Strategy::nonfinite`] reported each at its step.
    fn skipped_on_device(&mut self) -> Result<Vec<usize>>;
    /// Whether the last optimizer step's check was kept on the device (nothing in it waited
    /// for the device); `false` where each step reads it, the default.
    fn decided_on_device(&self) -> bool {
        false
    }
}

/// What a strategy adds to a log line: fields of the training record, and records of its own.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Fields added to the training record.
    pub fields: Vec<(String, serde_json::Value)>,
    /// Further records (each with its own `split`).
    pub records: Vec<serde_json::Map<String, serde_json::Value>>,
}

/// Runs `count` micro-batches from `batches` one at a time through `step`, collecting their
/// outputs with the losses in f32.
pub(crate) fn one_by_one<B>(
    batches: &mut dyn Iterator<Item = Result<B>>,
    count: usize,
    mut step: impl FnMut(B) -> Result<StepOutput>,
) -> Result<Vec<StepOutput>> {
    let mut outs = Vec::with_capacity(count);
    for batch in batches.take(count) {
        outs.push(scored(step(batch?)?));
    }
    Ok(outs)
}

/// A detached micro-batch output as the loop keeps it: the loss in f32.
pub(crate) fn scored(out: StepOutput) -> StepOutput {
    StepOutput {
        loss: out.loss.cast(burn::tensor::FloatDType::F32),
        ..out
    }
}
