//! The fused kernels on Flex tensors: each takes a tensor's storage and layout (copied only
//! where a kernel needs another layout) and returns fresh tensors. [`super::ext`] calls these
//! from Burn's backend extension, forward and backward.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::IntTensor;
use burn::tensor::{DType, Shape, TensorData};

use super::gated;
use super::gemm::{self, Mat};
use super::kernels::{self, View4};

/// A tensor's elements in row-major order (copied only when its layout is not that).
pub(super) fn contiguous(t: &FlexTensor) -> FlexTensor {
    assert_eq!(
        t.dtype(),
        DType::F32,
        "fused kernels take f32, got {:?}",
        t.dtype()
    );
    t.to_contiguous()
}

pub(super) fn f32s(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>().expect("a contiguous f32 tensor")
}

pub(super) fn tensor(values: Vec<f32>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape.into()))
}

pub(super) fn dims(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}

/// A 4-d tensor read through its strides (last stride 1 or not).
pub(super) fn view4(t: &FlexTensor) -> View4<'_> {
    assert_eq!(
        t.dtype(),
        DType::F32,
        "fused kernels take f32, got {:?}",
        t.dtype()
    );
    let strides = t.layout().strides();
    assert_eq!(
        strides.len(),
        4,
        "attention takes [batch, heads, time, head_dim]"
    );
    View4 {
        data: t.storage::<f32>(),
        offset: t.layout().start_offset(),
        strides: [strides[0], strides[1], strides[2], strides[3]],
    }
}

/// A `[B, T, H, D]` buffer seen as the `[B, H, T, D]` tensor it holds.
pub(super) fn heads_view(values: Vec<f32>, [b, h, t, d]: [usize; 4]) -> FlexTensor {
    tensor(values, [b, t, h, d]).transpose(1, 2)
}

/// The targets as row indices; a negative one (PyTorch's `-100`, [`crate::IGNORE`]) is
/// [`IGNORED`]: its row takes no part in the loss.
pub(super) fn targets(t: &IntTensor<Flex>) -> Vec<usize> {
    let t = t.to_contiguous();
    let as_index = |i: i64| -> usize { usize::try_from(i).unwrap_or(IGNORED) };
    match t.dtype() {
        DType::I64 => t
            .as_slice::<i64>()
            .unwrap()
            .iter()
            .map(|&i| as_index(i))
            .collect(),
        DType::I32 => t
            .as_slice::<i32>()
            .unwrap()
            .iter()
            .map(|&i| as_index(i as i64))
            .collect(),
        other => panic!("cross-entropy targets must be i64 or i32, got {other:?}"),
    }
}

/// A row whose target is negative: no loss, no gradient.
pub(super) const IGNORED: usize = usize::MAX;

pub(super) fn layer_norm_forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    eps: f64,
) -> (FlexTensor, FlexTensor) {
    let shape = dims(x);
    let c = *shape.last().expect("LayerNorm of a scalar");
    let (x, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
    let x = f32s(&x);
    let rows = x.len() / c.max(1);
    let mut y = vec![0.0f32; x.len()];
    let mut stats = vec![0.0f32; rows * 2];
    kernels::layer_norm_forward(
        x,
        c,
        f32s(&gamma),
        f32s(&beta),
        eps as f32,
        &mut y,
        &mut stats,
    );
    (tensor(y, shape), tensor(stats, [rows, 2]))
}

/// RMSNorm over the last dimension, and each row's `1/rms` for the backward.
pub(super) fn rms_norm_forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    eps: f64,
) -> (FlexTensor, FlexTensor) {
    let shape = dims(x);
    let c = *shape.last().expect("RMSNorm of a scalar");
    let (x, gamma) = (contiguous(x), contiguous(gamma));
    let x = f32s(&x);
    let rows = x.len() / c.max(1);
    let mut y = vec![0.0f32; x.len()];
    let mut inv = vec![0.0f32; rows];
    gated::rms_norm_forward(x, c, f32s(&gamma), eps as f32, &mut y, &mut inv);
    (tensor(y, shape), tensor(inv, [rows]))
}

