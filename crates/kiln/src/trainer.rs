//! The training loop every strategy shares.
//!
//! [`fit`] starts one worker thread per device. Each worker holds a full replica, takes its
//! shard of every global batch from the [`DistributedSampler`], runs forward and backward,
//! and, when the world has more than one rank, averages gradients through the
//! [`Collective`] on the last micro-step before its optimizer step. With one device the same
//! loop runs with a group of one, whose collectives are no-ops. Only rank 0 writes files.

use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::time::Instant;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::FloatDType;
use kiln_models::{BlockStack, TrainStep};
use serde_json::json;

use crate::checkpoint::{self, LoopState};
use crate::collective::{Collective, LocalComm, ReduceOp, local_group};
use crate::config::{
    OptimConfig, PrecisionConfig, RecomputeConfig, RecomputeMode, ReduceDtype, RootConfig,
    ScheduleConfig, TrainConfig, name_of,
};
use crate::data::{DistributedSampler, eval_shard};
use crate::error::{Error, Result};
use crate::metrics::{MetricsWriter, Progress, Summary, num, record};
use crate::monitor::{MonitorSetup, SystemMonitor, Throughput, peak_tflops};
use crate::optim::{
    ParamLayout, Schedule, buckets, build_optimizer, clip_global_norm, grads_to_parts,
    parts_to_grads, scaled_lr,
};
use crate::precision::{
    self, LossScaler, cast_params, compute_dtype, is_mixed, is_true_low, to_master_grads,
};
use crate::recompute::{Recompute, forward_backward};

/// A model and its data, as the trainer sees them; nothing here knows about devices beyond
/// the one it is handed.
pub trait Workload: Sync {
    /// The model type: its forward pass as a stem, blocks and a head (see [`BlockStack`]).
    type Model: Module + BlockStack<Self::Batch> + 'static;
    /// One batch, already on a device.
    type Batch;
    /// A freshly initialised model on `device` (weights are then replaced by rank 0's).
    fn init_model(&self, device: &Device) -> Self::Model;
    /// Number of training samples.
    fn train_len(&self) -> usize;
    /// The training batch of `indices` on `device`.
    fn train_batch(&self, indices: &[usize], device: &Device) -> Self::Batch;
    /// Number of evaluation samples.
    fn eval_len(&self) -> usize;
    /// The evaluation batch of samples `range` on `device`.
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> Self::Batch;
    /// `batch` with its float inputs in `dtype` (the compute dtype of a lower precision).
    fn cast_batch(&self, batch: Self::Batch, dtype: FloatDType) -> Self::Batch;
    /// The samples rank `rank` of `world` trains on at global micro-step `micro_step`
    /// (`step × accumulate + micro`), `batch` of them, for workloads that draw their own (text
    /// windows from seed and step). `None`, the default, uses the epoch-shuffled sampler.
    fn sample(
        &self,
        micro_step: usize,
        rank: usize,
        world: usize,
        batch: usize,
    ) -> Option<Vec<usize>> {
        let _ = (micro_step, rank, world, batch);
        None
    }
    /// Tokens in one sample, for workloads that count throughput in tokens.
    fn tokens_per_sample(&self) -> Option<usize> {
        None
    }
    /// Training FLOPs (forward and backward) of one sample, for models that count them; the
    /// model FLOPs utilization (MFU) is logged when this and a peak FLOP/s are known.
    fn flops_per_sample(&self) -> Option<f64> {
        None
    }
}

/// What the loop needs besides the workload.
#[derive(Debug, Clone)]
pub struct TrainerSettings {
    /// Loop settings.
    pub train: TrainConfig,
    /// Optimizer settings.
    pub optim: OptimConfig,
    /// Learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Drop the last incomplete global batch of each epoch.
    pub drop_last: bool,
    /// One device per replica.
    pub devices: Vec<Device>,
    /// Size of one gradient bucket of the all-reduce, in MiB of f32.
    pub bucket_mb: f64,
    /// Synchronise BatchNorm batch statistics across replicas.
    pub sync_batchnorm: bool,
    /// Limit CPU replicas to their share of the cores (one rayon pool each).
    pub split_cpu_threads: bool,
    /// Where rank 0 writes metrics and checkpoints.
    pub run_dir: PathBuf,
    /// Checkpoint directory to continue from.
    pub resume_from: Option<PathBuf>,
    /// Metric sinks, the system monitor's interval, the peak FLOP/s and the smoothing.
    pub monitor: crate::config::MonitorConfig,
    /// Show progress (a bar on a terminal, log lines otherwise) on rank 0.
    pub progress: bool,
    /// Strategy name for the summary.
    pub strategy: String,
    /// Accelerator name for the summary.
    pub accelerator: String,
    /// Precision policy.
    pub precision: PrecisionConfig,
    /// Activation checkpointing.
    pub recompute: RecomputeConfig,
}

