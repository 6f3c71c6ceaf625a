//! `RankKit`, what every strategy's rank holds: its collective, device, layout and
//! optimizer, the reductions of flat gradients (all-reduce in buckets, the reduce-scatter of
//! one unit) — the step that follows them is `update.rs`'s — and the
//! canonical optimizer state in and out of the rank's shard. (Its name is not `cores.rs`'s:
//! those are a CPU's.)

use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::FloatDType;

use super::context::Context;
use super::host::{reduce_host, scatter_host};
use super::memory::Memory;
use crate::comm::{Collective, ReduceOp};
use crate::config::ReduceDtype;
use crate::error::{Error, Result};
use crate::exec::{Pass, Recompute};
use crate::optim::{FlatOptimizer, OptimState, Share, Source, optim_tensor, rest_record};
use crate::params::{
    Entry, FlatLayout, collect_floats, has_buffers, host_f32, replace_floats, sync_running_state,
};
use crate::precision::Policy;

/// The group a rank's kit reduces in: the one its strategy was built with, or one the
/// strategy split off and owns (a DiLoCo island).
#[derive(Clone)]
pub(crate) enum Group<'a> {
    Borrowed(&'a dyn Collective),
    Owned(std::sync::Arc<dyn Collective>),
}

impl<'a> std::ops::Deref for Group<'a> {
    type Target = dyn Collective + 'a;

    fn deref(&self) -> &Self::Target {
        match self {
            Group::Borrowed(c) => *c,
            Group::Owned(c) => &**c,
        }
    }
}

/// A rank's shared equipment; see the module documentation.
pub(crate) struct RankKit<'a> {
    pub comm: Group<'a>,
    /// The rank's device with autodiff.
    pub device: Device,
    /// The same device without autodiff, where flat buffers and optimizer state live.
    pub inner: Device,
    pub layout: FlatLayout,
    pub optimizer: FlatOptimizer,
    /// The precision policy: the master and compute dtypes, the compute copy.
    pub policy: Policy,
    /// The dtype of the parameters the optimizer steps (the policy's master dtype).
    pub master: FloatDType,
    pub recompute: Recompute,
    pub sync_batchnorm: bool,
    pub bucket_elements: usize,
    /// Reduce gradients beside the backward where the strategy can (`dist.overlap`).
    pub overlap: bool,
    pub memory: Memory,
    /// Whether the last optimizer step was refused for a non-finite gradient (no scaler).
    pub nonfinite: bool,
    /// Whether a step's gradient may be checked on the device, the step skipped there and the
    /// host told later (the context's `decide_on_device`, for a rank alone in its group).
    pub on_device: bool,
    /// Whether the last step's check was kept on the device (the host did not wait for it).
    pub deferred: bool,
    pub(super) sync_seconds: f64,
    /// The rank's tensor-parallel group, where it has one.
    pub(super) tp: Option<TpNorm<'a>>,
}

/// What the step asks of a tensor-parallel group: the overflow flag and the gradient's norm
/// over the whole model, each rank's parts counted once and the parameters every rank holds
/// whole counted once among them.
pub(super) struct TpNorm<'a> {
    pub(super) comm: &'a dyn Collective,
    /// Per element of the rank's shard: 1 for a part of a cut parameter, `1 / tp` for a
    /// parameter whole on every rank of the group (its gradient is the same on each).
    pub(super) weights: Tensor<1>,
    /// The runs of the shard whose gradients are parts of a whole parameter's
    /// (`Split::Summed`): summed over the group before anything reads them.
    pub(super) summed: Vec<std::ops::Range<usize>>,
}

/// The runs of `true` in `mask`.
fn runs(mask: &[bool]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, &m) in mask.iter().enumerate() {
        match out.last_mut() {
            Some(r) if m && r.end == i => r.end = i + 1,
            _ if m => out.push(i..i + 1),
            _ => {}
        }
    }
    out
}

