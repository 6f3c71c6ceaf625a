//! Collectives: how ranks agree on gradients, metrics and parameters.
//!
//! The [`Collective`] trait works on flat host buffers of `f32`, the common ground of every
//! transport, plus point-to-point messages of activations for pipeline stages and splitting
//! into sub-groups. Strategies and the training loop see only the trait; [`local_group`] creates the
//! in-process implementation ([`local`]: one thread per device, any device kind). A transport
//! between processes implements the same trait. Reductions add the ranks' contributions in rank
//! order, so the same inputs always give the same bits.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod pack;
pub mod watch;

pub use local::{LocalComm, local_group};

use kiln_models::Activation;

use crate::error::Result;

/// Where this process stands among the processes a launcher (`mpirun`, `srun`) started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Processes {
    /// This process's index, `0..count`.
    pub index: usize,
    /// Number of processes.
    pub count: usize,
    /// This process's index among the processes of its machine.
    pub local_index: usize,
}

impl Processes {
    /// One process alone.
    pub const ALONE: Processes = Processes {
        index: 0,
        count: 1,
        local_index: 0,
    };

    /// What the launcher's environment says: OpenMPI's `OMPI_COMM_WORLD_*`, MPICH/PMI's
    /// `PMI_*`, or Slurm's `srun` (`SLURM_PROCID` with `SLURM_STEP_NUM_TASKS`); one process
    /// alone when none is set.
    pub fn from_env() -> Self {
        let var = |k: &str| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
        };
        let found = [
            (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
            ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
        ]
        .iter()
        .find_map(|(rank, size, local)| {
            Some(Processes {
                index: var(rank)?,
                count: var(size)?,
                local_index: var(local).unwrap_or(0),
            })
        });
        match found {
            Some(p) if p.count > 0 && p.index < p.count => p,
            _ => Processes::ALONE,
        }
    }
}

/// Starts what several processes need (MPI, with the `mpi` feature) and returns a guard to
/// keep until the run is over. Without the feature, several processes are refused with the
/// way to build kiln for them.
pub fn start(processes: Processes) -> Result<Option<Box<dyn std::any::Any>>> {
    if processes.count <= 1 {
        return Ok(None);
    }
    #[cfg(feature = "mpi")]
    {
        Ok(mpi::init(processes)?.map(|g| Box::new(g) as Box<dyn std::any::Any>))
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(crate::error::Error::Device(format!(
            "this train runs as process {} of {} under a launcher (mpirun/srun), but it was \
             built without the `mpi` feature; build it with `cargo build --release --features \
             kiln/mpi` (needs libopenmpi-dev and libclang-dev), or run one process",
            processes.index, processes.count
        )))
    }
}

/// One group of the world for each of this process's `devices` device threads: in-process
/// threads, or, once MPI runs ([`start`]), the processes' threads together.
pub fn world_group(devices: usize) -> Result<Vec<Box<dyn Collective>>> {
    #[cfg(feature = "mpi")]
    if mpi::active() {
        return mpi::world_group(devices);
    }
    Ok(local_group(devices)
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Collective>)
        .collect())
}

/// The other processes' watchdogs, once MPI runs ([`watch::Remote`]).
pub fn remote() -> Option<Box<dyn watch::Remote>> {
    #[cfg(feature = "mpi")]
    if mpi::active() {
        return mpi::control();
    }
    None
}

/// What process 0 decided, on every process: `decide` runs on process 0 alone and its outcome
/// (a value or an error message) is broadcast to the others. With one process, `decide` runs.
pub fn agree(decide: impl FnOnce() -> Result<String>) -> Result<String> {
    let mine = if processes().index == 0 {
        Some(decide())
    } else {
        None
    };
    #[cfg(feature = "mpi")]
    if mpi::active() {
        let mut bytes = match &mine {
            Some(Ok(v)) => [&[0u8][..], v.as_bytes()].concat(),
            Some(Err(e)) => [&[1u8][..], e.to_string().as_bytes()].concat(),
            None => Vec::new(),
        };
        mpi::agree(&mut bytes);
        let text = String::from_utf8_lossy(&bytes[1..]).into_owned();
        return match (bytes[0], mine) {
            (_, Some(own)) => own,
            (0, None) => Ok(text),
            (_, None) => Err(crate::error::Error::Worker(format!("process 0: {text}"))),
        };
    }
    mine.expect("one process is process 0")
}

