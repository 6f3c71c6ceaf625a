//! `pipeline`: the model's block stack cut into stages, one device and thread each, with
//! micro-batches flowing through them; `devices / stages` such pipelines are data-parallel
//! replicas.
//!
//! Rank `r` is stage `r mod K` of replica `r div K`. Stage s holds its blocks (the
//! [`partition`]) and, on the first and the last stage, the parameters outside every block
//! (the stem's and the head's, the GPT's token embedding tied between them, kept on both); the
//! other stages' parameters are released in its module. A micro-batch's forward enters at the
//! first stage (the stem), passes each stage's blocks — the activation travels to the next
//! stage's device with Burn's `to_device` — and ends in the head and the loss on the last
//! stage, whose backward starts there; each stage's backward is the block walk's
//! ([`crate::exec::backward_blocks`]) seeded with the gradient the next stage sent back. The
//! order of a stage's forwards and backwards is the [`schedule`]'s (GPipe or 1F1B).
//!
//! The micro-batches of one flush are `pipeline.microbatches` consecutive accumulation
//! micro-steps (each of `train.batch_size` samples), so a pipeline sees exactly the samples of
//! `single --accumulate M`. At the optimizer step each block's gradients are averaged with the
//! same stage of the other replicas; the parameters outside the blocks have their stem part on
//! the first stage and their head part on the last, so those are summed over the first and
//! last stages of every replica (and divided by the replicas), which keeps the two copies of
//! a tied weight identical. Clipping adds every stage's squares (the shared parameters counted
//! once); the overflow check of a loss scaler is all-reduced over every rank.
//!
//! BatchNorm sees one micro-batch at a time, as with gradient accumulation, in micro-batch
//! order on every stage (both schedules run the forwards in order), so its running statistics
//! come out as accumulation's. Evaluation and checkpoints assemble the whole model on every
//! rank (each unit broadcast from the stage that holds it).

pub mod partition;
pub mod schedule;

use std::collections::{BTreeMap, HashMap};
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::OnceLock;
use std::time::Instant;

use burn::module::{Module, ParamId};
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::{Activation, BlockStack, StepOutput};
use serde_json::json;

use self::schedule::Op;
use super::context::Context;
use super::core::{Core, Norm};
use super::memory::Memory;
use super::rules::{Estimate, ModelFacts, Rules, Setup, state_tensors};
use super::step::{Report, Strategy, scored};
use crate::comm::{Collective, ReduceOp};
use crate::config::{OptimConfig, PipelineSchedule, name_of};
use crate::error::{Error, Result};
use crate::exec::{
    Accumulate, Hooks, Part, Plan, backward_blocks, forward_blocks, head_backward, stem_backward,
    stem_forward,
};
use crate::optim::OptimState;
use crate::params::{FlatLayout, buffers_with_ids, host_f32, replace_floats};
use crate::precision::LossScaler;

/// The pipeline's rules: stages divide the ranks, and no more stages than blocks.
pub struct Pipeline;

impl Rules for Pipeline {
    fn check(&self, setup: &Setup) -> Result<()> {
        let stages = setup.pipeline.stages;
        if !setup.world.is_multiple_of(stages) {
            return Err(Error::config(format!(
                "key `pipeline.stages`: {stages} stages must divide the {} devices (devices / \
                 stages pipelines train as replicas)",
                setup.world
            )));
        }
        Ok(())
    }

    fn check_model(&self, model: &ModelFacts, setup: &Setup) -> Result<()> {
        let p = &setup.pipeline;
        stage_elements(&model.layout, p.stages, p.cuts.as_deref()).map(|_| ())
    }

    fn describe(&self, setup: &Setup) -> String {
        let p = &setup.pipeline;
        format!(
            "pipeline ({} stages × {} replicas, {} micro-batches per flush, {})",
            p.stages,
            setup.world / p.stages,
            p.microbatches,
            name_of(&p.schedule)
        )
    }

    fn batch_line(
        &self,
        setup: &Setup,
        batch: usize,
        accumulate: usize,
        per_step: usize,
    ) -> String {
        let p = &setup.pipeline;
        format!(
            "{batch} per micro-batch × {} micro-batches × {} pipelines × {accumulate} \
             accumulation = {per_step} per step",
            p.microbatches,
            setup.world / p.stages
        )
    }

