//! Validation: when it is due, and the scores over the whole evaluation set, each sample
//! counted once across ranks, in the precision the ranks train in.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::TrainStep;

use super::Workload;
use super::log::{Scores, add_metrics, agree_names, mean_metrics};
use super::worker::Worker;
use crate::checkpoint::LoopState;
use crate::comm::ReduceOp;
use crate::config::TrainConfig;
use crate::data::eval_shard;
use crate::error::Result;

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

impl<W: Workload> Worker<'_, W> {
    /// Mean loss and accuracy over the whole evaluation set, each sample counted once, in the
    /// precision the ranks train in; and the means of the step's named metrics.
    pub(super) fn validate(&self, model: &W::Model) -> Result<(Scores, Vec<(String, f64)>)> {
        let eval_device = self.device.clone().without_autodiff();
        let policy = &self.policy;
        let model = policy.eval_model(model).valid();
        let range = eval_shard(self.workload.eval_len(), self.world(), self.rank());
        let bs = self.settings.train.batch_size;
        let mut loss_sum: Option<Tensor<1>> = None;
        let mut correct: Option<Tensor<1, Int>> = None;
        let mut named = BTreeMap::new();
        let mut start = range.start;
        while start < range.end {
            let end = (start + bs).min(range.end);
            let batch = self.workload.eval_batch(start..end, &eval_device);
            let batch = policy.cast_batch(batch, |b, d| self.workload.cast_batch(b, d));
            let out = model.step(batch);
            let weighted = out
                .loss
                .cast(FloatDType::F32)
                .mul_scalar(out.samples as f32);
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
            start = end;
        }
        let mut stats = vec![
            loss_sum.map_or(0.0, |l| l.into_scalar::<f32>()),
            correct
                .as_ref()
                .map_or(0.0, |c| c.clone().into_scalar::<i64>() as f32),
            range.len() as f32,
            f32::from(u8::from(correct.is_some() || range.is_empty())),
        ];
        self.comm.all_reduce(&mut stats, ReduceOp::Sum)?;
        let n = f64::from(stats[2]).max(1.0);
        let has_accuracy = stats[3] as usize == self.world();
        let names = agree_names(self.comm.as_ref(), &named.keys().cloned().collect())?;
        let metrics = mean_metrics(self.comm.as_ref(), &names, named)?;
        let scores = (
            f64::from(stats[0]) / n,
            has_accuracy.then(|| f64::from(stats[1]) / n),
        );
        Ok((scores, metrics))
    }
}
