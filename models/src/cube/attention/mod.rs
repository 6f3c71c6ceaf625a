//! Causal attention as CubeCL kernels, forward and backward, without the `T × T` scores.
//!
//! Burn 0.22.1 differentiates attention by its composed ops: the scores `q·kᵀ`, their mask,
//! softmax and the product with `v`, each a kernel with a `[B, H, T, T]` buffer kept for the
//! backward (on an H200 the GPT GPU recipe's six layers held about 400 MB of them each, and
//! their element-wise kernels and reductions were most of the step's non-product time,
//! BENCHMARKS.md). Here, as FlashAttention-2 does:
//!
//! - **Blocks of 4 × 4, as a matrix product is cut**: a cube takes a tile of 32 query rows
//!   (16 or 8 where shared memory or the units are fewer, [`tiling`]) against tiles of as many
//!   keys in shared memory; each unit computes a block of 4 rows × 4 keys of the scores, and
//!   later a block of 4 rows × 4 columns of a product with them. Eight reads of shared memory
//!   feed 64 multiply-adds, where a unit per row, reading a key's vector for one row, fed 16
//!   with four; and the 64 units of a cube are two warps of independent sums.
//! - **Forward**: for each tile of keys up to the diagonal, the scores into shared memory; a
//!   unit per row takes the row's largest score, its weights and their sum (the online
//!   softmax); the output's blocks are rescaled and added the weights times the values. It
//!   writes the output and each row's log-sum-exp — `T` floats a head, not `T × T`.
//! - **Backward**: the scores recomputed from q, k and the log-sum-exp. One kernel gives `dq`
//!   (by query tiles, keys by tiles as in the forward: the scores and `dout·vᵀ` give
//!   `p (dp − δ)`, times the keys); one more `dk` and `dv` together (by key tiles, the query
//!   tiles from the diagonal on and every query head that shares the key head — grouped-query
//!   attention: the weights and `p (dp − δ)`, times the output's gradient and the query rows).
//!   Every gradient element is written once by one unit: no atomics, the result independent of
//!   timing.
//! - Units hold their sums and the tiles their rows as vectors of four floats (see the
//!   kernels' module).
//!
//! The kernels read q, k, v, the output and its gradient where they lie: any layout whose last
//! dimension is contiguous (the GPT's q, k and v are views of its packed `[B, T, 3C]`
//! projection). They write the output and the three gradients with each position's heads side
//! by side (`[B, T, H, D]` seen as `[B, H, T, D]`), the layout the models put the heads back into:
//! on an H200 the GPT GPU recipe's copies into and out of `[B, H, T, D]` were eleven kernels a
//! layer, 0.44 ms of it (BENCHMARKS.md).
//!
//! Query heads may be a multiple of the key/value heads (grouped-query attention): a query head
//! `h` reads key head `h / (H / KV)`, nothing repeated in memory. `starts` restricts each row to
//! its packed document, as the CPU's kernel does.
//!
//! The tensors may be f32, bf16 or f16; the units compute in f32 whatever they hold (the tiles
//! in shared memory, the running sums, each row's log-sum-exp and `δ` are f32), so that under
//! `bf16-mixed` the softmax is as exact as in f32 and only the loads and stores are 16-bit.
//!
//! For bf16 and f16 on a device with matrix units (a card's tensor cores: planes that multiply
//! 16 × 16 × 16 blocks of the type into f32), the same three passes run as the `mma` module's
//! kernels instead: the products on the matrix units, the softmax and the masks in f32 by a unit
//! a row, the weights and `p (dp − δ)` rounded to the tensors' type before their products.
//! [`emulate_matrix_units`] runs those kernels where no device has matrix units, for tests.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, Shape};
use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::{into_contiguous, untile};
use burn_cubecl::ops::numeric::{empty_device_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};

use kernels::{DropArgsLaunch, dkv_kernel, dq_kernel, forward_kernel};
use mma::{dkv_mma, dq_mma, forward_mma};

