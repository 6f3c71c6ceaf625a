//! The blocks of 16 × 16 that attention's matrix-unit kernels (`mma`) multiply, and the tiles
//! they take them from: a fragment of the matrix units (CubeCL's `cmma`), or, where the kernels
//! run without them, the sums a plane's units compute one by one from the same shared memory.

use cubecl::cmma::{self, Matrix, MatrixIdent, MatrixLayout};
use cubecl::prelude::*;

/// The edge of the blocks the matrix units multiply.
pub(super) const M: usize = 16;

/// The alignment, in bytes, of the tiles the matrix units load from and store to (CUDA's
/// fragments take 256-bit aligned addresses).
pub(super) const ALIGN: usize = 32;

/// Rows `row0 ..` of a `[t, d]` slab at `base` (rows `from.stride(2)` apart) into `tile`
/// (`[rows, d]`, row-major, in the tensor's own type), zeros past `t`; the cube's `units` units
/// take consecutive elements.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_rows<E: Float>(
    from: &Tensor<E>,
    base: usize,
    row0: usize,
    t: usize,
    tile: &mut [E],
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
) {
    let stride = from.stride(2);
    let mut idx = UNIT_POS as usize;
    while idx < comptime!(rows * d) {
        let row = idx / d;
        let mut x = E::new(0.0);
        if row0 + row < t {
            x = from[base + (row0 + row) * stride + idx % d];
        }
        tile[idx] = x;
        idx += units;
    }
}

/// A 16 × 16 block of f32 sums that a plane holds: a fragment of the matrix units, or, where
/// the kernels run without them ([`super::emulate_matrix_units`]), `256 / plane` sums a unit —
/// element `lane + plane · z` of the block in row-major order — that the plane's units compute
/// one by one from the same tiles in shared memory.
#[derive(CubeType, Clone)]
#[expand(derive(Clone))]
#[allow(
    dead_code,
    reason = "built in the kernels through the expand type's generated constructors"
)]
pub(super) enum Block<F: Float> {
    /// A fragment of the matrix units.
    Units(Matrix<F>),
    /// The plane's units' sums.
    Lanes(Array<F>),
}

/// A block of zeros: a fragment, or (`lanes`) the units' sums of a plane of `plane` units.
#[cube]
pub(super) fn zero_block<F: Float>(#[comptime] lanes: bool, #[comptime] plane: usize) -> Block<F> {
    if comptime!(lanes) {
        let mut sums = Array::<F>::new(comptime!(M * M / plane));
        for z in 0..comptime!(M * M / plane) {
            sums[z] = F::new(0.0);
        }
        Block::new_Lanes(sums)
    } else {
        Block::new_Units(cmma::Matrix::<F>::from_value(
            MatrixIdent::Accumulator,
            M,
            M,
            M,
            MatrixLayout::Undefined,
            F::new(0.0),
        ))
    }
}

/// Row and column of the block's element that sum `z` of this unit holds (a plane of `plane`
/// units, [`Block::Lanes`]).
#[cube]
pub(super) fn lane_element(z: usize, #[comptime] plane: usize) -> (usize, usize) {
    let e = UNIT_POS_X as usize + z * plane;
    (e / M, e % M)
}

/// `acc += a · b` on the matrix units: the 16 × 16 block of `a` from `a_at` (row-major, rows
/// `lda` apart) times that of `b` from `b_at` (rows or, `ColMajor`, columns `ldb` apart).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_product<E: Float, F: Float>(
    acc: &mut Matrix<F>,
    a: &[E],
    a_at: usize,
    #[comptime] lda: usize,
    b: &[E],
    b_at: usize,
    #[comptime] ldb: usize,
    #[comptime] b_layout: MatrixLayout,
) {
    let mut fa =
        unsafe { Matrix::<E>::uninitialized(MatrixIdent::A, M, M, M, MatrixLayout::RowMajor) };
    let mut fb = unsafe { Matrix::<E>::uninitialized(MatrixIdent::B, M, M, M, b_layout) };
    cmma::load(
        &mut fa,
        &a[a_at..a_at + comptime!((M - 1) * lda + M)],
        lda as u32,
    );
    cmma::load(
        &mut fb,
        &b[b_at..b_at + comptime!((M - 1) * ldb + M)],
        ldb as u32,
    );
    cmma::execute(&fa, &fb, &*acc, &*acc);
}

/// `acc = x[x0 .. x0 + 16 rows] · y[y0 .. y0 + 16 rows]ᵀ`: 16 rows of `x` against 16 of `y`,
/// both row-major tiles of `d` columns.
#[cube]
pub(super) fn rows_by_rows<E: Float, F: Float>(
    acc: &mut Block<F>,
    x: &[E],
    x0: usize,
    y: &[E],
    y0: usize,
    #[comptime] d: usize,
    #[comptime] plane: usize,
) {
    match acc {
        Block::Units(m) => {
            cmma::fill(m, F::new(0.0));
            #[unroll]
            for c in 0..comptime!(d / M) {
                let (xs, ys) = (x0 * d + c * M, y0 * d + c * M);
                add_product::<E, F>(m, x, xs, d, y, ys, d, MatrixLayout::ColMajor);
            }
        }
        Block::Lanes(sums) => {
            for z in 0..comptime!(M * M / plane) {
                let (r, c) = lane_element(z, plane);
                let (xr, yr) = ((x0 + r) * d, (y0 + c) * d);
                let mut sum = F::new(0.0);
                for k in 0..d {
                    sum += F::cast_from(x[xr + k]) * F::cast_from(y[yr + k]);
                }
                sums[z] = sum;
            }
        }
    }
}

