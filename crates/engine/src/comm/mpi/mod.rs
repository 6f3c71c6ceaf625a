//! Several processes, and machines, over MPI (cargo feature `mpi`): the hierarchical group.
//!
//! `mpirun -np P train --devices N` gives a world of P × N ranks; global rank `p·N + l` is
//! device thread `l` of process `p`. Every group — the world, and every group split from it —
//! is two levels: the group's ranks inside this process form an in-process group
//! ([`LocalComm`](super::LocalComm)), and the group's first rank in each process (its *lead*)
//! joins an MPI communicator of the processes that host the group. A collective runs in
//! three steps: the ranks of each process combine in-process (in rank order), the leads run
//! the MPI collective, and each lead hands the result back to its process's ranks. The
//! reduction order is fixed by the layout, so reruns with one seed give the same bits.
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE`: every thread may call it, and the leads of
//! different groups do so at once (a single communication thread would serialise collectives
//! of different groups in an order that can differ between processes, and deadlock). A
//! communicator is used for collectives by one thread per process (its lead); point-to-point
//! messages (pipeline activations) go from any thread, each ordered pair of ranks with its own
//! tag, through a sending thread per destination so that two stages sending to each other
//! never wait on each other.
//!
//! A failing rank prints its error and calls `MPI_Abort`: the launcher then ends every process
//! of the job. A process killed outright is seen by the launcher, which does the same.

mod control;
mod ffi;
mod group;
mod p2p;
mod ring;
mod runtime;
mod split;

pub use control::control;
pub use group::world_group;
pub use runtime::{MpiGuard, active, agree, barrier, init, processes};
