//! Causal attention as CubeCL kernels, forward and backward, without the `T × T` scores.
//!
//! Burn 0.22.1 differentiates attention by its composed ops: the scores `q·kᵀ`, their mask,
//! softmax and the product with `v`, each a kernel with a `[B, H, T, T]` buffer kept for the
//! backward (on an H200 the GPT GPU recipe's six layers held about 400 MB of them each, and
//! their element-wise kernels and reductions were most of the step's non-product time,
//! BENCHMARKS.md). Here, as FlashAttention-2 does:
//!
//! - **Blocks of 4 × 4, as a matrix product is cut**: a cube takes a tile of 32 query rows
//!   (16 or 8 where shared memory or the units are fewer, [`tiling`]) against tiles of as many
//!   keys in shared memory; each unit computes a block of 4 rows × 4 keys of the scores, and
//!   later a block of 4 rows × 4 columns of a product with them. Eight reads of shared memory
//!   feed 64 multiply-adds, where a unit per row, reading a key's vector for one row, fed 16
//!   with four; and the 64 units of a cube are two warps of independent sums.
//! - **Forward**: for each tile of keys up to the diagonal, the scores into shared memory; a
//!   unit per row takes the row's largest score, its weights and their sum (the online
//!   softmax); the output's blocks are rescaled and added the weights times the values. It
//!   writes the output and each row's log-sum-exp — `T` floats a head, not `T × T`.
//! - **Backward**: the scores recomputed from q, k and the log-sum-exp. One kernel gives `dq`
//!   (by query tiles, keys by tiles as in the forward: the scores and `dout·vᵀ` give
//!   `p (dp − δ)`, times the keys); one more `dk` and `dv` together (by key tiles, the query
//!   tiles from the diagonal on and every query head that shares the key head — grouped-query
//!   attention: the weights and `p (dp − δ)`, times the output's gradient and the query rows).
//!   Every gradient element is written once by one unit: no atomics, the result independent of
//!   timing.
//! - Units hold their sums and the tiles their rows as vectors of four floats (see the
//!   kernels' module).
//!
//! The kernels read q, k, v, the output and its gradient where they lie: any layout whose last
//! dimension is contiguous (the GPT's q, k and v are views of its packed `[B, T, 3C]`
//! projection). They write the output and the three gradients with each position's heads side
//! by side (`[B, T, H, D]` seen as `[B, H, T, D]`), the layout the models put the heads back into:
//! on an H200 the GPT GPU recipe's copies into and out of `[B, H, T, D]` were eleven kernels a
//! layer, 0.44 ms of it (BENCHMARKS.md).
//!
//! The GPT's packed `[B, T, 3C]` projection is taken whole
//! ([`CubeAttentionOps::kiln_attention_packed`], `launch.rs`): q, k and v are read in it, the
//! output written as `[B, T, C]`, and the backward writes the three gradients in place into
//! one `[B, T, 3C]` tensor, where Burn's backward of three slices of it filled three tensors
//! of that size, assigned each part and added them (seven launches a layer on CubeCL's CPU
//! runtime). Where a part's offset does not suit the device's buffer alignment the three are
//! written apart and put side by side.
//!
//! Query heads may be a multiple of the key/value heads (grouped-query attention): a query head
//! `h` reads key head `h / (H / KV)`, nothing repeated in memory. `starts` restricts each row to
//! its packed document, as the CPU's kernel does.
//!
//! The tensors may be f32, bf16 or f16; the units compute in f32 whatever they hold (the tiles
//! in shared memory, the running sums, each row's log-sum-exp and `δ` are f32), so that under
//! `bf16-mixed` the softmax is as exact as in f32 and only the loads and stores are 16-bit.
//!
//! For bf16 and f16 on a device with matrix units (a card's tensor cores: planes that multiply
//! 16 × 16 × 16 blocks of the type into f32), the same three passes run as the `mma` module's
//! kernels instead: the products on the matrix units, the softmax and the masks in f32 by a unit
//! a row, the weights and `p (dp − δ)` rounded to the tensors' type before their products.
//! [`emulate_matrix_units`] runs those kernels where no device has matrix units, for tests.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend, Backend, backend_extension};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

