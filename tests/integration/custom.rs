//! A model kiln does not ship, trained through the library API as another crate would: two
//! devices, resume, the exported weights loaded back, the features that need a block stack
//! refusing a model without one, precision, callbacks, schedules and whole-set metrics.

use std::ops::Range;
use std::path::Path;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln::{BlockStack, RunInfo, RunOptions, StepOutput, TrainStep, Workload, train_workload};
use kiln_models::ImageBatch;

use crate::common::{max_relative_diff, small_config, temp_dir, train_losses};

/// A small classifier of one's own: two linear layers with a tanh between.
#[derive(Module, Debug)]
struct Tiny {
    hidden: Linear,
    out: Linear,
}

impl Tiny {
    fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(64, 24).init(device),
            out: LinearConfig::new(24, 10).init(device),
        }
    }

    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        self.out
            .forward(self.hidden.forward(images.flatten(1, 3)).tanh())
    }
}

impl TrainStep<ImageBatch> for Tiny {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        let samples = batch.targets.dims()[0];
        let logits = self.forward(batch.images).cast(FloatDType::F32);
        let correct = logits
            .clone()
            .argmax(1)
            .squeeze_dim::<1>(1)
            .equal(batch.targets.clone())
            .int()
            .sum();
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.targets);
        StepOutput::new(loss, samples).with_correct(correct)
    }
}

/// No block stack described.
impl BlockStack<ImageBatch> for Tiny {}

/// The embedded digits for `Tiny`.
struct TinyDigits(kiln_datasets::ImageSplits);

impl Workload for TinyDigits {
    type Model = Tiny;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Tiny {
        Tiny::new(device)
    }
    fn train_len(&self) -> usize {
        self.0.train.len()
    }
    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        kiln::data::ImageBatcher::new(device.clone()).batch(&self.0.train, indices)
    }
    fn eval_len(&self) -> usize {
        self.0.test.len()
    }
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
        let indices: Vec<usize> = range.collect();
        kiln::data::ImageBatcher::new(device.clone()).batch(&self.0.test, &indices)
    }
    fn cast_batch(&self, batch: ImageBatch, dtype: FloatDType) -> ImageBatch {
        ImageBatch {
            images: batch.images.cast(dtype),
            ..batch
        }
    }
}

/// The data methods of a workload on the embedded digits, delegated to its `TinyDigits` in
/// field `$field`.
macro_rules! digits_data {
    ($field:tt) => {
        fn train_len(&self) -> usize {
            self.$field.train_len()
        }
        fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
            self.$field.train_batch(indices, device)
        }
        fn eval_len(&self) -> usize {
            self.$field.eval_len()
        }
        fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
            self.$field.eval_batch(range, device)
        }
        fn cast_batch(&self, batch: ImageBatch, dtype: FloatDType) -> ImageBatch {
            self.$field.cast_batch(batch, dtype)
        }
    };
}

fn run(config: &kiln::builtin::Config, resume: Option<&Path>) -> kiln::Result<kiln::RunResult> {
    let options = RunOptions {
        resume_from: resume.map(Path::to_path_buf),
        ..RunOptions::default()
    };
    let info = RunInfo {
        model: "tiny".into(),
        ..RunInfo::default()
    };
    train_workload(
        &config.kiln,
        &options,
        &TinyDigits(kiln_datasets::digits()),
        info,
        |dir| {
            std::fs::write(dir.join("tiny.txt"), "a model of one's own")
                .map_err(|e| kiln::Error::io(dir, e))
        },
    )
}

