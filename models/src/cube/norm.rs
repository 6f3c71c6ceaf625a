//! LayerNorm and RMSNorm on a GPU, forward and backward a kernel each.
//!
//! Burn composes both norms from a dozen tensor ops, and its autodiff differentiates each:
//! `mean_dim`'s backward alone is a fill, a scaling, a sum over a dimension of one and a
//! product. Fusion compiles the forward (a reduction with the element-wise ops before it, and
//! the scale by `γ` a launch of its own), but only where an element-wise op comes first: a
//! reduction may not start a fused block, so a norm after a kernel of kiln's (the dropout's)
//! ran op by op, eight launches. The backward's chain of about twenty ops, reductions among
//! them, ran op by op everywhere: CubeCL's profile of the small GPT on CubeCL's CPU runtime
//! showed each LayerNorm's backward as about twenty launches (BENCHMARKS.md).
//!
//! Here both are kernels tiled alike ([`NormTiling`]): a cube of units per [`NormTiling::rows`]
//! rows, each row's statistics from the cube's sums in shared memory, `Σ x` and
//! `Σ (x − mean)²` (RMSNorm's `Σ x²`). The forward ([`CubeNormOps::kiln_norm_forward`]) writes
//! `(x − mean) / σ · γ + β`. The backward ([`CubeNormOps::kiln_norm_backward`]) computes the
//! statistics again and then `Σ g` and `Σ g·x̂` (`g = dy·γ`), and writes
//! `dx = (g − mean(g) − x̂·mean(g·x̂)) / σ` (RMSNorm: without `mean(g)`); over its rows each
//! unit adds up its columns' `dy·x̂` and `dy`, the cube's row of sums that one reduction over
//! the cubes makes `dγ` and `dβ`. Nothing is kept from the forward but `x` and `γ`. The
//! arithmetic is f32 for every float type; `x`, `y`, `dy` and `dx` stay in theirs.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape};
use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The rows a cube of the backward takes at least.
const LEAST_ROWS: usize = 32;

/// The most cubes the backward launches (WGPU's limit on a dimension of the cube count).
const MOST_CUBES: usize = 65_535;

/// How the backward covers `x` as `[N, C]` (its last dimension, N rows the others): cubes of `units` units (a power of two), each unit
/// `per_unit` columns of a row (`u`, `u + units`, …), each cube `rows` rows in turn; `cubes`
/// cubes, whose sums of `dy·x̂` and `dy` are `cubes` rows to add up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormTiling {
    /// Rows a cube takes, one after another.
    pub rows: usize,
    /// Units in a cube.
    pub units: usize,
    /// Columns a unit takes in each row.
    pub per_unit: usize,
    /// Cubes launched.
    pub cubes: usize,
}

impl NormTiling {
    /// The tiling for `n` rows of `c` columns (both at least one) on a device whose cubes hold
    /// `most_units` units: about eight columns a unit, 32 to 256 units (fewer where the device
    /// holds fewer: CubeCL's CPU runtime, a unit a core); 32 rows a cube, more where the cubes
    /// would pass 65,535 (WGPU's limit on a dimension of the cube count).
    pub fn new(n: usize, c: usize, most_units: usize) -> Self {
        let fit = 1 << most_units.max(1).ilog2();
        let units = c.div_ceil(8).next_power_of_two().clamp(32, 256).min(fit);
        let (rows, cubes) = Self::cubes(n);
        Self {
            rows,
            units,
            per_unit: c.div_ceil(units).max(1),
            cubes,
        }
    }

    /// The rows a cube takes and the cubes for `n` rows (whatever the units).
    fn cubes(n: usize) -> (usize, usize) {
        let mut rows = LEAST_ROWS;
        while n.div_ceil(rows) > MOST_CUBES {
            rows *= 2;
        }
        (rows, n.div_ceil(rows).max(1))
    }
}

