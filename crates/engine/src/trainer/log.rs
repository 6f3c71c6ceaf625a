//! What the loop reports: the running sums of a logging window (kept on the device until a
//! line is due), the training and validation records with the metric names every rank agrees
//! on and their means over ranks, the progress display and the system monitor's samples.
//! Every rank takes part in the reductions; rank 0 alone writes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::StepOutput;
use serde_json::{Map, Value, json};

use crate::comm::{Collective, ReduceOp, pack};
use crate::error::{Error, Result};
use crate::metrics::{MetricsWriter, Progress, num, record};
use crate::monitor::{SystemMonitor, Throughput};
use crate::state::LoopState;
use crate::strategy::Strategy;

/// A validation's mean loss and, for a classifier, its accuracy.
pub(super) type Scores = (f64, Option<f64>);

/// Seconds of one phase of a step: building batches, forward and backward, collectives, the
/// optimizer's update.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Times {
    pub data: f64,
    pub compute: f64,
    pub sync: f64,
    pub optim: f64,
}

/// Running sums of a logging window, kept on the device until a log line needs them.
struct Window {
    /// Summed losses, one per parameter group (one for a model with one optimizer).
    loss: Vec<Option<Tensor<1>>>,
    /// Micro-batches whose loss this rank computed, per group.
    scored: Vec<usize>,
    /// Named metrics of the micro-batch outputs: their sum and how many were added.
    metrics: BTreeMap<String, (Tensor<1>, usize)>,
    steps: usize,
    samples: usize,
    /// Tokens the scored micro-batches' losses were the means over (the first group's), when
    /// their outputs count them.
    tokens: Option<f64>,
    started: Instant,
    /// Seconds of the window spent outside training (validation, checkpoints).
    excluded: f64,
    times: Times,
}

impl Window {
    fn new(phases: usize) -> Self {
        Self {
            loss: vec![None; phases],
            scored: vec![0; phases],
            metrics: BTreeMap::new(),
            steps: 0,
            samples: 0,
            tokens: None,
            started: Instant::now(),
            excluded: 0.0,
            times: Times::default(),
        }
    }
}

/// Where the loop's records go; see the module documentation.
pub(super) struct Logger<'a> {
    comm: &'a dyn Collective,
    /// The parameter groups' names (none for a model with one optimizer).
    groups: Vec<String>,
    /// Log every this many steps (and after the last).
    every: usize,
    window: Window,
    /// The learning rate of each phase of the latest step.
    lrs: Vec<f64>,
    /// Rank 0's sinks and display.
    writer: Option<MetricsWriter>,
    progress: Option<Progress>,
    throughput: Throughput,
    monitor: Option<&'a SystemMonitor>,
    /// Whether records count the steps skipped for a non-finite gradient.
    count_skips: bool,
    /// Naming stragglers (not under a pipeline, whose stages differ by design) with this margin.
    stragglers: Option<f64>,
    /// The rank that was slowest by the margin in the last windows: in how many in a row, and
    /// over how many steps.
    suspect: Option<(usize, usize, usize)>,
    /// Ranks already named as stragglers.
    named: Vec<usize>,
    /// Steps skipped for a non-finite gradient so far.
    pub skipped: usize,
    /// The training time per step of every logged window.
    pub step_times: Vec<f64>,
    /// The mean training loss of the last logged window.
    pub last_loss: Option<f64>,
}

/// What the logger is made of: rank 0's sinks and display, the throughput's arithmetic.
pub(super) struct LoggerParts<'a> {
    pub comm: &'a dyn Collective,
    pub groups: Vec<String>,
    pub every: usize,
    pub writer: Option<MetricsWriter>,
    pub progress: Option<Progress>,
    pub throughput: Throughput,
    pub monitor: Option<&'a SystemMonitor>,
    pub count_skips: bool,
    pub stragglers: Option<f64>,
}

impl<'a> Logger<'a> {
    pub fn new(parts: LoggerParts<'a>) -> Self {
        let phases = parts.groups.len().max(1);
        Self {
            comm: parts.comm,
            window: Window::new(phases),
            lrs: vec![0.0; phases],
            groups: parts.groups,
            every: parts.every,
            writer: parts.writer,
            progress: parts.progress,
            throughput: parts.throughput,
            monitor: parts.monitor,
            count_skips: parts.count_skips,
            stragglers: parts.stragglers,
            suspect: None,
            named: Vec::new(),
            skipped: 0,
            step_times: Vec::new(),
            last_loss: None,
        }
    }

