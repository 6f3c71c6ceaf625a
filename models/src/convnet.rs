//! The ConvNet of the classic multi-GPU tutorial: two 5×5 convolution blocks (16 then 32
//! channels) with BatchNorm, ReLU and 2×2 max-pooling, then one linear layer.

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::blocks::{Activation, BlockStack};
use crate::step::{ImageBatch, InputSpec, StepOutput, TrainStep, classification_output};

/// Architecture of a [`ConvNet`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConvNetConfig {
    /// Output channels of each convolution block. Default `[16, 32]`.
    pub channels: Vec<usize>,
    /// Square kernel size of every convolution (odd; padded to keep the size). Default 5.
    pub kernel_size: usize,
    /// Whether each block has a BatchNorm after its convolution. Default true.
    pub batch_norm: bool,
}

impl Default for ConvNetConfig {
    fn default() -> Self {
        Self {
            channels: vec![16, 32],
            kernel_size: 5,
            batch_norm: true,
        }
    }
}

/// One stage: convolution, optional BatchNorm, ReLU, 2×2 max-pool.
#[derive(Module, Debug)]
pub struct ConvBlock {
    conv: Conv2d,
    norm: Option<BatchNorm>,
    activation: Relu,
    pool: MaxPool2d,
}

impl ConvBlock {
    /// Applies the stage to `[batch, channels, h, w]`, halving h and w.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let x = crate::fused::conv2d(&self.conv, x);
        let x = match &self.norm {
            Some(norm) => crate::fused::batch_norm(norm, x),
            None => x,
        };
        self.after_norm(x)
    }

    /// ReLU and pooling, what follows the BatchNorm.
    fn after_norm(&self, x: Tensor<4>) -> Tensor<4> {
        crate::fused::relu_max_pool(&self.activation, &self.pool, x)
    }
}

/// Convolutional classifier; see the module documentation.
#[derive(Module, Debug)]
pub struct ConvNet {
    /// The convolution stages, exposed so that recomputation can wrap them from outside.
    pub blocks: Vec<ConvBlock>,
    /// The final linear classifier.
    pub head: Linear,
}

impl ConvNetConfig {
    /// Checks that the configuration can build a network for `input`.
    pub fn validate(&self, input: &InputSpec) -> Result<(), String> {
        if self.channels.is_empty() || self.channels.contains(&0) {
            return Err(format!(
                "model.convnet.channels must be non-empty and positive, got {:?}",
                self.channels
            ));
        }
        if self.kernel_size == 0 || self.kernel_size.is_multiple_of(2) {
            return Err(format!(
                "model.convnet.kernel_size must be odd, got {}",
                self.kernel_size
            ));
        }
        let shrink = 1usize << self.channels.len();
        if input.height < shrink || input.width < shrink {
            return Err(format!(
                "model.convnet.channels has {} pooling stages, too many for {}x{} images",
                self.channels.len(),
                input.height,
                input.width
            ));
        }
        Ok(())
    }

    /// Builds the network for `input` on `device`.
    pub fn init(&self, input: &InputSpec, device: &Device) -> ConvNet {
        let pad = self.kernel_size / 2;
        let mut blocks = Vec::with_capacity(self.channels.len());
        let (mut c, mut h, mut w) = (input.channels, input.height, input.width);
        for &out in &self.channels {
            blocks.push(ConvBlock {
                conv: Conv2dConfig::new([c, out], [self.kernel_size, self.kernel_size])
                    .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
                    .init(device),
                norm: self
                    .batch_norm
                    .then(|| BatchNormConfig::new(out).init(device)),
                activation: Relu::new(),
                pool: MaxPool2dConfig::new([2, 2]).init(),
            });
            c = out;
            h /= 2;
            w /= 2;
        }
        ConvNet {
            blocks,
            head: LinearConfig::new(c * h * w, input.num_classes).init(device),
        }
    }

    /// Training FLOPs (forward and backward) of one image: three times the forward's
    /// multiply-adds, each two FLOPs, of the convolutions and the head (BatchNorm, ReLU and
    /// pooling left out, as MFU counts do).
    pub fn flops_per_sample(&self, input: &InputSpec) -> f64 {
        let k2 = (self.kernel_size * self.kernel_size) as f64;
        let (mut c, mut h, mut w) = (input.channels, input.height, input.width);
        let mut macs = 0.0;
        for &out in &self.channels {
            macs += (c * out * h * w) as f64 * k2;
            c = out;
            h /= 2;
            w /= 2;
        }
        macs += (c * h * w * input.num_classes) as f64;
        6.0 * macs
    }
}

impl ConvNet {
    /// Class logits `[batch, classes]` for images `[batch, channels, h, w]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let mut x = images;
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.head.forward(x.flatten(1, 3))
    }
}

impl TrainStep<ImageBatch> for ConvNet {
    fn step(&self, batch: ImageBatch) -> StepOutput {
        classification_output(self.forward(batch.images), batch.targets)
    }
}

impl BlockStack<ImageBatch> for ConvNet {
    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn stem(&self, batch: &ImageBatch) -> Activation {
        Activation::Rank4(batch.images.clone())
    }

    fn block_params(&self, i: usize) -> Vec<burn::module::ParamId> {
        crate::modules::param_ids(&self.blocks[i])
    }

    fn block(&self, i: usize, x: Activation) -> Activation {
        Activation::Rank4(self.blocks[i].forward(x.into_rank()))
    }

    fn block_norm(&self, i: usize) -> Option<&BatchNorm> {
        self.blocks[i].norm.as_ref()
    }

    fn before_norm(&self, i: usize, x: Activation) -> Activation {
        Activation::Rank4(crate::fused::conv2d(&self.blocks[i].conv, x.into_rank()))
    }

    fn after_norm(&self, i: usize, x: Activation) -> Activation {
        Activation::Rank4(self.blocks[i].after_norm(x.into_rank()))
    }

    fn head(&self, x: Activation, batch: &ImageBatch) -> StepOutput {
        let x: Tensor<4> = x.into_rank();
        classification_output(self.head.forward(x.flatten(1, 3)), batch.targets.clone())
    }
}
