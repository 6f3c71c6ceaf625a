//! ZeRO-3's frozen parameters (`[finetune]`'s, LoRA's bases): sharded like the trained ones
//! and gathered with their unit for as long as the walk needs it, in the compute dtype, so
//! that a rank holds its shard of them and the blocks it is computing — and nothing of them
//! takes a gradient, optimizer state or a reduce-scatter.

use burn::module::{Module, ParamId};
use burn::prelude::*;
use burn::tensor::FloatDType;

use super::core::Core;
use crate::error::Result;
use crate::params::{FlatLayout, dtype_bytes, host_f32};

/// A rank's shard of the frozen parameters, and which of their units are loaded.
pub(crate) struct FrozenShard {
    layout: FlatLayout,
    /// This rank's piece of each unit, master values (f32 on the host).
    pieces: Vec<Vec<f32>>,
    gathered: Vec<bool>,
    /// Bytes held now: the pieces and the gathered units.
    now: usize,
}

impl FrozenShard {
    /// The shard of `model`'s frozen parameters over the rank's group, with `model` released
    /// of them; `None` (and `model` as it was) when it has none.
    pub fn new<M: Module>(model: M, blocks: &[Vec<ParamId>], core: &mut Core) -> (M, Option<Self>) {
        let shards = core.layout.shards;
        let layout = FlatLayout::frozen(&model, blocks, shards);
        if layout.total() == 0 {
            return (model, None);
        }
        let rank = if shards > 1 { core.rank() } else { 0 };
        let mut model = model;
        let mut pieces = Vec::with_capacity(layout.units.len());
        for u in 0..layout.units.len() {
            let whole = layout.unit_values(&model, u, FloatDType::F32, &core.inner);
            pieces.push(host_f32(whole.slice(layout.piece_range(u, rank))));
            model = layout.release_unit(model, u, &core.device);
        }
        let now = pieces.iter().map(Vec::len).sum::<usize>() * dtype_bytes(core.master);
        let shard = Self {
            gathered: vec![false; layout.units.len()],
            layout,
            pieces,
            now,
        };
        core.memory.frozen = core.memory.frozen.max(now);
        (model, Some(shard))
    }

    /// Unit `u` all-gathered from every rank's piece, whole (padded), on the inner device.
    fn all_gathered(&self, u: usize, core: &mut Core) -> Result<Tensor<1>> {
        let mine = &self.pieces[u];
        let all = core.timed(|c| c.all_gather(mine))?;
        Ok(core.on_inner(all))
    }

    /// This rank's piece of unit `u`, when the unit is to be gathered (not loaded yet, not
    /// empty); the caller all-gathers it (on the walk's communication thread, if any) and
    /// hands the result to [`FrozenShard::load`].
    pub fn wanted(&self, u: usize) -> Option<&[f32]> {
        (!self.gathered[u] && self.layout.units[u].len > 0).then(|| self.pieces[u].as_slice())
    }

    /// `model` with unit `u` loaded in `dtype` from `all`, every rank's piece in rank order.
    pub fn load<M: Module>(
        &mut self,
        model: M,
        u: usize,
        all: Vec<f32>,
        dtype: FloatDType,
        core: &mut Core,
    ) -> M {
        let flat = core.on_inner(all);
        let model = self.layout.load_unit(model, u, flat, dtype, &core.device);
        self.gathered[u] = true;
        self.now += self.layout.units[u].len * dtype_bytes(dtype);
        core.memory.frozen = core.memory.frozen.max(self.now);
        model
    }

    /// `model` with unit `u` of the frozen parameters released, loaded in `dtype`.
    pub fn release<M: Module>(&mut self, model: M, u: usize, dtype: FloatDType, core: &Core) -> M {
        if !self.gathered[u] {
            return model;
        }
        self.gathered[u] = false;
        self.now -= self.layout.units[u].len * dtype_bytes(dtype);
        self.layout.release_unit(model, u, &core.device)
    }

    /// `full` (a model outside the walk) with every frozen parameter in `dtype`.
    pub fn whole<M: Module>(&self, full: M, dtype: FloatDType, core: &mut Core) -> Result<M> {
        let mut full = full;
        for u in 0..self.layout.units.len() {
            if self.layout.units[u].len == 0 {
                continue;
            }
            let flat = self.all_gathered(u, core)?;
            full = self.layout.load_unit(full, u, flat, dtype, &core.device);
        }
        Ok(full)
    }
}
