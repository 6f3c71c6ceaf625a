//! The replicated strategies' one step: `single`, `ddp`, `zero1` and `zero2` hold a full replica
//! on every rank, cast its compute copy at the start of a step, run the micro-batches on it and
//! bring it up to date after the update. They differ only in where a step's gradients go —
//! added up on the rank and reduced at the end (or not at all), or reduce-scattered into a
//! shard as each part's backward ends — and in which part of the space a rank steps: their
//! [`Reduction`]. The pieces the steps are made of ([`averaged`], [`step_whole`],
//! [`step_shard`], [`open_shard`]) live here too, for `zero3` and parameter groups to share.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::{BlockStack, StepOutput};

use super::courier::{self, Courier, Job, Ticket};
use super::kit::RankKit;
use super::kit::answered_by_kit;
use super::step::{Strategy, one_by_one};
use super::update::Norm;
use crate::error::Result;
use crate::exec::{self, Accumulate, Hooks, Part};
use crate::params::{collect_floats, host_f32};
use crate::precision::LossScaler;

/// A full replica in the master dtype, with the compute copy of a lower precision cast from it
/// once per optimizer step.
pub(crate) struct Replica<M> {
    /// The master parameters (and the buffers). Replaced through [`Replica::set_model`] (or
    /// by the step that fills `compute_flat` beside it).
    pub model: M,
    compute: Option<M>,
    /// The trained parameters as the last step left them, in the compute dtype (mixed
    /// precision), one vector: the next compute copy's parameters are views of it, one cast
    /// a step where casting the model is one a parameter.
    compute_flat: Option<Tensor<1>>,
}

impl<M: Module> Replica<M> {
    pub fn new(model: M, kit: &mut RankKit) -> Self {
        kit.memory.params.set(kit.master_bytes(kit.layout.total()));
        kit.memory.frozen = crate::params::frozen_bytes(&model);
        kit.memory.note();
        Self {
            model,
            compute: None,
            compute_flat: None,
        }
    }

    /// `model` as the master from now on (the compute dtype's vector of the last step is
    /// dropped: it no longer matches).
    pub fn set_model(&mut self, model: M) {
        self.model = model;
        self.compute_flat = None;
    }

    /// Drops the vector the last step cast: it was another layout's (a parameter group's,
    /// stepped by its own kit), so the next compute copy casts the model.
    pub fn forget_compute_flat(&mut self) {
        self.compute_flat = None;
    }

    /// Casts this step's compute copy (mixed precision), counting its bytes: the trained
    /// parameters as views of the vector the last step cast, where there is one, and the
    /// others (frozen ones) cast one by one.
    pub fn begin(&mut self, kit: &mut RankKit) {
        let master = match self.compute_flat.take() {
            Some(flat) => kit.load_flat_in(self.model.clone(), flat, kit.policy.compute),
            None => self.model.clone(),
        };
        if let Some(copy) = kit.policy.compute_copy(&master) {
            self.compute = Some(copy);
            let bytes = kit.policy.compute_copy_bytes(kit.layout.total());
            kit.memory.params.add(bytes);
            kit.memory.note();
        }
    }

    /// The module the micro-steps run: the compute copy, or the master itself.
    pub fn current(&self) -> M {
        self.compute.clone().unwrap_or_else(|| self.model.clone())
    }

    /// Drops the compute copy.
    pub fn end(&mut self, kit: &mut RankKit) {
        if self.compute.take().is_some() {
            let bytes = kit.policy.compute_copy_bytes(kit.layout.total());
            kit.memory.params.sub(bytes);
        }
    }

    /// The rank's flat gradients unit by unit (padded), f32, taken out of `grads`.
    pub fn unit_grads(&self, kit: &RankKit, mut grads: GradientsParams) -> Vec<Tensor<1>> {
        (0..kit.layout.units.len())
            .map(|u| {
                kit.layout
                    .unit_grads(&self.model, &mut grads, u, FloatDType::F32, &kit.device)
            })
            .collect()
    }

