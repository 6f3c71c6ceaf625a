//! kiln: multi-device training for Burn models, and the `train` program.
//!
//! A model written once against Burn's tensors trains on one device or many — CPU, WGPU or
//! CUDA — on one machine or several: data parallelism, ZeRO-1/2/3, pipelines, DiLoCo, mixed
//! precision, activation checkpointing, checkpoints that resume under any strategy, a planner
//! and a launcher that restarts. The engine is the `kiln-engine` crate, re-exported here whole;
//! this crate adds the command line: [`App`] (`train`'s flags, subcommands and config files for
//! a workload of one's own), kiln's own `train` program and its built-in recipes
//! ([`builtin`]), the [`launcher`] that restarts a run, and the [`plot`]s. A program of one's
//! own with `train`'s whole command line:
//!
//! ```no_run
//! use std::ops::Range;
//!
//! use burn::nn::{Linear, LinearConfig};
//! use burn::prelude::*;
//! use burn::tensor::FloatDType;
//! use kiln::{BlockStack, StepOutput, TrainStep, UserConfig, Workload};
//! use serde::{Deserialize, Serialize};
//!
//! /// The program's own `[model]` section.
//! #[derive(Debug, Clone, Default, Serialize, Deserialize)]
//! #[serde(default)]
//! struct ModelConfig {
//!     hidden: usize,
//! }
//!
//! /// The program's own `[data]` section.
//! #[derive(Debug, Clone, Default, Serialize, Deserialize)]
//! #[serde(default)]
//! struct DataConfig {
//!     points: usize,
//! }
//!
//! /// A small network that learns `sin` on [-3, 3].
//! #[derive(Module, Debug)]
//! struct Net {
//!     hidden: Linear,
//!     out: Linear,
//! }
//!
//! #[derive(Debug, Clone)]
//! struct Batch {
//!     x: Tensor<2>,
//!     y: Tensor<2>,
//! }
//!
//! /// The step: a batch in, the mean loss (f32) out, with a metric of its own.
//! impl TrainStep<Batch> for Net {
//!     fn step(&self, batch: Batch) -> StepOutput {
//!         let n = batch.x.dims()[0];
//!         let y = self.out.forward(self.hidden.forward(batch.x).tanh());
//!         let error = y.cast(FloatDType::F32) - batch.y.cast(FloatDType::F32);
//!         StepOutput::new(error.clone().square().mean(), n).with_metric("mae", error.abs().mean())
//!     }
//! }
//!
//! /// No blocks described: the model runs whole.
//! impl BlockStack<Batch> for Net {}
//!
//! /// The model's construction and its batches.
//! struct Sine {
//!     hidden: usize,
//!     points: usize,
//! }
//!
//! impl Sine {
//!     fn batch(&self, ids: impl Iterator<Item = usize>, device: &Device) -> Batch {
//!         let x: Vec<f32> = ids.map(|i| 6.0 * i as f32 / self.points as f32 - 3.0).collect();
//!         let y: Vec<f32> = x.iter().map(|v| v.sin()).collect();
//!         let n = x.len();
//!         Batch {
//!             x: Tensor::from_data(TensorData::new(x, [n, 1]), device),
//!             y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
//!         }
//!     }
//! }
//!
//! impl Workload for Sine {
//!     type Model = Net;
//!     type Batch = Batch;
//!
//!     fn init_model(&self, device: &Device) -> Net {
//!         Net {
//!             hidden: LinearConfig::new(1, self.hidden).init(device),
//!             out: LinearConfig::new(self.hidden, 1).init(device),
//!         }
//!     }
//!     fn train_len(&self) -> usize {
//!         self.points
//!     }
//!     fn train_batch(&self, indices: &[usize], device: &Device) -> Batch {
//!         self.batch(indices.iter().copied(), device)
//!     }
//!     fn eval_len(&self) -> usize {
//!         self.points / 4
//!     }
//!     fn eval_batch(&self, range: Range<usize>, device: &Device) -> Batch {
//!         self.batch(range.map(|i| 4 * i + 2), device)
//!     }
//!     fn cast_batch(&self, b: Batch, dtype: FloatDType) -> Batch {
//!         Batch { x: b.x.cast(dtype), ..b }
//!     }
//! }
//!
//! /// `sine --devices 2 --strategy zero1 --set model.hidden=64` and the rest of `train`'s
//! /// command line.
//! fn main() {
//!     kiln::App::new("sine", "Fit a sine with kiln")
//!         .recipe("[model]\nhidden = 32\n[data]\npoints = 4096\n[train]\nmax_steps = 300\n")
//!         .main(|c: &UserConfig<ModelConfig, DataConfig>| {
//!             Ok(Sine { hidden: c.model.hidden.max(1), points: c.data.points.max(64) })
//!         })
//! }
//! ```
//!
//! [`app`] is a program's command line on the engine, [`cli`] the flags and subcommands it
//! parses, [`builtin`] kiln's own `train` program (its image and text workloads), [`launcher`]
//! the restarts, [`plot`] the charts. A program that trains without a command line depends on
//! `kiln-engine` alone (its `train_workload` with a `RootConfig`).
#![deny(missing_docs)]

/// `println!` that never panics: a reader that went away (`train | head`) costs the line, not
/// the run.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

pub mod app;
pub mod builtin;
pub mod cli;
pub mod launcher;
pub mod plot;

/// The engine: the trainer, strategies, collectives, checkpoints, planner and config.
pub use kiln_engine::*;

pub use app::{App, UserConfig};

/// kiln's version and the commit it was built from: `0.1.0 (commit 1a2b3c4d5e6f)` (`+` after
/// the commit when the checkout's files differed from it; `no commit` outside a checkout).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("KILN_COMMIT"), ")");