/// `silu(gate) · up`, the two of one shape.
pub(super) fn swiglu_forward(gate: &FlexTensor, up: &FlexTensor) -> FlexTensor {
    let shape = dims(gate);
    assert_eq!(shape, dims(up), "SwiGLU's gate and up differ in shape");
    let (gate, up) = (contiguous(gate), contiguous(up));
    let mut y = vec![0.0f32; f32s(&gate).len()];
    gated::swiglu_forward(f32s(&gate), f32s(&up), &mut y);
    tensor(y, shape)
}

/// ReLU then 2×2 max-pooling of stride 2 of `[B, C, H, W]`, and which element of each window
/// gave each output (a byte each) for the backward.
pub(super) fn relu_max_pool2_forward(x: &FlexTensor) -> (FlexTensor, std::sync::Arc<Vec<u8>>) {
    let [b, c, h, w]: [usize; 4] = dims(x).try_into().expect("pooling takes [B, C, H, W]");
    let x = contiguous(x);
    let n = b * c * (h / 2) * (w / 2);
    let (mut y, mut arg) = (vec![0.0f32; n], vec![0u8; n]);
    gated::relu_max_pool2_forward(f32s(&x), b * c, [h, w], &mut y, &mut arg);
    (tensor(y, [b, c, h / 2, w / 2]), std::sync::Arc::new(arg))
}

pub(super) fn gelu_forward(x: &FlexTensor) -> FlexTensor {
    let shape = dims(x);
    let x = contiguous(x);
    let x = f32s(&x);
    let mut y = vec![0.0f32; x.len()];
    kernels::gelu_forward(x, &mut y);
    tensor(y, shape)
}

pub(super) fn cross_entropy_forward(
    logits: &FlexTensor,
    targets: &[usize],
) -> (FlexTensor, FlexTensor) {
    let [n, v]: [usize; 2] = dims(logits)
        .try_into()
        .expect("cross-entropy takes [rows, classes]");
    assert_eq!(
        targets.len(),
        n,
        "{n} rows of logits, {} targets",
        targets.len()
    );
    let out_of_range = |t: &usize| *t >= v && *t != IGNORED;
    if let Some((row, &t)) = targets.iter().enumerate().find(|(_, t)| out_of_range(t)) {
        panic!("target {t} of row {row} is not below the {v} classes");
    }
    let logits = contiguous(logits);
    let mut lse = vec![0.0f32; n];
    let mut scratch = vec![0.0f32; v];
    let total = kernels::cross_entropy_forward(f32s(&logits), v, targets, &mut lse, &mut scratch);
    (
        tensor(vec![(total / scored(targets) as f64) as f32], [1]),
        tensor(lse, [n]),
    )
}

/// The rows a loss is the mean over: those with a target, at least one (a batch with none
/// has the loss 0 and no gradient, not 0/0).
pub(super) fn scored(targets: &[usize]) -> usize {
    targets.iter().filter(|&&t| t != IGNORED).count().max(1)
}

pub(super) fn attention_shape(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor) -> [usize; 4] {
    let shape: [usize; 4] = dims(q)
        .try_into()
        .expect("attention takes [batch, heads, time, head_dim]");
    assert!(
        dims(k) == shape && dims(v) == shape,
        "q, k and v differ in shape"
    );
    shape
}

/// Each row's first key (`[B, T]`: the first position of its document in a packed row), or
/// empty (every row from 0).
pub(super) fn starts(t: &IntTensor<Flex>) -> Vec<usize> {
    targets(t)
}

/// The output (a `[B, H, T, D]` view of a `[B, T, H, D]` buffer) and the rows' log-sum-exp;
/// `starts` as [`kernels::attention_forward`]'s.
pub(super) fn attention_forward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    starts: &[usize],
) -> (FlexTensor, FlexTensor) {
    let shape = attention_shape(q, k, v);
    let [b, h, t, d] = shape;
    let mut out = vec![0.0f32; b * h * t * d];
    let mut lse = vec![0.0f32; b * h * t];
    let scale = 1.0 / (d as f32).sqrt();
    kernels::attention_forward(
        view4(q),
        view4(k),
        view4(v),
        shape,
        scale,
        starts,
        &mut out,
        &mut lse,
    );
    (heads_view(out, shape), tensor(lse, [b * h * t]))
}

