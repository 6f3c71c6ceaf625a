//! The fused kernels on plain `f32` slices: no Burn type in sight, so that each is a loop that
//! reads its inputs once and writes its outputs once.
//!
//! Vectorisation without `unsafe` intrinsics: every loop is written so that the compiler can
//! vectorise it without reordering a floating-point sum — element-wise loops, and reductions
//! kept in [`LANES`] independent partial sums (each lane a plain scalar chain, summed at the
//! end). Each public kernel is compiled three times by [`versions!`]: for the baseline x86-64
//! (SSE2), for AVX2 + FMA and for AVX-512F; the widest one the CPU has is picked at run time,
//! so the same binary runs on any x86-64 (and elsewhere the plain version runs).
//!
//! The element-wise functions and reductions they share are in [`super::math`]; attention's
//! matrix products (scores, weighted sums and their gradients, by blocks of query rows) go
//! through [`super::gemm`], the `gemm` crate that Burn's own matmul calls.

use super::gemm::{self, Mat};
use super::math::{dot, exp, exp_shifted, max, normal_cdf_pdf, sum};

/// Generates, for each kernel `fn name(args) -> R { body }`, the plain version and the AVX2 and
/// AVX-512 ones, and `name` itself picking among them by what the CPU reports (cached by std).
macro_rules! versions {
    ($(
        $(#[$meta:meta])*
        pub(crate) fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    )*) => {$(
        $(#[$meta])*
        // A kernel's arguments are its buffers and their shapes, each used once.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn plain($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx512($($arg: $ty),*) $(-> $ret)? { plain($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx2($($arg: $ty),*) $(-> $ret)? { plain($($arg),*) }
                match level() {
                    // SAFETY: the CPU reported the features each version was compiled for.
                    Level::Avx512 => return unsafe { avx512($($arg),*) },
                    Level::Avx2 => return unsafe { avx2($($arg),*) },
                    Level::Plain => {}
                }
            }
            plain($($arg),*)
        }
    )*};
}

// The macro, for the kernels of the other files (`gated.rs`, `conv.rs`).
pub(crate) use versions;

/// The vector instructions a kernel runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// The baseline of the target (SSE2 on x86-64).
    Plain,
    /// AVX2 and FMA.
    Avx2,
    /// AVX-512F (with AVX2 and FMA).
    Avx512,
}

/// Set by tests to force a narrower level than the CPU's (0: the CPU's own).
static FORCED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The widest level this CPU runs, or the one [`force_level`] set.
pub(crate) fn level() -> Level {
    match FORCED.load(std::sync::atomic::Ordering::Relaxed) {
        1 => return Level::Plain,
        2 => return Level::Avx2,
        3 => return Level::Avx512,
        _ => {}
    }
    cpu_level()
}

/// The widest level the CPU reports.
pub(crate) fn cpu_level() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Level::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Level::Avx2;
        }
    }
    Level::Plain
}

/// Makes every kernel run at `level` (at most the CPU's; `None`: the CPU's own again). For
/// tests that compare the versions.
#[cfg(test)]
pub(crate) fn force_level(level: Option<Level>) {
    let code = match level {
        None => 0,
        Some(Level::Plain) => 1,
        Some(Level::Avx2) => 2,
        Some(Level::Avx512) => 3,
    };
    FORCED.store(code, std::sync::atomic::Ordering::Relaxed);
}

/// A strided 4-d view `[B, H, T, D]` of a buffer: element `(b, h, t, d)` at
/// `offset + b·s[0] + h·s[1] + t·s[2] + d·s[3]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct View4<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub strides: [isize; 4],
}

