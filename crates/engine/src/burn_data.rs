//! Burn's data API carried over: a Burn [`Dataset`] and [`Batcher`] — written for Burn's own
//! learner — train through kiln as they are.
//!
//! kiln takes samples by index (its sampler decides which, from the seed, epoch, step and
//! rank), so [`BurnData`] asks the dataset for each index's item and hands the items to the
//! batcher on the rank's device, as Burn's `DataLoader` does. [`BurnWorkload`] adds the model
//! and makes a [`Workload`]:
//! ```ignore
//! let data = BurnData::new(train_set, test_set, MyBatcher::default());
//! let workload = BurnWorkload::new(data, |device| MyModelConfig::new().init(device))
//!     .with_cast(|b: MyBatch, dtype| MyBatch { images: b.images.cast(dtype), ..b });
//! kiln::train_workload(&config, &options, &workload, info, |_| Ok(()))?;
//! ```
//! A batch must be a function of its items for the loader workers (`data.workers`) to give
//! the same bits: augmentation draws from [`sample_rng`](crate::sample_rng) (in
//! `Dataset::get`, keyed by the index), not from `rand::rng()`.

use std::ops::Range;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::prelude::*;
use burn::tensor::FloatDType;
use kiln_models::BlockStack;

use crate::error::{Error, Result};
use crate::trainer::Workload;

/// A training and an evaluation [`Dataset`] of items `I`, and the [`Batcher`] that makes a
/// batch `O` of items on a device.
pub struct BurnData<I, O> {
    train: Arc<dyn Dataset<I>>,
    eval: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<I, O>>,
}

impl<I, O> Clone for BurnData<I, O> {
    fn clone(&self) -> Self {
        Self {
            train: self.train.clone(),
            eval: self.eval.clone(),
            batcher: self.batcher.clone(),
        }
    }
}

impl<I, O> BurnData<I, O> {
    /// The data of Burn's `DataLoaderBuilder::new(batcher)…build(train)` and
    /// `…build(eval)`.
    pub fn new(
        train: impl Dataset<I> + 'static,
        eval: impl Dataset<I> + 'static,
        batcher: impl Batcher<I, O> + 'static,
    ) -> Self {
        Self {
            train: Arc::new(train),
            eval: Arc::new(eval),
            batcher: Arc::new(batcher),
        }
    }

    /// Training items.
    pub fn train_len(&self) -> usize {
        self.train.len()
    }

    /// Evaluation items.
    pub fn eval_len(&self) -> usize {
        self.eval.len()
    }

    /// The batch of training items `indices` on `device` (an item the dataset cannot give is
    /// an error naming it).
    pub fn train_batch(&self, indices: &[usize], device: &Device) -> Result<O> {
        let items = items(self.train.as_ref(), indices.iter().copied(), "training")?;
        Ok(self.batcher.batch(items, device))
    }

    /// The batch of evaluation items `range` on `device`.
    pub fn eval_batch(&self, range: Range<usize>, device: &Device) -> Result<O> {
        let items = items(self.eval.as_ref(), range, "evaluation")?;
        Ok(self.batcher.batch(items, device))
    }
}

/// Items `indices` of `set`; an item the dataset cannot give (`get`'s error: a file that does
/// not read) is an error naming the item and the dataset's reason.
fn items<I>(
    set: &dyn Dataset<I>,
    indices: impl Iterator<Item = usize>,
    which: &str,
) -> Result<Vec<I>> {
    indices
        .map(|i| {
            set.get(i)
                .map_err(|e| Error::data(format!("the {which} dataset's item {i}: {e}")))
        })
        .collect()
}

type Init<M> = Box<dyn Fn(&Device) -> M + Send + Sync>;
type Cast<O> = Box<dyn Fn(O, FloatDType) -> O + Send + Sync>;

/// A [`Workload`] from a model's constructor and [`BurnData`].
pub struct BurnWorkload<M, I, O> {
    data: BurnData<I, O>,
    init: Init<M>,
    cast: Option<Cast<O>>,
    rows: Vec<(String, String)>,
}

impl<M, I, O> BurnWorkload<M, I, O> {
    /// Trains the model `init` builds on `data`.
    pub fn new(data: BurnData<I, O>, init: impl Fn(&Device) -> M + Send + Sync + 'static) -> Self {
        Self {
            data,
            init: Box::new(init),
            cast: None,
            rows: Vec::new(),
        }
    }

    /// How a batch's float inputs are cast to a lower precision's compute dtype
    /// (`precision.mode = "bf16-mixed"` and the like). Without it a batch stays as the
    /// batcher made it, and a lower precision is refused at start if the model then mixes
    /// dtypes.
    pub fn with_cast(mut self, cast: impl Fn(O, FloatDType) -> O + Send + Sync + 'static) -> Self {
        self.cast = Some(Box::new(cast));
        self
    }

    /// A row of the start-up table (`("data", "…")`).
    pub fn with_row(mut self, key: &str, value: impl Into<String>) -> Self {
        self.rows.push((key.to_string(), value.into()));
        self
    }

    /// The data.
    pub fn data(&self) -> &BurnData<I, O> {
        &self.data
    }
}

impl<M, I, O> Workload for BurnWorkload<M, I, O>
where
    M: Module + BlockStack<O> + 'static,
    O: Send,
{
    type Model = M;
    type Batch = O;

    fn init_model(&self, device: &Device) -> M {
        (self.init)(device)
    }

    fn train_len(&self) -> usize {
        self.data.train_len()
    }

    /// kiln calls [`Workload::try_train_batch`]; this form panics on an item the dataset
    /// cannot give.
    fn train_batch(&self, indices: &[usize], device: &Device) -> O {
        self.data
            .train_batch(indices, device)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_train_batch(&self, indices: &[usize], _step: usize, device: &Device) -> Result<O> {
        self.data.train_batch(indices, device)
    }

    fn eval_len(&self) -> usize {
        self.data.eval_len()
    }

    /// kiln calls [`Workload::try_eval_batch`]; this form panics on an item the dataset
    /// cannot give.
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> O {
        self.data
            .eval_batch(range, device)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_eval_batch(&self, range: Range<usize>, device: &Device) -> Result<O> {
        self.data.eval_batch(range, device)
    }

    fn cast_batch(&self, batch: O, dtype: FloatDType) -> O {
        match &self.cast {
            Some(cast) => cast(batch, dtype),
            None => batch,
        }
    }

    fn describe(&self) -> Vec<(String, String)> {
        let mut rows = vec![(
            "data".to_string(),
            format!(
                "Burn dataset: {} train / {} eval items",
                self.data.train_len(),
                self.data.eval_len()
            ),
        )];
        rows.extend(self.rows.iter().cloned());
        rows
    }
}