    /// The master model with its buffers settled over ranks (see [`RankKit::settle_buffers`]).
    pub fn settled(&mut self, kit: &mut RankKit) -> Result<M> {
        let model = kit.settle_buffers(self.model.clone())?;
        self.model = model.clone();
        Ok(model)
    }

    /// Fails if the replicas of `kit`'s group differ in their trained parameters.
    pub fn check(&self, kit: &mut RankKit, step: usize) -> Result<()> {
        let values = collect_floats(&self.model, true);
        let comm = kit.comm.clone();
        kit.check_replicas(&*comm, values, step)
    }
}

/// Where a replicated strategy keeps a step's gradients until its optimizer step.
pub(crate) enum Held<M: Module> {
    /// Added up on the rank, micro-batch after micro-batch.
    Local(Accumulate<M>),
    /// The rank's shard of the averaged gradient, each part reduce-scattered into it as its
    /// backward ends.
    Shard(Vec<f32>),
    /// The averaged gradient (every unit padded, on the host), reduced beside the last
    /// micro-batch's backward.
    Reduced(Vec<f32>),
}

/// What a replicated strategy does with its gradients: the one thing in which `single`, `ddp`,
/// `zero1` and `zero2` differ.
pub(crate) trait Reduction {
    /// Whether the micro-steps reduce-scatter each part's gradients into a shard (no whole
    /// gradient is kept) rather than adding them up on the rank.
    fn scatters(&self) -> bool {
        false
    }
    /// Whether the optimizer step all-reduces the whole gradient, which the last micro-batch
    /// can then reduce beside its backward (`dist.overlap`).
    fn all_reduces(&self) -> bool {
        false
    }
    /// Whether the ranks hold replicas that must agree bit for bit.
    fn replicated(&self) -> bool {
        true
    }
    /// The optimizer step after the micro-steps: reduces what is left to reduce, steps the
    /// rank's part of the space and brings `replica` up to date. Returns whether it stepped.
    fn step<M: Module>(
        &self,
        kit: &mut RankKit,
        replica: &mut Replica<M>,
        held: &mut Held<M>,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool>;
}

/// A replicated strategy: a [`Replica`] per rank, its gradients handled as `R` says.
pub(crate) struct Replicated<'a, M: Module, R> {
    kit: RankKit<'a>,
    replica: Replica<M>,
    held: Held<M>,
    reduction: R,
}

impl<'a, M: Module, R: Reduction> Replicated<'a, M, R> {
    pub fn new(model: M, mut kit: RankKit<'a>, reduction: R) -> Self {
        let replica = Replica::new(model, &mut kit);
        Self {
            kit,
            replica,
            held: Held::Local(Accumulate::default()),
            reduction,
        }
    }

    /// The rank's equipment and its replica (for a strategy built around this one).
    pub fn parts(&mut self) -> (&mut RankKit<'a>, &mut Replica<M>) {
        (&mut self.kit, &mut self.replica)
    }
}

/// One micro-batch on `replica`: its gradients added to `acc`, on the rank (no communication).
/// `group` names the parameter group whose loss runs (models with several optimizers).
pub(crate) fn accumulate<B, M: BlockStack<B> + Module>(
    kit: &mut RankKit,
    replica: &Replica<M>,
    acc: &mut Accumulate<M>,
    batch: B,
    objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    group: Option<usize>,
) -> Result<StepOutput> {
    let mut pass = kit.pass(kit.recompute);
    pass.group = group;
    let (out, _) = exec::run(replica.current(), batch, &pass, acc, objective)?;
    let bytes = kit.layout.total() * 4;
    kit.memory.grads.set(bytes);
    kit.sample_pool();
    Ok(out)
}

