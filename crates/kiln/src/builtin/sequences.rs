//! The training sequences of fine-tuning on examples and the workload that batches them: an
//! example as the model sees it (inputs, next-token targets where they train), several of
//! them packed into a row of the context (`data.pack`: attention within each, positions from
//! 0 in each), batches of similar lengths padded on the right, and each batch's loss weighed
//! by its share of the step's trained targets.

use std::ops::Range;

use burn::prelude::*;
use kiln_datasets::chat::Encoded;
use kiln_models::{CausalLm, IGNORE, TokenBatch};

use kiln_engine::trainer::Workload;

/// One row of training: token ids, the next-token targets ([`IGNORE`] where nothing trains),
/// and, for a row of packed examples, where each position's example begins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// The input ids.
    pub inputs: Vec<u32>,
    /// Per input: the id that follows it where it trains, else [`IGNORE`].
    pub targets: Vec<i64>,
    /// Packed examples: per input, the position in the row where its example begins.
    pub starts: Option<Vec<u32>>,
}

impl Sequence {
    /// One example: its ids but the last as inputs, each following id a target where it is
    /// marked trained.
    pub fn of(e: &Encoded) -> Self {
        let n = e.ids.len().saturating_sub(1);
        let targets = (0..n)
            .map(|p| {
                if e.trained[p + 1] {
                    i64::from(e.ids[p + 1])
                } else {
                    IGNORE
                }
            })
            .collect();
        Self {
            inputs: e.ids[..n].to_vec(),
            targets,
            starts: None,
        }
    }

    /// The targets that train.
    pub fn trained(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
    }
}

/// `examples` packed in their order into rows of at most `context` inputs: each row takes the
/// next examples while they fit (an example longer than the context has a row of its own, cut
/// to it), each example's positions restarting at its start.
pub fn pack(examples: &[Encoded], context: usize) -> Vec<Sequence> {
    let mut rows: Vec<Sequence> = Vec::new();
    let mut row = Sequence {
        inputs: Vec::new(),
        targets: Vec::new(),
        starts: Some(Vec::new()),
    };
    for e in examples {
        let mut one = Sequence::of(e);
        one.inputs.truncate(context);
        one.targets.truncate(context);
        if !row.inputs.is_empty() && row.inputs.len() + one.inputs.len() > context {
            rows.push(std::mem::replace(
                &mut row,
                Sequence {
                    inputs: Vec::new(),
                    targets: Vec::new(),
                    starts: Some(Vec::new()),
                },
            ));
        }
        let start = row.inputs.len() as u32;
        let starts = row.starts.as_mut().expect("a packed row");
        starts.extend(std::iter::repeat_n(start, one.inputs.len()));
        row.inputs.extend(one.inputs);
        row.targets.extend(one.targets);
    }
    if !row.inputs.is_empty() {
        rows.push(row);
    }
    rows
}

/// The trained targets of a step's sequences, and how many batches they are cut into.
#[derive(Debug, Clone, Copy)]
struct StepTargets {
    step: usize,
    batches: usize,
    targets: usize,
}

/// Fine-tuning on examples: a [`CausalLm`] on padded batches of sequences (one example each,
/// or several packed).
pub struct InstructWorkload<M: CausalLm> {
    train: Vec<Sequence>,
    val: Vec<Sequence>,
    /// The training sequences' trained targets.
    targets: Vec<usize>,
    /// The steps [`Workload::sample`] drew lately: step, batches and their trained targets.
    steps: std::sync::Mutex<Vec<StepTargets>>,
    config: M::Config,
    seed: u64,
    pad: i64,
    mean_len: usize,
}

impl<M: CausalLm> InstructWorkload<M> {
    /// The workload of `train` and `val` for `config`; `pad` fills the rows of a batch past
    /// their sequences (no loss; causal attention never reaches it from a real position).
    pub fn new(
        train: Vec<Sequence>,
        val: Vec<Sequence>,
        config: M::Config,
        seed: u64,
        pad: i64,
    ) -> Self {
        let all: usize = train.iter().map(|s| s.inputs.len()).sum();
        Self {
            targets: train.iter().map(Sequence::trained).collect(),
            steps: std::sync::Mutex::new(Vec::new()),
            mean_len: all / train.len().max(1),
            train,
            val,
            config,
            seed,
            pad,
        }
    }

    /// The weight of a batch that trains `targets` in step `step`: its share of the step's
    /// trained targets times the step's batches, where [`Workload::sample`] drew the step.
    fn weight(&self, step: usize, targets: usize) -> Option<f32> {
        let steps = self.steps.lock().unwrap_or_else(|e| e.into_inner());
        let s = steps.iter().find(|s| s.step == step)?;
        Some((targets as f64 * s.batches as f64 / s.targets.max(1) as f64) as f32)
    }

