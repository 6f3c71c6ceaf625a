//! A fully connected autoencoder: images through a narrow code and back, trained on the mean
//! squared error of the reconstruction. The test set's reconstruction error is the validation
//! loss; a PNG grid of test images over their reconstructions is written to the run directory.

use std::ops::Range;
use std::path::Path;

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::FloatDType;
use burn::tensor::activation::{relu, sigmoid};
use kiln::{BlockStack, StepOutput, TrainStep, UserConfig, Workload};
use kiln_datasets::ImageSplits;
use serde::{Deserialize, Serialize};

use crate::data::{DataConfig, host_pixels, images};

/// `[model]`: the autoencoder's sizes and its reconstruction grids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AutoencoderConfig {
    /// Width of the hidden layer on each side of the code. Default 256.
    pub hidden: usize,
    /// Size of the code. Default 32.
    pub code: usize,
    /// Write the reconstruction grid every this many steps (0: only after the last). Default 0.
    pub snapshot_every: usize,
    /// Test images in the grid (shown over their reconstructions). Default 16.
    pub shown: usize,
}

impl Default for AutoencoderConfig {
    fn default() -> Self {
        Self {
            hidden: 256,
            code: 32,
            snapshot_every: 0,
            shown: 16,
        }
    }
}

/// Encoder and decoder, two linear layers each.
#[derive(Module, Debug)]
pub struct Autoencoder {
    encode1: Linear,
    encode2: Linear,
    decode1: Linear,
    decode2: Linear,
}

impl AutoencoderConfig {
    /// The autoencoder for `height × width` images on `device`.
    pub fn init(&self, height: usize, width: usize, device: &Device) -> Autoencoder {
        let pixels = height * width;
        Autoencoder {
            encode1: LinearConfig::new(pixels, self.hidden).init(device),
            encode2: LinearConfig::new(self.hidden, self.code).init(device),
            decode1: LinearConfig::new(self.code, self.hidden).init(device),
            decode2: LinearConfig::new(self.hidden, pixels).init(device),
        }
    }

    /// Rejects sizes that cannot work, naming the key.
    pub fn validate(&self) -> kiln::Result<()> {
        for (key, v) in [
            ("model.hidden", self.hidden),
            ("model.code", self.code),
            ("model.shown", self.shown),
        ] {
            if v == 0 {
                return Err(kiln::Error::config(format!(
                    "key `{key}`: must be at least 1, got 0"
                )));
            }
        }
        Ok(())
    }
}

impl Autoencoder {
    /// Reconstructions of `images` (`[n, 1, h, w]`), same shape, in `[0, 1]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<4> {
        let [n, c, h, w] = images.dims();
        let x = images.flatten::<2>(1, 3);
        let code = self.encode2.forward(relu(self.encode1.forward(x)));
        let out = sigmoid(self.decode2.forward(relu(self.decode1.forward(code))));
        out.reshape([n, c, h, w])
    }
}

/// A batch of images (their labels are not needed).
#[derive(Debug, Clone)]
pub struct Images(pub Tensor<4>);

impl TrainStep<Images> for Autoencoder {
    fn step(&self, batch: Images) -> StepOutput {
        let n = batch.0.dims()[0];
        let target = batch.0.clone().cast(FloatDType::F32);
        let error = self.forward(batch.0).cast(FloatDType::F32) - target;
        let mse = error.clone().square().mean();
        StepOutput::new(mse, n).with_metric("mae", error.abs().mean())
    }
}

/// The autoencoder describes no block stack: it trains whole.
impl BlockStack<Images> for Autoencoder {}

/// The autoencoder and its images, as kiln trains them.
pub struct AutoencoderWorkload {
    /// Sizes and grids.
    pub config: AutoencoderConfig,
    /// The images.
    pub data: ImageSplits,
}

impl AutoencoderWorkload {
    /// The workload a program's config describes.
    pub fn new(config: &UserConfig<AutoencoderConfig, DataConfig>) -> kiln::Result<Self> {
        config.model.validate()?;
        Ok(Self {
            config: config.model.clone(),
            data: config.data.load()?,
        })
    }
}

impl Workload for AutoencoderWorkload {
    type Model = Autoencoder;
    type Batch = Images;

    fn init_model(&self, device: &Device) -> Autoencoder {
        self.config
            .init(self.data.train.height, self.data.train.width, device)
    }

    fn train_len(&self) -> usize {
        self.data.train.len()
    }

    fn train_batch(&self, indices: &[usize], device: &Device) -> Images {
        Images(images(&self.data.train, indices, device))
    }

    fn eval_len(&self) -> usize {
        self.data.test.len()
    }

    fn eval_batch(&self, range: Range<usize>, device: &Device) -> Images {
        let indices: Vec<usize> = range.collect();
        Images(images(&self.data.test, &indices, device))
    }

    fn cast_batch(&self, batch: Images, dtype: FloatDType) -> Images {
        Images(batch.0.cast(dtype))
    }

    fn snapshot_every(&self) -> Option<usize> {
        Some(self.config.snapshot_every)
    }

    /// `reconstructions.png`: rows of test images, each over a row of their reconstructions.
    fn snapshot(&self, _step: usize, model: &Autoencoder, run_dir: &Path) -> kiln::Result<()> {
        let device = model.encode1.weight.val().device();
        let shown = self.config.shown.min(self.data.test.len());
        let ids: Vec<usize> = (0..shown).collect();
        let inputs = images(&self.data.test, &ids, &device);
        let outputs = model.forward(inputs.clone());
        let (h, w) = (self.data.test.height, self.data.test.width);
        let columns = shown.min(8);
        let (inputs, outputs) = (host_pixels(inputs), host_pixels(outputs));
        let per = columns * h * w;
        let mut grid = Vec::with_capacity(inputs.len() * 2);
        for (a, b) in inputs.chunks(per).zip(outputs.chunks(per)) {
            grid.extend_from_slice(a);
            grid.extend_from_slice(b);
        }
        let scale = (64 / h.max(w)).max(1);
        kiln::plot::save_image_grid(
            &run_dir.join("reconstructions.png"),
            &grid,
            h,
            w,
            columns,
            scale,
        )
    }
}