/// One micro-batch on `replica` as the block walk: each part's gradients reduce-scattered into
/// `shard` as its backward ends — on a communication thread beside the walk with
/// `dist.overlap`.
fn scatter<B, M: BlockStack<B> + Module>(
    kit: &mut RankKit,
    replica: &Replica<M>,
    shard: &mut Vec<f32>,
    batch: B,
    objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
) -> Result<StepOutput> {
    let recompute = kit.recompute;
    let sync_bn = kit.pass(recompute).sync_bn.is_some();
    let device = kit.device.clone();
    let comm = kit.comm.clone();
    let pass = exec::Pass {
        recompute,
        sync_bn: sync_bn.then_some(&*comm),
        device: &device,
        group: None,
    };
    let out = if overlaps(kit, &replica.model) {
        courier::beside(kit, |kit, courier| {
            let mut hooks = Scatter {
                kit,
                shard,
                beside: Some(Beside::new(courier)),
            };
            let (out, _) = exec::run(replica.current(), batch, &pass, &mut hooks, objective)?;
            hooks.settle(usize::MAX)?;
            Ok(out)
        })?
    } else {
        let mut hooks = Scatter {
            kit: &mut *kit,
            shard,
            beside: None,
        };
        exec::run(replica.current(), batch, &pass, &mut hooks, objective)?.0
    };
    kit.sample_pool();
    Ok(out)
}

/// How many reduce-scatters may wait for the communication thread at once: each holds a
/// whole unit's gradients on the host.
pub(crate) const SCATTERS_IN_FLIGHT: usize = 2;

impl<B, M: BlockStack<B> + Module, R: Reduction> Strategy<M, B> for Replicated<'_, M, R> {
    fn begin_step(&mut self) -> Result<()> {
        self.replica.begin(&mut self.kit);
        if self.reduction.scatters() {
            self.held = Held::Shard(open_shard(&mut self.kit));
        } else if !matches!(self.held, Held::Local(_)) {
            self.held = Held::Local(Accumulate::default());
        }
        Ok(())
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        let (kit, replica) = (&mut self.kit, &self.replica);
        let overlap = self.reduction.all_reduces() && overlaps(kit, &replica.model);
        let mut micro = 0;
        one_by_one(batches, count, |batch| {
            micro += 1;
            match &mut self.held {
                Held::Local(acc) if overlap && micro == count => {
                    let (out, reduced) = overlapped(kit, replica, acc, batch, objective)?;
                    self.held = Held::Reduced(reduced);
                    Ok(out)
                }
                Held::Local(acc) => accumulate(kit, replica, acc, batch, objective, None),
                Held::Shard(shard) => scatter(kit, replica, shard, batch, objective),
                Held::Reduced(_) => unreachable!("a step's gradients are reduced once"),
            }
        })
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        self.replica.end(&mut self.kit);
        self.reduction.step(
            &mut self.kit,
            &mut self.replica,
            &mut self.held,
            lr,
            scaler,
            clip,
        )
    }

    fn full_model(&mut self) -> Result<M> {
        self.replica.settled(&mut self.kit)
    }

    fn checkpoint_share(&mut self) -> Result<crate::optim::Share> {
        let model = self.replica.settled(&mut self.kit)?;
        share_replica(&mut self.kit, model)
    }

    fn load_optimizer_shards(
        &mut self,
        source: &dyn crate::optim::Source,
        groups: &[String],
    ) -> Result<()> {
        load_one_optimizer(&mut self.kit, source, groups)
    }

    fn check_replicas(&mut self, step: usize) -> Result<()> {
        if !self.reduction.replicated() {
            // One device: no replicas to compare.
            return Ok(());
        }
        self.replica.check(&mut self.kit, step)
    }

    answered_by_kit!();
}

/// A replica's share of a sharded checkpoint: its part of the trained parameters (its shard,
/// or its equal part where every rank steps the whole space), of the optimizer state and of
/// the frozen parameters, and on rank 0 the rest of `model`.
pub(crate) fn share_replica<M: Module>(kit: &mut RankKit, model: M) -> Result<crate::optim::Share> {
    let dtypes = crate::optim::param_dtypes(&model);
    let dtype = |e: &crate::params::Entry| dtypes.get(&e.id).copied().unwrap_or(FloatDType::F32);
    let params = kit.shard_of(&model);
    let (mut share, scalars) = kit.share(params, "", &dtype);
    let mut held = kit.share_frozen(&mut share, &model, &dtype);
    held.extend(kit.layout.entries.iter().map(|e| e.id));
    kit.lead(&mut share, model, &held, "", scalars);
    Ok(share)
}

