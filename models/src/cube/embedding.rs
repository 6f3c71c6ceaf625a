//! The embedding table's gradient as a CubeCL kernel.
//!
//! Burn's embedding backward adds each row of the output's gradient into the table's row its
//! token names (`select_assign`): one thread per column of the table, each walking every
//! token of the batch in turn. For the GPT GPU recipe that is 384 threads, each adding 16,384
//! rows one after another — on an H200 the two embeddings' scatters took 5.8 ms of a 58 ms
//! step (BENCHMARKS.md, CubeCL's profile). Here the tokens are cut into parts of
//! [`ROWS_PER_PART`]: one thread per column of each part adds its part's rows into a table of
//! its own (no two threads write one place), and the parts' tables are then summed, so that
//! the work spreads over parts × columns threads and the result does not depend on timing.
//! The parts' tables and their sum are f32 whatever the gradient's float type (bf16 and f16
//! are added up in f32 and rounded once), as an f32 table's gradient would be.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape};
use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::zeros_client;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Tokens per part: each part's thread of a column adds this many rows at most.
pub const ROWS_PER_PART: usize = 256;

/// The most elements the parts' tables hold together (64 MiB of f32); a large vocabulary gets
/// fewer parts (at least one).
const MOST_PARTIAL: usize = 1 << 24;

