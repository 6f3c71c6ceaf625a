//! The ConvNet's convolution and BatchNorm as CPU kernels on plain f32 slices (NCHW).
//!
//! A convolution of stride 1, no dilation, one group and zero padding the same on both sides
//! of each axis is one matrix product per image over the image's unfolded patches (im2col):
//! `y_b = W · col(x_b) + bias`, `[O, C·kh·kw] · [C·kh·kw, Ho·Wo]`, written straight into the
//! image's NCHW output with the bias as its starting value; backward, `dW += dy_b · col(x_b)ᵀ`,
//! `db += Σ dy_b` and `dx_b = fold(Wᵀ · dy_b)`, the patches unfolded again rather than kept.
//! A layer with many input channels unfolds along the width only instead (`conv_rows.rs`).
//! Burn's Flex unfolds the forward in NHWC tiles, computes the weight's gradient as a
//! convolution of the input by the output's gradient (a kernel the size of the image) and the
//! input's as a transposed convolution.
//!
//! BatchNorm in training: per channel, the batch mean and the biased variance (two passes,
//! summed in f64 across planes), then `y = x·s + t` with `s = γ/√(var + ε)`, `t = β − mean·s`;
//! backward, `dx = s·(dy − mean(dy) − x̂·mean(dy·x̂))`, `dγ = Σ dy·x̂`, `dβ = Σ dy`. Burn
//! composes the same as a dozen tensor ops, each a pass over the activations. BatchNorm's loops
//! are compiled for SSE2, AVX2 and AVX-512 ([`super::kernels`]' `versions!`); the unfold and
//! fold are copies and adds that the vector width does not speed.

use super::gemm::{self, Mat};
use super::kernels::{Level, level, versions};
use super::math;

/// The shape of a convolution the kernels take: `batch` images of `channels × height × width`,
/// `out_channels` filters of `kernel`, `padding` zeros on each side of each axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConvGeometry {
    pub(crate) batch: usize,
    pub(crate) channels: usize,
    pub(crate) height: usize,
    pub(crate) width: usize,
    pub(crate) out_channels: usize,
    pub(crate) kernel: [usize; 2],
    pub(crate) padding: [usize; 2],
}

impl ConvGeometry {
    /// The output's height and width.
    pub(crate) fn out_hw(&self) -> [usize; 2] {
        let [kh, kw] = self.kernel;
        let [ph, pw] = self.padding;
        [
            (self.height + 2 * ph + 1).saturating_sub(kh),
            (self.width + 2 * pw + 1).saturating_sub(kw),
        ]
    }

    /// Values in one image's patch: a row of the unfolded matrix.
    fn patch(&self) -> usize {
        self.channels * self.kernel[0] * self.kernel[1]
    }

    pub(super) fn image(&self) -> usize {
        self.channels * self.height * self.width
    }

    pub(super) fn out_plane(&self) -> usize {
        let [ho, wo] = self.out_hw();
        ho * wo
    }
}

/// Values copied at a time when unfolding: one AVX-512 register.
pub(super) const CHUNK: usize = 16;

thread_local! {
    /// Scratch buffers reused from call to call on a thread: the padded image and the unfolded
    /// patches (fresh ones per call would be zeroed, and their pages faulted in, every time).
    static SCRATCH: std::cell::RefCell<[Vec<f32>; 2]> = const {
        std::cell::RefCell::new([Vec::new(), Vec::new()])
    };
}

/// `f(padded image, patches)` with the thread's scratch buffers grown to `sizes` (their
/// contents left from the last call).
pub(super) fn with_scratch<R>(sizes: [usize; 2], f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    SCRATCH.with_borrow_mut(|[a, b]| {
        for (v, &n) in [&mut *a, &mut *b].into_iter().zip(&sizes) {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        }
        f(&mut a[..sizes[0]], &mut b[..sizes[1]])
    })
}

impl ConvGeometry {
    /// The padded image's height and width.
    pub(super) fn padded(&self) -> [usize; 2] {
        [
            self.height + 2 * self.padding[0],
            self.width + 2 * self.padding[1],
        ]
    }

