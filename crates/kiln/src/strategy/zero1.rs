//! `zero1` (ZeRO stage 1): replicas as in `ddp`, gradients all-reduced as in `ddp`, but each
//! rank keeps the optimizer state of its shard only and updates only its shard's parameters;
//! the updated shards are then all-gathered into every replica.

use burn::module::Module;
use burn::prelude::*;
use kiln_models::{BlockStack, StepOutput};

use super::core::{Core, Norm, Replica};
use super::ddp::{accumulate, averaged};
use super::{Strategy, answered_by_core, one_by_one};
use crate::error::Result;
use crate::exec::Accumulate;
use crate::params::host_f32;
use crate::precision::LossScaler;

/// Sharded optimizer state over replicated parameters and gradients.
pub struct Zero1<'a, M: Module> {
    core: Core<'a>,
    replica: Replica<M>,
    acc: Accumulate<M>,
}

impl<'a, M: Module> Zero1<'a, M> {
    pub(crate) fn new(model: M, mut core: Core<'a>) -> Self {
        let replica = Replica::new(model, &mut core);
        Self {
            core,
            replica,
            acc: Accumulate::default(),
        }
    }
}

/// This rank's pieces of `padded`, the concatenation of every unit's padded flat space.
pub(crate) fn my_pieces(core: &Core, padded: &[f32]) -> Vec<f32> {
    let rank = core.rank();
    let mut out = Vec::with_capacity(core.layout.shard_len);
    let mut base = 0;
    for (u, unit) in core.layout.units.iter().enumerate() {
        let r = core.layout.piece_range(u, rank);
        out.extend_from_slice(&padded[base + r.start..base + r.end]);
        base += unit.padded(core.layout.shards);
    }
    out
}

/// The canonical (unpadded) vector of `padded`, every unit's padded flat space concatenated.
fn unpadded(core: &Core, padded: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(core.layout.total());
    let mut base = 0;
    for unit in &core.layout.units {
        out.extend_from_slice(&padded[base..base + unit.len]);
        base += unit.padded(core.layout.shards);
    }
    out
}

/// Steps this rank's shard with the gradient shard `grads` (host) and all-gathers the updated
/// parameters into `replica`: the end of every step of `zero1` and `zero2`.
pub(crate) fn step_shard<M: Module>(
    core: &mut Core,
    replica: &mut Replica<M>,
    grads: Vec<f32>,
    lr: f64,
    scaler: Option<&mut LossScaler>,
    clip: Option<f64>,
    norm: Norm<'_>,
) -> Result<bool> {
    let n = grads.len();
    let grads = Tensor::<1>::from_data(TensorData::new(grads, [n]), &core.inner);
    let params = core.shard_of(&replica.model);
    let stepped = core.finish(grads, params, lr, scaler, clip, norm)?;
    core.memory.grads.set(0);
    let Some(shard) = stepped else {
        return Ok(false);
    };
    let values = core.gather_canonical(&host_f32(shard))?;
    replica.model = core.load_canonical(replica.model.clone(), values);
    core.sample_pool();
    Ok(true)
}

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Zero1<'_, M> {
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
        let all = averaged(&mut self.core, &self.replica, &mut self.acc)?;
        let grads = my_pieces(&self.core, &all);
        // Every rank has the whole averaged gradient: clipping takes its norm as `ddp` does.
        let norm = if clip.is_some() {
            let whole = unpadded(&self.core, &all);
            let n = whole.len();
            Norm::Whole(Box::new(Tensor::from_data(
                TensorData::new(whole, [n]),
                &self.core.inner,
            )))
        } else {
            Norm::Local
        };
        drop(all);
        step_shard(
            &mut self.core,
            &mut self.replica,
            grads,
            lr,
            scaler,
            clip,
            norm,
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