/// Takes the model's one optimizer's state from a sharded checkpoint, this rank's ranges of
/// it; `groups` must be that one (`""`).
pub(crate) fn load_one_optimizer(
    kit: &mut RankKit,
    source: &dyn crate::optim::Source,
    groups: &[String],
) -> Result<()> {
    match groups {
        [name] if name.is_empty() => kit.load_optimizer_from(source, ""),
        _ => Err(crate::error::Error::checkpoint(format!(
            "the checkpoint holds the optimizer states of groups {groups:?}, but this model \
             steps one optimizer"
        ))),
    }
}

/// The gradients a step added up on the rank, taken out of `held`.
pub(crate) fn local<M: Module>(held: &mut Held<M>) -> GradientsParams {
    match held {
        Held::Local(acc) => acc.take(),
        Held::Shard(_) | Held::Reduced(_) => {
            unreachable!("a strategy that adds up locally holds an accumulator")
        }
    }
}

/// The averaged flat gradients of the step's micro-batches, on the host (every unit padded):
/// reduced now, or already beside the last backward.
pub(crate) fn averaged<M: Module>(
    kit: &mut RankKit,
    replica: &Replica<M>,
    held: &mut Held<M>,
) -> Result<Vec<f32>> {
    if let Held::Reduced(reduced) = held {
        return Ok(std::mem::take(reduced));
    }
    let units = replica.unit_grads(kit, local(held));
    kit.all_reduce_units(units)
}

/// Whether a step of `kit` on `model` reduces beside its backward: `dist.overlap`, several
/// ranks, and blocks to walk without collectives of their own (synchronised BatchNorm).
pub(crate) fn overlaps<B, M: BlockStack<B> + Module>(kit: &RankKit, model: &M) -> bool {
    kit.overlap
        && kit.world() > 1
        && model.num_blocks() > 0
        && kit.pass(kit.recompute).sync_bn.is_none()
}

/// The last micro-batch of a step as the block walk, each unit's gradients (with what the
/// earlier micro-batches added up in `acc`) handed to a communication thread as soon as they
/// are whole: a block's at the end of its backward, the rest (stem and head) last. The thread
/// reduces the units as [`RankKit::all_reduce_units`] does, bucket by bucket, so the result is
/// the same bits; the rank computes the blocks below meanwhile. Returns the output and the
/// averaged gradient (every unit padded).
fn overlapped<B, M: BlockStack<B> + Module>(
    kit: &mut RankKit,
    replica: &Replica<M>,
    acc: &mut Accumulate<M>,
    batch: B,
    objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
) -> Result<(StepOutput, Vec<f32>)> {
    let mut earlier = acc.take();
    let units = kit.layout.units.len();
    let mut in_earlier = vec![false; units];
    for u in kit.layout.units_in(&replica.model, &earlier) {
        in_earlier[u] = true;
    }
    let device = kit.device.clone();
    let pass = exec::Pass {
        recompute: kit.recompute,
        sync_bn: None,
        device: &device,
        group: None,
    };
    // The whole gradient is held anyway: no bound on the units in flight.
    let (out, reduced) = courier::beside(kit, |kit, courier| {
        let mut hooks = Overlap {
            kit,
            earlier: &mut earlier,
            in_earlier,
            rest: Accumulate::default(),
            tickets: vec![None; units],
            courier,
        };
        let (out, model) = exec::run(replica.current(), batch, &pass, &mut hooks, objective)?;
        hooks.finish(&model)?;
        let mut reduced = Vec::with_capacity(hooks.kit.layout.total());
        for ticket in std::mem::take(&mut hooks.tickets) {
            let ticket = ticket.expect("finish hands every unit over");
            reduced.extend(hooks.courier.wait(ticket)?);
        }
        Ok((out, reduced))
    })?;
    kit.memory.grads.set(kit.layout.total() * 4);
    kit.sample_pool();
    Ok((out, reduced))
}

