//! Precision and recompute, the policies kiln applies around a model from outside: block
//! recomputation gives the gradients of the plain backward, mixed precision trains as well as
//! f32, the loss scaler skips overflowing steps on every replica, and both run with several
//! devices and accumulation.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use kiln::builtin::image::ImageWorkload;
use kiln::builtin::train;
use kiln::config::StrategyKind;
use kiln::exec::{Recompute, forward_backward};
use kiln::run::RunOptions;
use kiln::trainer::{TrainerSettings, Workload, fit, parameter_values};
use kiln_models::{
    Classifier, ConvNetConfig, GptConfig, ImageBatch, InputSpec, ModelSpec, TokenBatch,
};

use crate::common::{
    assert_one_line_error, max_relative_diff, metrics, small_config, temp_dir, train_bin,
};
use crate::gpt::{gpt_config, text_file};

/// Recomputed gradients are the same numbers summed in another order.
const RECOMPUTE_PARITY: f64 = 1e-6;

/// The gradient of every trained parameter, in module order.
fn grad_values<M: Module>(model: &M, grads: &GradientsParams) -> Vec<Vec<f32>> {
    struct Collect<'a> {
        grads: &'a GradientsParams,
        out: Vec<Vec<f32>>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_require_grad() {
                return;
            }
            let g = self
                .grads
                .get::<D>(param.id)
                .expect("a gradient for every trained parameter");
            self.out
                .push(g.into_data().convert::<f32>().iter::<f32>().collect());
        }
    }
    let mut c = Collect {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut c);
    c.out
}

/// Gradients of `model` on `batch()` with and without block recomputation (every block, and
/// every second block).
fn recompute_gap<M, B>(model: &M, batch: impl Fn() -> B, device: &Device) -> (f64, f64)
where
    M: kiln_models::BlockStack<B> + Module,
{
    let (out, plain) = forward_backward(model, batch(), device, Recompute::Keep, |l| l);
    let plain = grad_values(model, &plain);
    let mut gaps = [0.0; 2];
    for (gap, every) in gaps.iter_mut().zip([1, 2]) {
        let (again, grads) =
            forward_backward(model, batch(), device, Recompute::Blocks { every }, |l| l);
        let a: f32 = out.loss.clone().into_scalar();
        let b: f32 = again.loss.into_scalar();
        assert_eq!(a.to_bits(), b.to_bits(), "loss {a} vs {b}");
        *gap = max_relative_diff(&grad_values(model, &grads), &plain);
    }
    (gaps[0], gaps[1])
}

#[test]
fn recomputed_blocks_give_the_plain_gradients_for_the_gpt() {
    let device = Device::flex().autodiff();
    let model = kiln_models::with_rng(|| {
        device.seed(3);
        kiln_models::materialized(
            GptConfig {
                n_layer: 3,
                n_head: 2,
                n_embd: 16,
                block_size: 8,
                vocab_size: 13,
                dropout: 0.0,
                bias: true,
            }
            .init(&device),
        )
    });
    let ids: Vec<i64> = (0..4 * 8).map(|i| (i * 5 + 1) % 13).collect();
    let batch = || {
        TokenBatch::new(
            Tensor::from_data(TensorData::new(ids.clone(), [4, 8]), &device),
            Tensor::from_data(
                TensorData::new(ids.iter().map(|i| (i + 1) % 13).collect::<Vec<_>>(), [4, 8]),
                &device,
            ),
        )
    };
    let (all, every_second) = recompute_gap(&model, batch, &device);
    println!("gpt: recompute gap {all:.3e} (every block), {every_second:.3e} (every 2nd)");
    assert!(all <= RECOMPUTE_PARITY, "{all}");
    assert!(every_second <= RECOMPUTE_PARITY, "{every_second}");
}

