//! The attention kernels themselves (see the module's page for what each computes): the
//! forward's online softmax, `dq` by query tiles, `dk` and `dv` by key tiles, and the dropout
//! mask each recomputes from its seed.
//!
//! Each kernel's work is matrix products on tiles in shared memory, cut in blocks of 4 × 4: a
//! unit computes 16 scores (4 rows × 4 keys, [`block_dots`]) and adds to 16 outputs (4 rows ×
//! 4 columns, [`block_product`]). A block's rows are `rows / 4` apart, not side by side, so that
//! the units of a warp read rows that lie in different banks of shared memory; a tile's row is
//! padded by one vector for the same reason. Rows and sums are vectors of four floats ([`V`]):
//! a row of `d` floats is `d / 4` vectors, rounded up, the last padded with zeros.

use cubecl::prelude::*;

/// [`mix`] in a kernel.
#[cube]
pub(crate) fn mix_in(x: u32) -> u32 {
    let mut x = x;
    x ^= x >> 16;
    x *= 0x7feb_352d;
    x ^= x >> 15;
    x *= 0x846c_a68b;
    x ^ (x >> 16)
}

/// The hash of local head `h` of batch row `b` under the draw's seed, by its place in the whole
/// (`b · heads + first_head + h`).
#[cube]
pub(super) fn head_hash(drop: &DropArgs, b: usize, h: usize) -> u32 {
    let bh = (b * drop.heads as usize + drop.first_head as usize + h) as u32;
    mix_in(drop.seed_a ^ mix_in(drop.seed_b ^ bh))
}

/// The factor of the weight of the row hashed `row` on the key hashed `key` (`mix_in(j)`):
/// `inv_keep` kept, 0 dropped.
#[cube]
pub(super) fn kept_factor<F: Float>(row: u32, key: u32, threshold: u32, inv_keep: F) -> F {
    let mut z = inv_keep;
    if (mix_in(row ^ key) >> 8) < threshold {
        z = F::new(0.0);
    }
    z
}

/// `AttentionDropout` as the kernels read it.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct DropArgs {
    /// The seed's low 32 bits.
    pub seed_a: u32,
    /// Its high 32 bits.
    pub seed_b: u32,
    /// A weight whose hash's top 24 bits fall below it is dropped.
    pub threshold: u32,
    /// The factor of a kept weight.
    pub inv_keep: f32,
    /// The first of these heads in the whole.
    pub first_head: u32,
    /// The heads of the whole.
    pub heads: u32,
}

/// The start of each row's keys: `starts[b, i]` within documents, else 0.
#[cube]
pub(super) fn first_key<I: Numeric>(
    starts: &Tensor<I>,
    at: usize,
    live: bool,
    #[comptime] within: bool,
) -> usize {
    let mut first = 0usize;
    if within && live {
        first = u32::cast_from(starts[at]) as usize;
    }
    first
}

/// Four floats: the cube's tiles in shared memory and a unit's sums are held as these.
type V<F> = Vector<F, Const<4>>;

/// The sum of a vector's four lanes.
#[cube]
fn lanes<F: Float>(x: V<F>) -> F {
    (x.extract(0usize) + x.extract(1usize)) + (x.extract(2usize) + x.extract(3usize))
}

/// A `[rows, d]` tile of a head's rows in shared memory, `d / 4` vectors a row (rounded up) and
/// one more: rows a vector apart in memory's banks, so that units reading the same column of
/// different rows do not wait on each other.
#[cube]
fn tile_at(row: usize, c4: usize, #[comptime] d: usize) -> usize {
    row * comptime!(d.div_ceil(4) + 1) + c4
}