impl<'a> RankKit<'a> {
    /// The equipment for a rank of `ctx.comm` that steps its shard of `layout` (a layout of
    /// one shard: the whole of it).
    pub fn new(ctx: Context<'a>, layout: FlatLayout) -> Self {
        let comm = Group::Borrowed(ctx.comm);
        Self::in_group(ctx, comm, layout)
    }

    /// [`RankKit::new`] for a rank of `comm` rather than of `ctx.comm`.
    pub fn in_group(ctx: Context<'a>, comm: Group<'a>, layout: FlatLayout) -> Self {
        let shards = layout.shards;
        let on_device =
            ctx.decide_on_device && shards == 1 && comm.world_size() == 1 && ctx.tp.is_none();
        let master = ctx.policy.master;
        let rank = if shards > 1 { comm.rank() } else { 0 };
        let inner = ctx.device.clone().without_autodiff();
        let optimizer =
            FlatOptimizer::new(&ctx.optim, &layout.shard_decay_mask(rank), master, &inner);
        let tp = ctx.tp.as_ref().map(|place| {
            let whole = 1.0 / place.comm.world_size() as f32;
            let weights: Vec<f32> = layout
                .shard_mask(rank, |e| place.is_cut(&e.path))
                .into_iter()
                .map(|cut| if cut { 1.0 } else { whole })
                .collect();
            let n = weights.len();
            TpNorm {
                comm: place.comm,
                weights: Tensor::<1>::from_data(TensorData::new(weights, [n]), &inner),
                summed: runs(&layout.shard_mask(rank, |e| place.is_summed(&e.path))),
            }
        });
        Self {
            comm,
            device: ctx.device,
            inner,
            layout,
            optimizer,
            master,
            policy: ctx.policy,
            recompute: ctx.recompute,
            sync_batchnorm: ctx.sync_batchnorm,
            bucket_elements: ctx.bucket_elements.max(1),
            overlap: ctx.overlap,
            memory: Memory::default(),
            nonfinite: false,
            on_device,
            deferred: false,
            sync_seconds: 0.0,
            tp,
        }
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// How a micro-batch runs, with `recompute` as the strategy decides.
    pub fn pass(&self, recompute: Recompute) -> Pass<'_> {
        Pass {
            recompute,
            sync_bn: (self.sync_batchnorm && self.world() > 1).then_some(&*self.comm),
            device: &self.device,
            group: None,
        }
    }

    /// Runs `f` (a collective) and counts its time as synchronisation.
    pub fn timed<T>(&mut self, f: impl FnOnce(&dyn Collective) -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let comm = self.comm.clone();
        let out = f(&*comm);
        self.sync_seconds += started.elapsed().as_secs_f64();
        out
    }

    /// Counts `seconds` of waiting for a collective that ran elsewhere (a communication
    /// thread) as synchronisation.
    pub fn add_sync_seconds(&mut self, seconds: f64) {
        self.sync_seconds += seconds;
    }

    pub fn take_sync_seconds(&mut self) -> f64 {
        std::mem::take(&mut self.sync_seconds)
    }

    /// Records the device pool's bytes in use, where the backend has a pool.
    pub fn sample_pool(&mut self) {
        if let Some(p) = self.device.memory_pool_usage() {
            let used = p.bytes_in_use;
            self.memory.pool_peak = Some(self.memory.pool_peak.map_or(used, |m| m.max(used)));
        }
        self.memory.note();
    }

    /// The host values of a flat tensor as they travel in a reduction: f32, or rounded to
    /// bf16 (read back at half the bytes) and widened again.
    pub fn travelling(&self, flat: Tensor<1>) -> Result<Vec<f32>> {
        let readback = |e| Error::Worker(format!("gradient readback: {e:?}"));
        Ok(match self.policy.reduce_dtype() {
            ReduceDtype::F32 => flat
                .cast(FloatDType::F32)
                .into_data()
                .try_into_vec::<f32>()
                .map_err(readback)?,
            ReduceDtype::Bf16 => flat
                .cast(FloatDType::BF16)
                .into_data()
                .try_into_vec::<burn::tensor::bf16>()
                .map_err(readback)?
                .into_iter()
                .map(|x| x.to_f32())
                .collect(),
        })
    }