/// The norms on a CubeCL device.
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait CubeNormOps: Backend {
    /// The gradients of a norm with `epsilon` over the rows of `x` (`[…, C]`) from the
    /// output's `dy` and the scale `gamma` (`[C]`): `dx` (`x`'s dtype) and each cube's sums of
    /// `dy·x̂` and of `dy` over its rows (`[cubes, C]`, f32, [`NormTiling`]). Not
    /// differentiated.
    #[fusion(meta = |_dy, x, _gamma, _epsilon, _rms| {
        let c = x.shape[x.shape.num_dims() - 1];
        let cubes = NormTiling::cubes(x.shape.num_elements() / c.max(1)).1;
        let sums = TensorSpec::new(Shape::new([cubes, c]), DType::F32);
        (x.clone(), sums.clone(), sums)
    })]
    fn kiln_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// LayerNorm (`rms` false) or RMSNorm over the rows of `x` (`[…, C]`), scaled by `gamma`
    /// and, where `shift`, shifted by `beta` (`[C]`, `gamma`'s dtype; unread otherwise), in
    /// `x`'s dtype. Not differentiated.
    #[fusion(dtype = x, shape = x)]
    fn kiln_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        rms: bool,
        shift: bool,
    ) -> FloatTensor<Self>;

    /// [`CubeNormOps::kiln_norm_forward`], differentiated in `x`, `gamma` and `beta` through
    /// [`CubeNormOps::kiln_norm_backward`].
    #[fusion(default)]
    fn kiln_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        rms: bool,
        shift: bool,
    ) -> FloatTensor<Self> {
        Self::kiln_norm_forward(x, gamma, beta, epsilon, rms, shift)
    }
}

/// `a` and `b` summed over the cube's units (`sums`: `2·units` places), every unit given the
/// two sums.
#[cube]
fn cube_sums<F: Float>(sums: &mut [F], a: F, b: F, u: usize, #[comptime] units: usize) -> (F, F) {
    sums[u] = a;
    sums[units + u] = b;
    sync_cube();
    fold(sums, u, units, 128usize);
    fold(sums, u, units, 64usize);
    fold(sums, u, units, 32usize);
    fold(sums, u, units, 16usize);
    fold(sums, u, units, 8usize);
    fold(sums, u, units, 4usize);
    fold(sums, u, units, 2usize);
    fold(sums, u, units, 1usize);
    let totals = (sums[0], sums[units]);
    // Every unit has read the sums before they are written again.
    sync_cube();
    totals
}

/// The cube's two sums (`sums[..units]`, `sums[units..]`) folded from `2·half` units' places
/// into `half`'s, where the cube has more than `half` units.
#[cube]
fn fold<F: Float>(sums: &mut [F], u: usize, #[comptime] units: usize, #[comptime] half: usize) {
    if comptime!(units > half) {
        if u < half {
            let a = sums[u + half];
            let b = sums[units + u + half];
            sums[u] += a;
            sums[units + u] += b;
        }
        sync_cube();
    }
}

/// Row `row` of `x` (`C` columns, contiguous) into `xh` (a unit's columns `u`, `u + units`, …;
/// 0 where past the row or `live` is false) and its mean (0 for RMSNorm) and the mean of the
/// squares about it, from the cube's sums in `sums`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn row_stats<E: Float, F: Float>(
    x: &Tensor<E>,
    xh: &mut Array<F>,
    sums: &mut [F],
    row: usize,
    live: bool,
    c: usize,
    u: usize,
    #[comptime] units: usize,
    #[comptime] per_unit: usize,
    #[comptime] rms: bool,
) -> (F, F) {
    let zero = F::new(0.0);
    let inv_c = F::new(1.0) / F::cast_from(c as u32);
    let mut s = zero;
    #[unroll]
    for k in 0..per_unit {
        let col = u + k * units;
        xh[k] = zero;
        if live && col < c {
            xh[k] = F::cast_from(x[row * c + col]);
            s += xh[k];
        }
    }
    let mut m = zero;
    if !rms {
        let (total, _) = cube_sums(sums, s, zero, u, units);
        m = total * inv_c;
    }
    let mut q = zero;
    #[unroll]
    for k in 0..per_unit {
        let col = u + k * units;
        if live && col < c {
            let d = xh[k] - m;
            q += d * d;
        }
    }
    let (squares, _) = cube_sums(sums, q, zero, u, units);
    (m, squares * inv_c)
}

