//! Attention's kernels on the matrix units, for 16-bit q, k and v: CubeCL's `cmma` (a card's
//! tensor cores, Vulkan's cooperative matrices). The same three passes as the kernels' module
//! (the forward's online softmax, `dq` by query tiles, `dk` and `dv` by key tiles), cut for
//! the units that multiply 16 × 16 blocks a plane (a warp) at a time:
//!
//! - A cube is `planes` planes; each plane owns 16 rows of the cube's tile (query rows in the
//!   forward and `dq`, key rows in `dk`/`dv`) and computes their products with the other side's
//!   tile (16 · `chunks` rows) as 16 × 16 blocks: the scores `q·kᵀ` (and `dout·vᵀ` in the
//!   backward) into shared memory in f32, then the products with the weights.
//! - Between the two, the cube's units take a row each: the online softmax (the forward), the
//!   weights and `p (dp − δ)` (the backward), the causal mask, the documents' starts and the
//!   dropout, in f32 as the other kernels compute them; the weights and `p (dp − δ)` are then
//!   rounded to the tensors' type for the second product (as FlashAttention does), which sums
//!   in f32.
//! - The forward's output is rescaled row by row as the softmax's maximum grows, so it lives in
//!   shared memory (f32) between tiles; `dq`, `dk` and `dv` only add, so they stay in the units'
//!   fragments until the end.
//!
//! The scale multiplies the scores in f32 (not q before the product), so each row's
//! log-sum-exp means what the other kernels' means and either backward takes either forward's.

use cubecl::prelude::*;

use super::blocks::{
    ALIGN, Block, M, load_rows, put, rows_by_rows, store_blocks, take, weights_by_tile, zero_block,
};
use super::kernels::{DropArgs, first_key, head_hash, kept_factor, mix_in, row_start};

