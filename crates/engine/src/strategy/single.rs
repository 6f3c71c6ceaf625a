//! `single`: one device, no collectives. The flat optimizer steps the whole space on the
//! device; nothing is read back to the host.

use burn::module::Module;
use burn::tensor::FloatDType;

use super::kit::{RankKit, cat_or_empty};
use super::replica::{Held, Reduction, Replica, local, step_whole};
use super::rules::{
    Checks, Costs, Estimate, Room, Setup, Shape, Variant, Words, replicated_estimate,
};
use crate::config::OptimConfig;
use crate::error::{Error, Result};
use crate::params::FlatLayout;
use crate::precision::LossScaler;

/// One replica on one device.
pub struct Single;

impl Checks for Single {
    fn check(&self, setup: &Setup) -> Result<()> {
        if setup.world > 1 {
            return Err(Error::config(format!(
                "key `strategy.name`: `single` runs on one device, but {} are selected",
                setup.world
            )));
        }
        Ok(())
    }

    fn one_optimizer(&self) -> bool {
        false
    }
}

impl Words for Single {
    fn describe(&self, _setup: &Setup) -> String {
        "single (one device)".to_string()
    }
}

impl Costs for Single {
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
        if room.world == 1 {
            vec![Variant::plain(crate::config::StrategyKind::Single)]
        } else {
            Vec::new()
        }
    }
}

impl Shape for Single {
    /// Per-kit sub-replicas of a CPU device take the `ddp` step among themselves.
    fn core_split(&self) -> Option<crate::config::StrategyKind> {
        Some(crate::config::StrategyKind::Ddp)
    }
}

impl Reduction for Single {
    fn replicated(&self) -> bool {
        false
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
        let units = replica.unit_grads(kit, local(held));
        let grads = cat_or_empty(units, FloatDType::F32, &kit.inner);
        let stepped = step_whole(kit, replica, grads, lr, scaler, clip)?;
        kit.memory.grads.set(0);
        if stepped.is_some() {
            kit.sample_pool();
        }
        Ok(stepped.is_some())
    }
}
