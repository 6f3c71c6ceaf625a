//! MPI in this process: started once with `MPI_THREAD_MULTIPLE`, the world communicator,
//! what process 0 decides for every process, and the line a failing process prints.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::comm::processes::Processes;
use crate::error::{Error, Result};

/// A communicator that several threads use.
pub(super) struct Comm(pub(super) SimpleCommunicator);

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (`init` refuses anything less), under
// which MPI calls may be made from any thread at once. kiln keeps MPI's one remaining rule:
// collectives on one communicator are issued by one thread per process (the group's lead).
unsafe impl Send for Comm {}

// SAFETY: as for `Send`.
unsafe impl Sync for Comm {}

pub(super) struct State {
    pub(super) world: Arc<Comm>,
    /// A duplicate of the world on which the processes' watchdogs talk ([`Control`]).
    pub(super) control: Arc<Comm>,
    pub(super) processes: Processes,
    /// Sub-communicators made by a lead for the other ranks of its process, by group id; `None`
    /// for a group that lives in one process.
    pub(super) registry: Mutex<HashMap<u64, Option<Arc<Comm>>>>,
    pub(super) registered: Condvar,
}

pub(super) static STATE: OnceLock<State> = OnceLock::new();

/// Keeps MPI initialised; dropping it frees kiln's communicators and finalises MPI.
pub struct MpiGuard {
    universe: Option<mpi::environment::Universe>,
}

impl Drop for MpiGuard {
    fn drop(&mut self) {
        if let Some(state) = STATE.get() {
            state
                .registry
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        }
        drop(self.universe.take());
    }
}

/// Initialises MPI when this process was started by a launcher with several processes
/// (`processes.count > 1`); returns the guard that keeps it initialised.
pub fn init(processes: Processes) -> Result<Option<MpiGuard>> {
    if processes.count <= 1 {
        return Ok(None);
    }
    mca_defaults();
    let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        .ok_or_else(|| Error::Device("MPI was initialised twice".into()))?;
    if threading != mpi::Threading::Multiple {
        return Err(Error::Device(format!(
            "this MPI library provides {threading:?} threading, and kiln needs \
             MPI_THREAD_MULTIPLE (its device threads call MPI at once); use an MPI built with \
             thread support (OpenMPI 4 from Debian has it)"
        )));
    }
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    if (rank, size) != (processes.index, processes.count) {
        return Err(Error::Device(format!(
            "the launcher's environment says process {} of {}, MPI says {rank} of {size}",
            processes.index, processes.count
        )));
    }
    let control = Arc::new(Comm(world.duplicate()));
    let _ = STATE.set(State {
        world: Arc::new(Comm(world)),
        control,
        processes,
        registry: Mutex::new(HashMap::new()),
        registered: Condvar::new(),
    });
    Ok(Some(MpiGuard {
        universe: Some(universe),
    }))
}

/// OpenMPI settings kiln changes from OpenMPI's defaults, unless the launcher's environment
/// (`mpirun --mca NAME VALUE`, or the variable itself) sets them:
///
/// - `mpi_yield_when_idle = 1`: a rank waiting in a blocking call (the short collectives, see
///   `ffi::BLOCKING_BELOW`) gives its core away between polls instead of spinning on it.
///   Spinning, a thread takes a core from the compute wherever ranks and their threads
///   outnumber the cores (ddp, two processes on a 2-core machine at 1 Gbit/s, when the
///   gradients' all-reduce blocked: 155 ms a step spinning, 128 ms yielding, 139 ms without
///   overlap; see BENCHMARKS.md).
/// - `coll_libnbc_iallreduce_algorithm = 1`: the non-blocking all-reduce that carries the
///   gradients (`ffi::sum_in_place`) as a ring, a reduce-scatter then an all-gather in which
///   every process sends and receives at once. OpenMPI's own choice for fewer than four
///   processes, or in place, is a binomial tree: one process receives everything, sums it and
///   sends it back, so each direction of a link is busy half the time (a 0.8 MB block over 1
///   Gbit/s beside the compute: 10 ms against 5–6).
const MCA_DEFAULTS: [(&str, &str); 2] = [
    ("OMPI_MCA_mpi_yield_when_idle", "1"),
    ("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1"),
];

fn mca_defaults() {
    for (name, value) in MCA_DEFAULTS {
        if std::env::var_os(name).is_none() {
            // SAFETY: this runs in `cli::run_training` before MPI starts and before kiln
            // starts any thread (signal handlers, workers, monitors); no other thread of kiln
            // reads or writes the environment meanwhile.
            unsafe { std::env::set_var(name, value) };
        }
    }
}

/// Whether MPI runs (several processes).
pub fn active() -> bool {
    STATE.get().is_some()
}

/// The processes MPI joined, once it runs.
pub fn processes() -> Option<Processes> {
    STATE.get().map(|s| s.processes)
}

/// Bytes broadcast from process 0 to every process (what process 0 decided, such as the run
/// directory).
pub fn agree(bytes: &mut Vec<u8>) {
    if let Some(state) = STATE.get() {
        let root = state.world.0.process_at_rank(0);
        let mut len = bytes.len() as u64;
        root.broadcast_into(&mut len);
        bytes.resize(len as usize, 0);
        root.broadcast_into(&mut bytes[..]);
    }
}

/// Waits until every process arrives.
pub fn barrier() {
    if let Some(state) = STATE.get() {
        state.world.0.barrier();
    }
}

/// Prints the line of the failure that ends this process, once.
pub(super) fn say_once(reason: &str) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SAID.swap(true, Ordering::SeqCst) {
        return;
    }
    let p = processes().unwrap_or(Processes::ALONE);
    eprintln!("error: process {} of {}: {reason}", p.index, p.count);
}
