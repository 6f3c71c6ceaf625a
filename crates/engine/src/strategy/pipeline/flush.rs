//! One flush of a stage: its schedule's forwards and backwards with the activations and
//! their gradients travelling between stages, and the gradients averaged over replicas.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::{Activation, BlockStack, StepOutput};

use super::schedule::Op;
use super::stage::Stage;
use super::timeline::{Event, now};
use crate::comm::{Collective, ReduceOp};
use crate::error::{Error, Result};
use crate::exec::{
    Hooks, Part, Pass, StemKept, backward_blocks, forward_blocks, head_backward, stem_backward,
    stem_forward,
};
use crate::strategy::pipeline::schedule;
use crate::strategy::step::scored;

/// The next micro-batch where the stage takes it (`wanted`).
fn take<B>(batches: &mut dyn Iterator<Item = Result<B>>, wanted: bool) -> Result<Option<B>> {
    match wanted.then(|| batches.next()) {
        Some(Some(batch)) => batch.map(Some),
        Some(None) => Err(Error::Worker(
            "the loop handed fewer micro-batches than the schedule runs".into(),
        )),
        None => Ok(None),
    }
}

impl<B, M: BlockStack<B> + Module> Stage<'_, M, B> {
    /// One flush: the micro-batches of `batches` in the schedule's order on this stage.
    /// Returns the losses this stage computed (on the last stage).
    pub(super) fn flush(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        let (first, last) = (self.first(), self.last());
        let takes = self.takes();
        let (stage, micro) = (self.stage, self.microbatches);
        let blocks = self.blocks();
        let ops = schedule::ops(self.schedule, self.stages, stage, micro);
        let model = self.compute.clone().unwrap_or_else(|| self.model.clone());
        let device = self.kit.device.clone();
        let sync_bn = (self.kit.sync_batchnorm && self.peers.world_size() > 1)
            .then_some(self.peers.as_ref() as &dyn Collective);
        let pass = Pass {
            recompute: self.kit.recompute,
            sync_bn,
            device: &device,
            group: None,
        };
        let recompute_stem = blocks
            .clone()
            .any(|i| pass.recompute.recomputes(i - blocks.start, blocks.len()));
        let mut held_batches: BTreeMap<usize, B> = BTreeMap::new();
        let mut stem_graphs: BTreeMap<usize, StemKept> = BTreeMap::new();
        let mut stashes = BTreeMap::new();
        let mut upstreams: BTreeMap<usize, Activation> = BTreeMap::new();
        let mut losses = Vec::new();
        let mut events = Vec::with_capacity(ops.len());
        let mut held = 0usize;
        let flush_start = now();
        for op in ops {
            match op {
                Op::Forward(m) => {
                    let batch = take(batches, takes)?;
                    let (x, start) = if first {
                        let start = now();
                        let batch = batch.as_ref().expect("the first stage takes the batch");
                        let (x, graph) = stem_forward(&model, batch, recompute_stem);
                        stem_graphs.insert(m, graph);
                        (x, start)
                    } else {
                        let x = self.kit.timed(|_| self.pipe.recv(stage - 1))?;
                        (x.arrive(&device), now())
                    };
                    let (out, stash, _) = forward_blocks(
                        model.clone(),
                        x,
                        blocks.clone(),
                        batch.as_ref(),
                        &pass,
                        &mut self.acc,
                    )?;
                    if last {
                        let batch = batch.as_ref().expect("the last stage takes the batch");
                        let (o, up, grads) = head_backward(&model, out, batch, objective);
                        self.acc.grads(&model, Part::Head, grads)?;
                        upstreams.insert(m, up);
                        losses.push(scored(o));
                    } else {
                        self.kit.timed(|_| self.pipe.send(stage + 1, out))?;
                    }
                    if let Some(batch) = batch {
                        // The stem's or the blocks' backward reads it again (the head's ran).
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
                        self.kit
                            .timed(|_| self.pipe.recv(stage + 1))?
                            .arrive(&device)
                    };
                    let start = now();
                    let stash = stashes.remove(&m).expect("the forward ran first");
                    let kept = held_batches.remove(&m);
                    let (below, _) = backward_blocks(
                        model.clone(),
                        stash,
                        upstream,
                        kept.as_ref(),
                        &pass,
                        &mut self.acc,
                    )?;
                    if first {
                        let batch = kept.expect("kept from the forward");
                        let graph = stem_graphs.remove(&m).expect("kept from the forward");
                        if let Some(grads) = stem_backward(&model, &batch, graph, below) {
                            self.acc.grads(&model, Part::Stem, grads)?;
                        }
                    } else {
                        self.kit.timed(|_| self.pipe.send(stage - 1, below))?;
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
    pub(super) fn reduced_grads(&mut self) -> Result<Tensor<1>> {
        let mut grads = self.acc.take();
        let mut host = Vec::with_capacity(self.kit.layout.total());
        for (local, &u) in self.owned.iter().enumerate() {
            let flat = self.kit.layout.unit_grads(
                &self.model,
                &mut grads,
                local,
                FloatDType::F32,
                &self.kit.device,
            );
            if u == 0 {
                let mut sum = self
                    .kit
                    .reduce_in(self.ends.as_ref(), vec![flat], ReduceOp::Sum)?;
                if self.replicas > 1 {
                    let inv = self.replicas as f32;
                    for x in &mut sum {
                        *x /= inv;
                    }
                }
                host.extend(sum);
            } else {
                host.extend(
                    self.kit
                        .reduce_in(self.peers.as_ref(), vec![flat], ReduceOp::Mean)?,
                );
            }
        }
        let n = host.len();
        Ok(Tensor::<1>::from_data(
            TensorData::new(host, [n]),
            &self.kit.inner,
        ))
    }
}
