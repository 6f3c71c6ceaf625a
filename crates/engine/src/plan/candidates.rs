//! The candidates: every strategy (a pipeline with each stage count and schedule) ×
//! precision × recompute × micro-batch and accumulation that gives the run's samples per
//! step on its ranks, each as the config that would run it.

use crate::config::{PrecisionMode, RecomputeMode, RootConfig, name_of};
use crate::strategy::{ModelFacts, Room, all_rules};

/// One way to run the step, as the config that runs it.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    /// The config (the user's, with this candidate's keys).
    pub config: RootConfig,
    /// Its strategy's words (a pipeline's stages, micro-batches and schedule).
    pub words: String,
}

impl Candidate {
    /// The `--strategy`/`--set` flags that turn `base` into this candidate: only what differs.
    pub fn flags(&self, base: &RootConfig) -> Vec<String> {
        let (c, b) = (&self.config, base);
        let mut out = Vec::new();
        if c.strategy.name != b.strategy.name {
            out.push(format!("--strategy {}", name_of(&c.strategy.name)));
        }
        if c.parallel.tp != b.parallel.tp {
            out.push(format!("--mesh tp={}", c.parallel.tp));
        }
        let mut set = |key: &str, new: String, old: String| {
            if new != old {
                out.push(format!("--set {key}={new}"));
            }
        };
        set(
            "train.batch_size",
            c.train.batch_size.to_string(),
            b.train.batch_size.to_string(),
        );
        set(
            "train.accumulate",
            c.train.accumulate.to_string(),
            b.train.accumulate.to_string(),
        );
        let quoted = |s: String| format!("\"{s}\"");
        set(
            "precision.mode",
            quoted(name_of(&c.precision.mode)),
            quoted(name_of(&b.precision.mode)),
        );
        set(
            "recompute.mode",
            quoted(name_of(&c.recompute.mode)),
            quoted(name_of(&b.recompute.mode)),
        );
        let (p, q) = (&c.pipeline, &b.pipeline);
        set(
            "pipeline.stages",
            p.stages.to_string(),
            q.stages.to_string(),
        );
        set(
            "pipeline.microbatches",
            p.microbatches.to_string(),
            q.microbatches.to_string(),
        );
        set(
            "pipeline.schedule",
            quoted(name_of(&p.schedule)),
            quoted(name_of(&q.schedule)),
        );
        out
    }

    /// The candidate's words: strategy (a pipeline's stages, micro-batches and schedule).
    pub fn strategy_words(&self) -> String {
        self.words.clone()
    }
}

/// Every candidate for `base` on `world` ranks (`processes` of them processes) giving
/// `samples` samples per step, in each of `precisions`.
pub(crate) fn candidates(
    base: &RootConfig,
    world: usize,
    processes: usize,
    samples: usize,
    facts: &ModelFacts,
    precisions: &[PrecisionMode],
) -> Vec<Candidate> {
    // Under tensor parallelism the strategies run over the data dimension: one rank of each
    // group of `tp`.
    let tp = base.parallel.tp.max(1);
    let (world, processes) = ((world / tp).max(1), processes.min((world / tp).max(1)));
    // Each strategy says where it runs and in which variants; the planner names none.
    let room = Room {
        world,
        processes,
        devices: world / processes.max(1),
        blocks: facts.blocks,
    };
    let variants: Vec<_> = all_rules().iter().flat_map(|r| r.variants(&room)).collect();
    let recomputes = if facts.blocks > 0 && facts.deterministic {
        let mut r = vec![base.recompute.mode];
        for m in [RecomputeMode::None, RecomputeMode::Blocks] {
            if !r.contains(&m) {
                r.push(m);
            }
        }
        r
    } else {
        vec![base.recompute.mode]
    };
    let mut out = Vec::new();
    for v in &variants {
        let m = v.microbatches;
        // Samples each replica of the model takes per step (a pipeline's stages share one).
        let replicas = world / v.stages;
        if !samples.is_multiple_of(replicas) {
            continue;
        }
        let per_replica = samples / replicas;
        for accumulate in accumulations(base, per_replica / m) {
            if !per_replica.is_multiple_of(m * accumulate) {
                continue;
            }
            let batch = per_replica / (m * accumulate);
            for &precision in precisions {
                for &recompute in &recomputes {
                    let mut c = base.clone();
                    c.strategy.name = v.kind;
                    c.pipeline = v.pipeline.clone();
                    c.train.batch_size = batch;
                    c.train.accumulate = accumulate;
                    c.precision.mode = precision;
                    c.recompute.mode = recompute;
                    let words = if tp > 1 {
                        format!("tp {tp} × {}", v.words)
                    } else {
                        v.words.clone()
                    };
                    out.push(Candidate { config: c, words });
                }
            }
        }
    }
    out
}