    /// Values of a padded image buffer: `C·Hp·Wp`, and a chunk of slack for the last copy.
    pub(super) fn padded_len(&self) -> usize {
        let [hp, wp] = self.padded();
        self.channels * hp * wp + CHUNK
    }

    /// Values of a patches buffer: `C·kh·kw · Ho·Wo`, and a chunk of slack.
    fn patches_len(&self) -> usize {
        self.patch() * self.out_plane() + CHUNK
    }
}

/// `xp` (`[C, Hp, Wp]`, slack after) = one image `x` (`[C, H, W]`) with its zero border.
pub(super) fn pad(g: &ConvGeometry, x: &[f32], xp: &mut [f32]) {
    let [hp, wp] = g.padded();
    let [ph, pw] = g.padding;
    let (h, w) = (g.height, g.width);
    xp.fill(0.0);
    for ci in 0..g.channels {
        for r in 0..h {
            let at = ci * hp * wp + (r + ph) * wp + pw;
            xp[at..at + w].copy_from_slice(&x[(ci * h + r) * w..][..w]);
        }
    }
}

/// `col` (`[C·kh·kw, Ho·Wo]`, slack after) = the patches of a padded image `xp`: row
/// `(c, ki, kj)` holds `xp[c, oh + ki, ow + kj]` at `oh·Wo + ow`. Each output row is copied in
/// whole chunks, spilling into the next (which overwrites the spill) and into the slack.
fn unfold(g: &ConvGeometry, xp: &[f32], col: &mut [f32]) {
    let [kh, kw] = g.kernel;
    let [hp, wp] = g.padded();
    let [ho, wo] = g.out_hw();
    let n = ho * wo;
    let chunks = wo.div_ceil(CHUNK);
    for ci in 0..g.channels {
        for ki in 0..kh {
            for kj in 0..kw {
                let row = (ci * kh + ki) * kw + kj;
                for oh in 0..ho {
                    let src = ci * hp * wp + (oh + ki) * wp + kj;
                    let dst = row * n + oh * wo;
                    for q in 0..chunks {
                        let (s, d) = (src + q * CHUNK, dst + q * CHUNK);
                        let from: &[f32; CHUNK] = xp[s..s + CHUNK].try_into().unwrap();
                        col[d..d + CHUNK].copy_from_slice(from);
                    }
                }
            }
        }
    }
}

/// `dxp` (`[C, Hp, Wp]`, padded) += the patches' gradients `col` folded back onto the pixels
/// they were read from.
fn fold(g: &ConvGeometry, col: &[f32], dxp: &mut [f32]) {
    let [kh, kw] = g.kernel;
    let [hp, wp] = g.padded();
    let [ho, wo] = g.out_hw();
    let n = ho * wo;
    for ci in 0..g.channels {
        for ki in 0..kh {
            for kj in 0..kw {
                let row = (ci * kh + ki) * kw + kj;
                for oh in 0..ho {
                    let d = &mut dxp[ci * hp * wp + (oh + ki) * wp + kj..][..wo];
                    for (o, v) in d.iter_mut().zip(&col[row * n + oh * wo..][..wo]) {
                        *o += v;
                    }
                }
            }
        }
    }
}

/// One image's `dx` (`[C, H, W]`) = the inside of its padded gradient `dxp`.
pub(super) fn crop(g: &ConvGeometry, dxp: &[f32], dx: &mut [f32]) {
    let [hp, wp] = g.padded();
    let [ph, pw] = g.padding;
    let (h, w) = (g.height, g.width);
    for ci in 0..g.channels {
        for r in 0..h {
            let at = ci * hp * wp + (r + ph) * wp + pw;
            dx[(ci * h + r) * w..][..w].copy_from_slice(&dxp[at..at + w]);
        }
    }
}