    /// The mean over ranks of the flat gradients `units` (each a unit's padded flat space),
    /// one bucket at a time; returns them concatenated on the host.
    pub fn all_reduce_units(&mut self, units: Vec<Tensor<1>>) -> Result<Vec<f32>> {
        let comm = self.comm.clone();
        self.reduce_in(&*comm, units, ReduceOp::Mean)
    }

    /// [`Self::all_reduce_units`] over `group`, with `op`.
    pub fn reduce_in(
        &mut self,
        group: &dyn Collective,
        units: Vec<Tensor<1>>,
        op: ReduceOp,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        let (dtype, bucket) = (self.policy.reduce_dtype(), self.bucket_elements);
        for t in units {
            let host = self.travelling(t)?;
            out.extend(self.timed(|_| reduce_host(group, host, op, dtype, bucket))?);
        }
        Ok(out)
    }

    /// Unit `u`'s gradients in `grads`, reduce-scattered (mean over ranks): this rank's piece
    /// is added into `shard` at the unit's place. The unit's whole gradient exists only here.
    pub fn scatter_unit<M: Module>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
        u: usize,
        shard: &mut [f32],
    ) -> Result<()> {
        let host = self.unit_travelling(model, grads, u)?;
        let dtype = self.policy.reduce_dtype();
        let piece = self.timed(|c| scatter_host(c, &host, dtype))?;
        drop(host);
        self.add_piece(u, piece, shard);
        Ok(())
    }

    /// Unit `u`'s whole gradients in `grads` on the host, as they travel to a reduce-scatter,
    /// counted as held until [`Self::add_piece`] lands the rank's piece.
    pub fn unit_travelling<M: Module>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
        u: usize,
    ) -> Result<Vec<f32>> {
        self.memory.grads.add(self.unit_grad_bytes(u));
        self.memory.note();
        let flat = self
            .layout
            .unit_grads(model, grads, u, FloatDType::F32, &self.device);
        self.travelling(flat)
    }

    /// Adds `piece`, this rank's piece of unit `u`'s averaged gradients, into `shard` at the
    /// unit's place; the unit's whole gradients are no longer held.
    pub fn add_piece(&mut self, u: usize, piece: Vec<f32>, shard: &mut [f32]) {
        let unit = &self.layout.units[u];
        for (d, v) in shard[unit.shard_offset..unit.shard_offset + unit.piece]
            .iter_mut()
            .zip(piece)
        {
            *d += v;
        }
        self.memory.grads.sub(self.unit_grad_bytes(u));
    }

    /// The bytes of unit `u`'s whole (padded) f32 gradients.
    fn unit_grad_bytes(&self, u: usize) -> usize {
        self.layout.units[u].padded(self.layout.shards) * 4
    }

    /// The rank's piece of unit `u` of `model`'s parameters, in the master dtype.
    pub fn unit_piece<M: Module>(&self, model: &M, u: usize) -> Tensor<1> {
        let rank = if self.layout.shards > 1 {
            self.rank()
        } else {
            0
        };
        self.layout
            .unit_values(model, u, self.master, &self.inner)
            .slice(self.layout.piece_range(u, rank))
    }

    /// This rank's shard of `model`'s parameters, in the master dtype.
    pub fn shard_of<M: Module>(&self, model: &M) -> Tensor<1> {
        let pieces: Vec<Tensor<1>> = (0..self.layout.units.len())
            .map(|u| self.unit_piece(model, u))
            .collect();
        cat_or_empty(pieces, self.master, &self.inner)
    }

    /// The canonical vector of a quantity of which every rank holds its shard (`mine`).
    pub fn gather_canonical(&mut self, mine: &[f32]) -> Result<Vec<f32>> {
        if self.layout.shards == 1 {
            return Ok(self.layout.assemble(&[mine.to_vec()]));
        }
        let all = self.timed(|c| c.all_gather(mine))?;
        let n = self.layout.shard_len;
        let shards: Vec<Vec<f32>> = all.chunks(n).map(<[f32]>::to_vec).collect();
        Ok(self.layout.assemble(&shards))
    }

    /// `values` as a flat tensor on the rank's inner device (where the optimizer steps).
    pub fn on_inner(&self, values: Vec<f32>) -> Tensor<1> {
        let n = values.len();
        Tensor::<1>::from_data(TensorData::new(values, [n]), &self.inner)
    }

    /// `model` with every unit's parameters from the canonical vector `values` (on the host).
    pub fn load_canonical<M: Module>(&self, model: M, values: Vec<f32>) -> M {
        let flat = self.on_inner(values);
        self.load_flat(model, flat)
    }

    /// `model` with every unit's parameters from `flat`, a canonical vector on the device.
    pub fn load_flat<M: Module>(&self, model: M, flat: Tensor<1>) -> M {
        self.load_flat_in(model, flat, self.master)
    }

    /// [`Self::load_flat`] with the parameters in `dtype` (views of `flat` where it is
    /// already in it).
    pub fn load_flat_in<M: Module>(&self, mut model: M, flat: Tensor<1>, dtype: FloatDType) -> M {
        let mut base = 0;
        for (u, unit) in self.layout.units.iter().enumerate() {
            let part = flat.clone().slice(base..base + unit.len);
            model = self.layout.load_unit(model, u, part, dtype, &self.device);
            base += unit.len;
        }
        model
    }

    /// The canonical optimizer state (on rank 0); every rank takes part in the gathers.
    pub fn optimizer_state(&mut self) -> Result<Option<OptimState>> {
        let (tensors, scalars) = self.optimizer.export();
        let mut leaves = Vec::with_capacity(tensors.len());
        for (name, shard) in tensors {
            leaves.push((name, self.gather_canonical(&shard)?));
        }
        Ok((self.rank() == 0)
            .then(|| OptimState::from_leaves(self.optimizer.kind(), &self.layout, leaves, scalars)))
    }

    /// Takes this rank's part of a canonical optimizer state.
    pub fn load_optimizer_state(&mut self, state: &OptimState) -> Result<()> {
        if state.kind != self.optimizer.kind() {
            return Err(Error::checkpoint(format!(
                "the checkpoint's optimizer state is {}'s, but optim.name = {:?}",
                crate::config::name_of(&state.kind),
                crate::config::name_of(&self.optimizer.kind())
            )));
        }
        let rank = if self.layout.shards > 1 {
            self.rank()
        } else {
            0
        };
        let leaves = state.leaves(&self.layout)?;
        let parts = leaves
            .into_iter()
            .map(|(name, v)| (name, self.layout.cut(&v, rank)))
            .collect();
        self.optimizer.import(parts, state.scalars.clone())?;
        self.memory.optim.set(self.optimizer.state_bytes());
        Ok(())
    }

    /// The layout this rank's share of a sharded checkpoint is cut by, and its place in it:
    /// the rank's own shard, or — where every rank holds the whole space (`single`, `ddp`) —
    /// the space cut into one equal part per rank, so that each value is written once.
    fn write_layout(&self) -> (FlatLayout, usize) {
        if self.layout.shards > 1 {
            (self.layout.clone(), self.rank())
        } else {
            (self.layout.with_shards(self.world()), self.rank())
        }
    }

    /// `flat` (this kit's layout of one shard) as `layout`'s shard `rank` (see
    /// [`Self::write_layout`]), on the device: itself, or its part when it is the whole space.
    fn write_part(&self, flat: Tensor<1>, layout: &FlatLayout, rank: usize) -> Tensor<1> {
        if self.layout.shards > 1 {
            return flat;
        }
        part_of(flat, layout, rank)
    }

    /// This rank's share of a sharded checkpoint of parameter group `group` (`""`: the
    /// model's one optimizer): `params` — the rank's flat parameters in this kit's layout —
    /// and its optimizer state, each copied to the host as [`Self::write_layout`] cuts them,
    /// each parameter's dtype as `dtype` says; with the optimizer's scalars (for the lead).
    pub fn share(
        &mut self,
        params: Tensor<1>,
        group: &str,
        dtype: &dyn Fn(&Entry) -> FloatDType,
    ) -> (Share, crate::optim::Scalars) {
        let (layout, rank) = self.write_layout();
        let mut share = Share::default();
        let values = host_f32(self.write_part(params, &layout, rank));
        share.add_shard(&layout, rank, values, dtype, |path| path.to_string());
        let whole = self.layout.shards == 1;
        let (tensors, scalars) =
            self.optimizer
                .export_part(&|t| self.write_part(t, &layout, rank), &|v| {
                    if whole { layout.cut(&v, rank) } else { v }
                });
        for (leaf, values) in tensors {
            share.add_shard(&layout, rank, values, &|_| FloatDType::F32, |path| {
                optim_tensor(group, &leaf, path)
            });
        }
        (share, scalars)
    }

    /// Adds the frozen parameters of `model` (which every rank holds whole) to `share`, this
    /// rank's equal part of them; returns their ids.
    pub fn share_frozen<M: Module>(
        &self,
        share: &mut Share,
        model: &M,
        dtype: &dyn Fn(&Entry) -> FloatDType,
    ) -> Vec<burn::module::ParamId> {
        let layout = FlatLayout::frozen(model, &[], self.world());
        if layout.total() == 0 {
            return Vec::new();
        }
        let rank = self.rank();
        let whole = layout.unit_values(model, 0, FloatDType::F32, &self.inner);
        let values = host_f32(whole.slice(layout.piece_range(0, rank)));
        share.add_shard(&layout, rank, values, dtype, |path| path.to_string());
        layout.entries.iter().map(|e| e.id).collect()
    }

    /// On rank 0, the lead of `share`: `model`'s tensors outside `held` (the ids the pieces
    /// hold) and group `group`'s optimizer kind and `scalars`.
    pub fn lead<M: Module>(
        &self,
        share: &mut Share,
        model: M,
        held: &[burn::module::ParamId],
        group: &str,
        scalars: crate::optim::Scalars,
    ) {
        if self.rank() == 0 {
            share.rest = Some(rest_record(model, held));
            share.optimizers = Some(vec![(group.to_string(), self.optimizer.kind(), scalars)]);
        }
    }

    /// Takes this rank's part of `group`'s optimizer state from a sharded checkpoint, reading
    /// only the ranges its shard holds.
    pub fn load_optimizer_from(&mut self, source: &dyn Source, group: &str) -> Result<()> {
        let Some((kind, scalars)) = source.optimizer(group) else {
            return Err(Error::checkpoint(
                "the checkpoint holds no state of this model's optimizer".to_string(),
            ));
        };
        if kind != self.optimizer.kind() {
            return Err(Error::checkpoint(format!(
                "the checkpoint's optimizer state is {}'s, but optim.name = {:?}",
                crate::config::name_of(&kind),
                crate::config::name_of(&self.optimizer.kind())
            )));
        }
        let rank = if self.layout.shards > 1 {
            self.rank()
        } else {
            0
        };
        let mut parts = Vec::new();
        for leaf in source.leaves(group) {
            let name = |path: &str| optim_tensor(group, &leaf, path);
            parts.push((leaf.clone(), source.shard(&self.layout, rank, &name)?));
        }
        self.optimizer.import(parts, scalars)?;
        self.memory.optim.set(self.optimizer.state_bytes());
        Ok(())
    }

    /// Brings `model`'s buffers (running statistics) up to date and, with several ranks, to
    /// their mean, so that every rank evaluates and saves one model. Running statistics are
    /// exponential moving averages, which are linear: averaging them only before they are used
    /// gives the same values as averaging after every step.
    pub fn settle_buffers<M: Module>(&mut self, model: M) -> Result<M> {
        sync_running_state(&model);
        if self.world() == 1 || !has_buffers(&model) {
            return Ok(model);
        }
        let mut values = collect_floats(&model, false);
        self.timed(|c| c.all_reduce(&mut values, ReduceOp::Mean))?;
        Ok(replace_floats(model, false, values, &self.device))
    }

    /// Fails if any rank of `group` holds `values` that differ from its rank 0's by even one
    /// bit.
    pub fn check_replicas(
        &mut self,
        group: &dyn Collective,
        values: Vec<f32>,
        step: usize,
    ) -> Result<()> {
        if group.world_size() == 1 || values.is_empty() {
            return Ok(());
        }
        let all = self.timed(|_| group.all_gather(&values))?;
        let n = values.len();
        for r in 1..group.world_size() {
            let other = &all[r * n..(r + 1) * n];
            if let Some(i) = (0..n).find(|&i| all[i].to_bits() != other[i].to_bits()) {
                return Err(Error::Worker(format!(
                    "replicas diverged after step {step}: rank {r} differs from rank 0 at \
                     parameter element {i} ({} vs {})",
                    other[i], all[i]
                )));
            }
        }
        Ok(())
    }

    /// Bytes of `n` parameter elements in the master dtype.
    pub fn master_bytes(&self, n: usize) -> usize {
        self.policy.master_bytes(n)
    }
}

