//! A model of one's own, trained with kiln's whole command line: an MLP on the embedded 8×8
//! digits with its own `[model]` and `[data]` sections, a metric of its own (the mean
//! probability it gives the right class), a callback that follows the best validation
//! accuracy, and a snapshot that writes it into the run directory after the last step.
//!
//! ```text
//! cargo run --release -p kiln --example own_model                      # the recipe below
//! cargo run --release -p kiln --example own_model -- --devices 2 --strategy zero1 \
//!     --max-steps 100 --set model.hidden=64 --set data.noise=0.1
//! cargo run --release -p kiln --example own_model -- --print-config
//! ```

use std::ops::Range;
use std::path::Path;
use std::sync::Mutex;

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn::tensor::activation::softmax;
use kiln::{BlockStack, Event, EventKind, StepOutput, TrainStep, UserConfig, Workload, sample_rng};
use kiln_datasets::ImageDataset;
use kiln_models::{ImageBatch, classification_output};
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: kiln::Allocator = kiln::Allocator;

/// The recipe the program runs without `--config`: kiln's sections beside its own.
const RECIPE: &str = r#"
[run]
name = "own-model"
seed = 7

[model]
hidden = 48

[data]
noise = 0.05

[train]
epochs = 4
batch_size = 32
log_every = 10

[optim]
name = "adamw"
lr = 0.005
"#;

/// `[model]`: the program's own section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ModelConfig {
    /// Width of the hidden layer.
    hidden: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self { hidden: 32 }
    }
}

/// `[data]`: Gaussian-like noise added to the training pixels, drawn per sample from kiln's
/// random numbers so that the batches are the same on any number of devices and workers.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct DataConfig {
    /// The noise's half-width (uniform in ±noise, summed over two draws).
    noise: f32,
}

/// Two linear layers with a GELU between them.
#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
}

impl Mlp {
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.hidden.forward(images.flatten(1, 3));
        self.out.forward(burn::tensor::activation::gelu(x))
    }
}

impl TrainStep<ImageBatch> for Mlp {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        let logits = self.forward(batch.images).cast(FloatDType::F32);
        // The metric: the probability given to the right class, averaged over the batch.
        let right = softmax(logits.clone().detach(), 1)
            .gather(1, batch.targets.clone().unsqueeze_dim(1))
            .mean();
        // Cross-entropy and the count of right answers, as kiln's own classifiers give them.
        classification_output(logits, batch.targets).with_metric("p_right", right)
    }
}

/// No block stack described: the model runs whole (zero2, zero3 and pipelines refuse it).
impl BlockStack<ImageBatch> for Mlp {}

/// The model, the digits and the callback's state.
struct Digits {
    model: ModelConfig,
    data: DataConfig,
    splits: kiln_datasets::ImageSplits,
    best: Mutex<Option<(usize, f64)>>,
}

impl Digits {
    fn batch(
        &self,
        set: &ImageDataset,
        indices: &[usize],
        noise: f32,
        device: &Device,
    ) -> ImageBatch {
        let mut pixels = Vec::with_capacity(indices.len() * 64);
        for &i in indices {
            let mut rng = sample_rng(i);
            for &p in set.image(i) {
                let jitter = (rng.next_f32() + rng.next_f32() - 1.0) * noise;
                pixels.push(f32::from(p) / f32::from(set.max_value) + jitter);
            }
        }
        let labels: Vec<i64> = indices.iter().map(|&i| i64::from(set.label(i))).collect();
        ImageBatch {
            images: Tensor::from_data(TensorData::new(pixels, [indices.len(), 1, 8, 8]), device),
            targets: Tensor::from_data(TensorData::new(labels, [indices.len()]), device),
        }
    }
}

impl Workload for Digits {
    type Model = Mlp;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Mlp {
        Mlp {
            hidden: LinearConfig::new(64, self.model.hidden).init(device),
            out: LinearConfig::new(self.model.hidden, 10).init(device),
        }
    }
    fn train_len(&self) -> usize {
        self.splits.train.len()
    }
    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        self.batch(&self.splits.train, indices, self.data.noise, device)
    }
    fn eval_len(&self) -> usize {
        self.splits.test.len()
    }
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
        let indices: Vec<usize> = range.collect();
        self.batch(&self.splits.test, &indices, 0.0, device)
    }
    fn cast_batch(&self, batch: ImageBatch, dtype: FloatDType) -> ImageBatch {
        ImageBatch {
            images: batch.images.cast(dtype),
            ..batch
        }
    }

    fn events(&self) -> &[EventKind] {
        &[EventKind::Validated]
    }

    /// The callback: after each validation, on rank 0, keep the best accuracy.
    fn on_event(&self, event: &Event<'_>, _model: &Mlp) -> kiln::Result<()> {
        let Some(&(_, accuracy)) = event.metrics.iter().find(|(k, _)| k == "accuracy") else {
            return Ok(());
        };
        let mut best = self.best.lock().expect("the callback's state");
        if best.is_none_or(|(_, b)| accuracy > b) {
            *best = Some((event.step, accuracy));
            println!(
                "own_model: best validation accuracy so far {accuracy:.4} at step {}",
                event.step
            );
        }
        Ok(())
    }

    /// Snapshots after the last step only.
    fn snapshot_every(&self) -> Option<usize> {
        Some(0)
    }

    /// `best.json` in the run directory: the best validation accuracy and its step.
    fn snapshot(&self, _step: usize, _model: &Mlp, run_dir: &Path) -> kiln::Result<()> {
        let Some((step, accuracy)) = *self.best.lock().expect("the callback's state") else {
            return Ok(());
        };
        let path = run_dir.join("best.json");
        let text = format!("{{\"step\": {step}, \"accuracy\": {accuracy}}}\n");
        std::fs::write(&path, text).map_err(|e| kiln::Error::io(&path, e))
    }
}

fn main() {
    kiln::App::new("own_model", "An MLP of one's own on the embedded digits")
        .recipe(RECIPE)
        .main(|config: &UserConfig<ModelConfig, DataConfig>| {
            if config.model.hidden == 0 {
                return Err(kiln::Error::config(
                    "key `model.hidden`: must be at least 1, got 0",
                ));
            }
            Ok(Digits {
                model: config.model.clone(),
                data: config.data.clone(),
                splits: kiln_datasets::digits(),
                best: Mutex::new(None),
            })
        })
}
