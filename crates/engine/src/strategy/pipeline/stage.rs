//! [`Stage`]: one rank's stage of one pipeline — its blocks, its share of the parameters
//! outside them, and which stage owns each unit.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::ops::Range;

use burn::module::{Module, ParamId};
use kiln_models::BlockStack;

use super::timeline::Timeline;
use crate::comm::Collective;
use crate::config::PipelineSchedule;
use crate::error::Result;
use crate::exec::Accumulate;
use crate::params::{FlatLayout, frozen_with_ids, set_frozen};
use crate::strategy::context::Context;
use crate::strategy::kit::RankKit;
use crate::strategy::pipeline::partition;

/// A pipeline stage of one replica; see the module documentation.
pub struct Stage<'a, M: Module, B> {
    pub(super) kit: RankKit<'a>,
    /// Every unit of the model (this stage's layout is `kit.layout`).
    pub(super) full: FlatLayout,
    /// The units of `full` this stage holds, ascending (0, the parameters outside the blocks,
    /// on the first and the last stage).
    pub(super) owned: Vec<usize>,
    /// The master parameters (other stages' released) and the buffers.
    pub(super) model: M,
    pub(super) compute: Option<M>,
    pub(super) acc: Accumulate<M>,
    pub(super) stage: usize,
    pub(super) stages: usize,
    pub(super) replicas: usize,
    /// `cuts[s]..cuts[s + 1]` are stage s's blocks.
    cuts: Vec<usize>,
    /// The block each float tensor (parameters and buffers) belongs to.
    pub(super) block_of: HashMap<ParamId, usize>,
    /// The frozen parameters in module order: id, shape and the stage that keeps them.
    pub(super) frozen: Vec<(ParamId, Vec<usize>, usize)>,
    /// This replica's stages (rank = stage): activations and gradients travel here.
    pub(super) pipe: Box<dyn Collective>,
    /// This stage in every replica: block gradients are averaged here.
    pub(super) peers: Box<dyn Collective>,
    /// The first and last stages of every replica: the parameters outside the blocks are
    /// summed here.
    pub(super) ends: Box<dyn Collective>,
    pub(super) schedule: PipelineSchedule,
    pub(super) microbatches: usize,
    pub(super) timeline: Timeline,
    _batch: PhantomData<fn(B)>,
}

impl<'a, B, M: BlockStack<B> + Module> Stage<'a, M, B> {
    pub(crate) fn new(model: M, blocks: &[Vec<ParamId>], ctx: Context<'a>) -> Result<Self> {
        let comm = ctx.comm;
        let section = ctx.own.pipeline().clone();
        let stages = section.stages;
        let (rank, world) = (comm.rank(), comm.world_size());
        let (stage, replica) = (rank % stages, rank / stages);
        let replicas = world / stages;
        let first_or_last = stage == 0 || stage + 1 == stages;
        let pipe = comm.split(replica, stage)?;
        let peers = comm.split(stage, replica)?;
        let ends = comm.split(usize::from(!first_or_last), rank)?;

        let full = FlatLayout::new(&model, blocks, 1);
        let weights: Vec<usize> = full.units[1..].iter().map(|u| u.len).collect();
        let cuts = partition::cuts(&weights, stages, section.cuts.as_deref())?;
        let mut owned: Vec<usize> = Vec::new();
        if first_or_last {
            owned.push(0);
        }
        owned.extend((cuts[stage]..cuts[stage + 1]).map(|b| b + 1));
        let schedule = section.schedule;
        let microbatches = section.microbatches;
        let mut kit = RankKit::new(ctx, full.select(&owned));
        let mut model = model;
        for u in (0..full.units.len()).filter(|u| !owned.contains(u)) {
            model = full.release_unit(model, u, &kit.device);
        }
        // Frozen parameters are placed like the units: each stage keeps those of its blocks
        // (and, on the first and last, those outside the blocks) and releases the rest.
        let block_of: HashMap<ParamId, usize> = blocks
            .iter()
            .enumerate()
            .flat_map(|(b, ids)| ids.iter().map(move |id| (*id, b)))
            .collect();
        let frozen: Vec<(ParamId, Vec<usize>, usize)> = frozen_with_ids(&model)
            .into_iter()
            .map(|(id, shape, _)| {
                let owner = block_of.get(&id).map_or(0, |&b| stage_of(&cuts, b));
                (id, shape, owner)
            })
            .collect();
        let released: HashMap<ParamId, (Vec<usize>, Vec<f32>)> = frozen
            .iter()
            .filter(|(id, _, owner)| {
                let outside = !block_of.contains_key(id);
                *owner != stage && !(outside && first_or_last)
            })
            .map(|(id, _, _)| (*id, (Vec::new(), Vec::new())))
            .collect();
        if !released.is_empty() {
            let dtype = kit.master;
            model = set_frozen(model, &released, dtype, &kit.device);
        }
        kit.memory.params.set(kit.master_bytes(kit.layout.total()));
        kit.memory.frozen = crate::params::frozen_bytes(&model);
        kit.memory.note();
        Ok(Self {
            kit,
            full,
            owned,
            model,
            compute: None,
            acc: Accumulate::default(),
            stage,
            stages,
            replicas,
            cuts,
            block_of,
            frozen,
            pipe,
            peers,
            ends,
            schedule,
            microbatches,
            timeline: Timeline::default(),
            _batch: PhantomData,
        })
    }

    /// Whether this stage takes the micro-batches: the first embeds them, the last scores
    /// them, and every stage runs its blocks on them when the model's blocks read the batch
    /// (a packed batch's documents).
    pub(super) fn takes(&self) -> bool {
        self.first() || self.last() || self.model.blocks_read_batch()
    }

    pub(super) fn first(&self) -> bool {
        self.stage == 0
    }

    pub(super) fn last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    pub(super) fn blocks(&self) -> Range<usize> {
        self.cuts[self.stage]..self.cuts[self.stage + 1]
    }

    /// The stage that holds unit `u` of the full layout (the first, for the parameters
    /// outside the blocks).
    pub(super) fn owner(&self, u: usize) -> usize {
        if u == 0 {
            return 0;
        }
        self.stage_of_block(u - 1)
    }

    /// The stage that runs block `b`.
    pub(super) fn stage_of_block(&self, b: usize) -> usize {
        stage_of(&self.cuts, b)
    }

    /// Where unit `u` of the full layout starts in a canonical vector.
    pub(super) fn canonical_offset(&self, u: usize) -> usize {
        self.full.units[..u].iter().map(|x| x.len).sum()
    }
}

/// The stage whose blocks `cuts[s]..cuts[s + 1]` hold block `b`.
fn stage_of(cuts: &[usize], b: usize) -> usize {
    (0..cuts.len() - 1)
        .find(|&s| cuts[s] <= b && b < cuts[s + 1])
        .expect("every block has a stage")
}