/// Waits until every process arrives (nothing with one process).
pub fn process_barrier() {
    #[cfg(feature = "mpi")]
    mpi::barrier();
}

/// The processes of the run: those MPI joined, or this one alone.
pub fn processes() -> Processes {
    #[cfg(feature = "mpi")]
    if let Some(p) = mpi::processes() {
        return p;
    }
    Processes::ALONE
}

/// The reduction an [`Collective::all_reduce`] applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise mean over ranks.
    Mean,
}

/// [`Collective::reduce_scatter_bf16`] through the f32 reduce-scatter: the values widened
/// (exactly), reduced in f32 and the piece rounded once to bf16.
pub(crate) fn reduce_scatter_widened(
    group: &dyn Collective,
    data: &[burn::tensor::bf16],
    op: ReduceOp,
) -> Result<Vec<burn::tensor::bf16>> {
    let wide: Vec<f32> = data.iter().map(|x| x.to_f32()).collect();
    let piece = group.reduce_scatter(&wide, op)?;
    Ok(piece
        .into_iter()
        .map(burn::tensor::bf16::from_f32)
        .collect())
}

/// A process group seen from one rank.
pub trait Collective: Send + Sync {
    /// This replica's rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of replicas.
    fn world_size(&self) -> usize;
    /// Replaces `data` on every rank by its reduction over all ranks.
    fn all_reduce(&self, data: &mut [f32], op: ReduceOp) -> Result<()>;
    /// [`all_reduce`](Collective::all_reduce) of bf16 values, for gradients reduced in
    /// half the bytes: the reduction is exact in f32 and rounded once to bf16.
    fn all_reduce_bf16(&self, data: &mut [burn::tensor::bf16], op: ReduceOp) -> Result<()>;
    /// Replaces `data` on every rank by rank `root`'s.
    fn broadcast(&self, data: &mut Vec<f32>, root: usize) -> Result<()>;
    /// Returns the concatenation of every rank's `data`, in rank order.
    fn all_gather(&self, data: &[f32]) -> Result<Vec<f32>>;
    /// Reduces `data` over ranks and returns this rank's contiguous chunk of the result
    /// (chunks as [`chunk_range`] cuts them).
    fn reduce_scatter(&self, data: &[f32], op: ReduceOp) -> Result<Vec<f32>>;
    /// [`reduce_scatter`](Collective::reduce_scatter) of bf16 values, for gradients
    /// reduce-scattered in half the bytes: the reduction is exact in f32 and rounded once.
    fn reduce_scatter_bf16(
        &self,
        data: &[burn::tensor::bf16],
        op: ReduceOp,
    ) -> Result<Vec<burn::tensor::bf16>>;
    /// Waits until every rank has arrived.
    fn barrier(&self) -> Result<()>;
    /// Stops the group and every group split from the same root: every rank waiting now or
    /// later, in a collective or a `recv`, gets an error carrying `reason`.
    fn abort(&self, reason: &str);
    /// Splits the group (every rank must call it, in the same order as its other splits):
    /// the ranks that pass the same `color` form a new group, ranked by `key` (then by their
    /// rank here). MPI's `MPI_Comm_split`.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>>;
    /// Sends an activation (or its gradient) to rank `to` of this group; messages between two
    /// ranks arrive in the order they were sent. The receiver moves it to its device.
    fn send(&self, to: usize, value: Activation) -> Result<()>;
    /// The next activation rank `from` of this group sent to this rank, waiting for it.
    fn recv(&self, from: usize) -> Result<Activation>;
}

/// The part of a buffer of `len` elements that `rank` owns in a reduce-scatter.
pub fn chunk_range(len: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}
