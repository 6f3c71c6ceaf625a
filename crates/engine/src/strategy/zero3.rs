//! `zero3` (ZeRO stage 3, FSDP's full sharding): each rank keeps only its shard of the
//! parameters, besides its shards of the gradients and the optimizer state.
//!
//! Each unit of the [`FlatLayout`] (the parameters outside every block, then each block) is
//! sharded on its own across all ranks, so gathering a unit is one all-gather of equal pieces.
//! The `rest` unit — stem, head and the weights tied between them (the GPT's token embedding)
//! — is gathered for the whole optimizer step. A block is gathered just before its forward and
//! released after it, then gathered again for its backward and released after that, while the
//! micro-step runs as the block walk and each part's gradients are reduce-scattered as in
//! `zero2`.
//!
//! Releasing a block after its forward needs its forward to leave no graph behind: Burn's
//! autodiff graph holds the tensors a block's operations used — its parameters among them —
//! until the backward consumes it, so a block that kept its activations would keep its
//! gathered parameters too. ZeRO-3 therefore recomputes its blocks in the backward: every
//! block but the last (whose backward comes first) by default, or blocks `0, K, 2K, …` with
//! `recompute.mode = "blocks"` and `every = K`, where the blocks it does not recompute stay
//! gathered from their forward to their backward (and are counted so).
//!
//! With `dist.overlap`, the walk's collectives run on a communication thread
//! (`courier.rs`): the reduce-scatters as in `zero2`, and the all-gather of the next
//! block the walk needs (`walk_gathers`), handed over as soon as the block before it is
//! loaded — one block ahead, held on the host until its turn — so that block `k + 1` travels
//! while block `k` computes.

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::{BlockStack, StepOutput};

use std::collections::VecDeque;

use super::courier::{self, Courier, Job, Ticket};
use super::ddp::several;
use super::frozen::FrozenShard;
use super::kit::RankKit;
use super::kit::answered_by_kit;
use super::replica::{Beside, Scatter, open_shard, overlaps};
use super::rules::{
    Checks, Costs, Estimate, ModelFacts, Op, Room, Setup, Shape, Traffic, Variant, Words,
    state_tensors,
};
use super::step::{Strategy, one_by_one};
use super::update::Norm;
use super::zero2::scattering;
use crate::config::{OptimConfig, RecomputeMode, name_of};
use crate::error::{Error, Result};
use crate::exec::{self, Hooks, Part, Recompute};
use crate::params::{FlatLayout, host_f32};
use crate::precision::LossScaler;

/// ZeRO-3's rules: it needs the model's blocks, runs each twice, and cannot synchronise
/// BatchNorm.
pub struct Zero3;

impl Checks for Zero3 {
    fn check(&self, setup: &Setup) -> Result<()> {
        if setup.ddp.sync_batchnorm {
            return Err(Error::config(
                "key `ddp.sync_batchnorm`: cannot be combined with strategy.name = \"zero3\": \
                 zero3 recomputes every block in its backward (to release its gathered \
                 parameters), and synchronised BatchNorm cannot run a block twice; use strategy \
                 \"zero2\" or turn ddp.sync_batchnorm off",
            ));
        }
        Ok(())
    }

    fn check_model(&self, model: &ModelFacts, setup: &Setup) -> Result<()> {
        if model.blocks == 0 {
            return Err(Error::config(
                "key `strategy.name`: \"zero3\" gathers the model block by block, but this \
                 model describes no blocks (its BlockStack's num_blocks is 0); describe the \
                 blocks, or use strategy \"zero1\"",
            ));
        }
        // `recompute.mode = "blocks"` refuses a model with dropout in its own words, first.
        if !model.deterministic && setup.recompute.mode != RecomputeMode::Blocks {
            return Err(Error::config(
                "key `strategy.name`: \"zero3\" recomputes each block in its backward, which \
                 runs each block twice and needs both runs to agree, but this model says its \
                 blocks do not (BlockStack::blocks_deterministic); use strategy \"zero2\"",
            ));
        }
        Ok(())
    }
}

