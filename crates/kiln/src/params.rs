//! A module's floats as flat buffers: reading, replacing and laying them out.
//!
//! This is the leaf everyone may import (strategies, the block walk, synchronised BatchNorm,
//! checkpoints): it knows Burn's module traversal and nothing of kiln's other layers.
//!
//! [`FlatLayout`] is the one flat space every strategy's optimizer steps: the trainable
//! parameters grouped into *units* (the parameters outside every block — stem, head, tied
//! weights — then one unit per block of the [`BlockStack`](kiln_models::BlockStack)), each unit
//! padded to a multiple of the shard count and cut into equal pieces. Shard `r` is the
//! concatenation of every unit's piece `r`, so that gathering one unit is one all-gather of
//! equal pieces, and the whole space is the concatenation of the shards' pieces unit by unit.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

/// The float tensors of `module` in module order, one vector each: all of them, or only those
/// that are (`Some(true)`) or are not (`Some(false)`, buffers) trained.
pub fn float_tensors<M: Module>(module: &M, trainable: Option<bool>) -> Vec<Vec<f32>> {
    struct Collect {
        trainable: Option<bool>,
        out: Vec<Vec<f32>>,
    }
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.trainable.is_some_and(|t| param.is_require_grad() != t) {
                return;
            }
            self.out.push(host_f32(param.val()));
        }
    }
    let mut c = Collect {
        trainable,
        out: Vec::new(),
    };
    module.visit(&mut c);
    c.out
}

/// The values of every float tensor of `module` (parameters and buffers such as BatchNorm
/// statistics), one vector per tensor in module order, for comparing replicas or runs.
pub fn parameter_values<M: Module>(module: &M) -> Vec<Vec<f32>> {
    float_tensors(module, None)
}

/// The float tensors of `module` that are (`trainable`) or are not (buffers) trained,
/// flattened into one host buffer in module order.
pub fn collect_floats<M: Module>(module: &M, trainable: bool) -> Vec<f32> {
    float_tensors(module, Some(trainable)).concat()
}

/// Replaces the float tensors [`collect_floats`] collected with `values`, each in the dtype it
/// had (a bf16 buffer stays bf16).
pub fn replace_floats<M: Module>(
    module: M,
    trainable: bool,
    values: Vec<f32>,
    device: &Device,
) -> M {
    struct Replace<'a> {
        trainable: bool,
        values: Vec<f32>,
        offset: usize,
        device: &'a Device,
    }
    impl ModuleMapper for Replace<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if param.is_require_grad() != self.trainable {
                return param;
            }
            let shape = param.shape();
            let dtype = float_dtype(param.val().dtype());
            let n = shape.num_elements();
            let slice = self.values[self.offset..self.offset + n].to_vec();
            self.offset += n;
            let device = self.device.clone().without_autodiff();
            let tensor = Tensor::<D>::from_data(TensorData::new(slice, shape), &device).cast(dtype);
            let tracked = self.trainable;
            let device = self.device.clone();
            param.map(|_| {
                if tracked {
                    param_tensor(tensor, &device)
                } else {
                    tensor
                }
            })
        }
    }
    let mut r = Replace {
        trainable,
        values,
        offset: 0,
        device,
    };
    module.map(&mut r)
}

/// The buffers (float tensors that are not trained) of `module` in module order, with their
/// ids.
pub fn buffers_with_ids<M: Module>(module: &M) -> Vec<(ParamId, Vec<f32>)> {
    struct Collect(Vec<(ParamId, Vec<f32>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                self.0.push((param.id, host_f32(param.val())));
            }
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Folds the pending updates of Burn's `RunningState` buffers (e.g. BatchNorm statistics) into
/// their values. A `RunningState` keeps the last update of each thread aside until it is next
/// read for a forward pass, so visiting the module right after a step would see the previous
/// step's statistics; `valid` folds the pending updates in as a side effect on the shared state.
pub fn sync_running_state<M: Module>(module: &M) {
    let _ = module.valid();
}

/// Whether `module` holds float state that is not trained (buffers).
pub fn has_buffers<M: Module>(module: &M) -> bool {
    struct Find(bool);
    impl ModuleVisitor for Find {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 |= !param.is_require_grad();
        }
    }
    let mut f = Find(false);
    module.visit(&mut f);
    f.0
}

/// The ids of the trainable float parameters of `module`, in module order.
pub fn trainable_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_require_grad() {
                self.0.push(param.id);
            }
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// A tensor's values on the host as f32 (exact for bf16 and f16).
pub fn host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().iter::<f32>().collect()
}

