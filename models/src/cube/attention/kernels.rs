//! The attention kernels themselves (see the module's page for what each computes): the
//! forward's online softmax, `dq` by query rows, `dk` and `dv` by key rows, and the dropout mask
//! each recomputes from its seed.
//!
//! A unit's rows and the cube's tiles are held as vectors of four floats ([`V`]): a row of `d`
//! floats is `d / 4` vectors (rounded up, the last padded with zeros), and every read of a tile
//! from shared memory — the same address for every unit of the cube — feeds four multiply-adds,
//! where a float at a time fed one and shared memory's reads were what a step waited on.

use cubecl::prelude::*;

/// [`mix`] in a kernel.
#[cube]
fn mix_in(x: u32) -> u32 {
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
fn head_hash(drop: &DropArgs, b: usize, h: usize) -> u32 {
    let bh = (b * drop.heads as usize + drop.first_head as usize + h) as u32;
    mix_in(drop.seed_a ^ mix_in(drop.seed_b ^ bh))
}

/// The factor of the weight of the row hashed `row` on the key hashed `key` (`mix_in(j)`):
/// `inv_keep` kept, 0 dropped.
#[cube]
fn kept_factor<F: Float>(row: u32, key: u32, threshold: u32, inv_keep: F) -> F {
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
fn first_key<I: Numeric>(
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

/// Four floats: a unit's rows and the cube's tiles in shared memory are held as these.
type V<F> = Vector<F, Const<4>>;

/// The sum of a vector's four lanes.
#[cube]
fn lanes<F: Float>(x: V<F>) -> F {
    (x.extract(0usize) + x.extract(1usize)) + (x.extract(2usize) + x.extract(3usize))
}

/// Zeros.
#[cube]
fn zeros<F: Float>(row: &mut Array<V<F>>, #[comptime] d: usize) {
    #[unroll]
    for c in 0..comptime!(d.div_ceil(4)) {
        row[c] = V::<F>::new(F::new(0.0));
    }
}

/// The `d` floats of `from` at `at`, times `scale`, into `row` (`d / 4` vectors rounded up);
/// zeros past `d`, and all zeros where `!live`. (The two conditions stay apart: the first is
/// decided as the kernel is expanded, the second as it runs.)
#[cube]
#[allow(clippy::collapsible_if)]
fn load_row<E: Float, F: Float>(
    from: &Tensor<E>,
    at: usize,
    live: bool,
    scale: F,
    row: &mut Array<V<F>>,
    #[comptime] d: usize,
) {
    #[unroll]
    for c4 in 0..comptime!(d.div_ceil(4)) {
        let mut x = V::<F>::empty();
        #[unroll]
        for lane in 0..4 {
            let mut y = F::new(0.0);
            if comptime!(c4 * 4 + lane < d) {
                if live {
                    y = F::cast_from(from[at + comptime!(c4 * 4 + lane)]) * scale;
                }
            }
            x.insert(lane, y);
        }
        row[c4] = x;
    }
}

/// `row`'s `d` floats (`scale` times) to `to` at `at`.
#[cube]
fn store_row<E: Float, F: Float>(
    row: &Array<V<F>>,
    scale: F,
    to: &mut Tensor<E>,
    at: usize,
    #[comptime] d: usize,
) {
    #[unroll]
    for c4 in 0..comptime!(d.div_ceil(4)) {
        let x = row[c4];
        #[unroll]
        for lane in 0..4 {
            if comptime!(c4 * 4 + lane < d) {
                to[at + comptime!(c4 * 4 + lane)] = E::cast_from(x.extract(lane) * scale);
            }
        }
    }
}

/// Rows `row0 ..` of a `[t, d]` slab at `base` (a head's rows, `from.stride(2)` apart) into
/// `tile` (`rows` rows of `d / 4` vectors rounded up, in the arithmetic's float type), times
/// `scale`, zeros past `t` and past `d`; every unit of the cube takes part, consecutive units
/// consecutive vectors.
#[cube]
fn load_tile<E: Float, F: Float>(
    from: &Tensor<E>,
    base: usize,
    row0: usize,
    t: usize,
    scale: F,
    tile: &mut [V<F>],
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    let d4 = comptime!(d.div_ceil(4));
    let stride = from.stride(2);
    let mut idx = UNIT_POS_X as usize;
    while idx < rows * d4 {
        let row = row0 + idx / d4;
        let c0 = (idx % d4) * 4;
        let at = base + row * stride + c0;
        let mut x = V::<F>::empty();
        #[unroll]
        for lane in 0..4 {
            let mut y = F::new(0.0);
            if row < t && c0 + lane < d {
                y = F::cast_from(from[at + lane]) * scale;
            }
            x.insert(lane, y);
        }
        tile[idx] = x;
        idx += rows;
    }
}

/// The dot product of `row` with row `r` of `tile`.
#[cube]
fn dot<F: Float>(row: &Array<V<F>>, tile: &[V<F>], r: usize, #[comptime] d: usize) -> F {
    let mut s = V::<F>::new(F::new(0.0));
    #[unroll]
    for c in 0..comptime!(d.div_ceil(4)) {
        s += row[c] * tile[r + c];
    }
    lanes::<F>(s)
}

/// `acc += x · (row r of tile)`.
#[cube]
fn add_scaled<F: Float>(
    acc: &mut Array<V<F>>,
    x: F,
    tile: &[V<F>],
    r: usize,
    #[comptime] d: usize,
) {
    let xv = V::<F>::new(x);
    #[unroll]
    for c in 0..comptime!(d.div_ceil(4)) {
        acc[c] += xv * tile[r + c];
    }
}

/// Where row `i` of head `h` of batch row `b` starts in `x` (`[B, H, T, D]` in any layout whose
/// last dimension is contiguous).
#[cube]
fn row_start<E: Float>(x: &Tensor<E>, b: usize, h: usize, i: usize) -> usize {
    b * x.stride(0) + h * x.stride(1) + i * x.stride(2)
}

/// A cube per (query tile, head, batch row), a unit per query row: the online softmax over
/// the keys `first ..= i`, loaded a tile at a time.
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
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let d4 = comptime!(d.div_ceil(4));
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let (b, h) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let hk = h / (heads / kv_heads);
    let row0 = CUBE_POS_X as usize * rows;
    let i = row0 + UNIT_POS_X as usize;
    let live = i < t;
    let row_at = (b * heads + h) * t + i;
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    let scale = F::cast_from(scale);
    let mut qr = Array::<V<F>>::new(d4);
    let mut acc = Array::<V<F>>::new(d4);
    load_row::<E, F>(q, row_start::<E>(q, b, h, i), live, scale, &mut qr, d);
    zeros::<F>(&mut acc, d);
    let first = first_key::<I>(starts, b * t + i, live, within);
    let inv_keep = F::cast_from(drop.inv_keep);
    let mut row_hash = 0u32;
    if dropping {
        row_hash = mix_in(head_hash(&drop, b, h) ^ i as u32);
    }
    let mut m = F::new(-1.0e30);
    let mut l = F::new(0.0);
    let mut ks = Shared::<[V<F>]>::new_slice(rows * d4);
    let mut vs = Shared::<[V<F>]>::new_slice(rows * d4);
    // The keys any row of this cube sees end before its last row + 1.
    let mut last = row0 + rows;
    if last > t {
        last = t;
    }
    let tiles = last.div_ceil(rows);
    for kt in 0..tiles {
        let key0 = kt * rows;
        load_tile::<E, F>(k, k_base, key0, t, F::new(1.0), &mut ks, rows, d);
        load_tile::<E, F>(v, v_base, key0, t, F::new(1.0), &mut vs, rows, d);
        sync_cube();
        if live {
            let mut j = key0;
            if j < first {
                j = first;
            }
            let mut end = key0 + rows;
            if end > i + 1 {
                end = i + 1;
            }
            while j < end {
                let r = (j - key0) * d4;
                let s = dot::<F>(&qr, &ks, r, d);
                // A new largest score: what was summed so far is rescaled to it once.
                if s > m {
                    let corr = (m - s).exp();
                    l *= corr;
                    let cv = V::<F>::new(corr);
                    #[unroll]
                    for c in 0..d4 {
                        acc[c] *= cv;
                    }
                    m = s;
                }
                let p = (s - m).exp();
                l += p;
                let mut pz = p;
                if dropping {
                    pz = p * kept_factor::<F>(row_hash, mix_in(j as u32), drop.threshold, inv_keep);
                }
                add_scaled::<F>(&mut acc, pz, &vs, r, d);
                j += 1;
            }
        }
        sync_cube();
    }
    if live {
        let out_at = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
        store_row::<E, F>(&acc, F::new(1.0) / l, out, out_at, d);
        lse[row_at] = m + l.ln();
    }
}

/// A cube per (query tile, head, batch row), a unit per query row:
/// `dq_i = scale · Σ_j p_ij (dout_i·v_j − δ_i) k_j`, `p_ij = exp(scale·q_i·k_j − lse_i)`,
/// `δ_i = dout_i·out_i`, which it writes to `delta` for [`dk_kernel`].
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
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let d4 = comptime!(d.div_ceil(4));
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let (b, h) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let hk = h / (heads / kv_heads);
    let row0 = CUBE_POS_X as usize * rows;
    let i = row0 + UNIT_POS_X as usize;
    let live = i < t;
    let row_at = (b * heads + h) * t + i;
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    let scale = F::cast_from(scale);
    let mut qr = Array::<V<F>>::new(d4);
    let mut gr = Array::<V<F>>::new(d4);
    let mut acc = Array::<V<F>>::new(d4);
    load_row::<E, F>(q, row_start::<E>(q, b, h, i), live, scale, &mut qr, d);
    load_row::<E, F>(
        dout,
        row_start::<E>(dout, b, h, i),
        live,
        F::new(1.0),
        &mut gr,
        d,
    );
    // δ_i: the output's row read as the gradient's, into acc before it sums.
    load_row::<E, F>(
        out,
        row_start::<E>(out, b, h, i),
        live,
        F::new(1.0),
        &mut acc,
        d,
    );
    let mut dd = V::<F>::new(F::new(0.0));
    #[unroll]
    for c in 0..d4 {
        dd += gr[c] * acc[c];
    }
    let di = lanes::<F>(dd);
    zeros::<F>(&mut acc, d);
    let mut li = F::new(0.0);
    if live {
        li = lse[row_at];
        delta[row_at] = di;
    }
    let first = first_key::<I>(starts, b * t + i, live, within);
    let inv_keep = F::cast_from(drop.inv_keep);
    let mut row_hash = 0u32;
    if dropping {
        row_hash = mix_in(head_hash(&drop, b, h) ^ i as u32);
    }
    let mut ks = Shared::<[V<F>]>::new_slice(rows * d4);
    let mut vs = Shared::<[V<F>]>::new_slice(rows * d4);
    let mut last = row0 + rows;
    if last > t {
        last = t;
    }
    let tiles = last.div_ceil(rows);
    for kt in 0..tiles {
        let key0 = kt * rows;
        load_tile::<E, F>(k, k_base, key0, t, F::new(1.0), &mut ks, rows, d);
        load_tile::<E, F>(v, v_base, key0, t, F::new(1.0), &mut vs, rows, d);
        sync_cube();
        if live {
            let mut j = key0;
            if j < first {
                j = first;
            }
            let mut end = key0 + rows;
            if end > i + 1 {
                end = i + 1;
            }
            while j < end {
                let r = (j - key0) * d4;
                let mut sv = V::<F>::new(F::new(0.0));
                let mut pv = V::<F>::new(F::new(0.0));
                #[unroll]
                for c in 0..d4 {
                    sv += qr[c] * ks[r + c];
                    pv += gr[c] * vs[r + c];
                }
                let s = lanes::<F>(sv);
                let mut dp = lanes::<F>(pv);
                if dropping {
                    dp *= kept_factor::<F>(row_hash, mix_in(j as u32), drop.threshold, inv_keep);
                }
                let ds = (s - li).exp() * (dp - di);
                add_scaled::<F>(&mut acc, ds, &ks, r, d);
                j += 1;
            }
        }
        sync_cube();
    }
    if live {
        let dq_at = b * dq.stride(0) + h * dq.stride(1) + i * dq.stride(2);
        store_row::<E, F>(&acc, scale, dq, dq_at, d);
    }
}

/// A cube per (key tile, key/value head, batch row), a unit per key row `j`, over every query
/// head that reads it and every query row `i ≥ j` that sees it:
/// `dk_j = scale · Σ p_ij (dout_i·v_j − δ_i) q_i` (`δ` from [`dq_kernel`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn dk_kernel<E: Float, F: Float, I: Numeric>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    dout: &Tensor<E>,
    lse: &Tensor<F>,
    delta: &Tensor<F>,
    starts: &Tensor<I>,
    dk: &mut Tensor<E>,
    scale: f32,
    drop: DropArgs,
    #[comptime] d: usize,
    #[comptime] rows: usize,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let d4 = comptime!(d.div_ceil(4));
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let group = heads / kv_heads;
    let (b, hk) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let j = CUBE_POS_X as usize * rows + UNIT_POS_X as usize;
    let live = j < t;
    let scale = F::cast_from(scale);
    let mut kr = Array::<V<F>>::new(d4);
    let mut vr = Array::<V<F>>::new(d4);
    let mut gk = Array::<V<F>>::new(d4);
    load_row::<E, F>(
        k,
        row_start::<E>(k, b, hk, j),
        live,
        F::new(1.0),
        &mut kr,
        d,
    );
    load_row::<E, F>(
        v,
        row_start::<E>(v, b, hk, j),
        live,
        F::new(1.0),
        &mut vr,
        d,
    );
    zeros::<F>(&mut gk, d);
    let mut qs = Shared::<[V<F>]>::new_slice(rows * d4);
    let mut gs = Shared::<[V<F>]>::new_slice(rows * d4);
    let tiles = t.div_ceil(rows);
    let inv_keep = F::cast_from(drop.inv_keep);
    let key_hash = mix_in(j as u32);
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
            load_tile::<E, F>(q, q_base, q0, t, scale, &mut qs, rows, d);
            load_tile::<E, F>(dout, g_base, q0, t, F::new(1.0), &mut gs, rows, d);
            sync_cube();
            if live {
                let mut i = q0;
                if j > q0 {
                    i = j;
                }
                let mut end = q0 + rows;
                if end > t {
                    end = t;
                }
                // A row's log-sum-exp, δ and first key are read where they are: every unit
                // reads the same row at once (shared memory holds the two tiles alone).
                while i < end {
                    let ii = i - q0;
                    let mut sees = true;
                    if within {
                        sees = u32::cast_from(starts[b * t + i]) as usize <= j;
                    }
                    if sees {
                        let r = ii * d4;
                        let mut sv = V::<F>::new(F::new(0.0));
                        let mut pv = V::<F>::new(F::new(0.0));
                        #[unroll]
                        for c in 0..d4 {
                            sv += qs[r + c] * kr[c];
                            pv += gs[r + c] * vr[c];
                        }
                        let p = (lanes::<F>(sv) - lse[head_rows + i]).exp();
                        let mut dp = lanes::<F>(pv);
                        if dropping {
                            let row_hash = mix_in(hash ^ i as u32);
                            dp *= kept_factor::<F>(row_hash, key_hash, drop.threshold, inv_keep);
                        }
                        add_scaled::<F>(&mut gk, p * (dp - delta[head_rows + i]), &qs, r, d);
                    }
                    i += 1;
                }
            }
            sync_cube();
        }
    }
    if live {
        let dk_at = b * dk.stride(0) + hk * dk.stride(1) + j * dk.stride(2);
        store_row::<E, F>(&gk, F::new(1.0), dk, dk_at, d);
    }
}

