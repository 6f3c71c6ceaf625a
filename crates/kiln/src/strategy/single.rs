//! `single`: one device, no collectives. The flat optimizer steps the whole space on the
//! device; nothing is read back to the host.

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::{BlockStack, StepOutput};

use super::core::{Core, Norm, Replica, cat_or_empty};
use super::{Strategy, answered_by_core, one_by_one};
use crate::error::Result;
use crate::exec::{self, Accumulate};
use crate::precision::LossScaler;

/// One replica on one device.
pub struct Single<'a, M: Module> {
    core: Core<'a>,
    replica: Replica<M>,
    acc: Accumulate<M>,
}

impl<'a, M: Module> Single<'a, M> {
    pub(crate) fn new(model: M, mut core: Core<'a>) -> Self {
        let replica = Replica::new(model, &mut core);
        Self {
            core,
            replica,
            acc: Accumulate::default(),
        }
    }
}

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Single<'_, M> {
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
            let plan = self.core.plan(self.core.recompute);
            let (out, _) = exec::run(
                self.replica.current(),
                batch,
                &plan,
                &mut self.acc,
                objective,
            )?;
            let bytes = self.core.layout.total() * 4;
            self.core.memory.grads.set(bytes);
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
        let units = self.replica.unit_grads(&self.core, self.acc.take());
        let grads = cat_or_empty(units, FloatDType::F32, &self.core.inner);
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

    fn check_replicas(&mut self, _step: usize) -> Result<()> {
        // One device, or ranks that hold different shards: no replicas to compare.
        Ok(())
    }

    answered_by_core!();
}
