//! End-to-end training on the embedded digits: the default recipe's accuracy, the run
//! directory, bit-identical reruns and resume, and loading the result for inference.

use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln_models::{ImageBatch, load_classifier, load_run, read_spec};

use crate::common::{metrics, small_config, temp_dir, train_bin, train_losses};

#[test]
fn default_recipe_reaches_97_percent_and_writes_the_run_directory() {
    let dir = temp_dir("default");
    let out = train_bin(&dir, &["--run-dir", "run"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in [
        "accelerator",
        "world size",
        "per device",
        "parameters",
        "1437 train",
    ] {
        assert!(
            stdout.contains(row),
            "start-up table lacks {row:?}:\n{stdout}"
        );
    }
    let run = dir.join("run");
    for f in [
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "model.toml",
        "model.bpk",
        "model.safetensors",
    ] {
        assert!(run.join(f).is_file(), "missing {f}");
    }
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap();
    for key in [
        "steps",
        "epochs",
        "final_train_loss",
        "val_loss",
        "val_accuracy",
        "wall_seconds",
        "samples_per_sec",
        "devices",
        "strategy",
        "precision",
    ] {
        assert!(!summary[key].is_null(), "summary lacks {key}: {summary}");
    }
    let accuracy = summary["val_accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.97, "default recipe reached only {accuracy}");
    assert_eq!(summary["epochs"].as_f64().unwrap(), 10.0);

    let train = metrics(&run, "train");
    assert!(!train.is_empty());
    for key in [
        "step",
        "epoch",
        "split",
        "loss",
        "lr",
        "samples_per_sec",
        "time_compute",
    ] {
        assert!(!train[0][key].is_null(), "train record lacks {key}");
    }
    let val = metrics(&run, "val");
    assert_eq!(val.len(), 10, "one validation per epoch");
    assert!(val.iter().all(|r| r["accuracy"].is_number()));
    assert!(kiln::checkpoint::latest(&run).is_ok());
    // The saved config reloads to the one that ran.
    kiln::builtin::load(Some(&run.join("config.toml")), &[]).unwrap();
}

#[test]
fn same_seed_gives_bit_identical_losses_and_another_seed_does_not() {
    let dir = temp_dir("determinism");
    let quiet = RunOptions::default();
    let a = train(&small_config(&dir.join("a"), &[]), &quiet).unwrap();
    let b = train(&small_config(&dir.join("b"), &[]), &quiet).unwrap();
    let c = train(&small_config(&dir.join("c"), &["run.seed=7"]), &quiet).unwrap();
    let (la, lb, lc) = (
        train_losses(&a.dir),
        train_losses(&b.dir),
        train_losses(&c.dir),
    );
    assert_eq!(la.len(), 12);
    assert_eq!(la, lb);
    assert_ne!(la, lc);
}

#[test]
fn resume_continues_bit_for_bit() {
    let dir = temp_dir("resume");
    let quiet = RunOptions::default();
    let overrides = [
        "train.checkpoint_every=4",
        "train.keep_checkpoints=10",
        "optim.name=\"sgd\"",
        "optim.lr=0.05",
        "schedule.kind=\"cosine\"",
        "schedule.warmup_steps=3",
        "train.grad_clip=1.0",
    ];
    let full = train(&small_config(&dir.join("full"), &overrides), &quiet).unwrap();
    let full_losses = train_losses(&full.dir);

    // Simulate a run that stopped after step 4: copy it and remove everything later.
    let resumed = resume_cut(&full.dir, &dir.join("cut"), 4, &[]);
    assert_eq!(train_losses(&resumed.dir), full_losses);
    assert_eq!(resumed.summary.steps, 12);

    // The same across an epoch boundary, with Adam state to restore.
    let epochs = [
        "train.checkpoint_every=5",
        "train.keep_checkpoints=10",
        "train.max_steps=200",
        "train.epochs=2",
        "train.batch_size=128",
    ];
    let full = train(&small_config(&dir.join("full2"), &epochs), &quiet).unwrap();
    let cut = dir.join("cut2");
    cut_copy(&full.dir, &cut, 15);
    let out = train_bin(&dir, &["--resume", cut.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(train_losses(&cut), train_losses(&full.dir));
    assert_eq!(
        metrics(&cut, "val")
            .iter()
            .map(|r| r["loss"].clone())
            .collect::<Vec<_>>(),
        metrics(&full.dir, "val")
            .iter()
            .map(|r| r["loss"].clone())
            .collect::<Vec<_>>()
    );
}

/// A copy of run `from` at `to` as if it had stopped after step `last`: later checkpoints are
/// gone.
/// Copies the run in `full` to `cut` keeping the checkpoints up to step `step` (as if it had
/// stopped there), and resumes it from its newest checkpoint, which must be step `step`, with
/// the run's own `config.toml` and `overrides`.
pub(crate) fn resume_cut(
    full: &std::path::Path,
    cut: &std::path::Path,
    step: usize,
    overrides: &[String],
) -> kiln::RunResult {
    cut_copy(full, cut, step);
    let (run_dir, ckpt) = kiln::run::resolve_resume(cut).unwrap();
    assert!(
        ckpt.ends_with(format!("step-{step:08}")),
        "{}",
        ckpt.display()
    );
    let mut config = kiln::builtin::load(Some(&run_dir.join("config.toml")), overrides).unwrap();
    config.kiln.run.dir = Some(run_dir);
    train(
        &config,
        &RunOptions {
            resume_from: Some(ckpt),
            ..RunOptions::default()
        },
    )
    .unwrap()
}

pub(crate) fn cut_copy(from: &std::path::Path, to: &std::path::Path, last: usize) {
    copy_dir(from, to);
    for (step, path) in kiln::checkpoint::list(to) {
        if step > last {
            std::fs::remove_dir_all(path).unwrap();
        }
    }
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[test]
fn trained_model_loads_for_inference_from_run_dir_and_safetensors() {
    let dir = temp_dir("inference");
    let result = train(
        &small_config(
            &dir.join("run"),
            &["train.max_steps=60", "model.kind=\"mlp\""],
        ),
        &RunOptions::default(),
    )
    .unwrap();
    let device = Device::flex();
    let model = load_run(&result.dir, &device).unwrap();
    let spec = read_spec(&result.dir.join("model.toml")).unwrap();
    let from_st = load_classifier(&spec, &result.dir.join("model.safetensors"), &device).unwrap();

    let splits = kiln_datasets::digits();
    let indices: Vec<usize> = (0..splits.test.len()).collect();
    let ImageBatch { images, targets } =
        kiln::data::ImageBatcher::new(device.clone()).batch(&splits.test, &indices);
    let predicted = model.predict(images.clone());
    assert_eq!(predicted, from_st.predict(images));
    let labels: Vec<i64> = targets.into_data().iter::<i64>().collect();
    let correct = predicted
        .iter()
        .zip(&labels)
        .filter(|(p, l)| **p as i64 == **l)
        .count();
    let accuracy = correct as f64 / labels.len() as f64;
    let reported = result.summary.val_accuracy.unwrap();
    assert!(
        (accuracy - reported).abs() < 1e-9,
        "{accuracy} vs {reported}"
    );

    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, b"garbage").unwrap();
    let e = load_classifier(&spec, &bad, &device)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.safetensors"), "{e}");
}

#[test]
fn a_refused_launch_or_model_writes_nothing() {
    // The library path (no command line): the strategy's rules see this launch's ranks.
    let dir = temp_dir("refused-launch");
    for (overrides, key) in [
        (
            &["hardware.devices=2", "strategy.name=\"single\""][..],
            "strategy.name",
        ),
        (
            &["strategy.name=\"zero3\"", "ddp.sync_batchnorm=true"][..],
            "ddp.sync_batchnorm",
        ),
        // A refusal of the model itself (it has no parameter groups) is checked before the
        // run directory is created, too.
        (&["groups.head.optim.lr=0.1"][..], "groups.head"),
    ] {
        let run = dir.join(key);
        let config = small_config(&run, overrides);
        let e = train(&config, &RunOptions::default()).unwrap_err();
        assert!(matches!(e, kiln::Error::Config(_)), "{e}");
        assert!(e.to_string().contains(key), "{e}");
        assert!(!run.exists(), "{} was written", run.display());
    }
}

#[test]
fn early_stopping_ends_every_rank_at_the_expected_step_with_a_checkpoint() {
    let dir = temp_dir("early-stopping");
    // Nothing improves by 100 after the first validation (step 2): the validations at steps
    // 4 and 6 are the patience of 2, so the run stops after step 6 of 20.
    let run = dir.join("run");
    let config = small_config(
        &run,
        &[
            "hardware.devices=2",
            "train.max_steps=20",
            "train.val_every=2",
            "train.early_stopping.patience=2",
            "train.early_stopping.min_delta=100.0",
        ],
    );
    let result = train(&config, &RunOptions::default()).unwrap();
    let s = &result.summary;
    assert_eq!(s.steps, 6);
    let reason = s.stopped_early.as_deref().unwrap();
    assert!(reason.starts_with("val_loss has not improved"), "{reason}");
    assert!(s.stopped_by.is_none());
    assert_eq!(kiln::checkpoint::latest(&run).unwrap().0, 6);
    let vals: Vec<u64> = metrics(&run, "val")
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(vals, [2, 4, 6]);

    // A metric the run does not log is one line naming the key.
    let config = small_config(
        &dir.join("unknown"),
        &[
            "train.val_every=2",
            "train.early_stopping.metric=\"val_r2\"",
        ],
    );
    let e = train(&config, &RunOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.early_stopping.metric") && e.contains("val_r2"),
        "{e}"
    );
}

#[test]
fn reduce_on_plateau_lowers_the_rate_at_the_expected_steps_and_resumes() {
    let dir = temp_dir("plateau");
    let o = [
        "train.max_steps=10",
        "train.val_every=2",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=10",
        "optim.lr=0.01",
        "schedule.kind=\"plateau\"",
        "schedule.gamma=0.5",
        "schedule.min_lr_ratio=0.2",
        "schedule.plateau.patience=1",
        "schedule.plateau.min_delta=100.0",
    ];
    let full = dir.join("full");
    train(&small_config(&full, &o), &RunOptions::default()).unwrap();
    let lrs: Vec<(u64, f64)> = metrics(&full, "train")
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), r["lr"].as_f64().unwrap()))
        .collect();
    // Validation at step 2 sets the best; those at 4, 6 and 8 each halve the rate of the
    // steps after them, down to the floor of 0.2 × 0.01.
    let expected = [
        0.01, 0.01, 0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025, 0.002, 0.002,
    ];
    assert_eq!(lrs.len(), expected.len());
    for ((step, lr), want) in lrs.iter().zip(expected) {
        assert!(
            (lr - want).abs() < 1e-12,
            "step {step}: lr {lr}, expected {want}"
        );
    }

    // Resumed from step 6 (two reductions made), the run goes on with the same rates and
    // losses, bit for bit.
    let cut = dir.join("cut");
    cut_copy(&full, &cut, 6);
    let (run_dir, ckpt) = kiln::run::resolve_resume(&cut).unwrap();
    let options = RunOptions {
        resume_from: Some(ckpt),
        ..RunOptions::default()
    };
    train(&small_config(&run_dir, &o), &options).unwrap();
    assert_eq!(train_losses(&cut), train_losses(&full));
    let resumed: Vec<f64> = metrics(&cut, "train")
        .iter()
        .map(|r| r["lr"].as_f64().unwrap())
        .collect();
    assert_eq!(resumed, lrs.iter().map(|(_, lr)| *lr).collect::<Vec<_>>());
}