/// The forward, tiled as the backward ([`NormTiling`]): for each row, the mean and the
/// squares' mean from the cube's sums ([`row_stats`]), then `y = (x − mean) / √(var + ε) · γ
/// (+ β)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn norm_forward_kernel<E: Float, G: Float, F: Float>(
    x: &Tensor<E>,
    gamma: &Tensor<G>,
    beta: &Tensor<G>,
    y: &mut Tensor<E>,
    n: u32,
    c: u32,
    epsilon: f32,
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] per_unit: usize,
    #[comptime] rms: bool,
    #[comptime] shift: bool,
    #[define(E, G, F)] _dtypes: [ElemType; 3],
) {
    let c = c as usize;
    let n = n as usize;
    let u = UNIT_POS_X as usize;
    let cube = CUBE_POS_X as usize;
    let mut sums = Shared::<[F]>::new_slice(comptime!(2 * units));
    let mut xh = Array::<F>::new(per_unit);
    for r in 0..rows {
        // Every unit goes through every row (the cube meets at its barriers).
        let row = cube * rows + r;
        let live = row < n;
        let (m, var) =
            row_stats::<E, F>(x, &mut xh, &mut sums, row, live, c, u, units, per_unit, rms);
        let std = (var + F::cast_from(epsilon)).sqrt();
        #[unroll]
        for k in 0..per_unit {
            let col = u + k * units;
            if live && col < c {
                let mut v = (xh[k] - m) / std * F::cast_from(gamma[col]);
                if shift {
                    v += F::cast_from(beta[col]);
                }
                y[row * c + col] = E::cast_from(v);
            }
        }
    }
}

/// A cube of `units` units per `rows` rows of `x` (`N` rows of `C`, contiguous), each unit
/// `per_unit` columns of a row. For each row: the mean and reciprocal standard deviation from
/// the cube's sums of `x` and of `(x − mean)²` (RMSNorm: of `x²`), then `x̂`, `g = dy·γ`, the
/// cube's sums of `g` and `g·x̂`, and `dx`; over the rows, each unit its columns' sums of `dy·x̂`
/// and `dy` in registers, written at the end as the cube's row of `dgamma` and `dbeta`
/// (`[cubes, C]`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn norm_backward_kernel<E: Float, G: Float, F: Float>(
    dy: &Tensor<E>,
    x: &Tensor<E>,
    gamma: &Tensor<G>,
    dx: &mut Tensor<E>,
    dgamma: &mut Tensor<F>,
    dbeta: &mut Tensor<F>,
    n: u32,
    c: u32,
    epsilon: f32,
    #[comptime] rows: usize,
    #[comptime] units: usize,
    #[comptime] per_unit: usize,
    #[comptime] rms: bool,
    #[define(E, G, F)] _dtypes: [ElemType; 3],
) {
    let c = c as usize;
    let n = n as usize;
    let u = UNIT_POS_X as usize;
    let cube = CUBE_POS_X as usize;
    let inv_c = F::new(1.0) / F::cast_from(c as u32);
    let zero = F::new(0.0);
    let mut sums = Shared::<[F]>::new_slice(comptime!(2 * units));
    let mut acc_g = Array::<F>::new(per_unit);
    let mut acc_b = Array::<F>::new(per_unit);
    let mut xh = Array::<F>::new(per_unit);
    let mut g = Array::<F>::new(per_unit);
    #[unroll]
    for k in 0..per_unit {
        acc_g[k] = zero;
        acc_b[k] = zero;
    }
    for r in 0..rows {
        // Every unit goes through every row (the cube meets at its barriers); a row past the
        // end reads and writes nothing.
        let row = cube * rows + r;
        let live = row < n;
        let (m, var) =
            row_stats::<E, F>(x, &mut xh, &mut sums, row, live, c, u, units, per_unit, rms);
        let rs = F::new(1.0) / (var + F::cast_from(epsilon)).sqrt();
        let mut s1 = zero;
        let mut s2 = zero;
        #[unroll]
        for k in 0..per_unit {
            let col = u + k * units;
            g[k] = zero;
            if live && col < c {
                let d = F::cast_from(dy[row * c + col]);
                let h = (xh[k] - m) * rs;
                let gv = d * F::cast_from(gamma[col]);
                xh[k] = h;
                g[k] = gv;
                s1 += gv;
                s2 += gv * h;
                acc_g[k] += d * h;
                acc_b[k] += d;
            }
        }
        let (sum_g, sum_gh) = cube_sums(&mut sums, s1, s2, u, units);
        let mean_g = sum_g * inv_c;
        let mean_gh = sum_gh * inv_c;
        #[unroll]
        for k in 0..per_unit {
            let col = u + k * units;
            if live && col < c {
                let mut v = g[k] - xh[k] * mean_gh;
                if !rms {
                    v -= mean_g;
                }
                dx[row * c + col] = E::cast_from(v * rs);
            }
        }
    }
    #[unroll]
    for k in 0..per_unit {
        let col = u + k * units;
        if col < c {
            dgamma[cube * c + col] = acc_g[k];
            dbeta[cube * c + col] = acc_b[k];
        }
    }
}