#[test]
fn recomputed_blocks_give_the_plain_gradients_for_the_convnet_and_keep_batchnorm_state() {
    let device = Device::flex().autodiff();
    let input = InputSpec {
        channels: 1,
        height: 8,
        width: 8,
        num_classes: 10,
    };
    let build = || {
        kiln_models::with_rng(|| {
            device.seed(5);
            kiln_models::materialized(
                ConvNetConfig {
                    channels: vec![4, 8],
                    kernel_size: 3,
                    batch_norm: true,
                }
                .init(&input, &device),
            )
        })
    };
    let pixels: Vec<f32> = (0..6 * 64).map(|i| ((i * 37) % 17) as f32 / 17.0).collect();
    let batch = || ImageBatch {
        images: Tensor::from_data(TensorData::new(pixels.clone(), [6, 1, 8, 8]), &device),
        targets: Tensor::from_data(TensorData::new(vec![0i64, 3, 5, 7, 9, 1], [6]), &device),
    };
    let model = build();
    let (all, every_second) = recompute_gap(&model, batch, &device);
    println!("convnet: recompute gap {all:.3e} (every block), {every_second:.3e} (every 2nd)");
    assert!(all <= RECOMPUTE_PARITY, "{all}");
    assert!(every_second <= RECOMPUTE_PARITY, "{every_second}");

    // Running statistics see each batch once, recomputed or not.
    let plain = build();
    let _ = forward_backward(&plain, batch(), &device, Recompute::Keep, |l| l);
    let recomputed = build();
    let _ = forward_backward(
        &recomputed,
        batch(),
        &device,
        Recompute::Blocks { every: 1 },
        |l| l,
    );
    assert_eq!(
        parameter_values(&plain.valid()),
        parameter_values(&recomputed.valid())
    );
}

/// Final parameters of a short run of `config`.
fn run_params(config: &kiln::builtin::Config) -> Vec<Vec<f32>> {
    let result = train(config, &RunOptions::default()).unwrap();
    parameter_values(&result_model(&result.dir))
}

fn result_model(dir: &std::path::Path) -> kiln_models::Gpt {
    kiln_models::load_family_run::<kiln_models::Gpt>(dir, &Device::flex())
        .unwrap()
        .0
}

#[test]
fn recompute_in_ddp_with_accumulation_matches_the_plain_run() {
    let dir = temp_dir("recompute-ddp");
    let text = text_file(&dir);
    let common = [
        "train.max_steps=3",
        "hardware.devices=2",
        "train.accumulate=2",
        "train.batch_size=4",
        "train.check_replicas=true",
        "model.gpt.n_layer=3",
    ];
    let plain = run_params(&gpt_config(&dir.join("plain"), &text, &common));
    let mut with = common.to_vec();
    with.push("recompute.mode=\"blocks\"");
    let blocks = run_params(&gpt_config(&dir.join("blocks"), &text, &with));
    let gap = max_relative_diff(&blocks, &plain);
    println!("gpt ddp×2, accumulate 2: blocks vs none {gap:.3e}");
    assert!(gap <= RECOMPUTE_PARITY, "{gap}");

    // The ConvNet (with BatchNorm) through the whole loop, every second block recomputed.
    let convnet = |name: &str, extra: &[&str]| {
        let mut o = vec![
            "hardware.devices=2",
            "train.max_steps=3",
            "train.check_replicas=true",
            "model.convnet.channels=[4, 8, 8]",
        ];
        o.extend_from_slice(extra);
        let result = train(&small_config(&dir.join(name), &o), &RunOptions::default()).unwrap();
        parameter_values(&kiln_models::load_run(&result.dir, &Device::flex()).unwrap())
    };
    let plain = convnet("conv-plain", &[]);
    let blocks = convnet(
        "conv-blocks",
        &["recompute.mode=\"blocks\"", "recompute.every=2"],
    );
    let gap = max_relative_diff(&blocks, &plain);
    println!("convnet ddp×2: blocks(every 2) vs none {gap:.3e}");
    assert!(gap <= RECOMPUTE_PARITY, "{gap}");
}

fn final_losses(dir: &std::path::Path) -> (f64, f64) {
    let train = metrics(dir, "train");
    let val = metrics(dir, "val");
    (
        train.last().unwrap()["loss"].as_f64().unwrap(),
        val.last().unwrap()["loss"].as_f64().unwrap(),
    )
}