/// The float dtype of a tensor's `DType` (f32 for anything that is not a float).
pub fn float_dtype(dtype: DType) -> FloatDType {
    match dtype {
        DType::BF16 => FloatDType::BF16,
        DType::F16 => FloatDType::F16,
        DType::F64 => FloatDType::F64,
        _ => FloatDType::F32,
    }
}

/// Bytes of one element of `dtype`.
pub fn dtype_bytes(dtype: FloatDType) -> usize {
    match dtype {
        FloatDType::BF16 | FloatDType::F16 => 2,
        FloatDType::F64 => 8,
        _ => 4,
    }
}

/// `inner` (a tensor without autodiff) as a trainable parameter value on `device`: with
/// autodiff, the device's gradient-checkpointing strategy, and its gradient kept. On a device
/// without autodiff the tensor is returned as it is.
pub fn param_tensor<const D: usize>(inner: Tensor<D>, device: &Device) -> Tensor<D> {
    if !device.is_autodiff() {
        return inner;
    }
    let t = inner.autodiff();
    let t = match device.gradient_checkpointing_strategy() {
        Some(s) => t.with_gradient_checkpointing_strategy(s),
        None => t,
    };
    t.require_grad()
}

/// One trainable parameter's place in a [`FlatLayout`].
#[derive(Debug, Clone)]
pub struct Entry {
    /// The parameter.
    pub id: ParamId,
    /// Its module path (`blocks.0.attn.qkv.weight`), the key of checkpoint files.
    pub path: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its element count.
    pub numel: usize,
    /// Whether weight decay applies (parameters of rank 2 and more).
    pub decay: bool,
    /// The unit it belongs to.
    pub unit: usize,
    /// Its offset inside its unit's flat space.
    pub offset: usize,
}

/// A group of parameters gathered and reduced together: the parameters outside every block,
/// or one block's.
#[derive(Debug, Clone)]
pub struct Unit {
    /// `rest` or `block N`.
    pub name: String,
    /// Its entries, a contiguous range of [`FlatLayout::entries`].
    pub entries: Range<usize>,
    /// Elements of its parameters.
    pub len: usize,
    /// Elements of each shard's piece (the unit padded to `piece × shards`).
    pub piece: usize,
    /// Where its piece starts inside a shard.
    pub shard_offset: usize,
}

impl Unit {
    /// The unit's padded length.
    pub fn padded(&self, shards: usize) -> usize {
        self.piece * shards
    }
}

/// The flat space of a model's trainable parameters, unit by unit, cut into `shards` equal
/// shards; see the module documentation.
#[derive(Debug, Clone)]
pub struct FlatLayout {
    /// Every trainable parameter, unit by unit, in module order inside a unit.
    pub entries: Vec<Entry>,
    /// The units: `rest` first, then the blocks in order.
    pub units: Vec<Unit>,
    /// Number of shards.
    pub shards: usize,
    /// Elements of one shard.
    pub shard_len: usize,
    index: HashMap<ParamId, usize>,
}

/// The trainable parameters of a module in module order: `(id, path, shape)`.
pub fn trainable_params<M: Module>(module: &M) -> Vec<(ParamId, String, Vec<usize>)> {
    struct Collect {
        path: Vec<String>,
        out: Vec<(ParamId, String, Vec<usize>)>,
    }
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_require_grad() {
                self.out
                    .push((param.id, self.path.join("."), param.shape().to_vec()));
            }
        }
    }
    let mut c = Collect {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut c);
    c.out
}