impl TrainerSettings {
    /// The settings `config` describes, for one replica per device of `devices`, writing into
    /// `run_dir`: a fresh run, without progress display (set `resume_from` and `progress` to
    /// change that).
    pub fn from_config(
        config: &RootConfig,
        devices: Vec<Device>,
        accelerator: String,
        run_dir: PathBuf,
    ) -> Self {
        Self {
            train: config.train.clone(),
            optim: config.optim.clone(),
            schedule: config.schedule.clone(),
            seed: config.run.seed,
            drop_last: config.data.drop_last,
            strategy: if devices.len() > 1 { "ddp" } else { "single" }.into(),
            devices,
            bucket_mb: config.ddp.bucket_mb,
            sync_batchnorm: config.ddp.sync_batchnorm,
            split_cpu_threads: accelerator.starts_with("cpu"),
            run_dir,
            resume_from: None,
            monitor: config.monitor.clone(),
            progress: false,
            accelerator,
            precision: config.precision.clone(),
            recompute: config.recompute.clone(),
        }
    }
}

/// How many optimizer steps a run of this length takes.
pub fn total_steps(train: &TrainConfig, steps_per_epoch: usize) -> usize {
    let by_epochs = train.epochs * steps_per_epoch;
    match train.max_steps {
        Some(max) if train.epochs == 0 => max,
        Some(max) => max.min(by_epochs),
        None => by_epochs,
    }
}