pub use drop::AttentionDropout;
pub(crate) use drop::{inv_keep, mix, threshold};
pub(crate) use kernels::mix_in;
pub use tiling::{MOST_HEAD_WIDTH, emulate_matrix_units};
pub(crate) use tiling::{allow_matrix_units, on_matrix_units};

mod blocks;
mod drop;
mod kernels;
mod launch;
mod mma;
mod tiling;

/// Causal attention on a CubeCL device.
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait CubeAttentionOps: Backend {
    /// The output (`[B, H, T, D]`, `q`'s dtype) and each row's log-sum-exp of its scaled
    /// scores (`[B, H, T]`, f32) of causal attention of `q` (`[B, H, T, D]`) over `k` and `v`
    /// (`[B, KV, T, D]`, `H` a multiple of `KV`), scaled by `scale`, the weights through
    /// `drop`; `starts`: each row's first key (`[B, T]`), or empty (every row from 0). Not
    /// differentiated.
    #[fusion(meta = |q, _k, _v, _starts, _scale, _drop| (
        q.clone(),
        TensorSpec::new(Shape::new([q.shape[0], q.shape[1], q.shape[2]]), DType::F32),
    ))]
    fn kiln_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of `q`, `k` and `v` from the output's gradient `dout`, with the forward's
    /// output `out` and log-sum-exp `lse` (arguments as [`CubeAttentionOps::kiln_attention_forward`]'s).
    /// Not differentiated.
    #[fusion(meta = |q, k, v, _out, _lse, _dout, _starts, _scale, _drop| (q.clone(), k.clone(), v.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// [`CubeAttentionOps::kiln_attention_forward`] of the heads of a packed projection `qkv`
    /// (`[B, T, 3·H·D]`: q's heads, then k's, then v's; `heads` of them each), read in place:
    /// the output as `[B, T, H·D]` and the log-sum-exp (`[B, H, T]`, f32). Not differentiated.
    #[fusion(meta = |qkv, _starts, heads, _scale, _drop| {
        let [b, t, c3] = [qkv.shape[0], qkv.shape[1], qkv.shape[2]];
        (
            TensorSpec::new(Shape::new([b, t, c3 / 3]), qkv.dtype),
            TensorSpec::new(Shape::new([b, *heads, t]), DType::F32),
        )
    })]
    fn kiln_attention_packed_forward(
        qkv: FloatTensor<Self>,
        starts: IntTensor<Self>,
        heads: usize,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradient of the packed projection `qkv` (`[B, T, 3·H·D]`, q's, k's and v's parts
    /// written in place of one tensor) from the output's gradient `dout` (`[B, T, H·D]`), with
    /// the forward's output and log-sum-exp (arguments as
    /// [`CubeAttentionOps::kiln_attention_packed_forward`]'s). Not differentiated.
    #[fusion(meta = |qkv, _out, _lse, _dout, _starts, _heads, _scale, _drop| qkv.clone())]
    #[allow(clippy::too_many_arguments)]
    fn kiln_attention_packed_backward(
        qkv: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        starts: IntTensor<Self>,
        heads: usize,
        scale: f32,
        drop: AttentionDropout,
    ) -> FloatTensor<Self>;

    /// Causal attention of a packed projection's heads, `[B, T, H·D]`, differentiated in
    /// `qkv` through [`CubeAttentionOps::kiln_attention_packed_backward`]: one gradient
    /// tensor, where Burn's backward of three views of `qkv` fills three and adds them.
    #[fusion(default)]
    fn kiln_attention_packed(
        qkv: FloatTensor<Self>,
        starts: IntTensor<Self>,
        heads: usize,
        scale: f32,
        drop: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::kiln_attention_packed_forward(qkv, starts, heads, scale, drop).0
    }

    /// Causal attention's output, differentiated in `q`, `k` and `v` through
    /// [`CubeAttentionOps::kiln_attention_backward`].
    #[fusion(default)]
    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::kiln_attention_forward(q, k, v, starts, scale, drop).0
    }
}

