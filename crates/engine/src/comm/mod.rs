//! Collectives: how ranks agree on gradients, metrics and parameters.
//!
//! The [`Collective`] trait works on flat host buffers of `f32`, the common ground of every
//! transport, plus point-to-point messages of activations for pipeline stages and splitting
//! into sub-groups. Strategies and the training loop see only the trait; [`local_group`] creates the
//! in-process implementation ([`local`]: one thread per device, any device kind). A transport
//! between processes implements the same trait. Reductions add the ranks' contributions in rank
//! order, so the same inputs always give the same bits.

mod collective;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod pack;
mod processes;
pub mod watch;
mod world;

pub use collective::{Collective, ReduceOp, chunk_range};
pub use local::{LocalComm, local_group};
pub use processes::Processes;
pub(crate) use world::agreed;
pub use world::{agree, process_barrier, processes, remote, start, world_group};