impl View4<'_> {
    #[inline(always)]
    fn at(&self, b: usize, h: usize, t: usize, d: usize) -> f32 {
        let i = self.offset as isize
            + b as isize * self.strides[0]
            + h as isize * self.strides[1]
            + t as isize * self.strides[2]
            + d as isize * self.strides[3];
        self.data[i as usize]
    }

    /// Copies head `(b, h)` into `rows` (`[T, D]`).
    #[inline(always)]
    fn gather(&self, b: usize, h: usize, t: usize, d: usize, rows: &mut [f32]) {
        if self.strides[3] == 1 && self.strides[2] >= 0 {
            // Rows of `d` in a row: one copy each (the models' q, k, v are such views).
            let start =
                self.offset as isize + b as isize * self.strides[0] + h as isize * self.strides[1];
            for (i, row) in rows.chunks_exact_mut(d).take(t).enumerate() {
                let at = (start + i as isize * self.strides[2]) as usize;
                row.copy_from_slice(&self.data[at..at + d]);
            }
        } else {
            for i in 0..t {
                for j in 0..d {
                    rows[i * d + j] = self.at(b, h, i, j);
                }
            }
        }
    }
}

versions! {
    /// LayerNorm over rows of `c`: `y = (x - mean)/sqrt(var + eps)·gamma + beta`, the biased
    /// variance as Burn's. Writes each row's mean and 1/sqrt(var + eps) to `stats` (`[rows, 2]`).
    pub(crate) fn layer_norm_forward(
        x: &[f32],
        c: usize,
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        y: &mut [f32],
        stats: &mut [f32],
    ) {
        let n = c as f32;
        for ((x, y), st) in x.chunks_exact(c).zip(y.chunks_exact_mut(c)).zip(stats.chunks_exact_mut(2)) {
            let mean = sum(x) / n;
            for (y, x) in y.iter_mut().zip(x) {
                *y = x - mean;
            }
            let var = dot(y, y) / n;
            let rstd = 1.0 / (var + eps).sqrt();
            for ((y, g), b) in y.iter_mut().zip(gamma).zip(beta) {
                *y = *y * rstd * g + b;
            }
            st[0] = mean;
            st[1] = rstd;
        }
    }

    /// LayerNorm's backward: `dx` (written), `dgamma` and `dbeta` (added to), from the input,
    /// `gamma`, the forward's `stats` and the output's gradient `dy`. `scratch` holds `c`.
    pub(crate) fn layer_norm_backward(
        x: &[f32],
        c: usize,
        gamma: &[f32],
        stats: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
        scratch: &mut [f32],
    ) {
        let n = c as f32;
        let rows = x.chunks_exact(c).zip(dy.chunks_exact(c)).zip(dx.chunks_exact_mut(c));
        for (((x, dy), dx), st) in rows.zip(stats.chunks_exact(2)) {
            let (mean, rstd) = (st[0], st[1]);
            // scratch = x̂; dx = dy·gamma for now.
            for (s, x) in scratch.iter_mut().zip(x) {
                *s = (x - mean) * rstd;
            }
            for ((dx, dy), g) in dx.iter_mut().zip(dy).zip(gamma) {
                *dx = dy * g;
            }
            let mean_g = sum(dx) / n;
            let mean_gx = dot(dx, scratch) / n;
            for (dx, s) in dx.iter_mut().zip(scratch.iter()) {
                *dx = (*dx - mean_g - s * mean_gx) * rstd;
            }
            for ((dg, dy), s) in dgamma.iter_mut().zip(dy).zip(scratch.iter()) {
                *dg += dy * s;
            }
            for (db, dy) in dbeta.iter_mut().zip(dy) {
                *db += dy;
            }
        }
    }

    /// The exact GELU, `x·Φ(x)`.
    pub(crate) fn gelu_forward(x: &[f32], y: &mut [f32]) {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = x * normal_cdf_pdf(x).0;
        }
    }

    /// GELU's backward: `dx = dy·(Φ(x) + x·φ(x))`.
    pub(crate) fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) {
        for ((dx, &x), dy) in dx.iter_mut().zip(x).zip(dy) {
            let (cdf, pdf) = normal_cdf_pdf(x);
            *dx = dy * (cdf + x * pdf);
        }
    }

    /// Each row's log-sum-exp of `logits` (`[rows, v]`) into `lse`; returns the summed
    /// cross-entropy `Σ lse - logit[target]` (in f64, the mean's sum over many rows) of the
    /// rows whose target is not `usize::MAX` (ignored: not summed, its `lse` 0).
    pub(crate) fn cross_entropy_forward(
        logits: &[f32],
        v: usize,
        targets: &[usize],
        lse: &mut [f32],
        scratch: &mut [f32],
    ) -> f64 {
        let mut total = 0.0f64;
        for ((row, &target), lse) in logits.chunks_exact(v).zip(targets).zip(lse.iter_mut()) {
            if target == usize::MAX {
                *lse = 0.0;
                continue;
            }
            let m = max(row);
            scratch.copy_from_slice(row);
            let s = exp_shifted(scratch, m);
            *lse = m + s.ln();
            total += (*lse - row[target]) as f64;
        }
        total
    }

    /// Cross-entropy's backward: `dlogits = scale·(softmax(logits) - onehot(target))`, zero
    /// on a row whose target is ignored (`usize::MAX`).
    pub(crate) fn cross_entropy_backward(
        logits: &[f32],
        v: usize,
        targets: &[usize],
        lse: &[f32],
        scale: f32,
        dlogits: &mut [f32],
    ) {
        let rows = logits.chunks_exact(v).zip(dlogits.chunks_exact_mut(v));
        for (((row, d), &target), &lse) in rows.zip(targets).zip(lse) {
            if target == usize::MAX {
                d.fill(0.0);
                continue;
            }
            for (d, &l) in d.iter_mut().zip(row) {
                *d = scale * exp(l - lse);
            }
            d[target] -= scale;
        }
    }

    /// Causal attention, `softmax(q·kᵀ·scale, masked to keys ≤ query)·v`, by blocks of
    /// [`QUERY_BLOCK`] query rows: a block's scores against the keys up to its last row are one
    /// matrix product (at most `QUERY_BLOCK × T` of them held, never `T × T`), each row's
    /// softmax is taken over its own keys (the others set to zero), and the block's output
    /// is the product of those weights with the values, written straight into `out` (laid
    /// out `[B, T, H, D]`: the model's next step reads it so). `lse` (`[B, H, T]`) gets each
    /// row's log-sum-exp for the backward.
    ///
    /// `starts` (`[B, T]`, or empty: every row from 0) is, for each row, the first key it may
    /// see — the first position of its document in a packed row: the row sees `start..=i`,
    /// and a block's product covers the keys from its rows' first start only.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_forward(
        q: View4,
        k: View4,
        v: View4,
        shape: [usize; 4],
        scale: f32,
        starts: &[usize],
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        let [nb, nh, t, d] = shape;
        let (mut qr, mut kr, mut vr) = (vec![0.0f32; t * d], vec![0.0f32; t * d], vec![0.0f32; t * d]);
        let mut p = vec![0.0f32; QUERY_BLOCK.min(t) * t];
        for b in 0..nb {
            let first_key = |i: usize| starts.get(b * t + i).copied().unwrap_or(0);
            for h in 0..nh {
                q.gather(b, h, t, d, &mut qr);
                k.gather(b, h, t, d, &mut kr);
                v.gather(b, h, t, d, &mut vr);
                for i0 in (0..t).step_by(QUERY_BLOCK) {
                    let i1 = (i0 + QUERY_BLOCK).min(t);
                    // The block's rows see the keys from their first start to its last row.
                    let k0 = (i0..i1).map(first_key).min().unwrap_or(0);
                    let (rows, keys) = (i1 - i0, i1 - k0);
                    let p = &mut p[..rows * keys];
                    let q_blk = Mat::rows(&qr, i0 * d, [rows, d], d);
                    let keys_k = Mat::rows(&kr, k0 * d, [keys, d], d);
                    gemm::product_into(p, 0, keys, q_blk, keys_k.t(), false);
                    for (r, row) in p.chunks_exact_mut(keys).enumerate() {
                        let i = i0 + r;
                        let (before, rest) = row.split_at_mut(first_key(i) - k0);
                        let (seen, later) = rest.split_at_mut(i + 1 - first_key(i));
                        for s in seen.iter_mut() {
                            *s *= scale;
                        }
                        let m = max(seen);
                        let total = exp_shifted(seen, m);
                        let inv = 1.0 / total;
                        for s in seen.iter_mut() {
                            *s *= inv;
                        }
                        before.fill(0.0);
                        later.fill(0.0);
                        lse[(b * nh + h) * t + i] = m + total.ln();
                    }
                    let at = (b * t + i0) * nh * d + h * d;
                    let values = Mat::rows(&vr, k0 * d, [keys, d], d);
                    gemm::product_into(out, at, nh * d, Mat::rows(p, 0, [rows, keys], keys), values, false);
                }
            }
        }
    }

    /// Causal attention's backward from `q`, `k`, `v`, the forward's `out` and `lse` and the
    /// output's gradient `dout` (laid out as `out`, `[B, T, H, D]`), recomputing the
    /// probabilities from `lse`. Adds `dq`, `dk` and `dv` into `grads` (zeros on entry), laid
    /// out by `layout = [row, q, k, v]`: head `h`'s gradient at time `i` of batch row `b`
    /// starts at `(b·T + i)·row + base + h·D` with `base` the tensor's (`[B, T, 3, H, D]` when
    /// `row = 3·H·D` and the bases are `0, H·D, 2·H·D`: the gradient of a packed q/k/v
    /// projection). `starts` as the forward's.
    ///
    /// By blocks of [`QUERY_BLOCK`] query rows, as the forward: the block's probabilities `p`
    /// and `dp = dout·vᵀ` against the keys it sees (two products), the score gradients
    /// `ds = p·(dp − dout·out)·scale`, then `dq = ds·k` for the block's rows and
    /// `dk += dsᵀ·q`, `dv += pᵀ·dout` for its keys (three more), each product written
    /// straight into `grads`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_backward(
        q: View4,
        k: View4,
        v: View4,
        out: &[f32],
        lse: &[f32],
        dout: View4,
        shape: [usize; 4],
        scale: f32,
        starts: &[usize],
        grads: &mut [f32],
        layout: [usize; 4],
    ) {
        let [nb, nh, t, d] = shape;
        let [row_len, base_q, base_k, base_v] = layout;
        let (mut qr, mut kr, mut vr) = (vec![0.0f32; t * d], vec![0.0f32; t * d], vec![0.0f32; t * d]);
        let mut dor = vec![0.0f32; t * d];
        let mut p = vec![0.0f32; QUERY_BLOCK.min(t) * t];
        let mut ds = vec![0.0f32; QUERY_BLOCK.min(t) * t];
        for b in 0..nb {
            let first_key = |i: usize| starts.get(b * t + i).copied().unwrap_or(0);
            for h in 0..nh {
                q.gather(b, h, t, d, &mut qr);
                k.gather(b, h, t, d, &mut kr);
                v.gather(b, h, t, d, &mut vr);
                dout.gather(b, h, t, d, &mut dor);
                let first = (b * t) * row_len + h * d;
                for i0 in (0..t).step_by(QUERY_BLOCK) {
                    let i1 = (i0 + QUERY_BLOCK).min(t);
                    let k0 = (i0..i1).map(first_key).min().unwrap_or(0);
                    let (rows, keys) = (i1 - i0, i1 - k0);
                    let (p, ds) = (&mut p[..rows * keys], &mut ds[..rows * keys]);
                    let q_blk = Mat::rows(&qr, i0 * d, [rows, d], d);
                    let do_blk = Mat::rows(&dor, i0 * d, [rows, d], d);
                    let keys_k = Mat::rows(&kr, k0 * d, [keys, d], d);
                    let keys_v = Mat::rows(&vr, k0 * d, [keys, d], d);
                    gemm::product_into(p, 0, keys, q_blk, keys_k.t(), false);
                    gemm::product_into(ds, 0, keys, do_blk, keys_v.t(), false);
                    for (r, (p_row, ds_row)) in
                        p.chunks_exact_mut(keys).zip(ds.chunks_exact_mut(keys)).enumerate()
                    {
                        let i = i0 + r;
                        let (lo, hi) = (first_key(i) - k0, i + 1 - k0);
                        let lse_i = lse[(b * nh + h) * t + i];
                        let at = (b * t + i) * nh * d + h * d;
                        // D_i = dout_i · out_i.
                        let delta = dot(&dor[i * d..(i + 1) * d], &out[at..at + d]);
                        for (pj, dsj) in p_row[lo..hi].iter_mut().zip(ds_row[lo..hi].iter_mut()) {
                            *pj = exp(*pj * scale - lse_i);
                            *dsj = *pj * (*dsj - delta) * scale;
                        }
                        p_row[..lo].fill(0.0);
                        ds_row[..lo].fill(0.0);
                        p_row[hi..].fill(0.0);
                        ds_row[hi..].fill(0.0);
                    }
                    let (p, ds) = (Mat::rows(p, 0, [rows, keys], keys), Mat::rows(ds, 0, [rows, keys], keys));
                    let at = first + i0 * row_len;
                    let keys_at = first + k0 * row_len;
                    gemm::product_into(grads, at + base_q, row_len, ds, keys_k, false);
                    gemm::product_into(grads, keys_at + base_k, row_len, ds.t(), q_blk, true);
                    gemm::product_into(grads, keys_at + base_v, row_len, p.t(), do_blk, true);
                }
            }
        }
    }
}