/// Sentences of words drawn by a fixed generator: a text with some entropy left after
/// training, so that losses are compared where rounding noise would show.
fn varied_text(dir: &std::path::Path) -> std::path::PathBuf {
    const WORDS: [&str; 24] = [
        "the", "whale", "sea", "ship", "captain", "white", "deep", "harpoon", "sailed", "and", "a",
        "storm", "rose", "over", "waves", "crew", "night", "wind", "of", "cold", "north", "boat",
        "line", "sank",
    ];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let mut text = String::new();
    for _ in 0..1500 {
        let len = 4 + next(6);
        let words: Vec<&str> = (0..len).map(|_| WORDS[next(WORDS.len())]).collect();
        text += &words.join(" ");
        text += ". ";
    }
    let path = dir.join("varied.txt");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn mixed_precision_trains_the_gpt_as_well_as_f32_with_f32_master_weights() {
    let dir = temp_dir("precision");
    let text = varied_text(&dir);
    let run = |mode: &str| {
        let run_dir = dir.join(mode);
        let config = gpt_config(
            &run_dir,
            &text,
            &[
                "train.max_steps=200",
                "train.log_every=50",
                &format!("precision.mode={mode:?}"),
            ],
        );
        let result = train(&config, &RunOptions::default()).unwrap();
        assert_eq!(result.summary.precision, mode);
        final_losses(&run_dir)
    };
    let (f32_train, f32_val) = run("32");
    for mode in ["bf16-mixed", "16-mixed"] {
        let (train_loss, val_loss) = run(mode);
        println!(
            "{mode}: train {train_loss:.4} (f32 {f32_train:.4}), val {val_loss:.4} (f32 {f32_val:.4})"
        );
        assert!((train_loss - f32_train).abs() <= 0.02 * f32_train, "{mode}");
        assert!((val_loss - f32_val).abs() <= 0.02 * f32_val, "{mode}");
    }
    // The 16-mixed run logged its scale.
    let scaled = metrics(&dir.join("16-mixed"), "train");
    assert!(scaled.iter().all(|r| r["loss_scale"].as_f64().is_some()));

    // The master copy the optimizer steps stays f32; the compute copy is bf16.
    let config = small_config(
        &dir.join("master"),
        &[
            "model.kind=\"mlp\"",
            "train.max_steps=2",
            "precision.mode=\"bf16-mixed\"",
        ],
    );
    let workload = image_workload(&config);
    let settings = TrainerSettings::from_config(
        &config.kiln,
        vec![Device::flex()],
        "cpu".into(),
        dir.join("master"),
    );
    let (_, model) = fit(&workload, &settings).unwrap();
    assert!(float_dtypes(&model).iter().all(|d| *d == DType::F32));
    // The compute copy cast from a training replica is bf16 and keeps the parameter ids, so
    // its gradients land on the master parameters.
    let replica = workload.init_model(&Device::flex().autodiff());
    let compute = kiln::precision::cast_params(replica.clone(), FloatDType::BF16, false);
    assert!(float_dtypes(&compute).iter().all(|d| *d == DType::BF16));
    assert_eq!(param_ids(&compute), param_ids(&replica));
}

fn param_ids<M: Module>(module: &M) -> Vec<burn::module::ParamId> {
    struct Ids(Vec<burn::module::ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

fn image_workload(config: &kiln::builtin::Config) -> ImageWorkload {
    let splits = kiln_datasets::digits();
    ImageWorkload {
        spec: ModelSpec {
            model: config.model.clone(),
            input: Some(kiln::data::input_spec(&splits.train)),
        },
        splits,
    }
}

fn float_dtypes<M: Module>(module: &M) -> Vec<DType> {
    struct Dtypes(Vec<DType>);
    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().dtype());
        }
    }
    let mut d = Dtypes(Vec::new());
    module.visit(&mut d);
    assert!(!d.0.is_empty());
    d.0
}

/// The image workload, except that rank 1's batch of micro-step `poison` is all infinities.
struct Poisoned {
    inner: ImageWorkload,
    poison: usize,
    seen: std::sync::atomic::AtomicUsize,
}

