//! `data.dataset = "image-folder"`: a ConvNet or an MLP on a folder of PNG/JPEG images in
//! torchvision's ImageFolder layout (`data.dir` holds `train/` and `test/` or `val/`, each
//! with one sub-folder per class). Images are decoded when a batch needs them — by the loader
//! threads with `data.workers` — resized to the model's input, and, with `data.augment`,
//! randomly cropped and flipped from (seed, step, sample).

use std::ops::Range;
use std::path::Path;

use burn::prelude::*;
use kiln_datasets::folder::{ImageFolder, Pixels, image_shape};
use kiln_models::{Classifier, ImageBatch, InputSpec, ModelSpec};

use super::config::{Config, DataConfig};
use super::launch::launch;
use kiln_engine::data::sample_rng;
use kiln_engine::error::{Error, Result};
use kiln_engine::run::{RunOptions, RunResult};
use kiln_engine::trainer::Workload;

/// An image classifier trained on an [`ImageFolder`].
pub struct FolderWorkload {
    /// The model to build (its input: the folder's classes, the size images are resized to).
    pub spec: ModelSpec,
    /// The training split.
    pub train: ImageFolder,
    /// The evaluation split (`test/`, or `val/`).
    pub test: ImageFolder,
    /// Randomly crop (zero padding of 1/8 of the side, then a crop of the input's size) and
    /// flip left–right each training image.
    pub augment: bool,
}

impl FolderWorkload {
    /// Opens `data.dir`'s splits and sizes the model's input from `data.image_size` and
    /// `data.channels`, or from the first training image.
    pub fn open(config: &DataConfig, model: &kiln_models::ModelSection) -> Result<Self> {
        let dir = config.resolved_dir();
        if !dir.is_dir() {
            return Err(Error::data(format!(
                "image folder {} does not exist (set data.dir to a folder holding train/ and \
                 test/ or val/, each with one sub-folder per class)",
                dir.display()
            )));
        }
        let train = ImageFolder::open(&dir.join("train"))?;
        let eval_dir = ["test", "val"]
            .iter()
            .map(|s| dir.join(s))
            .find(|d| d.is_dir())
            .ok_or_else(|| {
                Error::data(format!(
                    "image folder {} has no test/ or val/ folder to evaluate on",
                    dir.display()
                ))
            })?;
        let test = ImageFolder::open_as(&eval_dir, train.classes())?;
        let (h, w, c) = image_shape(train.path(0))?;
        let (height, width) = config.image_size.map_or((h, w), |[h, w]| (h, w));
        let channels = config.channels.unwrap_or(c);
        let spec = ModelSpec {
            model: model.clone(),
            input: Some(InputSpec {
                channels,
                height,
                width,
                num_classes: train.classes().len(),
            }),
        };
        spec.validate().map_err(Error::config)?;
        Ok(Self {
            spec,
            train,
            test,
            augment: config.augment,
        })
    }

    fn input(&self) -> InputSpec {
        self.spec.input.expect("set by open")
    }

    /// The batch of `indices` of `folder` on `device`, augmented with the random numbers of
    /// each sample when `augment`.
    fn batch(
        &self,
        folder: &ImageFolder,
        indices: &[usize],
        augment: bool,
        device: &Device,
    ) -> Result<ImageBatch> {
        let InputSpec {
            channels: c,
            height: h,
            width: w,
            ..
        } = self.input();
        let mut images = Vec::with_capacity(indices.len() * c * h * w);
        let mut targets = Vec::with_capacity(indices.len());
        for &i in indices {
            let px = folder.load(i, c, h, w)?;
            write_chw(&px, augment.then_some(i), &mut images);
            targets.push(i64::from(folder.label(i)));
        }
        let n = indices.len();
        Ok(ImageBatch {
            images: Tensor::from_data(TensorData::new(images, [n, c, h, w]), device),
            targets: Tensor::from_data(TensorData::new(targets, [n]), device),
        })
    }
}

