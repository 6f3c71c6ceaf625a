//! A rank's share of a sharded checkpoint, and where a rank reads its part of one back.
//!
//! A sharded checkpoint holds every tensor of the training state — each trained (or frozen)
//! parameter under its module path, each optimizer state leaf of a parameter under
//! [`optim_tensor`] — as flattened ranges that the ranks wrote, each the ranges it holds
//! ([`Share`]: its ZeRO shard, or its equal part of what every replica holds, so that each
//! range is written once). A rank reading one back asks a [`Source`] for the ranges it needs,
//! whatever world wrote them.

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::FloatDType;

use super::flat::{OptimState, Scalars};
use crate::config::OptimizerKind;
use crate::error::Result;
use crate::params::{FlatLayout, float_tensors, trainable_params};

/// The checkpoint's name of a parameter's optimizer state leaf: `optimizer:<leaf>:<path>`
/// for the model's one optimizer, `optimizer.<group>:<leaf>:<path>` for a parameter group's.
pub fn optim_tensor(group: &str, leaf: &str, path: &str) -> String {
    if group.is_empty() {
        format!("optimizer:{leaf}:{path}")
    } else {
        format!("optimizer.{group}:{leaf}:{path}")
    }
}

/// A flattened range of one tensor of the checkpoint, as a rank holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// The tensor: a parameter's module path, or [`optim_tensor`]'s name.
    pub tensor: String,
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    /// A parameter's id (restored with it, as a gathered checkpoint's record restores it).
    pub id: Option<u64>,
    /// The dtype the tensor is restored in (the values are kept in f32, exact for bf16/f16).
    pub dtype: FloatDType,
    /// Where the range starts in the flattened tensor.
    pub start: usize,
    /// Its length.
    pub len: usize,
    /// The share's buffer that holds its values, and where they start in it.
    pub buffer: usize,
    /// Where its values start in that buffer.
    pub at: usize,
    /// The part of a tensor cut over a tensor-parallel group that `tensor` is (its name then
    /// [`part_name`]'s), when it is one.
    pub cut: Option<Cut>,
}

/// A tensor-parallel rank's part of a cut tensor, as a sharded checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Cut {
    /// The rank's place in its group.
    pub index: usize,
    /// The group's size.
    pub of: usize,
    /// How the whole is cut.
    pub split: kiln_models::tp::Split,
    /// The whole tensor's shape.
    pub whole: Vec<usize>,
}

/// The name a sharded checkpoint gives part `index` of `of` of tensor `tensor`.
pub fn part_name(tensor: &str, index: usize, of: usize) -> String {
    format!("{tensor}#{index}/{of}")
}

/// The module path a checkpoint tensor's name holds (a parameter's own, or the parameter
/// whose optimizer state leaf it is).
pub fn path_of(tensor: &str) -> &str {
    match tensor.split_once(':') {
        Some((_, rest)) => rest.split_once(':').map_or(rest, |(_, path)| path),
        None => tensor,
    }
}

/// One rank's share of a sharded checkpoint: its pieces over host buffers (a copy taken on
/// the step's thread: the write goes on while the steps do), the model's tensors it writes
/// outside the pieces, and on rank 0 every optimizer's kind and scalars.
#[derive(Default)]
pub struct Share {
    /// The values, copied to the host.
    pub buffers: Vec<Vec<f32>>,
    /// Which tensor ranges the buffers hold.
    pub pieces: Vec<Piece>,
    /// The record of the model's tensors this rank writes whole (buffers, a quantized base,
    /// integer tensors, the parameters of a strategy that gathers them): rank 0's, or each
    /// pipeline stage's own.
    pub rest: Option<ModuleRecord>,
    /// `(group, kind, scalars)` of every optimizer (`""`: the model's one optimizer), on rank 0.
    pub optimizers: Option<Vec<(String, OptimizerKind, Scalars)>>,
}

impl Share {
    /// Adds `values` — shard `rank` of `layout`, laid out as [`FlatLayout::cut`] lays a shard
    /// out — and a piece for each parameter range it holds, the tensor named by `name` from
    /// the parameter's path.
    pub fn add_shard(
        &mut self,
        layout: &FlatLayout,
        rank: usize,
        values: Vec<f32>,
        dtype: &dyn Fn(&crate::params::Entry) -> FloatDType,
        name: impl Fn(&str) -> String,
    ) {
        let buffer = self.buffers.len();
        for span in layout.spans(rank) {
            let e = &layout.entries[span.entry];
            let tensor = name(&e.path);
            let id = (tensor == e.path).then(|| e.id.val());
            self.pieces.push(Piece {
                tensor,
                shape: e.shape.clone(),
                id,
                dtype: dtype(e),
                start: span.within.start,
                len: span.within.len(),
                buffer,
                at: span.at,
                cut: None,
            });
        }
        self.buffers.push(values);
    }