/// `acc += w[w0 .. w0 + 16 rows] · y[.., c0 .. c0 + 16]`: 16 rows of the weights `w`
/// (row-major, `n` columns) times columns `c0 ..` of the row-major tile `y` (`n` rows of `d`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn weights_by_tile<E: Float, F: Float>(
    acc: &mut Block<F>,
    w: &[E],
    w0: usize,
    y: &[E],
    c0: usize,
    #[comptime] n: usize,
    #[comptime] d: usize,
    #[comptime] plane: usize,
) {
    match acc {
        Block::Units(m) =>
        {
            #[unroll]
            for j in 0..comptime!(n / M) {
                let (ws, ys) = (w0 * n + j * M, j * M * d + c0);
                add_product::<E, F>(m, w, ws, n, y, ys, d, MatrixLayout::RowMajor);
            }
        }
        Block::Lanes(sums) => {
            for z in 0..comptime!(M * M / plane) {
                let (r, c) = lane_element(z, plane);
                let wr = (w0 + r) * n;
                let mut sum = sums[z];
                for j in 0..n {
                    sum += F::cast_from(w[wr + j]) * F::cast_from(y[j * d + c0 + c]);
                }
                sums[z] = sum;
            }
        }
    }
}

/// The 16 × 16 block `acc` into `s` at row `r0` (row-major, `n` columns), column `c0`.
#[cube]
pub(super) fn put<F: Float>(
    s: &mut [F],
    acc: &Block<F>,
    r0: usize,
    c0: usize,
    #[comptime] n: usize,
    #[comptime] plane: usize,
) {
    let at = r0 * n + c0;
    match acc {
        Block::Units(m) => {
            cmma::store(
                &mut s[at..at + comptime!((M - 1) * n + M)],
                m,
                n as u32,
                MatrixLayout::RowMajor,
            );
        }
        Block::Lanes(sums) => {
            for z in 0..comptime!(M * M / plane) {
                let (r, c) = lane_element(z, plane);
                s[at + r * n + c] = sums[z];
            }
        }
    }
}

/// `acc` from `s` at row `r0` (row-major, `n` columns), column `c0`: [`put`]'s inverse.
#[cube]
pub(super) fn take<F: Float>(
    acc: &mut Block<F>,
    s: &[F],
    r0: usize,
    c0: usize,
    #[comptime] n: usize,
    #[comptime] plane: usize,
) {
    let at = r0 * n + c0;
    match acc {
        Block::Units(m) => {
            cmma::load_with_layout(
                m,
                &s[at..at + comptime!((M - 1) * n + M)],
                n as u32,
                MatrixLayout::RowMajor,
            );
        }
        Block::Lanes(sums) => {
            for z in 0..comptime!(M * M / plane) {
                let (r, c) = lane_element(z, plane);
                sums[z] = s[at + r * n + c];
            }
        }
    }
}

/// Each plane's blocks `accs` (16 rows × `d` columns, the plane's rows from `row0 + 16·plane`)
/// times `scale` into `to` (head `h` of batch row `b`), rows past `t` left out: fragments
/// through `stage` (16 × 16 f32 a plane, from the plane's row `16·plane · n`), the units' sums
/// ([`Block::Lanes`]) where they are.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_blocks<E: Float, F: Float>(
    accs: &Sequence<Block<F>>,
    stage: &mut [F],
    to: &mut Tensor<E>,
    b: usize,
    h: usize,
    row0: usize,
    t: usize,
    scale: F,
    #[comptime] n: usize,
    #[comptime] d: usize,
    #[comptime] plane: usize,
) {
    let p = UNIT_POS_Y as usize;
    let head = b * to.stride(0) + h * to.stride(1);
    #[unroll]
    for c in 0..comptime!(d / M) {
        match accs.index(c) {
            Block::Units(m) => {
                let at = p * M * n;
                cmma::store(
                    &mut stage[at..at + comptime!((M - 1) * n + M)],
                    m,
                    n as u32,
                    MatrixLayout::RowMajor,
                );
                sync_cube();
                let mut idx = UNIT_POS_X as usize;
                while idx < comptime!(M * M) {
                    let (r, col) = (idx / M, idx % M);
                    let i = row0 + p * M + r;
                    if i < t {
                        let at = head + i * to.stride(2) + c * M + col;
                        to[at] = E::cast_from(stage[(p * M + r) * n + col] * scale);
                    }
                    idx += plane;
                }
                sync_cube();
            }
            Block::Lanes(sums) => {
                for z in 0..comptime!(M * M / plane) {
                    let (r, col) = lane_element(z, plane);
                    let i = row0 + p * M + r;
                    if i < t {
                        let at = head + i * to.stride(2) + c * M + col;
                        to[at] = E::cast_from(sums[z] * scale);
                    }
                }
            }
        }
    }
}
