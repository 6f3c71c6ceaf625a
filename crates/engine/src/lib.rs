//! kiln-engine: multi-device training for Burn models, as a library.
//!
//! A model written once against Burn's tensors trains on one device or many — CPU, WGPU or
//! CUDA — on one machine or several: data parallelism, ZeRO-1/2/3, pipelines, DiLoCo, mixed
//! precision, activation checkpointing, checkpoints that resume under any strategy, a planner.
//! This crate is the engine without a command line (no clap, plots or NVML unless its `clap`
//! and `nvml` features ask for them); the `kiln` crate is the `train` program and `kiln::App`
//! on top of it. A program that trains a model of its own:
//!
//! ```no_run
//! use std::ops::Range;
//!
//! use burn::nn::{Linear, LinearConfig};
//! use burn::prelude::*;
//! use burn::tensor::FloatDType;
//! use kiln_engine::{BlockStack, RootConfig, RunInfo, RunOptions, StepOutput, TrainStep, Workload};
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
//! /// Two devices, each step's gradients averaged (ddp), 300 steps; the run directory under
//! /// `runs/` as `train` writes it.
//! fn main() -> kiln_engine::Result<()> {
//!     let mut config = RootConfig::default();
//!     config.hardware.devices = kiln_engine::config::DeviceList::Count(2);
//!     config.train.max_steps = Some(300);
//!     let sine = Sine { hidden: 32, points: 4096 };
//!     let info = RunInfo { model: "sine".into(), ..RunInfo::default() };
//!     let result =
//!         kiln_engine::train_workload(&config, &RunOptions::default(), &sine, info, |_| Ok(()))?;
//!     println!("{}: final loss {:?}", result.dir.display(), result.summary.final_train_loss);
//!     Ok(())
//! }
//! ```
//!
//! The layers, bottom up: [`params`] (a module's floats as flat buffers, the leaf everyone
//! imports), [`comm`] (how ranks talk), [`exec`] (one micro-batch's forward and backward,
//! whole or block by block), [`optim`] (the flat, shardable optimizer and the schedule),
//! [`strategy`] (what a step does across ranks: `single`, `ddp`, `zero1`–`zero3`, pipelines,
//! DiLoCo), [`trainer`] (the one loop every strategy shares, and its launcher), [`precision`]
//! (the policy applied around any model), [`checkpoint`] and [`metrics`] (what rank 0
//! writes), [`config`] and [`run`] (from a config and a workload to a finished run), [`plan`]
//! (what fits and what is fastest). Models and datasets live in their own crates and know
//! nothing of these.
#![deny(missing_docs)]

/// `println!` that never panics: a reader that went away (`train | head`) costs the line, not
/// the run.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

pub(crate) mod burn_data;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub(crate) mod cores;
pub mod data;
pub mod error;
pub mod exec;
pub mod files;
pub mod flight;
pub mod heap;
pub mod metrics;
pub(crate) mod monitor;
pub mod optim;
pub mod panics;
pub mod params;
pub mod plan;
pub mod precision;
pub mod run;
pub mod runlock;
pub mod signal;
pub mod sinks;
pub(crate) mod state;
pub mod strategy;
pub mod trainer;
pub mod weights;

pub use burn_data::{BurnData, BurnWorkload};
pub use config::RootConfig;
pub use data::sample_rng;
pub use error::{Error, Result};
pub use heap::Allocator;
// What a model of one's own implements, and how it is trained.
pub use kiln_models::{
    Activation, BlockStack, Combine, ParamGroup, SetMetric, StepOutput, TrainStep, param_ids,
};
pub use run::{RunInfo, RunOptions, RunResult, train_workload};
pub use trainer::{Event, EventKind, Workload};