    /// Adds what phase `phase` of a step did: its learning rate, its micro-batches' outputs
    /// and its times.
    pub fn add(&mut self, phase: usize, lr: f64, outs: &[StepOutput], times: Times) {
        let w = &mut self.window;
        self.lrs[phase] = lr;
        w.scored[phase] += outs.len();
        for out in outs {
            if let (0, Some(t)) = (phase, out.tokens) {
                w.tokens = Some(w.tokens.unwrap_or(0.0) + t as f64);
            }
            let l = out.loss.clone();
            w.loss[phase] = Some(match w.loss[phase].take() {
                Some(sum) => sum + l,
                None => l,
            });
            add_metrics(&mut w.metrics, &out.metrics, 1.0, 1);
        }
        w.times.data += times.data;
        w.times.compute += times.compute;
        w.times.sync += times.sync;
        w.times.optim += times.optim;
    }

    /// Counts a finished step of `samples` samples.
    pub fn step_done(&mut self, step: usize, samples: usize) {
        self.window.steps += 1;
        self.window.samples += samples;
        if let Some(m) = self.monitor {
            m.set_step(step);
        }
    }

    /// Whether a training line is due after `step`.
    pub fn due(&self, step: usize, last: bool) -> bool {
        step.is_multiple_of(self.every) || last
    }

    /// Leaves `seconds` (validation, checkpoints) out of the window's throughput.
    pub fn exclude(&mut self, seconds: f64) {
        self.window.excluded += seconds;
    }

    /// The training record of the window that ends at `state`'s step, with what `strategy`
    /// adds; every rank calls it. Returns the values a callback sees.
    pub fn log<M, B>(
        &mut self,
        state: &LoopState,
        strategy: &mut dyn Strategy<M, B>,
    ) -> Result<Vec<(String, f64)>> {
        let phases = self.lrs.len();
        let w = &mut self.window;
        let elapsed = w.started.elapsed().as_secs_f64() - w.excluded;
        // Every rank that scored micro-batches contributes their losses (a pipeline's last
        // stage alone scores them), per group.
        let mut stats: Vec<f32> = w
            .loss
            .iter_mut()
            .map(|l| l.take().map_or(0.0, |l| l.into_scalar::<f32>()))
            .collect();
        stats.extend(w.scored.iter().map(|n| *n as f32));
        // The tokens trained, and how many ranks counted any.
        stats.extend([
            w.tokens.unwrap_or(0.0) as f32,
            f32::from(u8::from(w.tokens.is_some())),
        ]);
        self.comm.all_reduce(&mut stats, ReduceOp::Sum)?;
        let tokens = (stats[2 * phases + 1] > 0.0).then(|| f64::from(stats[2 * phases]));
        let group_losses: Vec<f64> = (0..phases)
            .map(|g| f64::from(stats[g]) / f64::from(stats[phases + g]).max(1.0))
            .collect();
        // With several optimizers, `loss` is the sum of theirs.
        let loss: f64 = group_losses.iter().sum();
        let local = std::mem::take(&mut w.metrics);
        let names = agree_names(self.comm, &local.keys().cloned().collect())?;
        let mut named: Vec<(String, f64)> = self
            .groups
            .iter()
            .zip(&group_losses)
            .map(|(g, l)| (format!("loss_{g}"), *l))
            .collect();
        named.extend(mean_metrics(self.comm, &names, local)?);
        let (compute, window_steps) = (w.times.compute / w.steps as f64, w.steps);
        let skew = self.skew(compute, window_steps)?;
        let report = strategy.report()?;
        self.last_loss = Some(loss);
        let w = &self.window;
        let rate = w.samples as f64 / elapsed.max(1e-9);
        let t = w.times;
        let per = |x: f64| x / w.steps as f64;
        self.step_times
            .push(per(t.data + t.compute + t.sync + t.optim));
        let (step, epoch, lr) = (state.step, state.epoch, self.lrs[0]);
        let mut rates = String::new();
        if let Some(m) = self.writer.as_mut() {
            let mut r = record(&[
                ("step", json!(step)),
                ("epoch", json!(epoch)),
                ("split", json!("train")),
                ("loss", num(loss)),
                ("lr", num(lr)),
                ("samples_per_sec", num(rate)),
                ("time_data", num(per(t.data))),
                ("time_compute", num(per(t.compute))),
                ("time_sync", num(per(t.sync))),
                ("time_optim", num(per(t.optim))),
            ]);
            let times = [t.data, t.compute, t.sync, t.optim];
            let token_rate = tokens.map(|t| t / elapsed.max(1e-9));
            rates = self.throughput.annotate(&mut r, rate, token_rate, times);
            if let Some(sc) = &state.scaler {
                r.insert("loss_scale".into(), num(sc.scale));
                r.insert("skipped_steps".into(), json!(sc.skipped));
            }
            if self.count_skips {
                r.insert("nonfinite_skipped".into(), json!(self.skipped));
            }
            for (g, lr) in self.groups.iter().zip(&self.lrs) {
                r.insert(format!("lr_{g}"), num(*lr));
            }
            if let Some((slowest, skew)) = skew {
                r.insert("slowest_rank".into(), json!(slowest));
                r.insert("rank_skew".into(), num(skew));
            }
            put_metrics(&mut r, &named)?;
            for (key, value) in report.fields {
                r.insert(key, value);
            }
            m.write(&r);
            for mut extra in report.records {
                extra.insert("step".into(), json!(step));
                m.write(&extra);
            }
            for sample in self.monitor.map(SystemMonitor::drain).unwrap_or_default() {
                m.write(&sample);
            }
        }
        if let Some(p) = &self.progress {
            let devices = self
                .monitor
                .and_then(|m| m.latest())
                .map(|s| s.summary_line());
            p.update(
                step,
                &format!("epoch {epoch} loss {loss:.4} lr {lr:.2e} {rates}"),
                devices.as_deref(),
            );
        }
        self.window = Window::new(phases);
        let mut logged = vec![
            ("loss".to_string(), loss),
            ("lr".to_string(), lr),
            ("samples_per_sec".to_string(), rate),
        ];
        logged.extend(named);
        Ok(logged)
    }

