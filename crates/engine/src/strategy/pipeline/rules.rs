//! The pipeline's rules: stages divide the ranks, no more stages than blocks, and what each
//! stage is expected to hold.

use crate::config::{OptimConfig, PipelineConfig, PipelineSchedule, StrategyKind, name_of};
use crate::error::{Error, Result};
use crate::params::FlatLayout;
use crate::strategy::pipeline::partition;
use crate::strategy::rules::{
    Checks, Costs, Estimate, ModelFacts, Op, Room, Setup, Shape, Traffic, Variant, Words,
    state_tensors,
};

/// The pipeline's rules: stages divide the ranks, and no more stages than blocks.
pub struct Pipeline;

/// The pipeline's own section of `setup`, which its rules read.
fn section(setup: &Setup) -> &PipelineConfig {
    setup.own.pipeline()
}

impl Checks for Pipeline {
    fn check(&self, setup: &Setup) -> Result<()> {
        let stages = section(setup).stages;
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
        let p = section(setup);
        stage_elements(&model.layout, p.stages, p.cuts.as_deref()).map(|_| ())
    }

    fn fixed_devices(&self) -> Option<&'static str> {
        Some(
            "a pipeline's stages need their devices: train launch keeps a pipeline on the \
             devices it started with",
        )
    }
}

impl Words for Pipeline {
    fn describe(&self, setup: &Setup) -> String {
        let p = section(setup);
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
        let p = section(setup);
        format!(
            "{batch} per micro-batch × {} micro-batches × {} pipelines × {accumulate} \
             accumulation = {per_step} per step",
            p.microbatches,
            setup.world / p.stages
        )
    }

    fn words(&self, setup: &Setup) -> String {
        let p = section(setup);
        words(p.stages, p.microbatches, p.schedule)
    }
}

impl Costs for Pipeline {
    /// The heaviest stage's figures.
    fn estimate(
        &self,
        layout: &FlatLayout,
        optim: &OptimConfig,
        setup: &Setup,
    ) -> Result<Estimate> {
        let p = section(setup);
        let stage = stage_elements(layout, p.stages, p.cuts.as_deref())?;
        let policy = &setup.policy;
        Ok(Estimate {
            params: policy.master_bytes(stage) + policy.compute_copy_bytes(stage),
            grads: stage * 4,
            optim: state_tensors(optim) * policy.master_bytes(stage),
        })
    }

    /// Each stage count that divides a process's devices (a stage per device, no more stages
    /// than blocks), under both schedules, with as many and twice as many micro-batches as
    /// stages.
    fn variants(&self, room: &Room) -> Vec<Variant> {
        let mut out = Vec::new();
        if room.world < 2 {
            return out;
        }
        let fits = |s: &usize| room.devices.is_multiple_of(*s) && *s <= room.blocks;
        for stages in (2..=room.world).filter(fits) {
            for schedule in [PipelineSchedule::OneFOneB, PipelineSchedule::Gpipe] {
                for microbatches in [stages, 2 * stages] {
                    out.push(Variant {
                        kind: StrategyKind::Pipeline,
                        stages,
                        microbatches,
                        pipeline: PipelineConfig {
                            stages,
                            microbatches,
                            schedule,
                            cuts: None,
                        },
                        words: words(stages, microbatches, schedule),
                    });
                }
            }
        }
        out
    }

    /// Probed per stage count.
    fn probe_as(&self, setup: &Setup) -> String {
        format!("pipeline-{}", section(setup).stages)
    }

    /// The replicas of each stage average its gradients.
    fn traffic(&self, setup: &Setup, floats: usize, _local: usize) -> Vec<Traffic> {
        let stages = section(setup).stages;
        if setup.world > stages {
            vec![Traffic::once(Op::AllReduce, floats / stages)]
        } else {
            Vec::new()
        }
    }

    /// A stage holds the activations of every micro-batch in flight: all of a flush under
    /// GPipe, at most its stage count under 1F1B.
    fn in_flight(&self, setup: &Setup) -> usize {
        let p = section(setup);
        match p.schedule {
            PipelineSchedule::Gpipe => p.microbatches,
            PipelineSchedule::OneFOneB => p.microbatches.min(p.stages),
        }
    }

    fn waits_are_work(&self) -> bool {
        true
    }

    /// A pipeline's micro-batches are BatchNorm's batches.
    fn own_micro_batches(&self) -> bool {
        true
    }

    fn simplicity(&self) -> usize {
        5
    }
}

impl Shape for Pipeline {
    fn stages(&self, setup: &Setup) -> usize {
        section(setup).stages
    }

    fn flush(&self, setup: &Setup) -> usize {
        section(setup).microbatches
    }
}

/// The planner's words for a pipeline.
fn words(stages: usize, microbatches: usize, schedule: PipelineSchedule) -> String {
    format!("pipeline {stages}×{microbatches} {}", name_of(&schedule))
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
