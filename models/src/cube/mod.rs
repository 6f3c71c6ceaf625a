//! The models' GPU kernels: CubeCL kernels behind Burn backend extensions, for the CubeCL
//! devices (CUDA, WGPU, CubeCL's CPU runtime, …) with or without autodiff. The embedding's and
//! attention's take f32, bf16 and f16 tensors and compute in f32 (`bf16-mixed` runs them);
//! AdamW's steps f32 master weights. Elsewhere — Burn's Flex CPU, another dtype, or with
//! [`set_enabled`]`(false)` — each function runs the Burn ops it replaces.
//!
//! - [`embedding`]: the lookup whose backward sums the table's gradient by parts of the batch
//!   (`embedding.rs`) where Burn's walks every token in one thread per column.
//! - [`adamw`]: AdamW's update of a flat shard in one pass (`adamw.rs`), where Burn's runs a
//!   dozen whole-vector ops.
//! - [`attention`]: causal attention forward and backward by tiles in shared memory, the rows'
//!   log-sum-exp kept instead of the `T × T` scores (`attention/`), where Burn's composes
//!   the scores, their mask, softmax and products; for bf16 and f16 on a device with matrix
//!   units (tensor cores), the products on them ([`attention_on_matrix_units`]).
//! - [`linear`]: not a kernel of its own but Burn's products arranged so that the weight's
//!   gradient is summed by parts of the rows (`linear.rs`), where Burn's is one product with
//!   few output tiles walking every row.
//! - [`gelu`]: the exact GELU, forward and backward a kernel each (`gelu.rs`), where Burn
//!   composes five ops that fusion leaves one by one between the MLP's products.
//! - [`dropout`], [`dropout_add`]: the mask a hash of the draw's seed and each element's place,
//!   recomputed in the backward, a block's residual sum in the same kernel (`dropout.rs`),
//!   where Burn draws and keeps a mask tensor and kiln's keyed draw seeds the backend for each
//!   (which runs what the fusion queue holds).
//! - [`norm()`]: LayerNorm and RMSNorm, forward and backward a kernel each (`norm.rs`), where
//!   Burn differentiates a dozen ops one by one.
//!
//! Each may be turned off alone ([`set_kernels`], `hardware.gpu_kernels`).
//!
//! Each kernel equals the Burn ops it replaces within 1e-5 relative (forward and gradient) on
//! WGPU with the software adapter (the integration tests' `wgpu` module). In bf16 and f16,
//! which that adapter cannot compute in, CubeCL's CPU runtime shows the embedding's and
//! attention's within a rounding of the low type of the same computation in f32 (`cube_cpu`,
//! the `cube-cpu` feature).

mod adamw;
mod attention;
mod dropout;
mod embedding;
mod gelu;
mod linear;
mod norm;

#[cfg(test)]
mod test_values;

use std::sync::atomic::{AtomicU8, Ordering};

use burn::backend::{Dispatch, DispatchDevice};
use burn::nn::Embedding;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType, TensorData};
use serde::{Deserialize, Serialize};

pub use adamw::{AdamStep, CubeAdamWOps};
pub use attention::{AttentionDropout, CubeAttentionOps, MOST_HEAD_WIDTH, emulate_matrix_units};
pub use dropout::{CubeDropoutOps, DropoutMask, MOST_ELEMENTS};
pub use embedding::{CubeEmbeddingOps, ROWS_PER_PART, parts};
pub use gelu::CubeGeluOps;
pub use linear::{LEAST_PART_ROWS, linear_by_parts, weight_parts};
pub use norm::{CubeNormOps, NormTiling};