    /// The slowest rank by compute time per step in this window of `steps` steps (`compute`,
    /// this rank's) and its time over the median rank's; a rank slowest by the margin in three
    /// windows and ten steps in a row is named once.
    fn skew(&mut self, compute: f64, steps: usize) -> Result<Option<(usize, f64)>> {
        if self.comm.world_size() == 1 {
            return Ok(None);
        }
        let all = self.comm.all_gather(&[compute as f32])?;
        let mut sorted: Vec<f64> = all.iter().map(|c| f64::from(*c)).collect();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[(sorted.len() - 1) / 2].max(1e-12);
        let (slowest, time) =
            all.iter().enumerate().fold(
                (0, f32::MIN),
                |best, (r, c)| if *c > best.1 { (r, *c) } else { best },
            );
        let skew = f64::from(time) / median;
        let Some(margin) = self.stragglers else {
            return Ok(Some((slowest, skew)));
        };
        self.suspect = if skew > 1.0 + margin {
            match self.suspect {
                Some((r, n, s)) if r == slowest => Some((r, n + 1, s + steps)),
                _ => Some((slowest, 1, steps)),
            }
        } else {
            None
        };
        if let Some((r, n, s)) = self.suspect
            && n >= 3
            && s >= 10
            && !self.named.contains(&r)
        {
            self.named.push(r);
            let line = format!(
                "straggler: rank {r}'s compute per step ran {skew:.2}× the median rank's in {n} \
                 log windows ({s} steps) in a row (dist.straggler_margin = {margin})"
            );
            match (&self.progress, self.writer.is_some()) {
                (Some(p), _) => p.println(&line),
                (None, true) => eprintln!("warning: {line}"),
                (None, false) => {}
            }
        }
        Ok(Some((slowest, skew)))
    }

