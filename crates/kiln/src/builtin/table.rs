//! `data.dataset = "csv"`: the built-in MLP classifies the rows of a CSV table (numeric
//! columns; `data.target` names the class column, whole numbers from 0). Features are
//! standardised with the training rows' mean and deviation. The evaluation rows are
//! `data.eval_path`'s, or the rows left after a seeded shuffle keeps `data.train_fraction`
//! for training.

use std::ops::Range;

use burn::prelude::*;
use kiln_datasets::rng::permutation;
use kiln_datasets::table::Table;
use kiln_models::{Classifier, ImageBatch, InputSpec, ModelKind, ModelSpec};

use super::config::{Config, DataConfig};
use super::launch::launch;
use kiln_engine::error::{Error, Result};
use kiln_engine::run::{RunOptions, RunResult};
use kiln_engine::trainer::Workload;

/// The seed of the train/evaluation split of one table: fixed, so that every run of a table
/// (any `run.seed`) scores the same rows.
const SPLIT_SEED: u64 = 0x7ab1e;

/// An MLP classifier on a table's rows.
pub struct TableWorkload {
    /// The model (its input: 1 × 1 × features).
    pub spec: ModelSpec,
    /// Training rows, standardised.
    pub train: Table,
    /// Evaluation rows, standardised with the training rows' moments.
    pub eval: Table,
}

impl TableWorkload {
    /// Reads `data.path` (and `data.eval_path`) as `[data]` says.
    pub fn open(config: &DataConfig, model: &kiln_models::ModelSection) -> Result<Self> {
        if model.kind != ModelKind::Mlp {
            return Err(Error::config(
                "key `model.kind`: the csv dataset trains the \"mlp\" (a table's rows have no \
                 image to convolve)",
            ));
        }
        let path = config.path.clone().ok_or_else(|| {
            Error::config("key `data.path`: the csv dataset needs the CSV file to train on")
        })?;
        let table = Table::read_csv(&path, &config.target, &config.features)?;
        let (train, eval) = match &config.eval_path {
            Some(eval) => (
                table,
                Table::read_csv(eval, &config.target, &config.features)?,
            ),
            None => {
                let order = permutation(table.len(), SPLIT_SEED);
                let cut = ((table.len() as f64) * config.train_fraction).round() as usize;
                if cut == 0 || cut == table.len() {
                    return Err(Error::data(format!(
                        "{}: {} rows leave no {} rows at data.train_fraction = {}",
                        path.display(),
                        table.len(),
                        if cut == 0 { "training" } else { "evaluation" },
                        config.train_fraction
                    )));
                }
                (table.subset(&order[..cut]), table.subset(&order[cut..]))
            }
        };
        if eval.features != train.features {
            return Err(Error::data(format!(
                "{}: its feature columns ({}) are not the training table's ({})",
                eval.path.display(),
                eval.features.join(", "),
                train.features.join(", ")
            )));
        }
        let classes = train.classes()?.max(eval.classes()?);
        let moments = train.moments();
        let (train, eval) = (standardised(train, &moments), standardised(eval, &moments));
        let spec = ModelSpec {
            model: model.clone(),
            input: Some(InputSpec {
                channels: 1,
                height: 1,
                width: train.width(),
                num_classes: classes,
            }),
        };
        spec.validate().map_err(Error::config)?;
        Ok(Self { spec, train, eval })
    }

    fn batch(
        table: &Table,
        indices: impl ExactSizeIterator<Item = usize>,
        device: &Device,
    ) -> ImageBatch {
        let n = indices.len();
        let mut values = Vec::with_capacity(n * table.width());
        let mut targets = Vec::with_capacity(n);
        for i in indices {
            values.extend_from_slice(table.row(i));
            targets.push(table.targets[i] as i64);
        }
        ImageBatch {
            images: Tensor::from_data(TensorData::new(values, [n, 1, 1, table.width()]), device),
            targets: Tensor::from_data(TensorData::new(targets, [n]), device),
        }
    }
}

fn standardised(mut table: Table, moments: &[(f32, f32)]) -> Table {
    let w = table.width();
    for (i, v) in table.values.iter_mut().enumerate() {
        let (mean, std) = moments[i % w];
        *v = (*v - mean) / std;
    }
    table
}

impl Workload for TableWorkload {
    type Model = Classifier;
    type Batch = ImageBatch;

    fn describe(&self) -> Vec<(String, String)> {
        vec![(
            "data".to_string(),
            format!(
                "table {}: {} train / {} eval rows, {} features → {} ({} classes), standardised",
                self.train.path.display(),
                self.train.len(),
                self.eval.len(),
                self.train.width(),
                self.train.target,
                self.spec.input.map_or(0, |i| i.num_classes)
            ),
        )]
    }

    fn init_model(&self, device: &Device) -> Classifier {
        self.spec
            .classifier(device)
            .expect("the spec was validated as a classifier")
    }

    fn train_len(&self) -> usize {
        self.train.len()
    }

    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        Self::batch(&self.train, indices.iter().copied(), device)
    }

    fn eval_len(&self) -> usize {
        self.eval.len()
    }

    fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
        Self::batch(&self.eval, range, device)
    }

    fn cast_batch(&self, batch: ImageBatch, dtype: burn::tensor::FloatDType) -> ImageBatch {
        ImageBatch {
            images: batch.images.cast(dtype),
            ..batch
        }
    }
}

/// Trains the MLP on the table `config` names.
pub fn train(config: &Config, options: &RunOptions) -> Result<RunResult> {
    let workload = TableWorkload::open(&config.data, &config.model)?;
    let spec = workload.spec.clone();
    launch(config, options, &workload, &spec, Vec::new(), |_| Ok(()))
}