/// Walk hooks that hand each whole unit's gradients to the communication thread.
struct Overlap<'c, 'a, M: Module> {
    kit: &'c mut RankKit<'a>,
    /// What the step's earlier micro-batches added up, and the units it has gradients of.
    earlier: &'c mut GradientsParams,
    in_earlier: Vec<bool>,
    /// The head's gradients, until the stem's complete the rest unit.
    rest: Accumulate<M>,
    /// The units handed over so far.
    tickets: Vec<Option<Ticket>>,
    courier: &'c mut Courier,
}

impl<M: Module> Overlap<'_, '_, M> {
    /// Unit `u`'s gradients in `grads` plus the earlier micro-batches', to the thread.
    fn send(&mut self, model: &M, grads: &mut GradientsParams, u: usize) -> Result<()> {
        let layout = &self.kit.layout;
        let device = &self.kit.device;
        let mut flat = layout.unit_grads(model, grads, u, FloatDType::F32, device);
        if self.in_earlier[u] {
            flat = layout.unit_grads(model, self.earlier, u, FloatDType::F32, device) + flat;
        }
        let host = self.kit.travelling(flat)?;
        self.tickets[u] = Some(self.courier.send(Job::Mean(host)));
        Ok(())
    }

    /// After the walk: the rest unit (stem and head), and any unit no part had gradients for
    /// (unused parameters: the earlier micro-batches' gradients or zeros, as after the
    /// backward).
    fn finish(&mut self, model: &M) -> Result<()> {
        let mut rest = self.rest.take();
        for u in 0..self.tickets.len() {
            if self.tickets[u].is_none() {
                self.send(model, &mut rest, u)?;
            }
        }
        Ok(())
    }
}

impl<M: Module> Hooks<M> for Overlap<'_, '_, M> {
    fn blockwise(&self) -> bool {
        true
    }

    fn grads(&mut self, model: &M, part: Part, mut grads: GradientsParams) -> Result<()> {
        match part {
            Part::Block(_) => {
                for u in self.kit.layout.units_in(model, &grads) {
                    self.send(model, &mut grads, u)?;
                }
                Ok(())
            }
            // The rest (stem and head) is whole only when the walk is over.
            Part::Head | Part::Stem | Part::All => self.rest.grads(model, part, grads),
        }
    }
}

/// Steps the whole flat space of `kit` with the gradient `grads` and loads the result into
/// `replica`: the end of every step of `single`, `ddp` and a parameter group.
pub(crate) fn step_whole<M: Module>(
    kit: &mut RankKit,
    replica: &mut Replica<M>,
    grads: Tensor<1>,
    lr: f64,
    scaler: Option<&mut LossScaler>,
    clip: Option<f64>,
) -> Result<Option<()>> {
    let params = kit.shard_of(&replica.model);
    let stepped = kit.finish(grads, params, lr, scaler, clip, Norm::Local)?;
    Ok(stepped.map(|flat| {
        // One shard: the stepped flat space is the canonical vector.
        replica.compute_flat = kit.policy.compute_flat(&flat);
        replica.model = kit.load_flat(replica.model.clone(), flat);
    }))
}

/// Steps this rank's shard with the gradient shard `grads` (host) and all-gathers the updated
/// parameters into `replica`: the end of every step of `zero1` and `zero2`.
pub(crate) fn step_shard<M: Module>(
    kit: &mut RankKit,
    replica: &mut Replica<M>,
    grads: Vec<f32>,
    lr: f64,
    scaler: Option<&mut LossScaler>,
    clip: Option<f64>,
    norm: Norm<'_>,
) -> Result<bool> {
    let n = grads.len();
    let grads = Tensor::<1>::from_data(TensorData::new(grads, [n]), &kit.inner);
    let params = kit.shard_of(&replica.model);
    let stepped = kit.finish(grads, params, lr, scaler, clip, norm)?;
    kit.memory.grads.set(0);
    let Some(shard) = stepped else {
        return Ok(false);
    };
    let values = kit.gather_canonical(&host_f32(shard))?;
    let model = kit.load_canonical(replica.model.clone(), values);
    replica.set_model(model);
    kit.sample_pool();
    Ok(true)
}