/// Rows `row0 ..` of a `[t, d]` slab at `base` (a head's rows, `from.stride(2)` apart) into
/// `tile` ([`tile_at`]'s layout, in the arithmetic's float type), times `scale`, zeros past `t`
/// and past `d`; the cube's `units` units take consecutive vectors.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<E: Float, F: Float>(
    from: &Tensor<E>,
    base: usize,
    row0: usize,
    t: usize,
    scale: F,
    tile: &mut [V<F>],
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
) {
    let d4 = comptime!(d.div_ceil(4));
    let stride = from.stride(2);
    let mut idx = UNIT_POS_X as usize;
    while idx < comptime!(rows * d4) {
        let row = idx / d4;
        let c4 = idx % d4;
        let at = base + (row0 + row) * stride + c4 * 4;
        let live = row0 + row < t;
        let mut x = V::<F>::empty();
        #[unroll]
        for lane in 0..4 {
            let mut y = F::new(0.0);
            if live && c4 * 4 + lane < d {
                y = F::cast_from(from[at + lane]) * scale;
            }
            x.insert(lane, y);
        }
        tile[tile_at(row, c4, d)] = x;
        idx += units;
    }
}

/// The 16 dot products of rows `r + nb·a` of tile `x` with rows `c + nb·e` of tile `y`
/// (`a`, `e` < 4) into `s[4a + e]`: eight reads of shared memory feed 64 multiply-adds.
/// (Rows `nb` apart rather than side by side: the units of a warp then read rows of `y` in
/// different banks.)
#[cube]
fn block_dots<F: Float>(
    x: &[V<F>],
    y: &[V<F>],
    r: usize,
    c: usize,
    s: &mut Array<F>,
    #[comptime] nb: usize,
    #[comptime] d: usize,
) {
    let d4 = comptime!(d.div_ceil(4));
    let (xr, yr) = (tile_at(r, 0, d), tile_at(c, 0, d));
    let mut acc = Array::<V<F>>::new(16usize);
    #[unroll]
    for z in 0..16 {
        acc[z] = V::<F>::new(F::new(0.0));
    }
    let mut xa = Array::<V<F>>::new(4usize);
    for c4 in 0..d4 {
        #[unroll]
        for a in 0..4 {
            xa[a] = x[xr + comptime!(nb * a * (d4 + 1)) + c4];
        }
        #[unroll]
        for e in 0..4 {
            let ye = y[yr + comptime!(nb * e * (d4 + 1)) + c4];
            #[unroll]
            for a in 0..4 {
                acc[comptime!(a * 4 + e)] += xa[a] * ye;
            }
        }
    }
    #[unroll]
    for z in 0..16 {
        s[z] = lanes::<F>(acc[z]);
    }
}

/// `acc[4n + a] += Σ_c Σ_e w[r + nb·a][c].e · tile[c + nb·e][cv]`: a block of 4 rows of weights
/// (`w`, `[rows, nb + 1]` vectors, lane `e` of vector `c` the weight of row `c + nb·e`) times a
/// vector column `cv` of a tile ([`tile_at`]'s layout).
#[cube]
fn block_product<F: Float>(
    acc: &mut Array<V<F>>,
    w: &[V<F>],
    tile: &[V<F>],
    r: usize,
    cv: usize,
    #[comptime] n: usize,
    #[comptime] nb: usize,
    #[comptime] d: usize,
) {
    let pw = comptime!(nb + 1);
    let sv = comptime!(d.div_ceil(4) + 1);
    let mut wa = Array::<V<F>>::new(4usize);
    for c in 0..nb {
        #[unroll]
        for a in 0..4 {
            wa[a] = w[(r + comptime!(nb * a)) * pw + c];
        }
        #[unroll]
        for e in 0..4 {
            let y = tile[(c + comptime!(nb * e)) * sv + cv];
            #[unroll]
            for a in 0..4 {
                acc[comptime!(n * 4 + a)] += V::<F>::new(wa[a].extract(e)) * y;
            }
        }
    }
}

/// The 16 values `s[4a + e]` as four vectors, row `r + nb·a` of `w` at column vector `c`.
#[cube]
fn put_block<F: Float>(w: &mut [V<F>], s: &Array<F>, r: usize, c: usize, #[comptime] nb: usize) {
    #[unroll]
    for a in 0..4usize {
        let mut x = V::<F>::empty();
        #[unroll]
        for e in 0..4usize {
            x.insert(e, s[comptime!(a * 4 + e)]);
        }
        w[(r + comptime!(nb * a)) * comptime!(nb + 1) + c] = x;
    }
}

