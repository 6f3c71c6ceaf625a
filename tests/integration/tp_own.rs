//! A model of one's own under tensor parallelism, through the library API as another crate
//! would write it: it says which Linear is column- and which row-parallel (`TensorParallel`,
//! returned by its `BlockStack`), and a group of 2 trains it as one device does, its dropout
//! masks drawn as one device draws them (`kiln_models::draw::dropout`); the same model drawing
//! from Burn's shared random state is refused a group in one line.

use std::ops::Range;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln::{BlockStack, RunInfo, RunOptions, StepOutput, TrainStep, Workload, train_workload};
use kiln_models::ImageBatch;
use kiln_models::draw::dropout;
use kiln_models::tp::{Split, TensorParallel, column, row};

use crate::common::{max_relative_diff, small_config, temp_dir};

/// Two Linears with a tanh and a dropout between: the first column-parallel (each rank its
/// share of the 24 hidden units), the second row-parallel (the ranks' products summed).
#[derive(Module, Debug)]
struct Own {
    hidden: Linear,
    out: Linear,
    drop: Dropout,
    /// Draws its dropout through kiln's keyed draws (and says so), or through Burn's module.
    #[module(skip)]
    keyed: bool,
}

impl Own {
    fn new(device: &Device, prob: f64, keyed: bool) -> Self {
        Self {
            hidden: LinearConfig::new(64, 24).init(device),
            out: LinearConfig::new(24, 10).init(device),
            drop: DropoutConfig::new(prob).init(),
            keyed,
        }
    }
}

impl TrainStep<ImageBatch> for Own {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        let samples = batch.targets.dims()[0];
        let h = column(&self.hidden, batch.images.flatten(1, 3)).tanh();
        // A rank holds its part of the hidden units (dimension 1): it keeps that part of the
        // whole's mask.
        let h = if self.keyed {
            dropout(&self.drop, h, kiln_models::tp::part(1))
        } else {
            self.drop.forward(h)
        };
        let logits = row(&self.out, h).cast(FloatDType::F32);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.targets);
        StepOutput::new(loss, samples)
    }
}

impl TensorParallel for Own {
    fn tp_ready(&self) -> bool {
        true
    }
    fn tp_draws_keyed(&self) -> bool {
        self.keyed
    }
    fn tp_split(&self, path: &str, _size: usize) -> Split {
        match path {
            "hidden.weight" => Split::columns(1),
            "hidden.bias" => Split::first(1),
            "out.weight" => Split::ROWS,
            _ => Split::Whole,
        }
    }
}

impl BlockStack<ImageBatch> for Own {
    fn tensor_parallel(&self) -> Option<&dyn TensorParallel> {
        Some(self)
    }
}

/// The embedded digits for [`Own`].
struct OwnDigits {
    splits: kiln_datasets::ImageSplits,
    prob: f64,
    keyed: bool,
}

impl Workload for OwnDigits {
    type Model = Own;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Own {
        Own::new(device, self.prob, self.keyed)
    }
    fn train_len(&self) -> usize {
        self.splits.train.len()
    }
    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        kiln::data::ImageBatcher::new(device.clone()).batch(&self.splits.train, indices)
    }
    fn eval_len(&self) -> usize {
        self.splits.test.len()
    }
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
        let indices: Vec<usize> = range.collect();
        kiln::data::ImageBatcher::new(device.clone()).batch(&self.splits.test, &indices)
    }
    fn cast_batch(&self, batch: ImageBatch, dtype: FloatDType) -> ImageBatch {
        ImageBatch {
            images: batch.images.cast(dtype),
            ..batch
        }
    }
}

/// Trains [`Own`] 12 steps of 16 digits with `overrides`; its losses and final parameters.
fn own_run(
    dir: &std::path::Path,
    prob: f64,
    keyed: bool,
    overrides: &[&str],
) -> kiln::Result<(Vec<f64>, Vec<Vec<f32>>)> {
    let mut o = vec![
        "train.max_steps=12",
        "train.grad_clip=1.0",
        "hardware.cpu_split=\"off\"",
    ];
    o.extend_from_slice(overrides);
    let config = small_config(dir, &o);
    let workload = OwnDigits {
        splits: kiln_datasets::digits(),
        prob,
        keyed,
    };
    let info = RunInfo {
        model: "own".into(),
        ..RunInfo::default()
    };
    let result = train_workload(
        &config.kiln,
        &RunOptions::default(),
        &workload,
        info,
        |_| Ok(()),
    )?;
    let losses = crate::common::metrics(&result.dir, "train")
        .iter()
        .map(|r| r["loss"].as_f64().unwrap())
        .collect();
    let model = Own::new(&Device::flex(), prob, keyed)
        .try_load_file(result.dir.join("model.bpk"))
        .unwrap();
    Ok((losses, kiln::trainer::parameter_values(&model)))
}

/// Dropout at 0.3 on the hidden units: tp = 2 on 2 devices against one device, the same 16
/// digits a step, 12 steps with clipping: every loss within 1e-5 relative and every parameter
/// within 1e-5 (relative, per tensor) — each rank drew the whole's mask and kept its half. The
/// dropout is live (the losses are not those of the same run without it).
#[test]
fn a_model_of_ones_own_splits_its_linears_and_trains_in_a_group_as_one_device() {
    let dir = temp_dir("tp-own");
    let (one_losses, one) = own_run(&dir.join("one"), 0.3, true, &[]).unwrap();
    let group = ["hardware.devices=2", "parallel.tp=2"];
    let (tp_losses, tp) = own_run(&dir.join("tp"), 0.3, true, &group).unwrap();
    assert_eq!(tp_losses.len(), 12);
    for (step, (a, b)) in tp_losses.iter().zip(&one_losses).enumerate() {
        let gap = (a - b).abs() / b.abs();
        assert!(gap <= 1e-5, "step {}: {a} under tp against {b}", step + 1);
    }
    let d = max_relative_diff(&tp, &one);
    println!("own model, tp 2 with dropout: max per-tensor relative difference {d:e}");
    assert!(d <= 1e-5, "max per-tensor relative difference {d:e}");
    let (plain, _) = own_run(&dir.join("plain"), 0.0, true, &[]).unwrap();
    assert_ne!(plain, one_losses, "dropout at 0.3 changed nothing");
}

/// The same model drawing its dropout from Burn's shared state: refused a group in one line
/// naming the key and what to do, before any rank starts; with dropout 0 it draws nothing and
/// trains.
#[test]
fn a_model_whose_draws_are_not_keyed_is_refused_a_group() {
    let dir = temp_dir("tp-own-refused");
    let group = ["hardware.devices=2", "parallel.tp=2", "train.max_steps=2"];
    let e = own_run(&dir.join("drawn"), 0.3, false, &group)
        .expect_err("a group drawing from the shared state ran")
        .to_string();
    assert!(!e.contains('\n'), "{e}");
    for needle in ["parallel.tp", "draws random numbers", "draw::dropout"] {
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
    }
    assert!(
        !dir.join("drawn").exists(),
        "the refused run made its directory"
    );
    own_run(&dir.join("still"), 0.0, false, &group).unwrap();
}
