//! How attention's kernels cut their work on a device: the tiles and units of the kernels on
//! the ordinary units ([`tiling`]), and where the `mma` module's kernels take the matrix units
//! and how they cut theirs (the switches `"matrix-units"` and [`emulate_matrix_units`], the
//! device's checks, [`mma_on`]).

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::DType;
use burn_backend::cubecl::dtype_to_storage_type;

/// The widest head the kernels take: at this width the backward's smallest tiles (4 rows)
/// take 8.7 KiB of shared memory, within WebGPU's least (16 KiB).
pub const MOST_HEAD_WIDTH: usize = 128;

/// The most shared memory a cube of the kernels takes: more would leave a multiprocessor fewer
/// cubes at once.
const MOST_SHARED: usize = 48 * 1024;

/// Which kernel a tiling is for: each keeps its own tiles in shared memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Pass {
    /// q, k and v's tiles, the weights, each row's largest score, sum and rescale.
    Forward,
    /// q, dout, k and v's tiles, `p (dp − δ)`, each row's log-sum-exp and δ.
    Dq,
    /// k, v, q and dout's tiles, the weights and `p (dp − δ)`, each row's log-sum-exp and δ.
    Dkv,
}

impl Pass {
    /// Bytes of shared memory at tiles of `rows` rows of `width` floats: a tile's row is
    /// `width / 4` vectors of four floats (rounded up) and one more, the weights' rows `rows / 4`
    /// vectors and one more.
    fn shared_bytes(self, rows: usize, width: usize) -> usize {
        let (tiles, weights, floats) = match self {
            Pass::Forward => (3, 1, 3),
            Pass::Dq => (4, 1, 2),
            Pass::Dkv => (4, 2, 2),
        };
        let vectors = tiles * rows * (width.div_ceil(4) + 1) + weights * rows * (rows / 4 + 1);
        vectors * 16 + floats * rows * 4
    }
}

/// The units of a cube the kernels aim for: two warps of an NVIDIA card.
const UNITS: usize = 64;

/// The rows of `pass`'s tiles and the units of its cubes at heads of `width` floats, on a device
/// whose cubes take `most_units` units and `shared` bytes of shared memory: the largest of 32,
/// 16 and 8 rows whose tiles fit (and [`MOST_SHARED`]) and whose `(rows / 4)²` blocks of 4 × 4
/// scores come to 4 a unit at most, else 4 rows; the units [`UNITS`], or the largest power of
/// two the device's cubes take. Where the units outnumber the blocks of scores (tiles of 16
/// rows have 16), the spare units wait while the others compute them, and all take part in the
/// products, whose blocks are `rows / 4 × width / 4`. (CubeCL's CPU runtime runs a cube's units
/// as threads, as many as the host's cores.)
fn tiling(pass: Pass, width: usize, most_units: u32, shared: usize) -> (usize, usize) {
    let units = (1usize << most_units.max(1).ilog2()).min(UNITS);
    let budget = shared.min(MOST_SHARED);
    for rows in [32, 16, 8] {
        let blocks = (rows / 4) * (rows / 4);
        if pass.shared_bytes(rows, width) <= budget && blocks <= 4 * units {
            return (rows, units);
        }
    }
    (4, units)
}

/// [`tiling`] on `client`'s device.
pub(super) fn tiling_on(
    pass: Pass,
    width: usize,
    client: &cubecl::client::Client,
) -> (usize, usize) {
    let hardware = &client.properties().hardware;
    tiling(
        pass,
        width,
        hardware.max_units_per_cube,
        hardware.max_shared_memory_size,
    )
}

/// How the matrix units' kernels (the `mma` module's) cut a pass: `planes` planes a cube of `plane` units
/// each, 16 of the cube's rows a plane, the other side's tile `16 · chunks` rows; `lanes`: the
/// products summed by the planes' units ([`emulate_matrix_units`]), not the matrix units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct MmaTiling {
    pub(super) planes: usize,
    pub(super) chunks: usize,
    pub(super) plane: usize,
    pub(super) lanes: bool,
}

/// Whether attention's kernels may run on the matrix units (`"matrix-units"` of
/// `hardware.gpu_kernels`, which the cube module's `set_kernels` passes on).
static MATRIX_UNITS: AtomicBool = AtomicBool::new(true);

/// Lets attention's kernels run on the matrix units where the device has them, or not.
pub(crate) fn allow_matrix_units(on: bool) {
    MATRIX_UNITS.store(on, Ordering::Relaxed);
}

/// Whether [`emulate_matrix_units`] is on.
static EMULATED: AtomicBool = AtomicBool::new(false);

/// The units of a plane where the matrix units' kernels run without them.
const EMULATED_PLANE: usize = 16;

