//! The models' hot operations as single CPU kernels: LayerNorm, RMSNorm, the exact GELU,
//! SwiGLU's gate, ReLU with 2×2 max-pooling, softmax cross-entropy, causal attention (of q, k,
//! v, or of the packed projection that holds them), the Linear's matrix product, and the image
//! models' stride-1 convolution and BatchNorm (with the batch's statistics, or with statistics
//! given, as a synchronised BatchNorm has them).
//!
//! Each function here is what a model calls in place of the Burn ops it composes. On Burn's
//! Flex CPU backend, with or without autodiff, and in f32, it runs one fused kernel forward and
//! one backward written by hand (backend extensions: [`FusedOps`], [`VisionOps`]), where
//! Burn's autodiff would record the composition op by op (LayerNorm alone is nine ops forward; softmax five;
//! attention materialises and masks a `T × T` score matrix per head). Anywhere else — WGPU,
//! CUDA, another dtype, or with [`set_enabled`]`(false)` — it runs exactly the Burn ops the
//! models ran before, so a model stays backend-generic and a GPU run is untouched.
//!
//! The fused kernels equal the composed ops within 1e-5 relative (forward and every gradient,
//! `tests.rs`, `vision_tests.rs`); they are not bit-identical to them, since sums run in another order (the
//! Linear's products are: the same `gemm` calls as Flex's matmul).

mod conv;
mod conv_rows;
mod ext;
mod flex;
mod gated;
mod gemm;
mod kernels;
mod math;
mod seed;
mod vision;

use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::{Dispatch, DispatchDevice};
use burn::nn::conv::Conv2d;
use burn::nn::pool::MaxPool2d;
use burn::nn::{BatchNorm, LayerNorm, PaddingConfig2d, Relu, RmsNorm};
use burn::prelude::*;
use burn::tensor::DType;

use crate::draw::DropoutPart;

pub use ext::FusedOps;
pub use seed::SeedOps;
pub use vision::VisionOps;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the fused CPU kernels on or off for the whole process (on by default). Off, every
/// function of this module runs the Burn ops it replaces: the switch compares the two.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether the fused CPU kernels are on (see [`set_enabled`]).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The vector instructions the fused kernels use on this CPU: `"avx512"`, `"avx2"` or
/// `"baseline"` (chosen at run time; the same binary runs on each).
pub fn vector_level() -> &'static str {
    match kernels::cpu_level() {
        kernels::Level::Avx512 => "avx512",
        kernels::Level::Avx2 => "avx2",
        kernels::Level::Plain => "baseline",
    }
}

/// Whether `device` is Flex, with or without autodiff.
fn on_flex(device: &Device) -> bool {
    match device.as_dispatch() {
        DispatchDevice::Flex(_) => true,
        DispatchDevice::Autodiff(inner) => matches!(&**inner, DispatchDevice::Flex(_)),
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// Whether the fused kernels take tensors of this dtype on this device.
fn fused_here(dtype: DType, device: &Device) -> bool {
    enabled() && dtype == DType::F32 && on_flex(device)
}

/// `norm` (whose epsilon is `epsilon`: Burn keeps it private) applied to `x`'s last dimension.
pub fn layer_norm<const D: usize>(norm: &LayerNorm, epsilon: f64, x: Tensor<D>) -> Tensor<D> {
    let gamma = norm.gamma.val();
    let f32_params = gamma.dtype() == DType::F32
        && norm
            .beta
            .as_ref()
            .is_none_or(|b| b.val().dtype() == DType::F32);
    if !(fused_here(x.dtype(), &x.device()) && f32_params) {
        if crate::cube::norm_takes(&x, &gamma) {
            let beta = norm.beta.as_ref().map(|b| b.val());
            return crate::cube::norm(x, gamma, beta, epsilon, false);
        }
        return norm.forward(x);
    }
    layer_norm_fused(x, gamma, norm.beta.as_ref().map(|b| b.val()), epsilon)
}

fn layer_norm_fused<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Tensor<D> {
    // No bias: zeros that nothing differentiates.
    let beta = beta.unwrap_or_else(|| gamma.zeros_like().detach());
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    ))
}

