//! The [`Collective`] trait: a process group seen from one rank, over flat host buffers of
//! `f32` (and bf16), with point-to-point activations and sub-groups.

use kiln_models::Activation;

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
