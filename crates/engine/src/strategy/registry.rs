//! The registry: a strategy kind's rules and its step, the one place that names every
//! strategy.

use burn::module::Module;
use kiln_models::BlockStack;

use super::context::Context;
use super::kit::RankKit;
use super::replica::Replicated;
use super::rules::{Dimension, Own, Rules, Setup, block_ids};
use super::step::Strategy;
use super::tp::{self, TpRank};
use super::{ddp, diloco, groups, pipeline, single, zero1, zero2, zero3};
use crate::config::{RootConfig, StrategyKind, name_of};
use crate::error::{Error, Result};
use crate::params::FlatLayout;
use crate::precision::Policy;

/// The rules of strategy `kind` (`auto` as `single`: resolve it first by the world).
pub fn rules(kind: StrategyKind) -> &'static dyn Rules {
    match kind {
        StrategyKind::Auto | StrategyKind::Single => &single::Single,
        StrategyKind::Ddp => &ddp::Ddp,
        StrategyKind::Zero1 => &zero1::Zero1,
        StrategyKind::Zero2 => &zero2::Zero2,
        StrategyKind::Zero3 => &zero3::Zero3,
        StrategyKind::Pipeline => &pipeline::Pipeline,
        StrategyKind::Diloco => &diloco::Diloco,
    }
}

/// The mesh's dimensions around the data dimension's strategy, in the order the start-up table
/// nests them (the innermost first).
pub static DIMENSIONS: [&dyn Dimension; 1] = [&tp::Tensor];

/// Every strategy's rules, in the order the planner lists its candidates: the simplest first.
pub fn all_rules() -> [&'static dyn Rules; 7] {
    [
        &single::Single,
        &ddp::Ddp,
        &zero1::Zero1,
        &zero2::Zero2,
        &zero3::Zero3,
        &diloco::Diloco,
        &pipeline::Pipeline,
    ]
}

/// Builds strategy `kind` (resolved: not `auto`) for this rank around `model`, a full replica
/// in its master dtype with rank 0's weights.
pub fn build<'a, B: 'a, M>(
    kind: StrategyKind,
    model: M,
    ctx: Context<'a>,
) -> Result<Box<dyn Strategy<M, B> + 'a>>
where
    M: BlockStack<B> + Module + 'static,
{
    // Inside a tensor-parallel group: the strategy steps the rank's part, and the group
    // gathers what leaves the rank.
    let Some(place) = ctx.tp.clone() else {
        return build_data(kind, model, ctx);
    };
    let (rank, size) = (place.comm.rank(), place.comm.world_size());
    let part = kiln_models::tp::cut_by(model, &place.splits, rank, size)
        .map_err(|e| Error::config(format!("key `parallel.tp`: {e}")))?;
    let inner = build_data(kind, part, ctx)?;
    Ok(Box::new(TpRank::new(inner, place)))
}

/// [`build`] for the data dimension: strategy `kind` over `ctx.comm` around `model`.
fn build_data<'a, B: 'a, M>(
    kind: StrategyKind,
    model: M,
    ctx: Context<'a>,
) -> Result<Box<dyn Strategy<M, B> + 'a>>
where
    M: BlockStack<B> + Module + 'static,
{
    let blocks = block_ids(&model);
    let layout = |shards: usize| FlatLayout::new(&model, &blocks, shards);
    let world = ctx.comm.world_size();
    let grouped = !model.param_groups().is_empty();
    Ok(match kind {
        // A model with several optimizers steps one group at a time (checked at start: only
        // these two take one).
        StrategyKind::Auto | StrategyKind::Single if grouped => {
            let whole = RankKit::new(ctx.clone(), layout(1));
            Box::new(groups::Groups::new(model, whole, ctx, false)?)
        }
        StrategyKind::Ddp if grouped => {
            let whole = RankKit::new(ctx.clone(), layout(1));
            Box::new(groups::Groups::new(model, whole, ctx, true)?)
        }
        _ if grouped => {
            return Err(Error::config(format!(
                "key `strategy.name`: {:?} cannot step a model with several optimizers",
                name_of(&kind)
            )));
        }
        StrategyKind::Auto | StrategyKind::Single => {
            let kit = RankKit::new(ctx, layout(1));
            Box::new(Replicated::new(model, kit, single::Single))
        }
        StrategyKind::Ddp => {
            let kit = RankKit::new(ctx, layout(1));
            Box::new(Replicated::new(model, kit, ddp::Ddp))
        }
        StrategyKind::Zero1 => {
            let kit = RankKit::new(ctx, layout(world));
            Box::new(Replicated::new(model, kit, zero1::Zero1))
        }
        StrategyKind::Zero2 => {
            let kit = RankKit::new(ctx, layout(world));
            Box::new(Replicated::new(model, kit, zero2::Zero2))
        }
        StrategyKind::Zero3 => {
            let kit = RankKit::new(ctx, layout(world));
            Box::new(zero3::Sharded::new(model, kit, &blocks)?)
        }
        StrategyKind::Pipeline => Box::new(pipeline::Stage::new(model, &blocks, ctx)?),
        StrategyKind::Diloco => {
            let whole = layout(1);
            Box::new(diloco::Islands::new(model, whole, ctx)?)
        }
    })
}

impl Setup {
    /// The setup `config` describes for `ranks` ranks (`auto` resolved by the ranks the
    /// strategy spans: `ranks / parallel.tp`).
    pub fn new(config: &RootConfig, ranks: usize) -> Self {
        let tp = config.parallel.tp.max(1);
        let world = (ranks / tp).max(1);
        let kind = config.strategy_on(ranks);
        Self {
            kind,
            rules: rules(kind),
            dimensions: &DIMENSIONS,
            world,
            tp,
            ranks,
            dp: config.parallel.dp,
            policy: Policy::new(&config.precision),
            recompute: config.recompute.clone(),
            ddp: config.ddp.clone(),
            own: Own::of(kind, &config.pipeline, &config.diloco),
            overlap: config.dist.overlap.resolve(crate::comm::processes().count),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(overrides: &[&str], processes: usize) -> Result<()> {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        let config = RootConfig::load(None, &o)?;
        let world = config.hardware.devices.indices().len() * processes;
        Setup::new(&config, world).check()
    }

    #[test]
    fn strategies_refuse_what_they_cannot_run() {
        assert!(setup(&["hardware.devices=2"], 1).is_ok());
        let e = setup(&["hardware.devices=2", "strategy.name=\"single\""], 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("strategy.name") && e.contains("2 are selected"),
            "{e}"
        );
        // Two processes of one device each are two ranks.
        assert!(setup(&["strategy.name=\"single\""], 2).is_err());
        let e = setup(&["strategy.name=\"zero3\"", "ddp.sync_batchnorm=true"], 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ddp.sync_batchnorm") && e.contains("zero3"),
            "{e}"
        );
        let e = setup(
            &[
                "hardware.devices=2",
                "strategy.name=\"pipeline\"",
                "pipeline.stages=3",
            ],
            1,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("pipeline.stages") && e.contains("divide"), "{e}");
    }
}
