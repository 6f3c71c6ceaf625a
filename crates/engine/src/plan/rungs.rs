//! The micro-batches each probe key is measured at. A key (a strategy's step, a precision, a
//! recompute mode) is measured at the largest micro-batch of its candidates and at one at most
//! half of it, so that every prediction lies on the line through two measurements.
//!
//! A probe holds what a run at its micro-batch holds. Under a memory limit the largest
//! micro-batch is often the one that does not fit, and probing it would take the process past
//! the limit before any run was chosen. So the smallest is probed first, and a larger one only
//! where what is measured already predicts that its probe fits: the largest rung whose estimate
//! fits is probed, the line through the measured points is drawn again, and so on up. A key
//! whose largest rung is not probed is predicted from the rungs that were: above the highest,
//! no less than it in proportion to the micro-batch ([`Fit::at`]). Without a limit every key
//! is measured at its smallest and largest rung.

use std::collections::{BTreeMap, BTreeSet};

use super::candidates::Candidate;
use super::kept::{Entry, point_id};
use super::predict::{Fit, Prediction, add_step_bytes, fit_key};
use super::probe::{Point, ProbeSetup, probe};
use crate::comm::agreed;
use crate::config::HEADROOM;
use crate::error::Result;
use crate::trainer::{TrainerSettings, Workload};

/// Each probe key's micro-batches, ascending: its candidates' and, first, one at most half the
/// largest.
pub(crate) type Rungs = BTreeMap<String, Vec<usize>>;

/// What keeps the probes under a memory limit: the limit (bytes; `None`: no limit) and whether
/// the figure that must fit is the process's (the CPU) or a device's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guard {
    /// The limit.
    pub limit: Option<f64>,
    /// Whether the devices are the CPU's.
    pub cpu: bool,
}

/// The rungs of each key among `candidates`.
pub(crate) fn rungs<'a>(
    candidates: impl Iterator<Item = &'a (Candidate, TrainerSettings)>,
) -> Rungs {
    let mut out: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
    for (_, s) in candidates {
        out.entry(fit_key(s))
            .or_default()
            .insert(s.train.batch_size);
    }
    out.into_iter()
        .map(|(key, mut batches)| {
            let least = batches.first().copied().unwrap_or(1);
            let most = batches.last().copied().unwrap_or(1);
            batches.insert(least.min(most / 2).max(1));
            (key, batches.into_iter().collect())
        })
        .collect()
}

/// The name of the probe point of `settings`' key at `batch` (its ranks' shape included).
fn point_id_of(s: &TrainerSettings, batch: usize) -> String {
    let cuts = match &s.parallel.pipeline.cuts {
        Some(c) => format!(" cuts={c:?}"),
        None => String::new(),
    };
    point_id(
        &fit_key(s),
        batch,
        s.parallel.devices.len(),
        s.parallel.sub_replicas.max(1),
        &cuts,
    )
}

/// The point of `settings`' key at `batch`, kept (`known`) or measured now (`fresh`).
fn measured(known: &Entry, fresh: &Entry, s: &TrainerSettings, batch: usize) -> Option<Point> {
    let id = point_id_of(s, batch);
    known
        .points
        .get(&id)
        .or_else(|| fresh.points.get(&id))
        .copied()
}

/// Probes each key of `held` — with its first candidate's settings — at its smallest rung and
/// then up its rungs as far as `guard` allows ([`climb`]), where `known` lacks the point, into
/// `fresh`; `how`: the machine's cores when the devices are the CPU's, and whether the model
/// draws random numbers.
pub(crate) fn probed<W: Workload>(
    workload: &W,
    held: &[(Prediction, TrainerSettings)],
    rungs: &Rungs,
    known: &Entry,
    how: (Option<usize>, bool),
    guard: Guard,
    fresh: &mut Entry,
) -> Result<()> {
    crate::panics::quiet_worker_panics();
    let (cpu_cores, draws) = how;
    let mut keys = BTreeSet::new();
    let mut first = true;
    for (held, settings) in held {
        let key = fit_key(settings);
        if !keys.insert(key.clone()) {
            continue;
        }
        let mut at = |batch: usize, fresh: &mut Entry| -> Result<Point> {
            if let Some(p) = measured(known, fresh, settings, batch) {
                return Ok(p);
            }
            let setup = ProbeSetup {
                settings: probe_settings(settings, batch),
                cpu_cores,
                draws,
            };
            let point = probe(workload, &setup, batch, first)?;
            first = false;
            fresh.points.insert(point_id_of(settings, batch), point);
            Ok(point)
        };
        let rungs = &rungs[&key];
        let lo = at(rungs[0], fresh)?;
        let mut top = lo;
        loop {
            let have = |b: usize| measured(known, fresh, settings, b).is_some();
            let choose = || {
                climb(rungs, Fit { lo, hi: top }, &have, |fit, b| {
                    fits_at(held, settings, fit, b, guard)
                })
            };
            // Under a limit, process 0's choice on every process (the probes' collectives span
            // them all); without one the choice rests on the points alone, the same everywhere.
            let next: Option<usize> = match guard.limit {
                Some(_) => agreed(|| Ok(choose()))?,
                None => choose(),
            };
            match next {
                Some(b) => top = at(b, fresh)?,
                None => break,
            }
        }
    }
    Ok(())
}

