//! One rank's loop: steps, accumulation, logging, validation, checkpoints. It talks to its
//! [`Strategy`] and its [`Collective`] through their traits only.

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::TrainStep;
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
    loss: Option<Tensor<1>>,
    /// Micro-batches whose loss this rank computed.
    scored: usize,
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
    fn new() -> Self {
        Self {
            loss: None,
            scored: 0,
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
            },
        )?;
        if let Some(optim) = &start.optim {
            strategy.load_optimizer_state(optim)?;
        }
        let begin = &start.state;
        let mut scaler = begin.scaler.clone();
        let data_rank = s.data_rank(rank);
        let data_world = s.data_world();
        let peak = scaled_lr(&s.optim, data_world, s.micro_batches());
        let schedule = Schedule::new(peak, &s.schedule, self.total);
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
        let mut window = Window::new();
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
            let lr = schedule.lr(step);
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

            let t0 = Instant::now();
            strategy.begin_step()?;
            // The strategy takes each micro-batch when it needs it; building them is data time.
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
                let mut batch = self.workload.train_batch(&indices, &self.device);
                if dtype != FloatDType::F32 {
                    batch = self.workload.cast_batch(batch, dtype);
                }
                data_seconds += t0.elapsed().as_secs_f64();
                batch
            });
            let losses = strategy.micro_steps(&mut batches, micros, &objective)?;
            drop(batches);
            window.scored += losses.len();
            let step_losses = losses.clone();
            for loss in losses {
                window.loss = Some(match window.loss.take() {
                    Some(l) => l + loss,
                    None => loss,
                });
            }
            window.data += data_seconds;
            window.compute += t0.elapsed().as_secs_f64() - data_seconds;
            // Collectives inside the micro-steps (ZeRO's reduce-scatters and gathers) count
            // as synchronisation, not compute.
            let inside = strategy.take_sync_seconds();
            window.compute -= inside;
            window.sync += inside;

            let t2 = Instant::now();
            strategy.optimizer_step(lr, scaler.as_mut(), t.grad_clip)?;
            let inside = strategy.take_sync_seconds();
            window.sync += inside;
            window.optim += t2.elapsed().as_secs_f64() - inside;
            if strategy.nonfinite() {
                // Every rank saw the same flag. Within the allowance the step is skipped (the
                // parameters stay as they were); past it the run stops, before anything is
                // written for this step.
                if nonfinite_skipped < t.skip_nonfinite {
                    nonfinite_skipped += 1;
                } else {
                    return Err(self.nonfinite_error(step + 1, &step_losses, &s.output.run_dir)?);
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
                // last stage alone scores them).
                let mut stats = vec![
                    window.loss.take().map_or(0.0, |l| l.into_scalar::<f32>()),
                    window.scored as f32,
                ];
                self.comm.all_reduce(&mut stats, ReduceOp::Sum)?;
                let loss = f64::from(stats[0]) / f64::from(stats[1]).max(1.0);
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
                window = Window::new();
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
                let v = self.validate(&model)?;
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
                let optim = strategy.optimizer_state()?;
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
            last_val = Some(self.validate(&model)?);
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
        let what = if at.is_empty() {
            "a non-finite gradient (every loss was finite)".to_string()
        } else {
            format!("a non-finite loss ({})", at.join(", "))
        };
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
    /// precision the ranks train in.
    fn validate(&self, model: &W::Model) -> Result<(f64, Option<f64>)> {
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
        Ok((
            f64::from(stats[0]) / n,
            has_accuracy.then(|| f64::from(stats[1]) / n),
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
