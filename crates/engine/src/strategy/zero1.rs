//! `zero1` (ZeRO stage 1): replicas as in `ddp`, gradients all-reduced as in `ddp`, but each
//! rank keeps the optimizer state of its shard only and updates only its shard's parameters;
//! the updated shards are then all-gathered into every replica.

use burn::module::Module;
use burn::prelude::*;

use super::ddp::several;
use super::kit::RankKit;
use super::replica::{Held, Reduction, Replica, averaged, step_shard};
use super::rules::{
    Checks, Costs, Estimate, Op, Room, Setup, Shape, Traffic, Variant, Words, replicated_estimate,
};
use super::update::Norm;
use crate::config::OptimConfig;
use crate::error::Result;
use crate::params::FlatLayout;
use crate::precision::LossScaler;

/// Sharded optimizer state over replicated parameters and gradients.
pub struct Zero1;

impl Words for Zero1 {
    fn describe(&self, setup: &Setup) -> String {
        format!("zero1 (optimizer state sharded over {})", setup.world)
    }
}

impl Costs for Zero1 {
    fn estimate(
        &self,
        layout: &FlatLayout,
        optim: &OptimConfig,
        setup: &Setup,
    ) -> Result<Estimate> {
        let shard = layout.with_shards(setup.world).shard_len;
        Ok(replicated_estimate(
            layout,
            optim,
            setup,
            layout.total(),
            shard,
        ))
    }

    fn variants(&self, room: &Room) -> Vec<Variant> {
        several(room, crate::config::StrategyKind::Zero1)
    }

    /// Its forward, backward and buffers are `ddp`'s (its shard is in the estimate).
    fn probe_as(&self, _setup: &Setup) -> String {
        "ddp".to_string()
    }

    /// `ddp`'s all-reduce, then the updated shards all-gathered.
    fn traffic(&self, _setup: &Setup, floats: usize, _local: usize) -> Vec<Traffic> {
        vec![
            Traffic::once(Op::AllReduce, floats),
            Traffic::once(Op::AllGather, floats),
        ]
    }

    fn simplicity(&self) -> usize {
        1
    }
}

/// Nothing it refuses beyond what every strategy does.
impl Checks for Zero1 {}

/// One replica per rank, one micro-batch per accumulation step.
impl Shape for Zero1 {}

/// This rank's pieces of `padded`, the concatenation of every unit's padded flat space.
fn my_pieces(kit: &RankKit, padded: &[f32]) -> Vec<f32> {
    let rank = kit.rank();
    let mut out = Vec::with_capacity(kit.layout.shard_len);
    let mut base = 0;
    for (u, unit) in kit.layout.units.iter().enumerate() {
        let r = kit.layout.piece_range(u, rank);
        out.extend_from_slice(&padded[base + r.start..base + r.end]);
        base += unit.padded(kit.layout.shards);
    }
    out
}

/// The canonical (unpadded) vector of `padded`, every unit's padded flat space concatenated.
fn unpadded(kit: &RankKit, padded: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(kit.layout.total());
    let mut base = 0;
    for unit in &kit.layout.units {
        out.extend_from_slice(&padded[base..base + unit.len]);
        base += unit.padded(kit.layout.shards);
    }
    out
}

impl Reduction for Zero1 {
    fn all_reduces(&self) -> bool {
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
        let all = averaged(kit, replica, held)?;
        let grads = my_pieces(kit, &all);
        // Every rank has the whole averaged gradient: clipping takes its norm as `ddp` does.
        let norm = if clip.is_some() {
            let whole = unpadded(kit, &all);
            let n = whole.len();
            Norm::Whole(Box::new(Tensor::from_data(
                TensorData::new(whole, [n]),
                &kit.inner,
            )))
        } else {
            Norm::Local
        };
        drop(all);
        step_shard(kit, replica, grads, lr, scaler, clip, norm)
    }
}
