//! The two collectives of a tensor-parallel block: [`copy_to_group`] (the identity forward,
//! the gradient summed backward) as a backend extension whose `Autodiff` arm records the
//! reduction, and [`reduce_from_group`] (the sum forward, the identity backward) composed of
//! Burn's ops.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, TensorMetadata, backend_extension};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_cubecl::CubeBackend;

use super::group::{GroupHandle, current};

/// The forward half of Megatron's `f`. Every backend runs it as the identity; `Autodiff`'s
/// records a backward that sums the gradient over the forward's group.
#[backend_extension(Flex, Cube, Fusion, Autodiff)]
pub trait TpOps: Backend {
    /// `x` as it is; under autodiff, its gradient summed over the thread's tensor-parallel
    /// group.
    #[fusion(default)]
    fn kiln_tp_copy(x: FloatTensor<Self>) -> FloatTensor<Self> {
        x
    }
}

impl TpOps for Flex {}
impl TpOps for CubeBackend {}

#[derive(Debug)]
struct CopyBackward;

impl<B: Backend> Backward<B, 1> for CopyBackward {
    type State = GroupHandle;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let group = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let device = grad.device();
            let dtype = grad.dtype();
            let data = burn::tensor::try_read_sync(B::float_into_data(grad))
                .and_then(Result::ok)
                .unwrap_or_else(|| panic!("tensor parallelism: a gradient could not be read"));
            B::float_cast(
                B::float_from_data(summed(data, &group), &device),
                dtype.into(),
            )
        });
    }
}

impl<B: Backend + TpOps, C: CheckpointStrategy> TpOps for Autodiff<B, C> {
    fn kiln_tp_copy(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let Some(group) = current() else {
            return x;
        };
        let y = B::kiln_tp_copy(x.primitive().clone());
        match CopyBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(group, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

/// `data` summed over `group`, in f32. A failed reduction panics with the group's message: the
/// rank's worker turns it into the run's failure.
fn summed(data: TensorData, group: &GroupHandle) -> TensorData {
    let shape = data.shape().clone();
    let mut values: Vec<f32> = data
        .try_into_vec_as::<f32>()
        .unwrap_or_else(|e| panic!("tensor parallelism: a tensor as f32: {e:?}"));
    if let Err(e) = group.0.all_reduce_sum(&mut values) {
        panic!(
            "tensor parallelism: the all-reduce of rank {} of {} failed: {e}",
            group.0.rank(),
            group.0.size()
        );
    }
    TensorData::new(values, shape)
}

/// Megatron's `f`, before a column-parallel Linear: `x` as it is; its gradient summed over the
/// thread's tensor-parallel group. Outside a group, the identity both ways.
pub fn copy_to_group<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if current().is_none() {
        return x;
    }
    Tensor::from_dispatch(<burn::backend::Dispatch as TpOps>::kiln_tp_copy(
        x.into_dispatch(),
    ))
}

/// Megatron's `g`, after a row-parallel Linear: `x` summed over the thread's tensor-parallel
/// group; its gradient as it is (each rank's part of the sum takes the whole sum's gradient).
/// Outside a group, the identity both ways.
pub fn reduce_from_group<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let Some(group) = current() else {
        return x;
    };
    let device = x.device();
    let dtype = burn::tensor::FloatDType::from(x.dtype());
    let data = x.clone().detach().into_data();
    let sum = Tensor::<D>::from_data(summed(data, &group), &device).cast(dtype);
    // `x - x` is zero to the bit: the value is the sum, the gradient reaches `x` unchanged.
    x.clone() - x.detach() + sum
}
