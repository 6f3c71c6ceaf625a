//! A convolution unfolded along the width only, for layers with many input channels: the
//! padded image's rows become `C·kw` rows of `Hp·Wo` values (`xw[(c, kj), r·Wo + ow] =
//! xp[c, r, ow + kj]`), and the output is `kh` products, one per kernel row `ki`, of that
//! kernel row's weights (`[O, C·kw]`) by the unfolded rows shifted down by `ki` output rows:
//! `kh` times fewer values copied than whole patches, the same multiply-adds.

use super::conv::{CHUNK, ConvGeometry, bias_grad, crop, pad, started, with_scratch};
use super::gemm::{self, Mat};

/// Whether a convolution takes this path: a kernel of several rows over enough channels that
/// a kernel row's product (`C·kw` deep) keeps the matrix units busy.
pub(super) fn fits(g: &ConvGeometry) -> bool {
    g.kernel[0] > 1 && g.channels * g.kernel[1] >= 32
}

/// `[C·kw, Hp·Wo]` values, and a chunk of slack for the last copy.
fn rows_len(g: &ConvGeometry) -> usize {
    let [hp, _] = g.padded();
    let [_, wo] = g.out_hw();
    g.channels * g.kernel[1] * hp * wo + CHUNK
}

/// The weights by kernel row: `[kh][O][C·kw]`.
fn by_kernel_row(g: &ConvGeometry, w: &[f32]) -> Vec<f32> {
    let ([kh, kw], c, o) = (g.kernel, g.channels, g.out_channels);
    let mut wr = Vec::with_capacity(w.len());
    for ki in 0..kh {
        for oi in 0..o {
            for ci in 0..c {
                wr.extend_from_slice(&w[((oi * c + ci) * kh + ki) * kw..][..kw]);
            }
        }
    }
    wr
}

/// `xw` = the padded image `xp` unfolded along the width, each output row copied in whole
/// chunks (spilling into the next, which overwrites the spill, and into the slack).
fn unfold_rows(g: &ConvGeometry, xp: &[f32], xw: &mut [f32]) {
    let kw = g.kernel[1];
    let [hp, wp] = g.padded();
    let [_, wo] = g.out_hw();
    let chunks = wo.div_ceil(CHUNK);
    for ci in 0..g.channels {
        for kj in 0..kw {
            let row = ci * kw + kj;
            for r in 0..hp {
                let (src, dst) = (ci * hp * wp + r * wp + kj, (row * hp + r) * wo);
                for q in 0..chunks {
                    let (s, d) = (src + q * CHUNK, dst + q * CHUNK);
                    let from: &[f32; CHUNK] = xp[s..s + CHUNK].try_into().unwrap();
                    xw[d..d + CHUNK].copy_from_slice(from);
                }
            }
        }
    }
}

/// `dxp` (padded) += the unfolded rows' gradients `dxw` put back where they were read from.
fn fold_rows(g: &ConvGeometry, dxw: &[f32], dxp: &mut [f32]) {
    let kw = g.kernel[1];
    let [hp, wp] = g.padded();
    let [_, wo] = g.out_hw();
    for ci in 0..g.channels {
        for kj in 0..kw {
            let row = ci * kw + kj;
            for r in 0..hp {
                let d = &mut dxp[ci * hp * wp + r * wp + kj..][..wo];
                for (o, v) in d.iter_mut().zip(&dxw[(row * hp + r) * wo..][..wo]) {
                    *o += v;
                }
            }
        }
    }
}

/// Kernel row `ki`'s weights, `[O, C·kw]`, and the unfolded rows it multiplies, `[C·kw,
/// Ho·Wo]` (a row every `Hp·Wo` values, from `ki·Wo`).
fn operands<'a>(g: &ConvGeometry, wr: &'a [f32], xw: &'a [f32], ki: usize) -> (Mat<'a>, Mat<'a>) {
    let (ckw, o) = (g.channels * g.kernel[1], g.out_channels);
    let [hp, _] = g.padded();
    let [_, wo] = g.out_hw();
    let weights = Mat::rows(wr, ki * o * ckw, [o, ckw], ckw);
    let rows = Mat::rows(xw, ki * wo, [ckw, g.out_plane()], hp * wo);
    (weights, rows)
}

/// As [`super::conv::conv_forward`] (the caller picks by [`fits`]).
pub(super) fn forward(g: &ConvGeometry, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    let (n, o) = (g.out_plane(), g.out_channels);
    let per_out = o * n;
    let wr = by_kernel_row(g, w);
    let mut y = started(g, bias);
    with_scratch([g.padded_len(), rows_len(g)], |xp, xw| {
        for b in 0..g.batch {
            pad(g, &x[b * g.image()..][..g.image()], xp);
            unfold_rows(g, xp, xw);
            for ki in 0..g.kernel[0] {
                let (weights, rows) = operands(g, &wr, xw, ki);
                gemm::product_into(&mut y, b * per_out, n, weights, rows, true);
            }
        }
    });
    y
}

/// As [`super::conv::conv_backward`] (the caller picks by [`fits`]).
pub(super) fn backward(
    g: &ConvGeometry,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    want: [bool; 3],
) -> [Option<Vec<f32>>; 3] {
    let ([kh, kw], c, o) = (g.kernel, g.channels, g.out_channels);
    let (n, ckw) = (g.out_plane(), c * kw);
    let [hp, _] = g.padded();
    let [_, wo] = g.out_hw();
    let per_out = o * n;
    let wr = by_kernel_row(g, w);
    let mut dx = want[0].then(|| vec![0.0f32; g.batch * g.image()]);
    let mut dwr = want[1].then(|| vec![0.0f32; kh * o * ckw]);
    let db = want[2].then(|| bias_grad(g, dy));
    with_scratch([g.padded_len(), rows_len(g)], |xp, xw| {
        for b in 0..g.batch {
            let dy_b = Mat::rows(dy, b * per_out, [o, n], n);
            if let Some(dwr) = &mut dwr {
                pad(g, &x[b * g.image()..][..g.image()], xp);
                unfold_rows(g, xp, xw);
                for ki in 0..kh {
                    let (_, rows) = operands(g, &wr, xw, ki);
                    gemm::product_into(dwr, ki * o * ckw, ckw, dy_b, rows.t(), b > 0);
                }
            }
            if let Some(dx) = &mut dx {
                // The unfolded rows' gradients, in the same buffer (the weights' products
                // above are done with it).
                xw.fill(0.0);
                for ki in 0..kh {
                    let weights = Mat::rows(&wr, ki * o * ckw, [o, ckw], ckw);
                    gemm::product_into(xw, ki * wo, hp * wo, weights.t(), dy_b, true);
                }
                xp.fill(0.0);
                fold_rows(g, xw, xp);
                crop(g, xp, &mut dx[b * g.image()..][..g.image()]);
            }
        }
    });
    // The weights' gradient back in `[O, C, kh, kw]`.
    let dw = dwr.map(|dwr| {
        let mut dw = vec![0.0f32; o * c * kh * kw];
        for ki in 0..kh {
            for oi in 0..o {
                for ci in 0..c {
                    let from = &dwr[(ki * o + oi) * ckw + ci * kw..][..kw];
                    dw[((oi * c + ci) * kh + ki) * kw..][..kw].copy_from_slice(from);
                }
            }
        }
        dw
    });
    [dx, dw, db]
}