impl Words for Zero3 {
    fn describe(&self, setup: &Setup) -> String {
        format!(
            "zero3 (parameters, gradients and optimizer state sharded over {}; blocks \
             gathered for their forward and backward and recomputed in the backward)",
            setup.world
        )
    }

    fn recompute_line(&self, setup: &Setup) -> String {
        let r = &setup.recompute;
        match r.mode {
            RecomputeMode::Blocks if r.every > 1 => {
                format!("recompute every {}th block", r.every)
            }
            RecomputeMode::Blocks => "recompute blocks".to_string(),
            m => format!(
                "recompute {}, and zero3 recomputes every block but the last",
                name_of(&m)
            ),
        }
    }
}

impl Costs for Zero3 {
    fn estimate(
        &self,
        layout: &FlatLayout,
        optim: &OptimConfig,
        setup: &Setup,
    ) -> Result<Estimate> {
        let sharded = layout.with_shards(setup.world);
        let shard = sharded.shard_len;
        let p = &setup.policy;
        // With a communication thread, the next block all-gathered ahead of time (f32, on the
        // host until it is loaded).
        let fetched = if setup.overlap && setup.world > 1 {
            sharded.largest_block() * 4
        } else {
            0
        };
        Ok(Estimate {
            params: p.master_bytes(shard)
                + p.compute_bytes(gathered_peak(&sharded, recompute_for(setup)))
                + fetched,
            grads: (shard + scattering(setup) * sharded.largest_unit()) * 4,
            optim: state_tensors(optim) * p.master_bytes(shard),
        })
    }

    fn variants(&self, room: &Room) -> Vec<Variant> {
        several(room, crate::config::StrategyKind::Zero3)
    }

    /// Each micro-batch gathers every unit for its forward and again for its backward, and
    /// reduce-scatters the gradients.
    fn traffic(&self, _setup: &Setup, floats: usize, _local: usize) -> Vec<Traffic> {
        vec![
            Traffic::per_micro_batch(Op::AllGather, floats, 2),
            Traffic::per_micro_batch(Op::ReduceScatter, floats, 1),
        ]
    }

    fn simplicity(&self) -> usize {
        3
    }
}

impl Shape for Zero3 {
    fn reads_own_params(&self) -> bool {
        true
    }

    fn recomputes(&self, setup: &Setup) -> Recompute {
        recompute_for(setup)
    }
}

/// Which blocks ZeRO-3 recomputes: every block (but the last) unless `blocks` with
/// `every = K` says otherwise.
fn recompute_for(setup: &Setup) -> Recompute {
    match setup.walk_recompute() {
        Recompute::Keep => Recompute::Blocks { every: 1 },
        blocks => blocks,
    }
}

/// The most parameter elements ZeRO-3 holds gathered at once with `recompute`: the `rest`
/// unit, plus the blocks in flight as the walk gathers and releases them.
pub fn gathered_peak(layout: &FlatLayout, recompute: Recompute) -> usize {
    let n = layout.units.len() - 1;
    let size = |i: usize| layout.units[i + 1].len;
    let mut now = layout.units[0].len;
    let mut peak = now;
    let mut held = vec![false; n];
    for (i, h) in held.iter_mut().enumerate() {
        now += size(i);
        peak = peak.max(now);
        if recompute.recomputes(i, n) {
            now -= size(i);
        } else {
            *h = true;
        }
    }
    for i in (0..n).rev() {
        if !held[i] {
            now += size(i);
            peak = peak.max(now);
        }
        now -= size(i);
    }
    peak
}

/// Fully sharded data parallelism: one rank's step.
pub struct Sharded<'a, M: Module> {
    kit: RankKit<'a>,
    /// The model with every released unit's parameters replaced by placeholders (its buffers
    /// stay whole).
    model: Option<M>,
    /// This rank's shard of the parameters, in the master dtype.
    params: Tensor<1>,
    /// Which units are gathered into `model` now.
    gathered: Vec<bool>,
    /// This step's averaged gradient shard.
    grads: Vec<f32>,
    recompute: Recompute,
    /// The rank's shard of the frozen parameters, gathered with their units.
    frozen: Option<FrozenShard>,
}