/// Runs attention's matrix-unit kernels where the device has no matrix units, or for f32
/// tensors, for the whole process: each 16 × 16 product is summed by the plane's units from the
/// same tiles in shared memory, all else (tiles, masks, the softmax, the roundings to the
/// tensors' type) as on the matrix units. Slower than attention's other kernels; it is how the
/// matrix units' kernels are checked where no device has them (CubeCL's CPU runtime, in the
/// integration tests' `cube_cpu` module). Off by default.
pub fn emulate_matrix_units(on: bool) {
    EMULATED.store(on, Ordering::Relaxed);
}

impl MmaTiling {
    /// The cube's units.
    pub(super) fn units(&self) -> usize {
        self.planes * self.plane
    }

    /// The cube's rows: the query rows of the forward's and `dq`'s cubes, the key rows of
    /// `dk`/`dv`'s.
    pub(super) fn rows(&self) -> usize {
        16 * self.planes
    }
}

impl Pass {
    /// Bytes of shared memory of the matrix units' kernel of this pass at `planes` planes and
    /// the other side's tile of `16 · chunks` rows, heads of `width` values of `elem` bytes:
    /// the tiles of rows in the tensors' type, the scores (and `dout·vᵀ`) in f32, the weights
    /// (and `p (dp − δ)`) in the tensors' type, the forward's output in f32, the rows' numbers,
    /// and up to 32 bytes before each of the eight tiles that align them.
    fn mma_shared_bytes(self, planes: usize, chunks: usize, width: usize, elem: usize) -> usize {
        let (rows, other) = (16 * planes, 16 * chunks);
        8 * 32
            + match self {
                Pass::Forward => {
                    elem * (rows * width + 2 * other * width + rows * other)
                        + 4 * (rows * other + rows * width + 2 * rows)
                }
                Pass::Dq => {
                    elem * (2 * rows * width + 2 * other * width + 2 * rows * other)
                        + 4 * (2 * rows * other + 3 * rows)
                }
                Pass::Dkv => {
                    elem * (2 * rows * width + 2 * other * width + 2 * rows * other)
                        + 4 * (2 * rows * other + 3 * other)
                }
            }
    }
}

/// The matrix units' tiling of `pass` at heads of `width` values of `elem` bytes, on a device
/// of planes of `plane` units, `most_units` a cube and `shared` bytes of shared memory: the most
/// planes (4, 2, 1) and then the widest other tile (32 rows, 16) that fit; none where the width
/// is not a multiple of 16 or nothing fits.
fn mma_tiling(
    pass: Pass,
    width: usize,
    elem: usize,
    plane: usize,
    most_units: usize,
    shared: usize,
) -> Option<MmaTiling> {
    if width == 0 || !width.is_multiple_of(16) || plane == 0 {
        return None;
    }
    let budget = shared.min(MOST_SHARED);
    for planes in [4, 2, 1] {
        for chunks in [2, 1] {
            if planes * plane <= most_units
                && pass.mma_shared_bytes(planes, chunks, width, elem) <= budget
            {
                return Some(MmaTiling {
                    planes,
                    chunks,
                    plane,
                    lanes: false,
                });
            }
        }
    }
    None
}

/// Whether attention's kernels run on the matrix units on `client`'s device for tensors of
/// `dtype` (and how): `"matrix-units"` allowed ([`allow_matrix_units`]), a 16-bit float type, heads
/// a multiple of 16 wide, planes of one size, the device multiplying 16 × 16 × 16 blocks of
/// that type into f32 (a card's tensor cores, Vulkan's cooperative matrices); or, with
/// [`emulate_matrix_units`], f32, bf16 or f16 on any device, on planes of up to 16 units.
pub(super) fn mma_on(
    pass: Pass,
    width: usize,
    dtype: DType,
    client: &cubecl::client::Client,
) -> Option<MmaTiling> {
    if !MATRIX_UNITS.load(Ordering::Relaxed) {
        return None;
    }
    let props = client.properties();
    let hardware = &props.hardware;
    let most_units = hardware.max_units_per_cube as usize;
    let (elem, plane, lanes) = if EMULATED.load(Ordering::Relaxed) {
        let elem = match dtype {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            _ => return None,
        };
        let plane = (1usize << most_units.max(1).ilog2()).min(EMULATED_PLANE);
        (elem, plane, true)
    } else {
        if !matches!(dtype, DType::F16 | DType::BF16) {
            return None;
        }
        let elem = dtype_to_storage_type(dtype);
        let config = cubecl::features::MmaConfig {
            a_type: elem,
            b_type: elem,
            cd_type: dtype_to_storage_type(DType::F32),
            m: 16,
            n: 16,
            k: 16,
        };
        if hardware.plane_size_min != hardware.plane_size_max
            || !props.features.matmul.cmma.contains(&config)
        {
            return None;
        }
        (2, hardware.plane_size_max as usize, false)
    };
    let shared = hardware.max_shared_memory_size;
    mma_tiling(pass, width, elem, plane, most_units, shared).map(|m| MmaTiling { lanes, ..m })
}

