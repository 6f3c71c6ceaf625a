//! One rank's loop: steps, accumulation, logging, validation, checkpoints. It talks to its
//! [`Strategy`] and its [`Collective`] through their traits only.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::{StepOutput, TrainStep};
use serde_json::json;

use super::{Start, TrainerSettings, Workload};
use crate::checkpoint::{self, LoopState};
use crate::comm::{Collective, ReduceOp};
use crate::config::{RecomputeMode, name_of};
use crate::data::{DistributedSampler, eval_shard};
use crate::error::{Error, Result};
use crate::metrics::{MetricsWriter, Progress, Summary, num, record};
use crate::monitor::{SystemMonitor, Throughput, peak_tflops};
use crate::optim::{Schedule, scaled_lr};
use crate::precision::{cast_params, compute_dtype, is_mixed, is_true_low};
use crate::strategy::{self, Context, Memory, Strategy};

const ABORTED: &str = "stopped because ";

/// What a rank hands back: on the first rank of each process, the summary and the final model.
struct Outcome<M> {
    lead: Option<(Summary, M)>,
}

/// Whether `e` is a rank's report that another rank aborted the group.
fn is_abort_echo(e: &Error) -> bool {
    matches!(e, Error::Worker(m) if m.starts_with(ABORTED))
}

/// Starts one worker thread per rank of `comms`, waits for all of them and returns rank 0's
/// summary (with every rank's memory figures) and final model, or the error that started a
/// failure.
pub(super) fn run_all<W: Workload>(
    workload: &W,
    settings: &TrainerSettings,
    sampler: &DistributedSampler,
    total: usize,
    comms: Vec<Box<dyn Collective>>,
    start: &Start,
    monitor: Option<&SystemMonitor>,
) -> Result<(Summary, W::Model)> {
    let results: Vec<Result<Outcome<W::Model>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(local, comm)| {
                let sampler = sampler.clone();
                let rank = comm.rank();
                std::thread::Builder::new()
                    .name(format!("kiln-worker-{rank}"))
                    .spawn_scoped(scope, move || {
                        let base = settings.parallel.devices[local].clone().autodiff();
                        let worker = Worker {
                            workload,
                            settings,
                            sampler,
                            total,
                            comm,
                            local,
                            device: match settings.recompute.mode {
                                RecomputeMode::Balanced => base.gradient_checkpointing(),
                                _ => base,
                            },
                            monitor: monitor.filter(|_| rank == 0),
                        };
                        worker.run_guarded(start)
                    })
                    .expect("spawn a worker thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Worker("a worker thread died".into())))
            })
            .collect()
    });

    // Report the failure that started it all, not the ranks it aborted.
    let mut lead = None;
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(out) => {
                if out.lead.is_some() {
                    lead = out.lead;
                }
            }
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        let origin = errors.iter().position(|e| !is_abort_echo(e)).unwrap_or(0);
        return Err(errors.swap_remove(origin));
    }
    lead.ok_or_else(|| Error::Worker("the process's first rank returned no result".into()))
}

/// Every rank's memory figures, gathered (each count carried exactly in two f32 halves).
fn gather_memory(comm: &dyn Collective, m: &Memory) -> Result<Vec<[usize; 5]>> {
    let pool = m.pool_peak.map_or(usize::MAX, |p| p as usize);
    let counts = [
        m.params.peak,
        m.grads.peak,
        m.optim.peak,
        m.total_peak,
        pool,
    ];
    let mine: Vec<f32> = counts
        .iter()
        .flat_map(|c| {
            let c = *c as u64;
            [
                (c >> 40) as f32,
                ((c >> 20) & 0xf_ffff) as f32,
                (c & 0xf_ffff) as f32,
            ]
        })
        .collect();
    let all = comm.all_gather(&mine)?;
    Ok(all
        .chunks(mine.len())
        .map(|r| {
            let mut out = [0usize; 5];
            for (i, v) in r.chunks(3).enumerate() {
                out[i] = (((v[0] as u64) << 40) | ((v[1] as u64) << 20) | v[2] as u64) as usize;
            }
            out
        })
        .collect())
}

