//! Validation: when it is due, and the scores over the whole evaluation set, each sample
//! counted once across ranks, in the precision the ranks train in.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::{Combine, SetMetric, TrainStep};

use super::log::{Scores, add_metrics, agree_names, mean_metrics};
use super::workload::Workload;
use crate::comm::{Collective, ReduceOp, pack};
use crate::config::TrainConfig;
use crate::data::eval_shard;
use crate::error::{Error, Result};
use crate::precision::Policy;
use crate::state::LoopState;

/// When the loop validates, and what it found last.
#[derive(Debug, Default)]
pub(super) struct Validator {
    /// The latest scores.
    pub last: Option<Scores>,
    /// The step they were taken at.
    pub at: Option<usize>,
}

impl Validator {
    /// Whether validation is due after `state`'s step: at every epoch's end, every
    /// `train.val_every` steps, after the last step, and at every checkpoint that is scored
    /// (`scored`, with `train.best_metric`).
    pub fn due(
        &self,
        state: &LoopState,
        t: &TrainConfig,
        epoch_end: bool,
        last: bool,
        scored: bool,
    ) -> bool {
        let periodic = t.val_every.is_some_and(|n| state.step.is_multiple_of(n));
        epoch_end || periodic || last || scored
    }

    /// Records the scores of `step`.
    pub fn record(&mut self, step: usize, scores: Scores) {
        self.last = Some(scores);
        self.at = Some(step);
    }

    /// The value of `metric` (`val_loss` or `val_accuracy`) if validation ran at `step`.
    pub fn score(&self, metric: &str, step: usize) -> Option<f64> {
        let v = self.last.filter(|_| self.at == Some(step))?;
        if metric == "val_accuracy" {
            v.1
        } else {
            Some(v.0)
        }
    }
}

/// Mean loss and accuracy over the whole evaluation set of `workload`, each sample counted
/// once, on this rank's shard of it (`comm`'s rank), batches of `batch_size` on `device`, in
/// the precision `policy` trains in; the means of the step's named metrics, then its metrics
/// over the whole set.
pub(super) fn validate<W: Workload>(
    workload: &W,
    model: &W::Model,
    policy: &Policy,
    comm: &dyn Collective,
    device: &Device,
    batch_size: usize,
) -> Result<(Scores, Vec<(String, f64)>)> {
    {
        let eval_device = device.clone().without_autodiff();
        let model = policy.eval_model(model).valid();
        let range = eval_shard(workload.eval_len(), comm.world_size(), comm.rank());
        let bs = batch_size;
        let mut loss_sum: Option<Tensor<1>> = None;
        let mut correct: Option<Tensor<1, Int>> = None;
        let mut named = BTreeMap::new();
        let mut sets = SetParts::default();
        // The loss is a mean over what the batches' losses are means over: their tokens where
        // they count them (a language model's trained targets), else their samples.
        let mut weights = 0.0f64;
        let mut start = range.start;
        while start < range.end {
            let end = (start + bs).min(range.end);
            let batch = workload.try_eval_batch(start..end, &eval_device)?;
            let batch = policy.cast_batch(batch, |b, d| workload.cast_batch(b, d));
            let out = model.step(batch);
            let weight = out.tokens.unwrap_or(out.samples) as f32;
            weights += f64::from(weight);
            let weighted = out.loss.cast(FloatDType::F32).mul_scalar(weight);
            loss_sum = Some(match loss_sum {
                Some(l) => l + weighted,
                None => weighted,
            });
            if let Some(c) = out.correct {
                correct = Some(match correct {
                    Some(acc) => acc + c,
                    None => c,
                });
            }
            // Weighted by samples, then counted in samples: a mean over the set.
            add_metrics(&mut named, &out.metrics, out.samples as f32, out.samples);
            sets.add(out.set_metrics)?;
            start = end;
        }
        let mut stats = vec![
            loss_sum.map_or(0.0, |l| l.into_scalar::<f32>()),
            correct
                .as_ref()
                .map_or(0.0, |c| c.clone().into_scalar::<i64>() as f32),
            range.len() as f32,
            f32::from(u8::from(correct.is_some() || range.is_empty())),
            weights as f32,
        ];
        comm.all_reduce(&mut stats, ReduceOp::Sum)?;
        let n = f64::from(stats[2]).max(1.0);
        let has_accuracy = stats[3] as usize == comm.world_size();
        let names = agree_names(comm, &named.keys().cloned().collect())?;
        let mut metrics = mean_metrics(comm, &names, named)?;
        metrics.extend(sets.finish(comm)?);
        let scores = (
            f64::from(stats[0]) / f64::from(stats[4]).max(1.0),
            has_accuracy.then(|| f64::from(stats[1]) / n),
        );
        Ok((scores, metrics))
    }
}