impl FlatLayout {
    /// The layout of `module`'s trainable parameters, with `blocks[i]` the ids of block `i`'s
    /// parameters, cut into `shards` shards. A parameter claimed by no block, or by more than
    /// one, belongs to the `rest` unit.
    pub fn new<M: Module>(module: &M, blocks: &[Vec<ParamId>], shards: usize) -> Self {
        Self::build(trainable_params(module), blocks, shards)
    }

    /// The layout of the trainable parameters of `module` whose ids are in `ids` (one
    /// optimizer's group), in module order, as one unit cut into `shards` shards.
    pub fn of_params<M: Module>(module: &M, ids: &[ParamId], shards: usize) -> Self {
        let chosen: std::collections::HashSet<ParamId> = ids.iter().copied().collect();
        let params = trainable_params(module)
            .into_iter()
            .filter(|(id, _, _)| chosen.contains(id))
            .collect();
        Self::build(params, &[], shards)
    }

    fn build(
        params: Vec<(ParamId, String, Vec<usize>)>,
        blocks: &[Vec<ParamId>],
        shards: usize,
    ) -> Self {
        assert!(shards > 0, "a layout needs at least one shard");
        let mut owner: HashMap<ParamId, Option<usize>> = HashMap::new();
        for (b, ids) in blocks.iter().enumerate() {
            for id in ids {
                owner
                    .entry(*id)
                    .and_modify(|o| *o = None)
                    .or_insert(Some(b));
            }
        }
        let unit_of = |id: &ParamId| match owner.get(id) {
            Some(Some(b)) => b + 1,
            _ => 0,
        };
        let mut entries = Vec::with_capacity(params.len());
        let mut units = Vec::with_capacity(blocks.len() + 1);
        let mut shard_offset = 0;
        for u in 0..=blocks.len() {
            let start = entries.len();
            let mut len = 0;
            for (id, path, shape) in params.iter().filter(|(id, _, _)| unit_of(id) == u) {
                let numel = shape.iter().product();
                entries.push(Entry {
                    id: *id,
                    path: path.clone(),
                    shape: shape.clone(),
                    numel,
                    decay: shape.len() >= 2,
                    unit: u,
                    offset: len,
                });
                len += numel;
            }
            let piece = len.div_ceil(shards);
            units.push(Unit {
                name: if u == 0 {
                    "rest".to_string()
                } else {
                    format!("block {}", u - 1)
                },
                entries: start..entries.len(),
                len,
                piece,
                shard_offset,
            });
            shard_offset += piece;
        }
        let index = entries.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
        Self {
            entries,
            units,
            shards,
            shard_len: shard_offset,
            index,
        }
    }

    /// The same parameters cut into another number of shards.
    pub fn with_shards(&self, shards: usize) -> Self {
        let mut out = self.clone();
        out.shards = shards;
        let mut offset = 0;
        for u in &mut out.units {
            u.piece = u.len.div_ceil(shards);
            u.shard_offset = offset;
            offset += u.piece;
        }
        out.shard_len = offset;
        out
    }

    /// The layout of units `units` alone (in that order, renumbered from 0), cut as this
    /// one: a pipeline stage's share of the model.
    pub fn select(&self, units: &[usize]) -> Self {
        let mut entries = Vec::new();
        let mut chosen = Vec::with_capacity(units.len());
        let mut shard_offset = 0;
        for (new, &u) in units.iter().enumerate() {
            let unit = &self.units[u];
            let start = entries.len();
            for e in &self.entries[unit.entries.clone()] {
                entries.push(Entry {
                    unit: new,
                    ..e.clone()
                });
            }
            chosen.push(Unit {
                entries: start..entries.len(),
                shard_offset,
                ..unit.clone()
            });
            shard_offset += unit.piece;
        }
        let index = entries.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
        Self {
            entries,
            units: chosen,
            shards: self.shards,
            shard_len: shard_offset,
            index,
        }
    }

