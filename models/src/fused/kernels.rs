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
//! The element-wise functions and reductions they share are in [`super::math`].

use super::math::{axpy, dot, exp, exp_shifted, max, normal_cdf_pdf, sum};

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

    /// Copies head `(b, h)` into `rows` (`[T, D]`) and, when given, `cols` (`[D, T]`).
    #[inline(always)]
    fn gather(
        &self,
        b: usize,
        h: usize,
        t: usize,
        d: usize,
        rows: &mut [f32],
        cols: Option<&mut [f32]>,
    ) {
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
        if let Some(cols) = cols {
            for i in 0..t {
                for j in 0..d {
                    cols[j * t + i] = rows[i * d + j];
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
    /// cross-entropy `Σ lse - logit[target]` (in f64, the mean's sum over many rows).
    pub(crate) fn cross_entropy_forward(
        logits: &[f32],
        v: usize,
        targets: &[usize],
        lse: &mut [f32],
        scratch: &mut [f32],
    ) -> f64 {
        let mut total = 0.0f64;
        for ((row, &target), lse) in logits.chunks_exact(v).zip(targets).zip(lse.iter_mut()) {
            let m = max(row);
            scratch.copy_from_slice(row);
            let s = exp_shifted(scratch, m);
            *lse = m + s.ln();
            total += (*lse - row[target]) as f64;
        }
        total
    }

    /// Cross-entropy's backward: `dlogits = scale·(softmax(logits) - onehot(target))`.
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
            for (d, &l) in d.iter_mut().zip(row) {
                *d = scale * exp(l - lse);
            }
            d[target] -= scale;
        }
    }

    /// Causal attention, `softmax(q·kᵀ·scale, masked to keys ≤ query)·v`, one query row at a
    /// time: a row's scores (at most `t` of them) are all that is held, never the `t × t`
    /// matrix, and the masked half is never computed. `out` is laid out `[B, T, H, D]` (the
    /// model's next step reads it so); `lse` (`[B, H, T]`) gets each row's log-sum-exp for the
    /// backward.
    pub(crate) fn attention_forward(
        q: View4,
        k: View4,
        v: View4,
        shape: [usize; 4],
        scale: f32,
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        let [nb, nh, t, d] = shape;
        let mut qr = vec![0.0f32; t * d];
        let mut kr = vec![0.0f32; t * d];
        let mut kc = vec![0.0f32; d * t];
        let mut vr = vec![0.0f32; t * d];
        let mut s = vec![0.0f32; t];
        let mut o = vec![0.0f32; d];
        for b in 0..nb {
            for h in 0..nh {
                q.gather(b, h, t, d, &mut qr, None);
                k.gather(b, h, t, d, &mut kr, Some(&mut kc));
                v.gather(b, h, t, d, &mut vr, None);
                for i in 0..t {
                    let row = &mut s[..=i];
                    scores(row, &qr[i * d..(i + 1) * d], &kc, t, scale);
                    let m = max(row);
                    let total = exp_shifted(row, m);
                    weighted_rows(&mut o, row, &vr);
                    let inv = 1.0 / total;
                    let at = ((b * t + i) * nh + h) * d;
                    for (y, o) in out[at..at + d].iter_mut().zip(&o) {
                        *y = o * inv;
                    }
                    lse[(b * nh + h) * t + i] = m + total.ln();
                }
            }
        }
    }

    /// Causal attention's backward from `q`, `k`, `v`, the forward's `out` and `lse` and the
    /// output's gradient `dout` (laid out as `out`, `[B, T, H, D]`), recomputing the
    /// probabilities from `lse`. Writes `dq`, `dk` and `dv` into `grads`, laid out by
    /// `layout = [row, q, k, v]`: head `h`'s gradient at time `i` of batch row `b` starts at
    /// `(b·T + i)·row + base + h·D` with `base` the tensor's (`[B, T, 3, H, D]` when
    /// `row = 3·H·D` and the bases are `0, H·D, 2·H·D`: the gradient of a packed q/k/v
    /// projection). Every element a base reaches is written.
    ///
    /// Keys go in blocks of [`KEY_BLOCK`]: for a block, every query row at or after its first
    /// key recomputes its probabilities `p` and score gradients `ds` against the block's keys
    /// into two tiles (`rows × KEY_BLOCK`) and adds `ds·k` to its `dq`; then each key of the
    /// block sums its column of the tiles against the query rows, `dv_j = Σ_i p_ij·dout_i` and
    /// `dk_j = Σ_i ds_ij·q_i`, in registers, written once. Held at once: the two tiles, never the
    /// `t × t` matrices.
    pub(crate) fn attention_backward(
        q: View4,
        k: View4,
        v: View4,
        out: &[f32],
        lse: &[f32],
        dout: View4,
        shape: [usize; 4],
        scale: f32,
        grads: &mut [f32],
        layout: [usize; 4],
    ) {
        let [nb, nh, t, d] = shape;
        let [row_len, base_q, base_k, base_v] = layout;
        let bc = KEY_BLOCK.min(t);
        let mut qr = vec![0.0f32; t * d];
        let mut kr = vec![0.0f32; t * d];
        let mut kc = vec![0.0f32; d * t];
        let mut vr = vec![0.0f32; t * d];
        let mut vc = vec![0.0f32; d * t];
        let mut dor = vec![0.0f32; t * d];
        let mut dqr = vec![0.0f32; t * d];
        let mut ptile = vec![0.0f32; t * bc];
        let mut dstile = vec![0.0f32; t * bc];
        let mut delta = vec![0.0f32; t];
        let mut column = vec![0.0f32; t];
        let mut part = vec![0.0f32; d];
        for b in 0..nb {
            for h in 0..nh {
                q.gather(b, h, t, d, &mut qr, None);
                k.gather(b, h, t, d, &mut kr, Some(&mut kc));
                v.gather(b, h, t, d, &mut vr, Some(&mut vc));
                dout.gather(b, h, t, d, &mut dor, None);
                for (i, delta) in delta.iter_mut().enumerate() {
                    // D_i = dout_i · out_i.
                    let at = ((b * t + i) * nh + h) * d;
                    *delta = dot(&dor[i * d..(i + 1) * d], &out[at..at + d]);
                }
                dqr.fill(0.0);
                for j0 in (0..t).step_by(bc) {
                    let j1 = (j0 + bc).min(t);
                    for i in j0..t {
                        let (qi, doi) = (&qr[i * d..(i + 1) * d], &dor[i * d..(i + 1) * d]);
                        let n = (i + 1).min(j1) - j0;
                        let row = (i - j0) * bc;
                        let p = &mut ptile[row..row + n];
                        scores(p, qi, &kc[j0..], t, scale);
                        let lse_i = lse[(b * nh + h) * t + i];
                        for p in p.iter_mut() {
                            *p = exp(*p - lse_i);
                        }
                        // dp_j = dout_i · v_j, then ds_j = p_j·(dp_j - D_i)·scale.
                        let ds = &mut dstile[row..row + n];
                        scores(ds, doi, &vc[j0..], t, 1.0);
                        for (ds, &pj) in ds.iter_mut().zip(p.iter()) {
                            *ds = pj * (*ds - delta[i]) * scale;
                        }
                        weighted_rows(&mut part, ds, &kr[j0 * d..]);
                        for (g, x) in dqr[i * d..(i + 1) * d].iter_mut().zip(&part) {
                            *g += x;
                        }
                    }
                    for j in j0..j1 {
                        // Rows i ≥ j see key j: their entries of column j - j0.
                        let rows = t - j;
                        let at = (b * t + j) * row_len + h * d;
                        for (r, c) in column[..rows].iter_mut().enumerate() {
                            *c = ptile[(j - j0 + r) * bc + j - j0];
                        }
                        let dv = &mut grads[at + base_v..at + base_v + d];
                        weighted_rows(dv, &column[..rows], &dor[j * d..]);
                        for (r, c) in column[..rows].iter_mut().enumerate() {
                            *c = dstile[(j - j0 + r) * bc + j - j0];
                        }
                        let dk = &mut grads[at + base_k..at + base_k + d];
                        weighted_rows(dk, &column[..rows], &qr[j * d..]);
                    }
                }
                for i in 0..t {
                    let at = (b * t + i) * row_len + h * d + base_q;
                    grads[at..at + d].copy_from_slice(&dqr[i * d..(i + 1) * d]);
                }
            }
        }
    }
}

/// Keys per block of attention's backward: its two tiles hold `t × KEY_BLOCK` values each.
const KEY_BLOCK: usize = 64;

/// `out[e] = Σ_j w[j]·rows[j·d + e]` (`d = out.len()`): a weighted sum of the first
/// `w.len()` rows. Thirty-two features at a time (then eight, then one), over all the rows,
/// even and odd rows into two sets of sums: the sums stay in registers instead of being
/// loaded and stored once per row, and enough of them are independent that the adds do not
/// wait on each other.
#[inline(always)]
fn weighted_rows(out: &mut [f32], w: &[f32], rows: &[f32]) {
    let d = out.len();
    let mut e = 0;
    while e + 32 <= d {
        weighted_block::<4>(&mut out[e..e + 32], w, &rows[e..], d);
        e += 32;
    }
    while e + 8 <= d {
        weighted_block::<1>(&mut out[e..e + 8], w, &rows[e..], d);
        e += 8;
    }
    for (e, o) in out.iter_mut().enumerate().skip(e) {
        *o = w
            .iter()
            .enumerate()
            .map(|(j, &wj)| wj * rows[j * d + e])
            .sum();
    }
}

/// [`weighted_rows`] for `8·G` features, read at `rows[j·d..j·d + 8·G]`: `2·G` sums of eight,
/// each its own array so that each stays in a register.
#[inline(always)]
fn weighted_block<const G: usize>(out: &mut [f32], w: &[f32], rows: &[f32], d: usize) {
    let (mut even, mut odd) = ([[0.0f32; 8]; G], [[0.0f32; 8]; G]);
    let pairs = w.len() / 2;
    for p in 0..pairs {
        let (w0, w1) = (w[2 * p], w[2 * p + 1]);
        let r0 = &rows[2 * p * d..2 * p * d + 8 * G];
        let r1 = &rows[(2 * p + 1) * d..(2 * p + 1) * d + 8 * G];
        for g in 0..G {
            add_scaled8(&mut even[g], w0, &r0[8 * g..8 * g + 8]);
            add_scaled8(&mut odd[g], w1, &r1[8 * g..8 * g + 8]);
        }
    }
    if w.len() % 2 == 1 {
        let j = w.len() - 1;
        let r = &rows[j * d..j * d + 8 * G];
        for g in 0..G {
            add_scaled8(&mut even[g], w[j], &r[8 * g..8 * g + 8]);
        }
    }
    for g in 0..G {
        for l in 0..8 {
            out[8 * g + l] = even[g][l] + odd[g][l];
        }
    }
}

/// `acc += w·r` over eight values.
#[inline(always)]
fn add_scaled8(acc: &mut [f32; 8], w: f32, r: &[f32]) {
    let r: &[f32; 8] = r.try_into().expect("eight values");
    for l in 0..8 {
        acc[l] += w * r[l];
    }
}

/// `row[j] = scale·Σ_e x[e]·cols[e·t + j]` for `j < row.len()`: the scores of one query against
/// the first keys, from the keys laid out by column (`[D, T]`), so that the inner loop runs
/// along the keys with no horizontal sum. Four columns at a time keep `row` in registers
/// longer.
#[inline(always)]
fn scores(row: &mut [f32], x: &[f32], cols: &[f32], t: usize, scale: f32) {
    let n = row.len();
    row.fill(0.0);
    let d = x.len();
    let mut e = 0;
    while e + 4 <= d {
        let (a0, a1, a2, a3) = (x[e], x[e + 1], x[e + 2], x[e + 3]);
        let c0 = &cols[e * t..e * t + n];
        let c1 = &cols[(e + 1) * t..(e + 1) * t + n];
        let c2 = &cols[(e + 2) * t..(e + 2) * t + n];
        let c3 = &cols[(e + 3) * t..(e + 3) * t + n];
        for j in 0..n {
            row[j] += a0 * c0[j] + a1 * c1[j] + a2 * c2[j] + a3 * c3[j];
        }
        e += 4;
    }
    while e < d {
        axpy(row, x[e], &cols[e * t..e * t + n]);
        e += 1;
    }
    for r in row.iter_mut() {
        *r *= scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vector_level_this_cpu_has_gives_the_plain_kernels_results() {
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
            force_level(None);
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
