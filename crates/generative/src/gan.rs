//! A DCGAN-style GAN: a generator of strided transposed convolutions and a discriminator of
//! strided convolutions with leaky ReLU, trained with the non-saturating loss and two AdamW
//! optimizers (`[groups.discriminator]`, `[groups.generator]`). Each step trains the
//! discriminator on real images and detached fakes, then the generator through the
//! discriminator it has just stepped. The generator's noise is drawn from the sample's index
//! and the step, so that one device and several give the same run.

use std::ops::Range;
use std::path::Path;

use burn::nn::conv::{Conv2d, Conv2dConfig, ConvTranspose2d, ConvTranspose2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn::tensor::activation::{leaky_relu, log_sigmoid, sigmoid};
use kiln::{BlockStack, ParamGroup, StepOutput, TrainStep, UserConfig, Workload};
use kiln_datasets::ImageSplits;
use serde::{Deserialize, Serialize};

use crate::data::{DataConfig, host_pixels, images, noise_key, normal};

/// `[model]`: the GAN's sizes and its sample grids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GanConfig {
    /// Size of the generator's noise vector. Default 32.
    pub latent: usize,
    /// Channels of the wider convolution (the other has half). Default 64.
    pub width: usize,
    /// Write a grid of generated samples every this many steps (0: only after the last).
    /// Default 100.
    pub sample_every: usize,
    /// Samples in a grid. Default 64.
    pub samples: usize,
}

impl Default for GanConfig {
    fn default() -> Self {
        Self {
            latent: 32,
            width: 64,
            sample_every: 100,
            samples: 64,
        }
    }
}

/// Noise to images: a linear layer to `width × s/4 × s/4`, then two transposed convolutions
/// that double the size (leaky ReLU between), the last to one channel in `[0, 1]`.
#[derive(Module, Debug)]
pub struct Generator {
    project: Linear,
    up1: ConvTranspose2d,
    up2: ConvTranspose2d,
    width: usize,
    base_h: usize,
    base_w: usize,
}

impl Generator {
    /// Images `[n, 1, h, w]` from noise `[n, latent]`.
    pub fn forward(&self, noise: Tensor<2>) -> Tensor<4> {
        let n = noise.dims()[0];
        // Leaky ReLU rather than DCGAN's ReLU: without BatchNorm to centre them, ReLU units
        // die and the samples stop depending on the noise.
        let x = leaky_relu(self.project.forward(noise), 0.2);
        let x: Tensor<4> = x.reshape([n, self.width, self.base_h, self.base_w]);
        let x = leaky_relu(self.up1.forward(x), 0.2);
        sigmoid(self.up2.forward(x))
    }
}

/// Images to one logit each: two strided convolutions with leaky ReLU, then a linear layer.
#[derive(Module, Debug)]
pub struct Discriminator {
    down1: Conv2d,
    down2: Conv2d,
    score: Linear,
}

impl Discriminator {
    /// Logits `[n, 1]` ("real") for images `[n, 1, h, w]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = leaky_relu(self.down1.forward(images), 0.2);
        let x = leaky_relu(self.down2.forward(x), 0.2);
        self.score.forward(x.flatten(1, 3))
    }
}

/// The two networks, one module.
#[derive(Module, Debug)]
pub struct Gan {
    /// Noise to images.
    pub generator: Generator,
    /// Images to a logit.
    pub discriminator: Discriminator,
}

