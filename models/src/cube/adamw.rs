//! AdamW's update of a flat f32 shard as one CubeCL kernel.
//!
//! kiln's strategies step one flat vector of parameters per rank; Burn's AdamW updates it with
//! about a dozen whole-vector tensor ops (each moment scaled, the gradient squared, the
//! corrections, the square root, the quotient, the decay), which fusion gathers into fewer
//! kernels but still as several passes over memory with a buffer each. Here each element is
//! read once and its parameter and moments written once, in Burn's arithmetic, op for op, in
//! f32 (what the CPU's fused loop does, `kiln::optim`).

use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, TensorMetadata, backend_extension};
use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::{CubeDim, calculate_cube_count_elemwise};

/// AdamW's constants and this step's numbers, as the kernel takes them (f32, as Burn's
/// `AdamWConfig` holds them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    /// β₁.
    pub beta_1: f32,
    /// β₂.
    pub beta_2: f32,
    /// ε.
    pub epsilon: f32,
    /// The learning rate.
    pub lr: f32,
    /// `1 − β₁ᵗ` of this step `t` (1 for the first).
    pub correction_1: f32,
    /// `1 − β₂ᵗ`.
    pub correction_2: f32,
    /// The decay factor `1 − lr·λ` of the elements `decay` marks.
    pub decay_factor: f32,
    /// Whether any element decays: without, the mask is not read (any bool tensor will do).
    pub decays: bool,
    /// Whether the step is decided on the device: the `guard` and `table` tensors are read
    /// (see [`CubeAdamWOps::kiln_adamw`]) in place of `correction_1` and `correction_2`.
    /// Without, neither is read (any tensor will do).
    pub guarded: bool,
}