impl Workload for Poisoned {
    type Model = Classifier;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Classifier {
        self.inner.init_model(device)
    }
    fn train_len(&self) -> usize {
        self.inner.train_len()
    }
    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        let batch = self.inner.train_batch(indices, device);
        let on_rank_1 = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("kiln-worker-1"));
        if on_rank_1 && self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == self.poison {
            return ImageBatch {
                images: batch.images.mul_scalar(f32::INFINITY),
                ..batch
            };
        }
        batch
    }
    fn eval_len(&self) -> usize {
        self.inner.eval_len()
    }
    fn eval_batch(&self, range: std::ops::Range<usize>, device: &Device) -> ImageBatch {
        self.inner.eval_batch(range, device)
    }
    fn cast_batch(&self, batch: ImageBatch, dtype: FloatDType) -> ImageBatch {
        self.inner.cast_batch(batch, dtype)
    }
}

fn mlp_16_mixed(dir: &std::path::Path, extra: &[&str]) -> kiln::builtin::Config {
    let mut o = vec![
        "model.kind=\"mlp\"",
        "model.mlp.hidden=[32]",
        "precision.mode=\"16-mixed\"",
        "precision.init_scale=1024",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=100",
        "train.max_steps=6",
    ];
    o.extend_from_slice(extra);
    small_config(dir, &o)
}

#[test]
fn an_infinite_gradient_skips_the_step_on_every_replica_and_halves_the_scale() {
    // Under every data-parallel strategy: the overflow shows in rank 1's gradients only, and
    // the all-reduced flag makes every rank (every shard) skip the step alike.
    for strategy in [
        StrategyKind::Ddp,
        StrategyKind::Zero1,
        StrategyKind::Zero2,
        StrategyKind::Zero3,
    ] {
        let dir = temp_dir(&format!("scaler-skip-{strategy:?}"));
        let config = mlp_16_mixed(&dir, &["train.check_replicas=true"]);
        let workload = Poisoned {
            inner: image_workload(&config),
            poison: 3,
            seen: Default::default(),
        };
        let mut settings = TrainerSettings::from_config(
            &config.kiln,
            vec![Device::flex(), Device::flex()],
            "cpu".into(),
            dir.to_path_buf(),
        );
        settings.parallel.strategy = strategy;
        fit(&workload, &settings).unwrap();

        let records = metrics(&dir, "train");
        let scale = |step: u64| -> (f64, u64) {
            let r = records.iter().find(|r| r["step"] == step).unwrap();
            (
                r["loss_scale"].as_f64().unwrap(),
                r["skipped_steps"].as_u64().unwrap(),
            )
        };
        // Rank 1's fourth batch is step 4's.
        assert_eq!(scale(3), (1024.0, 0), "{strategy:?}");
        assert_eq!(scale(4), (512.0, 1), "{strategy:?}");
        assert_eq!(scale(6), (512.0, 1), "{strategy:?}");
        // Step 4 left the parameters as step 3 did.
        let params = |step: usize| {
            let path = kiln::checkpoint::step_dir(&dir, step);
            let model =
                kiln::checkpoint::load_model(&path, workload.init_model(&Device::flex())).unwrap();
            parameter_values(&model)
        };
        assert_eq!(params(3), params(4), "{strategy:?}");
        assert_ne!(params(4), params(5), "{strategy:?}");
    }
}

