//! The training loop every strategy shares, and the launcher that starts it.
//!
//! [`fit`] is the launcher (`launch.rs`): it checks the settings and the model against the strategy's rules,
//! reads a checkpoint to resume from (`start.rs`), creates the group of ranks (one thread per
//! device, joined through a [`Collective`](crate::comm::Collective)) and starts one worker per
//! rank. The loop itself (`worker.rs`) is a step (`train_step`) and then, in order, the parts
//! of `after.rs`'s list (each an `AfterStep`, reading one decision of what is due and acting
//! on the loop's [`LoopState`](crate::state::LoopState)): the memory hold, logging
//! (`log.rs`), validation (`validate.rs`) and the watches it feeds, the epoch's end,
//! checkpoints and snapshots (`checkpointer.rs`), the stop at an agreed signal or early. It talks to the collective and to a
//! [`Strategy`](crate::strategy::Strategy) through their traits only. Only rank 0 writes files.

mod after;
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
