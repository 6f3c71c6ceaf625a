//! The kernels' launches: their arguments checked and laid out, the outputs made (or given:
//! views of a packed projection's gradient), each pass on the matrix units or the ordinary
//! ones; and the packed `[B, T, 3C]` projection (the GPT's) read in place, its three
//! gradients written in place into one `[B, T, 3C]` tensor where Burn's backward of three
//! slices fills three and adds them.

use burn::backend::TensorMetadata;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::{into_contiguous, slice, untile};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::zspace::metadata::Metadata;

use super::drop::AttentionDropout;
use super::kernels::{dkv_kernel, dq_kernel, forward_kernel};
use super::mma::{dkv_mma, dq_mma, forward_mma};
use super::tiling::{MOST_HEAD_WIDTH, Pass, mma_on, tiling_on};

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
    // Left uninitialised: filling it would be a launch of its own, each pass.
    let dtype = starts.dtype;
    let one = empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::new([1]),
        dtype,
    );
    (one, false)
}

/// The forward's output and log-sum-exp (`CubeAttentionOps::kiln_attention_forward`), the
/// output written into `out` where given (a `[B, H, T, D]` view whose last dimension is
/// contiguous), else into a new tensor ([`heads_in_rows`]).
pub(super) fn forward_into(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    starts: CubeTensor,
    scale: f32,
    drop: AttentionDropout,
    out: Option<CubeTensor>,
) -> (CubeTensor, CubeTensor) {
    let [q, k, v] = [q, k, v].map(rows_contiguous);
    let [b, h, _, t, d] = dims(&q, &k, &v);
    let (starts, within) = starts_arg(starts, &q);
    let (client, device, dtype) = (q.client.clone(), q.device.clone(), q.dtype);
    let out = out.unwrap_or_else(|| heads_in_rows(&q, [b, h, t, d]));
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

/// The gradients of q, k and v (`CubeAttentionOps::kiln_attention_backward`), written into
/// `grads` where given (`[B, H, T, D]` and twice `[B, KV, T, D]`, views whose last dimension is
/// contiguous), else into new tensors ([`heads_in_rows`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_into(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    dout: CubeTensor,
    starts: CubeTensor,
    scale: f32,
    drop: AttentionDropout,
    grads: Option<[CubeTensor; 3]>,
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
    let [dq, dk, dv] = grads.unwrap_or_else(|| {
        [
            heads_in_rows(&q, [b, h, t, d]),
            heads_in_rows(&q, [b, kv, t, d]),
            heads_in_rows(&q, [b, kv, t, d]),
        ]
    });
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

/// `x` (`[B, T, H·D]`, its last dimension contiguous, its rows any distance apart) seen as
/// `[B, H, T, D]` in place.
fn heads_view(x: CubeTensor, heads: usize) -> CubeTensor {
    let [b, t, c] = x.shape().dims::<3>();
    let d = c / heads;
    let s = x.meta.strides().to_vec();
    let meta = Metadata::new([b, heads, t, d], [s[0], d, s[1], 1]);
    CubeTensor::new(x.client, x.handle, meta, x.device, x.dtype)
}

/// q, k and v of a packed projection `qkv` (`[B, T, 3·H·D]`) as `[B, H, T, D]` tensors: views
/// in place where the device may bind a buffer from their first element, else copies.
fn packed_views(qkv: &CubeTensor, heads: usize) -> [CubeTensor; 3] {
    let [b, t, c3] = qkv.shape().dims::<3>();
    let c = c3 / 3;
    [0, 1, 2].map(|i| heads_view(slice(qkv.clone(), &[0..b, 0..t, i * c..(i + 1) * c]), heads))
}

/// A new packed projection's gradient (`[B, T, 3·H·D]`, like `qkv`) and q's, k's and v's
/// parts of it as `[B, H, T, D]` views, where the device may bind the buffer from each part's
/// first element (the parts' offsets a multiple of its alignment); `None` otherwise.
fn packed_grads(qkv: &CubeTensor, heads: usize) -> Option<(CubeTensor, [CubeTensor; 3])> {
    let [b, t, c3] = qkv.shape().dims::<3>();
    let (c, size) = (c3 / 3, qkv.dtype.size());
    let alignment = qkv.client.properties().memory.alignment;
    if !((c * size) as u64).is_multiple_of(alignment) {
        return None;
    }
    let (client, device) = (qkv.client.clone(), qkv.device.clone());
    let whole = empty_device_dtype(client, device, Shape::new([b, t, c3]), qkv.dtype);
    let part = |i: usize| {
        let handle = whole
            .handle
            .clone()
            .offset_start((i * c * size) as u64)
            .offset_end(((2 - i) * c * size) as u64);
        let meta = Metadata::new([b, t, c], [t * c3, c3, 1]);
        let x = CubeTensor::new(
            whole.client.clone(),
            handle,
            meta,
            whole.device.clone(),
            whole.dtype,
        );
        heads_view(x, heads)
    };
    let parts = [part(0), part(1), part(2)];
    Some((whole, parts))
}

/// `CubeAttentionOps::kiln_attention_packed_forward` on a CubeCL device.
pub(super) fn packed_forward(
    qkv: CubeTensor,
    starts: CubeTensor,
    heads: usize,
    scale: f32,
    drop: AttentionDropout,
) -> (CubeTensor, CubeTensor) {
    let qkv = rows_contiguous(qkv);
    let [b, t, c3] = qkv.shape().dims::<3>();
    let [q, k, v] = packed_views(&qkv, heads);
    let (client, device) = (qkv.client.clone(), qkv.device.clone());
    let out = empty_device_dtype(client, device, Shape::new([b, t, c3 / 3]), qkv.dtype);
    let (_, lse) = forward_into(
        q,
        k,
        v,
        starts,
        scale,
        drop,
        Some(heads_view(out.clone(), heads)),
    );
    (out, lse)
}

/// `CubeAttentionOps::kiln_attention_packed_backward` on a CubeCL device.
#[allow(clippy::too_many_arguments)]
pub(super) fn packed_backward(
    qkv: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    dout: CubeTensor,
    starts: CubeTensor,
    heads: usize,
    scale: f32,
    drop: AttentionDropout,
) -> CubeTensor {
    let [qkv, out, dout] = [qkv, out, dout].map(rows_contiguous);
    let [q, k, v] = packed_views(&qkv, heads);
    let [out, dout] = [out, dout].map(|x| heads_view(x, heads));
    if let Some((whole, parts)) = packed_grads(&qkv, heads) {
        backward_into(q, k, v, out, lse, dout, starts, scale, drop, Some(parts));
        return whole;
    }
    // The parts' own tensors, side by side.
    let (dq, dk, dv) = backward_into(q, k, v, out, lse, dout, starts, scale, drop, None);
    let [b, t, c3] = qkv.shape().dims::<3>();
    let rows = |x: CubeTensor| {
        // `[B, H, T, D]` laid out as `[B, T, H, D]`: contiguous as `[B, T, C]`.
        let meta = Metadata::new([b, t, c3 / 3], [t * c3 / 3, c3 / 3, 1]);
        CubeTensor::new(x.client, x.handle, meta, x.device, x.dtype)
    };
    <CubeBackend as FloatTensorOps<CubeBackend>>::float_cat(vec![rows(dq), rows(dk), rows(dv)], 2)
}