    /// The heaviest stage's figures.
    fn estimate(
        &self,
        layout: &FlatLayout,
        optim: &OptimConfig,
        setup: &Setup,
    ) -> Result<Estimate> {
        let p = &setup.pipeline;
        let stage = stage_elements(layout, p.stages, p.cuts.as_deref())?;
        let policy = &setup.policy;
        Ok(Estimate {
            params: policy.master_bytes(stage) + policy.compute_copy_bytes(stage),
            grads: stage * 4,
            optim: state_tensors(optim) * policy.master_bytes(stage),
        })
    }

    fn stages(&self, setup: &Setup) -> usize {
        setup.pipeline.stages
    }

    fn flush(&self, setup: &Setup) -> usize {
        setup.pipeline.microbatches
    }
}

/// Seconds since one moment shared by every thread of the process, so that stages' timelines
/// line up.
fn now() -> f64 {
    static ANCHOR: OnceLock<Instant> = OnceLock::new();
    ANCHOR.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// One operation as it ran: which, and when (seconds on the shared clock). A forward's start
/// is taken after its input arrived, a backward's after its upstream gradient did, so waiting
/// is not counted as work.
#[derive(Debug, Clone, Copy)]
struct Event {
    op: Op,
    start: f64,
    end: f64,
}

/// What a stage measured over a logging window.
#[derive(Debug, Default)]
struct Timeline {
    /// Seconds of forward and backward work.
    busy: f64,
    /// Seconds from each flush's start to its last operation's end.
    span: f64,
    /// The most micro-batches whose activations the stage held at once.
    held: usize,
    /// The last flush's operations, and when it started.
    last: Vec<Event>,
    last_start: f64,
}

/// A pipeline stage of one replica; see the module documentation.
pub struct Stage<'a, M: Module, B> {
    core: Core<'a>,
    /// Every unit of the model (this stage's layout is `core.layout`).
    full: FlatLayout,
    /// The units of `full` this stage holds, ascending (0, the parameters outside the blocks,
    /// on the first and the last stage).
    owned: Vec<usize>,
    /// The master parameters (other stages' released) and the buffers.
    model: M,
    compute: Option<M>,
    acc: Accumulate<M>,
    stage: usize,
    stages: usize,
    replicas: usize,
    /// `cuts[s]..cuts[s + 1]` are stage s's blocks.
    cuts: Vec<usize>,
    /// The block each float tensor (parameters and buffers) belongs to.
    block_of: HashMap<ParamId, usize>,
    /// This replica's stages (rank = stage): activations and gradients travel here.
    pipe: Box<dyn Collective>,
    /// This stage in every replica: block gradients are averaged here.
    peers: Box<dyn Collective>,
    /// The first and last stages of every replica: the parameters outside the blocks are
    /// summed here.
    ends: Box<dyn Collective>,
    schedule: PipelineSchedule,
    microbatches: usize,
    timeline: Timeline,
    _batch: PhantomData<fn(B)>,
}

impl<'a, B, M: BlockStack<B> + Module> Stage<'a, M, B> {
    pub(crate) fn new(model: M, blocks: &[Vec<ParamId>], ctx: Context<'a>) -> Result<Self> {
        let comm = ctx.comm;
        let stages = ctx.pipeline.stages;
        let (rank, world) = (comm.rank(), comm.world_size());
        let (stage, replica) = (rank % stages, rank / stages);
        let replicas = world / stages;
        let first_or_last = stage == 0 || stage + 1 == stages;
        let pipe = comm.split(replica, stage)?;
        let peers = comm.split(stage, replica)?;
        let ends = comm.split(usize::from(!first_or_last), rank)?;

        let full = FlatLayout::new(&model, blocks, 1);
        let weights: Vec<usize> = full.units[1..].iter().map(|u| u.len).collect();
        let cuts = partition::cuts(&weights, stages, ctx.pipeline.cuts.as_deref())?;
        let mut owned: Vec<usize> = Vec::new();
        if first_or_last {
            owned.push(0);
        }
        owned.extend((cuts[stage]..cuts[stage + 1]).map(|b| b + 1));
        let schedule = ctx.pipeline.schedule;
        let microbatches = ctx.pipeline.microbatches;
        let mut core = Core::new(ctx, full.select(&owned));
        let mut model = model;
        for u in (0..full.units.len()).filter(|u| !owned.contains(u)) {
            model = full.release_unit(model, u, &core.device);
        }
        core.memory
            .params
            .set(core.master_bytes(core.layout.total()));
        core.memory.note();
        let block_of = blocks
            .iter()
            .enumerate()
            .flat_map(|(b, ids)| ids.iter().map(move |id| (*id, b)))
            .collect();
        Ok(Self {
            core,
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
            pipe,
            peers,
            ends,
            schedule,
            microbatches,
            timeline: Timeline::default(),
            _batch: PhantomData,
        })
    }