/// A cube per (tile of `16 · planes` query rows, head, batch row). For each tile of
/// `16 · chunks` keys up to the diagonal: each plane's scores against it on the matrix units,
/// into shared memory; each row's online softmax by a unit a row (the output's row rescaled);
/// then the weights times the values added to the output. Writes the output and each row's
/// log-sum-exp.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_mma<E: Float, F: Float, I: Numeric>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    starts: &Tensor<I>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<F>,
    scale: f32,
    drop: DropArgs,
    #[comptime] d: usize,
    #[comptime] planes: usize,
    #[comptime] chunks: usize,
    #[comptime] units: usize,
    #[comptime] lanes: bool,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let plane = comptime!(units / planes);
    let rows = comptime!(M * planes);
    let keys = comptime!(M * chunks);
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let (b, h) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let hk = h / (heads / kv_heads);
    let row0 = CUBE_POS_X as usize * rows;
    let u = UNIT_POS as usize;
    let p0 = UNIT_POS_Y as usize * M;
    let scale = F::cast_from(scale);
    let inv_keep = F::cast_from(drop.inv_keep);
    let mut qs = Shared::<[E]>::new_aligned_slice(comptime!(rows * d), ALIGN);
    let mut ks = Shared::<[E]>::new_aligned_slice(comptime!(keys * d), ALIGN);
    let mut vs = Shared::<[E]>::new_aligned_slice(comptime!(keys * d), ALIGN);
    let mut ss = Shared::<[F]>::new_aligned_slice(comptime!(rows * keys), ALIGN);
    let mut ps = Shared::<[E]>::new_aligned_slice(comptime!(rows * keys), ALIGN);
    let mut os = Shared::<[F]>::new_aligned_slice(comptime!(rows * d), ALIGN);
    let mut ms = Shared::<[F]>::new_slice(rows);
    let mut ls = Shared::<[F]>::new_slice(rows);
    load_rows::<E>(
        q,
        row_start::<E>(q, b, h, 0),
        row0,
        t,
        &mut qs,
        rows,
        d,
        units,
    );
    let mut idx = u;
    while idx < comptime!(rows * d) {
        os[idx] = F::new(0.0);
        idx += units;
    }
    let mut r = u;
    while r < rows {
        ms[r] = F::new(-1.0e30);
        ls[r] = F::new(0.0);
        r += units;
    }
    let mut hash = 0u32;
    if dropping {
        hash = head_hash(&drop, b, h);
    }
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    let mut last = row0 + rows;
    if last > t {
        last = t;
    }
    let mut acc = zero_block::<F>(lanes, plane);
    for kt in 0..last.div_ceil(keys) {
        let key0 = kt * keys;
        load_rows::<E>(k, k_base, key0, t, &mut ks, keys, d, units);
        load_rows::<E>(v, v_base, key0, t, &mut vs, keys, d, units);
        sync_cube();
        #[unroll]
        for j in 0..chunks {
            rows_by_rows::<E, F>(&mut acc, &qs, p0, &ks, comptime!(j * M), d, plane);
            put::<F>(&mut ss, &acc, p0, comptime!(j * M), keys, plane);
        }
        sync_cube();
        let mut r = u;
        while r < rows {
            let i = row0 + r;
            let first = first_key::<I>(starts, b * t + i, i < t, within);
            let m_old = ms[r];
            let mut m = m_old;
            for c in 0..keys {
                let j = key0 + c;
                let x = ss[r * keys + c] * scale;
                if j <= i && j >= first && x > m {
                    m = x;
                }
            }
            let mut row_hash = 0u32;
            if dropping {
                row_hash = mix_in(hash ^ i as u32);
            }
            let mut sum = F::new(0.0);
            for c in 0..keys {
                let j = key0 + c;
                let mut pe = F::new(0.0);
                if j <= i && j >= first {
                    pe = (ss[r * keys + c] * scale - m).exp();
                }
                sum += pe;
                if dropping {
                    pe *= kept_factor::<F>(row_hash, mix_in(j as u32), drop.threshold, inv_keep);
                }
                ps[r * keys + c] = E::cast_from(pe);
            }
            let corr = (m_old - m).exp();
            ls[r] = ls[r] * corr + sum;
            ms[r] = m;
            for c in 0..d {
                os[r * d + c] *= corr;
            }
            r += units;
        }
        sync_cube();
        #[unroll]
        for c in 0..comptime!(d / M) {
            take::<F>(&mut acc, &os, p0, comptime!(c * M), d, plane);
            weights_by_tile::<E, F>(&mut acc, &ps, p0, &vs, comptime!(c * M), keys, d, plane);
            put::<F>(&mut os, &acc, p0, comptime!(c * M), d, plane);
        }
        sync_cube();
    }
    let mut r = u;
    while r < rows {
        let i = row0 + r;
        if i < t {
            lse[(b * heads + h) * t + i] = ms[r] + ls[r].ln();
        }
        r += units;
    }
    let mut idx = u;
    while idx < comptime!(rows * d) {
        let (r, c) = (idx / d, idx % d);
        let i = row0 + r;
        if i < t {
            let at = b * out.stride(0) + h * out.stride(1) + i * out.stride(2) + c;
            out[at] = E::cast_from(os[idx] / ls[r]);
        }
        idx += units;
    }
}

/// The weights (into `ps`, through the dropout) and `p (dp − δ)` (into `gs`) of a tile of
/// `n` rows × `keys` columns of scores `ss` and `dout·vᵀ` `dps`, a unit a row: row `r` is query
/// row `q0 + r` against keys `key0 ..` where `by_rows`, else key row `key0 + r` against query
/// rows `q0 ..`; `lrow`, `drow` and `frow` hold the query rows' log-sum-exp, δ and first key.
#[cube]
#[allow(clippy::too_many_arguments)]
fn grads_rows<E: Float, F: Float>(
    ss: &[F],
    dps: &[F],
    ps: &mut [E],
    gs: &mut [E],
    lrow: &[F],
    drow: &[F],
    frow: &[u32],
    drop: &DropArgs,
    hash: u32,
    t: usize,
    q0: usize,
    key0: usize,
    scale: F,
    #[comptime] n: usize,
    #[comptime] cols: usize,
    #[comptime] units: usize,
    #[comptime] by_rows: bool,
    #[comptime] dropping: bool,
) {
    let inv_keep = F::cast_from(drop.inv_keep);
    let mut r = UNIT_POS as usize;
    while r < n {
        for c in 0..cols {
            let mut qr = r;
            let mut kc = c;
            if !by_rows {
                qr = c;
                kc = r;
            }
            let (i, j) = (q0 + qr, key0 + kc);
            let z = r * cols + c;
            let mut pz = F::new(0.0);
            let mut gz = F::new(0.0);
            if i < t && j <= i && j >= frow[qr] as usize {
                let p = (ss[z] * scale - lrow[qr]).exp();
                let mut f = F::new(1.0);
                if dropping {
                    let row_hash = mix_in(hash ^ i as u32);
                    f = kept_factor::<F>(row_hash, mix_in(j as u32), drop.threshold, inv_keep);
                }
                pz = p * f;
                gz = p * (dps[z] * f - drow[qr]);
            }
            ps[z] = E::cast_from(pz);
            gs[z] = E::cast_from(gz);
        }
        r += units;
    }
}