/// The accumulation steps weighed for `per_rank` samples per rank and step: 1, 2 and 4 where
/// they divide, and the run's own.
fn accumulations(base: &RootConfig, per_rank: usize) -> Vec<usize> {
    let own = base.train.accumulate;
    let mut out = Vec::new();
    let mut push = |a: usize| {
        if a >= 1 && !out.contains(&a) && per_rank >= a && per_rank.is_multiple_of(a) {
            out.push(a);
        }
    };
    for a in [1, 2, 4] {
        push(a);
    }
    // The run's own, where its micro-batch is the same on these ranks.
    push(own.min(per_rank.max(1)));
    if out.is_empty() {
        out.push(1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StrategyKind;
    use crate::params::FlatLayout;

    fn facts(blocks: usize) -> ModelFacts {
        ModelFacts {
            blocks,
            deterministic: true,
            buffers: false,
            groups: Vec::new(),
            layout: {
                let linear = burn::nn::LinearConfig::new(2, 3).init(&burn::prelude::Device::flex());
                FlatLayout::new(&linear, &[], 1)
            },
            tp_floats: None,
        }
    }

    #[test]
    fn candidates_keep_the_samples_per_step_and_name_their_flags() {
        let base = RootConfig::load(None, &["train.batch_size=8".to_string()]).unwrap();
        let precisions = [PrecisionMode::F32, PrecisionMode::Bf16Mixed];
        let all = candidates(&base, 2, 1, 16, &facts(4), &precisions);
        let kinds: Vec<String> = all.iter().map(Candidate::strategy_words).collect();
        for k in [
            "ddp",
            "zero1",
            "zero2",
            "zero3",
            "pipeline 2×2 1f1b",
            "pipeline 2×4 gpipe",
        ] {
            assert!(kinds.iter().any(|w| w == k), "{k} missing from {kinds:?}");
        }
        for c in &all {
            let t = &c.config.train;
            let p = &c.config.pipeline;
            assert_eq!(
                t.batch_size * t.accumulate * p.microbatches * 2 / p.stages,
                16
            );
        }
        // Only what differs from the config given.
        let zero2 = all
            .iter()
            .find(|c| c.strategy_words() == "zero2" && c.config.train.accumulate == 2)
            .unwrap();
        assert_eq!(
            zero2.flags(&base),
            [
                "--strategy zero2",
                "--set train.batch_size=4",
                "--set train.accumulate=2"
            ]
        );
        // One device: one strategy; a model without blocks is neither piped nor recomputed.
        let one = candidates(&base, 1, 1, 8, &facts(0), &precisions[..1]);
        assert!(
            one.iter()
                .all(|c| c.config.strategy.name == StrategyKind::Single)
        );
        assert!(
            one.iter()
                .all(|c| c.config.recompute.mode == RecomputeMode::None)
        );
        assert!(
            one.iter()
                .all(|c| c.config.precision.mode == PrecisionMode::F32)
        );
        assert!(
            all.iter()
                .any(|c| c.config.precision.mode == PrecisionMode::Bf16Mixed)
        );
    }
}