/// `norm` (Burn's RMSNorm) applied to `x`'s last dimension.
pub fn rms_norm<const D: usize>(norm: &RmsNorm, x: Tensor<D>) -> Tensor<D> {
    let gamma = norm.gamma.val();
    if !(fused_here(x.dtype(), &x.device()) && gamma.dtype() == DType::F32) {
        if crate::cube::norm_takes(&x, &gamma) {
            return crate::cube::norm(x, gamma, None, norm.epsilon, true);
        }
        return norm.forward(x);
    }
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_rms_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        norm.epsilon,
    ))
}

/// SwiGLU's gate, `silu(gate) · up` (the two of one shape).
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    let device = gate.device();
    if !(fused_here(gate.dtype(), &device) && fused_here(up.dtype(), &device)) {
        return burn::tensor::activation::silu(gate) * up;
    }
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

/// `pool` after `relu` on `[batch, channels, h, w]`: where the pool is 2×2 of stride 2 with no
/// padding, dilation or ceiling (the ConvNet's), one pass on the CPU; anything else, the two
/// modules.
pub fn relu_max_pool(relu: &Relu, pool: &MaxPool2d, x: Tensor<4>) -> Tensor<4> {
    let two = pool.kernel_size == [2, 2]
        && pool.stride == [2, 2]
        && pool.dilation == [1, 1]
        && !pool.ceil_mode
        && matches!(pool.padding, PaddingConfig2d::Valid);
    if !(two && fused_here(x.dtype(), &x.device())) {
        return pool.forward(relu.forward(x));
    }
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_relu_max_pool2(
        x.into_dispatch(),
    ))
}

/// `conv` applied to `x` (`[batch, channels, h, w]`): where it has stride 1, no dilation, one
/// group and the same padding on both sides of each axis (the ConvNet's), one matrix product
/// per image on the CPU with a backward written by hand ([`VisionOps`]); anything else,
/// Burn's `Conv2d::forward`.
pub fn conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    let [kh, kw] = conv.kernel_size;
    let [_, _, h, w] = x.dims();
    // (top, bottom, left, right), as Burn's Conv2d reads its padding for stride 1.
    let (t, b, l, r) = match conv.padding {
        PaddingConfig2d::Valid => (0, 0, 0, 0),
        PaddingConfig2d::Explicit(top, left, bottom, right) => (top, bottom, left, right),
        PaddingConfig2d::Same => {
            let (th, tw) = (kh.saturating_sub(1), kw.saturating_sub(1));
            (th / 2, th - th / 2, tw / 2, tw - tw / 2)
        }
    };
    let weight = conv.weight.val();
    let bias = conv.bias.as_ref().map(|b| b.val());
    let plain = conv.stride == [1, 1]
        && conv.dilation == [1, 1]
        && conv.groups == 1
        && (t, l) == (b, r)
        && h + 2 * t >= kh
        && w + 2 * l >= kw;
    let f32_params =
        weight.dtype() == DType::F32 && bias.as_ref().is_none_or(|b| b.dtype() == DType::F32);
    if !(plain && f32_params && fused_here(x.dtype(), &x.device())) {
        return conv.forward(x);
    }
    Tensor::from_dispatch(match bias {
        None => {
            <Dispatch as VisionOps>::fused_conv2d(x.into_dispatch(), weight.into_dispatch(), t, l)
        }
        Some(bias) => <Dispatch as VisionOps>::fused_conv2d_bias(
            x.into_dispatch(),
            weight.into_dispatch(),
            bias.into_dispatch(),
            t,
            l,
        ),
    })
}