/// The most units a cube of `x`'s device holds.
fn client_units(x: &CubeTensor) -> usize {
    x.client.properties().hardware.max_units_per_cube as usize
}

impl CubeNormOps for CubeBackend {
    fn kiln_norm_forward(
        x: CubeTensor,
        gamma: CubeTensor,
        beta: CubeTensor,
        epsilon: f64,
        rms: bool,
        shift: bool,
    ) -> CubeTensor {
        let [x, gamma, beta] = [x, gamma, beta].map(into_contiguous);
        let shape = x.shape();
        let c = shape[shape.num_dims() - 1];
        let n = shape.num_elements() / c.max(1);
        assert!(
            gamma.shape().num_elements() == c
                && beta.shape().num_elements() == c
                && beta.dtype == gamma.dtype
                && c > 0,
            "a norm of x {:?} with γ {:?} {:?} and β {:?} {:?}: γ and β must be [C], one dtype",
            x.shape(),
            gamma.shape(),
            gamma.dtype,
            beta.shape(),
            beta.dtype
        );
        let tiling = NormTiling::new(n, c, client_units(&x));
        let client = x.client.clone();
        let y = empty_device_dtype(client.clone(), x.device.clone(), x.shape(), x.dtype);
        let dtypes = [x.dtype, gamma.dtype, DType::F32].map(dtype_to_storage_type);
        norm_forward_kernel::launch(
            &client,
            CubeCount::Static(tiling.cubes as u32, 1, 1),
            CubeDim::new_1d(tiling.units as u32),
            x.into_tensor_arg(),
            gamma.into_tensor_arg(),
            beta.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            n as u32,
            c as u32,
            epsilon as f32,
            tiling.rows,
            tiling.units,
            tiling.per_unit,
            rms,
            shift,
            dtypes,
        );
        y
    }

    fn kiln_norm_backward(
        dy: CubeTensor,
        x: CubeTensor,
        gamma: CubeTensor,
        epsilon: f64,
        rms: bool,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let [dy, x, gamma] = [dy, x, gamma].map(into_contiguous);
        let shape = x.shape();
        let c = shape[shape.num_dims() - 1];
        let n = shape.num_elements() / c.max(1);
        assert!(
            dy.shape() == shape && gamma.shape().num_elements() == c && c > 0,
            "a norm's backward of dy {:?} over x {:?} with γ {:?}: dy and x must be [.., C], γ \
             [C]",
            dy.shape(),
            x.shape(),
            gamma.shape()
        );
        let tiling = NormTiling::new(n, c, client_units(&x));
        let (client, device) = (x.client.clone(), x.device.clone());
        let dx = empty_device_dtype(client.clone(), device.clone(), x.shape(), x.dtype);
        let sums = || {
            empty_device_dtype(
                client.clone(),
                device.clone(),
                Shape::new([tiling.cubes, c]),
                DType::F32,
            )
        };
        let (dgamma, dbeta) = (sums(), sums());
        let dtypes = [x.dtype, gamma.dtype, DType::F32].map(dtype_to_storage_type);
        norm_backward_kernel::launch(
            &client,
            CubeCount::Static(tiling.cubes as u32, 1, 1),
            CubeDim::new_1d(tiling.units as u32),
            dy.into_tensor_arg(),
            x.into_tensor_arg(),
            gamma.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            dgamma.clone().into_tensor_arg(),
            dbeta.clone().into_tensor_arg(),
            n as u32,
            c as u32,
            epsilon as f32,
            tiling.rows,
            tiling.units,
            tiling.per_unit,
            rms,
            dtypes,
        );
        (dx, dgamma, dbeta)
    }
}