/// The settings a probe of `settings`' key at `batch` runs: one micro-batch a step, and a
/// pipeline with one micro-batch per stage under 1F1B.
fn probe_settings(settings: &TrainerSettings, batch: usize) -> TrainerSettings {
    let mut s = settings.clone();
    s.train.batch_size = batch;
    s.train.accumulate = 1;
    s.parallel.pipeline.microbatches = s.parallel.pipeline.stages;
    s.parallel.pipeline.schedule = crate::config::PipelineSchedule::OneFOneB;
    s
}

/// The next rung above `fit.hi` to measure: the largest that is measured already (`have`) or
/// whose estimate from `fit` fits (`fits`); `None` when none is.
fn climb(
    rungs: &[usize],
    fit: Fit,
    have: &dyn Fn(usize) -> bool,
    fits: impl Fn(&Fit, usize) -> bool,
) -> Option<usize> {
    rungs
        .iter()
        .rev()
        .copied()
        .filter(|&b| b > fit.hi.batch)
        .find(|&b| have(b) || fits(&fit, b))
}

/// Whether the probe of the candidate `held` describes, at micro-batch `batch` with its
/// step's bytes read from `fit`, fits `guard`'s limit with the headroom a plan keeps.
fn fits_at(
    held: &Prediction,
    settings: &TrainerSettings,
    fit: &Fit,
    batch: usize,
    guard: Guard,
) -> bool {
    let Some(limit) = guard.limit else {
        return true;
    };
    let mut p = held.clone();
    add_step_bytes(
        &mut p,
        &probe_settings(settings, batch),
        fit,
        batch,
        guard.cpu,
    );
    p.need(guard.cpu) * (1.0 + HEADROOM) <= limit
}

/// Each probe key's line through its smallest rung's point and its highest measured one (kept
/// or `fresh`), for the keys of `held`.
pub(crate) fn fits(
    held: &[(Prediction, TrainerSettings)],
    rungs: &Rungs,
    fresh: &Entry,
    known: &Entry,
) -> BTreeMap<String, Fit> {
    // A point is measured now only where none was kept: the two never hold one name.
    let point = |s: &TrainerSettings, batch: usize| measured(known, fresh, s, batch);
    let mut fits = BTreeMap::new();
    for (_, s) in held {
        let key = fit_key(s);
        if fits.contains_key(&key) {
            continue;
        }
        let rungs = &rungs[&key];
        let lo = point(s, rungs[0]);
        let hi = rungs.iter().rev().find_map(|&b| point(s, b));
        if let (Some(lo), Some(hi)) = (lo, hi) {
            fits.insert(key, Fit { lo, hi });
        }
    }
    fits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(batch: usize, step_bytes: f64) -> Point {
        Point {
            batch,
            step_bytes,
            ..Point::default()
        }
    }

    /// Under a limit of 100 step bytes: from 4 (10 bytes) the proportional estimate puts 32 at
    /// 80 and 64 at 160, so 32 is the next rung; a rung measured already is taken whatever its
    /// estimate; from the line through 4 and 32 nothing above fits; without a limit the
    /// largest rung is next.
    #[test]
    fn the_climb_takes_the_largest_rung_that_fits_or_is_measured() {
        let rungs = [4, 8, 16, 32, 64];
        let under = |fit: &Fit, b: usize| fit.at(b, |p| p.step_bytes) <= 100.0;
        let none = |_: usize| false;
        let from_lo = Fit {
            lo: point(4, 10.0),
            hi: point(4, 10.0),
        };
        assert_eq!(climb(&rungs, from_lo, &none, under), Some(32));
        assert_eq!(climb(&rungs, from_lo, &|b| b == 64, under), Some(64));
        let steep = Fit {
            lo: point(4, 10.0),
            hi: point(32, 94.0),
        };
        assert_eq!(climb(&rungs, steep, &none, under), None);
        assert_eq!(climb(&rungs, steep, &none, |_, _| true), Some(64));
        let done = Fit {
            lo: point(4, 10.0),
            hi: point(64, 40.0),
        };
        assert_eq!(climb(&rungs, done, &none, |_, _| true), None);
    }
}
