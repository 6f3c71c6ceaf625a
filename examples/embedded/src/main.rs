//! A program that embeds kiln's engine to train a model of its own: an MLP on the embedded 8×8
//! digits, on two CPU devices with their gradients averaged, its config kiln's sections from a
//! file and `key=value` assignments — and no command line, plots or GPU sampling of kiln's
//! (`cargo tree` shows no clap, plotters or png).
//!
//! ```text
//! cargo run --release                                   # 2 devices, ddp, 150 steps
//! cargo run --release -- strategy.kind=\"zero1\" train.max_steps=300 run.dir=\"runs/mlp\"
//! cargo run --release -- my-run.toml hardware.devices=1
//! ```

use std::ops::Range;
use std::path::Path;

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_datasets::{ImageDataset, ImageSplits};
use kiln_engine::{BlockStack, RootConfig, RunInfo, RunOptions, StepOutput, TrainStep, Workload};
use kiln_models::{ImageBatch, classification_output};

#[global_allocator]
static ALLOCATOR: kiln_engine::Allocator = kiln_engine::Allocator;

/// What the program sets before the user's assignments.
const DEFAULTS: [&str; 6] = [
    "run.name=\"embedded\"",
    "hardware.devices=2",
    "train.max_steps=150",
    "train.batch_size=32",
    "train.log_every=25",
    "optim.lr=0.005",
];

/// Two linear layers with a GELU between them.
#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
}

impl TrainStep<ImageBatch> for Mlp {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        let x = self.hidden.forward(batch.images.flatten(1, 3));
        let logits = self.out.forward(burn::tensor::activation::gelu(x));
        classification_output(logits.cast(FloatDType::F32), batch.targets)
    }
}

/// No block stack described: the model runs whole.
impl BlockStack<ImageBatch> for Mlp {}

/// The digits and the model's width.
struct Digits {
    hidden: usize,
    splits: ImageSplits,
}

fn batch(set: &ImageDataset, indices: &[usize], device: &Device) -> ImageBatch {
    let pixels: Vec<f32> = indices
        .iter()
        .flat_map(|&i| set.image(i).iter().map(|&p| f32::from(p) / f32::from(set.max_value)))
        .collect();
    let labels: Vec<i64> = indices.iter().map(|&i| i64::from(set.label(i))).collect();
    ImageBatch {
        images: Tensor::from_data(TensorData::new(pixels, [indices.len(), 1, 8, 8]), device),
        targets: Tensor::from_data(TensorData::new(labels, [indices.len()]), device),
    }
}

impl Workload for Digits {
    type Model = Mlp;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Mlp {
        Mlp {
            hidden: LinearConfig::new(64, self.hidden).init(device),
            out: LinearConfig::new(self.hidden, 10).init(device),
        }
    }
    fn train_len(&self) -> usize {
        self.splits.train.len()
    }
    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        batch(&self.splits.train, indices, device)
    }
    fn eval_len(&self) -> usize {
        self.splits.test.len()
    }
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
        batch(&self.splits.test, &range.collect::<Vec<_>>(), device)
    }
    fn cast_batch(&self, batch: ImageBatch, dtype: FloatDType) -> ImageBatch {
        ImageBatch {
            images: batch.images.cast(dtype),
            ..batch
        }
    }
}

fn run() -> kiln_engine::Result<()> {
    // A `.toml` argument is a config file; every other argument is a `key=value` assignment,
    // applied after the program's defaults.
    let (files, sets): (Vec<String>, Vec<String>) =
        std::env::args().skip(1).partition(|a| a.ends_with(".toml"));
    if files.len() > 1 {
        return Err(kiln_engine::Error::config(format!(
            "one config file at most, got {}",
            files.join(", ")
        )));
    }
    let overrides: Vec<String> = DEFAULTS.iter().map(|s| s.to_string()).chain(sets).collect();
    let config = RootConfig::load(files.first().map(Path::new), &overrides)?;
    let digits = Digits {
        hidden: 48,
        splits: kiln_datasets::digits(),
    };
    let info = RunInfo {
        model: "MLP 64-48-10".into(),
        ..RunInfo::default()
    };
    let options = RunOptions {
        verbose: true,
        ..RunOptions::default()
    };
    let result = kiln_engine::train_workload(&config, &options, &digits, info, |_| Ok(()))?;
    let summary = &result.summary;
    println!(
        "embedded: {} steps on {} devices ({}), val accuracy {:.4}, in {}",
        summary.steps,
        summary.devices,
        summary.strategy,
        summary.val_accuracy.unwrap_or(f64::NAN),
        result.dir.display()
    );
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("embedded: {e}");
        std::process::exit(e.exit_code());
    }
}