#[derive(Debug)]
struct NormBackward;

impl<B: Backend + CubeNormOps> Backward<B, 3> for NormBackward {
    /// x, γ, ε, RMSNorm or not, shifted or not.
    type State = (FloatTensor<B>, FloatTensor<B>, f64, bool, bool);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let dy = grads.consume::<B>(&ops.node);
        let (x, gamma, epsilon, rms, shift) = ops.state;
        let (c, dtype) = (gamma.shape().num_elements(), gamma.dtype());
        let (dx, dgamma, dbeta) = B::kiln_norm_backward(dy, x, gamma, epsilon, rms);
        // The cubes' sums added up, in the parameter's dtype.
        let total = |sums: FloatTensor<B>| {
            let t = B::float_reshape(B::float_sum_dim(sums, 0), Shape::new([c]));
            if dtype == DType::F32 {
                t
            } else {
                B::float_cast(t, dtype.into())
            }
        };
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_gamma {
            grads.register::<B>(node.id, total(dgamma));
        }
        // Without a shift the third parent is γ again, whose gradient is in.
        if shift && let Some(node) = node_beta {
            grads.register::<B>(node.id, total(dbeta));
        }
    }
}

impl<B: Backend + CubeNormOps, C: CheckpointStrategy> CubeNormOps for Autodiff<B, C> {
    fn kiln_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        rms: bool,
        shift: bool,
    ) -> FloatTensor<Self> {
        let (x, gamma, beta) = (Self::inner(x), Self::inner(gamma), Self::inner(beta));
        Self::from_inner(B::kiln_norm_forward(x, gamma, beta, epsilon, rms, shift))
    }

    fn kiln_norm_backward(
        dy: FloatTensor<Self>,
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        epsilon: f64,
        rms: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dgamma, dbeta) = B::kiln_norm_backward(
            Self::inner(dy),
            Self::inner(x),
            Self::inner(gamma),
            epsilon,
            rms,
        );
        (
            Self::from_inner(dx),
            Self::from_inner(dgamma),
            Self::from_inner(dbeta),
        )
    }

    fn kiln_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        rms: bool,
        shift: bool,
    ) -> FloatTensor<Self> {
        let (xp, gp, bp) = (x.primitive(), gamma.primitive(), beta.primitive());
        let y = B::kiln_norm_forward(xp.clone(), gp.clone(), bp.clone(), epsilon, rms, shift);
        match NormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xp.clone(), gp.clone(), epsilon, rms, shift), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backwards_cubes_cover_the_rows_and_columns_within_the_launch_limits() {
        // The GPT GPU recipe on a card (1,024 units a cube): 16,384 rows of 384.
        let t = NormTiling::new(16_384, 384, 1_024);
        assert_eq!((t.rows, t.units, t.per_unit, t.cubes), (32, 64, 6, 512));
        // A remainder of rows is a cube of its own; narrow rows take the least units.
        let t = NormTiling::new(4 * 97, 24, 1_024);
        assert_eq!((t.rows, t.units, t.per_unit, t.cubes), (32, 32, 1, 13));
        // Wide rows take more units, then more columns a unit.
        assert_eq!(NormTiling::new(8, 4_096, 1_024).units, 256);
        assert_eq!(NormTiling::new(8, 5_000, 1_024).per_unit, 20);
        // A device of few units a cube (CubeCL's CPU runtime: its cores): a power of two
        // within them, more columns a unit.
        let t = NormTiling::new(111, 40, 2);
        assert_eq!((t.units, t.per_unit, t.cubes), (2, 20, 4));
        assert_eq!(NormTiling::new(111, 40, 6).units, 4);
        // Many rows: more a cube, never past the limit.
        for n in [1, 31, 33, 1 << 21, (1 << 21) + 1, 1 << 26] {
            let t = NormTiling::new(n, 100, 256);
            assert!(t.cubes <= MOST_CUBES && t.cubes * t.rows >= n, "{n}: {t:?}");
            assert!(t.units.is_power_of_two() && t.units * t.per_unit >= 100);
        }
    }
}
