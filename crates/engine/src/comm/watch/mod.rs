//! Never hang, never go unexplained: every collective and transfer of a rank is recorded in its
//! flight recorder and watched against a deadline (PyTorch's NCCL watchdog and Flight Recorder
//! do the same for its process groups).
//!
//! [`watched`] wraps each rank's group in a [`Watched`] group that numbers its collectives (per
//! group, the same on every rank), records each one's kind, group, size and dtype, when it was
//! entered and left, in the rank's [`Recorder`] (a ring of the last `dist.flight_entries`), and
//! with `dist.check_collectives` first compares that signature across the group's ranks. One
//! [`Watchdog`] thread per process looks at its ranks every 100 ms: a rank that has waited
//! past its deadline (`dist.timeout_s`, or `dist.startup_timeout_s` before its first optimizer
//! step) ends the run — the line names the collective, how long it waited and which ranks did
//! not arrive, every rank's flight record is written to `flight/rank-K.jsonl` in the run
//! directory, and the group is aborted, which wakes every waiting rank of the process with
//! that line (under MPI, the abort ends every process of the job). SIGUSR1 writes the flight
//! records of a live run; a failure writes them before the group is aborted.

mod recorder;
mod remote;
mod shared;
mod watchdog;
mod watched;

pub use recorder::{Recorder, describe, hostname};
pub use remote::Remote;
pub use shared::WatchConfig;
pub use watchdog::{Watchdog, watched};
pub use watched::Watched;
