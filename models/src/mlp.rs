//! A multi-layer perceptron over flattened images.

use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::blocks::{Activation, BlockStack};
use crate::step::{ImageBatch, InputSpec, StepOutput, TrainStep, classification_output};

/// Architecture of an [`Mlp`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MlpConfig {
    /// Width of each hidden layer. Default `[256, 128]`.
    pub hidden: Vec<usize>,
}

impl Default for MlpConfig {
    fn default() -> Self {
        Self {
            hidden: vec![256, 128],
        }
    }
}

/// Fully connected classifier with ReLU between layers.
#[derive(Module, Debug)]
pub struct Mlp {
    /// Hidden layers, each followed by ReLU.
    pub layers: Vec<Linear>,
    /// The output layer.
    pub head: Linear,
    activation: Relu,
}

impl MlpConfig {
    /// Checks that the configuration is buildable.
    pub fn validate(&self) -> Result<(), String> {
        if self.hidden.contains(&0) {
            return Err(format!(
                "model.mlp.hidden must hold positive widths, got {:?}",
                self.hidden
            ));
        }
        Ok(())
    }

    /// Builds the network for `input` on `device`.
    pub fn init(&self, input: &InputSpec, device: &Device) -> Mlp {
        let mut width = input.channels * input.height * input.width;
        let mut layers = Vec::with_capacity(self.hidden.len());
        for &h in &self.hidden {
            layers.push(LinearConfig::new(width, h).init(device));
            width = h;
        }
        Mlp {
            layers,
            head: LinearConfig::new(width, input.num_classes).init(device),
            activation: Relu::new(),
        }
    }

    /// Training FLOPs (forward and backward) of one image: six per weight of the layers.
    pub fn flops_per_sample(&self, input: &InputSpec) -> f64 {
        let mut width = input.channels * input.height * input.width;
        let mut macs = 0;
        for &h in &self.hidden {
            macs += width * h;
            width = h;
        }
        6.0 * (macs + width * input.num_classes) as f64
    }
}

impl Mlp {
    /// Class logits `[batch, classes]` for images `[batch, channels, h, w]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = images.flatten(1, 3);
        for layer in &self.layers {
            x = self.activation.forward(layer.forward(x));
        }
        self.head.forward(x)
    }
}

impl TrainStep<ImageBatch> for Mlp {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        classification_output(self.forward(batch.images), batch.targets)
    }
}

/// The hidden layers (linear + ReLU) are the blocks; the stem flattens the images.
impl BlockStack<ImageBatch> for Mlp {
    fn num_blocks(&self) -> usize {
        self.layers.len()
    }

    fn stem(&self, batch: &ImageBatch) -> Activation {
        Activation::Rank2(batch.images.clone().flatten(1, 3))
    }

    fn block_params(&self, i: usize) -> Vec<burn::module::ParamId> {
        crate::modules::param_ids(&self.layers[i])
    }

    fn block(&self, i: usize, x: Activation) -> Activation {
        Activation::Rank2(
            self.activation
                .forward(self.layers[i].forward(x.into_rank::<2>())),
        )
    }

    fn head(&self, x: Activation, batch: &ImageBatch) -> StepOutput {
        classification_output(self.head.forward(x.into_rank::<2>()), batch.targets.clone())
    }
}