    /// Adds `other`'s pieces and values to this share (its rest and optimizers are dropped).
    pub fn merge(&mut self, other: Share) {
        let base = self.buffers.len();
        self.buffers.extend(other.buffers);
        self.pieces.extend(other.pieces.into_iter().map(|p| Piece {
            buffer: p.buffer + base,
            ..p
        }));
    }

    /// Values of all pieces, in bytes.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.len * 4).sum()
    }

    /// The share of a rank that holds the whole model and every optimizer's canonical state
    /// (what a strategy that gathers them gives): every trained parameter and optimizer leaf
    /// whole, and the rest of the model.
    pub fn whole<M: Module>(model: M, states: Vec<(String, OptimState)>) -> Self {
        let mut share = Share::default();
        let dtypes = param_dtypes(&model);
        let trained = trainable_params(&model);
        let trained_ids: Vec<ParamId> = trained.iter().map(|t| t.0).collect();
        let values = float_tensors(&model, Some(true));
        for ((id, path, shape), values) in trained.into_iter().zip(values) {
            let dtype = dtypes.get(&id).copied().unwrap_or(FloatDType::F32);
            share.add_whole(path, Some(id.val()), shape, dtype, values);
        }
        let mut optimizers = Vec::with_capacity(states.len());
        for (group, state) in states {
            for (path, leaf, shape, values) in state.tensors {
                share.add_whole(
                    optim_tensor(&group, &leaf, &path),
                    None,
                    shape,
                    FloatDType::F32,
                    values,
                );
            }
            optimizers.push((group, state.kind, state.scalars));
        }
        share.rest = Some(rest_record(model, &trained_ids));
        share.optimizers = Some(optimizers);
        share
    }

    fn add_whole(
        &mut self,
        tensor: String,
        id: Option<u64>,
        shape: Vec<usize>,
        dtype: FloatDType,
        v: Vec<f32>,
    ) {
        self.pieces.push(Piece {
            tensor,
            shape,
            id,
            dtype,
            start: 0,
            len: v.len(),
            buffer: self.buffers.len(),
            at: 0,
            cut: None,
        });
        self.buffers.push(v);
    }
}

/// The record of `model`'s tensors but those in `held` (which pieces hold).
pub fn rest_record<M: Module>(model: M, held: &[ParamId]) -> ModuleRecord {
    let held: std::collections::HashSet<ParamId> = held.iter().copied().collect();
    let rest: Vec<ParamId> = all_ids(&model)
        .into_iter()
        .filter(|id| !held.contains(id))
        .collect();
    model.into_record_group(ParamGroup::from_ids(rest))
}

/// The ids of every tensor of `module` (float, integer and boolean), in module order.
pub fn tensor_ids<M: Module>(module: &M) -> Vec<ParamId> {
    all_ids(module)
}

/// The float dtype of each float parameter of `module`, by id.
pub fn param_dtypes<M: Module>(module: &M) -> std::collections::HashMap<ParamId, FloatDType> {
    struct Dtypes(std::collections::HashMap<ParamId, FloatDType>);
    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0
                .insert(param.id, crate::params::float_dtype(param.val().dtype()));
        }
    }
    let mut d = Dtypes(std::collections::HashMap::new());
    module.visit(&mut d);
    d.0
}

/// The ids of every tensor of `module` (float, integer and boolean).
fn all_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            self.0.push(param.id);
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// Where a rank reads its part of a sharded checkpoint: ranges of its tensors, whichever
/// ranks wrote them.
pub trait Source: Sync {
    /// The values of `range` of the flattened `tensor`; an error names the checkpoint's file
    /// and what is missing or damaged.
    fn read(&self, tensor: &str, range: Range<usize>) -> Result<Vec<f32>>;
    /// Whether the checkpoint holds `tensor` (as itself or as a tensor-parallel group's
    /// parts).
    fn holds(&self, tensor: &str) -> bool;
    /// The whole shape of `tensor`, if the checkpoint holds it.
    fn shape(&self, tensor: &str) -> Option<Vec<usize>>;
    /// The kind and scalars of parameter group `group`'s optimizer (`""`: the model's one),
    /// `None` when the checkpoint holds no state for it.
    fn optimizer(&self, group: &str) -> Option<(OptimizerKind, Scalars)>;
    /// The optimizer state leaves the checkpoint holds for `group` (`momentum.moment_1`, …).
    fn leaves(&self, group: &str) -> Vec<String>;
    /// The whole canonical optimizer state of `group` (what a strategy that takes the
    /// canonical state reads).
    fn canonical(&self, group: &str) -> Result<OptimState>;

    /// Shard `rank` of `layout` of the tensors `name` gives for each parameter path, laid out
    /// as [`FlatLayout::cut`] lays it out (zeros as padding): only the ranges it holds are read.
    fn shard(
        &self,
        layout: &FlatLayout,
        rank: usize,
        name: &dyn Fn(&str) -> String,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0.0; layout.shard_len];
        for span in layout.spans(rank) {
            let e = &layout.entries[span.entry];
            let values = self.read(&name(&e.path), span.within.clone())?;
            out[span.at..span.at + values.len()].copy_from_slice(&values);
        }
        Ok(out)
    }
}
