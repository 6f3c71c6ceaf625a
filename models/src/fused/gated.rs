//! Element-wise operations as one pass each, forward and backward, on plain f32 slices (the
//! loops vectorise as the compiler finds, each compiled for SSE2, AVX2 and AVX-512 by
//! [`super::kernels`]' `versions!`; the sums and `exp` are [`super::math`]'s): the Llama
//! family's RMSNorm over the last dimension and SwiGLU's gate `silu(gate) · up`, and the
//! ConvNet's ReLU with 2×2 max-pooling. Burn composes RMSNorm of six ops forward (square, mean,
//! add, sqrt, divide, scale) and the gate of three, each a pass over the activations with a
//! buffer of its own, and autodiff keeps what each needs; its pooling goes through a 3-d
//! pooling with indices.

use super::kernels::{Level, level, versions};
use super::math;

/// The logistic function, with [`math::exp`] (which vectorises; std's is a call).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + math::exp(-x))
}

versions! {
/// RMSNorm of the rows of `x` (width `c`): `y = x · r · gamma`, `r = 1/√(mean(x²) + eps)`,
/// each row's `r` written to `inv` for the backward.
pub(crate) fn rms_norm_forward(
    x: &[f32],
    c: usize,
    gamma: &[f32],
    eps: f32,
    y: &mut [f32],
    inv: &mut [f32],
) {
    for ((xr, yr), r) in x.chunks_exact(c).zip(y.chunks_exact_mut(c)).zip(inv) {
        *r = 1.0 / (math::dot(xr, xr) / c as f32 + eps).sqrt();
        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(gamma) {
            *o = v * *r * g;
        }
    }
}

/// RMSNorm's backward: with `g = dy · gamma`, `dx = r·g − x·r³·(Σ g·x)/c` and
/// `dgamma = Σ_rows dy·x·r` (added into `dgamma`).
pub(crate) fn rms_norm_backward(
    x: &[f32],
    c: usize,
    gamma: &[f32],
    inv: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
) {
    let rows = x.chunks_exact(c).zip(dy.chunks_exact(c));
    for (((xr, dyr), dxr), &r) in rows.zip(dx.chunks_exact_mut(c)).zip(inv) {
        // dx = dy·gamma for now, then r·dx − x·k.
        for ((o, &d), &g) in dxr.iter_mut().zip(dyr).zip(gamma) {
            *o = d * g;
        }
        let k = r * r * r * math::dot(dxr, xr) / c as f32;
        for (((o, &d), &v), dg) in dxr.iter_mut().zip(dyr).zip(xr).zip(&mut *dgamma) {
            *o = r * *o - v * k;
            *dg += d * v * r;
        }
    }
}

/// `y = silu(gate) · up = gate · σ(gate) · up`.
pub(crate) fn swiglu_forward(gate: &[f32], up: &[f32], y: &mut [f32]) {
    for ((o, &g), &u) in y.iter_mut().zip(gate).zip(up) {
        *o = g * sigmoid(g) * u;
    }
}

/// The gate's backward: `dgate = dy · up · σ(g)·(1 + g·(1 − σ(g)))`, `dup = dy · g·σ(g)`.
pub(crate) fn swiglu_backward(
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
    dgate: &mut [f32],
    dup: &mut [f32],
) {
    let inputs = gate.iter().zip(up).zip(dy);
    for (((&g, &u), &d), (dg, du)) in inputs.zip(dgate.iter_mut().zip(dup.iter_mut())) {
        let s = sigmoid(g);
        *dg = d * u * s * (1.0 + g * (1.0 - s));
        *du = d * g * s;
    }
}

/// ReLU then 2×2 max-pooling of stride 2 (no padding: a last odd row or column is left out)
/// over `planes` planes of `h × w`: `y = max(0, max of the window)`, and for each output the
/// window's element that gave it (0..4, row-major; 4 where the ReLU gave zero), for the
/// backward. ReLU and the max commute, so one pass does both.
pub(crate) fn relu_max_pool2_forward(
    x: &[f32],
    planes: usize,
    hw: [usize; 2],
    y: &mut [f32],
    arg: &mut [u8],
) {
    let [h, w] = hw;
    let (oh, ow) = (h / 2, w / 2);
    for p in 0..planes {
        let plane = &x[p * h * w..(p + 1) * h * w];
        for i in 0..oh {
            let top = &plane[2 * i * w..][..2 * ow];
            let bottom = &plane[(2 * i + 1) * w..][..2 * ow];
            let at = p * oh * ow + i * ow;
            let (yr, ar) = (&mut y[at..at + ow], &mut arg[at..at + ow]);
            // Selects, not branches, so that the loop vectorises; the first largest wins, as
            // Burn's pooling picks it.
            for j in 0..ow {
                let (a, b, c, d) = (top[2 * j], top[2 * j + 1], bottom[2 * j], bottom[2 * j + 1]);
                let (m, k) = if b > a { (b, 1u8) } else { (a, 0u8) };
                let (m, k) = if c > m { (c, 2u8) } else { (m, k) };
                let (m, k) = if d > m { (d, 3u8) } else { (m, k) };
                let on = m > 0.0;
                yr[j] = if on { m } else { 0.0 };
                ar[j] = if on { k } else { 4 };
            }
        }
    }
}

/// Its backward: each output's gradient to the element that gave it (none where the ReLU gave
/// zero); `dx` starts at zero.
pub(crate) fn relu_max_pool2_backward(
    dy: &[f32],
    arg: &[u8],
    planes: usize,
    hw: [usize; 2],
    dx: &mut [f32],
) {
    let [h, w] = hw;
    let (oh, ow) = (h / 2, w / 2);
    for p in 0..planes {
        for i in 0..oh {
            for j in 0..ow {
                let at = p * oh * ow + i * ow + j;
                let k = arg[at] as usize;
                if k < 4 {
                    let (r, c) = (2 * i + k / 2, 2 * j + k % 2);
                    dx[p * h * w + r * w + c] = dy[at];
                }
            }
        }
    }
}
}