#[test]
fn a_model_of_ones_own_trains_on_two_devices_resumes_and_exports() {
    let dir = temp_dir("custom");
    let o = [
        "hardware.devices=2",
        "train.max_steps=8",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=10",
        "train.check_replicas=true",
    ];
    let full = run(&small_config(&dir.join("full"), &o), None).unwrap();
    assert_eq!(full.summary.strategy, "ddp");
    assert!(full.dir.join("tiny.txt").is_file());
    let saved = std::fs::read_to_string(full.dir.join("config.toml")).unwrap();
    assert!(
        !saved.contains("[model"),
        "the built-in model section is left out: {saved}"
    );

    // Resume from step 4: the same losses, bit for bit.
    let cut = dir.join("cut");
    crate::training::cut_copy(&full.dir, &cut, 4);
    let (run_dir, ckpt) = kiln::run::resolve_resume(&cut).unwrap();
    let config = small_config(&run_dir, &o);
    run(&config, Some(&ckpt)).unwrap();
    assert_eq!(train_losses(&cut), train_losses(&full.dir));

    // The exported weights load into the user's own module and score what the run reported.
    let device = Device::flex();
    let model = Tiny::new(&device)
        .try_load_file(full.dir.join("model.bpk"))
        .unwrap();
    let splits = kiln_datasets::digits();
    let indices: Vec<usize> = (0..splits.test.len()).collect();
    let batch = kiln::data::ImageBatcher::new(device.clone()).batch(&splits.test, &indices);
    let correct: i64 = model.step(batch).correct.unwrap().into_scalar();
    let accuracy = correct as f64 / splits.test.len() as f64;
    assert!((accuracy - full.summary.val_accuracy.unwrap()).abs() < 1e-9);

    // ZeRO-1 shards its optimizer state (it needs no blocks) and matches ddp.
    let ddp = kiln::trainer::parameter_values(&model);
    let zero1 = run(
        &small_config(
            &dir.join("zero1"),
            &[
                "hardware.devices=2",
                "train.max_steps=8",
                "strategy.name=\"zero1\"",
            ],
        ),
        None,
    )
    .unwrap();
    let z = Tiny::new(&device)
        .try_load_file(zero1.dir.join("model.bpk"))
        .unwrap();
    let d = max_relative_diff(&kiln::trainer::parameter_values(&z), &ddp);
    assert!(d <= 1e-6, "zero1 vs ddp {d:e}");
}

#[test]
fn what_needs_a_block_stack_refuses_a_model_without_one() {
    let dir = temp_dir("custom-refusals");
    for (name, o, key) in [
        (
            "zero3",
            &["hardware.devices=2", "strategy.name=\"zero3\""][..],
            "strategy.name",
        ),
        (
            "zero2",
            &["hardware.devices=2", "strategy.name=\"zero2\""][..],
            "strategy.name",
        ),
        (
            "blocks",
            &["recompute.mode=\"blocks\""][..],
            "recompute.mode",
        ),
        (
            "syncbn",
            &["hardware.devices=2", "ddp.sync_batchnorm=true"][..],
            "ddp.sync_batchnorm",
        ),
        (
            "pipeline",
            &[
                "hardware.devices=2",
                "strategy.name=\"pipeline\"",
                "pipeline.stages=2",
            ][..],
            "pipeline.stages",
        ),
    ] {
        let mut all = vec!["train.max_steps=2"];
        all.extend_from_slice(o);
        let e = run(&small_config(&dir.join(name), &all), None)
            .unwrap_err()
            .to_string();
        println!("{name}: {e}");
        assert!(e.starts_with("config error:"), "{name}: {e}");
        assert!(e.contains(key), "{name}: {e}");
        assert!(e.contains("block"), "{name}: {e}");
    }
}

/// A recurrent cell of one's own that builds its zero state inside its forward, as an LSTM
/// does: in the device's default dtype (f32), or, `state_like_input`, in its input's.
#[derive(Module, Debug)]
struct Carry {
    input: Linear,
    recur: Linear,
    out: Linear,
    state_like_input: bool,
}

impl TrainStep<ImageBatch> for Carry {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        let samples = batch.targets.dims()[0];
        let x = self.input.forward(batch.images.flatten(1, 3));
        let device = x.device();
        let mut state = if self.state_like_input {
            Tensor::zeros([samples, 24], (&device, x.dtype()))
        } else {
            Tensor::zeros([samples, 24], &device)
        };
        for _ in 0..2 {
            state = (x.clone() + self.recur.forward(state)).tanh();
        }
        let logits = self.out.forward(state).cast(FloatDType::F32);
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, batch.targets);
        StepOutput::new(loss, samples)
    }
}

impl BlockStack<ImageBatch> for Carry {}

/// The embedded digits for `Carry`.
struct CarryDigits {
    digits: TinyDigits,
    state_like_input: bool,
}

impl Workload for CarryDigits {
    type Model = Carry;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Carry {
        Carry {
            input: LinearConfig::new(64, 24).init(device),
            recur: LinearConfig::new(24, 24).init(device),
            out: LinearConfig::new(24, 10).init(device),
            state_like_input: self.state_like_input,
        }
    }
    digits_data!(digits);
}