impl CubeAttentionOps for CubeBackend {
    fn kiln_attention_forward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        starts: CubeTensor,
        scale: f32,
        drop: AttentionDropout,
    ) -> (CubeTensor, CubeTensor) {
        launch::forward_into(q, k, v, starts, scale, drop, None)
    }

    fn kiln_attention_backward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        out: CubeTensor,
        lse: CubeTensor,
        dout: CubeTensor,
        starts: CubeTensor,
        scale: f32,
        drop: AttentionDropout,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        launch::backward_into(q, k, v, out, lse, dout, starts, scale, drop, None)
    }

    fn kiln_attention_packed_forward(
        qkv: CubeTensor,
        starts: CubeTensor,
        heads: usize,
        scale: f32,
        drop: AttentionDropout,
    ) -> (CubeTensor, CubeTensor) {
        launch::packed_forward(qkv, starts, heads, scale, drop)
    }

    fn kiln_attention_packed_backward(
        qkv: CubeTensor,
        out: CubeTensor,
        lse: CubeTensor,
        dout: CubeTensor,
        starts: CubeTensor,
        heads: usize,
        scale: f32,
        drop: AttentionDropout,
    ) -> CubeTensor {
        launch::packed_backward(qkv, out, lse, dout, starts, heads, scale, drop)
    }
}

#[derive(Debug)]
struct PackedBackward;

impl<B: Backend + CubeAttentionOps> Backward<B, 1> for PackedBackward {
    /// qkv, the output, its rows' log-sum-exp, the starts, the heads, the scale and the
    /// dropout.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        IntTensor<B>,
        usize,
        f32,
        AttentionDropout,
    );

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (qkv, out, lse, starts, heads, scale, drop) = ops.state;
        if let Some(node) = node {
            let dqkv =
                B::kiln_attention_packed_backward(qkv, out, lse, dout, starts, heads, scale, drop);
            grads.register::<B>(node.id, dqkv);
        }
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: Backend + CubeAttentionOps> Backward<B, 3> for AttentionBackward {
    /// q, k, v, the output, its rows' log-sum-exp, the starts, the scale and the dropout.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        IntTensor<B>,
        f32,
        AttentionDropout,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, starts, scale, drop) = ops.state;
        let (dq, dk, dv) = B::kiln_attention_backward(q, k, v, out, lse, dout, starts, scale, drop);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + CubeAttentionOps, C: CheckpointStrategy> CubeAttentionOps for Autodiff<B, C> {
    fn kiln_attention_packed_forward(
        qkv: FloatTensor<Self>,
        starts: IntTensor<Self>,
        heads: usize,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) =
            B::kiln_attention_packed_forward(Self::inner(qkv), starts, heads, scale, drop);
        (Self::from_inner(out), Self::from_inner(lse))
    }

    fn kiln_attention_packed_backward(
        qkv: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        starts: IntTensor<Self>,
        heads: usize,
        scale: f32,
        drop: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_attention_packed_backward(
            Self::inner(qkv),
            Self::inner(out),
            Self::inner(lse),
            Self::inner(dout),
            starts,
            heads,
            scale,
            drop,
        ))
    }

    fn kiln_attention_packed(
        qkv: FloatTensor<Self>,
        starts: IntTensor<Self>,
        heads: usize,
        scale: f32,
        drop: AttentionDropout,
    ) -> FloatTensor<Self> {
        let qp = qkv.primitive().clone();
        let (out, lse) =
            B::kiln_attention_packed_forward(qp.clone(), starts.clone(), heads, scale, drop);
        match PackedBackward
            .prepare::<C>([qkv.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (qp, out.clone(), lse, starts, heads, scale, drop);
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn kiln_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) = B::kiln_attention_forward(
            Self::inner(q),
            Self::inner(k),
            Self::inner(v),
            starts,
            scale,
            drop,
        );
        (Self::from_inner(out), Self::from_inner(lse))
    }

    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::kiln_attention_backward(
            Self::inner(q),
            Self::inner(k),
            Self::inner(v),
            Self::inner(out),
            Self::inner(lse),
            Self::inner(dout),
            starts,
            scale,
            drop,
        );
        (
            Self::from_inner(dq),
            Self::from_inner(dk),
            Self::from_inner(dv),
        )
    }

    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> FloatTensor<Self> {
        let (qp, kp, vp) = (q.primitive(), k.primitive(), v.primitive());
        let (out, lse) = B::kiln_attention_forward(
            qp.clone(),
            kp.clone(),
            vp.clone(),
            starts.clone(),
            scale,
            drop,
        );
        match AttentionBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (
                    qp.clone(),
                    kp.clone(),
                    vp.clone(),
                    out.clone(),
                    lse,
                    starts,
                    scale,
                    drop,
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}