impl<'a, M: Module> Sharded<'a, M> {
    pub(crate) fn new(model: M, mut kit: RankKit<'a>, blocks: &[Vec<ParamId>]) -> Result<Self> {
        let params = kit.shard_of(&model);
        let (model, frozen) = FrozenShard::new(model, blocks, &mut kit);
        let mut model = model;
        for u in 0..kit.layout.units.len() {
            model = kit.layout.release_unit(model, u, &kit.device);
        }
        kit.memory
            .params
            .set(kit.master_bytes(kit.layout.shard_len));
        kit.memory.note();
        let recompute = match kit.recompute {
            Recompute::Blocks { every } => Recompute::Blocks { every },
            Recompute::Keep => Recompute::Blocks { every: 1 },
        };
        let units = kit.layout.units.len();
        Ok(Self {
            kit,
            model: Some(model),
            params,
            gathered: vec![false; units],
            grads: Vec::new(),
            recompute,
            frozen,
        })
    }

    fn hooks(&mut self) -> Units<'_, 'a> {
        let dtype = gathered_dtype(&self.kit);
        Units {
            scatter: Scatter {
                kit: &mut self.kit,
                shard: &mut self.grads,
                beside: None,
            },
            params: &self.params,
            gathered: &mut self.gathered,
            dtype,
            expected: VecDeque::new(),
            fetched: None,
            frozen: self.frozen.as_mut(),
        }
    }
}

/// The dtype gathered units are loaded in: the compute dtype.
fn gathered_dtype(kit: &RankKit) -> FloatDType {
    if kit.policy.mixed {
        kit.policy.compute
    } else {
        kit.master
    }
}

/// This rank's piece of unit `u` of `params` (its shard), on the host.
fn my_piece(kit: &RankKit, params: &Tensor<1>, u: usize) -> Vec<f32> {
    let unit = &kit.layout.units[u];
    host_f32(
        params
            .clone()
            .slice(unit.shard_offset..unit.shard_offset + unit.piece),
    )
}

/// Unit `u` whole (padded), all-gathered from every rank's piece of `params`.
fn all_gathered(kit: &mut RankKit, params: &Tensor<1>, u: usize) -> Result<Tensor<1>> {
    let mine = my_piece(kit, params, u);
    let all = kit.timed(|c| c.all_gather(&mine))?;
    Ok(kit.on_inner(all))
}

/// The units a micro-step's walk over `n` blocks gathers, in order: every block for its
/// forward, then, from the last down, each block that `recompute` runs again in the backward
/// (a block that keeps its graph stays gathered).
fn walk_gathers(n: usize, recompute: Recompute) -> VecDeque<usize> {
    let forward = (0..n).map(|i| i + 1);
    let backward = (0..n)
        .rev()
        .filter(|&i| recompute.recomputes(i, n))
        .map(|i| i + 1);
    forward.chain(backward).collect()
}

/// Gathering and releasing units, and the walk's hooks. With a communication thread
/// (`dist.overlap`), the gradients are reduce-scattered on it and the unit the walk gathers
/// next is all-gathered on it ahead of time, one at a time, while the rank computes.
struct Units<'s, 'a> {
    scatter: Scatter<'s, 'a>,
    params: &'s Tensor<1>,
    gathered: &'s mut Vec<bool>,
    /// The dtype gathered units are loaded in (the compute dtype).
    dtype: FloatDType,
    /// The units the walk will gather, in order (empty without a communication thread).
    expected: VecDeque<usize>,
    /// The unit being all-gathered ahead of time.
    fetched: Option<(usize, Ticket)>,
    /// The frozen parameters, gathered and released with their units.
    frozen: Option<&'s mut FrozenShard>,
}