/// One of this module's GPU paths, each of which may be turned off alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuKernel {
    /// The embedding table's gradient summed by parts of the batch ([`embedding`]).
    Embedding,
    /// Causal attention forward and backward ([`attention`]).
    Attention,
    /// AdamW's update of a flat shard ([`adamw`]).
    Adamw,
    /// The Linear's weight gradient summed by parts of the rows ([`linear`]).
    Linear,
    /// LayerNorm's and RMSNorm's backward as one kernel ([`norm()`]).
    Norm,
    /// Attention's kernels on the matrix units (a card's tensor cores, Vulkan's cooperative
    /// matrices) for bf16 and f16 tensors where the device has them ([`attention`]'s `mma`);
    /// off, or elsewhere, attention's kernels compute in f32 on the ordinary units.
    MatrixUnits,
    /// The exact GELU, forward and backward ([`gelu`]).
    Gelu,
    /// Dropout's mask hashed from the draw's seed in the kernel, forward and backward
    /// ([`dropout`]).
    Dropout,
}

impl GpuKernel {
    /// Every one, in the order of the enum.
    pub const ALL: [GpuKernel; 8] = [
        GpuKernel::Embedding,
        GpuKernel::Attention,
        GpuKernel::Adamw,
        GpuKernel::Linear,
        GpuKernel::Norm,
        GpuKernel::MatrixUnits,
        GpuKernel::Gelu,
        GpuKernel::Dropout,
    ];

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// The kernels on, a bit each ([`GpuKernel::bit`]).
static KERNELS: AtomicU8 = AtomicU8::new(0b1111_1111);

/// Turns every GPU kernel on or off for the whole process (on by default). Off, every function
/// of this module runs the Burn ops it replaces: the switch compares the two.
pub fn set_enabled(on: bool) {
    set_kernels(if on { &GpuKernel::ALL } else { &[] });
}

/// Turns on `kernels` and off the others, for the whole process.
pub fn set_kernels(kernels: &[GpuKernel]) {
    let bits = kernels.iter().fold(0, |b, k| b | k.bit());
    KERNELS.store(bits, Ordering::Relaxed);
    attention::allow_matrix_units(kernels.contains(&GpuKernel::MatrixUnits));
}

/// Whether any GPU kernel is on (see [`set_enabled`]).
pub fn enabled() -> bool {
    KERNELS.load(Ordering::Relaxed) != 0
}

/// Whether `kernel` is on (see [`set_kernels`]).
pub fn kernel_on(kernel: GpuKernel) -> bool {
    KERNELS.load(Ordering::Relaxed) & kernel.bit() != 0
}

/// Whether `device` is a CubeCL device, with or without autodiff.
fn on_cube(device: &Device) -> bool {
    match device.as_dispatch() {
        DispatchDevice::Cube(_) => true,
        DispatchDevice::Autodiff(inner) => matches!(&**inner, DispatchDevice::Cube(_)),
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// Whether this module's GPU paths may take tensors of this dtype on this device: f32, bf16 or
/// f16 on a CubeCL device, one of the paths on (each checks its own switch besides).
pub fn kernels_here(dtype: DType, device: &Device) -> bool {
    enabled() && matches!(dtype, DType::F32 | DType::BF16 | DType::F16) && on_cube(device)
}

/// Whether [`adamw`] steps a shard of this dtype on this device: f32 (the master weights of
/// every precision but the `-true` ones) where [`kernels_here`].
pub fn adamw_here(dtype: DType, device: &Device) -> bool {
    dtype == DType::F32 && kernel_on(GpuKernel::Adamw) && kernels_here(dtype, device)
}

/// `table`'s rows for `tokens` (`[B, T]` → `[B, T, C]`), as [`Embedding::forward`]; where
/// [`kernels_here`] its gradient is the kernel's.
pub fn embedding(table: &Embedding, tokens: Tensor<2, Int>) -> Tensor<3> {
    let weights = table.weight.val();
    if !(kernel_on(GpuKernel::Embedding) && kernels_here(weights.dtype(), &weights.device())) {
        return table.forward(tokens);
    }
    Tensor::from_dispatch(<Dispatch as CubeEmbeddingOps>::kiln_embedding(
        weights.into_dispatch(),
        tokens.into_dispatch(),
    ))
}

/// One AdamW step of a flat f32 shard on a CubeCL device as one kernel: the parameters, first
/// and second moments after it, from the parameters, the gradient, the moments before it
/// (zeros before the first step) and `decay` (true where an element decays by
/// `step.decay_factor`; `None`: none does). `guard`: the step decided on the device, as
/// `(guard, table)` ([`CubeAdamWOps::kiln_adamw`]); `None`: taken, corrected by `step`'s
/// numbers. The caller checks [`adamw_here`].
pub fn adamw(
    params: Tensor<1>,
    grads: Tensor<1>,
    moments: (Tensor<1>, Tensor<1>),
    decay: Option<Tensor<1, Bool>>,
    guard: Option<(Tensor<1>, Tensor<1>)>,
    mut step: AdamStep,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let (m, v) = moments;
    let device = params.device();
    step.decays = decay.is_some();
    step.guarded = guard.is_some();
    // Without decay the kernel reads no mask, without a guard no guard: one element stands
    // in for each.
    let decay = decay.unwrap_or_else(|| Tensor::<1, Bool>::from_data([false], &device));
    let (guard, table) = guard.unwrap_or_else(|| {
        let one = || Tensor::<1>::ones([1], &device);
        (one(), one())
    });
    let (p, m, v) = <Dispatch as CubeAdamWOps>::kiln_adamw(
        params.into_dispatch(),
        grads.into_dispatch(),
        m.into_dispatch(),
        v.into_dispatch(),
        decay.into_dispatch(),
        guard.into_dispatch(),
        table.into_dispatch(),
        step,
    );
    (
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    )
}

/// Whether [`attention`]'s kernels run on the matrix units (a card's tensor cores, Vulkan's
/// cooperative matrices) for tensors of `dtype` with heads of `width` on `device`: the
/// attention kernels and `"matrix-units"` on ([`set_kernels`]), bf16 or f16, heads a multiple
/// of 16 wide, and a device that multiplies 16 × 16 × 16 blocks of that type into f32. Where
/// this is false and [`attention_takes`], the kernels compute in f32 on the ordinary units.
pub fn attention_on_matrix_units(dtype: DType, width: usize, device: &Device) -> bool {
    let cube = match device.as_dispatch() {
        DispatchDevice::Cube(cube) => cube,
        DispatchDevice::Autodiff(inner) => match &**inner {
            DispatchDevice::Cube(cube) => cube,
            #[allow(unreachable_patterns)]
            _ => return false,
        },
        #[allow(unreachable_patterns)]
        _ => return false,
    };
    kernel_on(GpuKernel::Attention)
        && kernels_here(dtype, device)
        && width <= MOST_HEAD_WIDTH
        && attention::on_matrix_units(dtype, width, &cube.client())
}

/// Whether [`attention`] runs the kernels for these tensors: one float type of
/// [`kernels_here`]'s on a CubeCL device, q
/// `[B, H, T, D]`, k and v `[B, KV, T, D]` with `H` a multiple of `KV`, heads of
/// [`MOST_HEAD_WIDTH`] floats at most.
pub fn attention_takes(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>) -> bool {
    let ([b, h, t, d], kd) = (q.dims(), k.dims());
    let dtypes = [q.dtype(), k.dtype(), v.dtype()];
    kernel_on(GpuKernel::Attention)
        && kernels_here(q.dtype(), &q.device())
        && dtypes.iter().all(|&x| x == q.dtype())
        && kd == v.dims()
        && kd[0] == b
        && kd[2] == t
        && kd[3] == d
        && kd[1] > 0
        && h.is_multiple_of(kd[1])
        && d <= MOST_HEAD_WIDTH
}

/// Causal attention of `q` (`[B, H, T, D]`) over `k` and `v` (`[B, KV, T, D]`: a query head
/// `h` reads key/value head `h / (H / KV)`), scaled by 1/√D, differentiated in all three;
/// `starts` (`[B, T]`): each row's first key, for examples packed into one row; the weights
/// through `drop` (the kernels' own mask, [`AttentionDropout::keeps`]; `prob = 0`: none). The
/// caller checks [`attention_takes`].
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    starts: Option<&Tensor<2, Int>>,
    drop: AttentionDropout,
) -> Tensor<4> {
    let [b, _, t, d] = q.dims();
    let scale = 1.0 / (d as f32).sqrt();
    let starts = starts_or_empty(starts, b, t, &q.device());
    Tensor::from_dispatch(<Dispatch as CubeAttentionOps>::kiln_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        starts.into_dispatch(),
        scale,
        drop,
    ))
}

/// `starts` (`[b, t]`, checked), or an empty tensor for none.
fn starts_or_empty(
    starts: Option<&Tensor<2, Int>>,
    b: usize,
    t: usize,
    device: &Device,
) -> Tensor<2, Int> {
    match starts {
        Some(s) => {
            assert_eq!(
                s.dims(),
                [b, t],
                "attention within documents: starts {:?} for a batch of {b} rows of {t}",
                s.dims()
            );
            s.clone()
        }
        None => Tensor::<2, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0, 0]), device),
    }
}