    /// The validation record after `state`'s step, and its line.
    pub fn validation(
        &mut self,
        state: &LoopState,
        scores: Scores,
        metrics: &[(String, f64)],
    ) -> Result<()> {
        let (step, epoch) = (state.step, state.epoch);
        if let Some(m) = self.writer.as_mut() {
            let mut r = record(&[
                ("step", json!(step)),
                ("epoch", json!(epoch)),
                ("split", json!("val")),
                ("loss", num(scores.0)),
            ]);
            if let Some(acc) = scores.1 {
                r.insert("accuracy".into(), num(acc));
            }
            put_metrics(&mut r, metrics)?;
            m.write(&r);
        }
        if let Some(p) = &self.progress {
            let acc = scores
                .1
                .map_or(String::new(), |a| format!(" accuracy {:.2}%", a * 100.0));
            p.println(&format!(
                "step {step} epoch {epoch}: val loss {:.4}{acc}",
                scores.0
            ));
        }
        Ok(())
    }

    /// Ends the display and writes the system monitor's last samples.
    pub fn finish(&mut self) {
        if let Some(p) = &self.progress {
            p.finish();
        }
        if let (Some(mon), Some(m)) = (self.monitor, self.writer.as_mut()) {
            mon.stop();
            for sample in mon.drain() {
                m.write(&sample);
            }
        }
    }
}

/// Adds `metrics`, each weighted by `weight`, into the running sums `into`, counting `count`
/// for each (1 per micro-batch in training, its samples in validation).
pub(super) fn add_metrics(
    into: &mut BTreeMap<String, (Tensor<1>, usize)>,
    metrics: &[(String, Tensor<1>)],
    weight: f32,
    count: usize,
) {
    for (name, value) in metrics {
        let value = value.clone().cast(FloatDType::F32).mul_scalar(weight);
        match into.get_mut(name) {
            Some((sum, n)) => {
                *sum = sum.clone() + value;
                *n += count;
            }
            None => {
                into.insert(name.clone(), (value, count));
            }
        }
    }
}

/// The names every rank knows, sorted: the union of each rank's `mine` (ranks that score no
/// micro-batch, like a pipeline's first stage, know none).
pub(super) fn agree_names(comm: &dyn Collective, mine: &BTreeSet<String>) -> Result<Vec<String>> {
    let text = mine.iter().cloned().collect::<Vec<_>>().join("\n");
    let mut names = BTreeSet::new();
    for theirs in pack::gather_text(comm, &text)? {
        names.extend(
            theirs
                .split('\n')
                .filter(|n| !n.is_empty())
                .map(str::to_string),
        );
    }
    Ok(names.into_iter().collect())
}

/// The mean of each of `names` over every rank's sums `local` (value, count), in `names`'
/// order; a name no rank reported is left out.
pub(super) fn mean_metrics(
    comm: &dyn Collective,
    names: &[String],
    local: BTreeMap<String, (Tensor<1>, usize)>,
) -> Result<Vec<(String, f64)>> {
    let mut stats = Vec::with_capacity(names.len() * 2);
    for name in names {
        match local.get(name) {
            Some((sum, n)) => {
                stats.push(sum.clone().into_scalar::<f32>());
                stats.push(*n as f32);
            }
            None => stats.extend([0.0, 0.0]),
        }
    }
    if !stats.is_empty() && comm.world_size() > 1 {
        comm.all_reduce(&mut stats, ReduceOp::Sum)?;
    }
    Ok(names
        .iter()
        .zip(stats.chunks(2))
        .filter(|(_, s)| s[1] > 0.0)
        .map(|(name, s)| (name.clone(), f64::from(s[0]) / f64::from(s[1])))
        .collect())
}

/// Adds the named metrics to `record` and lists their names under `metrics`; a name that is
/// one of kiln's own fields is an error.
fn put_metrics(record: &mut Map<String, Value>, metrics: &[(String, f64)]) -> Result<()> {
    if metrics.is_empty() {
        return Ok(());
    }
    for (name, value) in metrics {
        if record.contains_key(name) || name == "metrics" {
            return Err(Error::Training(format!(
                "the step's metric {name:?} has the name of one of kiln's own fields; rename it"
            )));
        }
        record.insert(name.clone(), num(*value));
    }
    record.insert(
        "metrics".into(),
        json!(metrics.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()),
    );
    Ok(())
}