impl GanConfig {
    /// The GAN for `height × width` images (both multiples of 4) on `device`.
    pub fn init(&self, height: usize, width: usize, device: &Device) -> Gan {
        let base = [height / 4, width / 4];
        let (wide, narrow) = (self.width, (self.width / 2).max(1));
        let kernel = [4, 4];
        Gan {
            generator: Generator {
                project: LinearConfig::new(self.latent, wide * base[0] * base[1]).init(device),
                up1: ConvTranspose2dConfig::new([wide, narrow], kernel)
                    .with_stride([2, 2])
                    .with_padding([1, 1])
                    .init(device),
                up2: ConvTranspose2dConfig::new([narrow, 1], kernel)
                    .with_stride([2, 2])
                    .with_padding([1, 1])
                    .init(device),
                width: wide,
                base_h: base[0],
                base_w: base[1],
            },
            discriminator: Discriminator {
                down1: Conv2dConfig::new([1, narrow], kernel)
                    .with_stride([2, 2])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .init(device),
                down2: Conv2dConfig::new([narrow, wide], kernel)
                    .with_stride([2, 2])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .init(device),
                score: LinearConfig::new(wide * base[0] * base[1], 1).init(device),
            },
        }
    }

    /// Rejects sizes that cannot work, naming the key.
    pub fn validate(&self, height: usize, width: usize) -> kiln::Result<()> {
        let bad = |key: &str, msg: String| Err(kiln::Error::config(format!("key `{key}`: {msg}")));
        if self.latent == 0 {
            return bad("model.latent", "must be at least 1, got 0".into());
        }
        if self.width < 2 {
            return bad(
                "model.width",
                format!("must be at least 2, got {}", self.width),
            );
        }
        if self.samples == 0 {
            return bad("model.samples", "must be at least 1, got 0".into());
        }
        if !height.is_multiple_of(4) || !width.is_multiple_of(4) || height == 0 || width == 0 {
            return bad(
                "data.dataset",
                format!(
                    "the GAN needs images whose sides are multiples of 4, got {height}×{width}"
                ),
            );
        }
        Ok(())
    }
}

/// A batch: real images and the noise of as many fakes.
#[derive(Debug, Clone)]
pub struct GanBatch {
    /// Real images `[n, 1, h, w]` in `[0, 1]`.
    pub images: Tensor<4>,
    /// Noise `[n, latent]`.
    pub noise: Tensor<2>,
}

/// `-log σ(x)`, the binary cross-entropy of logits `x` labelled "real", as a mean.
fn real_loss(logits: Tensor<2>) -> Tensor<1> {
    log_sigmoid(logits).neg().mean()
}

/// `-log(1 - σ(x))`, the binary cross-entropy of logits `x` labelled "fake", as a mean.
fn fake_loss(logits: Tensor<2>) -> Tensor<1> {
    log_sigmoid(logits.neg()).neg().mean()
}

impl Gan {
    /// The discriminator's loss on real images and on `fakes`, with the mean probability it
    /// gives each as metrics.
    fn discriminator_output(&self, images: Tensor<4>, fakes: Tensor<4>) -> StepOutput {
        let n = images.dims()[0];
        let real = self.discriminator.forward(images).cast(FloatDType::F32);
        let fake = self.discriminator.forward(fakes).cast(FloatDType::F32);
        let d_real = sigmoid(real.clone()).mean();
        let d_fake = sigmoid(fake.clone()).mean();
        StepOutput::new(real_loss(real) + fake_loss(fake), n)
            .with_metric("d_real", d_real)
            .with_metric("d_fake", d_fake)
    }
}

impl TrainStep<GanBatch> for Gan {
    /// Validation: the discriminator's loss on real test images and fakes, with the
    /// generator's loss as a metric.
    fn step(&self, batch: GanBatch) -> StepOutput {
        let fakes = self.generator.forward(batch.noise);
        let g_loss = real_loss(
            self.discriminator
                .forward(fakes.clone())
                .cast(FloatDType::F32),
        );
        self.discriminator_output(batch.images, fakes)
            .with_metric("g_loss", g_loss)
    }

    fn param_groups(&self) -> Vec<ParamGroup> {
        vec![
            ParamGroup::of("discriminator", &self.discriminator),
            ParamGroup::of("generator", &self.generator),
        ]
    }

