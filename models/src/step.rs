//! What a model gives the trainer: a step ("batch in, loss and outputs out"), its batch of
//! images, its parameter groups, the input it expects.

use burn::prelude::*;

use crate::metric::SetMetric;
use crate::modules::param_ids;

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
    /// Tokens the loss is the mean over (a language model's targets that train), counted on
    /// the host: the log's tokens per second adds them up when any output has them.
    pub tokens: Option<usize>,
    /// Further scalars by name (`recon_loss`, `d_real`), each a mean over the batch of shape
    /// `[1]`: the trainer averages them over micro-batches and ranks and logs them beside the
    /// loss, in training and in validation.
    pub metrics: Vec<(String, Tensor<1>)>,
    /// Metrics over the whole validation set (R², AUC): this batch's parts, which the trainer
    /// combines over every batch and rank before it computes them. Validation only; a
    /// training step's are ignored.
    pub set_metrics: Vec<SetMetric>,
}

impl StepOutput {
    /// The output of a batch of `samples` samples whose mean loss is `loss`.
    pub fn new(loss: Tensor<1>, samples: usize) -> Self {
        Self {
            loss,
            correct: None,
            samples,
            tokens: None,
            metrics: Vec::new(),
            set_metrics: Vec::new(),
        }
    }

    /// This output with the count of tokens its loss is the mean over.
    pub fn with_tokens(mut self, tokens: usize) -> Self {
        self.tokens = Some(tokens);
        self
    }

    /// This output with a count of correct predictions (a classifier's accuracy).
    pub fn with_correct(mut self, correct: Tensor<1, Int>) -> Self {
        self.correct = Some(correct);
        self
    }

    /// This output with one more named scalar (a mean over the batch, shape `[1]`).
    pub fn with_metric(mut self, name: impl Into<String>, value: Tensor<1>) -> Self {
        self.metrics.push((name.into(), value));
        self
    }

    /// This output with the batch's part of a metric over the whole validation set
    /// ([`SetMetric::r2`], [`SetMetric::auc`], or one's own).
    pub fn with_set_metric(mut self, metric: SetMetric) -> Self {
        self.set_metrics.push(metric);
        self
    }
}

/// Parameters that one optimizer of a several-optimizer step owns (a GAN's generator or
/// discriminator): a name, used in the config (`[groups.<name>]`), the logs and the
/// checkpoint, and the ids of its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamGroup {
    /// The group's name: lower-case letters, digits, `_` and `-`.
    pub name: String,
    /// Its parameters (from [`param_ids`] of a sub-module, or chosen one by one).
    pub params: Vec<burn::module::ParamId>,
}

impl ParamGroup {
    /// The group `name` of every float parameter of `module`.
    pub fn of<M: Module>(name: impl Into<String>, module: &M) -> Self {
        Self {
            name: name.into(),
            params: param_ids(module),
        }
    }
}

/// The one thing kiln's trainer needs from a model: a batch in, loss and outputs out.
///
/// A step with several optimizers (a GAN's discriminator, then its generator) names its
/// parameter groups in [`TrainStep::param_groups`] and gives each group's loss in
/// [`TrainStep::group_step`]. The trainer then runs, for each group in order: that group's
/// forward and backward on every micro-batch of the step (the gradients reduced over ranks
/// once, after the last), and that group's optimizer step, which touches no other parameter.
/// A later group sees the parameters an earlier one has just stepped.
pub trait TrainStep<B>: Module {
    /// Runs the forward pass and the loss on `batch` (for validation, and for training when
    /// the model has one optimizer).
    fn step(&self, batch: B) -> StepOutput;

    /// The parameter groups that take optimizers of their own, in the order a step runs them.
    /// Empty (the default): one optimizer over every parameter, trained on [`TrainStep::step`].
    fn param_groups(&self) -> Vec<ParamGroup> {
        Vec::new()
    }

    /// The loss whose gradients group `group` (an index into [`TrainStep::param_groups`])
    /// steps on; gradients it gives other groups' parameters are dropped. Defaults to
    /// [`TrainStep::step`].
    fn group_step(&self, group: usize, batch: B) -> StepOutput {
        let _ = group;
        self.step(batch)
    }
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

/// Cross-entropy loss and correct-prediction count of `logits` against `targets`; the loss is
/// computed in f32 whatever the logits' dtype.
pub fn classification_output(logits: Tensor<2>, targets: Tensor<1, Int>) -> StepOutput {
    let samples = targets.dims()[0];
    let logits = logits.cast(burn::tensor::FloatDType::F32);
    let predicted = logits.clone().argmax(1).squeeze_dim::<1>(1);
    let correct = predicted.equal(targets.clone()).int().sum();
    let loss = burn::nn::loss::CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, targets);
    StepOutput::new(loss, samples).with_correct(correct)
}