/// `t` with no negative stride (copied only when it is a flipped view).
pub(super) fn operand(t: &FlexTensor) -> FlexTensor {
    if t.layout().strides().iter().all(|&s| s >= 0) {
        t.clone()
    } else {
        contiguous(t)
    }
}

pub(super) fn linear_forward(x: &FlexTensor, w: &FlexTensor, b: Option<&FlexTensor>) -> FlexTensor {
    let (x, w, b) = (operand(x), operand(w), b.map(contiguous));
    let (x, w) = (Mat::of(&x), Mat::of(&w));
    let ([m, _], [_, n]) = (x.dims(), w.dims());
    tensor(gemm::product(x, w, b.as_ref().map(f32s)), [m, n])
}

/// A Linear's gradients from the output's `dy`: `dx = dy·wᵀ`, `dw = xᵀ·dy`, `db` the sums of
/// `dy`'s columns; each only when asked.
pub(super) fn linear_backward(
    x: &FlexTensor,
    w: &FlexTensor,
    dy: &FlexTensor,
    [want_x, want_w, want_b]: [bool; 3],
) -> [Option<FlexTensor>; 3] {
    let (x, w, dy) = (operand(x), operand(w), operand(dy));
    let (mx, mw, mdy) = (Mat::of(&x), Mat::of(&w), Mat::of(&dy));
    let ([m, k], [_, n]) = (mx.dims(), mw.dims());
    let dx = want_x.then(|| tensor(gemm::product(mdy, mw.t(), None), [m, k]));
    let dw = want_w.then(|| tensor(gemm::product(mx.t(), mdy, None), [k, n]));
    let db = want_b.then(|| tensor(gemm::column_sums(f32s(&contiguous(&dy)), n), [n]));
    [dx, dw, db]
}

/// `[B, H, T, D]` of a packed `[B, T, 3·H·D]` projection.
pub(super) fn packed_shape(qkv: &FlexTensor, heads: usize) -> [usize; 4] {
    let [b, t, c3]: [usize; 3] = dims(qkv)
        .try_into()
        .expect("packed attention takes [batch, time, 3·channels]");
    assert!(
        heads > 0 && c3.is_multiple_of(3 * heads),
        "packed attention: {c3} channels are not 3 × {heads} heads of one size"
    );
    [b, heads, t, c3 / (3 * heads)]
}

/// A `[B, T, ·]` tensor's channels `start..start + H·D` seen as `[B, H, T, D]` (no negative
/// stride: see [`operand`]).
pub(super) fn heads_of(t: &FlexTensor, start: usize, [_, _, _, d]: [usize; 4]) -> View4<'_> {
    let s = t.layout().strides();
    assert_eq!(s.len(), 3, "[batch, time, channels]");
    View4 {
        data: t.storage::<f32>(),
        offset: t.layout().start_offset() + start * s[2] as usize,
        strides: [s[0], d as isize * s[2], s[1], s[2]],
    }
}

/// The output (`[B, T, H·D]`) and the rows' log-sum-exp of attention over a packed projection;
/// `starts` as [`kernels::attention_forward`]'s.
pub(super) fn packed_forward(
    qkv: &FlexTensor,
    heads: usize,
    starts: &[usize],
) -> (FlexTensor, FlexTensor) {
    let qkv = operand(qkv);
    let shape = packed_shape(&qkv, heads);
    let [b, h, t, d] = shape;
    let c = h * d;
    let mut out = vec![0.0f32; b * t * c];
    let mut lse = vec![0.0f32; b * h * t];
    kernels::attention_forward(
        heads_of(&qkv, 0, shape),
        heads_of(&qkv, c, shape),
        heads_of(&qkv, 2 * c, shape),
        shape,
        1.0 / (d as f32).sqrt(),
        starts,
        &mut out,
        &mut lse,
    );
    (tensor(out, [b, t, c]), tensor(lse, [b * h * t]))
}
