//! kiln's integration tests: one test binary, one module per area.

mod cli;
mod common;
mod ddp;
mod gpt;
mod monitor;
mod pipeline;
mod policies;
mod training;
mod zero;
