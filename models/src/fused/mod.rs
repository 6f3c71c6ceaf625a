//! The transformer's hot operations as single CPU kernels: LayerNorm, RMSNorm, the exact GELU,
//! SwiGLU's gate, ReLU with 2×2 max-pooling, softmax cross-entropy, causal attention (of q, k,
//! v, or of the packed projection that holds them) and the Linear's matrix product.
//!
//! Each function here is what a model calls in place of the Burn ops it composes. On Burn's
//! Flex CPU backend, with or without autodiff, and in f32, it runs one fused kernel forward and
//! one backward written by hand (a [backend extension](ext::FusedOps)), where Burn's autodiff
//! would record the composition op by op (LayerNorm alone is nine ops forward; softmax five;
//! attention materialises and masks a `T × T` score matrix per head). Anywhere else — WGPU,
//! CUDA, another dtype, or with [`set_enabled`]`(false)` — it runs exactly the Burn ops the
//! models ran before, so a model stays backend-generic and a GPU run is untouched.
//!
//! The fused kernels equal the composed ops within 1e-5 relative (forward and every gradient,
//! `tests.rs`); they are not bit-identical to them, since sums run in another order (the
//! Linear's products are: the same `gemm` calls as Flex's matmul).

mod ext;
mod flex;
mod gated;
mod gemm;
mod kernels;
mod math;

use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::{Dispatch, DispatchDevice};
use burn::nn::pool::MaxPool2d;
use burn::nn::{Dropout, LayerNorm, PaddingConfig2d, Relu, RmsNorm};
use burn::prelude::*;
use burn::tensor::DType;

pub use ext::FusedOps;

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

/// The exact GELU, `x·Φ(x)`.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !fused_here(x.dtype(), &x.device()) {
        return burn::tensor::activation::gelu(x);
    }
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_gelu(x.into_dispatch()))
}

/// Mean cross-entropy of `logits` (`[rows, classes]`, any float dtype: computed in f32) against
/// the class ids `targets` (`[rows]`), shape `[1]`.
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

fn cross_entropy_composed(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    burn::nn::loss::CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, targets)
}

/// Causal self-attention of `q`, `k`, `v` (`[batch, heads, time, head_dim]`): position `t`
/// attends to `0..=t`, scores scaled by `1/√head_dim`, the weights passed through `dropout`
/// if there is one. The fused kernel runs where the dropout does nothing (probability 0, or no
/// training): it never forms the weights that dropout would act on.
pub fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    dropout: Option<&Dropout>,
) -> Tensor<4> {
    let device = q.device();
    let dropout_acts = dropout.is_some_and(|d| d.prob > 0.0 && device.is_autodiff());
    let dtypes = [q.dtype(), k.dtype(), v.dtype()];
    if dropout_acts || !dtypes.iter().all(|&d| fused_here(d, &device)) {
        return causal_attention_composed(q, k, v, dropout);
    }
    causal_attention_fused(q, k, v)
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
    dropout: Option<&Dropout>,
) -> Tensor<3> {
    let c3 = qkv.dims()[2];
    assert!(
        heads > 0 && c3.is_multiple_of(3 * heads),
        "packed attention: {c3} channels are not 3 × {heads} heads of one size"
    );
    let device = qkv.device();
    let dropout_acts = dropout.is_some_and(|d| d.prob > 0.0 && device.is_autodiff());
    if !dropout_acts && fused_here(qkv.dtype(), &device) {
        return Tensor::from_dispatch(<Dispatch as FusedOps>::fused_causal_attention_packed(
            qkv.into_dispatch(),
            heads,
        ));
    }
    packed_composed(qkv, heads, dropout)
}

/// The Burn ops that [`causal_attention_packed`] replaces: q, k and v sliced out of the
/// projection, attention, the heads put side by side again.
fn packed_composed(qkv: Tensor<3>, heads: usize, dropout: Option<&Dropout>) -> Tensor<3> {
    let [b, t, c3] = qkv.dims();
    let (c, d) = (c3 / 3, c3 / 3 / heads);
    let split = |i: usize| {
        qkv.clone()
            .slice([0..b, 0..t, i * c..(i + 1) * c])
            .reshape([b, t, heads, d])
            .swap_dims(1, 2)
    };
    causal_attention_composed(split(0), split(1), split(2), dropout)
        .swap_dims(1, 2)
        .reshape([b, t, c])
}

/// `x · weight + bias` over the rows of `x` (`[rows, in]`; `weight` `[in, out]` as Burn's
/// Linear keeps it): Burn's `linear`, fused on the CPU into one product that writes its
/// output's own buffer, the bias its starting value, with a backward of two products and a
/// column sum.
pub fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<2> {
    let f32_params =
        weight.dtype() == DType::F32 && bias.as_ref().is_none_or(|b| b.dtype() == DType::F32);
    if !(fused_here(x.dtype(), &x.device()) && f32_params) {
        return burn::tensor::module::linear(x, weight, bias);
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

fn causal_attention_fused(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
    ))
}

fn causal_attention_composed(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    dropout: Option<&Dropout>,
) -> Tensor<4> {
    let [b, h, t, d] = q.dims();
    let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f32).sqrt());
    let future = Tensor::<2, Bool>::tril_mask([t, t], 0, &scores.device())
        .reshape([1, 1, t, t])
        .expand([b, h, t, t]);
    let weights = burn::tensor::activation::softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
    match dropout {
        Some(dropout) => dropout.forward(weights),
        None => weights,
    }
    .matmul(v)
}

#[cfg(test)]
mod tests;