impl Units<'_, '_> {
    fn gather<M: Module>(&mut self, model: M, u: usize) -> Result<M> {
        if self.gathered[u] {
            return Ok(model);
        }
        let model = self.gather_frozen(model, u)?;
        if self.expected.front() == Some(&u) {
            self.expected.pop_front();
        }
        let flat = self.fetch(u)?;
        let kit = &mut *self.scatter.kit;
        let model = kit
            .layout
            .load_unit(model, u, flat, self.dtype, &kit.device);
        self.gathered[u] = true;
        let bytes = kit.layout.units[u].len * crate::params::dtype_bytes(self.dtype);
        kit.memory.params.add(bytes);
        kit.memory.note();
        self.prefetch()?;
        self.scatter.settle(0)?;
        Ok(model)
    }

    /// `model` with unit `u` of the frozen parameters loaded, all-gathered on the walk's
    /// communication thread when there is one (only it talks to the group during the walk).
    fn gather_frozen<M: Module>(&mut self, model: M, u: usize) -> Result<M> {
        let Some(mine) = self
            .frozen
            .as_deref()
            .and_then(|f| f.wanted(u))
            .map(<[f32]>::to_vec)
        else {
            return Ok(model);
        };
        let all = if self.scatter.beside.is_some() {
            let courier = self.courier();
            let ticket = courier.send(Job::Gather(mine));
            courier.wait(ticket)?
        } else {
            self.scatter.kit.timed(|c| c.all_gather(&mine))?
        };
        let frozen = self.frozen.as_deref_mut().expect("wanted above");
        Ok(frozen.load(model, u, all, self.dtype, self.scatter.kit))
    }

    /// Unit `u`'s values, all-gathered now or ahead of time.
    fn fetch(&mut self, u: usize) -> Result<Tensor<1>> {
        if self.scatter.beside.is_none() {
            return all_gathered(self.scatter.kit, self.params, u);
        }
        if let Some((v, ticket)) = self.fetched.take() {
            let all = self.courier().wait(ticket)?;
            self.count_fetched(v, false);
            if v == u {
                return Ok(self.scatter.kit.on_inner(all));
            }
            // Every rank's walk is the same, so every rank fetched the same unit in vain.
        }
        let mine = my_piece(self.scatter.kit, self.params, u);
        let courier = self.courier();
        let ticket = courier.send(Job::Gather(mine));
        let all = courier.wait(ticket)?;
        Ok(self.scatter.kit.on_inner(all))
    }

    /// Hands the all-gather of the next unit the walk gathers to the communication thread.
    fn prefetch(&mut self) -> Result<()> {
        if self.scatter.beside.is_none() || self.fetched.is_some() {
            return Ok(());
        }
        let Some(&v) = self.expected.front() else {
            return Ok(());
        };
        if self.gathered[v] {
            return Ok(());
        }
        let mine = my_piece(self.scatter.kit, self.params, v);
        let ticket = self.courier().send(Job::Gather(mine));
        self.count_fetched(v, true);
        self.fetched = Some((v, ticket));
        Ok(())
    }

    /// Counts (or uncounts) unit `u`'s all-gathered values, f32 on the host until loaded.
    fn count_fetched(&mut self, u: usize, add: bool) {
        let kit = &mut *self.scatter.kit;
        let bytes = kit.layout.units[u].padded(kit.layout.shards) * 4;
        if add {
            kit.memory.params.add(bytes);
            kit.memory.note();
        } else {
            kit.memory.params.sub(bytes);
        }
    }

    fn courier(&mut self) -> &mut Courier {
        self.scatter
            .beside
            .as_mut()
            .expect("a walk with a communication thread")
            .courier
    }

    /// After the walk: a unit fetched in vain, and every piece into the shard.
    fn finish(&mut self) -> Result<()> {
        if let Some((v, ticket)) = self.fetched.take() {
            self.courier().wait(ticket)?;
            self.count_fetched(v, false);
        }
        self.scatter.settle(usize::MAX)
    }