#[test]
fn a_model_that_creates_tensors_in_its_forward_is_refused_in_one_line_or_trains_in_bf16() {
    let dir = temp_dir("custom-carry");
    for mode in ["bf16-mixed", "bf16-true"] {
        for state_like_input in [false, true] {
            let run_dir = dir.join(format!("{mode}-{state_like_input}"));
            let mode_key = format!("precision.mode={mode:?}");
            let config = small_config(
                &run_dir,
                &["hardware.devices=2", "train.max_steps=4", &mode_key],
            );
            let workload = CarryDigits {
                digits: TinyDigits(kiln_datasets::digits()),
                state_like_input,
            };
            let info = RunInfo {
                model: "carry".into(),
                ..RunInfo::default()
            };
            let result = train_workload(
                &config.kiln,
                &RunOptions::default(),
                &workload,
                info,
                |_| Ok(()),
            );
            if state_like_input {
                let result = result.unwrap();
                let losses = train_losses(&result.dir);
                assert_eq!(losses.len(), 4, "{mode}");
                assert!(
                    losses.iter().all(|(_, l)| f64::from_bits(*l).is_finite()),
                    "{mode}"
                );
            } else {
                let e = result.unwrap_err().to_string();
                println!("{mode}: {e}");
                assert!(e.starts_with("config error:"), "{e}");
                assert!(!e.contains('\n'), "{e}");
                for part in ["precision.mode", mode, "dtype mismatch", "Tensor::zeros"] {
                    assert!(e.contains(part), "{part}: {e}");
                }
                assert!(
                    !run_dir.exists(),
                    "the refused run wrote {}",
                    run_dir.display()
                );
            }
        }
    }
}

/// The refusal of the start-up probe, as a process of its own prints it: run by
/// `the_probe_refusal_prints_one_line_and_no_panic_with_rust_backtrace_set` with
/// `RUST_BACKTRACE=1`, which reads what this process wrote.
#[test]
#[ignore = "run as a child process by the_probe_refusal_prints_one_line_and_no_panic_with_rust_backtrace_set"]
fn probe_refusal_child() {
    let dir = temp_dir("custom-probe-child");
    let run_dir = dir.join("run");
    let config = small_config(
        &run_dir,
        &["train.max_steps=2", "precision.mode=\"bf16-mixed\""],
    );
    let workload = CarryDigits {
        digits: TinyDigits(kiln_datasets::digits()),
        state_like_input: false,
    };
    let e = train_workload(
        &config.kiln,
        &RunOptions::default(),
        &workload,
        RunInfo::default(),
        |_| Ok(()),
    )
    .unwrap_err();
    eprintln!("refused: {e}");
}

#[test]
fn the_probe_refusal_prints_one_line_and_no_panic_with_rust_backtrace_set() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "custom::probe_refusal_child",
            "--ignored",
            "--nocapture",
        ])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{all}");
    let refusal: Vec<&str> = all.lines().filter(|l| l.starts_with("refused: ")).collect();
    assert_eq!(refusal.len(), 1, "{all}");
    assert!(refusal[0].contains("precision.mode"), "{all}");
    for noise in ["panicked", "stack backtrace", "burn_flex"] {
        assert!(
            !all.contains(noise),
            "the probe's panic reached the terminal ({noise}): {all}"
        );
    }
}

/// `TinyDigits` with a schedule of its own: the configured rate over (1 + step).
struct Harmonic(TinyDigits);

impl Workload for Harmonic {
    type Model = Tiny;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Tiny {
        self.0.init_model(device)
    }
    digits_data!(0);
    fn lr(&self, _group: usize, step: usize, scheduled: f64) -> f64 {
        scheduled / (1 + step) as f64
    }
}

#[test]
fn a_workload_sets_the_rate_as_a_function_of_the_step() {
    let dir = temp_dir("custom-lr");
    let config = small_config(&dir.join("run"), &["train.max_steps=4", "optim.lr=0.012"]);
    let result = train_workload(
        &config.kiln,
        &RunOptions::default(),
        &Harmonic(TinyDigits(kiln_datasets::digits())),
        RunInfo::default(),
        |_| Ok(()),
    )
    .unwrap();
    let lrs: Vec<f64> = crate::common::metrics(&result.dir, "train")
        .iter()
        .map(|r| r["lr"].as_f64().unwrap())
        .collect();
    assert_eq!(lrs.len(), 4);
    for (step, lr) in lrs.iter().enumerate() {
        let want = 0.012 / (1 + step) as f64;
        assert!((lr - want).abs() < 1e-15, "step {step}: {lr} vs {want}");
    }
}

