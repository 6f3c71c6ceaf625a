//! A step with several optimizers (a GAN's discriminator, then its generator), on one device
//! (`single`) or replicated (`ddp`).
//!
//! Each parameter group of [`TrainStep::param_groups`](kiln_models::TrainStep::param_groups)
//! has a `RankKit` of its own: a [`FlatLayout`] over its parameters
//! only, its optimizer and its optimizer state. The loop selects a group, runs its micro-steps
//! (gradients accumulated locally, then averaged over ranks once, after the last: the
//! `toggle_model(sync_grad=…)` pattern) and steps it. Gradients the group's loss gives other
//! groups' parameters are dropped, and the step loads the group's parameters alone, so another
//! group's parameters and optimizer state stay as they were, bit for bit.

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::{BlockStack, StepOutput};

use super::context::Context;
use super::kit::{RankKit, cat_or_empty};
use super::memory::Memory;
use super::replica::{Replica, accumulate, step_whole};
use super::step::{Strategy, one_by_one};
use crate::error::{Error, Result};
use crate::exec::Accumulate;
use crate::optim::{OptimState, Share, Source, param_dtypes, rest_record};
use crate::params::FlatLayout;
use crate::precision::LossScaler;

/// Several optimizers over disjoint parameter groups of one replicated model.
pub struct Groups<'a, M: Module> {
    /// The whole model's equipment: the compute copy, memory counts, buffers and replicas.
    whole: RankKit<'a>,
    /// One per group: its layout, optimizer and state.
    kits: Vec<RankKit<'a>>,
    names: Vec<String>,
    replica: Replica<M>,
    acc: Accumulate<M>,
    current: usize,
    /// Average the gradients over ranks (`ddp`), or not (`single`).
    reduce: bool,
}