struct Worker<'a, W: Workload> {
    workload: &'a W,
    settings: &'a TrainerSettings,
    sampler: DistributedSampler,
    total: usize,
    comm: Box<dyn Collective + 'a>,
    /// This rank's index among the ranks of its process (its device's index).
    local: usize,
    device: Device,
    /// The system monitor, on rank 0.
    monitor: Option<&'a SystemMonitor>,
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
    started: Instant,
    /// Seconds of the window spent outside training (validation, checkpoints).
    excluded: f64,
    data: f64,
    compute: f64,
    sync: f64,
    optim: f64,
}

impl Window {
    fn new(phases: usize) -> Self {
        Self {
            loss: vec![None; phases],
            scored: vec![0; phases],
            metrics: BTreeMap::new(),
            steps: 0,
            samples: 0,
            started: Instant::now(),
            excluded: 0.0,
            data: 0.0,
            compute: 0.0,
            sync: 0.0,
            optim: 0.0,
        }
    }

    /// Adds group `phase`'s micro-batch outputs.
    fn add(&mut self, phase: usize, outs: &[StepOutput]) {
        self.scored[phase] += outs.len();
        for out in outs {
            let l = out.loss.clone();
            self.loss[phase] = Some(match self.loss[phase].take() {
                Some(sum) => sum + l,
                None => l,
            });
            add_metrics(&mut self.metrics, &out.metrics, 1.0, 1);
        }
    }
}

/// A validation's mean loss and, for a classifier, its accuracy.
type Scores = (f64, Option<f64>);

