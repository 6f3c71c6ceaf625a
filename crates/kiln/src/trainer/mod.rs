//! The training loop every strategy shares, and the launcher that starts it.
//!
//! [`fit`] is the launcher (`launch.rs`): it checks the settings and the model against the strategy's rules,
//! reads a checkpoint to resume from (`start.rs`), creates the group of ranks (one thread per
//! device, joined through a [`Collective`](crate::comm::Collective)) and starts one worker per
//! rank. The loop itself (`worker.rs`) is a step (`train_step`) and the components that decide
//! when they are due and act on the loop's [`LoopState`](crate::state::LoopState):
//! logging (`log.rs`), validation (`validate.rs`), checkpoints and snapshots
//! (`checkpointer.rs`), and the agreement on a stop signal. It talks to the collective and to a
//! [`Strategy`](crate::strategy::Strategy) through their traits only. Only rank 0 writes files.

mod checkpointer;
mod checks;
mod faults;
mod finish;
mod launch;
mod loader;
mod log;
mod plateau;
mod ranks;
mod settings;
mod start;
mod step;
mod validate;
mod worker;
mod workload;

pub use faults::{ATTEMPT_VAR, FAULT_ATTEMPTS_VAR, FAULT_VAR};
pub use finish::median;
pub use launch::{Checked, check, fit, fit_checked, refusal, sampler, total_steps};
pub use settings::{OutputSettings, ParallelSettings, TrainerSettings};
pub(crate) use start::same_samples_per_step;
pub use workload::{Event, EventKind, Workload};

/// The float values of a module's parameters and buffers, one vector per tensor, for
/// comparing runs (kept here for callers of the trainer).
pub use crate::params::parameter_values;
