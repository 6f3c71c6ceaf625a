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
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape};
use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::{into_contiguous, untile};
use burn_cubecl::ops::numeric::{empty_device_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use kernels::{DropArgsLaunch, dkv_kernel, dq_kernel, forward_kernel};
use mma::{dkv_mma, dq_mma, forward_mma};
pub use tiling::{MOST_HEAD_WIDTH, emulate_matrix_units};
use tiling::{Pass, mma_on, tiling_on};
pub(crate) use tiling::{allow_matrix_units, on_matrix_units};

mod blocks;
mod kernels;
mod mma;
mod tiling;

/// Dropout on the attention weights, drawn by the kernels themselves: whether the weight of
/// query row `i` on key `j` of head `h` in batch row `b` is kept is a function of the seed and
/// that place alone ([`AttentionDropout::keeps`]), so the forward and both backward kernels
/// recompute the same mask and none is stored. `prob = 0`: no dropout.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionDropout {
    /// The draw's seed.
    pub seed: u64,
    /// The probability of dropping a weight; the kept ones are scaled by `1 / (1 − prob)`.
    pub prob: f32,
    /// The first of these heads in the whole (a tensor-parallel rank's heads are a part of it).
    pub first_head: usize,
    /// The heads of the whole.
    pub heads: usize,
}

/// Knuth's multiplicative constant's cousins: a 32-bit integer hash (two multiply-xorshift
/// rounds), the same on the host and in the kernels.
fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

impl AttentionDropout {
    /// The dropped fraction as the kernels compare it: 24 bits of a hash below it drop.
    fn threshold(&self) -> u32 {
        (f64::from(self.prob) * f64::from(1u32 << 24)).round() as u32
    }

    /// The factor of a kept weight.
    fn inv_keep(&self) -> f32 {
        (1.0 / (1.0 - f64::from(self.prob))) as f32
    }

    /// Whether the weight of query row `i` on key `j` of local head `h` in batch row `b` is
    /// kept — what the kernels compute.
    pub fn keeps(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let bh = (b * self.heads + self.first_head + h) as u32;
        let head = mix((self.seed as u32) ^ mix(((self.seed >> 32) as u32) ^ bh));
        let row = mix(head ^ i as u32);
        (mix(row ^ mix(j as u32)) >> 8) >= self.threshold()
    }
}

impl AttentionDropout {
    /// The kernels' arguments.
    fn args(&self) -> DropArgsLaunch {
        DropArgsLaunch::new(
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.threshold(),
            self.inv_keep(),
            self.first_head as u32,
            self.heads as u32,
        )
    }
}

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

/// The shapes the kernels take, checked: `[B, H, T, D]` and `[B, KV, T, D]` twice.
fn dims(q: &CubeTensor, k: &CubeTensor, v: &CubeTensor) -> [usize; 5] {
    let [b, h, t, d] = q.shape().dims::<4>();
    let kd = k.shape().dims::<4>();
    let kv = kd[1];
    assert!(
        kd == [b, kv, t, d] && v.shape().dims::<4>() == kd && kv > 0 && h.is_multiple_of(kv),
        "attention of q {:?} over k {:?} and v {:?}: k and v must be [B, KV, T, D] with H a \
         multiple of KV",
        q.shape(),
        k.shape(),
        v.shape()
    );
    assert!(
        d <= MOST_HEAD_WIDTH,
        "attention heads of {d} floats: the kernels take {MOST_HEAD_WIDTH} at most"
    );
    [b, h, kv, t, d]
}

/// `x` as the kernels read it: as it is where its last dimension is contiguous (a head's rows
/// may lie any distance apart: a view of the GPT's packed projection, a transposed output), else
/// a contiguous copy.
fn rows_contiguous(x: CubeTensor) -> CubeTensor {
    let x = untile(x);
    let strides = x.meta.strides();
    if strides[strides.len() - 1] == 1 {
        x
    } else {
        into_contiguous(x)
    }
}

/// An uninitialised `[B, H, T, D]` tensor laid out as `[B, T, H, D]`, each position's heads side
/// by side: the models' `swap_dims(1, 2)` and reshape to `[B, T, H·D]` then read it as it is,
/// and a gradient of q, k or v goes back into the packed projection's layout without a copy.
fn heads_in_rows(like: &CubeTensor, [b, h, t, d]: [usize; 4]) -> CubeTensor {
    let (client, device) = (like.client.clone(), like.device.clone());
    let mut x = empty_device_dtype(client, device, Shape::new([b, t, h, d]), like.dtype);
    x.meta.swap(1, 2);
    x
}

