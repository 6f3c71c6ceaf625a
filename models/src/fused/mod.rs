//! The transformer's hot operations as single CPU kernels: LayerNorm, the exact GELU,
//! softmax cross-entropy and causal attention.
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
//! the tests below); they are not bit-identical to them, since sums run in another order.

mod ext;
mod kernels;
mod math;

use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::{Dispatch, DispatchDevice};
use burn::nn::{Dropout, LayerNorm};
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
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::{DropoutConfig, LayerNormConfig};
    use burn::tensor::{Gradients, TensorData};

    /// Numbers in [-2, 2) from a fixed sequence (the tests repeat exactly).
    fn numbers(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn leaf<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
        spread(shape, seed, 1.0, 0.0, device)
    }

    /// A leaf of `numbers·scale + shift`.
    fn spread<const D: usize>(
        shape: [usize; D],
        seed: u64,
        scale: f32,
        shift: f32,
        device: &Device,
    ) -> Tensor<D> {
        let n = shape.iter().product();
        let v = numbers(n, seed)
            .into_iter()
            .map(|x| x * scale + shift)
            .collect();
        Tensor::<D>::from_data(TensorData::new(v, shape), device).require_grad()
    }

    fn values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
        t.to_data().try_to_vec::<f32>().unwrap()
    }

    /// `max|a - b| ≤ tol·max|b|`: the difference against the tensor's own scale.
    fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
        let diff = a
            .iter()
            .zip(b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= tol * scale,
            "{what}: max difference {diff:e} against scale {scale:e}"
        );
        assert!(a.iter().all(|v| v.is_finite()), "{what}: not finite");
    }

    /// The output and the gradient of `Σ output·w` (w fixed, not all ones) for each input.
    fn run<const D: usize, const E: usize>(
        inputs: &[Tensor<D>],
        f: impl Fn(Vec<Tensor<D>>) -> Tensor<E>,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let out = f(inputs.to_vec());
        let w = Tensor::<E>::from_data(
            TensorData::new(numbers(out.shape().num_elements(), 99), out.shape()),
            &out.device(),
        );
        let grads: Gradients = (out.clone() * w).sum().backward();
        let grads = inputs
            .iter()
            .map(|x| values(&x.grad(&grads).expect("a gradient")))
            .collect();
        (values(&out), grads)
    }

    fn assert_same<const D: usize, const E: usize>(
        what: &str,
        inputs: &[Tensor<D>],
        fused: impl Fn(Vec<Tensor<D>>) -> Tensor<E>,
        composed: impl Fn(Vec<Tensor<D>>) -> Tensor<E>,
    ) {
        let (y1, g1) = run(inputs, fused);
        let (y2, g2) = run(inputs, composed);
        assert_close(&format!("{what} forward"), &y1, &y2, 1e-5);
        for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
            assert_close(&format!("{what} gradient {i}"), a, b, 1e-5);
        }
    }

    #[test]
    fn layer_norm_equals_burns_forward_and_backward() {
        let device = Device::flex().autodiff();
        for (rows, c, bias) in [
            (1, 1, true),
            (3, 7, false),
            (5, 33, true),
            (24 * 64, 128, false),
        ] {
            let mut norm = LayerNormConfig::new(c).with_bias(bias).init(&device);
            norm.gamma = Param::from_tensor(spread([c], 3, 0.5, 1.0, &device));
            if bias {
                norm.beta = Some(Param::from_tensor(spread([c], 4, 0.5, 0.0, &device)));
            }
            let x = leaf([rows, 2, c], 5, &device);
            let gamma = norm.gamma.val();
            let beta = norm.beta.as_ref().map(|b| b.val());
            let what = format!("LayerNorm rows {rows} × {c}, bias {bias}");
            let fused = |v: Vec<Tensor<3>>| {
                layer_norm_fused(v[0].clone(), gamma.clone(), beta.clone(), 1e-5)
            };
            let composed = |v: Vec<Tensor<3>>| norm.forward(v[0].clone());
            let (y1, g1) = run(std::slice::from_ref(&x), fused);
            let (y2, g2) = run(std::slice::from_ref(&x), composed);
            assert_close(&format!("{what} forward"), &y1, &y2, 1e-5);
            assert_close(&format!("{what} dx"), &g1[0], &g2[0], 1e-5);
            // dgamma, dbeta: gradients of the parameters themselves.
            let param_grads = |fused: bool| {
                let out = if fused {
                    layer_norm_fused(x.clone(), gamma.clone(), beta.clone(), 1e-5)
                } else {
                    norm.forward(x.clone())
                };
                let w = Tensor::<3>::from_data(
                    TensorData::new(numbers(out.shape().num_elements(), 7), out.shape()),
                    &device,
                );
                let grads = (out * w).sum().backward();
                let g = values(&norm.gamma.grad(&grads).unwrap());
                let b = norm.beta.as_ref().map(|b| values(&b.grad(&grads).unwrap()));
                (g, b)
            };
            let (fg, fb) = param_grads(true);
            let (cg, cb) = param_grads(false);
            assert_close(&format!("{what} dgamma"), &fg, &cg, 1e-5);
            if let (Some(fb), Some(cb)) = (fb, cb) {
                assert_close(&format!("{what} dbeta"), &fb, &cb, 1e-5);
            }
        }
    }

    #[test]
    fn gelu_equals_burns_forward_and_backward() {
        let device = Device::flex().autodiff();
        for shape in [[1, 1], [7, 13], [64, 512]] {
            // Spread to ±6 to reach both tails.
            let x = spread(shape, 11, 3.0, 0.0, &device);
            assert_same(
                &format!("GELU {shape:?}"),
                &[x],
                |v| gelu(v[0].clone()),
                |v| burn::tensor::activation::gelu(v[0].clone()),
            );
        }
    }

    #[test]
    fn cross_entropy_equals_burns_forward_and_backward() {
        let device = Device::flex().autodiff();
        for (n, v) in [(1, 2), (37, 65), (24 * 64, 97), (5, 50_257)] {
            let logits = spread([n, v], 21, 4.0, 0.0, &device);
            let ids: Vec<i64> = (0..n).map(|i| ((i * 7919 + 13) % v) as i64).collect();
            let targets = Tensor::<1, Int>::from_data(TensorData::new(ids, [n]), &device);
            assert_same(
                &format!("cross-entropy {n} × {v}"),
                &[logits],
                |x| cross_entropy(x[0].clone(), targets.clone()),
                |x| cross_entropy_composed(x[0].clone(), targets.clone()),
            );
        }
    }

    #[test]
    fn causal_attention_equals_burns_forward_and_backward() {
        let device = Device::flex().autodiff();
        let off = DropoutConfig::new(0.0).init();
        // T = 1 (only itself), T not a multiple of any tile, D odd, the GPT recipe's shape,
        // and T over three of the backward's key blocks of 64 (the last one partial).
        for [b, h, t, d] in [
            [1, 1, 1, 4],
            [2, 3, 5, 7],
            [2, 2, 37, 16],
            [24, 4, 64, 32],
            [1, 2, 150, 8],
        ] {
            let c = h * d;
            // q, k, v as the models make them: strided views of one [B, T, 3C] projection.
            let qkv = leaf([b, t, 3 * c], 31, &device);
            let split = |x: &Tensor<3>, i: usize| {
                x.clone()
                    .slice([0..b, 0..t, i * c..(i + 1) * c])
                    .reshape([b, t, h, d])
                    .swap_dims(1, 2)
            };
            let what = format!("attention {:?}", [b, h, t, d]);
            assert_same(
                &what,
                std::slice::from_ref(&qkv),
                |x| causal_attention_fused(split(&x[0], 0), split(&x[0], 1), split(&x[0], 2)),
                |x| {
                    causal_attention_composed(
                        split(&x[0], 0),
                        split(&x[0], 1),
                        split(&x[0], 2),
                        Some(&off),
                    )
                },
            );
            // And contiguous inputs of their own.
            let (q, k, v) = (
                leaf([b, h, t, d], 41, &device),
                leaf([b, h, t, d], 42, &device),
                leaf([b, h, t, d], 43, &device),
            );
            assert_same(
                &format!("{what}, contiguous"),
                &[q, k, v],
                |x| causal_attention_fused(x[0].clone(), x[1].clone(), x[2].clone()),
                |x| causal_attention_composed(x[0].clone(), x[1].clone(), x[2].clone(), Some(&off)),
            );
        }
    }

    #[test]
    fn without_autodiff_the_kernels_give_the_same_outputs() {
        let device = Device::flex();
        let x = Tensor::<2>::from_data(TensorData::new(numbers(6 * 40, 8), [6, 40]), &device);
        assert_close(
            "GELU",
            &values(&gelu(x.clone())),
            &values(&burn::tensor::activation::gelu(x.clone())),
            1e-5,
        );
        let norm = LayerNormConfig::new(40).init(&device);
        assert_close(
            "LayerNorm",
            &values(&layer_norm(&norm, 1e-5, x.clone())),
            &values(&norm.forward(x.clone())),
            1e-5,
        );
        let q = x.reshape([1, 2, 3, 40]);
        let off = DropoutConfig::new(0.0).init();
        assert_close(
            "attention",
            &values(&causal_attention(
                q.clone(),
                q.clone(),
                q.clone(),
                Some(&off),
            )),
            &values(&causal_attention_composed(q.clone(), q.clone(), q, None)),
            1e-5,
        );
    }

    #[test]
    fn other_dtypes_and_live_dropout_take_burns_ops() {
        let device = Device::flex().autodiff();
        let x = leaf([4, 8], 1, &device);
        // bf16: the fused kernels take f32 only, so Burn's GELU runs (and gives bf16).
        let y = gelu(x.clone().cast(burn::tensor::FloatDType::BF16));
        assert_eq!(y.dtype(), DType::BF16);
        // Dropout that acts in training: the composed path, which draws the mask.
        let live = DropoutConfig::new(0.5).init();
        let q = leaf([1, 1, 4, 8], 2, &device);
        let a = causal_attention(q.clone(), q.clone(), q.clone(), Some(&live));
        let b = causal_attention_fused(q.clone(), q.clone(), q);
        assert_ne!(values(&a), values(&b), "dropout at 0.5 changed nothing");
    }
}
