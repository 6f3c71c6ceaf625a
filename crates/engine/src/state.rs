//! The loop's position: where a run stands ([`LoopState`]) and the watches it carries
//! ([`Plateau`]). The checkpointer saves it whole and the loop advances it; a leaf both may use.

use serde::{Deserialize, Serialize};

use crate::config::MetricWatch;
use crate::precision::LossScaler;

/// Where the loop stood when a checkpoint was taken: enough to continue bit for bit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// Optimizer steps taken so far.
    pub step: usize,
    /// Epoch the next step belongs to.
    pub epoch: usize,
    /// Steps of that epoch already taken (the data-order position).
    pub step_in_epoch: usize,
    /// Seed of the run (the data order is a function of seed and epoch).
    pub seed: u64,
    /// Number of replicas that trained up to here.
    pub world_size: usize,
    /// Samples per optimizer step over all replicas (batch × devices × accumulation); a run
    /// continues the same data order only with the same value.
    pub samples_per_step: usize,
    /// Learning rate of the last step (the schedule is a function of `step`).
    pub lr: f64,
    /// Samples seen so far.
    pub samples: u64,
    /// Seconds of training so far.
    pub wall_seconds: f64,
    /// The loss scaler's state (`16-mixed`), absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaler: Option<LossScaler>,
    /// Early stopping's watch of its metric (`train.early_stopping`), absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early: Option<Plateau>,
    /// Each parameter group's reduce-on-plateau watch (one for a model with one optimizer;
    /// a schedule of another kind keeps an unused one); empty when no schedule watches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plateaus: Vec<Plateau>,
}

/// What a watch has seen.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Plateau {
    /// The best value so far, and the step it was seen at.
    pub best: Option<(f64, usize)>,
    /// Validations in a row since the last improvement.
    pub bad: usize,
    /// Times the watch has acted (a reduce-on-plateau schedule: the rate's reductions).
    pub acted: u32,
}

impl Plateau {
    /// Records `value`, seen at `step`; returns whether `w.patience` validations in a row
    /// have now passed without an improvement (the count then starts again). A NaN never
    /// improves.
    pub fn observe(&mut self, w: &MetricWatch, value: f64, step: usize) -> bool {
        let improved = match self.best {
            None => !value.is_nan(),
            Some((best, _)) if w.maximize() => value > best + w.min_delta,
            Some((best, _)) => value < best - w.min_delta,
        };
        if improved {
            self.best = Some((value, step));
            self.bad = 0;
            return false;
        }
        self.bad += 1;
        if self.bad < w.patience {
            return false;
        }
        self.bad = 0;
        self.acted += 1;
        true
    }

    /// Why a watch acted: the metric, how long it has not improved, and its best.
    pub fn reason(&self, w: &MetricWatch) -> String {
        let best = self.best.map_or("no finite value".to_string(), |(v, s)| {
            format!("best {v:.6} at step {s}")
        });
        format!(
            "{} has not improved by more than {} for {} validation{} ({best})",
            w.metric,
            w.min_delta,
            w.patience,
            if w.patience == 1 { "" } else { "s" }
        )
    }
}