    /// Elements of every parameter, unpadded.
    pub fn total(&self) -> usize {
        self.units.iter().map(|u| u.len).sum()
    }

    /// The entry of parameter `id`, if it is trained.
    pub fn entry(&self, id: ParamId) -> Option<&Entry> {
        self.index.get(&id).map(|&i| &self.entries[i])
    }

    /// The range of shard `rank`'s piece inside unit `u`'s padded flat space.
    pub fn piece_range(&self, u: usize, rank: usize) -> Range<usize> {
        let p = self.units[u].piece;
        rank * p..(rank + 1) * p
    }

    /// The largest unit, in elements.
    pub fn largest_unit(&self) -> usize {
        self.units.iter().map(|u| u.len).max().unwrap_or(0)
    }

    /// The largest block unit (the `rest` unit excluded), in elements.
    pub fn largest_block(&self) -> usize {
        self.units.iter().skip(1).map(|u| u.len).max().unwrap_or(0)
    }

    /// Unit `u`'s parameter values in `module`, flattened in `dtype` and padded, on the
    /// parameters' device without autodiff.
    pub fn unit_values<M: Module>(
        &self,
        module: &M,
        u: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Tensor<1> {
        struct Collect<'a> {
            layout: &'a FlatLayout,
            unit: usize,
            dtype: FloatDType,
            parts: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some(e) = self.layout.entry(param.id) else {
                    return;
                };
                if e.unit == self.unit {
                    let t = param.val().inner().reshape([e.numel]);
                    self.parts.push(t.cast(self.dtype));
                }
            }
        }
        let mut c = Collect {
            layout: self,
            unit: u,
            dtype,
            parts: Vec::new(),
        };
        module.visit(&mut c);
        self.padded_cat(c.parts, u, dtype, device)
    }

    /// Unit `u`'s gradients, removed from `grads`, flattened in `dtype` and padded (zeros for
    /// parameters without a gradient).
    pub fn unit_grads<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
        u: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Tensor<1> {
        struct Collect<'a> {
            layout: &'a FlatLayout,
            grads: &'a mut GradientsParams,
            unit: usize,
            dtype: FloatDType,
            device: Device,
            parts: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some(e) = self.layout.entry(param.id) else {
                    return;
                };
                if e.unit != self.unit {
                    return;
                }
                let part = match self.grads.remove::<D>(param.id) {
                    Some(g) => g.reshape([e.numel]).cast(self.dtype),
                    None => Tensor::<1>::zeros([e.numel], &self.device.clone().without_autodiff())
                        .cast(self.dtype),
                };
                self.parts.push(part);
            }
        }
        let mut c = Collect {
            layout: self,
            grads,
            unit: u,
            dtype,
            device: device.clone(),
            parts: Vec::new(),
        };
        module.visit(&mut c);
        self.padded_cat(c.parts, u, dtype, device)
    }

    /// The units that have at least one gradient in `grads`, in unit order.
    pub fn units_in<M: Module>(&self, module: &M, grads: &GradientsParams) -> Vec<usize> {
        struct Find<'a> {
            layout: &'a FlatLayout,
            grads: &'a GradientsParams,
            found: Vec<bool>,
        }
        impl ModuleVisitor for Find<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(e) = self.layout.entry(param.id)
                    && self.grads.get::<D>(param.id).is_some()
                {
                    self.found[e.unit] = true;
                }
            }
        }
        let mut f = Find {
            layout: self,
            grads,
            found: vec![false; self.units.len()],
        };
        module.visit(&mut f);
        (0..self.units.len()).filter(|&u| f.found[u]).collect()
    }

    fn padded_cat(
        &self,
        mut parts: Vec<Tensor<1>>,
        u: usize,
        dtype: FloatDType,
        device: &Device,
    ) -> Tensor<1> {
        let unit = &self.units[u];
        let pad = unit.padded(self.shards) - unit.len;
        if pad > 0 {
            parts.push(Tensor::<1>::zeros([pad], &device.clone().without_autodiff()).cast(dtype));
        }
        if parts.is_empty() {
            return Tensor::<1>::zeros([0], &device.clone().without_autodiff()).cast(dtype);
        }
        Tensor::cat(parts, 0)
    }

    /// `module` with unit `u`'s parameters taken from `flat` (the unit's flat space, padded or
    /// not, on the device), in `dtype`, as trainable values on `device`.
    pub fn load_unit<M: Module>(
        &self,
        module: M,
        u: usize,
        flat: Tensor<1>,
        dtype: FloatDType,
        device: &Device,
    ) -> M {
        struct Load<'a> {
            layout: &'a FlatLayout,
            unit: usize,
            flat: Tensor<1>,
            dtype: FloatDType,
            device: &'a Device,
        }
        impl ModuleMapper for Load<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(e) = self.layout.entry(param.id) else {
                    return param;
                };
                if e.unit != self.unit {
                    return param;
                }
                let shape: [usize; D] = e.shape.clone().try_into().expect("the entry's rank");
                let value = self
                    .flat
                    .clone()
                    .slice(e.offset..e.offset + e.numel)
                    .reshape(shape)
                    .cast(self.dtype);
                let device = self.device;
                param.map(|_| param_tensor(value, device))
            }
        }
        let mut l = Load {
            layout: self,
            unit: u,
            flat,
            dtype,
            device,
        };
        module.map(&mut l)
    }

    /// `module` with unit `u`'s parameters replaced by one-element placeholders (zero-sized
    /// in what they hold), keeping their ids and shapes' ranks: the unit is released.
    pub fn release_unit<M: Module>(&self, module: M, u: usize, device: &Device) -> M {
        struct Release<'a> {
            layout: &'a FlatLayout,
            unit: usize,
            device: &'a Device,
        }
        impl ModuleMapper for Release<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                match self.layout.entry(param.id) {
                    Some(e) if e.unit == self.unit => {
                        let device = self.device;
                        let inner = Tensor::<D>::zeros([1; D], &device.clone().without_autodiff());
                        param.map(|_| param_tensor(inner, device))
                    }
                    _ => param,
                }
            }
        }
        module.map(&mut Release {
            layout: self,
            unit: u,
            device,
        })
    }

    /// Bytes of unit `u`'s parameters in `dtype`.
    pub fn unit_bytes(&self, u: usize, dtype: FloatDType) -> usize {
        self.units[u].len * dtype_bytes(dtype)
    }

    /// Bytes of every parameter in `dtype`.
    pub fn total_bytes(&self, dtype: FloatDType) -> usize {
        self.total() * dtype_bytes(dtype)
    }

    /// Per-element weight-decay flags of one shard (`true` where decay applies; padding
    /// never decays).
    pub fn shard_decay_mask(&self, rank: usize) -> Vec<bool> {
        let mut mask = vec![false; self.shard_len];
        for (u, unit) in self.units.iter().enumerate() {
            let piece = self.piece_range(u, rank);
            for e in &self.entries[unit.entries.clone()] {
                if !e.decay {
                    continue;
                }
                let lo = e.offset.max(piece.start);
                let hi = (e.offset + e.numel).min(piece.end);
                for i in lo..hi {
                    mask[unit.shard_offset + i - piece.start] = true;
                }
            }
        }
        mask
    }

    /// The canonical (unpadded, parameter-by-parameter in layout order) vector of a quantity
    /// laid out per shard: `shards[r]` is shard `r`'s values.
    pub fn assemble(&self, shards: &[Vec<f32>]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.total());
        for unit in &self.units {
            let mut padded = Vec::with_capacity(unit.padded(self.shards));
            for shard in shards {
                padded.extend_from_slice(&shard[unit.shard_offset..unit.shard_offset + unit.piece]);
            }
            out.extend_from_slice(&padded[..unit.len]);
        }
        out
    }

    /// Shard `rank`'s part of a canonical vector (see [`Self::assemble`]), zeros as padding.
    pub fn cut(&self, canonical: &[f32], rank: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.shard_len);
        let mut base = 0;
        for (u, unit) in self.units.iter().enumerate() {
            let piece = self.piece_range(u, rank);
            for i in piece {
                out.push(if i < unit.len {
                    canonical[base + i]
                } else {
                    0.0
                });
            }
            base += unit.len;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};

    #[derive(Module, Debug)]
    struct Two {
        first: Linear,
        blocks: Vec<Linear>,
    }

    fn model(device: &Device) -> Two {
        Two {
            first: LinearConfig::new(3, 2).init(device),
            blocks: vec![
                LinearConfig::new(2, 5).init(device),
                LinearConfig::new(5, 1).init(device),
            ],
        }
    }

    fn block_ids(m: &Two) -> Vec<Vec<ParamId>> {
        m.blocks.iter().map(trainable_ids).collect()
    }

    #[test]
    fn layout_groups_units_pads_pieces_and_names_paths() {
        let device = Device::flex().autodiff();
        let m = model(&device);
        let layout = FlatLayout::new(&m, &block_ids(&m), 4);
        // rest: 3·2 + 2 = 8; block 0: 2·5 + 5 = 15; block 1: 5 + 1 = 6.
        let lens: Vec<usize> = layout.units.iter().map(|u| u.len).collect();
        assert_eq!(lens, vec![8, 15, 6]);
        let pieces: Vec<usize> = layout.units.iter().map(|u| u.piece).collect();
        assert_eq!(pieces, vec![2, 4, 2]);
        assert_eq!(layout.shard_len, 8);
        assert_eq!(layout.total(), 29);
        assert_eq!(layout.entries[0].path, "first.weight");
        assert_eq!(layout.entries[2].path, "blocks.0.weight");
        assert!(layout.entries[0].decay && !layout.entries[1].decay);
        assert_eq!(layout.largest_block(), 15);
    }

    #[test]
    fn cut_and_assemble_are_inverse_for_every_shard_count() {
        let device = Device::flex().autodiff();
        let m = model(&device);
        for shards in 1..=5 {
            let layout = FlatLayout::new(&m, &block_ids(&m), shards);
            let canonical: Vec<f32> = (0..layout.total()).map(|i| i as f32).collect();
            let pieces: Vec<Vec<f32>> = (0..shards).map(|r| layout.cut(&canonical, r)).collect();
            assert!(pieces.iter().all(|p| p.len() == layout.shard_len));
            assert_eq!(layout.assemble(&pieces), canonical, "{shards} shards");
        }
    }

    #[test]
    fn unit_values_load_and_release_round_trip() {
        let device = Device::flex().autodiff();
        let m = model(&device);
        let layout = FlatLayout::new(&m, &block_ids(&m), 3);
        let before = parameter_values(&m);
        let flat = layout.unit_values(&m, 1, FloatDType::F32, &device);
        assert_eq!(flat.dims(), [layout.units[1].padded(3)]);
        let released = layout.release_unit(m, 1, &device);
        assert_eq!(released.blocks[0].weight.shape().num_elements(), 1);
        assert!(released.blocks[0].weight.is_require_grad());
        let back = layout.load_unit(released, 1, flat, FloatDType::F32, &device);
        assert_eq!(parameter_values(&back), before);
        assert!(back.blocks[0].weight.is_require_grad());
    }

    #[test]
    fn decay_mask_marks_matrices_only() {
        let device = Device::flex().autodiff();
        let m = model(&device);
        let layout = FlatLayout::new(&m, &block_ids(&m), 1);
        let mask = layout.shard_decay_mask(0);
        let decayed = mask.iter().filter(|d| **d).count();
        assert_eq!(decayed, 6 + 10 + 5);
    }
}