mod kernels;
mod mma;

/// The widest head the kernels take: at this width the backward's smallest tiles (4 rows)
/// take 8.7 KiB of shared memory, within WebGPU's least (16 KiB).
pub const MOST_HEAD_WIDTH: usize = 128;

/// The most shared memory a cube of the kernels takes: more would leave a multiprocessor fewer
/// cubes at once.
const MOST_SHARED: usize = 48 * 1024;

/// Which kernel a tiling is for: each keeps its own tiles in shared memory.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pass {
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

/// How the matrix units' kernels ([`mma`]) cut a pass: `planes` planes a cube of `plane` units
/// each, 16 of the cube's rows a plane, the other side's tile `16 · chunks` rows; `lanes`: the
/// products summed by the planes' units ([`emulate_matrix_units`]), not the matrix units.
#[derive(Debug, Clone, Copy, PartialEq)]
struct MmaTiling {
    planes: usize,
    chunks: usize,
    plane: usize,
    lanes: bool,
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
    fn units(&self) -> usize {
        self.planes * self.plane
    }

    /// The cube's rows: the query rows of the forward's and `dq`'s cubes, the key rows of
    /// `dk`/`dv`'s.
    fn rows(&self) -> usize {
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
/// `dtype` (and how): `hardware.gpu_kernels`' `"matrix-units"` on, a 16-bit float type, heads
/// a multiple of 16 wide, planes of one size, the device multiplying 16 × 16 × 16 blocks of
/// that type into f32 (a card's tensor cores, Vulkan's cooperative matrices); or, with
/// [`emulate_matrix_units`], f32, bf16 or f16 on any device, on planes of up to 16 units.
fn mma_on(
    pass: Pass,
    width: usize,
    dtype: DType,
    client: &cubecl::client::Client,
) -> Option<MmaTiling> {
    if !super::kernel_on(super::GpuKernel::MatrixUnits) {
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
pub(super) fn on_matrix_units(dtype: DType, width: usize, client: &cubecl::client::Client) -> bool {
    [Pass::Forward, Pass::Dq, Pass::Dkv]
        .into_iter()
        .all(|pass| mma_on(pass, width, dtype, client).is_some())
}

/// [`tiling`] on `client`'s device.
fn tiling_on(pass: Pass, width: usize, client: &cubecl::client::Client) -> (usize, usize) {
    let hardware = &client.properties().hardware;
    tiling(
        pass,
        width,
        hardware.max_units_per_cube,
        hardware.max_shared_memory_size,
    )
}

/// Dropout on the attention weights, drawn by the kernels themselves: whether the weight of
/// query row `i` on key `j` of head `h` in batch row `b` is kept is a function of the seed and
/// that place alone ([`AttentionDropout::keeps`]), so the forward and both backward kernels
/// recompute the same mask and none is stored. `prob = 0`: no dropout.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionDropout {
    /// The draw's seed.
    pub seed: u64,
    /// The probability of dropping a weight; the kept ones are scaled by `1 / (1 − prob)`.
    pub prob: f32,
    /// The first of these heads in the whole (a tensor-parallel rank's heads are a part of it).
    pub first_head: usize,
    /// The heads of the whole.
    pub heads: usize,
}

/// Knuth's multiplicative constant's cousins: a 32-bit integer hash (two multiply-xorshift
/// rounds), the same on the host and in the kernels.
fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

impl AttentionDropout {
    /// The dropped fraction as the kernels compare it: 24 bits of a hash below it drop.
    fn threshold(&self) -> u32 {
        (f64::from(self.prob) * f64::from(1u32 << 24)).round() as u32
    }

    /// The factor of a kept weight.
    fn inv_keep(&self) -> f32 {
        (1.0 / (1.0 - f64::from(self.prob))) as f32
    }

    /// Whether the weight of query row `i` on key `j` of local head `h` in batch row `b` is
    /// kept — what the kernels compute.
    pub fn keeps(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let bh = (b * self.heads + self.first_head + h) as u32;
        let head = mix((self.seed as u32) ^ mix(((self.seed >> 32) as u32) ^ bh));
        let row = mix(head ^ i as u32);
        (mix(row ^ mix(j as u32)) >> 8) >= self.threshold()
    }
}

impl AttentionDropout {
    /// The kernels' arguments.
    fn args(&self) -> DropArgsLaunch {
        DropArgsLaunch::new(
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.threshold(),
            self.inv_keep(),
            self.first_head as u32,
            self.heads as u32,
        )
    }
}

/// Causal attention on a CubeCL device.
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait CubeAttentionOps: Backend {
    /// The output (`[B, H, T, D]`, `q`'s dtype) and each row's log-sum-exp of its scaled
    /// scores (`[B, H, T]`, f32) of causal attention of `q` (`[B, H, T, D]`) over `k` and `v`
    /// (`[B, KV, T, D]`, `H` a multiple of `KV`), scaled by `scale`, the weights through
    /// `drop`; `starts`: each row's first key (`[B, T]`), or empty (every row from 0). Not
    /// differentiated.
    #[fusion(meta = |q, _k, _v, _starts, _scale, _drop| (
        q.clone(),
        TensorSpec::new(Shape::new([q.shape[0], q.shape[1], q.shape[2]]), DType::F32),
    ))]
    fn kiln_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of `q`, `k` and `v` from the output's gradient `dout`, with the forward's
    /// output `out` and log-sum-exp `lse` (arguments as [`CubeAttentionOps::kiln_attention_forward`]'s).
    /// Not differentiated.
    #[fusion(meta = |q, k, v, _out, _lse, _dout, _starts, _scale, _drop| (q.clone(), k.clone(), v.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Causal attention's output, differentiated in `q`, `k` and `v` through
    /// [`CubeAttentionOps::kiln_attention_backward`].
    #[fusion(default)]
    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::kiln_attention_forward(q, k, v, starts, scale, drop).0
    }
}