/// The parts of the whole-set metrics ([`SetMetric`]) of this rank's validation batches,
/// combined as they arrive: sums in f64, gathered rows in sample order.
#[derive(Default)]
struct SetParts {
    /// Per metric, in the order the first batch gave them: its spec and its combined part.
    metrics: Vec<(SetMetric, Vec<f64>)>,
}

impl SetParts {
    /// Adds one batch's parts (read to the host: validation is not the hot loop).
    fn add(&mut self, parts: Vec<SetMetric>) -> Result<()> {
        for m in parts {
            let [_, width] = m.part.dims();
            let values: Vec<f64> = m
                .part
                .clone()
                .into_data()
                .convert::<f64>()
                .try_into_vec()
                .map_err(|e| Error::Worker(format!("set metric {}: {e:?}", m.name)))?;
            let at = match self.metrics.iter().position(|(s, _)| s.name == m.name) {
                Some(at) => at,
                None => {
                    let start = match m.combine {
                        Combine::Sum => vec![0.0; width],
                        Combine::Gather => Vec::new(),
                    };
                    self.metrics.push((m.clone(), start));
                    self.metrics.len() - 1
                }
            };
            let (spec, combined) = &mut self.metrics[at];
            if spec.part.dims()[1] != width || spec.combine != m.combine {
                return Err(Error::Worker(format!(
                    "set metric {}: its parts changed shape or combination between batches \
                     (width {} then {width})",
                    m.name,
                    spec.part.dims()[1]
                )));
            }
            match m.combine {
                Combine::Sum => {
                    for row in values.chunks(width) {
                        for (c, v) in combined.iter_mut().zip(row) {
                            *c += v;
                        }
                    }
                }
                Combine::Gather => combined.extend(values),
            }
        }
        Ok(())
    }

    /// Every metric's value over the whole set: the ranks' parts combined in rank order
    /// (which is sample order), computed by the metric's `finish`. Rank 0's list of metrics
    /// (its shard is never empty) is the run's; a rank without validation samples takes part
    /// with empty parts, and every rank returns rank 0's values.
    fn finish(self, comm: &dyn Collective) -> Result<Vec<(String, f64)>> {
        let spec = |m: &SetMetric| {
            let combine = match m.combine {
                Combine::Sum => "sum",
                Combine::Gather => "gather",
            };
            format!("{}\u{1f}{combine}\u{1f}{}", m.name, m.part.dims()[1])
        };
        let mine: Vec<String> = self.metrics.iter().map(|(m, _)| spec(m)).collect();
        let all = pack::gather_text(comm, &mine.join("\u{1e}"))?;
        let lead: Vec<&str> = all[0].split('\u{1e}').filter(|s| !s.is_empty()).collect();
        if lead.is_empty() {
            return Ok(Vec::new());
        }
        if !mine.is_empty() && mine.iter().map(String::as_str).ne(lead.iter().copied()) {
            return Err(Error::Worker(format!(
                "rank {} gives other whole-set metrics than rank 0 ({} vs {})",
                comm.rank(),
                mine.join(", ").replace('\u{1f}', " "),
                lead.join(", ").replace('\u{1f}', " ")
            )));
        }
        let mut values = Vec::with_capacity(lead.len());
        let mut names = Vec::with_capacity(lead.len());
        for (i, text) in lead.iter().enumerate() {
            let mut fields = text.split('\u{1f}');
            let name = fields.next().unwrap_or_default().to_string();
            let gather = fields.next() == Some("gather");
            let width: usize = fields.next().and_then(|w| w.parse().ok()).unwrap_or(1);
            let own = self.metrics.get(i);
            let combined: Vec<f64> = if gather {
                let rows: Vec<f32> =
                    own.map_or(Vec::new(), |(_, c)| c.iter().map(|&v| v as f32).collect());
                pack::gather_ragged(comm, &rows)?
                    .into_iter()
                    .flatten()
                    .map(f64::from)
                    .collect()
            } else {
                let sums = own.map_or(vec![0.0; width], |(_, c)| c.clone());
                let bits: Vec<u64> = sums.iter().map(|v| v.to_bits()).collect();
                let mut total = vec![0.0; width];
                for rank in pack::gather_counts(comm, &bits)? {
                    for (t, b) in total.iter_mut().zip(rank) {
                        *t += f64::from_bits(b);
                    }
                }
                total
            };
            let value = own.map_or(f64::NAN, |(m, _)| (m.finish)(&combined, width));
            values.push(value.to_bits());
            names.push(name);
        }
        // Every rank reports rank 0's values (a rank without samples cannot compute them).
        let lead_values = pack::gather_counts(comm, &values)?.swap_remove(0);
        Ok(names
            .into_iter()
            .zip(lead_values)
            .map(|(n, v)| (n, f64::from_bits(v)))
            .collect())
    }
}
