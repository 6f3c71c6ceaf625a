//! `zero2` (ZeRO stage 2): replicated parameters, sharded gradients and optimizer state.
//!
//! Burn's `backward()` returns every gradient at once, so the micro-step runs as the block
//! walk ([`crate::exec`]), keeping each block's activations unless `recompute` says otherwise:
//! each part's gradients (the head's, each block's, the stem's) are reduce-scattered as soon as
//! its backward is done and then dropped. A rank holds at most its gradient shard plus one
//! unit's whole gradient. With accumulation the reduce-scatter runs on every micro-step (the
//! rank keeps no whole gradient to accumulate into), as DeepSpeed's stage 2 does.

use burn::module::Module;
use burn::prelude::*;
use kiln_models::{BlockStack, StepOutput};

use super::core::{Core, Norm, Replica, Scatter};
use super::zero1::step_shard;
use super::{Strategy, answered_by_core, one_by_one};
use crate::error::Result;
use crate::exec;
use crate::precision::LossScaler;

/// Sharded gradients and optimizer state over replicated parameters.
pub struct Zero2<'a, M: Module> {
    core: Core<'a>,
    replica: Replica<M>,
    /// This step's averaged gradient shard, added up over micro-steps.
    shard: Vec<f32>,
}

impl<'a, M: Module> Zero2<'a, M> {
    pub(crate) fn new(model: M, mut core: Core<'a>) -> Self {
        let replica = Replica::new(model, &mut core);
        Self {
            core,
            replica,
            shard: Vec::new(),
        }
    }
}

/// Starts a step's gradient shard (zeros) and counts it.
pub(crate) fn open_shard(core: &mut Core, shard: &mut Vec<f32>) {
    *shard = vec![0.0; core.layout.shard_len];
    let bytes = core.layout.shard_len * 4;
    core.memory.grads.set(bytes);
    core.memory.note();
}

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Zero2<'_, M> {
    fn begin_step(&mut self) -> Result<()> {
        self.replica.begin(&mut self.core);
        open_shard(&mut self.core, &mut self.shard);
        Ok(())
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = B>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        one_by_one(batches, count, |batch| -> Result<StepOutput> {
            let recompute = self.core.recompute;
            let sync_bn = self.core.plan(recompute).sync_bn.is_some();
            let device = self.core.device.clone();
            let comm = self.core.comm;
            let plan = exec::Plan {
                recompute,
                sync_bn: sync_bn.then_some(comm),
                device: &device,
            };
            let mut hooks = Scatter {
                core: &mut self.core,
                shard: &mut self.shard,
            };
            let (out, _) = exec::run(self.replica.current(), batch, &plan, &mut hooks, objective)?;
            self.core.sample_pool();
            Ok(out)
        })
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        self.replica.end(&mut self.core);
        let grads = std::mem::take(&mut self.shard);
        step_shard(
            &mut self.core,
            &mut self.replica,
            grads,
            lr,
            scaler,
            clip,
            Norm::Shards,
        )
    }

    fn full_model(&mut self) -> Result<M> {
        self.replica.settled(&mut self.core)
    }

    fn check_replicas(&mut self, step: usize) -> Result<()> {
        let values = self.replica.values();
        let comm = self.core.comm;
        self.core.check_replicas(comm, values, step)
    }

    answered_by_core!();
}