/// Rows `q0 .. q0 + n` of head `h`'s log-sum-exp, δ (from `delta`) and first keys into `lrow`,
/// `drow` and `frow`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn row_stats<F: Float, I: Numeric>(
    lse: &Tensor<F>,
    delta: &Tensor<F>,
    starts: &Tensor<I>,
    lrow: &mut [F],
    drow: &mut [F],
    frow: &mut [u32],
    head_rows: usize,
    b: usize,
    t: usize,
    q0: usize,
    #[comptime] n: usize,
    #[comptime] units: usize,
    #[comptime] within: bool,
) {
    let mut r = UNIT_POS as usize;
    while r < n {
        let i = q0 + r;
        let mut li = F::new(0.0);
        let mut di = F::new(0.0);
        if i < t {
            li = lse[head_rows + i];
            di = delta[head_rows + i];
        }
        lrow[r] = li;
        drow[r] = di;
        frow[r] = first_key::<I>(starts, b * t + i, i < t, within) as u32;
        r += units;
    }
}

/// A cube per (tile of `16 · planes` query rows, head, batch row): `δ_i = dout_i·out_i` into
/// `delta` (for [`dkv_mma`]), then for each tile of `16 · chunks` keys up to the diagonal each
/// plane's scores and `dout·vᵀ` on the matrix units, `p (dp − δ)` by a unit a row, and
/// `dq += p (dp − δ) · k` on the matrix units; `dq` times the scale at the end.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn dq_mma<E: Float, F: Float, I: Numeric>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out: &Tensor<E>,
    dout: &Tensor<E>,
    lse: &Tensor<F>,
    delta: &mut Tensor<F>,
    starts: &Tensor<I>,
    dq: &mut Tensor<E>,
    scale: f32,
    drop: DropArgs,
    #[comptime] d: usize,
    #[comptime] planes: usize,
    #[comptime] chunks: usize,
    #[comptime] units: usize,
    #[comptime] lanes: bool,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let plane = comptime!(units / planes);
    let rows = comptime!(M * planes);
    let keys = comptime!(M * chunks);
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let (b, h) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let hk = h / (heads / kv_heads);
    let row0 = CUBE_POS_X as usize * rows;
    let u = UNIT_POS as usize;
    let p0 = UNIT_POS_Y as usize * M;
    let head_rows = (b * heads + h) * t;
    let scale = F::cast_from(scale);
    let mut qs = Shared::<[E]>::new_aligned_slice(comptime!(rows * d), ALIGN);
    let mut gs = Shared::<[E]>::new_aligned_slice(comptime!(rows * d), ALIGN);
    let mut ks = Shared::<[E]>::new_aligned_slice(comptime!(keys * d), ALIGN);
    let mut vs = Shared::<[E]>::new_aligned_slice(comptime!(keys * d), ALIGN);
    let mut ss = Shared::<[F]>::new_aligned_slice(comptime!(rows * keys), ALIGN);
    let mut dps = Shared::<[F]>::new_aligned_slice(comptime!(rows * keys), ALIGN);
    let mut ps = Shared::<[E]>::new_aligned_slice(comptime!(rows * keys), ALIGN);
    let mut dss = Shared::<[E]>::new_aligned_slice(comptime!(rows * keys), ALIGN);
    let mut lrow = Shared::<[F]>::new_slice(rows);
    let mut drow = Shared::<[F]>::new_slice(rows);
    let mut frow = Shared::<[u32]>::new_slice(rows);
    load_rows::<E>(
        q,
        row_start::<E>(q, b, h, 0),
        row0,
        t,
        &mut qs,
        rows,
        d,
        units,
    );
    load_rows::<E>(
        dout,
        row_start::<E>(dout, b, h, 0),
        row0,
        t,
        &mut gs,
        rows,
        d,
        units,
    );
    let mut r = u;
    while r < rows {
        let i = row0 + r;
        let mut li = F::new(0.0);
        let mut di = F::new(0.0);
        if i < t {
            li = lse[head_rows + i];
            let (o_at, g_at) = (row_start::<E>(out, b, h, i), row_start::<E>(dout, b, h, i));
            for c in 0..d {
                di += F::cast_from(out[o_at + c]) * F::cast_from(dout[g_at + c]);
            }
            delta[head_rows + i] = di;
        }
        lrow[r] = li;
        drow[r] = di;
        frow[r] = first_key::<I>(starts, b * t + i, i < t, within) as u32;
        r += units;
    }
    let mut hash = 0u32;
    if dropping {
        hash = head_hash(&drop, b, h);
    }
    let mut accs = Sequence::<Block<F>>::new();
    #[unroll]
    for _ in 0..comptime!(d / M) {
        accs.push(zero_block::<F>(lanes, plane));
    }
    let mut acc = zero_block::<F>(lanes, plane);
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    let mut last = row0 + rows;
    if last > t {
        last = t;
    }
    for kt in 0..last.div_ceil(keys) {
        let key0 = kt * keys;
        load_rows::<E>(k, k_base, key0, t, &mut ks, keys, d, units);
        load_rows::<E>(v, v_base, key0, t, &mut vs, keys, d, units);
        sync_cube();
        #[unroll]
        for j in 0..chunks {
            rows_by_rows::<E, F>(&mut acc, &qs, p0, &ks, comptime!(j * M), d, plane);
            put::<F>(&mut ss, &acc, p0, comptime!(j * M), keys, plane);
            rows_by_rows::<E, F>(&mut acc, &gs, p0, &vs, comptime!(j * M), d, plane);
            put::<F>(&mut dps, &acc, p0, comptime!(j * M), keys, plane);
        }
        sync_cube();
        grads_rows::<E, F>(
            &ss, &dps, &mut ps, &mut dss, &lrow, &drow, &frow, &drop, hash, t, row0, key0, scale,
            rows, keys, units, true, dropping,
        );
        sync_cube();
        #[unroll]
        for c in 0..comptime!(d / M) {
            weights_by_tile::<E, F>(
                accs.index_mut(c),
                &dss,
                p0,
                &ks,
                comptime!(c * M),
                keys,
                d,
                plane,
            );
        }
        sync_cube();
    }
    store_blocks::<E, F>(&accs, &mut ss, dq, b, h, row0, t, scale, keys, d, plane);
}

