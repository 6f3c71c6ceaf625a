//! `ddp`: a full replica per rank. Gradients are accumulated locally over the micro-steps of
//! an optimizer step and averaged over ranks once, on the last one (nanoGPT's
//! `require_backward_grad_sync`), bucket by bucket; every rank then steps the whole flat space
//! identically.

use burn::module::Module;
use burn::prelude::*;

use super::kit::RankKit;
use super::replica::{Held, Reduction, Replica, averaged, step_whole};
use super::rules::{
    Checks, Costs, Estimate, Op, Room, Setup, Shape, Traffic, Variant, Words, replicated_estimate,
};
use crate::config::OptimConfig;
use crate::error::Result;
use crate::params::FlatLayout;
use crate::precision::LossScaler;

/// Data parallelism with replicated optimizer state.
pub struct Ddp;

impl Checks for Ddp {
    fn one_optimizer(&self) -> bool {
        false
    }
}

impl Words for Ddp {
    fn describe(&self, setup: &Setup) -> String {
        format!("ddp ({} replicas, gradients all-reduced)", setup.world)
    }
}

impl Costs for Ddp {
    fn estimate(
        &self,
        layout: &FlatLayout,
        optim: &OptimConfig,
        setup: &Setup,
    ) -> Result<Estimate> {
        let full = layout.total();
        Ok(replicated_estimate(layout, optim, setup, full, full))
    }

    fn variants(&self, room: &Room) -> Vec<Variant> {
        several(room, crate::config::StrategyKind::Ddp)
    }

    /// One all-reduce of the gradients, after the step's last micro-batch.
    fn traffic(&self, _setup: &Setup, floats: usize, _local: usize) -> Vec<Traffic> {
        vec![Traffic::once(Op::AllReduce, floats)]
    }
}

impl Shape for Ddp {
    /// Per-kit sub-replicas of a CPU device take the `ddp` step among themselves.
    fn core_split(&self) -> Option<crate::config::StrategyKind> {
        Some(crate::config::StrategyKind::Ddp)
    }
}

/// The one way to run a data-parallel strategy: on several ranks.
pub(crate) fn several(room: &Room, kind: crate::config::StrategyKind) -> Vec<Variant> {
    if room.world > 1 {
        vec![Variant::plain(kind)]
    } else {
        Vec::new()
    }
}

impl Reduction for Ddp {
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
        let host = averaged(kit, replica, held)?;
        let n = host.len();
        let grads = Tensor::<1>::from_data(TensorData::new(host, [n]), &kit.inner);
        let stepped = step_whole(kit, replica, grads, lr, scaler, clip)?;
        kit.memory.grads.set(0);
        if stepped.is_some() {
            kit.sample_pool();
        }
        Ok(stepped.is_some())
    }
}
