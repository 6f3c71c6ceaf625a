//! Models for kiln (ConvNet, MLP, GPT): plain Burn modules with no parallelism imports.
//!
//! Every model implements [`TrainStep`] ("batch in, loss and outputs out") so that kiln's
//! trainer can drive it, and exposes an ordinary `forward` for inference. A model is described
//! by a serialisable [`ModelSpec`] (architecture + input shape), which is all another Rust
//! program needs, together with a weights file, to rebuild and run it: see [`load`].
#![warn(missing_docs)]

pub mod convnet;
pub mod gpt;
pub mod load;
pub mod mlp;

pub use convnet::{ConvNet, ConvNetConfig};
pub use gpt::{Gpt, GptConfig, TokenBatch};
pub use load::{
    Classifier, LoadError, ModelKind, ModelSection, ModelSpec, load_classifier, load_gpt_run,
    load_run, read_spec, save_safetensors,
};
pub use mlp::{Mlp, MlpConfig};

use burn::prelude::*;

/// A batch of images with their class labels.
#[derive(Debug, Clone)]
pub struct ImageBatch {
    /// Pixels scaled to `[0, 1]`, shape `[batch, channels, height, width]`.
    pub images: Tensor<4>,
    /// Class index of every image, shape `[batch]`.
    pub targets: Tensor<1, Int>,
}

/// What one forward pass on a training or validation batch produces.
///
/// Everything stays a tensor so that the trainer can record metrics without waiting for the
/// device; it reads them back only when it logs.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Mean loss over the batch, shape `[1]`; its backward gives the gradients.
    pub loss: Tensor<1>,
    /// Number of correct predictions in the batch (classification only), shape `[1]`.
    pub correct: Option<Tensor<1, Int>>,
    /// Number of samples in the batch.
    pub samples: usize,
}

/// The one thing kiln's trainer needs from a model: a batch in, loss and outputs out.
pub trait TrainStep<B>: Module {
    /// Runs the forward pass and the loss on `batch`.
    fn step(&self, batch: B) -> StepOutput;
}

/// The shape of the data a classifier is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputSpec {
    /// Image channels (1 for greyscale).
    pub channels: usize,
    /// Image height in pixels.
    pub height: usize,
    /// Image width in pixels.
    pub width: usize,
    /// Number of classes.
    pub num_classes: usize,
}

/// Cross-entropy loss and correct-prediction count of `logits` against `targets`.
pub fn classification_output(logits: Tensor<2>, targets: Tensor<1, Int>) -> StepOutput {
    let samples = targets.dims()[0];
    let predicted = logits.clone().argmax(1).squeeze_dim::<1>(1);
    let correct = predicted.equal(targets.clone()).int().sum();
    let loss = burn::nn::loss::CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, targets);
    StepOutput {
        loss,
        correct: Some(correct),
        samples,
    }
}