/// A regression of one's own: the digit's value from its pixels, scored over the whole
/// validation set by R² and by the AUC of "is it 5 or more".
#[derive(Module, Debug)]
struct Regression {
    linear: Linear,
}

impl Regression {
    fn predict(&self, images: Tensor<4>) -> Tensor<1> {
        let x: Tensor<2> = images.flatten(1, 3);
        self.linear.forward(x).cast(FloatDType::F32).flatten(0, 1)
    }
}

impl TrainStep<ImageBatch> for Regression {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        let samples = batch.targets.dims()[0];
        let predictions = self.predict(batch.images);
        let targets = batch.targets.float().div_scalar(9.0);
        let loss = (predictions.clone() - targets.clone())
            .powi_scalar(2)
            .mean();
        let high = targets.clone().greater_equal_elem(5.0 / 9.0).float();
        StepOutput::new(loss, samples)
            .with_set_metric(kiln::SetMetric::r2("r2", predictions.clone(), targets))
            .with_set_metric(kiln::SetMetric::auc("auc", predictions, high))
    }
}

impl BlockStack<ImageBatch> for Regression {}

struct RegressionDigits(TinyDigits);

impl Workload for RegressionDigits {
    type Model = Regression;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Regression {
        Regression {
            linear: LinearConfig::new(64, 1).init(device),
        }
    }
    digits_data!(0);
}

#[test]
fn whole_set_metrics_equal_a_direct_computation_on_one_and_three_devices() {
    let dir = temp_dir("custom-set-metrics");
    let splits = kiln_datasets::digits();
    let device = Device::flex();
    for (devices, batch) in [(1, 24), (3, 8)] {
        let config = small_config(
            &dir.join(format!("run-{devices}")),
            &[
                &format!("hardware.devices={devices}"),
                &format!("train.batch_size={batch}"),
                "train.max_steps=60",
                "optim.lr=0.02",
            ],
        );
        let workload = RegressionDigits(TinyDigits(kiln_datasets::digits()));
        let result = train_workload(
            &config.kiln,
            &RunOptions::default(),
            &workload,
            RunInfo::default(),
            |_| Ok(()),
        )
        .unwrap();
        let last = crate::common::metrics(&result.dir, "val").pop().unwrap();
        let (r2, auc) = (last["r2"].as_f64().unwrap(), last["auc"].as_f64().unwrap());

        // The same over every validation sample at once, in f64.
        let model = workload
            .init_model(&device)
            .try_load_file(result.dir.join("model.bpk"))
            .unwrap();
        let indices: Vec<usize> = (0..splits.test.len()).collect();
        let b = kiln::data::ImageBatcher::new(device.clone()).batch(&splits.test, &indices);
        let p: Vec<f64> = model
            .predict(b.images)
            .into_data()
            .convert::<f64>()
            .try_into_vec()
            .unwrap();
        let y: Vec<f64> = b
            .targets
            .into_data()
            .convert::<f64>()
            .try_into_vec::<f64>()
            .unwrap()
            .into_iter()
            .map(|t| t / 9.0)
            .collect();
        let mean = y.iter().sum::<f64>() / y.len() as f64;
        let sse: f64 = y.iter().zip(&p).map(|(y, p)| (y - p).powi(2)).sum();
        let sst: f64 = y.iter().map(|y| (y - mean).powi(2)).sum();
        let direct_r2 = 1.0 - sse / sst;
        let (mut ordered, mut pairs) = (0.0, 0.0);
        for (pi, yi) in p.iter().zip(&y) {
            for (pj, yj) in p.iter().zip(&y) {
                if *yi >= 5.0 / 9.0 && *yj < 5.0 / 9.0 {
                    pairs += 1.0;
                    ordered += if pi > pj {
                        1.0
                    } else if pi == pj {
                        0.5
                    } else {
                        0.0
                    };
                }
            }
        }
        let direct_auc = ordered / pairs;
        println!(
            "{devices} devices: r2 {r2} (direct {direct_r2}), auc {auc} (direct {direct_auc})"
        );
        assert!(
            (r2 - direct_r2).abs() < 1e-5,
            "{devices}: r2 {r2} vs {direct_r2}"
        );
        assert!(
            (auc - direct_auc).abs() < 1e-6,
            "{devices}: auc {auc} vs {direct_auc}"
        );
        assert!(
            direct_r2 > 0.0 && direct_auc > 0.5,
            "the model learnt something"
        );
    }
}

