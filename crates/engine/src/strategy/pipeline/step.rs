//! A stage's optimizer step, whole model, optimizer state and report: [`Strategy`] for
//! [`Stage`].

use std::collections::HashMap;

use burn::module::{Module, ParamId};
use burn::prelude::*;
use kiln_models::{BlockStack, StepOutput};
use serde_json::json;

use super::schedule::Op;
use super::stage::Stage;
use crate::comm::ReduceOp;
use crate::config::name_of;
use crate::error::Result;
use crate::optim::OptimState;
use crate::params::{frozen_with_ids, host_f32, set_frozen};
use crate::precision::LossScaler;
use crate::strategy::memory::Memory;
use crate::strategy::step::{Report, Strategy};
use crate::strategy::update::Norm;

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Stage<'_, M, B> {
    fn begin_step(&mut self) -> Result<()> {
        if let Some(copy) = self.kit.policy.compute_copy(&self.model) {
            self.compute = Some(copy);
            let bytes = self.kit.policy.compute_copy_bytes(self.kit.layout.total());
            self.kit.memory.params.add(bytes);
            self.kit.memory.note();
        }
        Ok(())
    }

    fn takes_batches(&self) -> bool {
        self.takes()
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
        let bytes = self.kit.layout.total() * 4;
        self.kit.memory.grads.set(bytes);
        self.kit.sample_pool();
        Ok(losses)
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        if self.compute.take().is_some() {
            let bytes = self.kit.policy.compute_copy_bytes(self.kit.layout.total());
            self.kit.memory.params.sub(bytes);
        }
        let grads = self.reduced_grads()?;
        let params = self.kit.shard_of(&self.model);
        // The squares of every stage, the shared parameters counted once (on the first).
        let skip = if self.stages > 1 && self.last() {
            self.kit.layout.units[0].len
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
        let stepped = self.kit.finish(grads, params, lr, scaler, clip, norm)?;
        self.kit.memory.grads.set(0);
        let Some(flat) = stepped else {
            return Ok(false);
        };
        self.model = self.kit.load_flat(self.model.clone(), flat);
        self.kit.sample_pool();
        Ok(true)
    }

    fn full_model(&mut self) -> Result<M> {
        self.settle_buffers()?;
        let mut full = self.model.clone();
        // Frozen parameters: each from the stage that keeps it.
        if !self.frozen.is_empty() {
            let mine: HashMap<ParamId, Vec<f32>> = frozen_with_ids(&self.model)
                .into_iter()
                .map(|(id, _, v)| (id, v))
                .collect();
            let mut values = HashMap::new();
            for s in 0..self.stages {
                let kept: Vec<&(ParamId, Vec<usize>, usize)> =
                    self.frozen.iter().filter(|f| f.2 == s).collect();
                let mut flat: Vec<f32> = if s == self.stage {
                    kept.iter()
                        .flat_map(|(id, _, _)| mine[id].clone())
                        .collect()
                } else {
                    Vec::new()
                };
                let pipe = self.pipe.as_ref();
                self.kit.timed(|_| pipe.broadcast(&mut flat, s))?;
                let mut at = 0;
                for (id, shape, _) in kept {
                    let n: usize = shape.iter().product();
                    values.insert(*id, (shape.clone(), flat[at..at + n].to_vec()));
                    at += n;
                }
            }
            let dtype = self.kit.master;
            full = set_frozen(full, &values, dtype, &self.kit.device);
        }
        for u in 0..self.full.units.len() {
            let owner = self.owner(u);
            let mut values = if owner == self.stage {
                host_f32(
                    self.full
                        .unit_values(&self.model, u, self.kit.master, &self.kit.device),
                )
            } else {
                Vec::new()
            };
            let pipe = self.pipe.as_ref();
            self.kit.timed(|_| pipe.broadcast(&mut values, owner))?;
            let n = values.len();
            let flat = Tensor::<1>::from_data(TensorData::new(values, [n]), &self.kit.inner);
            full = self
                .full
                .load_unit(full, u, flat, self.kit.master, &self.kit.device);
        }
        Ok(full)
    }

    fn optimizer_state(&mut self) -> Result<Option<OptimState>> {
        let (tensors, scalars) = self.kit.optimizer.export();
        let mut leaves = Vec::with_capacity(tensors.len());
        for (name, mine) in tensors {
            let mut canonical = Vec::with_capacity(self.full.total());
            let mut local = 0;
            let mut offsets = HashMap::new();
            for (i, &u) in self.owned.iter().enumerate() {
                offsets.insert(u, local);
                local += self.kit.layout.units[i].len;
            }
            for u in 0..self.full.units.len() {
                let owner = self.owner(u);
                let len = self.full.units[u].len;
                let mut values = match offsets.get(&u) {
                    Some(&at) if owner == self.stage => mine[at..at + len].to_vec(),
                    _ => Vec::new(),
                };
                let pipe = self.pipe.as_ref();
                self.kit.timed(|_| pipe.broadcast(&mut values, owner))?;
                canonical.extend(values);
            }
            leaves.push((name, canonical));
        }
        Ok((self.kit.rank() == 0).then(|| {
            OptimState::from_leaves(self.kit.optimizer.kind(), &self.full, leaves, scalars)
        }))
    }

    fn load_optimizer_state(&mut self, state: &OptimState) -> Result<()> {
        let leaves = state.leaves(&self.full)?;
        let mut parts = Vec::with_capacity(leaves.len());
        for (name, canonical) in leaves {
            let mut mine = Vec::with_capacity(self.kit.layout.total());
            for &u in &self.owned {
                let at = self.canonical_offset(u);
                mine.extend_from_slice(&canonical[at..at + self.full.units[u].len]);
            }
            parts.push((name, mine));
        }
        self.kit.optimizer.import(parts, state.scalars.clone())?;
        self.kit.memory.optim.set(self.kit.optimizer.state_bytes());
        Ok(())
    }

    fn checkpoint_share(&mut self) -> Result<crate::optim::Share> {
        self.settle_buffers()?;
        Ok(self.share())
    }

    fn load_optimizer_shards(
        &mut self,
        source: &dyn crate::optim::Source,
        groups: &[String],
    ) -> Result<()> {
        crate::strategy::replica::load_one_optimizer(&mut self.kit, source, groups)
    }

    fn check_replicas(&mut self, step: usize) -> Result<()> {
        // The same stage of every replica.
        let values = host_f32(self.kit.shard_of(&self.model));
        let peers = self.peers.as_ref();
        self.kit.check_replicas(peers, values, step)?;
        // The copies of the parameters outside the blocks on the first and last stages.
        let shared = if self.first() || self.last() {
            host_f32(
                self.kit
                    .layout
                    .unit_values(&self.model, 0, self.kit.master, &self.kit.device),
            )
        } else {
            Vec::new()
        };
        let ends = self.ends.as_ref();
        self.kit.check_replicas(ends, shared, step)
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
            .kit
            .timed(|comm| crate::comm::pack::gather_ragged(comm, &mine))?;
        let mut report = Report::default();
        if self.kit.rank() != 0 {
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
        self.kit.memory
    }

    fn take_sync_seconds(&mut self) -> f64 {
        self.kit.take_sync_seconds()
    }

    fn nonfinite(&self) -> bool {
        self.kit.nonfinite
    }

    fn skipped_on_device(&mut self) -> Result<Vec<usize>> {
        Ok(self.kit.take_skipped())
    }
}