/// The output buffer of `g`'s convolution, `[B, O, Ho·Wo]`, each plane starting at its output
/// channel's bias (zeros without one), for the products to add to.
pub(super) fn started(g: &ConvGeometry, bias: Option<&[f32]>) -> Vec<f32> {
    let (n, o) = (g.out_plane(), g.out_channels);
    let mut y = Vec::with_capacity(g.batch * o * n);
    for _ in 0..g.batch {
        match bias {
            Some(bias) => bias.iter().for_each(|&v| y.resize(y.len() + n, v)),
            None => y.resize(y.len() + o * n, 0.0),
        }
    }
    y
}

/// The bias's gradient: each output channel's `dy` summed over its planes, image by image.
pub(super) fn bias_grad(g: &ConvGeometry, dy: &[f32]) -> Vec<f32> {
    let (n, o) = (g.out_plane(), g.out_channels);
    let mut db = vec![0.0f32; o];
    for image in dy.chunks_exact(o * n) {
        for (s, plane) in db.iter_mut().zip(image.chunks_exact(n)) {
            *s += math::sum(plane);
        }
    }
    db
}

/// The convolution of `x` (`[B, C, H, W]`) by `w` (`[O, C, kh, kw]`), plus `bias` (`[O]`):
/// `[B, O, Ho, Wo]`.
pub(super) fn conv_forward(
    g: &ConvGeometry,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (k, n, o) = (g.patch(), g.out_plane(), g.out_channels);
    assert_eq!(x.len(), g.batch * g.image(), "conv input of {g:?}");
    assert_eq!(w.len(), o * k, "conv weight of {g:?}");
    let per_out = o * n;
    let mut y = started(g, bias);
    let weight = Mat::rows(w, 0, [o, k], k);
    with_scratch([g.padded_len(), g.patches_len()], |xp, col| {
        for b in 0..g.batch {
            pad(g, &x[b * g.image()..][..g.image()], xp);
            unfold(g, xp, col);
            let patches = Mat::rows(col, 0, [k, n], n);
            gemm::product_into(&mut y, b * per_out, n, weight, patches, bias.is_some());
        }
    });
    y
}

/// The convolution's gradients for `[x, w, bias]` given the output's `dy`, each computed only
/// where `want` asks for it.
pub(super) fn conv_backward(
    g: &ConvGeometry,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    want: [bool; 3],
) -> [Option<Vec<f32>>; 3] {
    let (k, n, o) = (g.patch(), g.out_plane(), g.out_channels);
    let per_out = o * n;
    assert_eq!(dy.len(), g.batch * per_out, "conv output gradient of {g:?}");
    let mut dx = want[0].then(|| vec![0.0f32; g.batch * g.image()]);
    let mut dw = want[1].then(|| vec![0.0f32; o * k]);
    let db = want[2].then(|| bias_grad(g, dy));
    let weight_t = Mat::rows(w, 0, [o, k], k).t();
    with_scratch([g.padded_len(), g.patches_len()], |xp, col| {
        for b in 0..g.batch {
            let dy_b = Mat::rows(dy, b * per_out, [o, n], n);
            if let Some(dw) = &mut dw {
                pad(g, &x[b * g.image()..][..g.image()], xp);
                unfold(g, xp, col);
                let patches_t = Mat::rows(col, 0, [k, n], n).t();
                gemm::product_into(dw, 0, k, dy_b, patches_t, b > 0);
            }
            if let Some(dx) = &mut dx {
                gemm::product_into(col, 0, n, weight_t, dy_b, false);
                xp.fill(0.0);
                fold(g, col, xp);
                crop(g, xp, &mut dx[b * g.image()..][..g.image()]);
            }
        }
    });
    [dx, dw, db]
}

