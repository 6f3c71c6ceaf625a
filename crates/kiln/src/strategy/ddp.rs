//! `ddp`: a full replica per rank. Gradients are accumulated locally over the micro-steps of
//! an optimizer step and averaged over ranks once, on the last one (nanoGPT's
//! `require_backward_grad_sync`), bucket by bucket; every rank then steps the whole flat space
//! identically.

use burn::module::Module;
use burn::prelude::*;
use kiln_models::{BlockStack, StepOutput};

use super::core::{Core, Norm, Replica};
use super::{Strategy, answered_by_core, one_by_one};
use crate::error::Result;
use crate::exec::{self, Accumulate};
use crate::precision::LossScaler;

/// Data parallelism with replicated optimizer state.
pub struct Ddp<'a, M: Module> {
    core: Core<'a>,
    replica: Replica<M>,
    acc: Accumulate<M>,
}

impl<'a, M: Module> Ddp<'a, M> {
    pub(crate) fn new(model: M, mut core: Core<'a>) -> Self {
        let replica = Replica::new(model, &mut core);
        Self {
            core,
            replica,
            acc: Accumulate::default(),
        }
    }
}

/// The micro-step every replicated strategy runs: forward and backward, gradients added to the
/// rank's own accumulator (no communication).
pub(crate) fn accumulate<B, M: BlockStack<B> + Module>(
    core: &mut Core,
    replica: &Replica<M>,
    acc: &mut Accumulate<M>,
    batch: B,
    objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
) -> Result<StepOutput> {
    let plan = core.plan(core.recompute);
    let (out, _) = exec::run(replica.current(), batch, &plan, acc, objective)?;
    let bytes = core.layout.total() * 4;
    core.memory.grads.set(bytes);
    core.sample_pool();
    Ok(out)
}

/// The averaged flat gradients of the accumulated micro-steps, on the host (every unit padded).
pub(crate) fn averaged<M: Module>(
    core: &mut Core,
    replica: &Replica<M>,
    acc: &mut Accumulate<M>,
) -> Result<Vec<f32>> {
    let units = replica.unit_grads(core, acc.take());
    core.all_reduce_units(units)
}

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Ddp<'_, M> {
    fn begin_step(&mut self) -> Result<()> {
        self.replica.begin(&mut self.core);
        Ok(())
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = B>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        one_by_one(batches, count, |batch| -> Result<StepOutput> {
            accumulate(
                &mut self.core,
                &self.replica,
                &mut self.acc,
                batch,
                objective,
            )
        })
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        self.replica.end(&mut self.core);
        let host = averaged(&mut self.core, &self.replica, &mut self.acc)?;
        let n = host.len();
        let grads = Tensor::<1>::from_data(TensorData::new(host, [n]), &self.core.inner);
        let params = self.core.shard_of(&self.replica.model);
        let stepped = self
            .core
            .finish(grads, params, lr, scaler, clip, Norm::Local)?;
        self.core.memory.grads.set(0);
        let Some(flat) = stepped else {
            return Ok(false);
        };
        // One shard: the stepped flat space is the canonical vector.
        self.replica.model = self.core.load_flat(self.replica.model.clone(), flat);
        self.core.sample_pool();
        Ok(true)
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
