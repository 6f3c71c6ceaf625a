//! `zero2` (ZeRO stage 2): replicated parameters, sharded gradients and optimizer state.
//!
//! Burn's `backward()` returns every gradient at once, so the micro-step runs as the block
//! walk ([`crate::exec`]), keeping each block's activations unless `recompute` says otherwise:
//! each part's gradients (the head's, each block's, the stem's) are reduce-scattered as soon as
//! its backward is done and then dropped. A rank holds at most its gradient shard plus one
//! unit's whole gradient. A model that describes no blocks is refused: its whole gradient
//! would exist at once beside the shard (`zero1` shards its optimizer state). With
//! accumulation the reduce-scatter runs on every micro-step (the
//! rank keeps no whole gradient to accumulate into), as DeepSpeed's stage 2 does. With
//! `dist.overlap`, the reduce-scatters run on a communication thread while the rank computes
//! the blocks below, at most two units' gradients waiting for it.

use burn::module::Module;

use super::ddp::several;
use super::kit::RankKit;
use super::replica::{Held, Reduction, Replica, SCATTERS_IN_FLIGHT, step_shard};
use super::rules::{
    Checks, Costs, Estimate, ModelFacts, Op, Room, Setup, Shape, Traffic, Variant, Words,
    replicated_estimate,
};
use super::update::Norm;
use crate::config::OptimConfig;
use crate::error::{Error, Result};
use crate::params::FlatLayout;
use crate::precision::LossScaler;

/// Sharded gradients and optimizer state over replicated parameters.
pub struct Zero2;

impl Checks for Zero2 {
    fn check_model(&self, model: &ModelFacts, _setup: &Setup) -> Result<()> {
        if model.blocks == 0 {
            return Err(Error::config(
                "key `strategy.name`: \"zero2\" reduce-scatters each block's gradients as its \
                 backward ends, so that a rank holds one block's whole gradient besides its \
                 shard; this model describes no blocks (its BlockStack's num_blocks is 0), so \
                 its whole gradient would exist at once next to the shard, more than ddp holds; \
                 describe its blocks, or use strategy \"zero1\" (optimizer state sharded, \
                 gradients as ddp)",
            ));
        }
        Ok(())
    }
}

impl Words for Zero2 {
    fn describe(&self, setup: &Setup) -> String {
        format!(
            "zero2 (gradients and optimizer state sharded over {}; each block's gradients \
             reduce-scattered as its backward ends)",
            setup.world
        )
    }
}

impl Costs for Zero2 {
    fn estimate(
        &self,
        layout: &FlatLayout,
        optim: &OptimConfig,
        setup: &Setup,
    ) -> Result<Estimate> {
        let sharded = layout.with_shards(setup.world);
        let shard = sharded.shard_len;
        Ok(replicated_estimate(
            layout,
            optim,
            setup,
            shard + scattering(setup) * sharded.largest_unit(),
            shard,
        ))
    }

    fn variants(&self, room: &Room) -> Vec<Variant> {
        several(room, crate::config::StrategyKind::Zero2)
    }

    /// The gradients reduce-scattered as each micro-batch's backward ends; the updated
    /// shards all-gathered once.
    fn traffic(&self, _setup: &Setup, floats: usize, _local: usize) -> Vec<Traffic> {
        vec![
            Traffic::per_micro_batch(Op::ReduceScatter, floats, 1),
            Traffic::once(Op::AllGather, floats),
        ]
    }

    fn simplicity(&self) -> usize {
        2
    }
}

/// One replica per rank, one micro-batch per accumulation step.
impl Shape for Zero2 {}

/// How many units' whole gradients a rank holds at once while it reduce-scatters: one on its
/// own thread; with a communication thread (`dist.overlap`), those waiting for it.
pub(crate) fn scattering(setup: &Setup) -> usize {
    if setup.overlap && setup.world > 1 {
        SCATTERS_IN_FLIGHT
    } else {
        1
    }
}

impl Reduction for Zero2 {
    fn scatters(&self) -> bool {
        true
    }

    fn step<M: Module>(
        &self,
        kit: &mut RankKit,
        replica: &mut Replica<M>,
        held: &mut Held<M>,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        let grads = match held {
            Held::Shard(shard) => std::mem::take(shard),
            Held::Local(_) | Held::Reduced(_) => {
                unreachable!("zero2 reduce-scatters into a shard")
            }
        };
        step_shard(kit, replica, grads, lr, scaler, clip, Norm::Shards)
    }
}
