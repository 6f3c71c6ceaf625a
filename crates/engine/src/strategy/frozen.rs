//! ZeRO-3's frozen parameters (`[finetune]`'s, LoRA's bases): sharded like the trained ones
//! and gathered with their unit for as long as the walk needs it, in the compute dtype, so
//! that a rank holds its shard of them and the blocks it is computing — and nothing of them
//! takes a gradient, optimizer state or a reduce-scatter.

use burn::module::{Module, ParamId};
use burn::prelude::*;
use burn::tensor::FloatDType;

use super::kit::RankKit;
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
    pub fn new<M: Module>(
        model: M,
        blocks: &[Vec<ParamId>],
        kit: &mut RankKit,
    ) -> (M, Option<Self>) {
        let shards = kit.layout.shards;
        let layout = FlatLayout::frozen(&model, blocks, shards);
        if layout.total() == 0 {
            return (model, None);
        }
        let rank = if shards > 1 { kit.rank() } else { 0 };
        let mut model = model;
        let mut pieces = Vec::with_capacity(layout.units.len());
        for u in 0..layout.units.len() {
            let whole = layout.unit_values(&model, u, FloatDType::F32, &kit.inner);
            pieces.push(host_f32(whole.slice(layout.piece_range(u, rank))));
            model = layout.release_unit(model, u, &kit.device);
        }
        let now = pieces.iter().map(Vec::len).sum::<usize>() * dtype_bytes(kit.master);
        let shard = Self {
            gathered: vec![false; layout.units.len()],
            layout,
            pieces,
            now,
        };
        kit.memory.frozen = kit.memory.frozen.max(now);
        (model, Some(shard))
    }

    /// Adds this rank's shard of the frozen parameters to a sharded checkpoint's `share`, in
    /// `dtype`; returns their ids.
    pub fn share(
        &self,
        share: &mut crate::optim::Share,
        rank: usize,
        dtype: FloatDType,
    ) -> Vec<ParamId> {
        let rank = if self.layout.shards > 1 { rank } else { 0 };
        share.add_shard(
            &self.layout,
            rank,
            self.pieces.concat(),
            &|_| dtype,
            |path| path.to_string(),
        );
        self.layout.entries.iter().map(|e| e.id).collect()
    }

    /// Takes this rank's shard of the frozen parameters from a sharded checkpoint that holds
    /// them as ranges (one that kept them whole in its rest of the model loaded them into the
    /// model this shard was cut from).
    pub fn read_from(&mut self, source: &dyn crate::optim::Source, rank: usize) -> Result<()> {
        if !self.layout.entries.iter().all(|e| source.holds(&e.path)) {
            return Ok(());
        }
        let rank = if self.layout.shards > 1 { rank } else { 0 };
        let shard = source.shard(&self.layout, rank, &|path| path.to_string())?;
        for (u, unit) in self.layout.units.iter().enumerate() {
            self.pieces[u] = shard[unit.shard_offset..unit.shard_offset + unit.piece].to_vec();
        }
        Ok(())
    }

    /// Unit `u` all-gathered from every rank's piece, whole (padded), on the inner device.
    fn all_gathered(&self, u: usize, kit: &mut RankKit) -> Result<Tensor<1>> {
        let mine = &self.pieces[u];
        let all = kit.timed(|c| c.all_gather(mine))?;
        Ok(kit.on_inner(all))
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
        kit: &mut RankKit,
    ) -> M {
        let flat = kit.on_inner(all);
        let model = self.layout.load_unit(model, u, flat, dtype, &kit.device);
        self.gathered[u] = true;
        self.now += self.layout.units[u].len * dtype_bytes(dtype);
        kit.memory.frozen = kit.memory.frozen.max(self.now);
        model
    }

    /// `model` with unit `u` of the frozen parameters released, loaded in `dtype`.
    pub fn release<M: Module>(
        &mut self,
        model: M,
        u: usize,
        dtype: FloatDType,
        kit: &RankKit,
    ) -> M {
        if !self.gathered[u] {
            return model;
        }
        self.gathered[u] = false;
        self.now -= self.layout.units[u].len * dtype_bytes(dtype);
        self.layout.release_unit(model, u, &kit.device)
    }

    /// `full` (a model outside the walk) with every frozen parameter in `dtype`.
    pub fn whole<M: Module>(&self, full: M, dtype: FloatDType, kit: &mut RankKit) -> Result<M> {
        let mut full = full;
        for u in 0..self.layout.units.len() {
            if self.layout.units[u].len == 0 {
                continue;
            }
            let flat = self.all_gathered(u, kit)?;
            full = self.layout.load_unit(full, u, flat, dtype, &kit.device);
        }
        Ok(full)
    }
}