/// A cube per (key tile, key/value head, batch row), a unit per key row `j`, over every query
/// head that reads it and every query row `i ≥ j` that sees it: `dv_j = Σ p_ij dout_i` (the
/// weights through the dropout's mask).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn dv_kernel<E: Float, F: Float, I: Numeric>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    dout: &Tensor<E>,
    lse: &Tensor<F>,
    starts: &Tensor<I>,
    dv: &mut Tensor<E>,
    scale: f32,
    drop: DropArgs,
    #[comptime] d: usize,
    #[comptime] rows: usize,
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let d4 = comptime!(d.div_ceil(4));
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let group = heads / kv_heads;
    let (b, hk) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let j = CUBE_POS_X as usize * rows + UNIT_POS_X as usize;
    let live = j < t;
    let scale = F::cast_from(scale);
    let mut kr = Array::<V<F>>::new(d4);
    let mut gv = Array::<V<F>>::new(d4);
    load_row::<E, F>(
        k,
        row_start::<E>(k, b, hk, j),
        live,
        F::new(1.0),
        &mut kr,
        d,
    );
    zeros::<F>(&mut gv, d);
    let mut qs = Shared::<[V<F>]>::new_slice(rows * d4);
    let mut gs = Shared::<[V<F>]>::new_slice(rows * d4);
    let tiles = t.div_ceil(rows);
    let inv_keep = F::cast_from(drop.inv_keep);
    let key_hash = mix_in(j as u32);
    for g in 0..group {
        let h = hk * group + g;
        let head_rows = (b * heads + h) * t;
        let (q_base, g_base) = (row_start::<E>(q, b, h, 0), row_start::<E>(dout, b, h, 0));
        let mut hash = 0u32;
        if dropping {
            hash = head_hash(&drop, b, h);
        }
        for qt in CUBE_POS_X as usize..tiles {
            let q0 = qt * rows;
            load_tile::<E, F>(q, q_base, q0, t, scale, &mut qs, rows, d);
            load_tile::<E, F>(dout, g_base, q0, t, F::new(1.0), &mut gs, rows, d);
            sync_cube();
            if live {
                let mut i = q0;
                if j > q0 {
                    i = j;
                }
                let mut end = q0 + rows;
                if end > t {
                    end = t;
                }
                while i < end {
                    let ii = i - q0;
                    let mut sees = true;
                    if within {
                        sees = u32::cast_from(starts[b * t + i]) as usize <= j;
                    }
                    if sees {
                        let r = ii * d4;
                        let mut pz = (dot::<F>(&kr, &qs, r, d) - lse[head_rows + i]).exp();
                        if dropping {
                            let row_hash = mix_in(hash ^ i as u32);
                            pz *= kept_factor::<F>(row_hash, key_hash, drop.threshold, inv_keep);
                        }
                        add_scaled::<F>(&mut gv, pz, &gs, r, d);
                    }
                    i += 1;
                }
            }
            sync_cube();
        }
    }
    if live {
        let dv_at = b * dv.stride(0) + hk * dv.stride(1) + j * dv.stride(2);
        store_row::<E, F>(&gv, F::new(1.0), dv, dv_at, d);
    }
}
