//! The attention kernels themselves (see the module's page for what each computes): the
//! forward's online softmax, `dq` by query rows and `dk`/`dv` by key rows, and the dropout mask
//! each recomputes from its seed.

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

/// Rows `row0 ..` of a `[t, d]` slab at `base` (a head's rows, `from.stride(2)` apart) into
/// `tile` (`rows × d`, in the arithmetic's float type), zeros past `t`; every unit of the cube
/// takes part, consecutive units consecutive floats.
#[cube]
fn load_tile<E: Float, F: Float>(
    from: &Tensor<E>,
    base: usize,
    row0: usize,
    t: usize,
    scale: F,
    tile: &mut [F],
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    let stride = from.stride(2);
    let mut idx = UNIT_POS_X as usize;
    while idx < rows * d {
        let row = row0 + idx / d;
        let mut x = F::new(0.0);
        if row < t {
            x = F::cast_from(from[base + row * stride + idx % d]) * scale;
        }
        tile[idx] = x;
        idx += rows;
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
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let (b, h) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let hk = h / (heads / kv_heads);
    let row0 = CUBE_POS_X as usize * rows;
    let i = row0 + UNIT_POS_X as usize;
    let live = i < t;
    let row_at = (b * heads + h) * t + i;
    let q_at = row_start::<E>(q, b, h, i);
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    let scale = F::cast_from(scale);
    let mut qr = Array::<F>::new(d);
    let mut acc = Array::<F>::new(d);
    #[unroll]
    for c in 0..d {
        let mut x = F::new(0.0);
        if live {
            x = F::cast_from(q[q_at + c]) * scale;
        }
        qr[c] = x;
        acc[c] = F::new(0.0);
    }
    let first = first_key::<I>(starts, b * t + i, live, within);
    let inv_keep = F::cast_from(drop.inv_keep);
    let mut row_hash = 0u32;
    if dropping {
        row_hash = mix_in(head_hash(&drop, b, h) ^ i as u32);
    }
    let mut m = F::new(-1.0e30);
    let mut l = F::new(0.0);
    let mut ks = Shared::<[F]>::new_slice(rows * d);
    let mut vs = Shared::<[F]>::new_slice(rows * d);
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
                let r = (j - key0) * d;
                let mut s = F::new(0.0);
                #[unroll]
                for c in 0..d {
                    s += qr[c] * ks[r + c];
                }
                // A new largest score: what was summed so far is rescaled to it once.
                if s > m {
                    let corr = (m - s).exp();
                    l *= corr;
                    #[unroll]
                    for c in 0..d {
                        acc[c] *= corr;
                    }
                    m = s;
                }
                let p = (s - m).exp();
                l += p;
                let mut pz = p;
                if dropping {
                    pz = p * kept_factor::<F>(row_hash, mix_in(j as u32), drop.threshold, inv_keep);
                }
                #[unroll]
                for c in 0..d {
                    acc[c] += pz * vs[r + c];
                }
                j += 1;
            }
        }
        sync_cube();
    }
    if live {
        let inv = F::new(1.0) / l;
        let out_at = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
        #[unroll]
        for c in 0..d {
            out[out_at + c] = E::cast_from(acc[c] * inv);
        }
        lse[row_at] = m + l.ln();
    }
}