/// Query rows per block of attention: a block's scores and weights hold `QUERY_BLOCK × T`
/// values.
const QUERY_BLOCK: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vector_level_this_cpu_has_gives_the_plain_kernels_results() {
        // GELU, cross-entropy, and (their files' own) SwiGLU, RMSNorm and BatchNorm's kernels.
        let x: Vec<f32> = (0..37 * 29)
            .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let run = |level| {
            force_level(Some(level));
            let mut y = vec![0.0; x.len()];
            gelu_forward(&x, &mut y);
            let mut lse = vec![0.0; 37];
            let mut scratch = vec![0.0; 29];
            let targets: Vec<usize> = (0..37).map(|i| i % 29).collect();
            let total = cross_entropy_forward(&x, 29, &targets, &mut lse, &mut scratch);
            // The other files' kernels: SwiGLU's gate, RMSNorm, BatchNorm's sums and output.
            let mut gated = vec![0.0; x.len()];
            super::super::gated::swiglu_forward(&x, &x, &mut gated);
            let (mut normed, mut inv) = (vec![0.0; x.len()], vec![0.0; 37]);
            let gamma = vec![1.5; 29];
            super::super::gated::rms_norm_forward(&x, 29, &gamma, 1e-5, &mut normed, &mut inv);
            let dims = [1, 37, 29];
            let sums = super::super::conv::channel_sums(&x, dims, &[0.5; 37], true);
            let mut bn = vec![0.0; x.len()];
            let stats: (&[f32], &[f32]) = (&[0.25; 37], &[2.0; 37]);
            super::super::conv::batch_norm_apply(
                &x, dims, &[1.5; 37], &[0.1; 37], stats, 1e-5, &mut bn,
            );
            force_level(None);
            y.extend(gated.into_iter().chain(normed).chain(inv).chain(bn));
            y.extend(sums.iter().map(|&v| v as f32 / 29.0));
            (y, lse, total)
        };
        let plain = run(Level::Plain);
        for level in [Level::Avx2, Level::Avx512] {
            let have = matches!(
                (level, cpu_level()),
                (Level::Avx2, Level::Avx2 | Level::Avx512) | (Level::Avx512, Level::Avx512)
            );
            if !have {
                continue;
            }
            let other = run(level);
            for (a, b) in plain
                .0
                .iter()
                .zip(&other.0)
                .chain(plain.1.iter().zip(&other.1))
            {
                assert!(
                    (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                    "{level:?}: {a} vs {b}"
                );
            }
            assert!((plain.2 - other.2).abs() < 1e-4, "{level:?}");
        }
    }
}