/// `Σ (x − m)·(y − m')` over a plane, in [`math`]'s 16 partial sums (`y = None`: `Σ (x − m)²`).
#[inline(always)]
fn centered_dot(x: &[f32], m: f32, y: Option<(&[f32], f32)>) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let mut tail = 0.0f32;
    match y {
        None => {
            let chunks = x.chunks_exact(LANES);
            tail += chunks
                .remainder()
                .iter()
                .map(|v| (v - m) * (v - m))
                .sum::<f32>();
            for c in chunks {
                for l in 0..LANES {
                    acc[l] += (c[l] - m) * (c[l] - m);
                }
            }
        }
        Some((y, m2)) => {
            let (cx, cy) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
            tail += cx
                .remainder()
                .iter()
                .zip(cy.remainder())
                .map(|(a, b)| (a - m) * (b - m2))
                .sum::<f32>();
            for (a, b) in cx.zip(cy) {
                for l in 0..LANES {
                    acc[l] += (a[l] - m) * (b[l] - m2);
                }
            }
        }
    }
    acc.iter().sum::<f32>() + tail
}

versions! {
/// Per channel of `x` (`[B, C, S]`, `S` the values of a plane): `Σ (x − center)`, or with
/// `squared` `Σ (x − center)²`, each plane summed in f32 and the planes in f64.
pub(crate) fn channel_sums(
    x: &[f32],
    dims: [usize; 3],
    center: &[f32],
    squared: bool,
) -> Vec<f64> {
    let [b, c, s] = dims;
    assert_eq!(x.len(), b * c * s, "channel sums of [{b}, {c}, {s}]");
    (0..c)
        .map(|ci| {
            let m = center[ci];
            (0..b)
                .map(|bi| {
                    let plane = &x[(bi * c + ci) * s..][..s];
                    if squared {
                        centered_dot(plane, m, None) as f64
                    } else {
                        math::sum(plane) as f64 - m as f64 * s as f64
                    }
                })
                .sum()
        })
        .collect()
}

/// `y = (x − mean)·γ/√(var + ε) + β` per channel of `x` (`[B, C, S]`).
pub(crate) fn batch_norm_apply(
    x: &[f32],
    dims: [usize; 3],
    gamma: &[f32],
    beta: &[f32],
    stats: (&[f32], &[f32]),
    eps: f32,
    y: &mut [f32],
) {
    let ([b, c, s], (mean, var)) = (dims, stats);
    for ci in 0..c {
        let scale = gamma[ci] / (var[ci] + eps).sqrt();
        let shift = beta[ci] - mean[ci] * scale;
        for bi in 0..b {
            let at = (bi * c + ci) * s;
            for (o, &v) in y[at..at + s].iter_mut().zip(&x[at..at + s]) {
                *o = v * scale + shift;
            }
        }
    }
}
}

/// BatchNorm in training over `x` (`[B, C, S]`): fills `y`, each channel's `mean` and biased
/// `var` (two passes).
#[allow(clippy::too_many_arguments)]
pub(super) fn batch_norm_forward(
    x: &[f32],
    dims: [usize; 3],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
    y: &mut [f32],
    mean: &mut [f32],
    var: &mut [f32],
) {
    let [b, c, s] = dims;
    let count = (b * s) as f64;
    let zeros = vec![0.0f32; c];
    for (m, total) in mean.iter_mut().zip(channel_sums(x, dims, &zeros, false)) {
        *m = (total / count) as f32;
    }
    for (v, squares) in var.iter_mut().zip(channel_sums(x, dims, mean, true)) {
        *v = (squares / count) as f32;
    }
    batch_norm_apply(x, dims, gamma, beta, (mean, var), eps, y);
}

