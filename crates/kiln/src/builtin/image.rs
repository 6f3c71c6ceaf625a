//! Image classification: a ConvNet or an MLP on the embedded digits, MNIST or Fashion-MNIST.

use std::ops::Range;

use burn::prelude::*;
use kiln_datasets::{IdxKind, ImageSplits};
use kiln_models::{Classifier, ImageBatch, ModelSpec};

use super::config::{Config, DataConfig, DatasetKind};
use super::launch::launch;
use kiln_engine::data::{ImageBatcher, input_spec};
use kiln_engine::error::{Error, Result};
use kiln_engine::run::{RunOptions, RunResult};
use kiln_engine::trainer::Workload;

/// Image classification: a [`Classifier`] trained on an [`ImageSplits`].
pub struct ImageWorkload {
    /// The model to build.
    pub spec: ModelSpec,
    /// Training and test images.
    pub splits: ImageSplits,
}

impl Workload for ImageWorkload {
    type Model = Classifier;
    type Batch = ImageBatch;

    fn describe(&self) -> Vec<(String, String)> {
        let (splits, train) = (&self.splits, &self.splits.train);
        vec![(
            "data".to_string(),
            format!(
                "{}: {} train / {} test, {}x{}, {} classes",
                splits.name,
                train.len(),
                splits.test.len(),
                train.height,
                train.width,
                train.num_classes
            ),
        )]
    }

    fn flops_per_sample(&self) -> Option<f64> {
        self.spec.classifier_flops_per_sample()
    }

    fn init_model(&self, device: &Device) -> Classifier {
        self.spec
            .classifier(device)
            .expect("the spec was validated as an image classifier")
    }

    fn train_len(&self) -> usize {
        self.splits.train.len()
    }

    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        ImageBatcher::new(device.clone()).batch(&self.splits.train, indices)
    }

    fn eval_len(&self) -> usize {
        self.splits.test.len()
    }

    fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
        let indices: Vec<usize> = range.collect();
        ImageBatcher::new(device.clone()).batch(&self.splits.test, &indices)
    }

    fn cast_batch(&self, batch: ImageBatch, dtype: burn::tensor::FloatDType) -> ImageBatch {
        ImageBatch {
            images: batch.images.cast(dtype),
            ..batch
        }
    }
}

/// Loads the configured dataset, downloading it first when `data.download` is set and the
/// directory is missing.
pub fn load_data(config: &DataConfig) -> Result<ImageSplits> {
    let kind = match config.dataset {
        DatasetKind::Digits => return Ok(kiln_datasets::digits()),
        DatasetKind::Text
        | DatasetKind::ImageFolder
        | DatasetKind::Csv
        | DatasetKind::Instruct
        | DatasetKind::Chat => {
            return Err(Error::config(format!(
                "key `data.dataset`: {:?} is not a dataset held in memory",
                kiln_engine::config::name_of(&config.dataset)
            )));
        }
        DatasetKind::Mnist => IdxKind::Mnist,
        DatasetKind::FashionMnist => IdxKind::FashionMnist,
    };
    let dir = config.resolved_dir();
    // One process per machine downloads; the others wait for it.
    if config.download && kiln_engine::comm::processes().local_index == 0 && !dir.is_dir() {
        say!("downloading {} into {}", kind.name(), dir.display());
        kiln_datasets::download_mnist(&dir, kind)?;
    }
    if config.download {
        kiln_engine::comm::process_barrier();
    }
    Ok(kind.load(&dir)?)
}

/// Trains the image classifier `config` describes.
pub fn train(config: &Config, options: &RunOptions) -> Result<RunResult> {
    let splits = load_data(&config.data)?;
    let spec = ModelSpec {
        model: config.model.clone(),
        input: Some(input_spec(&splits.train)),
    };
    spec.validate().map_err(Error::config)?;
    let workload = ImageWorkload {
        spec: spec.clone(),
        splits,
    };
    // The data row comes from the workload itself (`Workload::describe`).
    launch(config, options, &workload, &spec, Vec::new(), |_| Ok(()))
}