/// `norm` applied to `x` (`[batch, channels, ...]`), on the CPU in f32 as one kernel: in
/// training (an autodiff device and the norm not frozen) with the batch's statistics (two
/// passes forward, two backward), the running statistics updated as Burn's BatchNorm updates
/// them; otherwise with the running statistics ([`batch_norm_with`]). Anywhere else,
/// `BatchNorm::forward`.
pub fn batch_norm<const D: usize>(norm: &BatchNorm, x: Tensor<D>) -> Tensor<D> {
    let (gamma, beta) = (norm.gamma.val(), norm.beta.val());
    let device = x.device();
    let training = device.is_autodiff() && norm.training.is_enabled();
    let f32_params = gamma.dtype() == DType::F32 && beta.dtype() == DType::F32;
    if !(f32_params && fused_here(x.dtype(), &device)) {
        return norm.forward(x);
    }
    if !training {
        // Evaluation: the running statistics, as Burn's BatchNorm takes them.
        let mean = norm.running_mean.value().to_device(&device);
        let var = norm.running_var.value().to_device(&device);
        return batch_norm_with(x, [gamma, beta, mean, var], norm.epsilon);
    }
    let (y, mean, var) = <Dispatch as VisionOps>::fused_batch_norm_train(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        norm.epsilon,
    );
    let (mean, var) = (
        Tensor::<1>::from_dispatch(mean),
        Tensor::<1>::from_dispatch(var),
    );
    let momentum = norm.momentum;
    let running = |old: Tensor<1>, batch: Tensor<1>| {
        old.to_device(&device)
            .mul_scalar(1.0 - momentum)
            .add(batch.detach().mul_scalar(momentum))
            .detach()
    };
    norm.running_mean
        .update(running(norm.running_mean.value_sync(), mean));
    norm.running_var
        .update(running(norm.running_var.value_sync(), var));
    Tensor::from_dispatch(y)
}

/// `[C]` values shaped to broadcast along dimension 1 of a rank-`D` tensor.
fn along_channels<const D: usize>(v: Tensor<1>) -> Tensor<D> {
    let mut shape = [1usize; D];
    shape[1] = v.dims()[0];
    v.reshape(shape)
}

/// `(x − mean)·γ/√(var + ε) + β` per channel of `x` (`[batch, channels, ...]`), differentiable
/// in all five: BatchNorm with statistics given (a synchronised BatchNorm's, taken over every
/// replica). One pass forward and two backward on the CPU; elsewhere the Burn ops.
pub fn batch_norm_with<const D: usize>(
    x: Tensor<D>,
    [gamma, beta, mean, var]: [Tensor<1>; 4],
    epsilon: f64,
) -> Tensor<D> {
    let device = x.device();
    let all_f32 = [&gamma, &beta, &mean, &var]
        .iter()
        .all(|t| t.dtype() == DType::F32);
    if !(all_f32 && fused_here(x.dtype(), &device)) {
        let scale = var.add_scalar(epsilon).sqrt().recip().mul(gamma);
        return (x - along_channels(mean)) * along_channels(scale) + along_channels(beta);
    }
    Tensor::from_dispatch(<Dispatch as VisionOps>::fused_batch_norm_stats(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        mean.into_dispatch(),
        var.into_dispatch(),
        epsilon,
    ))
}

/// Per channel of `x` (`[batch, channels, ...]`), over every other dimension and read back to
/// the host: `Σ (x − center)`, or with `squared` `Σ (x − center)²` (`center` zeros when
/// `None`). Not differentiated. One pass on the CPU; elsewhere the Burn ops.
pub fn channel_sums<const D: usize>(
    x: &Tensor<D>,
    center: Option<&[f32]>,
    squared: bool,
) -> Vec<f32> {
    let device = x.device();
    let c = x.dims()[1];
    let zeros = vec![0.0f32; c];
    let center = center.unwrap_or(&zeros);
    assert_eq!(center.len(), c, "{} centres for {c} channels", center.len());
    let center = Tensor::<1>::from_data(TensorData::new(center.to_vec(), [c]), &device);
    let sums = if fused_here(x.dtype(), &device) {
        Tensor::<1>::from_dispatch(<Dispatch as VisionOps>::fused_channel_sums(
            x.clone().detach().into_dispatch(),
            center.into_dispatch(),
            squared,
        ))
    } else {
        // In f32 whatever the activations' dtype.
        let x32 = x.clone().detach().cast(burn::tensor::FloatDType::F32);
        let centered = x32 - along_channels(center);
        let values = if squared {
            centered.clone() * centered
        } else {
            centered
        };
        let n = x.dims().iter().product::<usize>() / c.max(1);
        values
            .swap_dims(0, 1)
            .reshape([c, n])
            .sum_dim(1)
            .reshape([c])
    };
    sums.into_data().convert::<f32>().iter::<f32>().collect()
}