    fn group_step(&self, group: usize, batch: GanBatch) -> StepOutput {
        if group == 0 {
            // The discriminator learns from fakes it cannot change.
            let fakes = self.generator.forward(batch.noise).detach();
            self.discriminator_output(batch.images, fakes)
        } else {
            let n = batch.noise.dims()[0];
            let fakes = self.generator.forward(batch.noise);
            let logits = self.discriminator.forward(fakes).cast(FloatDType::F32);
            StepOutput::new(real_loss(logits), n)
        }
    }
}

/// The GAN describes no block stack: it trains whole.
impl BlockStack<GanBatch> for Gan {}

/// The GAN and its images, as kiln trains them.
pub struct GanWorkload {
    /// Sizes and sample grids.
    pub config: GanConfig,
    /// The images.
    pub data: ImageSplits,
    /// The run's seed (the noise is drawn from it).
    pub seed: u64,
}

/// The noise of the images `samples` at `step`: one row per sample.
fn noise(seed: u64, latent: usize, samples: &[usize], step: u64, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = samples
        .iter()
        .flat_map(|&s| (0..latent).map(move |j| normal(noise_key(seed, s, step, j))))
        .collect();
    Tensor::from_data(TensorData::new(values, [samples.len(), latent]), device)
}

/// The step value that keys the noise of validation and of the sample grids.
const FIXED: u64 = u64::MAX;

impl GanWorkload {
    /// The workload a program's config describes.
    pub fn new(config: &UserConfig<GanConfig, DataConfig>) -> kiln::Result<Self> {
        let data = config.data.load()?;
        config.model.validate(data.train.height, data.train.width)?;
        Ok(Self {
            config: config.model.clone(),
            data,
            seed: config.kiln.run.seed,
        })
    }
}

impl Workload for GanWorkload {
    type Model = Gan;
    type Batch = GanBatch;

    fn init_model(&self, device: &Device) -> Gan {
        self.config
            .init(self.data.train.height, self.data.train.width, device)
    }

    fn train_len(&self) -> usize {
        self.data.train.len()
    }

    fn train_batch(&self, indices: &[usize], device: &Device) -> GanBatch {
        self.train_batch_at(indices, 0, device)
    }

    fn train_batch_at(&self, indices: &[usize], step: usize, device: &Device) -> GanBatch {
        GanBatch {
            images: images(&self.data.train, indices, device),
            noise: noise(self.seed, self.config.latent, indices, step as u64, device),
        }
    }

    fn eval_len(&self) -> usize {
        self.data.test.len()
    }

    fn eval_batch(&self, range: Range<usize>, device: &Device) -> GanBatch {
        let indices: Vec<usize> = range.collect();
        GanBatch {
            images: images(&self.data.test, &indices, device),
            noise: noise(self.seed, self.config.latent, &indices, FIXED, device),
        }
    }

    fn cast_batch(&self, batch: GanBatch, dtype: FloatDType) -> GanBatch {
        GanBatch {
            images: batch.images.cast(dtype),
            noise: batch.noise.cast(dtype),
        }
    }

    fn snapshot_every(&self) -> Option<usize> {
        Some(self.config.sample_every)
    }

    /// `samples/step-NNNNNN.png` and `samples.png`: a grid of images generated from fixed
    /// noise, so that grids of successive steps compare.
    fn snapshot(&self, step: usize, model: &Gan, run_dir: &Path) -> kiln::Result<()> {
        let device = model.generator.project.weight.val().device();
        let ids: Vec<usize> = (0..self.config.samples).collect();
        let z = noise(self.seed, self.config.latent, &ids, FIXED, &device);
        let pixels = host_pixels(model.generator.forward(z));
        let (h, w) = (self.data.train.height, self.data.train.width);
        let columns = (self.config.samples as f64).sqrt().ceil() as usize;
        let scale = (64 / h.max(w)).max(1);
        let path = run_dir.join("samples").join(format!("step-{step:06}.png"));
        kiln::plot::save_image_grid(&path, &pixels, h, w, columns, scale)?;
        kiln::plot::save_image_grid(&run_dir.join("samples.png"), &pixels, h, w, columns, scale)
    }
}
