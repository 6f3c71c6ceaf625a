//! `bench`: throughput of kiln's data-parallel learner, side by side in one run.
//!
//! `cargo xtask bench ddp` (or `cargo run --release -p kiln --features burn-train-bench --bin
//! bench -- ddp`) trains the same model on the same data for the same number of global steps
//! with three learners, in interleaved rounds, and prints the median of each:
//!
//! - kiln `single`, one device, batch `N·b`;
//! - kiln `ddp`, N CPU replicas, batch `b` each;
//! - kiln `ddp` with nothing watched (`dist.timeout_s = 0`, `dist.flight_entries = 0`): what
//!   the deadlines and the flight recorder of the default path cost;
//! - burn-train's `MultiDevice` strategy with `OptimMainDevice` on the same N devices, batch `b`
//!   per device.
//!
//! Every run is a whole training run (start-up, one epoch, a small validation set) timed from
//! the outside, so that no learner's own accounting is trusted.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::constant::ConstantLr;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::prelude::*;
use burn::train::logger::{EvaluationProgressLogger, InMemoryMetricLogger, TrainingProgressLogger};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn::train::{
    ClassificationOutput, ExecutionStrategy, InferenceStep, Learner, MultiDeviceOptim,
    SupervisedTraining, TrainOutput, TrainStep,
};
use kiln::RootConfig;
use kiln::builtin::image::ImageWorkload;
use kiln::config::{OptimConfig, SinkKind, TrainConfig};
use kiln::data::{ImageBatcher, input_spec};
use kiln::optim::build_optimizer;
use kiln::trainer::{TrainerSettings, fit};
use kiln_datasets::{ImageDataset, ImageSplits};
use kiln_models::{Classifier, ImageBatch, ModelKind, ModelSection, ModelSpec};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ddp") => {
            if let Err(e) = ddp(&args[1..]) {
                eprintln!("error: {e}");
                std::process::exit(2);
            }
        }
        _ => {
            eprintln!(
                "usage: bench ddp [--steps N] [--batch B] [--devices N] [--rounds R] \
                 [--model convnet|mlp] [--data DIR]"
            );
            std::process::exit(2);
        }
    }
}

