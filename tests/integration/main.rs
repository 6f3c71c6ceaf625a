//! kiln's integration tests: one test binary, one module per area.

mod cli;
mod common;
mod ddp;
mod gpt;
mod monitor;
#[cfg(feature = "mpi")]
mod mpi;
mod pipeline;
mod policies;
mod training;
mod zero;
