//! The forward and backward of one micro-batch: whole, or block by block.
//!
//! The plain pass is one forward that keeps every activation and one backward. The *walk* runs
//! the model as its [`BlockStack`](kiln_models::BlockStack) (stem, blocks, head) and differentiates it a segment at a
//! time from the head down: each block's backward is seeded with the gradient that arrived
//! from above — `backward(sum(block(x) · g))` gives the block's parameter gradients and the
//! gradient for the block below (a vector-Jacobian product, [`segment_backward`]). The walk
//! is where three things happen that the plain pass cannot do:
//!
//! - **block recomputation** ([`Recompute::Blocks`]): a recomputed block keeps only its input
//!   (computed without a graph) and runs its forward again during the backward;
//! - **synchronised BatchNorm** ([`syncbn`]): a block with a BatchNorm is cut around it, and
//!   the norm's statistics and their gradients are all-reduced;
//! - **per-block gradients** ([`Hooks`]): a strategy receives each block's gradients as soon as
//!   its backward is done (ZeRO-2/3 reduce-scatter them there and drop them), and may change
//!   the model's parameters before and after each block (ZeRO-3 gathers a block's parameters
//!   before it runs and releases them after).
//!
//! A pipeline stage needs the same step (backward of a segment from its saved input and an
//! upstream gradient), which is why it is kept separate.

pub mod draws;
mod segment;
pub mod syncbn;
mod walk;

pub use segment::segment_backward;
pub use walk::{
    Accumulate, Hooks, Part, Pass, Recompute, Stash, StemKept, backward_blocks, forward_backward,
    forward_blocks, head_backward, run, stem_backward, stem_forward,
};