#[test]
fn the_loss_scaler_survives_resume() {
    let dir = temp_dir("scaler-resume");
    let extra = ["precision.growth_interval=2", "train.max_steps=7"];
    let full = train(
        &mlp_16_mixed(&dir.join("full"), &extra),
        &RunOptions::default(),
    )
    .unwrap();
    let scales = |d: &std::path::Path| -> Vec<(u64, f64, f64)> {
        metrics(d, "train")
            .iter()
            .map(|r| {
                (
                    r["step"].as_u64().unwrap(),
                    r["loss"].as_f64().unwrap(),
                    r["loss_scale"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let expected = scales(&full.dir);
    assert!(expected.last().unwrap().2 > 1024.0, "{expected:?}");

    let cut = dir.join("cut");
    crate::training::cut_copy(&full.dir, &cut, 3);
    let out = train_bin(&dir, &["--resume", cut.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(scales(&cut), expected);
}

#[test]
fn precision_and_recompute_combine_with_ddp_and_accumulation() {
    let dir = temp_dir("policies-ddp");
    let text = text_file(&dir);
    let run = |name: &str, extra: &[&str]| {
        let mut o = vec![
            "train.max_steps=20",
            "hardware.devices=2",
            "train.accumulate=2",
            "train.batch_size=4",
            "train.check_replicas=true",
        ];
        o.extend_from_slice(extra);
        let result = train(
            &gpt_config(&dir.join(name), &text, &o),
            &RunOptions::default(),
        );
        result.unwrap().summary.val_loss.unwrap()
    };
    let reference = run("f32", &[]);
    for (name, extra) in [
        (
            "bf16-blocks",
            &["precision.mode=\"bf16-mixed\"", "recompute.mode=\"blocks\""][..],
        ),
        (
            "f16-balanced",
            &["precision.mode=\"16-mixed\"", "recompute.mode=\"balanced\""][..],
        ),
        ("bf16-reduce", &["precision.reduce_dtype=\"bf16\""][..]),
    ] {
        let val = run(name, extra);
        println!("{name}: val {val:.4} vs f32 {reference:.4}");
        assert!((val - reference).abs() <= 0.03 * reference, "{name}");
    }
}

#[test]
fn impossible_policies_are_clear_errors() {
    let dir = temp_dir("policy-errors");
    let out = train_bin(
        &dir,
        &[
            "--precision",
            "bf16-mixed",
            "--set",
            "precision.scaler=\"dynamic\"",
        ],
    );
    assert_one_line_error(&out, &["precision.scaler", "16-mixed", "bf16-mixed"]);
    let out = train_bin(&dir, &["--precision", "16-true"]);
    assert_one_line_error(&out, &["optim.eps", "16-true"]);
    let out = train_bin(&dir, &["--recompute", "blocks:every=0"]);
    assert_one_line_error(&out, &["--recompute", "blocks:every=K"]);
    // The built-in ConvNet has BatchNorm, whose running statistics cannot stay f32.
    let out = train_bin(&dir, &["--precision", "bf16-mixed", "--max-steps", "1"]);
    assert_one_line_error(&out, &["precision.mode", "BatchNorm"]);

    let out = train_bin(
        &dir,
        &[
            "--precision",
            "16-mixed",
            "--recompute",
            "blocks:every=2",
            "--print-config",
        ],
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.contains("mode = \"16-mixed\""), "{printed}");
    assert!(printed.contains("every = 2"), "{printed}");
}

#[test]
fn true_precisions_train_and_export_f32_weights() {
    let dir = temp_dir("true-precision");
    let run = |mode: &str, extra: &[&str]| {
        let mut o = vec![
            "train.max_steps=40",
            "model.convnet.batch_norm=true",
            // An AdamW epsilon f16 can hold, for every mode alike.
            "optim.eps=1e-4",
        ];
        let precision = format!("precision.mode={mode:?}");
        o.push(&precision);
        o.extend_from_slice(extra);
        let result = train(&small_config(&dir.join(mode), &o), &RunOptions::default()).unwrap();
        let exported = kiln_models::load_run(&result.dir, &Device::flex()).unwrap();
        assert!(float_dtypes(&exported).iter().all(|d| *d == DType::F32));
        result.summary.val_accuracy.unwrap()
    };
    let reference = run("32", &[]);
    // bf16 and f16 everywhere, BatchNorm included.
    for mode in ["bf16-true", "16-true"] {
        let accuracy = run(mode, &[]);
        println!("{mode}: val accuracy {accuracy:.4} (f32 {reference:.4})");
        assert!(
            accuracy > reference - 0.1,
            "{mode}: {accuracy} vs {reference}"
        );
    }
}
