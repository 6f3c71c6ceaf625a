//! Pipeline parallelism on CPU ranks: parity with one device accumulating the same
//! micro-batches, data × pipeline against `ddp`, the schedules' recorded orders, resume across
//! strategies, and the settings that cannot work.

use std::path::Path;

use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::strategy::pipeline::schedule::{Op, check};
use kiln::trainer::parameter_values;

use crate::common::{
    assert_one_line_error, max_relative_diff, metrics, small_config, temp_dir, train_bin,
    train_losses,
};
use crate::gpt::{gpt_config, text_file};

/// The same sums, partly in another order (the tied embedding's two parts are added after
/// the stages' backwards rather than inside one).
const PARITY: f64 = 1e-6;

#[derive(Clone, Copy, Debug)]
enum Model {
    /// A 4-block GPT (its head tied to the token embedding), AdamW with clipping.
    Gpt,
    /// A 4-block MLP, SGD with momentum.
    Mlp,
    /// The ConvNet with BatchNorm (3 blocks, the most the 8×8 digits allow), SGD.
    ConvNet,
}

fn config(model: Model, dir: &Path, text: &Path, extra: &[String]) -> kiln::builtin::Config {
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut o: Vec<&str> = vec!["train.max_steps=5", "train.epochs=0", "train.log_every=1"];
    match model {
        Model::Gpt => {
            o.extend([
                "model.gpt.n_layer=4",
                "model.gpt.n_embd=12",
                "model.gpt.n_head=3",
                "model.gpt.block_size=8",
                "train.grad_clip=0.5",
            ]);
            o.extend(extra);
            gpt_config(dir, text, &o)
        }
        Model::Mlp => {
            o.extend([
                "model.kind=\"mlp\"",
                "model.mlp.hidden=[33, 17, 9, 7]",
                "optim.name=\"sgd\"",
                "optim.lr=0.1",
                "optim.momentum=0.9",
            ]);
            o.extend(extra);
            small_config(dir, &o)
        }
        Model::ConvNet => {
            o.extend([
                "model.convnet.channels=[4, 6, 8]",
                "model.convnet.kernel_size=3",
                "model.convnet.batch_norm=true",
                "optim.name=\"sgd\"",
                "optim.lr=0.05",
                "optim.momentum=0.9",
            ]);
            o.extend(extra);
            small_config(dir, &o)
        }
    }
}

fn params(model: Model, dir: &Path) -> Vec<Vec<f32>> {
    let device = Device::flex();
    match model {
        Model::Gpt => parameter_values(
            &kiln_models::load_family_run::<kiln_models::Gpt>(dir, &device)
                .unwrap()
                .0,
        ),
        _ => parameter_values(&kiln_models::load_run(dir, &device).unwrap()),
    }
}