    fn release<M: Module>(&mut self, model: M, u: usize) -> M {
        if !self.gathered[u] {
            return model;
        }
        let model = match self.frozen.as_deref_mut() {
            Some(frozen) => frozen.release(model, u, self.dtype, self.scatter.kit),
            None => model,
        };
        self.gathered[u] = false;
        let kit = &mut *self.scatter.kit;
        let bytes = kit.layout.units[u].len * crate::params::dtype_bytes(self.dtype);
        kit.memory.params.sub(bytes);
        kit.layout.release_unit(model, u, &kit.device)
    }
}

impl<M: Module> Hooks<M> for Units<'_, '_> {
    fn blockwise(&self) -> bool {
        true
    }

    fn before_forward(&mut self, model: M, i: usize) -> Result<M> {
        self.gather(model, i + 1)
    }

    fn after_forward(&mut self, model: M, i: usize, kept: bool) -> Result<M> {
        Ok(if kept {
            model
        } else {
            self.release(model, i + 1)
        })
    }

    fn before_backward(&mut self, model: M, i: usize, _kept: bool) -> Result<M> {
        self.gather(model, i + 1)
    }

    fn after_backward(&mut self, model: M, i: usize) -> Result<M> {
        Ok(self.release(model, i + 1))
    }

    fn grads(&mut self, model: &M, part: Part, grads: GradientsParams) -> Result<()> {
        self.scatter.grads(model, part, grads)
    }
}

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Sharded<'_, M> {
    fn begin_step(&mut self) -> Result<()> {
        self.grads = open_shard(&mut self.kit);
        let model = self.model.take().expect("the model is home between steps");
        let model = self.hooks().gather(model, 0)?;
        self.model = Some(model);
        Ok(())
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        let overlap = overlaps(&self.kit, self.model.as_ref().expect("the model is home"));
        one_by_one(batches, count, |batch| -> Result<StepOutput> {
            let recompute = self.recompute;
            let device = self.kit.device.clone();
            let pass = exec::Pass {
                recompute,
                sync_bn: None,
                device: &device,
                group: None,
            };
            let model = self
                .model
                .take()
                .expect("the model is home between micro-steps");
            let dtype = gathered_dtype(&self.kit);
            let (params, gathered, grads) = (&self.params, &mut self.gathered, &mut self.grads);
            let frozen = self.frozen.as_mut();
            let walk = |kit: &mut RankKit, courier: Option<&mut Courier>| {
                let n = model.num_blocks();
                let mut hooks = Units {
                    scatter: Scatter {
                        kit,
                        shard: grads,
                        beside: courier.map(Beside::new),
                    },
                    params,
                    gathered,
                    dtype,
                    expected: VecDeque::new(),
                    fetched: None,
                    frozen,
                };
                if hooks.scatter.beside.is_some() {
                    hooks.expected = walk_gathers(n, recompute);
                    hooks.prefetch()?;
                }
                let (out, model) = exec::run(model, batch, &pass, &mut hooks, objective)?;
                hooks.finish()?;
                Ok((out, model))
            };
            let (out, model) = if overlap {
                courier::beside(&mut self.kit, |kit, courier| walk(kit, Some(courier)))?
            } else {
                walk(&mut self.kit, None)?
            };
            self.model = Some(model);
            self.kit.sample_pool();
            Ok(out)
        })
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        let model = self
            .model
            .take()
            .expect("the model is home after the micro-steps");
        let model = self.hooks().release(model, 0);
        self.model = Some(model);
        let grads = std::mem::take(&mut self.grads);
        let n = grads.len();
        let grads = Tensor::<1>::from_data(TensorData::new(grads, [n]), &self.kit.inner);
        let stepped =
            self.kit
                .finish(grads, self.params.clone(), lr, scaler, clip, Norm::Shards)?;
        self.kit.memory.grads.set(0);
        self.kit.sample_pool();
        match stepped {
            Some(params) => {
                self.params = params;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn full_model(&mut self) -> Result<M> {
        let model = self.model.take().expect("the model is home between steps");
        let model = self.kit.settle_buffers(model)?;
        self.model = Some(model.clone());
        let mut full = model;
        for u in 0..self.kit.layout.units.len() {
            let flat = all_gathered(&mut self.kit, &self.params, u)?;
            full = self
                .kit
                .layout
                .load_unit(full, u, flat, self.kit.master, &self.kit.device);
        }
        if let Some(frozen) = &self.frozen {
            full = frozen.whole(full, self.kit.master, &mut self.kit)?;
        }
        Ok(full)
    }

    fn checkpoint_share(&mut self) -> Result<crate::optim::Share> {
        let model = self.model.take().expect("the model is home between steps");
        let model = self.kit.settle_buffers(model)?;
        self.model = Some(model.clone());
        let master = self.kit.master;
        let (mut share, scalars) = self.kit.share(self.params.clone(), "", &|_| master);
        let mut held: Vec<ParamId> = self.kit.layout.entries.iter().map(|e| e.id).collect();
        if let Some(frozen) = &self.frozen {
            held.extend(frozen.share(&mut share, self.kit.rank(), master));
        }
        self.kit.lead(&mut share, model, &held, "", scalars);
        Ok(share)
    }

    fn load_optimizer_shards(
        &mut self,
        source: &dyn crate::optim::Source,
        groups: &[String],
    ) -> Result<()> {
        super::replica::load_one_optimizer(&mut self.kit, source, groups)
    }

    fn load_param_shards(&mut self, source: &dyn crate::optim::Source) -> Result<()> {
        let rank = if self.kit.layout.shards > 1 {
            self.kit.rank()
        } else {
            0
        };
        let values = source.shard(&self.kit.layout, rank, &|path| path.to_string())?;
        self.params = self.kit.on_inner(values).cast(self.kit.master);
        if let Some(frozen) = &mut self.frozen {
            frozen.read_from(source, rank)?;
        }
        Ok(())
    }

    fn check_replicas(&mut self, _step: usize) -> Result<()> {
        // One device, or ranks that hold different shards: no replicas to compare.
        Ok(())
    }

    answered_by_kit!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_walk_gathers_every_block_then_the_recomputed_ones_downwards() {
        let every = |k| Recompute::Blocks { every: k };
        // The last block keeps its graph: it is gathered once.
        assert_eq!(walk_gathers(3, every(1)), [1, 2, 3, 2, 1]);
        assert_eq!(walk_gathers(4, every(2)), [1, 2, 3, 4, 3, 1]);
        assert_eq!(walk_gathers(2, Recompute::Keep), [1, 2]);
    }

    #[test]
    fn gathered_peak_follows_the_walk() {
        use burn::nn::{Linear, LinearConfig};
        #[derive(Module, Debug)]
        struct Stack {
            stem: Linear,
            blocks: Vec<Linear>,
        }
        let device = Device::flex().autodiff();
        let m = Stack {
            stem: LinearConfig::new(2, 2).init(&device),
            blocks: (0..4)
                .map(|i| LinearConfig::new(2, 2 + i).init(&device))
                .collect(),
        };
        let blocks: Vec<_> = m.blocks.iter().map(crate::params::trainable_ids).collect();
        let layout = FlatLayout::new(&m, &blocks, 2);
        // rest 6; blocks 6, 9, 12, 15.
        let every = |k| gathered_peak(&layout, Recompute::Blocks { every: k });
        assert_eq!(every(1), 6 + 15);
        // Every 2nd: blocks 1 and 3 are not recomputed and stay gathered from their forward
        // to their backward; block 2 comes and goes between them.
        assert_eq!(every(2), 6 + 9 + 15);
        assert_eq!(gathered_peak(&layout, Recompute::Keep), 6 + 6 + 9 + 12 + 15);
    }
}