/// Appends `px` as `[c, h, w]` floats in `[0, 1]`; for `augment = Some(sample)`, shifted by a
/// random offset within a zero border of 1/8 of each side, and flipped left–right with
/// probability 1/2, from the sample's random numbers.
fn write_chw(px: &Pixels, augment: Option<usize>, out: &mut Vec<f32>) {
    let (c, h, w) = (px.channels, px.height, px.width);
    let (mut dy, mut dx, mut flip) = (0isize, 0isize, false);
    if let Some(sample) = augment {
        let mut rng = sample_rng(sample);
        let (py, pxd) = ((h / 8) as isize, (w / 8) as isize);
        dy = rng.index(2 * py as usize + 1) as isize - py;
        dx = rng.index(2 * pxd as usize + 1) as isize - pxd;
        flip = rng.next_u64() & 1 == 1;
    }
    for ch in 0..c {
        for y in 0..h as isize {
            for x in 0..w as isize {
                let sx = if flip { w as isize - 1 - x } else { x } + dx;
                let sy = y + dy;
                let inside = (0..h as isize).contains(&sy) && (0..w as isize).contains(&sx);
                let v = if inside {
                    f32::from(px.data[(sy as usize * w + sx as usize) * c + ch]) / 255.0
                } else {
                    0.0
                };
                out.push(v);
            }
        }
    }
}

impl Workload for FolderWorkload {
    type Model = Classifier;
    type Batch = ImageBatch;

    fn describe(&self) -> Vec<(String, String)> {
        let i = self.input();
        vec![(
            "data".to_string(),
            format!(
                "image folder {}: {} train / {} {} images, {} classes, read as {}x{}{}{}",
                self.train.dir().parent().unwrap_or(Path::new("")).display(),
                self.train.len(),
                self.test.len(),
                self.test
                    .dir()
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("test"),
                i.num_classes,
                i.height,
                i.width,
                if i.channels == 1 { " grey" } else { " RGB" },
                if self.augment {
                    ", random crop and flip"
                } else {
                    ""
                }
            ),
        )]
    }

    fn init_model(&self, device: &Device) -> Classifier {
        self.spec
            .classifier(device)
            .expect("the spec was validated as an image classifier")
    }

    fn train_len(&self) -> usize {
        self.train.len()
    }

    /// kiln calls [`Workload::try_train_batch`]; this form panics on a file that does not
    /// decode.
    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        self.try_train_batch(indices, 0, device)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_train_batch(
        &self,
        indices: &[usize],
        _step: usize,
        device: &Device,
    ) -> Result<ImageBatch> {
        self.batch(&self.train, indices, self.augment, device)
    }

    fn eval_len(&self) -> usize {
        self.test.len()
    }

    /// kiln calls [`Workload::try_eval_batch`]; this form panics on a file that does not
    /// decode.
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
        self.try_eval_batch(range, device)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_eval_batch(&self, range: Range<usize>, device: &Device) -> Result<ImageBatch> {
        let indices: Vec<usize> = range.collect();
        self.batch(&self.test, &indices, false, device)
    }

    fn cast_batch(&self, batch: ImageBatch, dtype: burn::tensor::FloatDType) -> ImageBatch {
        ImageBatch {
            images: batch.images.cast(dtype),
            ..batch
        }
    }
}

/// Trains the image classifier `config` describes on its image folder.
pub fn train(config: &Config, options: &RunOptions) -> Result<RunResult> {
    let workload = FolderWorkload::open(&config.data, &config.model)?;
    let spec = workload.spec.clone();
    launch(config, options, &workload, &spec, Vec::new(), |_| Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn augmentation_shifts_and_flips_within_the_image() {
        let px = Pixels {
            data: (0..16).collect(),
            height: 4,
            width: 4,
            channels: 1,
        };
        let mut plain = Vec::new();
        write_chw(&px, None, &mut plain);
        assert_eq!(plain[5], 5.0 / 255.0);
        // Different samples draw different crops; the same sample the same one.
        let draws: Vec<Vec<f32>> = (0..8)
            .map(|s| {
                let mut v = Vec::new();
                write_chw(&px, Some(s), &mut v);
                v
            })
            .collect();
        assert!(draws.iter().any(|d| *d != plain));
        let mut again = Vec::new();
        write_chw(&px, Some(3), &mut again);
        assert_eq!(again, draws[3]);
        // A 4-pixel side pads by 0: only flips.
        for d in &draws {
            assert!(*d == plain || d[0] == 3.0 / 255.0);
        }
    }
}