    fn first(&self) -> bool {
        self.stage == 0
    }

    fn last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    fn blocks(&self) -> Range<usize> {
        self.cuts[self.stage]..self.cuts[self.stage + 1]
    }

    /// The stage that holds unit `u` of the full layout (the first, for the parameters
    /// outside the blocks).
    fn owner(&self, u: usize) -> usize {
        if u == 0 {
            return 0;
        }
        self.stage_of_block(u - 1)
    }

    /// The stage that runs block `b`.
    fn stage_of_block(&self, b: usize) -> usize {
        (0..self.stages)
            .find(|&s| self.cuts[s] <= b && b < self.cuts[s + 1])
            .expect("every block has a stage")
    }

    /// Where unit `u` of the full layout starts in a canonical vector.
    fn canonical_offset(&self, u: usize) -> usize {
        self.full.units[..u].iter().map(|x| x.len).sum()
    }

    /// One flush: the micro-batches of `batches` in the schedule's order on this stage.
    /// Returns the losses this stage computed (on the last stage).
    fn flush(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        let (first, last) = (self.first(), self.last());
        let (stage, micro) = (self.stage, self.microbatches);
        let blocks = self.blocks();
        let ops = schedule::ops(self.schedule, self.stages, stage, micro);
        let model = self.compute.clone().unwrap_or_else(|| self.model.clone());
        let device = self.core.device.clone();
        let sync_bn = (self.core.sync_batchnorm && self.peers.world_size() > 1)
            .then_some(self.peers.as_ref() as &dyn Collective);
        let plan = Plan {
            recompute: self.core.recompute,
            sync_bn,
            device: &device,
            group: None,
        };
        let recompute_stem = blocks
            .clone()
            .any(|i| plan.recompute.recomputes(i - blocks.start, blocks.len()));

        let mut held_batches: BTreeMap<usize, B> = BTreeMap::new();
        let mut stem_graphs: BTreeMap<usize, Option<Activation>> = BTreeMap::new();
        let mut stashes = BTreeMap::new();
        let mut upstreams: BTreeMap<usize, Activation> = BTreeMap::new();
        let mut losses = Vec::new();
        let mut events = Vec::with_capacity(ops.len());
        let mut held = 0usize;
        let flush_start = now();
        for op in ops {
            match op {
                Op::Forward(m) => {
                    let batch = match (first || last).then(|| batches.next()) {
                        Some(Some(batch)) => Some(batch?),
                        Some(None) => {
                            return Err(Error::Worker(
                                "the loop handed fewer micro-batches than the schedule runs".into(),
                            ));
                        }
                        None => None,
                    };
                    let (x, start) = if first {
                        let start = now();
                        let batch = batch.as_ref().expect("the first stage takes the batch");
                        let (x, graph) = stem_forward(&model, batch, recompute_stem);
                        stem_graphs.insert(m, graph);
                        (x, start)
                    } else {
                        let x = self.core.timed(|_| self.pipe.recv(stage - 1))?;
                        (x.arrive(&device), now())
                    };
                    let (out, stash, _) =
                        forward_blocks(model.clone(), x, blocks.clone(), &plan, &mut self.acc)?;
                    if last {
                        let batch = batch.as_ref().expect("the last stage takes the batch");
                        let (o, up, grads) = head_backward(&model, out, batch, objective);
                        self.acc.grads(&model, Part::Head, grads)?;
                        upstreams.insert(m, up);
                        losses.push(scored(o));
                    } else {
                        self.core.timed(|_| self.pipe.send(stage + 1, out))?;
                    }
                    if first && let Some(batch) = batch {
                        held_batches.insert(m, batch);
                    }
                    stashes.insert(m, stash);
                    held += 1;
                    self.timeline.held = self.timeline.held.max(held);
                    events.push(Event {
                        op,
                        start,
                        end: now(),
                    });
                }
                Op::Backward(m) => {
                    let upstream = if last {
                        upstreams.remove(&m).expect("the head ran in the forward")
                    } else {
                        self.core
                            .timed(|_| self.pipe.recv(stage + 1))?
                            .arrive(&device)
                    };
                    let start = now();
                    let stash = stashes.remove(&m).expect("the forward ran first");
                    let (below, _) =
                        backward_blocks(model.clone(), stash, upstream, &plan, &mut self.acc)?;
                    if first {
                        let batch = held_batches.remove(&m).expect("kept from the forward");
                        let graph = stem_graphs.remove(&m).flatten();
                        if let Some(grads) = stem_backward(&model, &batch, graph, below) {
                            self.acc.grads(&model, Part::Stem, grads)?;
                        }
                    } else {
                        self.core.timed(|_| self.pipe.send(stage - 1, below))?;
                    }
                    held -= 1;
                    events.push(Event {
                        op,
                        start,
                        end: now(),
                    });
                }
            }
        }
        let end = events.last().map_or(flush_start, |e| e.end);
        self.timeline.busy += events.iter().map(|e| e.end - e.start).sum::<f64>();
        self.timeline.span += end - flush_start;
        self.timeline.last = events;
        self.timeline.last_start = flush_start;
        Ok(losses)
    }