/// Whether [`attention_packed`] runs the kernels for a packed projection `qkv`
/// (`[B, T, 3·heads·D]`): as [`attention_takes`] for its q, k and v.
pub fn attention_packed_takes(qkv: &Tensor<3>, heads: usize) -> bool {
    let c3 = qkv.dims()[2];
    kernel_on(GpuKernel::Attention)
        && kernels_here(qkv.dtype(), &qkv.device())
        && heads > 0
        && c3 > 0
        && c3.is_multiple_of(3 * heads)
        && c3 / 3 / heads <= MOST_HEAD_WIDTH
}

/// [`attention`] of the heads of a packed projection `qkv` (`[B, T, 3·heads·D]`: q's heads, then
/// k's, then v's), read where they lie: the output `[B, T, heads·D]`, each position's heads side
/// by side, and in the backward one gradient of `qkv` whose three parts the kernels write in
/// place (where Burn's backward of three slices fills three tensors and adds them). The caller
/// checks [`attention_packed_takes`].
pub fn attention_packed(
    qkv: Tensor<3>,
    heads: usize,
    starts: Option<&Tensor<2, Int>>,
    drop: AttentionDropout,
) -> Tensor<3> {
    let [b, t, c3] = qkv.dims();
    let scale = 1.0 / ((c3 / 3 / heads) as f32).sqrt();
    let starts = starts_or_empty(starts, b, t, &qkv.device());
    Tensor::from_dispatch(<Dispatch as CubeAttentionOps>::kiln_attention_packed(
        qkv.into_dispatch(),
        starts.into_dispatch(),
        heads,
        scale,
        drop,
    ))
}