/// Trains `workload` as `settings` say and returns the summary and rank 0's final model.
pub fn fit<W: Workload>(workload: &W, settings: &TrainerSettings) -> Result<(Summary, W::Model)> {
    let world = settings.devices.len();
    let t = &settings.train;
    let sampler = DistributedSampler::new(
        workload.train_len(),
        settings.seed,
        world,
        t.batch_size,
        t.accumulate,
        settings.drop_last,
    );
    let spe = sampler.steps_per_epoch();
    if spe == 0 {
        return Err(Error::config(format!(
            "key `train.batch_size`: one step needs {} samples (batch {} × {} devices × {} \
             accumulation) but the training set holds {} and data.drop_last is set",
            sampler.samples_per_step(),
            t.batch_size,
            world,
            t.accumulate,
            workload.train_len()
        )));
    }
    let total = total_steps(t, spe);
    for (i, device) in settings.devices.iter().enumerate() {
        let label = match device.identity() {
            Some(who) => format!("{i} ({})", who.name),
            None => format!("{i} ({})", settings.accelerator),
        };
        precision::check_device(&settings.precision, device, &label)?;
    }
    std::fs::create_dir_all(&settings.run_dir).map_err(|e| Error::io(&settings.run_dir, e))?;

    // Rank 0's initial weights (or the checkpoint's) are what every replica starts from.
    let main_device = settings.devices[0].clone().autodiff();
    // Seeding and initialisation happen under kiln-models' random-number lock, so that runs
    // sharing the process cannot interleave their draws.
    let mut initial = kiln_models::with_rng(|| {
        main_device.seed(settings.seed);
        kiln_models::materialized(workload.init_model(&main_device))
    });
    let mut start = LoopState {
        step: 0,
        epoch: 0,
        step_in_epoch: 0,
        seed: settings.seed,
        world_size: world,
        samples_per_step: sampler.samples_per_step(),
        lr: 0.0,
        samples: 0,
        wall_seconds: 0.0,
        scaler: settings.precision.uses_scaler().then(|| {
            LossScaler::new(
                settings.precision.init_scale,
                settings.precision.growth_interval,
            )
        }),
    };
    check_policies::<W::Batch, _>(&initial, settings)?;
    if let Some(dir) = &settings.resume_from {
        let state = checkpoint::read_state(dir)?;
        if state.samples_per_step != sampler.samples_per_step() {
            return Err(Error::checkpoint(format!(
                "{}: checkpoint took {} samples per step, this run takes {} (batch × devices × \
                 accumulation must match to continue the same data order)",
                dir.display(),
                state.samples_per_step,
                sampler.samples_per_step()
            )));
        }
        let mode = settings.precision.mode;
        if is_true_low(mode) {
            return Err(Error::checkpoint(format!(
                "{}: a precision {:?} run cannot be resumed: its optimizer state is in {:?}, \
                 and Burn 0.22's optimizer loads saved state in the device's default dtype \
                 (f32); the mixed precisions, whose state is f32, resume",
                dir.display(),
                name_of(&mode),
                compute_dtype(mode)
            )));
        }
        initial = checkpoint::load_model(dir, initial)?;
        // Fail before the workers start if the optimizer state is unreadable.
        checkpoint::load_optimizer(dir, build_optimizer(&settings.optim, &initial))?;
        let fresh = start.scaler.take();
        start = state;
        start.seed = settings.seed;
        // A checkpoint of a run without a scaler continues with a fresh one, and a run that
        // no longer scales drops it.
        let saved = start.scaler.take();
        start.scaler = fresh.map(|fresh| saved.unwrap_or(fresh));
    }
    let weights = initial.into_record();

    // Rank 0 drains the system monitor into the sinks; dropping it stops the thread, on
    // failure too.
    let monitor = (settings.monitor.interval_s > 0.0).then(|| {
        SystemMonitor::start(MonitorSetup {
            interval: std::time::Duration::from_secs_f64(settings.monitor.interval_s),
            devices: settings.devices.clone(),
            cpu_replicas: settings.split_cpu_threads && world > 1,
        })
    });
    if let Some(m) = &monitor
        && settings.progress
    {
        println!("{}", m.notice());
    }
    let monitor = monitor.as_ref();

    let comms = local_group(world);
    let results: Vec<WorkerResult<W::Model>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let weights = weights.clone();
                let sampler = sampler.clone();
                let start = start.clone();
                std::thread::Builder::new()
                    .name(format!("kiln-worker-{rank}"))
                    .spawn_scoped(scope, move || {
                        let worker = Worker {
                            workload,
                            settings,
                            sampler,
                            total,
                            comm,
                            device: match settings.recompute.mode {
                                RecomputeMode::Balanced => settings.devices[rank]
                                    .clone()
                                    .autodiff()
                                    .gradient_checkpointing(),
                                _ => settings.devices[rank].clone().autodiff(),
                            },
                            monitor: monitor.filter(|_| rank == 0),
                        };
                        worker.run_guarded(weights, start)
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
    let mut output = None;
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(Some(out)) => output = Some(out),
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        let origin = errors.iter().position(|e| !is_abort_echo(e)).unwrap_or(0);
        return Err(errors.swap_remove(origin));
    }
    output.ok_or_else(|| Error::Worker("rank 0 returned no result".into()))
}

const ABORTED: &str = "stopped because ";

/// What a worker hands back: rank 0 the summary and its final model, other ranks nothing.
type WorkerResult<M> = Result<Option<(Summary, M)>>;

/// Whether `e` is a rank's report that another rank aborted the group.
fn is_abort_echo(e: &Error) -> bool {
    matches!(e, Error::Worker(m) if m.starts_with(ABORTED))
}

struct Worker<'a, W: Workload> {
    workload: &'a W,
    settings: &'a TrainerSettings,
    sampler: DistributedSampler,
    total: usize,
    comm: LocalComm,
    device: Device,
    /// The system monitor, on rank 0.
    monitor: Option<&'a SystemMonitor>,
}

