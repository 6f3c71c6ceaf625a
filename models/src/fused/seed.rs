//! A backward's root seeded with a gradient: `Σ output·upstream`, whose gradient with respect
//! to `output` is `upstream` itself. The block walk, the synchronised BatchNorm and a pipeline
//! stage run the backward of one segment of a model at a time this way; composed, the product
//! and the sum cost a pass over the activation each forward and two more backward (the sum's
//! broadcast, the product's gradient), each with a buffer of its own. Here the forward reads
//! both once and the backward hands `upstream` over as it is.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Flex, backend_extension};

use super::ext::record;
use super::flex::{contiguous, f32s, tensor};
use super::math;

/// The seeded root. Takes and returns f32 tensors on Flex.
#[backend_extension(Flex, Autodiff)]
pub trait SeedOps: burn::backend::Backend {
    /// `Σ output·upstream` (`[1]`), differentiated in `output` only: its gradient is
    /// `upstream` times the root's.
    fn fused_dot_seed(output: FloatTensor<Self>, upstream: FloatTensor<Self>) -> FloatTensor<Self>;
}

fn dot(output: &FlexTensor, upstream: &FlexTensor) -> FlexTensor {
    let (a, b) = (contiguous(output), contiguous(upstream));
    let (a, b) = (f32s(&a), f32s(&b));
    assert_eq!(a.len(), b.len(), "a seed of another size than its output");
    let total: f64 = a
        .chunks(4096)
        .zip(b.chunks(4096))
        .map(|(x, y)| math::dot(x, y) as f64)
        .sum();
    tensor(vec![total as f32], [1])
}

impl SeedOps for Flex {
    fn fused_dot_seed(output: FlexTensor, upstream: FlexTensor) -> FlexTensor {
        dot(&output, &upstream)
    }
}

#[derive(Debug)]
struct SeedBackward;

impl Backward<Flex, 1> for SeedBackward {
    /// The seed.
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let root = contiguous(&grads.consume::<Flex>(&ops.node));
        let Some(node) = node else {
            return;
        };
        let scale = f32s(&root)[0];
        let seed = ops.state;
        let grad = if scale == 1.0 {
            seed
        } else {
            let values: Vec<f32> = f32s(&contiguous(&seed)).iter().map(|v| v * scale).collect();
            tensor(values, seed.layout().shape().to_vec())
        };
        grads.register::<Flex>(node.id, grad);
    }
}

impl<C: CheckpointStrategy> SeedOps for Autodiff<Flex, C> {
    fn fused_dot_seed(output: FloatTensor<Self>, upstream: FloatTensor<Self>) -> FloatTensor<Self> {
        let y = dot(output.primitive(), upstream.primitive());
        let state = || upstream.primitive().clone();
        record(SeedBackward.prepare::<C>([output.node()]), state, y)
    }
}
