//! Strategies: what one optimizer step does across ranks, and what each one allows.
//!
//! Each strategy lives in its own file and owns two things:
//! - its **rules** ([`Rules`]), in four parts for their four readers: [`Checks`] (the settings
//!   and models it refuses, one line naming the key), [`Words`] (its start-up lines and the
//!   planner's words), [`Costs`] (the bytes per rank it expects, its collectives, how the
//!   planner may run it) and [`Shape`] (how many ranks and micro-batches one replica takes,
//!   what it recomputes, what it keeps in checkpoints). The launcher, the start-up table and
//!   the loop ask [`Setup`], which asks the registry ([`rules`]); nothing outside this folder
//!   names a concrete strategy;
//! - its **step** ([`Strategy`]): the loop hands it each micro-batch, asks it for an optimizer
//!   step, and for the whole model when it evaluates or checkpoints. It owns its rank's share of
//!   the model (replica or shard), where gradients go, where optimizer state lives, and how
//!   its state leaves and re-enters a checkpoint:
//!
//! | strategy | parameters per rank | gradients per rank | optimizer state per rank |
//! |---|---|---|---|
//! | [`single`] | all | all | all |
//! | [`ddp`] | all | all, all-reduced on the last micro-step | all |
//! | [`zero1`] | all | all, all-reduced on the last micro-step | its shard |
//! | [`zero2`] | all | its shard: each block's reduce-scattered as its backward ends | its shard |
//! | [`zero3`] | its shard + the gathered units | as zero2 | its shard |
//! | [`pipeline`] | its stage's | its stage's, averaged with the same stage's | its stage's |
//!
//! The replicated strategies (`single`, `ddp`, `zero1`, `zero2`) share one step
//! (`replica::Replicated`) and differ only in their `replica::Reduction`. Every strategy
//! steps a [`FlatOptimizer`](crate::optim::FlatOptimizer) over its shard of one
//! [`FlatLayout`](crate::params::FlatLayout) (the whole space for `single` and `ddp`), so there is one optimizer path and
//! one checkpoint format ([`OptimState`](crate::optim::OptimState)).
//!
//! Around the data dimension's strategy, the mesh's other dimensions ([`Dimension`]: tensor
//! parallelism, `tp.rs`) own their checks and start-up words; [`DIMENSIONS`] lists them and
//! [`build`] puts a rank's strategy inside them.
//!
//! Adding a strategy: a file here with a type implementing the four parts of [`Rules`] (and
//! [`Strategy`], or a `replica::Reduction`), one arm in [`rules`] and one in [`build`], and a
//! variant of [`StrategyKind`](crate::config::StrategyKind). Adding a dimension: a file here
//! with a type implementing [`Dimension`] and its rank's [`Strategy`] wrapper, one entry in
//! [`DIMENSIONS`] and its wrapping in [`build`].

mod context;
mod courier;
pub mod ddp;
pub mod diloco;
mod frozen;
pub mod groups;
mod host;
mod kit;
mod memory;
pub mod pipeline;
mod registry;
mod replica;
mod rules;
pub mod single;
mod step;
mod tp;
mod update;
pub mod zero1;
pub mod zero2;
pub mod zero3;

pub use context::Context;
pub use memory::{Counter, Memory};
pub use registry::{DIMENSIONS, all_rules, build, rules};
pub use rules::{
    Checks, Costs, Dimension, Estimate, ModelFacts, Op, Own, Room, Rules, Setup, Shape, Traffic,
    Variant, Words, block_ids,
};
pub use step::{Report, Strategy};
pub use tp::{Mesh, TpComm, TpPlace, part_if_cut, rank_part};
