//! `train launch`: a launcher that restarts, above `train` as torchrun's agent is above its
//! workers. It starts the run (under `mpirun` on the hosts that answer, or as one process
//! here), reads how it ended (the exit code, the run directory), and after a failure starts it
//! again with `--resume` on the hosts that answer then, keeping the samples of every step:
//! the per-device batch and the accumulation are recomputed for the devices left, so the run
//! goes on with the same global batch and the same mathematics. Refusals and divergences are
//! never retried; a signal to the launcher stops the run with its checkpoint. Every restart is
//! a line of `restarts.jsonl` in the run directory, and `summary.json` counts them. A host lost
//! and answering again while the job runs on the others is taken back with a planned restart
//! at a checkpoint (`readmit.rs`). `train` itself stays a single attempt that ends cleanly.

mod agent;
mod args;
mod child;
mod hosts;
mod readmit;
mod record;
mod split;

pub use agent::run;
pub use args::{LaunchArgs, RESTARTS_FILE};
pub use hosts::expand_nodelist;
pub use split::{Split, keep_samples};