/// `Σ output·upstream` as the root of a backward that runs one segment of a model: its
/// gradient with respect to `output` is `upstream`. On the CPU in f32 the forward is one read
/// of both and the backward hands `upstream` over as it is ([`SeedOps`]); elsewhere the
/// product and the sum.
pub fn dot_seed<const D: usize>(output: Tensor<D>, upstream: Tensor<D>) -> Tensor<1> {
    let device = output.device();
    if !(fused_here(output.dtype(), &device) && fused_here(upstream.dtype(), &device)) {
        return (output * upstream).sum();
    }
    assert_eq!(
        output.dims(),
        upstream.dims(),
        "a seed of another shape than its output"
    );
    Tensor::from_dispatch(<Dispatch as SeedOps>::fused_dot_seed(
        output.into_dispatch(),
        upstream.detach().into_dispatch(),
    ))
}

/// The exact GELU, `x·Φ(x)`.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !fused_here(x.dtype(), &x.device()) {
        // On a GPU the kernels' (`cube::gelu`), elsewhere Burn's ops.
        return crate::cube::gelu(x);
    }
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_gelu(x.into_dispatch()))
}

/// Mean cross-entropy of `logits` (`[rows, classes]`, any float dtype: computed in f32) against
/// the class ids `targets` (`[rows]`), shape `[1]`. A row whose target is negative
/// ([`crate::IGNORE`], PyTorch's `ignore_index = -100`) takes no part: the mean is over the
/// other rows, and its logits get no gradient; with no row left the loss is 0.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let logits = logits.cast(burn::tensor::FloatDType::F32);
    if !fused_here(logits.dtype(), &logits.device()) {
        return cross_entropy_composed(logits, targets);
    }
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_cross_entropy(
        logits.into_dispatch(),
        targets.into_dispatch(),
    ))
}

/// [`cross_entropy`] in Burn's ops: the log-softmax's entry at each target, the ignored rows'
/// (a negative target, read at class 0) multiplied by 0, summed over the rows scored.
fn cross_entropy_composed(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [n, _] = logits.dims();
    let scored = targets.clone().greater_equal_elem(0);
    let at = targets.clamp_min(0).reshape([n, 1]);
    let picked = burn::tensor::activation::log_softmax(logits, 1)
        .gather(1, at)
        .reshape([n]);
    let weight = scored.float();
    let count = weight.clone().sum().clamp_min(1.0);
    (picked * weight).sum().neg() / count
}

/// Causal self-attention of `q`, `k`, `v` (`[batch, heads, time, head_dim]`): position `t`
/// attends to `0..=t`, scores scaled by `1/√head_dim`, the weights passed through `dropout`
/// if there is one ([`crate::draw::dropout`], of the heads' part of the whole: a
/// tensor-parallel rank's heads take their part of the whole's mask). The fused kernel runs where the dropout does nothing (probability 0, or no
/// training): it never forms the weights that dropout would act on.
pub fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    dropout: Option<DropoutPart<'_>>,
) -> Tensor<4> {
    attention_within(q, k, v, None, dropout)
}

/// The dropout the GPU's attention kernels draw for `dropout` on the weights of `heads` heads:
/// none where it does nothing; `None` where the kernels cannot draw it — a forward without a
/// key ([`crate::draw::keyed`]), or a part not cut by heads — and the composed ops draw it.
/// Takes the forward's draw only when it answers one.
fn cube_dropout(
    dropout: Option<DropoutPart<'_>>,
    heads: usize,
    device: &Device,
) -> Option<crate::cube::AttentionDropout> {
    let Some(part) = dropout.filter(|d| crate::draw::acts(d.dropout, device)) else {
        return Some(crate::cube::AttentionDropout::default());
    };
    if part.part.is_some_and(|p| p.dim != 1) {
        return None;
    }
    let draw = crate::draw::kernel_draw(part)?;
    let (first_head, all) = match draw.part {
        Some(p) => (p.index * heads, p.of * heads),
        None => (0, heads),
    };
    Some(crate::cube::AttentionDropout {
        seed: draw.seed,
        prob: draw.prob as f32,
        first_head,
        heads: all,
    })
}