/// The parts [`linear`] sums the gradient of `weight` (`[in, out]`) by for `x` (`[rows, in]`):
/// [`weight_parts`] where the Linear's path is on, on a CubeCL device, for a float weight; else
/// 1 (one product, as Burn's, which keeps a quantized weight packed). A forward without
/// gradients is cut the same way, so that validation runs the products training tuned.
pub fn linear_parts(x: &Tensor<2>, weight: &Tensor<2>) -> usize {
    let float = matches!(weight.dtype(), DType::F32 | DType::BF16 | DType::F16);
    if !(float && kernel_on(GpuKernel::Linear) && kernels_here(x.dtype(), &x.device())) {
        return 1;
    }
    let ([rows, inputs], outputs) = (x.dims(), weight.dims()[1]);
    weight_parts(rows, inputs, outputs)
}

/// The exact GELU of `x`, `x · Φ(x)` (Burn's `gelu`): where the GELU's path is on and
/// [`kernels_here`], a kernel forward and backward; else Burn's ops.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !(kernel_on(GpuKernel::Gelu) && kernels_here(x.dtype(), &x.device())) {
        return burn::tensor::activation::gelu(x);
    }
    Tensor::from_dispatch(<Dispatch as CubeGeluOps>::kiln_gelu(x.into_dispatch()))
}