/// Zeros.
#[cube]
fn zeros<F: Float>(acc: &mut Array<V<F>>, #[comptime] len: usize) {
    #[unroll]
    for z in 0..len {
        acc[z] = V::<F>::new(F::new(0.0));
    }
}

/// Where row `i` of head `h` of batch row `b` starts in `x` (`[B, H, T, D]` in any layout whose
/// last dimension is contiguous).
#[cube]
pub(super) fn row_start<E: Float>(x: &Tensor<E>, b: usize, h: usize, i: usize) -> usize {
    b * x.stride(0) + h * x.stride(1) + i * x.stride(2)
}

/// `x` (times `scale`), column vector `cv` of a row, to `to` at `row` (the row's start), the
/// columns past `d` left out.
#[cube]
fn store_vector<E: Float, F: Float>(
    to: &mut Tensor<E>,
    row: usize,
    cv: usize,
    x: V<F>,
    scale: F,
    #[comptime] d: usize,
) {
    #[unroll]
    for lane in 0..4 {
        if cv * 4 + lane < d {
            to[row + cv * 4 + lane] = E::cast_from(x.extract(lane) * scale);
        }
    }
}

/// The forward's rows after a tile of scores (`ps`, [`put_block`]'s layout): each row's
/// largest score so far (`ms`), its weights through the dropout (into `ps`), their sum (`ls`,
/// the earlier sum rescaled) and the rescale of what was summed before (`cs`), a unit a row.
/// `b`: the batch row; `row0`, `key0`: the tile's first row and its first key.
#[cube]
#[allow(clippy::too_many_arguments)]
fn softmax_rows<F: Float, I: Numeric>(
    ps: &mut [V<F>],
    ms: &mut [F],
    ls: &mut [F],
    cs: &mut [F],
    starts: &Tensor<I>,
    drop: &DropArgs,
    hash: u32,
    b: usize,
    t: usize,
    row0: usize,
    key0: usize,
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
) {
    let nb = comptime!(rows / 4);
    let pw = comptime!(nb + 1);
    let inv_keep = F::cast_from(drop.inv_keep);
    let mut r = UNIT_POS_X as usize;
    while r < rows {
        let i = row0 + r;
        let first = first_key::<I>(starts, b * t + i, i < t, within);
        let m_old = ms[r];
        let mut m = m_old;
        for c in 0..nb {
            let x = ps[r * pw + c];
            #[unroll]
            for e in 0..4 {
                let j = key0 + c + comptime!(nb * e);
                let xe = x.extract(e);
                if j <= i && j >= first && xe > m {
                    m = xe;
                }
            }
        }
        let mut row_hash = 0u32;
        if dropping {
            row_hash = mix_in(hash ^ i as u32);
        }
        let mut sum = F::new(0.0);
        for c in 0..nb {
            let x = ps[r * pw + c];
            let mut p = V::<F>::empty();
            #[unroll]
            for e in 0..4 {
                let j = key0 + c + comptime!(nb * e);
                let mut pe = F::new(0.0);
                if j <= i && j >= first {
                    pe = (x.extract(e) - m).exp();
                }
                sum += pe;
                if dropping {
                    pe *= kept_factor::<F>(row_hash, mix_in(j as u32), drop.threshold, inv_keep);
                }
                p.insert(e, pe);
            }
            ps[r * pw + c] = p;
        }
        let corr = (m_old - m).exp();
        ls[r] = ls[r] * corr + sum;
        ms[r] = m;
        cs[r] = corr;
        r += units;
    }
}

