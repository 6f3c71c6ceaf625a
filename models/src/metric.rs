//! Validation metrics over the whole set, not means of batch means: R², AUC, a median error.
//!
//! A batch gives its *part* of such a metric, a `[rows, width]` tensor; the trainer combines
//! the parts of every batch and every rank — adding them up ([`Combine::Sum`]: sums, counts)
//! or concatenating every sample's row in sample order ([`Combine::Gather`]: predictions) —
//! and only then computes the value with the metric's `finish`. The value is therefore the
//! same whatever the batch size and the device count.

use burn::prelude::*;
use burn::tensor::FloatDType;

/// How the parts of a [`SetMetric`] from every batch and every rank combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    /// Added up element by element; each part is one row.
    Sum,
    /// Concatenated: every sample's row, in sample order.
    Gather,
}

/// A validation metric computed once over the whole validation set.
#[derive(Debug, Clone)]
pub struct SetMetric {
    /// The metric's name (logged as `NAME` in validation records; `val_NAME` for early
    /// stopping and reduce-on-plateau).
    pub name: String,
    /// This batch's part, `[rows, width]` (one row for [`Combine::Sum`]).
    pub part: Tensor<2>,
    /// How parts combine.
    pub combine: Combine,
    /// The value from the combined parts (row after row) and the width.
    pub finish: fn(&[f64], usize) -> f64,
}

impl SetMetric {
    /// A metric of one's own: `part` of this batch, combined as `combine`, computed by
    /// `finish`.
    pub fn new(
        name: impl Into<String>,
        part: Tensor<2>,
        combine: Combine,
        finish: fn(&[f64], usize) -> f64,
    ) -> Self {
        Self {
            name: name.into(),
            part: part.cast(FloatDType::F32),
            combine,
            finish,
        }
    }

    /// R² of `predictions` against `targets` (both `[n]`): 1 − Σ(y − ŷ)² / Σ(y − ȳ)², from
    /// the sums n, Σy, Σy² and Σ(y − ŷ)² of the whole set.
    pub fn r2(name: impl Into<String>, predictions: Tensor<1>, targets: Tensor<1>) -> Self {
        let y = targets.cast(FloatDType::F32);
        let p = predictions.cast(FloatDType::F32);
        let device = y.device();
        let n = Tensor::<1>::from_floats([y.dims()[0] as f32], &device);
        let sums = Tensor::cat(
            vec![
                n,
                y.clone().sum(),
                y.clone().powi_scalar(2).sum(),
                (y - p).powi_scalar(2).sum(),
            ],
            0,
        );
        Self::new(name, sums.reshape([1, 4]), Combine::Sum, r2_of_sums)
    }

    /// The area under the ROC curve of `scores` for binary `labels` (both `[n]`; a label
    /// above 0.5 is a positive): the probability that a positive scores above a negative,
    /// ties counting one half, from every sample's (score, label).
    pub fn auc(name: impl Into<String>, scores: Tensor<1>, labels: Tensor<1>) -> Self {
        let rows = Tensor::stack::<2>(
            vec![scores.cast(FloatDType::F32), labels.cast(FloatDType::F32)],
            1,
        );
        Self::new(name, rows, Combine::Gather, auc_of_rows)
    }
}

/// R² from the sums n, Σy, Σy², Σ(y − ŷ)² (NaN when the targets do not vary).
pub fn r2_of_sums(sums: &[f64], _width: usize) -> f64 {
    let (n, sy, syy, sse) = (sums[0], sums[1], sums[2], sums[3]);
    let total = syy - sy * sy / n;
    if total > 0.0 {
        1.0 - sse / total
    } else {
        f64::NAN
    }
}

/// AUC from rows (score, label): the Mann–Whitney statistic with tied scores given their mean
/// rank (NaN without both classes).
pub fn auc_of_rows(rows: &[f64], width: usize) -> f64 {
    let mut pairs: Vec<(f64, bool)> = rows.chunks(width).map(|r| (r[0], r[1] > 0.5)).collect();
    pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut rank_sum, mut positives) = (0.0, 0.0);
    let mut i = 0;
    while i < pairs.len() {
        let mut j = i;
        while j < pairs.len() && pairs[j].0 == pairs[i].0 {
            j += 1;
        }
        // Ranks i+1 ..= j share their mean.
        let rank = (i + 1 + j) as f64 / 2.0;
        for p in &pairs[i..j] {
            if p.1 {
                rank_sum += rank;
                positives += 1.0;
            }
        }
        i = j;
    }
    let negatives = pairs.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return f64::NAN;
    }
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r2_and_auc_follow_their_definitions() {
        // y = [1, 2, 3, 4], ŷ = [1, 2, 3, 3]: SSE 1, SST 5.
        let sums = [4.0, 10.0, 30.0, 1.0];
        assert!((r2_of_sums(&sums, 4) - 0.8).abs() < 1e-12);
        assert!(r2_of_sums(&[2.0, 2.0, 2.0, 0.0], 4).is_nan());
        // Scores 0.1 (neg), 0.4 (pos), 0.35 (neg), 0.8 (pos): every positive above every negative.
        let rows = [0.1, 0.0, 0.4, 1.0, 0.35, 0.0, 0.8, 1.0];
        assert!((auc_of_rows(&rows, 2) - 1.0).abs() < 1e-12);
        // A negative at 0.5 above the positive at 0.4: 3 of 4 pairs ordered.
        let rows = [0.1, 0.0, 0.4, 1.0, 0.5, 0.0, 0.8, 1.0];
        assert!((auc_of_rows(&rows, 2) - 0.75).abs() < 1e-12);
        // A tie between a positive and a negative counts one half.
        let rows = [0.5, 0.0, 0.5, 1.0];
        assert!((auc_of_rows(&rows, 2) - 0.5).abs() < 1e-12);
        let device = Device::flex();
        let m = SetMetric::r2(
            "r2",
            Tensor::from_floats([1.0, 2.0, 3.0, 3.0], &device),
            Tensor::from_floats([1.0, 2.0, 3.0, 4.0], &device),
        );
        assert_eq!(m.part.dims(), [1, 4]);
        let values: Vec<f32> = m.part.into_data().convert::<f32>().try_into_vec().unwrap();
        assert_eq!(values, [4.0, 10.0, 30.0, 1.0]);
    }
}