/// A step's gradient shard (zeros), counted.
pub(crate) fn open_shard(kit: &mut RankKit) -> Vec<f32> {
    let bytes = kit.layout.shard_len * 4;
    kit.memory.grads.set(bytes);
    kit.memory.note();
    vec![0.0; kit.layout.shard_len]
}

/// Walk hooks that reduce-scatter each part's gradients into the rank's gradient shard as soon
/// as its backward is done (ZeRO-2): on the rank's thread, or handed to the communication
/// thread (`beside`).
pub(crate) struct Scatter<'c, 'a> {
    pub kit: &'c mut RankKit<'a>,
    pub shard: &'c mut Vec<f32>,
    pub beside: Option<Beside<'c>>,
}

impl Scatter<'_, '_> {
    /// Unit `u`'s gradients in `grads`, reduce-scattered into the shard now or handed over.
    pub fn unit<M: Module>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
        u: usize,
    ) -> Result<()> {
        let Some(beside) = &mut self.beside else {
            return self.kit.scatter_unit(model, grads, u, self.shard);
        };
        // At most SCATTERS_IN_FLIGHT units' gradients wait for the thread.
        if beside.pending.len() >= SCATTERS_IN_FLIGHT {
            let over = beside.pending.len() + 1 - SCATTERS_IN_FLIGHT;
            beside.settle(self.kit, self.shard, over)?;
        }
        let host = self.kit.unit_travelling(model, grads, u)?;
        let ticket = beside.courier.send(Job::Scatter(host));
        beside.pending.push_back((u, ticket));
        beside.settle(self.kit, self.shard, 0)
    }

    /// Adds the pieces that came back into the shard (see [`Beside::settle`]); `at_least`
    /// of them waited for (`usize::MAX`: every one).
    pub fn settle(&mut self, at_least: usize) -> Result<()> {
        match &mut self.beside {
            Some(beside) => beside.settle(self.kit, self.shard, at_least),
            None => Ok(()),
        }
    }
}

/// The communication thread of a walk that reduce-scatters, and the units handed to it whose
/// pieces are not in the shard yet.
pub(crate) struct Beside<'c> {
    pub courier: &'c mut Courier,
    pending: std::collections::VecDeque<(usize, Ticket)>,
}

impl<'c> Beside<'c> {
    pub fn new(courier: &'c mut Courier) -> Self {
        Self {
            courier,
            pending: Default::default(),
        }
    }

    /// Adds the pieces that came back into `shard`, in the order they were handed over (a
    /// unit handed over twice — the rest, with the head's and the stem's gradients — adds up
    /// in the same order as on the rank's thread), waiting for the first `at_least` of them.
    fn settle(&mut self, kit: &mut RankKit, shard: &mut [f32], at_least: usize) -> Result<()> {
        let mut must = at_least;
        while let Some(&(u, ticket)) = self.pending.front() {
            if must == 0 && !self.courier.ready(ticket)? {
                break;
            }
            must = must.saturating_sub(1);
            self.pending.pop_front();
            let piece = self.courier.wait(ticket)?;
            kit.add_piece(u, piece, shard);
        }
        Ok(())
    }
}

impl<M: Module> Hooks<M> for Scatter<'_, '_> {
    fn blockwise(&self) -> bool {
        true
    }

    fn grads(&mut self, model: &M, _part: Part, mut grads: GradientsParams) -> Result<()> {
        // Every rank runs the same graph, so every rank reduces the same units in the same
        // order.
        for u in self.kit.layout.units_in(model, &grads) {
            self.unit(model, &mut grads, u)?;
        }
        Ok(())
    }
}