/// `starts` as the kernels read it, and whether it restricts the rows: an empty tensor becomes
/// one element (a binding may not be empty) that the kernels do not read.
fn starts_arg(starts: CubeTensor, like: &CubeTensor) -> (CubeTensor, bool) {
    if starts.shape().num_elements() > 0 {
        return (into_contiguous(starts), true);
    }
    let dtype = starts.dtype;
    let one = zeros_client(
        like.client.clone(),
        like.device.clone(),
        Shape::new([1]),
        dtype,
    );
    (one, false)
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
        let [q, k, v] = [q, k, v].map(rows_contiguous);
        let [b, h, _, t, d] = dims(&q, &k, &v);
        let (starts, within) = starts_arg(starts, &q);
        let (client, device, dtype) = (q.client.clone(), q.device.clone(), q.dtype);
        let out = heads_in_rows(&q, [b, h, t, d]);
        let lse = empty_device_dtype(client.clone(), device, Shape::new([b, h, t]), DType::F32);
        let dtypes = [
            dtype_to_storage_type(dtype),
            dtype_to_storage_type(DType::F32),
            dtype_to_storage_type(starts.dtype),
        ];
        if let Some(m) = mma_on(Pass::Forward, d, dtype, &client) {
            forward_mma::launch(
                &client,
                CubeCount::Static(t.div_ceil(m.rows()) as u32, h as u32, b as u32),
                CubeDim::new_2d(m.plane as u32, m.planes as u32),
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                starts.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                scale,
                drop.args(),
                d,
                m.planes,
                m.chunks,
                m.units(),
                m.lanes,
                within,
                drop.prob > 0.0,
                dtypes,
            );
            return (out, lse);
        }
        let (rows, units) = tiling_on(Pass::Forward, d, &client);
        forward_kernel::launch(
            &client,
            CubeCount::Static(t.div_ceil(rows) as u32, h as u32, b as u32),
            CubeDim::new_1d(units as u32),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            starts.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scale,
            drop.args(),
            d,
            rows,
            units,
            within,
            drop.prob > 0.0,
            dtypes,
        );
        (out, lse)
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
        let [q, k, v, out, dout] = [q, k, v, out, dout].map(rows_contiguous);
        let lse = into_contiguous(lse);
        let [b, h, kv, t, d] = dims(&q, &k, &v);
        // The kernels read the six in two types: q, k, v, the output and its gradient in one.
        let stored = [&k, &v, &out, &dout].map(|x| x.dtype);
        assert!(
            stored.iter().all(|&x| x == q.dtype) && lse.dtype == DType::F32,
            "attention's backward: q is {:?}, k, v, the output and its gradient {stored:?}, the \
             log-sum-exp {:?} (f32)",
            q.dtype,
            lse.dtype
        );
        let (starts, within) = starts_arg(starts, &q);
        let (client, device, dtype) = (q.client.clone(), q.device.clone(), q.dtype);
        let empty =
            |shape: Shape, dtype| empty_device_dtype(client.clone(), device.clone(), shape, dtype);
        let (dq, dk, dv) = (
            heads_in_rows(&q, [b, h, t, d]),
            heads_in_rows(&q, [b, kv, t, d]),
            heads_in_rows(&q, [b, kv, t, d]),
        );
        // δ_i = dout_i · out_i, a float per row: the dq kernel computes it and writes it here
        // for the dk/dv kernel, which runs after it.
        let delta = empty(Shape::new([b, h, t]), DType::F32);
        let dtypes = [
            dtype_to_storage_type(dtype),
            dtype_to_storage_type(DType::F32),
            dtype_to_storage_type(starts.dtype),
        ];
        let mma = (
            mma_on(Pass::Dq, d, dtype, &client),
            mma_on(Pass::Dkv, d, dtype, &client),
        );
        if let (Some(mq), Some(mkv)) = mma {
            dq_mma::launch(
                &client,
                CubeCount::Static(t.div_ceil(mq.rows()) as u32, h as u32, b as u32),
                CubeDim::new_2d(mq.plane as u32, mq.planes as u32),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                out.into_tensor_arg(),
                dout.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                starts.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                scale,
                drop.args(),
                d,
                mq.planes,
                mq.chunks,
                mq.units(),
                mq.lanes,
                within,
                drop.prob > 0.0,
                dtypes,
            );
            dkv_mma::launch(
                &client,
                CubeCount::Static(t.div_ceil(mkv.rows()) as u32, kv as u32, b as u32),
                CubeDim::new_2d(mkv.plane as u32, mkv.planes as u32),
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                dout.into_tensor_arg(),
                lse.into_tensor_arg(),
                delta.into_tensor_arg(),
                starts.into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                scale,
                drop.args(),
                d,
                mkv.planes,
                mkv.chunks,
                mkv.units(),
                mkv.lanes,
                within,
                drop.prob > 0.0,
                dtypes,
            );
            return (dq, dk, dv);
        }
        let (rows, units) = tiling_on(Pass::Dq, d, &client);
        dq_kernel::launch(
            &client,
            CubeCount::Static(t.div_ceil(rows) as u32, h as u32, b as u32),
            CubeDim::new_1d(units as u32),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            starts.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            drop.args(),
            d,
            rows,
            units,
            within,
            drop.prob > 0.0,
            dtypes,
        );
        let (rows, units) = tiling_on(Pass::Dkv, d, &client);
        dkv_kernel::launch(
            &client,
            CubeCount::Static(t.div_ceil(rows) as u32, kv as u32, b as u32),
            CubeDim::new_1d(units as u32),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            dout.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            starts.into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            scale,
            drop.args(),
            d,
            rows,
            units,
            within,
            drop.prob > 0.0,
            dtypes,
        );
        (dq, dk, dv)
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
