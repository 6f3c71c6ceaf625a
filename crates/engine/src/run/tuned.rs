//! [`Tuned`]: a workload whose model starts from `init.from` and trains as `[finetune]` says
//! (frozen parts, LoRA adapters) — the same data and callbacks, so every strategy, program
//! and device count trains it as any other model.

use std::ops::Range;

use burn::module::Module;
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::tensor::FloatDType;

use crate::config::{FinetuneConfig, InitConfig};
use crate::error::Result;
use crate::trainer::{Event, EventKind, Workload};
use crate::weights::{self, Loaded};

/// `inner` with its model loaded from `init.from` (checked once, when built) and frozen or
/// adapted as `[finetune]` says.
pub struct Tuned<'a, W> {
    inner: &'a W,
    /// The loaded weights of the plain model (before adapters), copied into each model built.
    start: Option<ModuleRecord>,
    tune: FinetuneConfig,
    /// What the load took, for the start-up table.
    pub loaded: Option<Loaded>,
    /// Trainable and total parameters of the tuned model.
    pub counts: (usize, usize),
}

impl<'a, W: Workload> Tuned<'a, W> {
    /// Reads `init.from` into a model of `inner` on `device` (unless `resuming`: a checkpoint
    /// holds every weight) and applies `[finetune]` to it, refusing in one line what does not
    /// fit; nothing is written.
    pub fn new(
        inner: &'a W,
        init: &InitConfig,
        tune: &FinetuneConfig,
        resuming: bool,
        device: &Device,
    ) -> Result<Self> {
        let device = device.clone().autodiff();
        let plain = kiln_models::with_rng(|| kiln_models::materialized(inner.init_model(&device)));
        let sharded = init
            .from
            .as_deref()
            .filter(|from| crate::checkpoint::is_sharded(from));
        let (plain, loaded) = if let Some(dir) = sharded.filter(|_| !resuming) {
            // A sharded checkpoint: its weights whole, as a resume reads them — under the
            // model's own names, so what reads a weights file otherwise is refused, not left out.
            let reads_otherwise = [
                (!init.rename.is_empty(), "init.rename"),
                (init.partial, "init.partial"),
                (
                    init.format != crate::config::WeightsFormat::Kiln,
                    "init.format",
                ),
            ];
            if let Some((_, key)) = reads_otherwise.iter().find(|(set, _)| *set) {
                return Err(crate::error::Error::config(format!(
                    "key `{key}`: {} is a sharded checkpoint, read whole under the model's own \
                     names; renames, partial loading and the PyTorch layout apply to a weights \
                     file (a run's exported model.safetensors, a .bpk, a .safetensors, a .pt)",
                    dir.display()
                )));
            }
            let model = crate::checkpoint::load_model(dir, plain)
                .map_err(|e| crate::error::Error::config(format!("key `init.from`: {e}")))?;
            let applied = crate::params::parameter_values(&model).len();
            let loaded = Loaded {
                file: dir.to_path_buf(),
                applied,
                ..Loaded::default()
            };
            (model, Some(loaded))
        } else if init.from.is_some() && !resuming {
            let (model, loaded) = weights::load(plain, init)?;
            (model, Some(loaded))
        } else {
            (plain, None)
        };
        let tuned = kiln_models::with_rng(|| weights::apply(plain.clone(), tune))?;
        let counts = weights::count_params(&tuned);
        Ok(Self {
            inner,
            start: loaded.is_some().then(|| plain.into_record()),
            tune: tune.clone(),
            loaded,
            counts,
        })
    }
}

impl<W: Workload> Workload for Tuned<'_, W> {
    type Model = W::Model;
    type Batch = W::Batch;

    fn init_model(&self, device: &Device) -> Self::Model {
        let mut model = self.inner.init_model(device);
        if let Some(start) = &self.start {
            model = model.load_record(start.clone());
        }
        weights::apply(model, &self.tune).expect("[finetune] was checked on this model")
    }
    fn train_len(&self) -> usize {
        self.inner.train_len()
    }
    fn train_batch(&self, indices: &[usize], device: &Device) -> Self::Batch {
        self.inner.train_batch(indices, device)
    }
    fn train_batch_at(&self, indices: &[usize], step: usize, device: &Device) -> Self::Batch {
        self.inner.train_batch_at(indices, step, device)
    }
    fn try_train_batch(
        &self,
        indices: &[usize],
        step: usize,
        device: &Device,
    ) -> Result<Self::Batch> {
        self.inner.try_train_batch(indices, step, device)
    }
    fn eval_len(&self) -> usize {
        self.inner.eval_len()
    }
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> Self::Batch {
        self.inner.eval_batch(range, device)
    }
    fn try_eval_batch(&self, range: Range<usize>, device: &Device) -> Result<Self::Batch> {
        self.inner.try_eval_batch(range, device)
    }
    fn cast_batch(&self, batch: Self::Batch, dtype: FloatDType) -> Self::Batch {
        self.inner.cast_batch(batch, dtype)
    }
    fn sample(&self, step: usize, slot: usize, slots: usize, batch: usize) -> Option<Vec<usize>> {
        self.inner.sample(step, slot, slots, batch)
    }
    fn lr(&self, group: usize, step: usize, scheduled: f64) -> f64 {
        self.inner.lr(group, step, scheduled)
    }
    fn tokens_per_sample(&self) -> Option<usize> {
        self.inner.tokens_per_sample()
    }
    fn flops_per_sample(&self) -> Option<f64> {
        self.inner.flops_per_sample()
    }
    fn snapshot_every(&self) -> Option<usize> {
        self.inner.snapshot_every()
    }
    fn describe(&self) -> Vec<(String, String)> {
        self.inner.describe()
    }
    fn drop_last(&self) -> bool {
        self.inner.drop_last()
    }
    fn events(&self) -> &[EventKind] {
        self.inner.events()
    }
    fn on_event(&self, event: &Event<'_>, model: &Self::Model) -> Result<()> {
        self.inner.on_event(event, model)
    }
    fn snapshot(&self, step: usize, model: &Self::Model, run_dir: &std::path::Path) -> Result<()> {
        self.inner.snapshot(step, model, run_dir)
    }
}