/// `x` (`[b, kv, t, d]`) with each head repeated for the `heads / kv` query heads that read it
/// (`[b, heads, t, d]`); as it is when `kv = heads`.
pub(crate) fn repeat_heads(x: Tensor<4>, heads: usize) -> Tensor<4> {
    let [b, kv, t, d] = x.dims();
    if kv == heads {
        return x;
    }
    x.reshape([b, kv, 1, t, d])
        .expand([b, kv, heads / kv, t, d])
        .reshape([b, heads, t, d])
}

/// [`causal_attention`] within documents: with `starts` (`[batch, time]`, the position where
/// each position's document begins in its row — several examples packed into one row),
/// position `t` attends to `starts[t]..=t` only, so that no example sees another.
pub fn attention_within(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    starts: Option<&Tensor<2, Int>>,
    dropout: Option<DropoutPart<'_>>,
) -> Tensor<4> {
    let device = q.device();
    let dropout_acts = dropout.is_some_and(|d| d.dropout.prob > 0.0 && device.is_autodiff());
    if crate::cube::attention_takes(&q, &k, &v)
        && let Some(drop) = cube_dropout(dropout, q.dims()[1], &device)
    {
        return crate::cube::attention(q, k, v, starts, drop);
    }
    let heads = q.dims()[1];
    let (k, v) = (repeat_heads(k, heads), repeat_heads(v, heads));
    let dtypes = [q.dtype(), k.dtype(), v.dtype()];
    if dropout_acts || !dtypes.iter().all(|&d| fused_here(d, &device)) {
        return causal_attention_composed(q, k, v, starts, dropout);
    }
    attention_fused(q, k, v, starts)
}

fn attention_fused(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    starts: Option<&Tensor<2, Int>>,
) -> Tensor<4> {
    let device = q.device();
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        starts_or_none(starts, &device),
    ))
}

/// The starts as the fused ops take them: the tensor, or an empty one (every row from 0).
fn starts_or_none(
    starts: Option<&Tensor<2, Int>>,
    device: &Device,
) -> burn::tensor::DispatchTensor {
    match starts {
        Some(s) => s.clone().into_dispatch(),
        None => Tensor::<1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), device)
            .into_dispatch(),
    }
}

/// [`causal_attention`] of a packed projection: `qkv` is `[batch, time, 3·channels]` (q, k and
/// v side by side, each `heads` heads of `channels / heads`, as one Linear makes them), the
/// result `[batch, time, channels]` with the heads side by side — what a transformer block
/// does between its two projections. Fused, the kernel reads q, k and v where the projection
/// put them and writes the projection's gradient whole: no slices, transposes or copies
/// between, forward or backward.
pub fn causal_attention_packed(
    qkv: Tensor<3>,
    heads: usize,
    dropout: Option<DropoutPart<'_>>,
) -> Tensor<3> {
    packed_within(qkv, heads, None, dropout)
}

/// [`causal_attention_packed`] within documents (`starts` as [`attention_within`]'s).
pub fn packed_within(
    qkv: Tensor<3>,
    heads: usize,
    starts: Option<&Tensor<2, Int>>,
    dropout: Option<DropoutPart<'_>>,
) -> Tensor<3> {
    let c3 = qkv.dims()[2];
    assert!(
        heads > 0 && c3.is_multiple_of(3 * heads),
        "packed attention: {c3} channels are not 3 × {heads} heads of one size"
    );
    let device = qkv.device();
    let dropout_acts = dropout.is_some_and(|d| d.dropout.prob > 0.0 && device.is_autodiff());
    if crate::cube::kernels_here(qkv.dtype(), &device) {
        if crate::cube::attention_packed_takes(&qkv, heads)
            && let Some(drop) = cube_dropout(dropout, heads, &device)
        {
            return crate::cube::attention_packed(qkv, heads, starts, drop);
        }
        let [b, t, _] = qkv.dims();
        let [q, k, v] = packed_heads(qkv, heads);
        return causal_attention_composed(q, k, v, starts, dropout)
            .swap_dims(1, 2)
            .reshape([b, t, c3 / 3]);
    }
    if !dropout_acts && fused_here(qkv.dtype(), &device) {
        let starts = starts_or_none(starts, &device);
        return Tensor::from_dispatch(<Dispatch as FusedOps>::fused_causal_attention_packed(
            qkv.into_dispatch(),
            heads,
            starts,
        ));
    }
    packed_composed(qkv, heads, starts, dropout)
}

