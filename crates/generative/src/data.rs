//! The `[data]` section both workloads share: which greyscale images to learn.

use std::path::PathBuf;

use burn::prelude::*;
use kiln_datasets::{IdxKind, ImageDataset, ImageSplits};
use serde::{Deserialize, Serialize};

/// Which images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dataset {
    /// The 1,797 8×8 digits embedded in kiln (no files needed).
    Digits,
    /// MNIST IDX files in `data.dir`.
    Mnist,
    /// Fashion-MNIST IDX files in `data.dir`.
    FashionMnist,
}

/// `[data]`: the images to learn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// `digits` (embedded), `mnist` or `fashion-mnist`. Default `digits`.
    pub dataset: Dataset,
    /// Directory of the IDX files. Default `data/mnist` or `data/fashion-mnist`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: Dataset::Digits,
            dir: None,
        }
    }
}

impl DataConfig {
    /// Loads the images (their labels are not used).
    pub fn load(&self) -> kiln::Result<ImageSplits> {
        let kind = match self.dataset {
            Dataset::Digits => return Ok(kiln_datasets::digits()),
            Dataset::Mnist => IdxKind::Mnist,
            Dataset::FashionMnist => IdxKind::FashionMnist,
        };
        let dir = self
            .dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("data/{}", kind.name())));
        Ok(kind.load(&dir)?)
    }
}

/// Images `indices` of `data` as `[n, 1, height, width]` in `[0, 1]`.
pub fn images(data: &ImageDataset, indices: &[usize], device: &Device) -> Tensor<4> {
    kiln::data::ImageBatcher::new(device.clone())
        .batch(data, indices)
        .images
}

/// The values of `images` (`[n, 1, h, w]`) on the host, for a PNG grid.
pub fn host_pixels(images: Tensor<4>) -> Vec<f32> {
    images
        .cast(burn::tensor::FloatDType::F32)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}

/// A standard normal number drawn from `key` alone (SplitMix64 and Box–Muller): the same on
/// every device and in every run with the same key.
pub fn normal(key: u64) -> f32 {
    let a = splitmix(key);
    let b = splitmix(a);
    let u1 = ((a >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let u2 = (b >> 11) as f64 / (1u64 << 53) as f64;
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of element `j` of sample `sample`'s noise at optimizer step `step`, in a run seeded
/// `seed`.
pub fn noise_key(seed: u64, sample: usize, step: u64, j: usize) -> u64 {
    splitmix(splitmix(splitmix(seed) ^ sample as u64) ^ step) ^ ((j as u64) << 1)
}
