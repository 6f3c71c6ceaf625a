//! Tensor parallelism inside a model's forward: Megatron-LM's two collectives and its column-
//! and row-parallel Linears.
//!
//! A tensor-parallel group of `size` ranks splits each Linear of a block: the first of a pair
//! by its output columns ([`column()`]: every rank holds `d_out / size` of them and computes its
//! part of the output from the whole input), the second by its input rows ([`row()`]: every rank
//! multiplies its part of the input by its rows, and the parts are summed). Between them
//! nothing is exchanged; around them two collectives are:
//!
//! - [`copy_to_group`] (Megatron's `f`) before a column-parallel Linear: the input as it is
//!   going forward, and its gradient summed over the group going back — each rank's part of
//!   the output sent back only its part of the input's gradient;
//! - [`reduce_from_group`] (Megatron's `g`) after a row-parallel Linear: the parts summed over
//!   the group going forward, the gradient as it is going back.
//!
//! A block of attention then MLP is two such pairs: two all-reduces in its forward and two in
//! its backward. The group is the thread's ([`with_group`]): the engine sets it around a rank's
//! forward, and a forward with none runs as one device (both collectives the identity).
//! The collectives go through the host in f32 ([`TpGroup::all_reduce_sum`]), whatever the
//! tensor's dtype; a backward's reduction uses the group its forward ran with.

mod cut;
mod group;
mod ops;
mod split;
#[cfg(test)]
mod tests;
pub mod vocab;

pub use cut::{Reshape, TensorParallel, TpFloats, cut, cut_by, must_divide, reshape, splits_of};
pub use group::{GroupHandle, TpGroup, current, part, place, with_group};
pub use ops::{TpOps, copy_to_group, reduce_from_group};
pub use split::{
    Split, column, column_rows, part_of, part_of_values, row, row_rows, split_range, whole_of,
    whole_of_values,
};