/// Shard `rank` of `layout` (laid out as [`FlatLayout::cut`] lays it out, zeros as padding)
/// from `flat`, the whole space of `layout`'s units (unpadded), on the device.
pub(crate) fn part_of(flat: Tensor<1>, layout: &FlatLayout, rank: usize) -> Tensor<1> {
    let dtype = crate::params::float_dtype(flat.dtype());
    let device = flat.device();
    let mut parts = Vec::with_capacity(layout.units.len() * 2);
    let mut base = 0;
    for (u, unit) in layout.units.iter().enumerate() {
        let piece = layout.piece_range(u, rank);
        let (lo, hi) = (piece.start.min(unit.len), piece.end.min(unit.len));
        if hi > lo {
            parts.push(flat.clone().slice(base + lo..base + hi));
        }
        if piece.len() > hi - lo {
            parts.push(Tensor::<1>::zeros([piece.len() - (hi - lo)], &device).cast(dtype));
        }
        base += unit.len;
    }
    cat_or_empty(parts, dtype, &device)
}

/// `parts` concatenated, or an empty tensor.
pub(crate) fn cat_or_empty(parts: Vec<Tensor<1>>, dtype: FloatDType, device: &Device) -> Tensor<1> {
    if parts.is_empty() {
        Tensor::<1>::zeros([0], device).cast(dtype)
    } else {
        Tensor::cat(parts, 0)
    }
}

/// The [`Strategy`] methods every strategy answers from its `kit` alone: the optimizer
/// state in and out of the canonical layout, the memory counts and the time in collectives.
macro_rules! answered_by_kit {
    () => {
        fn optimizer_state(&mut self) -> $crate::error::Result<Option<$crate::optim::OptimState>> {
            self.kit.optimizer_state()
        }

        fn load_optimizer_state(
            &mut self,
            state: &$crate::optim::OptimState,
        ) -> $crate::error::Result<()> {
            self.kit.load_optimizer_state(state)
        }

        fn memory(&self) -> $crate::strategy::memory::Memory {
            self.kit.memory
        }

        fn take_sync_seconds(&mut self) -> f64 {
            self.kit.take_sync_seconds()
        }

        fn nonfinite(&self) -> bool {
            self.kit.nonfinite
        }

        fn skipped_on_device(&mut self) -> $crate::error::Result<Vec<usize>> {
            Ok(self.kit.take_skipped())
        }

        fn decided_on_device(&self) -> bool {
            self.kit.deferred
        }
    };
}
pub(crate) use answered_by_kit;
