//! A validation metric watched for improvement: early stopping (`train.early_stopping`) and
//! reduce-on-plateau schedules (`schedule.kind = "plateau"`). Every rank sees the same
//! validation values (they are reduced over the ranks), so every rank takes the same decision
//! at the same step; the watches' state is part of the loop state, in every checkpoint.

use super::log::Scores;
use crate::config::MetricWatch;
use crate::error::{Error, Result};
#[cfg(test)]
use crate::state::Plateau;

/// The value of the watched metric among a validation's scores and named metrics; `key` is
/// where the watch is configured, for the error naming a metric the run does not log.
pub fn value(w: &MetricWatch, key: &str, scores: Scores, named: &[(String, f64)]) -> Result<f64> {
    let name = &w.metric["val_".len()..];
    let found = match name {
        "loss" => Some(scores.0),
        "accuracy" => scores.1,
        _ => named.iter().find(|(n, _)| n == name).map(|(_, v)| *v),
    };
    found.ok_or_else(|| {
        let mut logged = vec!["val_loss".to_string()];
        if scores.1.is_some() {
            logged.push("val_accuracy".into());
        }
        logged.extend(named.iter().map(|(n, _)| format!("val_{n}")));
        Error::config(format!(
            "key `{key}.metric`: this run's validation does not log {:?} (it logs {})",
            w.metric,
            logged.join(", ")
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MetricMode;

    #[test]
    fn a_watch_acts_after_patience_validations_without_improvement() {
        let w = MetricWatch {
            patience: 2,
            min_delta: 0.1,
            ..MetricWatch::default()
        };
        let mut p = Plateau::default();
        assert!(!p.observe(&w, 1.0, 10));
        assert!(
            !p.observe(&w, 0.95, 20),
            "not better by more than min_delta"
        );
        assert!(!p.observe(&w, 0.7, 30));
        assert_eq!(p.best, Some((0.7, 30)));
        assert!(!p.observe(&w, f64::NAN, 40));
        assert!(p.observe(&w, 0.65, 50));
        assert_eq!((p.acted, p.bad), (1, 0));
        let max = MetricWatch {
            metric: "val_accuracy".into(),
            mode: MetricMode::Auto,
            ..w
        };
        assert!(max.maximize());
        let mut p = Plateau::default();
        assert!(!p.observe(&max, 0.5, 1));
        assert!(!p.observe(&max, 0.7, 2));
        assert_eq!(p.best, Some((0.7, 2)));
        let named = [("r2".to_string(), 0.25)];
        let r2 = MetricWatch {
            metric: "val_r2".into(),
            ..MetricWatch::default()
        };
        assert_eq!(value(&r2, "k", (1.0, None), &named).unwrap(), 0.25);
        let e = value(&max, "train.early_stopping", (1.0, None), &named).unwrap_err();
        assert!(e.to_string().contains("it logs val_loss, val_r2"), "{e}");
    }
}
