//! The pipeline's rules: stages divide the ranks, no more stages than blocks, and what each
//! stage is expected to hold.

use crate::config::{OptimConfig, name_of};
use crate::error::{Error, Result};
use crate::params::FlatLayout;
use crate::strategy::pipeline::partition;
use crate::strategy::rules::{Estimate, ModelFacts, Rules, Setup, state_tensors};

/// The pipeline's rules: stages divide the ranks, and no more stages than blocks.
pub struct Pipeline;

impl Rules for Pipeline {
    fn check(&self, setup: &Setup) -> Result<()> {
        let stages = setup.pipeline.stages;
        if !setup.world.is_multiple_of(stages) {
            return Err(Error::config(format!(
                "key `pipeline.stages`: {stages} stages must divide the {} devices (devices / \
                 stages pipelines train as replicas)",
                setup.world
            )));
        }
        Ok(())
    }

    fn check_model(&self, model: &ModelFacts, setup: &Setup) -> Result<()> {
        let p = &setup.pipeline;
        stage_elements(&model.layout, p.stages, p.cuts.as_deref()).map(|_| ())
    }

    fn describe(&self, setup: &Setup) -> String {
        let p = &setup.pipeline;
        format!(
            "pipeline ({} stages × {} replicas, {} micro-batches per flush, {})",
            p.stages,
            setup.world / p.stages,
            p.microbatches,
            name_of(&p.schedule)
        )
    }

    fn batch_line(
        &self,
        setup: &Setup,
        batch: usize,
        accumulate: usize,
        per_step: usize,
    ) -> String {
        let p = &setup.pipeline;
        format!(
            "{batch} per micro-batch × {} micro-batches × {} pipelines × {accumulate} \
             accumulation = {per_step} per step",
            p.microbatches,
            setup.world / p.stages
        )
    }

    /// The heaviest stage's figures.
    fn estimate(
        &self,
        layout: &FlatLayout,
        optim: &OptimConfig,
        setup: &Setup,
    ) -> Result<Estimate> {
        let p = &setup.pipeline;
        let stage = stage_elements(layout, p.stages, p.cuts.as_deref())?;
        let policy = &setup.policy;
        Ok(Estimate {
            params: policy.master_bytes(stage) + policy.compute_copy_bytes(stage),
            grads: stage * 4,
            optim: state_tensors(optim) * policy.master_bytes(stage),
        })
    }

    fn stages(&self, setup: &Setup) -> usize {
        setup.pipeline.stages
    }

    fn flush(&self, setup: &Setup) -> usize {
        setup.pipeline.microbatches
    }
}

/// The parameter elements of the heaviest stage: its blocks', and on the first and last stage
/// the parameters outside the blocks.
pub(super) fn stage_elements(
    layout: &FlatLayout,
    stages: usize,
    cuts: Option<&[usize]>,
) -> Result<usize> {
    let weights: Vec<usize> = layout.units[1..].iter().map(|u| u.len).collect();
    let cuts = partition::cuts(&weights, stages, cuts)?;
    Ok((0..stages)
        .map(|s| {
            let own: usize = weights[cuts[s]..cuts[s + 1]].iter().sum();
            own + if s == 0 || s + 1 == stages {
                layout.units[0].len
            } else {
                0
            }
        })
        .max()
        .unwrap_or(0))
}