struct Options {
    steps: usize,
    batch: usize,
    devices: usize,
    rounds: usize,
    model: ModelKind,
    data: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options {
        steps: 60,
        batch: 32,
        devices: 2,
        rounds: 3,
        model: ModelKind::Convnet,
        data: Some(PathBuf::from("data/mnist")),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .as_str();
        let number = || {
            value
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{flag} {value:?}: expected a positive integer"))
        };
        match flag.as_str() {
            "--steps" => o.steps = number()?,
            "--batch" => o.batch = number()?,
            "--devices" => o.devices = number()?,
            "--rounds" => o.rounds = number()?,
            "--model" => {
                o.model = match value {
                    "convnet" => ModelKind::Convnet,
                    "mlp" => ModelKind::Mlp,
                    _ => return Err(format!("--model {value:?}: expected convnet or mlp")),
                }
            }
            "--data" => o.data = Some(PathBuf::from(value)),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(o)
}

/// The training set cut to exactly `steps` global batches, and a small validation set.
fn data(o: &Options) -> Result<ImageSplits, String> {
    let full = match &o.data {
        Some(dir) if dir.is_dir() => {
            kiln_datasets::load_idx_dir(dir, "mnist").map_err(|e| e.to_string())?
        }
        _ => kiln_datasets::digits(),
    };
    let need = o.steps * o.batch * o.devices;
    let train: Vec<usize> = (0..need).map(|i| i % full.train.len()).collect();
    let test: Vec<usize> = (0..(o.batch * o.devices).min(full.test.len())).collect();
    Ok(ImageSplits {
        train: full.train.subset(&train),
        test: full.test.subset(&test),
        name: full.name,
    })
}

fn ddp(args: &[String]) -> Result<(), String> {
    let o = parse(args)?;
    let splits = data(&o)?;
    let model = ModelSection {
        kind: o.model,
        ..ModelSection::default()
    };
    let spec = ModelSpec {
        model,
        input: Some(input_spec(&splits.train)),
    };
    let optim = OptimConfig::default();
    println!(
        "bench ddp: {} {}x{} images, {} global steps of {} samples, model {:?}, {} rounds, {} cores",
        splits.name,
        splits.train.height,
        splits.train.width,
        o.steps,
        o.batch * o.devices,
        o.model,
        o.rounds,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let workload = ImageWorkload {
        spec: spec.clone(),
        splits: splits.clone(),
    };
    let kiln_run = |devices: usize, batch: usize, watched: bool| {
        time_kiln(&workload, &o, &optim, devices, batch, watched)
    };
    let mut times = DdpTimes::default();
    // One warm-up round, then interleaved measured rounds.
    for round in 0..=o.rounds {
        let s = kiln_run(1, o.batch * o.devices, true)?;
        // Watched and unwatched swap places every round, so that neither always runs first.
        let (d, u) = if round % 2 == 0 {
            let d = kiln_run(o.devices, o.batch, true)?;
            (d, kiln_run(o.devices, o.batch, false)?)
        } else {
            let u = kiln_run(o.devices, o.batch, false)?;
            (kiln_run(o.devices, o.batch, true)?, u)
        };
        let b = burn_train_multi(&spec, &splits, &optim, o.batch, o.devices);
        if round > 0 {
            times.single.push(s);
            times.multi.push(d);
            times.bare.push(u);
            times.burn.push(b);
        }
        println!(
            "  round {round}{}: single {s:.3}s  kiln ddp {d:.3}s  unwatched {u:.3}s  \
             burn-train multi {b:.3}s",
            if round == 0 { " (warm-up)" } else { "" }
        );
    }
    times.report(&o);
    Ok(())
}

/// The wall time of one kiln run of the bench's workload on `devices` devices of `batch`
/// samples each, with the collectives watched (deadlines, flight records) or not.
fn time_kiln(
    workload: &ImageWorkload,
    o: &Options,
    optim: &OptimConfig,
    devices: usize,
    batch: usize,
    watched: bool,
) -> Result<f64, String> {
    let dir = std::env::temp_dir().join(format!("kiln-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut config = RootConfig {
        train: TrainConfig {
            epochs: 1,
            batch_size: batch,
            log_every: o.steps,
            ..TrainConfig::default()
        },
        optim: optim.clone(),
        ..RootConfig::default()
    };
    config.run.seed = 1;
    config.monitor.sinks = vec![SinkKind::Jsonl];
    if !watched {
        config.dist.timeout_s = 0.0;
        config.dist.flight_entries = 0;
    }
    let settings = TrainerSettings::from_config(
        &config,
        vec![Device::flex(); devices],
        "cpu".into(),
        dir.clone(),
    );
    let started = Instant::now();
    let (summary, _) = fit(workload, &settings).map_err(|e| e.to_string())?;
    let wall = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(summary.steps, o.steps);
    Ok(wall)
}

/// The measured rounds' wall times of `bench ddp`, per kind of run.
#[derive(Default)]
struct DdpTimes {
    single: Vec<f64>,
    multi: Vec<f64>,
    bare: Vec<f64>,
    burn: Vec<f64>,
}

impl DdpTimes {
    /// Prints the medians and the ratios the bench is read by.
    fn report(mut self, o: &Options) {
        // The watch's cost, round by round (a round's two runs ran back to back).
        let mut paired: Vec<f64> = self
            .multi
            .iter()
            .zip(&self.bare)
            .map(|(d, u)| d / u)
            .collect();
        let paired = median(&mut paired);
        let (s, d) = (median(&mut self.single), median(&mut self.multi));
        let (u, b) = (median(&mut self.bare), median(&mut self.burn));
        let per = |t: f64| 1000.0 * t / o.steps as f64;
        let samples = (o.steps * o.batch * o.devices) as f64;
        println!("median wall time per run (per global batch):");
        println!(
            "  kiln single, batch {}            {s:.3}s ({:.2} ms)",
            o.batch * o.devices,
            per(s)
        );
        println!(
            "  kiln ddp, {} x batch {}           {d:.3}s ({:.2} ms)",
            o.devices,
            o.batch,
            per(d)
        );
        println!(
            "  kiln ddp unwatched, {} x batch {} {u:.3}s ({:.2} ms)",
            o.devices,
            o.batch,
            per(u)
        );
        println!(
            "  burn-train MultiDevice, {} x {}   {b:.3}s ({:.2} ms)",
            o.devices,
            o.batch,
            per(b)
        );
        println!("ratios:");
        println!(
            "  ddp / single time per global batch        {:.3}  (goal <= 1.10)",
            d / s
        );
        println!(
            "  ddp / ddp unwatched (deadlines, flight)   {:.3}  (goal <= 1.02; median of the \
             rounds' own ratios {paired:.3})",
            d / u
        );
        println!(
            "  kiln ddp / burn-train throughput          {:.3}  (goal >= 1.3; {:.0} vs {:.0} samples/s)",
            b / d,
            samples / d,
            samples / b
        );
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The classifier as burn-train wants it.
#[derive(Module, Debug)]
struct BurnTrainModel {
    inner: Classifier,
}

impl TrainStep for BurnTrainModel {
    type Input = ImageBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: ImageBatch) -> TrainOutput<ClassificationOutput> {
        let logits = self.inner.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        let out = ClassificationOutput {
            loss: loss.clone(),
            output: logits,
            targets: batch.targets,
        };
        TrainOutput::new(self, loss.backward(), out)
    }
}

impl InferenceStep for BurnTrainModel {
    type Input = ImageBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: ImageBatch) -> ClassificationOutput {
        let logits = self.inner.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput {
            loss,
            output: logits,
            targets: batch.targets,
        }
    }
}

#[derive(Clone)]
struct IndexBatcher(Arc<ImageDataset>);

impl Batcher<usize, ImageBatch> for IndexBatcher {
    fn batch(&self, items: Vec<usize>, device: &Device) -> ImageBatch {
        ImageBatcher::new(device.clone()).batch(&self.0, &items)
    }
}

fn loader(data: &ImageDataset, batch: usize) -> Arc<dyn DataLoader<ImageBatch>> {
    DataLoaderBuilder::new(IndexBatcher(Arc::new(data.clone())))
        .batch_size(batch)
        .build(InMemDataset::new((0..data.len()).collect::<Vec<usize>>()))
}

/// One epoch of burn-train's own multi-device learner; returns its wall time.
fn burn_train_multi(
    spec: &ModelSpec,
    splits: &ImageSplits,
    optim: &OptimConfig,
    batch: usize,
    devices: usize,
) -> f64 {
    let dir = std::env::temp_dir().join(format!("kiln-bench-burn-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let started = Instant::now();
    let device = Device::flex().autodiff();
    device.seed(1);
    let model = BurnTrainModel {
        inner: spec.classifier(&device).expect("an image model"),
    };
    let optim_built = build_optimizer(optim, &model);
    let learner = Learner::new(model, optim_built, ConstantLr::new(optim.lr));
    let strategy = ExecutionStrategy::multi(
        vec![Device::flex(); devices],
        MultiDeviceOptim::OptimMainDevice,
    );
    let _ = SupervisedTraining::new(
        &dir,
        loader(&splits.train, batch),
        loader(&splits.test, batch),
    )
    .num_epochs(1)
    .with_training_strategy(strategy.into())
    .with_metric_logger(InMemoryMetricLogger::new())
    .with_application_logger(None)
    .renderer(Box::new(Quiet))
    .launch(learner);
    let wall = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    wall
}

/// A renderer that draws nothing, so that burn-train is not charged for terminal output.
struct Quiet;

impl MetricsRendererTraining for Quiet {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
}

impl MetricsRendererEvaluation for Quiet {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl TrainingProgressLogger for Quiet {
    fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _: usize) {}
    fn start_split(&mut self, _: &str, _: usize) {}
    fn update_split(&mut self, _: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _: String) {}
}

impl EvaluationProgressLogger for Quiet {
    fn start_global_progress(&mut self, _: usize) {}
    fn start_test(&mut self, _: &str, _: usize) {}
    fn update_test_progress(&mut self, _: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _: String) {}
}

impl MetricsRenderer for Quiet {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: burn::train::metric::MetricDefinition) {}
}