/// The Burn ops that [`causal_attention_packed`] replaces: q, k and v sliced out of the
/// projection, attention, the heads put side by side again.
fn packed_composed(
    qkv: Tensor<3>,
    heads: usize,
    starts: Option<&Tensor<2, Int>>,
    dropout: Option<DropoutPart<'_>>,
) -> Tensor<3> {
    let [b, t, c3] = qkv.dims();
    let [q, k, v] = packed_heads(qkv, heads);
    causal_attention_composed(q, k, v, starts, dropout)
        .swap_dims(1, 2)
        .reshape([b, t, c3 / 3])
}

/// q, k and v (`[b, heads, t, d]` each) of a packed projection `qkv` (`[b, t, 3·heads·d]`).
fn packed_heads(qkv: Tensor<3>, heads: usize) -> [Tensor<4>; 3] {
    let [b, t, c3] = qkv.dims();
    let (c, d) = (c3 / 3, c3 / 3 / heads);
    [0, 1, 2].map(|i| {
        qkv.clone()
            .slice([0..b, 0..t, i * c..(i + 1) * c])
            .reshape([b, t, heads, d])
            .swap_dims(1, 2)
    })
}

/// `x · weight + bias` over the rows of `x` (`[rows, in]`; `weight` `[in, out]` as Burn's
/// Linear keeps it): Burn's `linear`, fused on the CPU into one product that writes its
/// output's own buffer, the bias its starting value, with a backward of two products and a
/// column sum; on a GPU [`crate::cube::linear`], the weight's gradient summed by parts.
pub fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<2> {
    let f32_params =
        weight.dtype() == DType::F32 && bias.as_ref().is_none_or(|b| b.dtype() == DType::F32);
    if !(fused_here(x.dtype(), &x.device()) && f32_params) {
        // On a GPU, the weight's gradient summed by parts of the rows.
        return crate::cube::linear(x, weight, bias);
    }
    let [_, k] = x.dims();
    let [k2, _] = weight.dims();
    assert_eq!(k, k2, "linear: input rows of {k}, weight of {k2} inputs");
    Tensor::from_dispatch(match bias {
        None => <Dispatch as FusedOps>::fused_linear(x.into_dispatch(), weight.into_dispatch()),
        Some(b) => <Dispatch as FusedOps>::fused_linear_bias(
            x.into_dispatch(),
            weight.into_dispatch(),
            b.into_dispatch(),
        ),
    })
}

fn causal_attention_composed(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    starts: Option<&Tensor<2, Int>>,
    dropout: Option<DropoutPart<'_>>,
) -> Tensor<4> {
    let [b, h, t, d] = q.dims();
    let device = q.device();
    let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f32).sqrt());
    let future = Tensor::<2, Bool>::tril_mask([t, t], 0, &device).reshape([1, t, t]);
    let hidden = match starts {
        // A key before the query's document begins is hidden too.
        Some(s) => {
            let keys = Tensor::<1, Int>::arange(0..t as i64, &device)
                .reshape([1, 1, t])
                .expand([b, t, t]);
            let before = keys.lower(s.clone().reshape([b, t, 1]).expand([b, t, t]));
            future.expand([b, t, t]).bool_or(before)
        }
        None => future.expand([b, t, t]),
    };
    let hidden = hidden.reshape([b, 1, t, t]).expand([b, h, t, t]);
    let weights = burn::tensor::activation::softmax(scores.mask_fill(hidden, f32::NEG_INFINITY), 3);
    match dropout {
        Some(dropout) => dropout.apply(weights),
        None => weights,
    }
    .matmul(v)
}

#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod vision_tests;