/// The shapes the kernels take, checked: `[B, H, T, D]` and `[B, KV, T, D]` twice.
fn dims(q: &CubeTensor, k: &CubeTensor, v: &CubeTensor) -> [usize; 5] {
    let [b, h, t, d] = q.shape().dims::<4>();
    let kd = k.shape().dims::<4>();
    let kv = kd[1];
    assert!(
        kd == [b, kv, t, d] && v.shape().dims::<4>() == kd && kv > 0 && h.is_multiple_of(kv),
        "attention of q {:?} over k {:?} and v {:?}: k and v must be [B, KV, T, D] with H a \
         multiple of KV",
        q.shape(),
        k.shape(),
        v.shape()
    );
    assert!(
        d <= MOST_HEAD_WIDTH,
        "attention heads of {d} floats: the kernels take {MOST_HEAD_WIDTH} at most"
    );
    [b, h, kv, t, d]
}

/// `x` as the kernels read it: as it is where its last dimension is contiguous (a head's rows
/// may lie any distance apart: a view of the GPT's packed projection, a transposed output), else
/// a contiguous copy.
fn rows_contiguous(x: CubeTensor) -> CubeTensor {
    let x = untile(x);
    let strides = x.meta.strides();
    if strides[strides.len() - 1] == 1 {
        x
    } else {
        into_contiguous(x)
    }
}

/// An uninitialised `[B, H, T, D]` tensor laid out as `[B, T, H, D]`, each position's heads side
/// by side: the models' `swap_dims(1, 2)` and reshape to `[B, T, H·D]` then read it as it is,
/// and a gradient of q, k or v goes back into the packed projection's layout without a copy.
fn heads_in_rows(like: &CubeTensor, [b, h, t, d]: [usize; 4]) -> CubeTensor {
    let (client, device) = (like.client.clone(), like.device.clone());
    let mut x = empty_device_dtype(client, device, Shape::new([b, t, h, d]), like.dtype);
    x.meta.swap(1, 2);
    x
}

