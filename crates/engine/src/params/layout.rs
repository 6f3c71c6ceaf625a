//! [`FlatLayout`]: the trainable parameters in units, each padded to a multiple of the shard
//! count and cut into equal pieces; what a shard holds and where a parameter lives in it.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::FloatDType;

use super::floats::dtype_bytes;

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

/// Where a shard's piece of a unit meets one parameter ([`FlatLayout::spans`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// The parameter: its index in [`FlatLayout::entries`].
    pub entry: usize,
    /// The range of the parameter's flattened values the shard holds.
    pub within: Range<usize>,
    /// Where that range starts in the shard (laid out as [`FlatLayout::cut`] lays it out).
    pub at: usize,
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
    float_params(module)
        .into_iter()
        .filter(|p| p.3 == Kind::Trained)
        .map(|(id, path, shape, _)| (id, path, shape))
        .collect()
}

/// The module path and shape of every float tensor of `module`, in module order.
pub fn float_shapes<M: Module>(module: &M) -> Vec<(String, Vec<usize>)> {
    float_params(module)
        .into_iter()
        .map(|(_, path, shape, _)| (path, shape))
        .collect()
}

/// What a float tensor is to a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Trained,
    /// Not trained (a frozen parameter or a buffer), in a float dtype.
    Frozen,
    /// Not trained and quantised (QLoRA's bases): no layout takes it.
    Quantized,
}

/// Every float tensor of a module in module order: `(id, path, shape, kind)`.
fn float_params<M: Module>(module: &M) -> Vec<(ParamId, String, Vec<usize>, Kind)> {
    struct Collect {
        path: Vec<String>,
        out: Vec<(ParamId, String, Vec<usize>, Kind)>,
    }
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let kind = if param.is_require_grad() {
                Kind::Trained
            } else if param.val().dtype().is_float() {
                Kind::Frozen
            } else {
                Kind::Quantized
            };
            self.out
                .push((param.id, self.path.join("."), param.shape().to_vec(), kind));
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

    /// The layout of `module`'s frozen parameters (not trained and not buffers: see
    /// [`running_state_ids`](super::floats::running_state_ids)), in the units of `blocks`, cut into
    /// `shards` shards: what ZeRO-3 shards and gathers besides the trained ones.
    pub fn frozen<M: Module>(module: &M, blocks: &[Vec<ParamId>], shards: usize) -> Self {
        let running = super::floats::running_state_ids(module);
        let params = float_params(module)
            .into_iter()
            .filter(|(id, _, _, kind)| *kind == Kind::Frozen && !running.contains(id))
            .map(|(id, path, shape, _)| (id, path, shape))
            .collect();
        Self::build(params, blocks, shards)
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

    /// Where shard `rank`'s piece of each unit meets each parameter, unit by unit: what a
    /// sharded checkpoint names the shard's values by.
    pub fn spans(&self, rank: usize) -> Vec<Span> {
        let mut out = Vec::new();
        for (u, unit) in self.units.iter().enumerate() {
            let piece = self.piece_range(u, rank);
            for entry in unit.entries.clone() {
                let e = &self.entries[entry];
                let lo = e.offset.max(piece.start);
                let hi = (e.offset + e.numel).min(piece.end);
                if lo < hi {
                    out.push(Span {
                        entry,
                        within: lo - e.offset..hi - e.offset,
                        at: unit.shard_offset + lo - piece.start,
                    });
                }
            }
        }
        out
    }

    /// The largest unit, in elements.
    pub fn largest_unit(&self) -> usize {
        self.units.iter().map(|u| u.len).max().unwrap_or(0)
    }

    /// The largest block unit (the `rest` unit excluded), in elements.
    pub fn largest_block(&self) -> usize {
        self.units.iter().skip(1).map(|u| u.len).max().unwrap_or(0)
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
        self.shard_mask(rank, |e| e.decay)
    }

    /// Which elements of shard `rank` belong to a parameter for which `pick` holds.
    pub fn shard_mask(&self, rank: usize, pick: impl Fn(&Entry) -> bool) -> Vec<bool> {
        let mut mask = vec![false; self.shard_len];
        for (u, unit) in self.units.iter().enumerate() {
            let piece = self.piece_range(u, rank);
            for e in &self.entries[unit.entries.clone()] {
                if !pick(e) {
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
    use crate::params::*;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::DType;

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
            // The spans name every value of every shard once, where `cut` put it.
            let mut seen = vec![0; canonical.len()];
            for (r, piece) in pieces.iter().enumerate() {
                for span in layout.spans(r) {
                    let e = &layout.entries[span.entry];
                    let base: usize = layout.units[..e.unit].iter().map(|u| u.len).sum();
                    for (k, i) in span.within.clone().enumerate() {
                        let at = base + e.offset + i;
                        assert_eq!(piece[span.at + k], canonical[at]);
                        seen[at] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{shards} shards: {seen:?}");
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

    /// What a mixed-precision replica's compute copy is made of (`Replica::begin`): the units
    /// loaded in bf16 from views of the stepped vector cast once carry each parameter's values
    /// rounded to bf16, in bf16, with the module's ids and gradient tracking.
    #[test]
    fn units_loaded_from_a_vector_cast_once_are_each_parameter_rounded() {
        let device = Device::flex().autodiff();
        let m = model(&device);
        let layout = FlatLayout::new(&m, &block_ids(&m), 1);
        let inner = device.clone().without_autodiff();
        // Values bf16 rounds (a third's steps).
        let values: Vec<f32> = (0..layout.total()).map(|i| 1.0 + i as f32 / 3.0).collect();
        let flat = Tensor::<1>::from_data(TensorData::new(values, [layout.total()]), &inner);
        let low = flat.cast(FloatDType::BF16);
        let rounded = low.clone().cast(FloatDType::F32);
        let (mut copy, mut expected) = (m.clone(), m.clone());
        let mut base = 0;
        for (u, unit) in layout.units.iter().enumerate() {
            let part = |t: &Tensor<1>| t.clone().slice(base..base + unit.len);
            copy = layout.load_unit(copy, u, part(&low), FloatDType::BF16, &device);
            expected = layout.load_unit(expected, u, part(&rounded), FloatDType::F32, &device);
            base += unit.len;
        }
        assert_eq!(parameter_values(&copy), parameter_values(&expected));
        for (p, q) in [
            (&copy.first.weight, &m.first.weight),
            (&copy.blocks[1].weight, &m.blocks[1].weight),
        ] {
            assert_eq!(p.val().dtype(), DType::BF16);
            assert_eq!(p.id, q.id);
            assert!(p.is_require_grad());
        }
        let bias = copy.blocks[0].bias.as_ref().expect("a bias");
        assert_eq!(bias.val().dtype(), DType::BF16);
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
