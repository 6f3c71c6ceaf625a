//! kiln: multi-device training for Burn models.
//!
//! The layers, bottom up: [`collective`] (how replicas agree), [`trainer`] (the one loop every
//! strategy shares), [`precision`] and [`recompute`] (policies it applies around any model),
//! [`optim`] and [`data`] (what the loop steps and feeds), [`checkpoint`] and
//! [`metrics`] (what rank 0 writes), [`config`] and [`run`] (from a TOML file to a finished
//! run). Models and datasets live in their own crates and know nothing of these.
#![warn(missing_docs)]

pub mod checkpoint;
pub mod cli;
pub mod collective;
pub mod config;
pub mod data;
pub mod error;
pub mod metrics;
pub mod monitor;
pub mod optim;
pub mod plot;
pub mod precision;
pub mod recompute;
pub mod run;
pub mod sinks;
pub mod syncbn;
pub mod trainer;

pub use config::RootConfig;
pub use error::{Error, Result};
