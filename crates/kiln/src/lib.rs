//! kiln: multi-device training for Burn models.
//!
//! The layers, bottom up: [`params`] (a module's floats as flat buffers, the leaf everyone
//! imports), [`comm`] (how ranks talk), [`exec`] (one micro-batch's forward and backward,
//! whole or block by block), [`optim`] (the flat, shardable optimizer and the schedule),
//! [`strategy`] (what a step does across ranks: `single`, `ddp`, `zero1`–`zero3`), [`trainer`]
//! (the one loop every strategy shares, and its launcher), [`precision`] (the policy applied
//! around any model), [`checkpoint`] and [`metrics`] (what rank 0 writes), [`config`] and
//! [`run`] (from a config and a workload to a finished run), [`app`] (a program's command
//! line). [`builtin`] is kiln's own `train` program on top of them: its image and text
//! workloads. Models and datasets live in their own crates and know nothing of these.
//!
//! To train a model of one's own: implement [`TrainStep`] (a batch in, the loss out) and
//! [`BlockStack`] (`impl BlockStack<MyBatch> for MyModel {}` when the model does not describe
//! its blocks), a [`Workload`] (the model's construction and the data), and call
//! [`train_workload`] with a [`RootConfig`].
#![warn(missing_docs)]

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
pub mod burn_data;
pub mod checkpoint;
pub mod cli;
pub mod comm;
pub mod config;
pub mod cores;
pub mod data;
pub mod error;
pub mod exec;
pub mod files;
pub mod flight;
pub mod heap;
pub mod launcher;
pub mod metrics;
pub mod monitor;
pub mod optim;
pub mod panics;
pub mod params;
pub mod plan;
pub mod plot;
pub mod precision;
pub mod run;
pub mod runlock;
pub mod signal;
pub mod sinks;
pub mod state;
pub mod strategy;
pub mod trainer;
pub mod weights;

pub use app::{App, UserConfig};

/// kiln's version and the commit it was built from: `0.1.0 (commit 1a2b3c4d5e6f)` (`+` after
/// the commit when the checkout's files differed from it; `no commit` outside a checkout).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("KILN_COMMIT"), ")");
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