/// An event as a callback saw it: kind, step, the names of the values, the model's weights.
type Seen = (kiln::EventKind, usize, Vec<String>, Vec<Vec<f32>>);

/// `TinyDigits` with callbacks that write down what they see (and fail at step `fail_at`).
struct Watching {
    inner: TinyDigits,
    seen: std::sync::Mutex<Vec<Seen>>,
    fail_at: Option<usize>,
    drop_last: bool,
}

impl Workload for Watching {
    type Model = Tiny;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Tiny {
        self.inner.init_model(device)
    }
    digits_data!(inner);
    fn drop_last(&self) -> bool {
        self.drop_last
    }
    fn describe(&self) -> Vec<(String, String)> {
        vec![("data".into(), "the embedded digits, watched".into())]
    }
    fn events(&self) -> &[kiln::EventKind] {
        &[
            kiln::EventKind::Logged,
            kiln::EventKind::Validated,
            kiln::EventKind::EpochEnd,
        ]
    }
    fn on_event(&self, event: &kiln::Event<'_>, model: &Tiny) -> kiln::Result<()> {
        if self.fail_at == Some(event.step) {
            return Err(kiln::Error::Training(format!(
                "my callback refuses step {}",
                event.step
            )));
        }
        let names = event.metrics.iter().map(|(n, _)| n.clone()).collect();
        let weights = kiln::trainer::parameter_values(model);
        self.seen
            .lock()
            .unwrap()
            .push((event.kind, event.step, names, weights));
        Ok(())
    }
}

#[test]
fn callbacks_see_logged_steps_validations_and_epoch_ends_with_the_model() {
    use kiln::EventKind::{EpochEnd, Logged, Validated};
    let dir = temp_dir("custom-callbacks");
    // 1437 samples, 2 × 128 per step: 6 steps an epoch (the last wraps around).
    let o = [
        "hardware.devices=2",
        "train.batch_size=128",
        "train.max_steps=7",
        "train.log_every=2",
        "train.val_every=4",
        "train.epochs=0",
    ];
    let workload = Watching {
        inner: TinyDigits(kiln_datasets::digits()),
        seen: Default::default(),
        fail_at: None,
        drop_last: false,
    };
    let result = train_workload(
        &small_config(&dir.join("run"), &o).kiln,
        &RunOptions::default(),
        &workload,
        RunInfo::default(),
        |_| Ok(()),
    )
    .unwrap();
    let seen = workload.seen.into_inner().unwrap();
    let steps = |kind| -> Vec<usize> { seen.iter().filter(|e| e.0 == kind).map(|e| e.1).collect() };
    assert_eq!(steps(Logged), [2, 4, 6, 7]);
    assert_eq!(steps(Validated), [4, 6, 7]);
    assert_eq!(steps(EpochEnd), [6]);
    let names = |kind| seen.iter().find(|e| e.0 == kind).unwrap().2.clone();
    assert_eq!(names(Logged), ["loss", "lr", "samples_per_sec"]);
    assert_eq!(names(Validated), ["loss", "accuracy"]);
    // The model a callback sees is the run's: after the last step, the exported weights.
    let last = &seen.last().unwrap().3;
    let exported = Tiny::new(&Device::flex())
        .try_load_file(result.dir.join("model.bpk"))
        .unwrap();
    assert_eq!(last, &kiln::trainer::parameter_values(&exported));

    // A callback's error ends the run on every rank, naming it.
    let failing = Watching {
        inner: TinyDigits(kiln_datasets::digits()),
        seen: Default::default(),
        fail_at: Some(4),
        drop_last: false,
    };
    let e = train_workload(
        &small_config(&dir.join("failing"), &o).kiln,
        &RunOptions::default(),
        &failing,
        RunInfo::default(),
        |_| Ok(()),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("my callback refuses step 4"), "{e}");

    // A workload that drops the last incomplete batch has 5 steps an epoch.
    let dropping = Watching {
        inner: TinyDigits(kiln_datasets::digits()),
        seen: Default::default(),
        fail_at: None,
        drop_last: true,
    };
    train_workload(
        &small_config(&dir.join("drop-last"), &o).kiln,
        &RunOptions::default(),
        &dropping,
        RunInfo::default(),
        |_| Ok(()),
    )
    .unwrap();
    let seen = dropping.seen.into_inner().unwrap();
    let ends: Vec<usize> = seen
        .iter()
        .filter(|e| e.0 == EpochEnd)
        .map(|e| e.1)
        .collect();
    assert_eq!(ends, [5]);
}