fn run(model: Model, dir: &Path, text: &Path, extra: &[String]) -> Vec<Vec<f32>> {
    let result = train(&config(model, dir, text, extra), &RunOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert!(result.summary.final_train_loss.unwrap().is_finite());
    params(model, dir)
}

fn pipeline_args(stages: usize, micro: usize, schedule: &str, devices: usize) -> Vec<String> {
    vec![
        "strategy.name=\"pipeline\"".into(),
        format!("pipeline.stages={stages}"),
        format!("pipeline.microbatches={micro}"),
        format!("pipeline.schedule={schedule:?}"),
        format!("hardware.devices={devices}"),
        "train.batch_size=4".into(),
        "train.check_replicas=true".into(),
    ]
}

fn check_parity(model: Model, stage_counts: &[usize]) {
    let dir = temp_dir(&format!("pipe-parity-{model:?}"));
    let text = text_file(&dir);
    let mut failures = Vec::new();
    for micro in [1, 4, 8] {
        let single = run(
            model,
            &dir.join(format!("single-{micro}")),
            &text,
            &[
                "train.batch_size=4".into(),
                format!("train.accumulate={micro}"),
                // One replica, as the pipeline's schedule is compared with one device's.
                "hardware.cpu_split=\"off\"".into(),
            ],
        );
        for &k in stage_counts {
            for schedule in ["gpipe", "1f1b"] {
                let name = format!("k{k}-m{micro}-{schedule}");
                let got = run(
                    model,
                    &dir.join(&name),
                    &text,
                    &pipeline_args(k, micro, schedule, k),
                );
                let d = max_relative_diff(&got, &single);
                println!("{model:?} {name}: vs single --accumulate {micro}: {d:.3e}");
                if d > PARITY {
                    failures.push(format!("{model:?} {name}: {d:e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn pipeline_matches_one_device_accumulating_the_micro_batches_gpt() {
    check_parity(Model::Gpt, &[2, 4]);
}

#[test]
fn pipeline_matches_one_device_accumulating_the_micro_batches_mlp() {
    check_parity(Model::Mlp, &[2, 4]);
}

#[test]
fn pipeline_matches_one_device_accumulating_the_micro_batches_convnet_with_batchnorm() {
    // parameter_values compares the running statistics too.
    check_parity(Model::ConvNet, &[2, 3]);
}

#[test]
fn data_times_pipeline_matches_ddp() {
    let dir = temp_dir("pipe-data");
    let text = text_file(&dir);
    for model in [Model::Gpt, Model::Mlp] {
        let micro = 4;
        let ddp = run(
            model,
            &dir.join(format!("{model:?}-ddp")),
            &text,
            &[
                "hardware.devices=2".into(),
                "train.batch_size=4".into(),
                format!("train.accumulate={micro}"),
                "train.check_replicas=true".into(),
            ],
        );
        for schedule in ["gpipe", "1f1b"] {
            let got = run(
                model,
                &dir.join(format!("{model:?}-{schedule}")),
                &text,
                &pipeline_args(2, micro, schedule, 4),
            );
            let d = max_relative_diff(&got, &ddp);
            println!("{model:?} 2 pipelines × 2 stages ({schedule}) vs ddp N=2: {d:.3e}");
            assert!(d <= PARITY, "{model:?} {schedule}: {d:e}");
        }
    }
}

/// The operations each stage recorded for its last flush, in the order it ran them.
fn recorded(dir: &Path) -> Vec<(Vec<Vec<Op>>, Vec<usize>, usize)> {
    metrics(dir, "schedule")
        .iter()
        .map(|r| {
            let k = r["stages"].as_u64().unwrap() as usize;
            let mut orders = vec![Vec::new(); k];
            for op in r["ops"].as_array().unwrap() {
                let s = op[0].as_u64().unwrap() as usize;
                let m = op[2].as_u64().unwrap() as usize;
                orders[s].push(if op[1] == "F" {
                    Op::Forward(m)
                } else {
                    Op::Backward(m)
                });
            }
            let held = r["held"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap() as usize)
                .collect();
            (orders, held, r["microbatches"].as_u64().unwrap() as usize)
        })
        .collect()
}

#[test]
fn the_recorded_schedules_are_valid_and_1f1b_holds_at_most_k_micro_batches() {
    let dir = temp_dir("pipe-schedule");
    let text = text_file(&dir);
    for schedule in ["gpipe", "1f1b"] {
        for k in [2, 4] {
            let run_dir = dir.join(format!("{schedule}-{k}"));
            let mut args = pipeline_args(k, 8, schedule, k);
            args.push("train.max_steps=2".into());
            run(Model::Gpt, &run_dir, &text, &args);
            let records = recorded(&run_dir);
            assert_eq!(records.len(), 2, "one schedule record per logged step");
            for (orders, held, micro) in records {
                // Timing-free: the orders replayed against each other's dependencies.
                let most = check(&orders, micro).unwrap();
                assert_eq!(most, held, "the counted activations match the replay");
                for (s, h) in held.iter().enumerate() {
                    if schedule == "1f1b" {
                        assert!(*h <= k - s, "1f1b stage {s} held {h} micro-batches");
                    } else {
                        assert_eq!(*h, micro, "gpipe stage {s}");
                    }
                }
            }
            let train = metrics(&run_dir, "train");
            let last = train.last().unwrap();
            let ideal = last["bubble_ideal"].as_f64().unwrap();
            assert!((ideal - (k - 1) as f64 / (8 + k - 1) as f64).abs() < 1e-12);
            for s in 0..k {
                let b = last[format!("bubble_stage{s}").as_str()].as_f64().unwrap();
                assert!((0.0..1.0).contains(&b), "stage {s}: {b}");
            }
        }
    }
}

#[test]
fn a_pipeline_run_resumes_as_ddp_and_back() {
    let dir = temp_dir("pipe-resume");
    let text = text_file(&dir);
    let common = [
        "train.checkpoint_every=2".to_string(),
        "train.keep_checkpoints=10".into(),
        "train.max_steps=6".into(),
        "optim.name=\"adamw\"".into(),
        "optim.lr=0.003".into(),
        "train.grad_clip=1.0".into(),
    ];
    let as_pipeline = pipeline_args(2, 4, "1f1b", 2);
    let mut full_args = as_pipeline.clone();
    full_args.extend(common.iter().cloned());
    let full = dir.join("full");
    run(Model::Mlp, &full, &text, &full_args);
    let expected = train_losses(&full);

    // Steps 1–2 as a pipeline, 3–4 as ddp on 2 devices (batch 4 × 2 × accumulate 2: the same
    // samples per step), 5–6 as a pipeline again.
    let cut = dir.join("cut");
    crate::training::cut_copy(&full, &cut, 2);
    let resume = |extra: &[&str]| {
        let mut args = vec!["--resume", cut.to_str().unwrap()];
        for e in extra {
            args.extend(["--set", e]);
        }
        let out = train_bin(&dir, &args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    resume(&[
        "strategy.name=\"ddp\"",
        "pipeline.stages=1",
        "pipeline.microbatches=1",
        "train.accumulate=2",
        "train.max_steps=4",
        "train.check_replicas=false",
    ]);
    let summary = std::fs::read_to_string(cut.join("summary.json")).unwrap();
    assert!(summary.contains("\"strategy\": \"ddp\""), "{summary}");
    resume(&[
        "strategy.name=\"pipeline\"",
        "pipeline.stages=2",
        "pipeline.microbatches=4",
        "train.accumulate=1",
        "train.max_steps=6",
    ]);
    let summary = std::fs::read_to_string(cut.join("summary.json")).unwrap();
    assert!(summary.contains("\"strategy\": \"pipeline\""), "{summary}");
    let got = train_losses(&cut);
    assert_eq!(got.len(), expected.len());
    for ((s, a), (_, b)) in got.iter().zip(&expected) {
        let (a, b) = (f64::from_bits(*a), f64::from_bits(*b));
        println!("step {s}: {a:.7} vs {b:.7}");
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {s}: {a} vs {b}");
    }
}

#[test]
fn impossible_pipelines_are_one_line_errors() {
    let dir = temp_dir("pipe-errors");
    let out = train_bin(
        &dir,
        &[
            "--devices",
            "3",
            "--strategy",
            "pipeline",
            "--set",
            "pipeline.stages=2",
        ],
    );
    assert_one_line_error(&out, &["pipeline.stages", "divide"]);
    let out = train_bin(&dir, &["--set", "pipeline.microbatches=4"]);
    assert_one_line_error(&out, &["pipeline", "strategy"]);
    // The default ConvNet has 2 blocks: 4 stages cannot each have one.
    let out = train_bin(
        &dir,
        &[
            "--devices",
            "4",
            "--strategy",
            "pipeline",
            "--set",
            "pipeline.stages=4",
        ],
    );
    assert_one_line_error(&out, &["pipeline.stages", "block"]);
    let out = train_bin(
        &dir,
        &[
            "--devices",
            "2",
            "--strategy",
            "pipeline",
            "--set",
            "pipeline.stages=2",
            "--set",
            "pipeline.cuts=[2]",
        ],
    );
    assert_one_line_error(&out, &["pipeline.cuts"]);
}