/// A cube per (tile of `16 · planes` key rows, key/value head, batch row), over every query
/// head that reads it and every tile of `16 · chunks` query rows from the diagonal on: each
/// plane's scores `k·qᵀ` and `v·doutᵀ` on the matrix units, the weights and `p (dp − δ)` by a
/// unit a key row, then `dv += p · dout` and `dk += p (dp − δ) · q` on the matrix units; `dk`
/// times the scale at the end.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn dkv_mma<E: Float, F: Float, I: Numeric>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    dout: &Tensor<E>,
    lse: &Tensor<F>,
    delta: &Tensor<F>,
    starts: &Tensor<I>,
    dk: &mut Tensor<E>,
    dv: &mut Tensor<E>,
    scale: f32,
    drop: DropArgs,
    #[comptime] d: usize,
    #[comptime] planes: usize,
    #[comptime] chunks: usize,
    #[comptime] units: usize,
    #[comptime] lanes: bool,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let plane = comptime!(units / planes);
    let rows = comptime!(M * planes);
    let qrows = comptime!(M * chunks);
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let group = heads / kv_heads;
    let (b, hk) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let key0 = CUBE_POS_X as usize * rows;
    let p0 = UNIT_POS_Y as usize * M;
    let scale = F::cast_from(scale);
    let mut ks = Shared::<[E]>::new_aligned_slice(comptime!(rows * d), ALIGN);
    let mut vs = Shared::<[E]>::new_aligned_slice(comptime!(rows * d), ALIGN);
    let mut qs = Shared::<[E]>::new_aligned_slice(comptime!(qrows * d), ALIGN);
    let mut gs = Shared::<[E]>::new_aligned_slice(comptime!(qrows * d), ALIGN);
    let mut ss = Shared::<[F]>::new_aligned_slice(comptime!(rows * qrows), ALIGN);
    let mut dps = Shared::<[F]>::new_aligned_slice(comptime!(rows * qrows), ALIGN);
    let mut ps = Shared::<[E]>::new_aligned_slice(comptime!(rows * qrows), ALIGN);
    let mut dss = Shared::<[E]>::new_aligned_slice(comptime!(rows * qrows), ALIGN);
    let mut lrow = Shared::<[F]>::new_slice(qrows);
    let mut drow = Shared::<[F]>::new_slice(qrows);
    let mut frow = Shared::<[u32]>::new_slice(qrows);
    load_rows::<E>(
        k,
        row_start::<E>(k, b, hk, 0),
        key0,
        t,
        &mut ks,
        rows,
        d,
        units,
    );
    load_rows::<E>(
        v,
        row_start::<E>(v, b, hk, 0),
        key0,
        t,
        &mut vs,
        rows,
        d,
        units,
    );
    let mut gks = Sequence::<Block<F>>::new();
    let mut gvs = Sequence::<Block<F>>::new();
    #[unroll]
    for _ in 0..comptime!(d / M) {
        gks.push(zero_block::<F>(lanes, plane));
        gvs.push(zero_block::<F>(lanes, plane));
    }
    let mut acc = zero_block::<F>(lanes, plane);
    for g in 0..group {
        let h = hk * group + g;
        let head_rows = (b * heads + h) * t;
        let (q_base, g_base) = (row_start::<E>(q, b, h, 0), row_start::<E>(dout, b, h, 0));
        let mut hash = 0u32;
        if dropping {
            hash = head_hash(&drop, b, h);
        }
        // The query tiles from this cube's first key on: earlier rows see none of its keys.
        for qt in key0 / qrows..t.div_ceil(qrows) {
            let q0 = qt * qrows;
            load_rows::<E>(q, q_base, q0, t, &mut qs, qrows, d, units);
            load_rows::<E>(dout, g_base, q0, t, &mut gs, qrows, d, units);
            row_stats::<F, I>(
                lse, delta, starts, &mut lrow, &mut drow, &mut frow, head_rows, b, t, q0, qrows,
                units, within,
            );
            sync_cube();
            #[unroll]
            for j in 0..chunks {
                rows_by_rows::<E, F>(&mut acc, &ks, p0, &qs, comptime!(j * M), d, plane);
                put::<F>(&mut ss, &acc, p0, comptime!(j * M), qrows, plane);
                rows_by_rows::<E, F>(&mut acc, &vs, p0, &gs, comptime!(j * M), d, plane);
                put::<F>(&mut dps, &acc, p0, comptime!(j * M), qrows, plane);
            }
            sync_cube();
            grads_rows::<E, F>(
                &ss, &dps, &mut ps, &mut dss, &lrow, &drow, &frow, &drop, hash, t, q0, key0, scale,
                rows, qrows, units, false, dropping,
            );
            sync_cube();
            #[unroll]
            for c in 0..comptime!(d / M) {
                weights_by_tile::<E, F>(
                    gvs.index_mut(c),
                    &ps,
                    p0,
                    &gs,
                    comptime!(c * M),
                    qrows,
                    d,
                    plane,
                );
                weights_by_tile::<E, F>(
                    gks.index_mut(c),
                    &dss,
                    p0,
                    &qs,
                    comptime!(c * M),
                    qrows,
                    d,
                    plane,
                );
            }
            sync_cube();
        }
    }
    store_blocks::<E, F>(&gks, &mut ss, dk, b, hk, key0, t, scale, qrows, d, plane);
    store_blocks::<E, F>(
        &gvs,
        &mut ss,
        dv,
        b,
        hk,
        key0,
        t,
        F::new(1.0),
        qrows,
        d,
        plane,
    );
}