/// The update on a CubeCL device. Takes and returns f32 tensors of one length `[N]`.
#[backend_extension(Cube, Fusion)]
pub trait CubeAdamWOps: Backend {
    /// One AdamW step: `(parameters, first moments, second moments)` after the step, from the
    /// parameters, the gradient, the moments before it (zeros before the first step) and
    /// `decay` (true where an element decays, read where `step.decays`). Not differentiated.
    ///
    /// Where `step.guarded`, whether the step is taken is decided on the device, without the
    /// host reading anything: `guard` is `[taken, skipped]` — `taken` 0 leaves every element
    /// as it was (a gradient that was not finite), and `skipped` counts the steps so left
    /// since the host last read them — and `table` holds `[1 − β₁ᵗ, 1 − β₂ᵗ]` for `t` the
    /// host's step count less 0, 1, 2, … skipped steps: the kernel takes the pair at
    /// `skipped`, so a step after a skipped one is corrected as if that one had not been.
    #[fusion(meta = |params, _grads, m, v, _decay, _guard, _table, _step| (params.clone(), m.clone(), v.clone()))]
    #[allow(clippy::too_many_arguments)]
    fn kiln_adamw(
        params: FloatTensor<Self>,
        grads: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: BoolTensor<Self>,
        guard: FloatTensor<Self>,
        table: FloatTensor<Self>,
        step: AdamStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// One thread per element: the moments, the decay, the update (Burn's order of operations);
/// under `guarded`, a step the device refused copies each element through.
// `decays` and `guarded` are comptime branches (a kernel without those reads): not one `if`
// with a runtime test.
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn adamw_kernel<F: Float, B: Int>(
    params: &Tensor<F>,
    grads: &Tensor<F>,
    m: &Tensor<F>,
    v: &Tensor<F>,
    decay: &Tensor<B>,
    guard: &Tensor<F>,
    table: &Tensor<F>,
    out_params: &mut Tensor<F>,
    out_m: &mut Tensor<F>,
    out_v: &mut Tensor<F>,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    lr: f32,
    correction_1: f32,
    correction_2: f32,
    decay_factor: f32,
    #[comptime] decays: bool,
    #[comptime] guarded: bool,
    #[define(F, B)] _dtypes: [ElemType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= params.len() {
        terminate!();
    }
    let mut correction_1 = F::cast_from(correction_1);
    let mut correction_2 = F::cast_from(correction_2);
    if guarded {
        if guard[0] == F::new(0.0) {
            out_params[i] = params[i];
            out_m[i] = m[i];
            out_v[i] = v[i];
            terminate!();
        }
        let at = u32::cast_from(guard[1]) as usize * 2;
        correction_1 = table[at];
        correction_2 = table[at + 1];
    }
    let beta_1 = F::cast_from(beta_1);
    let beta_2 = F::cast_from(beta_2);
    let epsilon = F::cast_from(epsilon);
    let lr = F::cast_from(lr);
    let factor = F::cast_from(decay_factor);
    let one = F::new(1.0);
    let g = grads[i];
    let m_new = m[i] * beta_1 + g * (one - beta_1);
    let v_new = v[i] * beta_2 + (g * g) * (one - beta_2);
    out_m[i] = m_new;
    out_v[i] = v_new;
    let delta = (m_new / correction_1) / (F::sqrt(v_new / correction_2) + epsilon);
    let mut p = params[i];
    if decays {
        if u32::cast_from(decay[i]) != 0 {
            p *= factor;
        }
    }
    out_params[i] = p - delta * lr;
}

impl CubeAdamWOps for CubeBackend {
    fn kiln_adamw(
        params: CubeTensor,
        grads: CubeTensor,
        m: CubeTensor,
        v: CubeTensor,
        decay: CubeTensor,
        guard: CubeTensor,
        table: CubeTensor,
        step: AdamStep,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let n = params.shape().num_elements();
        let mut sized = vec![("gradient", &grads), ("moment", &m), ("moment", &v)];
        if step.decays {
            sized.push(("decay mask", &decay));
        }
        for (name, t) in sized {
            assert_eq!(
                t.shape().num_elements(),
                n,
                "an AdamW step of {n} parameters with a {name} of another length"
            );
        }
        if step.guarded {
            let (g, c) = (guard.shape().num_elements(), table.shape().num_elements());
            assert!(
                g == 2 && c >= 2 && c.is_multiple_of(2),
                "a guarded AdamW step takes a guard of 2 and corrections in pairs, not {g} and {c}"
            );
        }
        let [params, grads, m, v, decay, guard, table] =
            [params, grads, m, v, decay, guard, table].map(into_contiguous);
        let (client, device, dtype) = (params.client.clone(), params.device.clone(), params.dtype);
        let shape = params.shape();
        let out = || empty_device_dtype(client.clone(), device.clone(), shape.clone(), dtype);
        let (out_params, out_m, out_v) = (out(), out(), out());
        // Spread over the cube count's dimensions: one dimension holds 65,535 cubes on WGPU.
        let cube_dim = CubeDim::new(&client, n.max(1));
        let cube_count = calculate_cube_count_elemwise(&client, n.max(1), cube_dim);
        let mask_dtype = decay.dtype;
        adamw_kernel::launch(
            &client,
            cube_count,
            cube_dim,
            params.into_tensor_arg(),
            grads.into_tensor_arg(),
            m.into_tensor_arg(),
            v.into_tensor_arg(),
            decay.into_tensor_arg(),
            guard.into_tensor_arg(),
            table.into_tensor_arg(),
            out_params.clone().into_tensor_arg(),
            out_m.clone().into_tensor_arg(),
            out_v.clone().into_tensor_arg(),
            step.beta_1,
            step.beta_2,
            step.epsilon,
            step.lr,
            step.correction_1,
            step.correction_2,
            step.decay_factor,
            step.decays,
            step.guarded,
            [
                dtype_to_storage_type(dtype),
                dtype_to_storage_type(mask_dtype),
            ],
        );
        (out_params, out_m, out_v)
    }
}