/// Running sums of a logging window, kept on the device until a log line needs them.
struct Window {
    loss: Option<Tensor<1>>,
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
    fn run_guarded(self, weights: ModuleRecord, start: LoopState) -> WorkerResult<W::Model> {
        let rank = self.rank();
        let pool = (self.settings.split_cpu_threads && self.world() > 1).then(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            rayon::ThreadPoolBuilder::new()
                .num_threads((cores / self.world()).max(1))
                .thread_name(move |i| format!("kiln-worker-{rank}-pool-{i}"))
                .build()
                .expect("build a rayon pool")
        });
        let body = AssertUnwindSafe(|| match &pool {
            Some(pool) => pool.install(|| self.run(weights, start)),
            None => self.run(weights, start),
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

    fn run(&self, weights: ModuleRecord, start: LoopState) -> WorkerResult<W::Model> {
        let s = self.settings;
        let t = &s.train;
        let rank = self.rank();
        let world = self.world();
        let lead = rank == 0;

        // Each replica builds its own module (so that no Burn state is shared between
        // replicas) and takes rank 0's weights; the throwaway initialisation still draws
        // random numbers, hence the lock.
        let model = kiln_models::with_rng(|| {
            kiln_models::materialized(self.workload.init_model(&self.device))
        });
        let mut model = model.load_record(weights);
        let mode = s.precision.mode;
        let dtype = compute_dtype(mode);
        let mixed = is_mixed(mode);
        if is_true_low(mode) {
            // `-true`: the parameters themselves, buffers included, live in the low dtype.
            model = cast_params(model, dtype, true);
        }
        let recompute = match s.recompute.mode {
            RecomputeMode::Blocks => Recompute::Blocks {
                every: s.recompute.every,
            },
            RecomputeMode::None | RecomputeMode::Balanced => Recompute::Keep,
        };
        let mut scaler = start.scaler.clone();
        let mut optim = build_optimizer(&s.optim, &model);
        if let Some(dir) = &s.resume_from {
            optim = checkpoint::load_optimizer(dir, optim)?;
        }
        let peak = scaled_lr(&s.optim, world, t.accumulate);
        let schedule = Schedule::new(peak, &s.schedule, self.total);
        let spe = self.sampler.steps_per_epoch();
        let bucket_elements = (s.bucket_mb * 1024.0 * 1024.0 / 4.0).max(1.0) as usize;
        let buckets = buckets(&ParamLayout::of(&model), bucket_elements);

        let mut metrics = if lead {
            Some(MetricsWriter::open(
                &s.run_dir,
                &s.monitor.sinks,
                Some(start.step),
            ))
        } else {
            None
        };
        let progress = (lead && s.progress).then(|| Progress::new(self.total, start.step));
        let device_name = s.devices[0].identity().map(|i| i.name);
        let mut throughput = Throughput::new(
            world,
            self.workload.tokens_per_sample(),
            self.workload.flops_per_sample(),
            peak_tflops(s.monitor.peak_tflops, device_name.as_deref()),
            s.monitor.smoothing,
        );
        if let Some(m) = self.monitor {
            m.set_step(start.step);
        }

        let mut step = start.step;
        let mut epoch = start.epoch;
        let mut step_in_epoch = start.step_in_epoch;
        let mut samples = start.samples;
        let mut wall = start.wall_seconds;
        let mut order = self.sampler.epoch_order(epoch);
        let mut window = Window::new();
        let mut last_train_loss = None;
        let mut last_val: Option<(f64, Option<f64>)> = None;
        let mut validated_at = None;
        let mut step_times = Vec::new();
        let start_rss_mib = crate::monitor::process_memory_mib("VmRSS");
        let run_started = Instant::now();

        while step < self.total {
            if step_in_epoch == spe {
                epoch += 1;
                step_in_epoch = 0;
                order = self.sampler.epoch_order(epoch);
            }
            let lr = schedule.lr(step);

            // Mixed precision: this step's compute copy, cast from the f32 master parameters.
            let compute = mixed.then(|| cast_params(model.clone(), dtype, false));
            let replica = compute.as_ref().unwrap_or(&model);
            let loss_scale = scaler.as_ref().map(|sc| sc.scale as f32);
            let mut accumulator = GradientsAccumulator::new();
            for micro in 0..t.accumulate {
                let t0 = Instant::now();
                let micro_step = step * t.accumulate + micro;
                let indices = self
                    .workload
                    .sample(micro_step, rank, world, t.batch_size)
                    .unwrap_or_else(|| self.sampler.indices(&order, step_in_epoch, micro, rank));
                let mut batch = self.workload.train_batch(&indices, &self.device);
                if dtype != FloatDType::F32 {
                    batch = self.workload.cast_batch(batch, dtype);
                }
                let t1 = Instant::now();
                let accumulate = t.accumulate;
                let objective = |loss: Tensor<1>| {
                    let loss = if accumulate > 1 {
                        loss.div_scalar(accumulate as f32)
                    } else {
                        loss
                    };
                    match loss_scale {
                        Some(scale) => loss.mul_scalar(scale),
                        None => loss,
                    }
                };
                let (out, grads) = if s.sync_batchnorm && world > 1 {
                    crate::syncbn::forward_backward(
                        replica,
                        batch,
                        &self.comm,
                        &self.device,
                        objective,
                    )?
                } else {
                    forward_backward(replica, batch, &self.device, recompute, objective)
                };
                let detached = out.loss.cast(FloatDType::F32);
                window.loss = Some(match window.loss.take() {
                    Some(l) => l + detached,
                    None => detached,
                });
                accumulator.accumulate(replica, grads);
                window.data += (t1 - t0).as_secs_f64();
                window.compute += t1.elapsed().as_secs_f64();
            }
            let mut grads = accumulator.grads();
            drop(compute);

            let t2 = Instant::now();
            if world > 1 {
                grads = self.average_gradients(&model, grads, &buckets)?;
            }
            let t3 = Instant::now();
            // Gradients in the master parameters' dtype, unscaled, and (with a scaler) whether
            // all of them are finite; every rank holds the same averaged gradients, so every
            // rank reaches the same decision.
            let mut take_step = true;
            if dtype != FloatDType::F32 || scaler.is_some() {
                let unscale = scaler.as_ref().map(|sc| (1.0 / sc.scale) as f32);
                let (converted, total) = to_master_grads(&model, grads, unscale, scaler.is_some());
                grads = converted;
                if let (Some(sc), Some(total)) = (scaler.as_mut(), total) {
                    let mut flag =
                        vec![f32::from(u8::from(!total.into_scalar::<f32>().is_finite()))];
                    self.comm.all_reduce(&mut flag, ReduceOp::Sum)?;
                    take_step = sc.update(flag[0] == 0.0);
                }
            }
            if take_step {
                if let Some(max_norm) = t.grad_clip {
                    grads = clip_global_norm(&model, grads, max_norm);
                }
                model = optim.step(lr, model, grads);
            }
            window.sync += (t3 - t2).as_secs_f64();
            window.optim += t3.elapsed().as_secs_f64();

            step += 1;
            step_in_epoch += 1;
            window.steps += 1;
            window.samples += self.sampler.samples_per_step();
            samples += self.sampler.samples_per_step() as u64;
            if let Some(m) = self.monitor {
                m.set_step(step);
            }

            if t.check_replicas && world > 1 {
                self.check_replicas(&model, step)?;
            }

            let last = step == self.total;
            if step.is_multiple_of(t.log_every) || last {
                let elapsed = window.started.elapsed().as_secs_f64() - window.excluded;
                let mut stats = vec![
                    window.loss.take().map_or(0.0, |l| l.into_scalar::<f32>())
                        / (window.steps * t.accumulate) as f32,
                ];
                self.comm.all_reduce(&mut stats, ReduceOp::Mean)?;
                let loss = f64::from(stats[0]);
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
                    m.write(&r);
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

            let epoch_end = step_in_epoch == spe;
            let periodic_val = t.val_every.is_some_and(|n| step.is_multiple_of(n));
            if epoch_end || periodic_val || last {
                let val_started = Instant::now();
                model = self.settle_buffers(model)?;
                let v = self.validate(&model)?;
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

            if t.checkpoint_every.is_some_and(|n| step.is_multiple_of(n)) || last {
                model = self.settle_buffers(model)?;
                if lead {
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
                    checkpoint::save(&s.run_dir, &model, &optim, &state, t.keep_checkpoints)?;
                }
                // Nobody runs ahead of a checkpoint that has not landed yet.
                self.comm.barrier()?;
            }
        }

        model = self.settle_buffers(model)?;
        if validated_at != Some(step) && self.workload.eval_len() > 0 && step > 0 {
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
        if !lead {
            return Ok(None);
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
            strategy: s.strategy.clone(),
            precision: name_of(&mode),
            accelerator: s.accelerator.clone(),
            recompute: name_of(&s.recompute.mode),
            step_seconds: median(&mut step_times),
            start_rss_mib,
            peak_rss_mib: crate::monitor::process_memory_mib("VmHWM"),
        };
        if is_true_low(mode) {
            // The exported model is f32 whatever the training precision.
            model = cast_params(model, FloatDType::F32, true);
        }
        Ok(Some((summary, model.valid())))
    }

    /// Mean of every rank's gradients through the collective, one bucket of consecutive
    /// parameters at a time (each bucket is one flat buffer read back, reduced and uploaded).
    fn average_gradients(
        &self,
        model: &W::Model,
        mut grads: GradientsParams,
        buckets: &[Range<usize>],
    ) -> Result<GradientsParams> {
        let parts = grads_to_parts(model, &mut grads, &self.device);
        let mut reduced = Vec::with_capacity(parts.len());
        for bucket in buckets {
            let members = &parts[bucket.clone()];
            let sizes: Vec<usize> = members.iter().map(|p| p.dims()[0]).collect();
            let flat = Tensor::cat(members.to_vec(), 0);
            let readback = |e| Error::Worker(format!("gradient readback: {e:?}"));
            let flat = match self.settings.precision.reduce_dtype {
                ReduceDtype::F32 => {
                    let mut host = flat
                        .cast(FloatDType::F32)
                        .into_data()
                        .try_into_vec::<f32>()
                        .map_err(readback)?;
                    self.comm.all_reduce(&mut host, ReduceOp::Mean)?;
                    let n = host.len();
                    Tensor::<1>::from_data(TensorData::new(host, [n]), &self.device)
                }
                ReduceDtype::Bf16 => {
                    let mut host = flat
                        .cast(FloatDType::BF16)
                        .into_data()
                        .try_into_vec::<burn::tensor::bf16>()
                        .map_err(readback)?;
                    self.comm.all_reduce_bf16(&mut host, ReduceOp::Mean)?;
                    let n = host.len();
                    Tensor::<1>::from_data(TensorData::new(host, [n]), &self.device)
                        .cast(FloatDType::F32)
                }
            };
            let mut offset = 0;
            for size in sizes {
                reduced.push(flat.clone().slice(offset..offset + size));
                offset += size;
            }
        }
        Ok(parts_to_grads(model, reduced))
    }

    /// Brings the buffers (float state that is not trained, e.g. BatchNorm running statistics)
    /// up to date and, with several replicas, to their mean over ranks, so that every replica
    /// evaluates and saves one model. Running statistics are exponential moving averages,
    /// which are linear: averaging them only before they are used gives the same values as
    /// averaging after every step, without a collective in every step.
    fn settle_buffers(&self, model: W::Model) -> Result<W::Model> {
        sync_running_state(&model);
        if self.world() > 1 {
            self.average_buffers(model)
        } else {
            Ok(model)
        }
    }

    /// Averages the buffers over ranks.
    fn average_buffers(&self, model: W::Model) -> Result<W::Model> {
        let mut values = collect_floats(&model, false);
        if values.is_empty() {
            return Ok(model);
        }
        self.comm.all_reduce(&mut values, ReduceOp::Mean)?;
        Ok(replace_floats(model, false, values, &self.device))
    }

    /// Fails if any replica's parameters differ from rank 0's by even one bit.
    fn check_replicas(&self, model: &W::Model, step: usize) -> Result<()> {
        let mine = collect_floats(model, true);
        let all = self.comm.all_gather(&mine)?;
        let n = mine.len();
        for r in 1..self.world() {
            let other = &all[r * n..(r + 1) * n];
            if let Some(i) = (0..n).find(|&i| all[i].to_bits() != other[i].to_bits()) {
                return Err(Error::Worker(format!(
                    "replicas diverged after step {step}: rank {r} differs from rank 0 at \
                     parameter element {i} ({} vs {})",
                    other[i], all[i]
                )));
            }
        }
        Ok(())
    }

    /// Mean loss and accuracy over the whole evaluation set, each sample counted once, in the
    /// precision the replicas train in.
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

/// Rejects precision and recompute settings that cannot work with `model`, before any worker
/// starts.
fn check_policies<B, M: BlockStack<B>>(model: &M, s: &TrainerSettings) -> Result<()> {
    if is_mixed(s.precision.mode) && crate::recompute::has_buffers(model) {
        return Err(Error::config(format!(
            "key `precision.mode`: {:?} keeps f32 master weights apart from a low-precision \
             copy, but this model has buffers (BatchNorm running statistics), which Burn shares \
             between the two and updates in the compute dtype; use precision \"32\" or a \
             \"-true\" precision, or a model without BatchNorm",
            name_of(&s.precision.mode)
        )));
    }
    if s.recompute.mode == RecomputeMode::Blocks {
        if model.num_blocks() == 0 {
            return Err(Error::config(
                "key `recompute.mode`: \"blocks\" recomputes the model's blocks, but this model \
                 has none; use \"balanced\" or \"none\""
                    .to_string(),
            ));
        }
        if !model.blocks_deterministic() {
            return Err(Error::config(
                "key `recompute.mode`: \"blocks\" runs each block twice and needs both runs to \
                 agree, but this model draws random numbers in its blocks (dropout > 0); set the \
                 model's dropout to 0 or use recompute \"balanced\""
                    .to_string(),
            ));
        }
    }
    Ok(())
}

/// Folds the pending updates of Burn's `RunningState` buffers (e.g. BatchNorm statistics) into
/// their values. A `RunningState` keeps the last update of each thread aside until it is next
/// read for a forward pass, so visiting the module right after a step would see the previous
/// step's statistics; `valid` folds the pending updates in as a side effect on the shared state.
pub(crate) fn sync_running_state<M: Module>(module: &M) {
    let _ = module.valid();
}

/// The float tensors of `module` in module order, one vector each: all of them, or only those
/// that are (`Some(true)`) or are not (`Some(false)`, buffers) trained.
fn float_tensors<M: Module>(module: &M, trainable: Option<bool>) -> Vec<Vec<f32>> {
    struct Collect {
        trainable: Option<bool>,
        out: Vec<Vec<f32>>,
    }
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.trainable.is_some_and(|t| param.is_require_grad() != t) {
                return;
            }
            let data = param.val().into_data().convert::<f32>();
            self.out.push(data.iter::<f32>().collect());
        }
    }
    let mut c = Collect {
        trainable,
        out: Vec::new(),
    };
    module.visit(&mut c);
    c.out
}

/// The float tensors of `module` that are (`trainable`) or are not (buffers) trained,
/// flattened into one host buffer in module order.
pub(crate) fn collect_floats<M: Module>(module: &M, trainable: bool) -> Vec<f32> {
    float_tensors(module, Some(trainable)).concat()
}

/// Replaces the float tensors [`collect_floats`] collected with `values`.
pub(crate) fn replace_floats<M: Module>(
    module: M,
    trainable: bool,
    values: Vec<f32>,
    device: &Device,
) -> M {
    struct Replace<'a> {
        trainable: bool,
        values: Vec<f32>,
        offset: usize,
        device: &'a Device,
    }
    impl ModuleMapper for Replace<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if param.is_require_grad() != self.trainable {
                return param;
            }
            let shape = param.shape();
            let n = shape.num_elements();
            let slice = self.values[self.offset..self.offset + n].to_vec();
            self.offset += n;
            let device = self.device.clone().without_autodiff();
            let tensor = Tensor::<D>::from_data(TensorData::new(slice, shape), &device);
            param.map(|_| tensor)
        }
    }
    let mut r = Replace {
        trainable,
        values,
        offset: 0,
        device,
    };
    module.map(&mut r)
}

/// The median of `values` (sorted in place), `None` when empty.
fn median(values: &mut [f64]) -> Option<f64> {
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

/// The values of every float tensor of `module` (parameters and buffers such as BatchNorm
/// statistics), one vector per tensor in module order, for comparing replicas or runs.
pub fn parameter_values<M: Module>(module: &M) -> Vec<Vec<f32>> {
    float_tensors(module, None)
}