/// A cube per (tile of `rows` query rows, head, batch row) of `units` units. For each tile of
/// keys up to the diagonal: the scores, a 4 × 4 block a unit, into shared memory; each row's
/// online softmax (its largest score, weights and sum) by a unit a row; then the output, 4 rows
/// × 4 columns a unit, rescaled and added the weights times the values. Writes the output and
/// each row's log-sum-exp.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_kernel<E: Float, F: Float, I: Numeric>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    starts: &Tensor<I>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<F>,
    scale: f32,
    drop: DropArgs,
    #[comptime] d: usize,
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let d4 = comptime!(d.div_ceil(4));
    let nb = comptime!(rows / 4);
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let (b, h) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let hk = h / (heads / kv_heads);
    let row0 = CUBE_POS_X as usize * rows;
    let u = UNIT_POS_X as usize;
    let mut qs = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut ks = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut vs = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut ps = Shared::<[V<F>]>::new_slice(comptime!(rows * (nb + 1)));
    let mut ms = Shared::<[F]>::new_slice(rows);
    let mut ls = Shared::<[F]>::new_slice(rows);
    let mut cs = Shared::<[F]>::new_slice(rows);
    let q_base = row_start::<E>(q, b, h, 0);
    load_tile::<E, F>(
        q,
        q_base,
        row0,
        t,
        F::cast_from(scale),
        &mut qs,
        rows,
        d,
        units,
    );
    let mut r = u;
    while r < rows {
        ms[r] = F::new(-1.0e30);
        ls[r] = F::new(0.0);
        r += units;
    }
    let mut acc = Array::<V<F>>::new(comptime!((nb * d4).div_ceil(units) * 4));
    zeros::<F>(&mut acc, comptime!((nb * d4).div_ceil(units) * 4));
    let mut s = Array::<F>::new(16usize);
    let mut hash = 0u32;
    if dropping {
        hash = head_hash(&drop, b, h);
    }
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    // The keys any row of this cube sees end before its last row + 1.
    let mut last = row0 + rows;
    if last > t {
        last = t;
    }
    let tiles = last.div_ceil(rows);
    for kt in 0..tiles {
        let key0 = kt * rows;
        load_tile::<E, F>(k, k_base, key0, t, F::new(1.0), &mut ks, rows, d, units);
        load_tile::<E, F>(v, v_base, key0, t, F::new(1.0), &mut vs, rows, d, units);
        sync_cube();
        #[unroll]
        for n in 0..comptime!((nb * nb).div_ceil(units)) {
            let blk = u + comptime!(n * units);
            if blk < comptime!(nb * nb) {
                let (br, bc) = (blk / nb, blk % nb);
                block_dots::<F>(&qs, &ks, br, bc, &mut s, nb, d);
                put_block::<F>(&mut ps, &s, br, bc, nb);
            }
        }
        sync_cube();
        softmax_rows::<F, I>(
            &mut ps, &mut ms, &mut ls, &mut cs, starts, &drop, hash, b, t, row0, key0, rows, units,
            within, dropping,
        );
        sync_cube();
        #[unroll]
        for n in 0..comptime!((nb * d4).div_ceil(units)) {
            let blk = u + comptime!(n * units);
            if blk < comptime!(nb * d4) {
                let (br, cv) = (blk / d4, blk % d4);
                #[unroll]
                for a in 0..4 {
                    acc[comptime!(n * 4 + a)] *= V::<F>::new(cs[br + comptime!(nb * a)]);
                }
                block_product::<F>(&mut acc, &ps, &vs, br, cv, n, nb, d);
            }
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
    #[unroll]
    for n in 0..comptime!((nb * d4).div_ceil(units)) {
        let blk = u + comptime!(n * units);
        if blk < comptime!(nb * d4) {
            let (br, cv) = (blk / d4, blk % d4);
            #[unroll]
            for a in 0..4 {
                let r = br + comptime!(nb * a);
                let i = row0 + r;
                if i < t {
                    let at = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
                    let x = acc[comptime!(n * 4 + a)];
                    store_vector::<E, F>(out, at, cv, x, F::new(1.0) / ls[r], d);
                }
            }
        }
    }
}

/// A block of 4 query rows (`br + nb·a` of the tile from row `q0`) × 4 keys (`bc + nb·e` of
/// the tile from `key0`) of batch row `b`, given its scores `s` and `dout·vᵀ` `dp`: the weights
/// through the dropout into `s` and `p (dp − δ)` into `dp` (`p` the weight before the
/// dropout), zeros where a row does not see a key; `lrow` and `drow` the query tile's rows'
/// log-sum-exp and δ.
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_grads<F: Float, I: Numeric>(
    s: &mut Array<F>,
    dp: &mut Array<F>,
    lrow: &[F],
    drow: &[F],
    starts: &Tensor<I>,
    drop: &DropArgs,
    hash: u32,
    b: usize,
    t: usize,
    q0: usize,
    key0: usize,
    br: usize,
    bc: usize,
    #[comptime] nb: usize,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
) {
    let inv_keep = F::cast_from(drop.inv_keep);
    #[unroll]
    for a in 0..4 {
        let r = br + comptime!(nb * a);
        let i = q0 + r;
        let first = first_key::<I>(starts, b * t + i, i < t, within);
        let (li, di) = (lrow[r], drow[r]);
        let mut row_hash = 0u32;
        if dropping {
            row_hash = mix_in(hash ^ i as u32);
        }
        #[unroll]
        for e in 0..4 {
            let j = key0 + bc + comptime!(nb * e);
            let z = comptime!(a * 4 + e);
            let mut pz = F::new(0.0);
            let mut gz = F::new(0.0);
            if i < t && j <= i && j >= first {
                let p = (s[z] - li).exp();
                let mut f = F::new(1.0);
                if dropping {
                    f = kept_factor::<F>(row_hash, mix_in(j as u32), drop.threshold, inv_keep);
                }
                pz = p * f;
                gz = p * (dp[z] * f - di);
            }
            s[z] = pz;
            dp[z] = gz;
        }
    }
}

/// A cube per (tile of query rows, head, batch row): `dq_i = scale · Σ_j p_ij (dout_i·v_j − δ_i)
/// k_j`, `p_ij = exp(scale·q_i·k_j − lse_i)`, `δ_i = dout_i·out_i`, which it writes to `delta`
/// for [`dkv_kernel`]. For each key tile up to the diagonal: the scores and `dout·vᵀ`, a 4 × 4
/// block a unit, give `p (dp − δ)` in shared memory; then `dq`'s blocks of 4 rows × 4 columns
/// add it times the keys.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn dq_kernel<E: Float, F: Float, I: Numeric>(
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
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let d4 = comptime!(d.div_ceil(4));
    let nb = comptime!(rows / 4);
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let (b, h) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let hk = h / (heads / kv_heads);
    let row0 = CUBE_POS_X as usize * rows;
    let u = UNIT_POS_X as usize;
    let head_rows = (b * heads + h) * t;
    let scale = F::cast_from(scale);
    let mut qs = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut gs = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut ks = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut vs = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut dss = Shared::<[V<F>]>::new_slice(comptime!(rows * (nb + 1)));
    let mut lrow = Shared::<[F]>::new_slice(rows);
    let mut drow = Shared::<[F]>::new_slice(rows);
    let (q_base, g_base) = (row_start::<E>(q, b, h, 0), row_start::<E>(dout, b, h, 0));
    load_tile::<E, F>(q, q_base, row0, t, scale, &mut qs, rows, d, units);
    load_tile::<E, F>(dout, g_base, row0, t, F::new(1.0), &mut gs, rows, d, units);
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
        r += units;
    }
    let mut acc = Array::<V<F>>::new(comptime!((nb * d4).div_ceil(units) * 4));
    zeros::<F>(&mut acc, comptime!((nb * d4).div_ceil(units) * 4));
    let mut s = Array::<F>::new(16usize);
    let mut dp = Array::<F>::new(16usize);
    let mut hash = 0u32;
    if dropping {
        hash = head_hash(&drop, b, h);
    }
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    let mut last = row0 + rows;
    if last > t {
        last = t;
    }
    let tiles = last.div_ceil(rows);
    for kt in 0..tiles {
        let key0 = kt * rows;
        load_tile::<E, F>(k, k_base, key0, t, F::new(1.0), &mut ks, rows, d, units);
        load_tile::<E, F>(v, v_base, key0, t, F::new(1.0), &mut vs, rows, d, units);
        sync_cube();
        #[unroll]
        for n in 0..comptime!((nb * nb).div_ceil(units)) {
            let blk = u + comptime!(n * units);
            if blk < comptime!(nb * nb) {
                let (br, bc) = (blk / nb, blk % nb);
                block_dots::<F>(&qs, &ks, br, bc, &mut s, nb, d);
                block_dots::<F>(&gs, &vs, br, bc, &mut dp, nb, d);
                block_grads::<F, I>(
                    &mut s, &mut dp, &lrow, &drow, starts, &drop, hash, b, t, row0, key0, br, bc,
                    nb, within, dropping,
                );
                put_block::<F>(&mut dss, &dp, br, bc, nb);
            }
        }
        sync_cube();
        #[unroll]
        for n in 0..comptime!((nb * d4).div_ceil(units)) {
            let blk = u + comptime!(n * units);
            if blk < comptime!(nb * d4) {
                let (br, cv) = (blk / d4, blk % d4);
                block_product::<F>(&mut acc, &dss, &ks, br, cv, n, nb, d);
            }
        }
        sync_cube();
    }
    #[unroll]
    for n in 0..comptime!((nb * d4).div_ceil(units)) {
        let blk = u + comptime!(n * units);
        if blk < comptime!(nb * d4) {
            let (br, cv) = (blk / d4, blk % d4);
            #[unroll]
            for a in 0..4 {
                let i = row0 + br + comptime!(nb * a);
                if i < t {
                    let at = b * dq.stride(0) + h * dq.stride(1) + i * dq.stride(2);
                    store_vector::<E, F>(dq, at, cv, acc[comptime!(n * 4 + a)], scale, d);
                }
            }
        }
    }
}

