//! Models for kiln (ConvNet, MLP, GPT, and the Hugging Face families Llama and GPT-2): plain
//! Burn modules with no parallelism imports.
//!
//! Every model implements [`TrainStep`] ("batch in, loss and outputs out") so that kiln's
//! trainer can drive it, and exposes an ordinary `forward` for inference. A model is described
//! by a serialisable [`ModelSpec`] (architecture + input shape), which is all another Rust
//! program needs, together with a weights file, to rebuild and run it: see [`load`].
#![warn(missing_docs)]

pub mod blocks;
pub mod convnet;
pub mod gpt;
pub mod gpt2;
pub mod hf;
pub mod llama;
pub mod lm;
pub mod load;
pub mod metric;
pub mod mlp;

pub use blocks::{Activation, BlockStack};
pub use convnet::{ConvNet, ConvNetConfig};
pub use gpt::{Gpt, GptConfig, TokenBatch};
pub use gpt2::{Gpt2, Gpt2Config};
pub use hf::{HfArchitecture, HfLoaded};
pub use llama::{Llama, LlamaConfig};
pub use lm::{CausalLm, KvCache};
pub use load::{
    Classifier, LanguageModel, LoadError, ModelKind, ModelSection, ModelSpec, load_classifier,
    load_gpt_run, load_lm_run, load_run, read_spec, save_safetensors,
};
pub use metric::{Combine, SetMetric};
pub use mlp::{Mlp, MlpConfig};

use burn::prelude::*;

/// Runs `f` — typically seeding a device and building a model — while no other caller of
/// this function draws random numbers.
///
/// Burn's CPU random generator is process-wide, so two threads initialising models at once
/// (two runs in one process, replicas starting, tests in parallel) would interleave their
/// draws and make seeded initialisation irreproducible. Every model construction in kiln goes
/// through here.
pub fn with_rng<R>(f: impl FnOnce() -> R) -> R {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = RNG.lock().unwrap_or_else(|p| p.into_inner());
    f()
}

/// `linear` on `[B, T, C]` as one matrix product over the `B·T` rows. Burn's `linear` keeps
/// a batched product when T is a multiple of its row tile — one gemm per batch row, each
/// packing the same weight again; flattened first, it is one gemm whatever B. Each output
/// element sums over C in the same order either way.
pub fn linear_rows(linear: &burn::nn::Linear, x: Tensor<3>) -> Tensor<3> {
    on_rows(x, |rows| linear.forward(rows))
}

/// `f` on `[B, T, C]` seen as its `[B·T, C]` rows, the result back as `[B, T, N]`.
pub fn on_rows(x: Tensor<3>, f: impl FnOnce(Tensor<2>) -> Tensor<2>) -> Tensor<3> {
    let [b, t, c] = x.dims();
    let y = f(x.reshape([b * t, c]));
    let n = y.dims()[1];
    y.reshape([b, t, n])
}

/// Forces the initialisation of every parameter of `module`.
///
/// Burn initialises parameters lazily, on first use; drawing their random values here, inside
/// [`with_rng`], keeps them reproducible.
pub fn materialized<M: Module>(module: M) -> M {
    struct Touch;
    impl burn::module::ModuleVisitor for Touch {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
    module
}

/// The ids of every float parameter of `module` (trained or not), in module order: what
/// [`BlockStack::block_params`] returns for a block's sub-module.
pub fn param_ids<M: Module>(module: &M) -> Vec<burn::module::ParamId> {
    struct Ids(Vec<burn::module::ParamId>);
    impl burn::module::ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// The path of every float parameter of `module` (`model.layers.0.self_attn.q_proj.weight`),
/// in module order, as weight files name them.
pub fn param_paths<M: Module>(module: &M) -> Vec<String> {
    struct Paths {
        at: Vec<String>,
        out: Vec<String>,
    }
    impl burn::module::ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.at.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.at.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &burn::module::Param<Tensor<D>>) {
            self.out.push(self.at.join("."));
        }
    }
    let mut paths = Paths {
        at: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut paths);
    paths.out
}

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
            metrics: Vec::new(),
            set_metrics: Vec::new(),
        }
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