/// Whether [`dropout`] and [`dropout_add`] run their kernel for `x`: dropout's path on, `x` of
/// one of [`kernels_here`]'s types on a CubeCL device (the mask besides: [`DropoutMask`]).
pub fn dropout_takes<const D: usize>(x: &Tensor<D>) -> bool {
    kernel_on(GpuKernel::Dropout) && kernels_here(x.dtype(), &x.device())
}

/// `x` with `mask`'s dropped elements 0 and its kept ones scaled by `1 / (1 − prob)`, one
/// kernel forward and backward, the mask recomputed from its seed in each. The caller checks
/// [`dropout_takes`].
pub fn dropout<const D: usize>(x: Tensor<D>, mask: DropoutMask) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CubeDropoutOps>::kiln_dropout(
        x.into_dispatch(),
        mask,
    ))
}

/// `residual + dropout(x, mask)` ([`dropout`]) as one kernel: `residual`'s gradient is the
/// output's, `x`'s the output's through the mask. `residual` is `x`'s shape and dtype.
pub fn dropout_add<const D: usize>(
    residual: Tensor<D>,
    x: Tensor<D>,
    mask: DropoutMask,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CubeDropoutOps>::kiln_dropout_add(
        residual.into_dispatch(),
        x.into_dispatch(),
        mask,
    ))
}

/// Whether [`norm()`] runs its kernel for `x` and a scale `gamma`: the norms' path on, `x` of
/// one of [`kernels_here`]'s types on a CubeCL device, a float scale as wide as `x`'s last
/// dimension, no dimension empty.
pub fn norm_takes<const D: usize>(x: &Tensor<D>, gamma: &Tensor<1>) -> bool {
    let c = x.dims()[D - 1];
    kernel_on(GpuKernel::Norm)
        && kernels_here(x.dtype(), &x.device())
        && matches!(gamma.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && gamma.dims()[0] == c
        && x.shape().num_elements() > 0
}

/// LayerNorm (`rms` false) or RMSNorm of `x` over its last dimension with `epsilon`, scaled by
/// `gamma` and shifted by `beta`, as Burn's modules compute them (in f32 for every float type):
/// forward and backward a kernel each ([`CubeNormOps`]). The caller checks [`norm_takes`].
pub fn norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
    rms: bool,
) -> Tensor<D> {
    let shift = beta.is_some();
    // Without a shift the op's third tensor is γ again, unread. `x` keeps its shape: a
    // reshape that lowers the rank would end the fused block of the ops before the norm.
    let beta = match beta {
        Some(b) if b.dtype() != gamma.dtype() => b.cast(FloatDType::from(gamma.dtype())),
        Some(b) => b,
        None => gamma.clone(),
    };
    Tensor::from_dispatch(<Dispatch as CubeNormOps>::kiln_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
        rms,
        shift,
    ))
}

/// `x · weight + bias` over the rows of `x` (`[rows, in]`, `weight` `[in, out]`): where
/// [`linear_parts`] splits, [`linear_by_parts`]; else Burn's `linear`.
pub fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<2> {
    match linear_parts(&x, &weight) {
        1 => burn::tensor::module::linear(x, weight, bias),
        parts => linear_by_parts(x, weight, bias, parts),
    }
}

/// `x · weight` (`x` `[rows, in]`, `weight` `[in, out]`, a view such as a tied head's
/// transposed table): where [`linear_parts`] splits, [`linear_by_parts`]; else Burn's
/// `matmul`.
pub fn product(x: Tensor<2>, weight: Tensor<2>) -> Tensor<2> {
    match linear_parts(&x, &weight) {
        1 => x.matmul(weight),
        parts => linear_by_parts(x, weight, None, parts),
    }
}