impl<'a, M: Module> Groups<'a, M> {
    pub(crate) fn new<B>(
        model: M,
        mut whole: RankKit<'a>,
        ctx: Context<'a>,
        reduce: bool,
    ) -> Result<Self>
    where
        M: BlockStack<B>,
    {
        let groups = model.param_groups();
        let mut kits = Vec::with_capacity(groups.len());
        let mut names = Vec::with_capacity(groups.len());
        for group in groups {
            let mut c = ctx.clone();
            // A group's phase is checked at its phase (`skipped_on_device` is per step).
            c.decide_on_device = false;
            if let Some(optim) = ctx.group_optims.get(&group.name) {
                c.optim = optim.clone();
            }
            let layout = FlatLayout::of_params(&model, &group.params, 1);
            if layout.total() == 0 {
                return Err(Error::config(format!(
                    "parameter group {:?} holds no trainable parameter",
                    group.name
                )));
            }
            kits.push(RankKit::new(c, layout));
            names.push(group.name);
        }
        let replica = Replica::new(model, &mut whole);
        Ok(Self {
            whole,
            kits,
            names,
            replica,
            acc: Accumulate::default(),
            current: 0,
            reduce,
        })
    }
}

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Groups<'_, M> {
    fn select_group(&mut self, group: usize) -> Result<()> {
        if group >= self.kits.len() {
            return Err(Error::Worker(format!(
                "the model has {} parameter groups; there is no group {group}",
                self.kits.len()
            )));
        }
        self.current = group;
        Ok(())
    }

    fn begin_step(&mut self) -> Result<()> {
        // Each group's compute copy is cast afresh: a later group sees what an earlier one
        // stepped.
        self.replica.begin(&mut self.whole);
        Ok(())
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        let group = Some(self.current);
        let (whole, replica, acc) = (&mut self.whole, &self.replica, &mut self.acc);
        one_by_one(batches, count, |batch| {
            accumulate(whole, replica, acc, batch, objective, group)
        })
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        self.replica.end(&mut self.whole);
        let kit = &mut self.kits[self.current];
        // The group's own gradients (its layout's units); what its loss gave other groups is
        // dropped here.
        let units = self.replica.unit_grads(kit, self.acc.take());
        let flat = if self.reduce {
            let host = kit.all_reduce_units(units)?;
            let n = host.len();
            Tensor::<1>::from_data(TensorData::new(host, [n]), &kit.inner)
        } else {
            cat_or_empty(units, FloatDType::F32, &kit.inner)
        };
        let stepped = step_whole(kit, &mut self.replica, flat, lr, scaler, clip)?;
        self.replica.forget_compute_flat();
        self.whole.memory.grads.set(0);
        if stepped.is_some() {
            self.whole.sample_pool();
        }
        Ok(stepped.is_some())
    }

    fn full_model(&mut self) -> Result<M> {
        self.replica.settled(&mut self.whole)
    }

    fn optimizer_state(&mut self) -> Result<Option<OptimState>> {
        Err(Error::Worker(
            "a model with several optimizers has one state per group".into(),
        ))
    }

    fn load_optimizer_state(&mut self, _state: &OptimState) -> Result<()> {
        Err(Error::checkpoint(format!(
            "the checkpoint holds one optimizer's state, but this model steps {} optimizers \
             ({})",
            self.names.len(),
            self.names.join(", ")
        )))
    }

    fn optimizer_states(&mut self) -> Result<Option<Vec<(String, OptimState)>>> {
        let mut out = Vec::with_capacity(self.kits.len());
        for (name, kit) in self.names.iter().zip(&mut self.kits) {
            if let Some(state) = kit.optimizer_state()? {
                out.push((name.clone(), state));
            }
        }
        Ok((self.whole.rank() == 0).then_some(out))
    }

    fn load_optimizer_states(&mut self, states: &[(String, OptimState)]) -> Result<()> {
        for (name, kit) in self.names.iter().zip(&mut self.kits) {
            let Some((_, state)) = states.iter().find(|(n, _)| n == name) else {
                return Err(Error::checkpoint(format!(
                    "the checkpoint holds no optimizer state for parameter group {name:?}"
                )));
            };
            kit.load_optimizer_state(state).map_err(|e| match e {
                Error::Checkpoint(m) => Error::checkpoint(format!("group {name:?}: {m}")),
                other => other,
            })?;
        }
        Ok(())
    }

    fn checkpoint_share(&mut self) -> Result<Share> {
        let model = self.replica.settled(&mut self.whole)?;
        let dtypes = param_dtypes(&model);
        let dtype =
            |e: &crate::params::Entry| dtypes.get(&e.id).copied().unwrap_or(FloatDType::F32);
        let mut share = Share::default();
        let mut held = Vec::new();
        let mut optimizers = Vec::with_capacity(self.kits.len());
        for (name, kit) in self.names.iter().zip(&mut self.kits) {
            let params = kit.shard_of(&model);
            let (group, scalars) = kit.share(params, name, &dtype);
            share.merge(group);
            held.extend(kit.layout.entries.iter().map(|e| e.id));
            optimizers.push((name.clone(), kit.optimizer.kind(), scalars));
        }
        held.extend(self.whole.share_frozen(&mut share, &model, &dtype));
        if self.whole.rank() == 0 {
            share.rest = Some(rest_record(model, &held));
            share.optimizers = Some(optimizers);
        }
        Ok(share)
    }

    fn load_optimizer_shards(&mut self, source: &dyn Source, groups: &[String]) -> Result<()> {
        for (name, kit) in self.names.iter().zip(&mut self.kits) {
            if !groups.contains(name) {
                return Err(Error::checkpoint(format!(
                    "the checkpoint holds no optimizer state for parameter group {name:?}"
                )));
            }
            kit.load_optimizer_from(source, name).map_err(|e| match e {
                Error::Checkpoint(m) => Error::checkpoint(format!("group {name:?}: {m}")),
                other => other,
            })?;
        }
        Ok(())
    }

    fn check_replicas(&mut self, step: usize) -> Result<()> {
        if !self.reduce {
            return Ok(());
        }
        self.replica.check(&mut self.whole, step)
    }

    fn memory(&self) -> Memory {
        let mut m = self.whole.memory;
        let optim_now: usize = self.kits.iter().map(|c| c.memory.optim.now).sum();
        let optim_peak: usize = self.kits.iter().map(|c| c.memory.optim.peak).sum();
        m.optim.now = optim_now;
        m.optim.peak = optim_peak;
        m.total_peak += optim_peak;
        m
    }

    fn take_sync_seconds(&mut self) -> f64 {
        self.whole.take_sync_seconds()
            + self
                .kits
                .iter_mut()
                .map(RankKit::take_sync_seconds)
                .sum::<f64>()
    }

    fn nonfinite(&self) -> bool {
        self.kits[self.current].nonfinite
    }

    fn skipped_on_device(&mut self) -> Result<Vec<usize>> {
        // Each group's check is read at its phase: a skipped phase is not a skipped step.
        Ok(Vec::new())
    }
}