/// Whether all three of attention's passes run on the matrix units ([`mma_on`]).
pub(crate) fn on_matrix_units(dtype: DType, width: usize, client: &cubecl::client::Client) -> bool {
    [Pass::Forward, Pass::Dq, Pass::Dkv]
        .into_iter()
        .all(|pass| mma_on(pass, width, dtype, client).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_units_tiles_fit_their_device_and_take_heads_of_16s() {
        // (plane, units a cube, shared bytes): a card's, and the emulation's on two cores of
        // CubeCL's CPU runtime.
        let devices = [(32, 1024, 227 * 1024), (2, 2, 48 * 1024)];
        for pass in [Pass::Forward, Pass::Dq, Pass::Dkv] {
            for (plane, units, shared) in devices {
                for width in [16, 32, 64, 128] {
                    for elem in [2, 4] {
                        let case = format!("{pass:?} width {width}×{elem} B on {plane}/{units}");
                        let m = mma_tiling(pass, width, elem, plane, units, shared)
                            .unwrap_or_else(|| panic!("{case}: no tiling"));
                        assert!(m.units() <= units && m.plane == plane, "{case}");
                        let bytes = pass.mma_shared_bytes(m.planes, m.chunks, width, elem);
                        assert!(bytes <= shared.min(MOST_SHARED), "{case}: {bytes} B");
                    }
                }
                for width in [0, 6, 24, 72] {
                    assert_eq!(mma_tiling(pass, width, 2, plane, units, shared), None);
                }
            }
        }
        // A card in bf16 at the recipes' heads of 64: four warps of 16 query rows against 32
        // keys in the forward, 16 in the backward; heads of 128 on two warps.
        let card = |pass, width| {
            mma_tiling(pass, width, 2, 32, 1024, 227 * 1024).map(|m| (m.planes, m.chunks))
        };
        assert_eq!(card(Pass::Forward, 64), Some((4, 2)));
        assert_eq!(card(Pass::Dq, 64), Some((4, 1)));
        assert_eq!(card(Pass::Dkv, 64), Some((4, 1)));
        assert_eq!(card(Pass::Forward, 128), Some((2, 2)));
        // Where not even one plane's tiles fit, none: attention's other kernels run.
        assert_eq!(mma_tiling(Pass::Forward, 128, 4, 16, 1024, 32 * 1024), None);
    }

    #[test]
    fn each_pass_tiles_within_its_device_s_shared_memory_and_units() {
        let devices = [
            (1024, 227 * 1024),
            (1024, 32 * 1024),
            (256, 16 * 1024),
            (2, 48 * 1024),
        ];
        for pass in [Pass::Forward, Pass::Dq, Pass::Dkv] {
            for width in [1, 6, 16, 24, 64, 96, 128] {
                for (most_units, shared) in devices {
                    let (rows, units) = tiling(pass, width, most_units, shared);
                    let blocks = (rows / 4) * (rows / 4);
                    let case = format!("{pass:?} width {width} on {most_units} units, {shared} B");
                    assert!([4, 8, 16, 32].contains(&rows), "{case}: {rows} rows");
                    assert!(
                        pass.shared_bytes(rows, width) <= shared.min(MOST_SHARED),
                        "{case}"
                    );
                    assert!(
                        units.is_power_of_two() && units <= most_units as usize,
                        "{case}"
                    );
                    assert!(units <= UNITS && blocks <= 4 * units, "{case}");
                }
            }
        }
        // A GPU: tiles of 32 rows on two warps, 44 KiB for the dk/dv kernel's six tiles.
        assert_eq!(tiling(Pass::Dkv, 64, 1024, 227 * 1024), (32, 64));
        assert_eq!(Pass::Dkv.shared_bytes(32, 64), 44_288);
        // Heads of 128: tiles of 16 rows, still on two warps (16 blocks of scores, 128 of
        // each product).
        assert_eq!(tiling(Pass::Forward, 128, 1024, 227 * 1024), (16, 64));
        assert_eq!(tiling(Pass::Dkv, 128, 1024, 227 * 1024), (16, 64));
        // 32 KiB (llvmpipe): the forward's three tiles fit 32 rows, the backward's four 16.
        assert_eq!(tiling(Pass::Forward, 64, 1024, 32 * 1024), (32, 64));
        assert_eq!(tiling(Pass::Dq, 64, 1024, 32 * 1024), (16, 64));
        // Two cores of the CPU runtime: 4 blocks of 4 × 4 on two units.
        assert_eq!(tiling(Pass::Forward, 64, 2, 48 * 1024), (8, 2));
        assert_eq!(tiling(Pass::Dkv, 64, 1, 48 * 1024), (8, 1));
        assert_eq!(tiling(Pass::Dkv, 128, 256, 16 * 1024), (4, 64));
        // The widest head on WebGPU's least shared memory.
        assert!(Pass::Dkv.shared_bytes(4, MOST_HEAD_WIDTH) <= 16 * 1024);
    }
}
