//! A stage's share of a sharded checkpoint: the units it is the owner of — its blocks, and on
//! the first stage the parameters outside them —, each cut into one part per replica of the
//! stage so that every value is written once; the stage's buffers and the tensors it keeps
//! whole, written by its first replica; and its buffers settled over the pipeline and its
//! replicas, as the whole model's are.

use std::collections::HashSet;

use burn::module::{Module, ParamGroup, ParamId};
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::BlockStack;

use super::stage::Stage;
use crate::comm::ReduceOp;
use crate::error::Result;
use crate::optim::{Share, optim_tensor, param_dtypes, tensor_ids};
use crate::params::{buffers_with_ids, host_f32, replace_floats};
use crate::strategy::kit::{cat_or_empty, part_of};

impl<B, M: BlockStack<B> + Module> Stage<'_, M, B> {
    /// Brings the buffers up to date: each from the stage that holds its block, averaged over
    /// the replicas.
    pub(super) fn settle_buffers(&mut self) -> Result<()> {
        crate::params::sync_running_state(&self.model);
        let buffers = buffers_with_ids(&self.model);
        if buffers.is_empty() {
            return Ok(());
        }
        let mut values = Vec::new();
        for (id, v) in &buffers {
            if self.owner_of(id) == self.stage {
                values.extend_from_slice(v);
            } else {
                values.extend(std::iter::repeat_n(0.0, v.len()));
            }
        }
        self.kit
            .timed(|comm| comm.all_reduce(&mut values, ReduceOp::Sum))?;
        if self.replicas > 1 {
            let inv = self.replicas as f32;
            for x in &mut values {
                *x /= inv;
            }
        }
        self.model = replace_floats(self.model.clone(), false, values, &self.kit.device);
        Ok(())
    }

    /// The stage a tensor belongs to: its block's, or the first for one outside every block.
    fn owner_of(&self, id: &ParamId) -> usize {
        self.block_of.get(id).map_or(0, |&b| self.stage_of_block(b))
    }

    /// This rank's share, copied to the host (the buffers settled first).
    pub(super) fn share(&mut self) -> Share {
        let replica = self.kit.rank() / self.stages;
        // The units of the stage's layout it writes: unit 0 (outside the blocks) is the
        // first stage's, though the last holds a copy.
        let mine: Vec<usize> = (0..self.owned.len())
            .filter(|&i| self.owner(self.owned[i]) == self.stage)
            .collect();
        let spans: Vec<(usize, usize)> = mine
            .iter()
            .map(|&i| {
                let unit = &self.kit.layout.units[i];
                (unit.shard_offset, unit.len)
            })
            .collect();
        let layout = self.kit.layout.select(&mine).with_shards(self.replicas);
        let select = |t: Tensor<1>| {
            let dtype = crate::params::float_dtype(t.dtype());
            let parts = spans
                .iter()
                .map(|&(at, n)| t.clone().slice(at..at + n))
                .collect();
            cat_or_empty(parts, dtype, &t.device())
        };
        let select_host = |v: Vec<f32>| -> Vec<f32> {
            spans
                .iter()
                .flat_map(|&(at, n)| v[at..at + n].iter().copied())
                .collect()
        };
        let dtypes = param_dtypes(&self.model);
        let dtype =
            |e: &crate::params::Entry| dtypes.get(&e.id).copied().unwrap_or(FloatDType::F32);
        let mut share = Share::default();
        let params = select(self.kit.shard_of(&self.model));
        let values = host_f32(part_of(params, &layout, replica));
        share.add_shard(&layout, replica, values, &dtype, |path| path.to_string());
        let (tensors, scalars) = self
            .kit
            .optimizer
            .export_part(&|t| part_of(select(t), &layout, replica), &|v| {
                layout.cut(&select_host(v), replica)
            });
        for (leaf, values) in tensors {
            share.add_shard(&layout, replica, values, &|_| FloatDType::F32, |path| {
                optim_tensor("", &leaf, path)
            });
        }
        if replica == 0 {
            let trained: HashSet<ParamId> = self.full.entries.iter().map(|e| e.id).collect();
            let ids: Vec<ParamId> = tensor_ids(&self.model)
                .into_iter()
                .filter(|id| !trained.contains(id) && self.owner_of(id) == self.stage)
                .collect();
            share.rest = Some(
                self.model
                    .clone()
                    .into_record_group(ParamGroup::from_ids(ids)),
            );
        }
        if self.kit.rank() == 0 {
            share.optimizers = Some(vec![(String::new(), self.kit.optimizer.kind(), scalars)]);
        }
        share
    }
}