/// The embedding lookup whose backward runs the kernel. Takes and returns float tensors on a
/// CubeCL device (with or without autodiff).
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait CubeEmbeddingOps: Backend {
    /// The gradient of a table of `vocab` rows from the gradient of its lookup's output
    /// (`[N, C]`) and the lookup's token ids (`[N]`): `[vocab, C]`, row `v` the sum of the
    /// output rows whose token is `v`. Not differentiated.
    #[fusion(dtype = grad, shape = Shape::new([*vocab, grad[grad.num_dims() - 1]]))]
    fn kiln_embedding_grad(
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        vocab: usize,
    ) -> FloatTensor<Self>;

    /// The rows of `weights` (`[V, C]`) that `indices` (`[B, T]`) name: `[B, T, C]`, as
    /// Burn's embedding, differentiated in `weights` through
    /// [`CubeEmbeddingOps::kiln_embedding_grad`].
    #[fusion(default)]
    fn kiln_embedding(weights: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self> {
        Self::embedding(weights, indices)
    }
}

/// One thread per column `c` of part `p`: adds rows `p·chunk ..` of `grad` (`[N, C]`) into
/// the part's table `partial[p]` (`[V, C]`, in `F`, f32) at the rows their tokens name.
/// Tokens outside the table are left out (Burn's lookup refuses them in the forward).
#[cube(launch)]
fn embedding_grad_kernel<E: Float, F: Float, I: Numeric>(
    grad: &Tensor<E>,
    indices: &Tensor<I>,
    partial: &mut Tensor<F>,
    rows: u32,
    chunk: u32,
    vocab: u32,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let width = grad.shape(1);
    let c = ABSOLUTE_POS_X as usize;
    let part = ABSOLUTE_POS_Y as usize;
    if c >= width {
        terminate!();
    }
    let rows = rows as usize;
    let chunk = chunk as usize;
    let vocab = vocab as usize;
    let start = part * chunk;
    let mut end = start + chunk;
    if end > rows {
        end = rows;
    }
    let table = part * vocab * width;
    for n in start..end {
        let v = u32::cast_from(indices[n]) as usize;
        if v < vocab {
            let at = table + v * width + c;
            partial[at] += F::cast_from(grad[n * width + c]);
        }
    }
}

/// The number of parts for `rows` tokens into a `vocab × width` table.
pub fn parts(rows: usize, vocab: usize, width: usize) -> usize {
    let wanted = rows.div_ceil(ROWS_PER_PART).max(1);
    let room = (MOST_PARTIAL / (vocab * width).max(1)).max(1);
    // The parts are the cube count's second dimension, which holds 65,535 on WGPU.
    wanted.min(room).min(65_535)
}

impl CubeEmbeddingOps for CubeBackend {
    fn kiln_embedding_grad(grad: CubeTensor, indices: CubeTensor, vocab: usize) -> CubeTensor {
        let grad = into_contiguous(grad);
        let indices = into_contiguous(indices);
        let [rows, width] = grad.shape().dims::<2>();
        assert_eq!(
            indices.shape().num_elements(),
            rows,
            "an embedding gradient of {rows} rows with {} token ids",
            indices.shape().num_elements()
        );
        let parts = parts(rows, vocab, width);
        let chunk = rows.div_ceil(parts);
        let (client, device, dtype) = (grad.client.clone(), grad.device.clone(), grad.dtype);
        let partial = zeros_client(
            client.clone(),
            device,
            Shape::new([parts, vocab, width]),
            DType::F32,
        );
        let threads = (width as u32).clamp(1, 256);
        let cube_count = CubeCount::Static((width as u32).div_ceil(threads), parts as u32, 1);
        let index_dtype = indices.dtype;
        embedding_grad_kernel::launch(
            &client,
            cube_count,
            CubeDim::new_2d(threads, 1),
            grad.into_tensor_arg(),
            indices.into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            rows as u32,
            chunk as u32,
            vocab as u32,
            [
                dtype_to_storage_type(dtype),
                dtype_to_storage_type(DType::F32),
                dtype_to_storage_type(index_dtype),
            ],
        );
        type Ops = CubeBackend;
        // One part's table is the gradient as it is.
        let summed = match parts {
            1 => partial,
            _ => <Ops as FloatTensorOps<Ops>>::float_sum_dim(partial, 0),
        };
        let summed =
            <Ops as FloatTensorOps<Ops>>::float_reshape(summed, Shape::new([vocab, width]));
        match dtype {
            DType::F32 => summed,
            low => <Ops as FloatTensorOps<Ops>>::float_cast(summed, low.into()),
        }
    }
}

#[derive(Debug)]
struct EmbeddingBackward;

impl<B: Backend + CubeEmbeddingOps> Backward<B, 1> for EmbeddingBackward {
    /// The token ids (`[B, T]`) and the table's rows.
    type State = (IntTensor<B>, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (indices, vocab) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let shape = grad.shape();
            let width = shape[shape.num_dims() - 1];
            let rows = shape.num_elements() / width.max(1);
            let grad = B::float_reshape(grad, Shape::new([rows, width]));
            let indices = B::int_reshape(indices, Shape::new([rows]));
            B::kiln_embedding_grad(grad, indices, vocab)
        });
    }
}

impl<B: Backend + CubeEmbeddingOps, C: CheckpointStrategy> CubeEmbeddingOps for Autodiff<B, C> {
    fn kiln_embedding_grad(
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        vocab: usize,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_embedding_grad(Self::inner(grad), indices, vocab))
    }

    fn kiln_embedding(weights: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self> {
        let vocab = weights.primitive().shape()[0];
        let y = B::embedding(weights.primitive().clone(), indices.clone());
        match EmbeddingBackward
            .prepare::<C>([weights.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((indices, vocab), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_is_cut_into_parts_that_fit_the_room_given() {
        // The GPU recipe: 64 × 256 tokens into 65 × 384.
        assert_eq!(parts(16_384, 65, 384), 64);
        // A remainder is a part of its own.
        assert_eq!(parts(1_233, 37, 24), 5);
        // GPT-2's vocabulary: one part (the tables of two would pass 64 MiB).
        assert_eq!(parts(8_192, 50_257, 768), 1);
        // Never none.
        assert_eq!(parts(0, 65, 384), 1);
        assert!(parts(1 << 20, 1_000, 1_000) * 1_000 * 1_000 <= MOST_PARTIAL);
    }
}