/// A cube per (tile of key rows, key/value head, batch row), over every query head that reads
/// it and every query tile from the diagonal on: `dk_j = scale · Σ_i p_ij (dout_i·v_j − δ_i)
/// q_i` and `dv_j = Σ_i p_ij dout_i` (the weights through the dropout's mask; `δ` from
/// [`dq_kernel`]). For each query tile: the scores and `dout·vᵀ`, a 4 × 4 block a unit, give
/// the weights and `p (dp − δ)` in shared memory; then `dk`'s and `dv`'s blocks of 4 keys × 4
/// columns add them times the query rows and the output's gradient.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn dkv_kernel<E: Float, F: Float, I: Numeric>(
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
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let d4 = comptime!(d.div_ceil(4));
    let nb = comptime!(rows / 4);
    let pw = comptime!(nb + 1);
    let sv = comptime!(d4 + 1);
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let group = heads / kv_heads;
    let (b, hk) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let key0 = CUBE_POS_X as usize * rows;
    let u = UNIT_POS_X as usize;
    let scale = F::cast_from(scale);
    let mut ks = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut vs = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut qs = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut gs = Shared::<[V<F>]>::new_slice(comptime!(rows * (d4 + 1)));
    let mut ps = Shared::<[V<F>]>::new_slice(comptime!(rows * (nb + 1)));
    let mut dss = Shared::<[V<F>]>::new_slice(comptime!(rows * (nb + 1)));
    let mut lrow = Shared::<[F]>::new_slice(rows);
    let mut drow = Shared::<[F]>::new_slice(rows);
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    load_tile::<E, F>(k, k_base, key0, t, F::new(1.0), &mut ks, rows, d, units);
    load_tile::<E, F>(v, v_base, key0, t, F::new(1.0), &mut vs, rows, d, units);
    let mut gk = Array::<V<F>>::new(comptime!((nb * d4).div_ceil(units) * 4));
    let mut gv = Array::<V<F>>::new(comptime!((nb * d4).div_ceil(units) * 4));
    zeros::<F>(&mut gk, comptime!((nb * d4).div_ceil(units) * 4));
    zeros::<F>(&mut gv, comptime!((nb * d4).div_ceil(units) * 4));
    let mut s = Array::<F>::new(16usize);
    let mut dp = Array::<F>::new(16usize);
    let tiles = t.div_ceil(rows);
    for g in 0..group {
        let h = hk * group + g;
        let head_rows = (b * heads + h) * t;
        let (q_base, g_base) = (row_start::<E>(q, b, h, 0), row_start::<E>(dout, b, h, 0));
        let mut hash = 0u32;
        if dropping {
            hash = head_hash(&drop, b, h);
        }
        // The query tiles from this cube's first key on: earlier rows see none of its keys.
        for qt in CUBE_POS_X as usize..tiles {
            let q0 = qt * rows;
            load_tile::<E, F>(q, q_base, q0, t, scale, &mut qs, rows, d, units);
            load_tile::<E, F>(dout, g_base, q0, t, F::new(1.0), &mut gs, rows, d, units);
            let mut r = u;
            while r < rows {
                let i = q0 + r;
                let mut li = F::new(0.0);
                let mut di = F::new(0.0);
                if i < t {
                    li = lse[head_rows + i];
                    di = delta[head_rows + i];
                }
                lrow[r] = li;
                drow[r] = di;
                r += units;
            }
            sync_cube();
            #[unroll]
            for n in 0..comptime!((nb * nb).div_ceil(units)) {
                let blk = u + comptime!(n * units);
                if blk < comptime!(nb * nb) {
                    let (br, bc) = (blk / nb, blk % nb);
                    block_dots::<F>(&qs, &ks, br, bc, &mut s, nb, d);
                    block_dots::<F>(&gs, &vs, br, bc, &mut dp, nb, d);
                    block_grads::<F, I>(
                        &mut s, &mut dp, &lrow, &drow, starts, &drop, hash, b, t, q0, key0, br, bc,
                        nb, within, dropping,
                    );
                    put_block::<F>(&mut ps, &s, br, bc, nb);
                    put_block::<F>(&mut dss, &dp, br, bc, nb);
                }
            }
            sync_cube();
            #[unroll]
            for n in 0..comptime!((nb * d4).div_ceil(units)) {
                let blk = u + comptime!(n * units);
                if blk < comptime!(nb * d4) {
                    let (bk, cv) = (blk / d4, blk % d4);
                    for r in 0..rows {
                        let (pz, gz) = (ps[r * pw + bk], dss[r * pw + bk]);
                        let (dr, qr) = (gs[r * sv + cv], qs[r * sv + cv]);
                        #[unroll]
                        for e in 0..4 {
                            gv[comptime!(n * 4 + e)] += V::<F>::new(pz.extract(e)) * dr;
                            gk[comptime!(n * 4 + e)] += V::<F>::new(gz.extract(e)) * qr;
                        }
                    }
                }
            }
            sync_cube();
        }
    }
    #[unroll]
    for n in 0..comptime!((nb * d4).div_ceil(units)) {
        let blk = u + comptime!(n * units);
        if blk < comptime!(nb * d4) {
            let (bk, cv) = (blk / d4, blk % d4);
            #[unroll]
            for e in 0..4 {
                let j = key0 + bk + comptime!(nb * e);
                if j < t {
                    let k_at = b * dk.stride(0) + hk * dk.stride(1) + j * dk.stride(2);
                    let v_at = b * dv.stride(0) + hk * dv.stride(1) + j * dv.stride(2);
                    store_vector::<E, F>(dk, k_at, cv, gk[comptime!(n * 4 + e)], F::new(1.0), d);
                    store_vector::<E, F>(dv, v_at, cv, gv[comptime!(n * 4 + e)], F::new(1.0), d);
                }
            }
        }
    }
}