    /// This stage's flat gradients (its units, canonical order), reduced over the replicas:
    /// each block's averaged with the same stage's, the parameters outside the blocks summed
    /// over the first and last stages and divided by the replicas.
    fn reduced_grads(&mut self) -> Result<Tensor<1>> {
        let mut grads = self.acc.take();
        let mut host = Vec::with_capacity(self.core.layout.total());
        for (local, &u) in self.owned.iter().enumerate() {
            let flat = self.core.layout.unit_grads(
                &self.model,
                &mut grads,
                local,
                FloatDType::F32,
                &self.core.device,
            );
            if u == 0 {
                let mut sum = self
                    .core
                    .reduce_in(self.ends.as_ref(), vec![flat], ReduceOp::Sum)?;
                if self.replicas > 1 {
                    let inv = self.replicas as f32;
                    for x in &mut sum {
                        *x /= inv;
                    }
                }
                host.extend(sum);
            } else {
                host.extend(self.core.reduce_in(
                    self.peers.as_ref(),
                    vec![flat],
                    ReduceOp::Mean,
                )?);
            }
        }
        let n = host.len();
        Ok(Tensor::<1>::from_data(
            TensorData::new(host, [n]),
            &self.core.inner,
        ))
    }
}

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Stage<'_, M, B> {
    fn begin_step(&mut self) -> Result<()> {
        if let Some(copy) = self.core.policy.compute_copy(&self.model) {
            self.compute = Some(copy);
            let bytes = self
                .core
                .policy
                .compute_copy_bytes(self.core.layout.total());
            self.core.memory.params.add(bytes);
            self.core.memory.note();
        }
        Ok(())
    }

    fn takes_batches(&self) -> bool {
        self.first() || self.last()
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        let mut losses = Vec::new();
        for _ in 0..count / self.microbatches {
            losses.extend(self.flush(batches, objective)?);
        }
        let bytes = self.core.layout.total() * 4;
        self.core.memory.grads.set(bytes);
        self.core.sample_pool();
        Ok(losses)
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        if self.compute.take().is_some() {
            let bytes = self
                .core
                .policy
                .compute_copy_bytes(self.core.layout.total());
            self.core.memory.params.sub(bytes);
        }
        let grads = self.reduced_grads()?;
        let params = self.core.shard_of(&self.model);
        // The squares of every stage, the shared parameters counted once (on the first).
        let skip = if self.stages > 1 && self.last() {
            self.core.layout.units[0].len
        } else {
            0
        };
        let pipe = self.pipe.as_ref();
        let norm = Norm::Squares(Box::new(move |g: &Tensor<1>| {
            let n = g.dims()[0];
            let mine: f32 = if skip >= n {
                0.0
            } else {
                g.clone().slice(skip..n).square().sum().into_scalar()
            };
            let mut total = vec![mine];
            pipe.all_reduce(&mut total, ReduceOp::Sum)?;
            Ok(total[0])
        }));
        let stepped = self.core.finish(grads, params, lr, scaler, clip, norm)?;
        self.core.memory.grads.set(0);
        let Some(flat) = stepped else {
            return Ok(false);
        };
        self.model = self.core.load_flat(self.model.clone(), flat);
        self.core.sample_pool();
        Ok(true)
    }

    fn full_model(&mut self) -> Result<M> {
        // Buffers: each comes from the stage that holds its block, averaged over replicas.
        crate::params::sync_running_state(&self.model);
        let buffers = buffers_with_ids(&self.model);
        if !buffers.is_empty() {
            let mut values = Vec::new();
            for (id, v) in &buffers {
                let owner = self.block_of.get(id).map_or(0, |b| self.stage_of_block(*b));
                if owner == self.stage {
                    values.extend_from_slice(v);
                } else {
                    values.extend(std::iter::repeat_n(0.0, v.len()));
                }
            }
            self.core
                .timed(|comm| comm.all_reduce(&mut values, ReduceOp::Sum))?;
            if self.replicas > 1 {
                let inv = self.replicas as f32;
                for x in &mut values {
                    *x /= inv;
                }
            }
            self.model = replace_floats(self.model.clone(), false, values, &self.core.device);
        }
        let mut full = self.model.clone();
        for u in 0..self.full.units.len() {
            let owner = self.owner(u);
            let mut values = if owner == self.stage {
                host_f32(
                    self.full
                        .unit_values(&self.model, u, self.core.master, &self.core.device),
                )
            } else {
                Vec::new()
            };
            let pipe = self.pipe.as_ref();
            self.core.timed(|_| pipe.broadcast(&mut values, owner))?;
            let n = values.len();
            let flat = Tensor::<1>::from_data(TensorData::new(values, [n]), &self.core.inner);
            full = self
                .full
                .load_unit(full, u, flat, self.core.master, &self.core.device);
        }
        Ok(full)
    }

    fn optimizer_state(&mut self) -> Result<Option<OptimState>> {
        let (tensors, scalars) = self.core.optimizer.export();
        let mut leaves = Vec::with_capacity(tensors.len());
        for (name, mine) in tensors {
            let mut canonical = Vec::with_capacity(self.full.total());
            let mut local = 0;
            let mut offsets = HashMap::new();
            for (i, &u) in self.owned.iter().enumerate() {
                offsets.insert(u, local);
                local += self.core.layout.units[i].len;
            }
            for u in 0..self.full.units.len() {
                let owner = self.owner(u);
                let len = self.full.units[u].len;
                let mut values = match offsets.get(&u) {
                    Some(&at) if owner == self.stage => mine[at..at + len].to_vec(),
                    _ => Vec::new(),
                };
                let pipe = self.pipe.as_ref();
                self.core.timed(|_| pipe.broadcast(&mut values, owner))?;
                canonical.extend(values);
            }
            leaves.push((name, canonical));
        }
        Ok((self.core.rank() == 0).then(|| {
            OptimState::from_leaves(self.core.optimizer.kind(), &self.full, leaves, scalars)
        }))
    }

    fn load_optimizer_state(&mut self, state: &OptimState) -> Result<()> {
        let leaves = state.leaves(&self.full)?;
        let mut parts = Vec::with_capacity(leaves.len());
        for (name, canonical) in leaves {
            let mut mine = Vec::with_capacity(self.core.layout.total());
            for &u in &self.owned {
                let at = self.canonical_offset(u);
                mine.extend_from_slice(&canonical[at..at + self.full.units[u].len]);
            }
            parts.push((name, mine));
        }
        self.core.optimizer.import(parts, state.scalars.clone())?;
        self.core
            .memory
            .optim
            .set(self.core.optimizer.state_bytes());
        Ok(())
    }

    fn check_replicas(&mut self, step: usize) -> Result<()> {
        // The same stage of every replica.
        let values = host_f32(self.core.shard_of(&self.model));
        let peers = self.peers.as_ref();
        self.core.check_replicas(peers, values, step)?;
        // The copies of the parameters outside the blocks on the first and last stages.
        let shared = if self.first() || self.last() {
            host_f32(self.core.layout.unit_values(
                &self.model,
                0,
                self.core.master,
                &self.core.device,
            ))
        } else {
            Vec::new()
        };
        let ends = self.ends.as_ref();
        self.core.check_replicas(ends, shared, step)
    }

    fn report(&mut self) -> Result<Report> {
        // Every rank: busy, span, most held, then its last flush's operations.
        let t = std::mem::take(&mut self.timeline);
        let mut mine = vec![t.busy as f32, t.span as f32, t.held as f32];
        for e in &t.last {
            let (kind, m) = match e.op {
                Op::Forward(m) => (0.0, m),
                Op::Backward(m) => (1.0, m),
            };
            mine.extend([
                kind,
                m as f32,
                (e.start - t.last_start) as f32,
                (e.end - t.last_start) as f32,
            ]);
        }
        let all = self
            .core
            .timed(|comm| crate::comm::pack::gather_ragged(comm, &mine))?;
        let mut report = Report::default();
        if self.core.rank() != 0 {
            return Ok(report);
        }
        // Replica 0's stages are ranks 0..K.
        let (k, m) = (self.stages, self.microbatches);
        let mut ops = Vec::new();
        let mut held = Vec::new();
        for (s, v) in all.iter().take(k).enumerate() {
            let idle = if v[1] > 0.0 {
                1.0 - f64::from(v[0]) / f64::from(v[1])
            } else {
                0.0
            };
            report
                .fields
                .push((format!("bubble_stage{s}"), json!(idle)));
            held.push(v[2] as usize);
            for e in v[3..].chunks(4) {
                ops.push(json!([
                    s,
                    if e[0] == 0.0 { "F" } else { "B" },
                    e[1] as usize,
                    e[2],
                    e[3]
                ]));
            }
        }
        // The whole pipeline's idle share: what the stages' work leaves of K × the longest
        // stage's span (the white area of the timeline).
        let stats: Vec<(f64, f64)> = all
            .iter()
            .take(k)
            .map(|v| (f64::from(v[0]), f64::from(v[1])))
            .collect();
        let span = stats.iter().map(|x| x.1).fold(0.0, f64::max);
        if span > 0.0 {
            let busy: f64 = stats.iter().map(|x| x.0).sum();
            report
                .fields
                .push(("bubble".into(), json!(1.0 - busy / (k as f64 * span))));
        }
        let ideal = (k - 1) as f64 / (m + k - 1) as f64;
        report.fields.push(("bubble_ideal".into(), json!(ideal)));
        let mut record = serde_json::Map::new();
        record.insert("split".into(), json!("schedule"));
        record.insert("stages".into(), json!(k));
        record.insert("microbatches".into(), json!(m));
        record.insert("schedule".into(), json!(name_of(&self.schedule)));
        record.insert("held".into(), json!(held));
        record.insert("ops".into(), json!(ops));
        report.records.push(record);
        Ok(report)
    }

    fn memory(&self) -> Memory {
        self.core.memory
    }

    fn take_sync_seconds(&mut self) -> f64 {
        self.core.take_sync_seconds()
    }

    fn nonfinite(&self) -> bool {
        self.core.nonfinite
    }
}

/// The parameter elements of the heaviest stage: its blocks', and on the first and last stage
/// the parameters outside the blocks.
fn stage_elements(layout: &FlatLayout, stages: usize, cuts: Option<&[usize]>) -> Result<usize> {
    let weights: Vec<usize> = layout.units[1..].iter().map(|u| u.len).collect();
    let cuts = partition::cuts(&weights, stages, cuts)?;
    Ok((0..stages)
        .map(|s| {
            let own: usize = weights[cuts[s]..cuts[s + 1]].iter().sum();
            own + if s == 0 || s + 1 == stages {
                layout.units[0].len
            } else {
                0
            }
        })
        .max()
        .unwrap_or(0))
}
