//! [`Context`]: what one rank's strategy is built from besides the model.

use burn::prelude::*;

use super::rules::{Own, Setup};
use crate::comm::Collective;
use crate::config::OptimConfig;
use crate::exec::Recompute;
use crate::precision::Policy;

use super::tp::TpPlace;

/// What one rank's strategy is built from besides the model: resolved values, no config
/// sections beyond the strategy's own.
#[derive(Clone)]
pub struct Context<'a> {
    /// This rank's view of the group.
    pub comm: &'a dyn Collective,
    /// The rank's device, with autodiff (and Burn's checkpointing for `balanced`).
    pub device: Device,
    /// The precision policy.
    pub policy: Policy,
    /// Which blocks the block walk recomputes.
    pub recompute: Recompute,
    /// Synchronise BatchNorm statistics over ranks.
    pub sync_batchnorm: bool,
    /// Elements of one gradient bucket of an all-reduce.
    pub bucket_elements: usize,
    /// The strategy's own section, if it has one.
    pub own: Own,
    /// Reduce gradients beside the backward (`dist.overlap`).
    pub overlap: bool,
    /// The optimizer.
    pub optim: OptimConfig,
    /// The optimizer of each parameter group of a model with several (by group name; a group
    /// not here uses `optim`).
    pub group_optims: std::collections::BTreeMap<String, OptimConfig>,
    /// The rank's tensor-parallel group, where it has one: `comm` is then the data-parallel
    /// group of the rank's place in it, and the model the rank's part.
    pub tp: Option<TpPlace<'a>>,
    /// Whether a rank alone in its group may check its gradient on the device and skip a
    /// step there, the host reading the flags later (`train.host_waits = "log"`), instead of
    /// reading each step's.
    pub decide_on_device: bool,
}

impl<'a> Context<'a> {
    /// The context of the rank `comm` on `device` under `setup`, stepping `optim` (and
    /// `group_optims` for a model with parameter groups).
    pub fn new(
        setup: &Setup,
        comm: &'a dyn Collective,
        device: Device,
        optim: OptimConfig,
        group_optims: std::collections::BTreeMap<String, OptimConfig>,
    ) -> Self {
        Self {
            comm,
            device,
            policy: setup.policy.clone(),
            recompute: setup.walk_recompute(),
            sync_batchnorm: setup.ddp.sync_batchnorm,
            bucket_elements: (setup.ddp.bucket_mb * 1024.0 * 1024.0 / 4.0).max(1.0) as usize,
            own: setup.own.clone(),
            overlap: setup.overlap,
            optim,
            group_optims,
            tp: None,
            decide_on_device: false,
        }
    }
}
