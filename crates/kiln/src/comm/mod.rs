//! Collectives: how ranks agree on gradients, metrics and parameters.
//!
//! The [`Collective`] trait works on flat host buffers of `f32`, the common ground of every
//! transport. Strategies and the training loop see only the trait; [`local_group`] creates the
//! in-process implementation ([`local`]: one thread per device, any device kind). A transport
//! between processes implements the same trait. Reductions add the ranks' contributions in rank
//! order, so the same inputs always give the same bits.

pub mod local;

pub use local::{LocalComm, local_group};

use crate::error::Result;

/// The reduction an [`Collective::all_reduce`] applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise mean over ranks.
    Mean,
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
    /// Waits until every rank has arrived.
    fn barrier(&self) -> Result<()>;
    /// Stops the group: every rank waiting now or later gets an error carrying `reason`.
    fn abort(&self, reason: &str);
}

/// The part of a buffer of `len` elements that `rank` owns in a reduce-scatter.
pub fn chunk_range(len: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}