versions! {
/// Per channel, `(Σ dy, Σ dy·(x − mean))`.
pub(crate) fn grad_sums(x: &[f32], dims: [usize; 3], mean: &[f32], dy: &[f32]) -> Vec<(f64, f64)> {
    let [b, c, s] = dims;
    (0..c)
        .map(|ci| {
            (0..b).fold((0.0f64, 0.0f64), |(s1, s2), bi| {
                let at = (bi * c + ci) * s;
                let d = &dy[at..at + s];
                let xc = centered_dot(&x[at..at + s], mean[ci], Some((d, 0.0)));
                (s1 + math::sum(d) as f64, s2 + xc as f64)
            })
        })
        .collect()
}

/// `dx = dy·a + (x − mean)·k + t` per channel (`a`, `k`, `t` per channel).
pub(crate) fn channel_affine_grad(
    x: &[f32],
    dims: [usize; 3],
    mean: &[f32],
    dy: &[f32],
    per_channel: impl Fn(usize) -> (f32, f32, f32),
    dx: &mut [f32],
) {
    let [b, c, s] = dims;
    for (ci, &m) in mean.iter().enumerate().take(c) {
        let (a, k, t) = per_channel(ci);
        for bi in 0..b {
            let at = (bi * c + ci) * s;
            let rows = dx[at..at + s].iter_mut().zip(&dy[at..at + s]);
            for ((o, &d), &v) in rows.zip(&x[at..at + s]) {
                *o = d * a + (v - m) * k + t;
            }
        }
    }
}
}

/// Each channel's `1/√(var + ε)`.
fn inverse_std(var: &[f32], eps: f32) -> Vec<f32> {
    var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect()
}

/// BatchNorm's backward where the statistics were the batch's own (computed from `x`): `dx`
/// (when wanted) and each channel's `dgamma` and `dbeta`:
/// `dx = s·(dy − mean(dy) − x̂·mean(dy·x̂))`, `s = γ/√(var + ε)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn batch_norm_backward(
    x: &[f32],
    dims: [usize; 3],
    gamma: &[f32],
    (mean, var): (&[f32], &[f32]),
    eps: f32,
    dy: &[f32],
    dx: Option<&mut [f32]>,
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let [b, _, s] = dims;
    let count = (b * s) as f64;
    let (sums, inv) = (grad_sums(x, dims, mean, dy), inverse_std(var, eps));
    for (ci, &(s1, s2)) in sums.iter().enumerate() {
        // Σ dy·x̂ = inv · Σ dy·(x − mean).
        (dbeta[ci], dgamma[ci]) = (s1 as f32, (s2 * inv[ci] as f64) as f32);
    }
    if let Some(dx) = dx {
        let per_channel = |ci: usize| {
            let (s1, s2) = sums[ci];
            let scale = gamma[ci] * inv[ci];
            // x̂·mean(dy·x̂) = (x − mean)·inv²·Σ dy·(x − mean)/N.
            let k = (s2 / count) as f32 * inv[ci] * inv[ci];
            (scale, -scale * k, -scale * (s1 / count) as f32)
        };
        channel_affine_grad(x, dims, mean, dy, per_channel, dx);
    }
}

/// The backward of [`batch_norm_apply`] with the statistics as inputs of their own:
/// `dx = dy·γ·inv` (when wanted) and per channel `[dγ, dβ, dmean, dvar]` =
/// `[inv·S₂, S₁, −γ·inv·S₁, −½·γ·inv³·S₂]`, `S₁ = Σ dy`, `S₂ = Σ dy·(x − mean)`,
/// `inv = 1/√(var + ε)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn batch_norm_stats_backward(
    x: &[f32],
    dims: [usize; 3],
    gamma: &[f32],
    (mean, var): (&[f32], &[f32]),
    eps: f32,
    dy: &[f32],
    dx: Option<&mut [f32]>,
) -> [Vec<f32>; 4] {
    let (sums, inv) = (grad_sums(x, dims, mean, dy), inverse_std(var, eps));
    let mut out: [Vec<f32>; 4] = std::array::from_fn(|_| Vec::with_capacity(sums.len()));
    for (ci, &(s1, s2)) in sums.iter().enumerate() {
        let (g, i) = (gamma[ci] as f64, inv[ci] as f64);
        out[0].push((i * s2) as f32);
        out[1].push(s1 as f32);
        out[2].push((-g * i * s1) as f32);
        out[3].push((-0.5 * g * i * i * i * s2) as f32);
    }
    if let Some(dx) = dx {
        let per_channel = |ci: usize| (gamma[ci] * inv[ci], 0.0, 0.0);
        channel_affine_grad(x, dims, mean, dy, per_channel, dx);
    }
    out
}