/// Adds `metrics`, each weighted by `weight`, into the running sums `into`, counting `count`
/// for each (1 per micro-batch in training, its samples in validation).
fn add_metrics(
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
fn agree_names(comm: &dyn Collective, mine: &BTreeSet<String>) -> Result<Vec<String>> {
    if comm.world_size() == 1 {
        return Ok(mine.iter().cloned().collect());
    }
    let text: Vec<f32> = mine
        .iter()
        .cloned()
        .collect::<Vec<_>>()
        .join("\n")
        .bytes()
        .map(f32::from)
        .collect();
    let lengths = comm.all_gather(&[text.len() as f32])?;
    let longest = lengths.iter().fold(0.0f32, |a, b| a.max(*b)) as usize;
    if longest == 0 {
        return Ok(Vec::new());
    }
    let mut padded = text;
    padded.resize(longest, 0.0);
    let all = comm.all_gather(&padded)?;
    let mut names = BTreeSet::new();
    for (chunk, len) in all.chunks(longest).zip(lengths) {
        let bytes: Vec<u8> = chunk[..len as usize].iter().map(|b| *b as u8).collect();
        let text = String::from_utf8_lossy(&bytes);
        names.extend(
            text.split('\n')
                .filter(|n| !n.is_empty())
                .map(str::to_string),
        );
    }
    Ok(names.into_iter().collect())
}

/// The mean of each of `names` over every rank's sums `local` (value, count), in `names`'
/// order; a name no rank reported is left out.
fn mean_metrics(
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
fn put_metrics(
    record: &mut serde_json::Map<String, serde_json::Value>,
    metrics: &[(String, f64)],
) -> Result<()> {
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

impl<W: Workload> Worker<'_, W> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// Runs the worker, turning an error or a panic into an abort of the whole group so that
    /// no other rank waits forever.
    fn run_guarded(self, start: &Start) -> Result<Outcome<W::Model>> {
        let rank = self.rank();
        let pool = (self.settings.parallel.split_cpu_threads && self.world() > 1).then(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            rayon::ThreadPoolBuilder::new()
                .num_threads((cores / self.world()).max(1))
                .thread_name(move |i| format!("kiln-worker-{rank}-pool-{i}"))
                .build()
                .expect("build a rayon pool")
        });
        let body = AssertUnwindSafe(|| match &pool {
            Some(pool) => pool.install(|| self.run(start)),
            None => self.run(start),
        });
        let outcome = match std::panic::catch_unwind(body) {
            Ok(result) => result,
            Err(payload) => Err(Error::Worker(format!(
                "rank {rank} panicked: {}",
                panic_message(&payload)
            ))),
        };
        if let Err(e) = &outcome
            && !is_abort_echo(e)
        {
            self.comm
                .abort(&format!("{ABORTED}rank {rank} failed: {e}"));
        }
        outcome
    }

    /// This rank's module with rank 0's weights, in the master dtype.
    fn build_model(&self, start: &Start) -> W::Model {
        // Each rank builds its own module (so that no Burn state is shared between ranks) and
        // takes rank 0's weights; the throwaway initialisation still draws random numbers,
        // hence the lock.
        let model = kiln_models::with_rng(|| {
            kiln_models::materialized(self.workload.init_model(&self.device))
        });
        let model = model.load_record(start.weights.clone());
        let mode = self.settings.precision.mode;
        if is_true_low(mode) {
            // `-true`: the parameters themselves, buffers included, live in the low dtype.
            cast_params(model, compute_dtype(mode), true)
        } else {
            model
        }
    }

    fn run(&self, start: &Start) -> Result<Outcome<W::Model>> {
        let s = self.settings;
        let t = &s.train;
        let rank = self.rank();
        let world = self.world();
        let lead = rank == 0;
        let mode = s.precision.mode;
        let dtype = compute_dtype(mode);

        let model = self.build_model(start);
        let groups: Vec<String> = TrainStep::<W::Batch>::param_groups(&model)
            .into_iter()
            .map(|g| g.name)
            .collect();
        let phases = groups.len().max(1);
        let bucket_elements = (s.parallel.bucket_mb * 1024.0 * 1024.0 / 4.0).max(1.0) as usize;
        let mut strategy: Box<dyn Strategy<W::Model, W::Batch> + '_> = strategy::build(
            s.parallel.strategy,
            model,
            Context {
                comm: self.comm.as_ref(),
                device: self.device.clone(),
                precision: s.precision.clone(),
                recompute: s.recompute.clone(),
                sync_batchnorm: s.parallel.sync_batchnorm,
                optim: s.optim.clone(),
                bucket_elements,
                pipeline: s.parallel.pipeline.clone(),
                group_optims: s
                    .groups
                    .iter()
                    .map(|(name, g)| (name.clone(), g.optim.clone()))
                    .collect(),
            },
        )?;
        if let Some(optim) = &start.optim {
            strategy.load_optimizer_states(optim)?;
        }
        let begin = &start.state;
        let mut scaler = begin.scaler.clone();
        let data_rank = s.data_rank(rank);
        let data_world = s.data_world();
        // One schedule per optimizer.
        let schedules: Vec<Schedule> = (0..phases)
            .map(|g| {
                let name = groups.get(g).map_or("", String::as_str);
                let peak = scaled_lr(s.group_optim(name), data_world, s.micro_batches());
                Schedule::new(peak, s.group_schedule(name), self.total)
            })
            .collect();
        let spe = self.sampler.steps_per_epoch();

        let mut metrics = if lead {
            Some(MetricsWriter::open(
                &s.output.run_dir,
                &s.output.monitor.sinks,
                Some(begin.step),
            ))
        } else {
            None
        };
        let progress = (lead && s.output.progress).then(|| Progress::new(self.total, begin.step));
        let device_name = s.parallel.devices[0].identity().map(|i| i.name);
        let mut throughput = Throughput::new(
            world,
            self.workload.tokens_per_sample(),
            self.workload.flops_per_sample(),
            peak_tflops(s.output.monitor.peak_tflops, device_name.as_deref()),
            s.output.monitor.smoothing,
        );
        if let Some(m) = self.monitor {
            m.set_step(begin.step);
        }

        let mut step = begin.step;
        let mut epoch = begin.epoch;
        let mut step_in_epoch = begin.step_in_epoch;
        let mut samples = begin.samples;
        let mut wall = begin.wall_seconds;
        let mut order = self.sampler.epoch_order(epoch);
        let mut window = Window::new(phases);
        let mut last_train_loss = None;
        let mut last_val: Option<(f64, Option<f64>)> = None;
        let mut validated_at = None;
        let mut step_times = Vec::new();
        let mut nonfinite_skipped = 0usize;
        let mut stopped_by = None;
        let start_rss_mib = crate::monitor::process_memory_mib("VmRSS");
        let run_started = Instant::now();

        while step < self.total {
            if step_in_epoch == spe {
                epoch += 1;
                step_in_epoch = 0;
                order = self.sampler.epoch_order(epoch);
            }
            let lrs: Vec<f64> = schedules.iter().map(|sc| sc.lr(step)).collect();
            let lr = lrs[0];
            let loss_scale = scaler.as_ref().map(|sc| sc.scale as f32);
            let micros = s.micro_batches();
            let objective = move |loss: Tensor<1>| {
                let loss = if micros > 1 {
                    loss.div_scalar(micros as f32)
                } else {
                    loss
                };
                match loss_scale {
                    Some(scale) => loss.mul_scalar(scale),
                    None => loss,
                }
            };

            // Each optimizer in turn (one for most models): its micro-steps over the step's
            // micro-batches, then its update, which the next group's micro-steps see.
            for (phase, &lr_phase) in lrs.iter().enumerate() {
                let t0 = Instant::now();
                if phases > 1 {
                    strategy.select_group(phase)?;
                }
                strategy.begin_step()?;
                // The strategy takes each micro-batch when it needs it; building them is data
                // time.
                let mut data_seconds = 0.0;
                let mut batches = (0..micros).map(|micro| {
                    let t0 = Instant::now();
                    let micro_step = step * micros + micro;
                    let indices = self
                        .workload
                        .sample(micro_step, data_rank, data_world, t.batch_size)
                        .unwrap_or_else(|| {
                            self.sampler
                                .indices(&order, step_in_epoch, micro, data_rank)
                        });
                    let mut batch = self.workload.train_batch_at(&indices, step, &self.device);
                    if dtype != FloatDType::F32 {
                        batch = self.workload.cast_batch(batch, dtype);
                    }
                    data_seconds += t0.elapsed().as_secs_f64();
                    batch
                });
                let outs = strategy.micro_steps(&mut batches, micros, &objective)?;
                drop(batches);
                window.add(phase, &outs);
                window.data += data_seconds;
                window.compute += t0.elapsed().as_secs_f64() - data_seconds;
                // Collectives inside the micro-steps (ZeRO's reduce-scatters and gathers)
                // count as synchronisation, not compute.
                let inside = strategy.take_sync_seconds();
                window.compute -= inside;
                window.sync += inside;

                let t2 = Instant::now();
                strategy.optimizer_step(lr_phase, scaler.as_mut(), t.grad_clip)?;
                let inside = strategy.take_sync_seconds();
                window.sync += inside;
                window.optim += t2.elapsed().as_secs_f64() - inside;
                if strategy.nonfinite() {
                    // Every rank saw the same flag. Within the allowance the step is skipped
                    // (the parameters stay as they were); past it the run stops, before
                    // anything is written for this step.
                    if nonfinite_skipped < t.skip_nonfinite {
                        nonfinite_skipped += 1;
                    } else {
                        let losses: Vec<Tensor<1>> = outs.iter().map(|o| o.loss.clone()).collect();
                        let group = groups.get(phase).map(String::as_str);
                        return Err(self.nonfinite_error(
                            step + 1,
                            group,
                            &losses,
                            &s.output.run_dir,
                        )?);
                    }
                }
            }

            step += 1;
            step_in_epoch += 1;
            window.steps += 1;
            window.samples += self.sampler.samples_per_step();
            samples += self.sampler.samples_per_step() as u64;
            if let Some(m) = self.monitor {
                m.set_step(step);
            }

            if t.check_replicas && world > 1 {
                strategy.check_replicas(step)?;
            }
            if injected_fault() == Some((rank, step)) {
                panic!("injected failure after step {step} ({FAULT_VAR})");
            }

            let last = step == self.total;
            if step.is_multiple_of(t.log_every) || last {
                let elapsed = window.started.elapsed().as_secs_f64() - window.excluded;
                // Every rank that scored micro-batches contributes their losses (a pipeline's
                // last stage alone scores them), per group.
                let mut stats: Vec<f32> = window
                    .loss
                    .iter_mut()
                    .map(|l| l.take().map_or(0.0, |l| l.into_scalar::<f32>()))
                    .collect();
                stats.extend(window.scored.iter().map(|n| *n as f32));
                self.comm.all_reduce(&mut stats, ReduceOp::Sum)?;
                let group_losses: Vec<f64> = (0..phases)
                    .map(|g| f64::from(stats[g]) / f64::from(stats[phases + g]).max(1.0))
                    .collect();
                // With several optimizers, `loss` is the sum of theirs.
                let loss: f64 = group_losses.iter().sum();
                let local = std::mem::take(&mut window.metrics);
                let names = agree_names(self.comm.as_ref(), &local.keys().cloned().collect())?;
                let mut named: Vec<(String, f64)> = groups
                    .iter()
                    .zip(&group_losses)
                    .map(|(g, l)| (format!("loss_{g}"), *l))
                    .collect();
                named.extend(mean_metrics(self.comm.as_ref(), &names, local)?);
                let report = strategy.report()?;
                last_train_loss = Some(loss);
                let rate = window.samples as f64 / elapsed.max(1e-9);
                let per = |x: f64| x / window.steps as f64;
                step_times.push(per(window.data
                    + window.compute
                    + window.sync
                    + window.optim));
                let times = [window.data, window.compute, window.sync, window.optim];
                let mut rates = String::new();
                if let Some(m) = metrics.as_mut() {
                    let mut r = record(&[
                        ("step", json!(step)),
                        ("epoch", json!(epoch)),
                        ("split", json!("train")),
                        ("loss", num(loss)),
                        ("lr", num(lr)),
                        ("samples_per_sec", num(rate)),
                        ("time_data", num(per(window.data))),
                        ("time_compute", num(per(window.compute))),
                        ("time_sync", num(per(window.sync))),
                        ("time_optim", num(per(window.optim))),
                    ]);
                    rates = throughput.annotate(&mut r, rate, times);
                    if let Some(sc) = &scaler {
                        r.insert("loss_scale".into(), num(sc.scale));
                        r.insert("skipped_steps".into(), json!(sc.skipped));
                    }
                    if t.skip_nonfinite > 0 {
                        r.insert("nonfinite_skipped".into(), json!(nonfinite_skipped));
                    }
                    for (g, lr) in groups.iter().zip(&lrs) {
                        r.insert(format!("lr_{g}"), num(*lr));
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
                if let Some(p) = &progress {
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
                window = Window::new(phases);
            }

            // A signal asks every rank to stop here with a checkpoint; the ranks agree on the
            // step (a signal reaches processes and threads at different moments).
            let signalled = if t.checkpoint_on_signal && !last {
                let mut flag = vec![crate::signal::requested().map_or(0.0, |sig| sig as f32)];
                if world > 1 {
                    self.comm.all_reduce(&mut flag, ReduceOp::Sum)?;
                }
                (flag[0] > 0.0).then(|| crate::signal::requested().unwrap_or(libc::SIGTERM))
            } else {
                None
            };
            let checkpoint_due = t.checkpoint_every.is_some_and(|n| step.is_multiple_of(n))
                || last
                || signalled.is_some();
            let epoch_end = step_in_epoch == spe;
            let periodic_val = t.val_every.is_some_and(|n| step.is_multiple_of(n));
            // With a best metric, every checkpoint is scored.
            let scored = checkpoint_due && t.best_metric.is_some();
            if epoch_end || periodic_val || last || scored {
                let val_started = Instant::now();
                let model = strategy.full_model()?;
                let (v, val_metrics) = self.validate(&model)?;
                drop(model);
                validated_at = Some(step);
                last_val = Some(v);
                if let Some(m) = metrics.as_mut() {
                    let mut r = record(&[
                        ("step", json!(step)),
                        ("epoch", json!(epoch)),
                        ("split", json!("val")),
                        ("loss", num(v.0)),
                    ]);
                    if let Some(acc) = v.1 {
                        r.insert("accuracy".into(), num(acc));
                    }
                    put_metrics(&mut r, &val_metrics)?;
                    m.write(&r);
                }
                if let Some(p) = &progress {
                    let acc =
                        v.1.map_or(String::new(), |a| format!(" accuracy {:.2}%", a * 100.0));
                    p.println(&format!(
                        "step {step} epoch {epoch}: val loss {:.4}{acc}",
                        v.0
                    ));
                }
                // Validation time does not count against training throughput.
                window.excluded += val_started.elapsed().as_secs_f64();
            }

            if checkpoint_due {
                let saving = Instant::now();
                let model = strategy.full_model()?;
                let optim = strategy.optimizer_states()?;
                if let Some(optim) = optim.filter(|_| lead) {
                    let state = LoopState {
                        step,
                        epoch,
                        step_in_epoch,
                        seed: s.seed,
                        world_size: world,
                        samples_per_step: self.sampler.samples_per_step(),
                        lr,
                        samples,
                        wall_seconds: wall + run_started.elapsed().as_secs_f64(),
                        scaler: scaler.clone(),
                    };
                    let score = t.best_metric.as_deref().and_then(|metric| {
                        let v = last_val.filter(|_| validated_at == Some(step))?;
                        let value = if metric == "val_accuracy" { v.1? } else { v.0 };
                        Some(checkpoint::Score { metric, value })
                    });
                    checkpoint::save(
                        &s.output.run_dir,
                        &model,
                        &optim,
                        &state,
                        t.keep_checkpoints,
                        score,
                    )?;
                }
                // Nobody runs ahead of a checkpoint that has not landed yet.
                self.comm.barrier()?;
                window.excluded += saving.elapsed().as_secs_f64();
            }
            let snapshot_due = self
                .workload
                .snapshot_every()
                .is_some_and(|n| last || (n > 0 && step.is_multiple_of(n)));
            if snapshot_due {
                let started = Instant::now();
                let model = strategy.full_model()?;
                if lead {
                    let model = if is_true_low(mode) {
                        cast_params(model, FloatDType::F32, true)
                    } else {
                        model
                    };
                    self.workload
                        .snapshot(step, &model.valid(), &s.output.run_dir)?;
                }
                window.excluded += started.elapsed().as_secs_f64();
            }
            if let Some(signal) = signalled {
                stopped_by = Some(crate::signal::name(signal));
                break;
            }
        }

        let mut model = strategy.full_model()?;
        if validated_at != Some(step)
            && self.workload.eval_len() > 0
            && step > 0
            && stopped_by.is_none()
        {
            last_val = Some(self.validate(&model)?.0);
        }
        if let Some(p) = &progress {
            p.finish();
        }
        if let (Some(mon), Some(m)) = (self.monitor, metrics.as_mut()) {
            mon.stop();
            for sample in mon.drain() {
                m.write(&sample);
            }
        }
        wall += run_started.elapsed().as_secs_f64();
        let memories = gather_memory(self.comm.as_ref(), &strategy.memory())?;
        if self.local != 0 {
            return Ok(Outcome { lead: None });
        }
        let summary = Summary {
            steps: step,
            epochs: step as f64 / spe as f64,
            final_train_loss: last_train_loss,
            val_loss: last_val.map(|v| v.0),
            val_accuracy: last_val.and_then(|v| v.1),
            wall_seconds: wall,
            samples_per_sec: samples as f64 / wall.max(1e-9),
            devices: world,
            strategy: name_of(&s.parallel.strategy),
            precision: name_of(&mode),
            accelerator: s.parallel.accelerator.clone(),
            recompute: name_of(&s.recompute.mode),
            step_seconds: median(&mut step_times),
            start_rss_mib,
            peak_rss_mib: crate::monitor::process_memory_mib("VmHWM"),
            param_bytes_per_rank: memories.iter().map(|m| m[0]).collect(),
            grad_bytes_per_rank: memories.iter().map(|m| m[1]).collect(),
            optim_bytes_per_rank: memories.iter().map(|m| m[2]).collect(),
            peak_bytes_per_rank: memories.iter().map(|m| m[3]).collect(),
            pool_peak_bytes_per_rank: memories
                .iter()
                .map(|m| (m[4] != usize::MAX).then_some(m[4] as u64))
                .collect(),
            processes: s.parallel.processes.count,
            stopped_by,
        };
        if is_true_low(mode) {
            // The exported model is f32 whatever the training precision.
            model = cast_params(model, FloatDType::F32, true);
        }
        Ok(Outcome {
            lead: Some((summary, model.valid())),
        })
    }

    /// The error of a step whose gradients were not finite: which ranks' micro-batches had a
    /// non-finite loss (or that every loss was finite and the gradients were not), and the
    /// newest checkpoint, which nothing has overwritten.
    fn nonfinite_error(
        &self,
        step: usize,
        group: Option<&str>,
        losses: &[Tensor<1>],
        run_dir: &std::path::Path,
    ) -> Result<Error> {
        let bad = losses
            .iter()
            .position(|l| !l.clone().into_scalar::<f32>().is_finite())
            .map_or(-1.0, |m| m as f32);
        let all = self.comm.all_gather(&[bad])?;
        let at: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, m)| **m >= 0.0)
            .map(|(r, m)| format!("rank {r} micro-batch {}", *m as usize))
            .collect();
        let mut what = if at.is_empty() {
            "a non-finite gradient (every loss was finite)".to_string()
        } else {
            format!("a non-finite loss ({})", at.join(", "))
        };
        if let Some(group) = group {
            what = format!("{what} in parameter group {group:?}");
        }
        let kept = checkpoint::list(run_dir)
            .pop()
            .map_or("none was written".to_string(), |(_, d)| {
                format!("{} is intact", d.display())
            });
        Ok(Error::Training(format!(
            "step {step}: {what}; the step was not taken and the newest checkpoint {kept} \
             (train.skip_nonfinite = {} lets a run skip such steps)",
            self.settings.train.skip_nonfinite
        )))
    }

    /// Mean loss and accuracy over the whole evaluation set, each sample counted once, in the
    /// precision the ranks train in; and the means of the step's named metrics.
    fn validate(&self, model: &W::Model) -> Result<(Scores, Vec<(String, f64)>)> {
        let eval_device = self.device.clone().without_autodiff();
        let mode = self.settings.precision.mode;
        let dtype = compute_dtype(mode);
        let model = if is_mixed(mode) {
            cast_params(model.clone(), dtype, false).valid()
        } else {
            model.valid()
        };
        let range = eval_shard(self.workload.eval_len(), self.world(), self.rank());
        let bs = self.settings.train.batch_size;
        let mut loss_sum: Option<Tensor<1>> = None;
        let mut correct: Option<Tensor<1, Int>> = None;
        let mut named = BTreeMap::new();
        let mut start = range.start;
        while start < range.end {
            let end = (start + bs).min(range.end);
            let mut batch = self.workload.eval_batch(start..end, &eval_device);
            if dtype != FloatDType::F32 {
                batch = self.workload.cast_batch(batch, dtype);
            }
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
        Ok((
            (
                f64::from(stats[0]) / n,
                has_accuracy.then(|| f64::from(stats[1]) / n),
            ),
            metrics,
        ))
    }
}

/// The environment variable that makes one rank panic after one step, to test how a failure
/// ends a run (in-process and across processes): `KILN_FAULT_INJECT=rank:step`.
pub const FAULT_VAR: &str = "KILN_FAULT_INJECT";

/// The `(rank, step)` of an injected failure, when the variable asks for one.
fn injected_fault() -> Option<(usize, usize)> {
    static FAULT: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    *FAULT.get_or_init(|| {
        let raw = std::env::var(FAULT_VAR).ok()?;
        let (rank, step) = raw.split_once(':')?;
        Some((rank.trim().parse().ok()?, step.trim().parse().ok()?))
    })
}

/// The median of `values` (sorted in place), `None` when empty.
pub fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}

fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}