/// `starts` as the kernels read it, and whether it restricts the rows: an empty tensor becomes
/// one element (a binding may not be empty) that the kernels do not read.
fn starts_arg(starts: CubeTensor, like: &CubeTensor) -> (CubeTensor, bool) {
    if starts.shape().num_elements() > 0 {
        return (into_contiguous(starts), true);
    }
    let dtype = starts.dtype;
    let one = zeros_client(
        like.client.clone(),
        like.device.clone(),
        Shape::new([1]),
        dtype,
    );
    (one, false)
}

impl CubeAttentionOps for CubeBackend {
    fn kiln_attention_forward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        starts: CubeTensor,
        scale: f32,
        drop: AttentionDropout,
    ) -> (CubeTensor, CubeTensor) {
        let [q, k, v] = [q, k, v].map(rows_contiguous);
        let [b, h, _, t, d] = dims(&q, &k, &v);
        let (starts, within) = starts_arg(starts, &q);
        let (client, device, dtype) = (q.client.clone(), q.device.clone(), q.dtype);
        let out = heads_in_rows(&q, [b, h, t, d]);
        let lse = empty_device_dtype(client.clone(), device, Shape::new([b, h, t]), DType::F32);
        let dtypes = [
            dtype_to_storage_type(dtype),
            dtype_to_storage_type(DType::F32),
            dtype_to_storage_type(starts.dtype),
        ];
        if let Some(m) = mma_on(Pass::Forward, d, dtype, &client) {
            forward_mma::launch(
                &client,
                CubeCount::Static(t.div_ceil(m.rows()) as u32, h as u32, b as u32),
                CubeDim::new_2d(m.plane as u32, m.planes as u32),
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                starts.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                scale,
                drop.args(),
                d,
                m.planes,
                m.chunks,
                m.units(),
                m.lanes,
                within,
                drop.prob > 0.0,
                dtypes,
            );
            return (out, lse);
        }
        let (rows, units) = tiling_on(Pass::Forward, d, &client);
        forward_kernel::launch(
            &client,
            CubeCount::Static(t.div_ceil(rows) as u32, h as u32, b as u32),
            CubeDim::new_1d(units as u32),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            starts.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scale,
            drop.args(),
            d,
            rows,
            units,
            within,
            drop.prob > 0.0,
            dtypes,
        );
        (out, lse)
    }

    fn kiln_attention_backward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        out: CubeTensor,
        lse: CubeTensor,
        dout: CubeTensor,
        starts: CubeTensor,
        scale: f32,
        drop: AttentionDropout,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let [q, k, v, out, dout] = [q, k, v, out, dout].map(rows_contiguous);
        let lse = into_contiguous(lse);
        let [b, h, kv, t, d] = dims(&q, &k, &v);
        // The kernels read the six in two types: q, k, v, the output and its gradient in one.
        let stored = [&k, &v, &out, &dout].map(|x| x.dtype);
        assert!(
            stored.iter().all(|&x| x == q.dtype) && lse.dtype == DType::F32,
            "attention's backward: q is {:?}, k, v, the output and its gradient {stored:?}, the \
             log-sum-exp {:?} (f32)",
            q.dtype,
            lse.dtype
        );
        let (starts, within) = starts_arg(starts, &q);
        let (client, device, dtype) = (q.client.clone(), q.device.clone(), q.dtype);
        let empty =
            |shape: Shape, dtype| empty_device_dtype(client.clone(), device.clone(), shape, dtype);
        let (dq, dk, dv) = (
            heads_in_rows(&q, [b, h, t, d]),
            heads_in_rows(&q, [b, kv, t, d]),
            heads_in_rows(&q, [b, kv, t, d]),
        );
        // δ_i = dout_i · out_i, a float per row: the dq kernel computes it and writes it here
        // for the dk/dv kernel, which runs after it.
        let delta = empty(Shape::new([b, h, t]), DType::F32);
        let dtypes = [
            dtype_to_storage_type(dtype),
            dtype_to_storage_type(DType::F32),
            dtype_to_storage_type(starts.dtype),
        ];
        let mma = (
            mma_on(Pass::Dq, d, dtype, &client),
            mma_on(Pass::Dkv, d, dtype, &client),
        );
        if let (Some(mq), Some(mkv)) = mma {
            dq_mma::launch(
                &client,
                CubeCount::Static(t.div_ceil(mq.rows()) as u32, h as u32, b as u32),
                CubeDim::new_2d(mq.plane as u32, mq.planes as u32),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                out.into_tensor_arg(),
                dout.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                starts.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                scale,
                drop.args(),
                d,
                mq.planes,
                mq.chunks,
                mq.units(),
                mq.lanes,
                within,
                drop.prob > 0.0,
                dtypes,
            );
            dkv_mma::launch(
                &client,
                CubeCount::Static(t.div_ceil(mkv.rows()) as u32, kv as u32, b as u32),
                CubeDim::new_2d(mkv.plane as u32, mkv.planes as u32),
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                dout.into_tensor_arg(),
                lse.into_tensor_arg(),
                delta.into_tensor_arg(),
                starts.into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                scale,
                drop.args(),
                d,
                mkv.planes,
                mkv.chunks,
                mkv.units(),
                mkv.lanes,
                within,
                drop.prob > 0.0,
                dtypes,
            );
            return (dq, dk, dv);
        }
        let (rows, units) = tiling_on(Pass::Dq, d, &client);
        dq_kernel::launch(
            &client,
            CubeCount::Static(t.div_ceil(rows) as u32, h as u32, b as u32),
            CubeDim::new_1d(units as u32),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            starts.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            drop.args(),
            d,
            rows,
            units,
            within,
            drop.prob > 0.0,
            dtypes,
        );
        let (rows, units) = tiling_on(Pass::Dkv, d, &client);
        dkv_kernel::launch(
            &client,
            CubeCount::Static(t.div_ceil(rows) as u32, kv as u32, b as u32),
            CubeDim::new_1d(units as u32),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            dout.into_tensor_arg(),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            starts.into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            scale,
            drop.args(),
            d,
            rows,
            units,
            within,
            drop.prob > 0.0,
            dtypes,
        );
        (dq, dk, dv)
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: Backend + CubeAttentionOps> Backward<B, 3> for AttentionBackward {
    /// q, k, v, the output, its rows' log-sum-exp, the starts, the scale and the dropout.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        IntTensor<B>,
        f32,
        AttentionDropout,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, starts, scale, drop) = ops.state;
        let (dq, dk, dv) = B::kiln_attention_backward(q, k, v, out, lse, dout, starts, scale, drop);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + CubeAttentionOps, C: CheckpointStrategy> CubeAttentionOps for Autodiff<B, C> {
    fn kiln_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) = B::kiln_attention_forward(
            Self::inner(q),
            Self::inner(k),
            Self::inner(v),
            starts,
            scale,
            drop,
        );
        (Self::from_inner(out), Self::from_inner(lse))
    }

    fn kiln_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::kiln_attention_backward(
            Self::inner(q),
            Self::inner(k),
            Self::inner(v),
            Self::inner(out),
            Self::inner(lse),
            Self::inner(dout),
            starts,
            scale,
            drop,
        );
        (
            Self::from_inner(dq),
            Self::from_inner(dk),
            Self::from_inner(dv),
        )
    }

    fn kiln_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
        drop: AttentionDropout,
    ) -> FloatTensor<Self> {
        let (qp, kp, vp) = (q.primitive(), k.primitive(), v.primitive());
        let (out, lse) = B::kiln_attention_forward(
            qp.clone(),
            kp.clone(),
            vp.clone(),
            starts.clone(),
            scale,
            drop,
        );
        match AttentionBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (
                    qp.clone(),
                    kp.clone(),
                    vp.clone(),
                    out.clone(),
                    lse,
                    starts,
                    scale,
                    drop,
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
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