    /// The batch of `rows`, padded on the right to the longest (padding: the pad id, no
    /// target, and in a batch of packed rows a document of its own).
    fn batch<'a>(&self, rows: impl Iterator<Item = &'a Sequence>, device: &Device) -> TokenBatch {
        let rows: Vec<&Sequence> = rows.collect();
        let n = rows.len();
        let t = rows
            .iter()
            .map(|s| s.inputs.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut inputs = vec![self.pad; n * t];
        let mut targets = vec![IGNORE; n * t];
        let packed = rows.iter().any(|s| s.starts.is_some());
        let mut starts = if packed {
            vec![0i64; n * t]
        } else {
            Vec::new()
        };
        let mut trained = 0;
        for (r, s) in rows.iter().enumerate() {
            let at = r * t;
            for (p, (&x, &y)) in s.inputs.iter().zip(&s.targets).enumerate() {
                inputs[at + p] = i64::from(x);
                targets[at + p] = y;
                trained += usize::from(y != IGNORE);
            }
            if packed {
                let len = s.inputs.len();
                for p in 0..t {
                    starts[at + p] = match &s.starts {
                        Some(st) if p < len => i64::from(st[p]),
                        // One example, or the padding after the row's sequence.
                        _ if p < len => 0,
                        _ => len as i64,
                    };
                }
            }
        }
        let mut batch = TokenBatch::new(
            Tensor::from_data(TensorData::new(inputs, [n, t]), device),
            Tensor::from_data(TensorData::new(targets, [n, t]), device),
        );
        batch.trained = Some(trained);
        if packed {
            batch.documents = Some(Tensor::from_data(TensorData::new(starts, [n, t]), device));
        }
        batch
    }
}

impl<M: CausalLm + 'static> Workload for InstructWorkload<M> {
    type Model = M;
    type Batch = TokenBatch;

    fn init_model(&self, device: &Device) -> M {
        M::init(&self.config, device)
    }

    fn train_len(&self) -> usize {
        self.train.len()
    }

    fn train_batch(&self, indices: &[usize], device: &Device) -> TokenBatch {
        self.batch(indices.iter().map(|&i| &self.train[i]), device)
    }

    /// The batch weighted by its share of the step's trained targets.
    fn train_batch_at(&self, indices: &[usize], step: usize, device: &Device) -> TokenBatch {
        let mut batch = self.train_batch(indices, device);
        batch.loss_weight = self.weight(step, batch.trained.unwrap_or(0));
        batch
    }

    fn eval_len(&self) -> usize {
        self.val.len()
    }

    fn eval_batch(&self, range: Range<usize>, device: &Device) -> TokenBatch {
        self.batch(self.val[range].iter(), device)
    }

    /// Token ids are integers: nothing to cast.
    fn cast_batch(&self, batch: TokenBatch, _dtype: burn::tensor::FloatDType) -> TokenBatch {
        batch
    }

    /// The step's sequences — the next `slots × batch` of an epoch's seeded shuffle, epoch
    /// after epoch — sorted by length, so that each slot's batch pads little; then this
    /// slot's part. A function of the step and the slot alone, so any split into devices and
    /// accumulation trains the same sequences.
    fn sample(&self, step: usize, slot: usize, slots: usize, batch: usize) -> Option<Vec<usize>> {
        let n = self.train.len();
        let total = slots * batch;
        let mut epoch_order: Option<(usize, Vec<usize>)> = None;
        let mut all: Vec<usize> = (0..total)
            .map(|j| {
                let p = step * total + j;
                let epoch = p / n;
                if epoch_order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    let seed = self.seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    epoch_order = Some((epoch, kiln_datasets::rng::permutation(n, seed)));
                }
                epoch_order.as_ref().expect("set").1[p % n]
            })
            .collect();
        all.sort_by_key(|&i| (self.train[i].inputs.len(), i));
        let targets = all.iter().map(|&i| self.targets[i]).sum();
        let mut steps = self.steps.lock().unwrap_or_else(|e| e.into_inner());
        if !steps.iter().any(|s| s.step == step) {
            if steps.len() == 64 {
                steps.remove(0);
            }
            steps.push(StepTargets {
                step,
                batches: slots,
                targets,
            });
        }
        Some(all[slot * batch..(slot + 1) * batch].to_vec())
    }

    fn flops_per_sample(&self) -> Option<f64> {
        let t = self.mean_len.max(1);
        Some(M::flops_per_token(&self.config, t) * t as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(ids: &[u32], trained: &[bool]) -> Encoded {
        Encoded {
            ids: ids.to_vec(),
            trained: trained.to_vec(),
        }
    }

    #[test]
    fn examples_pack_into_rows_of_the_context_each_from_its_own_start() {
        let a = example(&[1, 2, 3, 4], &[false, false, true, true]);
        let b = example(&[5, 6, 7], &[false, true, true]);
        let c = example(&[8, 9, 10, 11, 12, 13], &[false; 6]);
        let rows = pack(&[a.clone(), b, c], 6);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].inputs, [1, 2, 3, 5, 6]);
        assert_eq!(rows[0].targets, [IGNORE, 3, 4, 6, 7]);
        assert_eq!(rows[0].starts.as_deref(), Some(&[0, 0, 0, 3, 3][..]));
        assert_eq!(rows[1].inputs, [8, 9, 10, 11, 12]);
        assert_eq!(rows[1].starts.as_deref(), Some(&[0; 5][..]));
        assert_eq!(Sequence::of(&a).trained(), 2);
        // Longer than the context: a row of its own, cut to it.
        let rows = pack(&[a], 2);
        assert_eq!(rows[0].inputs, [1, 2]);
    }
}