/// A cube per (query tile, head, batch row), a unit per query row:
/// `dq_i = scale · Σ_j p_ij (dout_i·v_j − δ_i) k_j`, `p_ij = exp(scale·q_i·k_j − lse_i)`,
/// `δ_i = dout_i·out_i`, which it writes to `delta` for [`dkv_kernel`].
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
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let (b, h) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let hk = h / (heads / kv_heads);
    let row0 = CUBE_POS_X as usize * rows;
    let i = row0 + UNIT_POS_X as usize;
    let live = i < t;
    let row_at = (b * heads + h) * t + i;
    let (q_at, o_at, g_at) = (
        row_start::<E>(q, b, h, i),
        row_start::<E>(out, b, h, i),
        row_start::<E>(dout, b, h, i),
    );
    let (k_base, v_base) = (row_start::<E>(k, b, hk, 0), row_start::<E>(v, b, hk, 0));
    let scale = F::cast_from(scale);
    let mut qr = Array::<F>::new(d);
    let mut gr = Array::<F>::new(d);
    let mut acc = Array::<F>::new(d);
    let mut li = F::new(0.0);
    let mut di = F::new(0.0);
    if live {
        li = lse[row_at];
    }
    #[unroll]
    for c in 0..d {
        let mut x = F::new(0.0);
        let mut g = F::new(0.0);
        if live {
            x = F::cast_from(q[q_at + c]) * scale;
            g = F::cast_from(dout[g_at + c]);
            di += g * F::cast_from(out[o_at + c]);
        }
        qr[c] = x;
        gr[c] = g;
        acc[c] = F::new(0.0);
    }
    if live {
        delta[row_at] = di;
    }
    let first = first_key::<I>(starts, b * t + i, live, within);
    let inv_keep = F::cast_from(drop.inv_keep);
    let mut row_hash = 0u32;
    if dropping {
        row_hash = mix_in(head_hash(&drop, b, h) ^ i as u32);
    }
    let mut ks = Shared::<[F]>::new_slice(rows * d);
    let mut vs = Shared::<[F]>::new_slice(rows * d);
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
                let r = (j - key0) * d;
                let mut s = F::new(0.0);
                let mut dp = F::new(0.0);
                #[unroll]
                for c in 0..d {
                    s += qr[c] * ks[r + c];
                    dp += gr[c] * vs[r + c];
                }
                if dropping {
                    dp *= kept_factor::<F>(row_hash, mix_in(j as u32), drop.threshold, inv_keep);
                }
                let ds = (s - li).exp() * (dp - di);
                #[unroll]
                for c in 0..d {
                    acc[c] += ds * ks[r + c];
                }
                j += 1;
            }
        }
        sync_cube();
    }
    if live {
        let dq_at = b * dq.stride(0) + h * dq.stride(1) + i * dq.stride(2);
        #[unroll]
        for c in 0..d {
            dq[dq_at + c] = E::cast_from(acc[c] * scale);
        }
    }
}

/// A cube per (key tile, key/value head, batch row), a unit per key row `j`, over every query
/// head that reads it and every query row `i ≥ j` that sees it:
/// `dv_j = Σ p_ij dout_i`, `dk_j = scale · Σ p_ij (dout_i·v_j − δ_i) q_i`.
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
    #[comptime] within: bool,
    #[comptime] dropping: bool,
    #[define(E, F, I)] _dtypes: [ElemType; 3],
) {
    let (heads, t, kv_heads) = (q.shape(1), q.shape(2), k.shape(1));
    let group = heads / kv_heads;
    let (b, hk) = (CUBE_POS_Z as usize, CUBE_POS_Y as usize);
    let key0 = CUBE_POS_X as usize * rows;
    let j = key0 + UNIT_POS_X as usize;
    let live = j < t;
    let (k_at, v_at) = (row_start::<E>(k, b, hk, j), row_start::<E>(v, b, hk, j));
    let scale = F::cast_from(scale);
    let mut kr = Array::<F>::new(d);
    let mut vr = Array::<F>::new(d);
    let mut gk = Array::<F>::new(d);
    let mut gv = Array::<F>::new(d);
    #[unroll]
    for c in 0..d {
        let mut x = F::new(0.0);
        let mut y = F::new(0.0);
        if live {
            x = F::cast_from(k[k_at + c]);
            y = F::cast_from(v[v_at + c]);
        }
        kr[c] = x;
        vr[c] = y;
        gk[c] = F::new(0.0);
        gv[c] = F::new(0.0);
    }
    let mut qs = Shared::<[F]>::new_slice(rows * d);
    let mut gs = Shared::<[F]>::new_slice(rows * d);
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
                        let r = ii * d;
                        let mut s = F::new(0.0);
                        let mut dp = F::new(0.0);
                        #[unroll]
                        for c in 0..d {
                            s += qs[r + c] * kr[c];
                            dp += gs[r + c] * vr[c];
                        }
                        let p = (s - lse[head_rows + i]).exp();
                        let mut pz = p;
                        if dropping {
                            let row_hash = mix_in(hash ^ i as u32);
                            let z = kept_factor::<F>(row_hash, key_hash, drop.threshold, inv_keep);
                            pz = p * z;
                            dp *= z;
                        }
                        let ds = p * (dp - delta[head_rows + i]);
                        #[unroll]
                        for c in 0..d {
                            gv[c] += pz * gs[r + c];
                            gk[c] += ds * qs[r + c];
                        }
                    }
                    i += 1;
                }
            }
            sync_cube();
        }
    }
    if live {
        let dk_at = b * dk.stride(0) + hk * dk.stride(1) + j * dk.stride(2);
        let dv_at = b * dv.stride(0) + hk * dv.stride(1) + j * dv.stride(2);
        #[unroll]
        for c in 0..d {
            dk[dk_at + c] = E::cast_from(gk[c]);
            dv[dv_at + c] = E::cast_from(gv[c]);
        }
    }
}
