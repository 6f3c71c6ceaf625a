//! The exact GELU on a GPU as two kernels, forward and backward.
//!
//! Burn's GELU is five tensor ops, `x · (1 + erf(x / √2)) / 2`. Between the MLP's two products
//! Burn's fusion puts them in one block with the first product, and its fusion log shows that
//! block run op by op: five passes over the MLP's widest activation, besides the backward's.
//! Here the forward is one pass, and the backward `dy · (Φ(x) + x·φ(x))` another, each
//! element computed in f32 whatever the tensors' float type.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units in a cube of either kernel.
const UNITS: u32 = 256;

/// The most cubes either kernel launches (WGPU's limit on a dimension of the cube count); past
/// it each unit takes several elements.
const MOST_CUBES: u32 = 65_535;

/// The exact GELU on a CubeCL device.
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait CubeGeluOps: Backend {
    /// The gradient of the GELU at `x` given the output's `dy` (one shape and dtype). Not
    /// differentiated.
    #[fusion(dtype = x, shape = x)]
    fn kiln_gelu_grad(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `x · Φ(x)`, differentiated through [`CubeGeluOps::kiln_gelu_grad`].
    #[fusion(dtype = x, shape = x)]
    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `Φ(x)`, the standard normal distribution function.
#[cube]
fn phi<F: Float>(x: F) -> F {
    (F::new(1.0) + (x * F::new(core::f32::consts::FRAC_1_SQRT_2)).erf()) * F::new(0.5)
}

/// `y = x · Φ(x)` element by element over `n` elements, each unit every `stride`-th from its
/// place.
#[cube(launch)]
fn gelu_kernel<E: Float, F: Float>(
    x: &Tensor<E>,
    y: &mut Tensor<E>,
    n: u32,
    #[define(E, F)] _dtypes: [ElemType; 2],
) {
    let n = n as usize;
    let stride = (CUBE_COUNT_X * CUBE_DIM_X) as usize;
    let mut i = ABSOLUTE_POS_X as usize;
    while i < n {
        let v = F::cast_from(x[i]);
        y[i] = E::cast_from(v * phi::<F>(v));
        i += stride;
    }
}

/// `dx = dy · (Φ(x) + x·φ(x))` element by element, as [`gelu_kernel`] walks them.
#[cube(launch)]
fn gelu_grad_kernel<E: Float, F: Float>(
    x: &Tensor<E>,
    dy: &Tensor<E>,
    dx: &mut Tensor<E>,
    n: u32,
    #[define(E, F)] _dtypes: [ElemType; 2],
) {
    let n = n as usize;
    let stride = (CUBE_COUNT_X * CUBE_DIM_X) as usize;
    // 1/√(2π)
    let norm = F::new(0.398_942_3);
    let mut i = ABSOLUTE_POS_X as usize;
    while i < n {
        let v = F::cast_from(x[i]);
        let density = (v * v * F::new(-0.5)).exp() * norm;
        dx[i] = E::cast_from(F::cast_from(dy[i]) * (phi::<F>(v) + v * density));
        i += stride;
    }
}

/// The cubes for `n` elements.
fn cubes(n: usize) -> u32 {
    (n.div_ceil(UNITS as usize) as u32).clamp(1, MOST_CUBES)
}

impl CubeGeluOps for CubeBackend {
    fn kiln_gelu(x: CubeTensor) -> CubeTensor {
        let x = into_contiguous(x);
        let n = x.shape().num_elements();
        let (client, dtype) = (x.client.clone(), x.dtype);
        let y = empty_device_dtype(client.clone(), x.device.clone(), x.shape(), dtype);
        let dtypes = [dtype, burn::tensor::DType::F32].map(dtype_to_storage_type);
        gelu_kernel::launch(
            &client,
            CubeCount::Static(cubes(n), 1, 1),
            CubeDim::new_1d(UNITS),
            x.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            n as u32,
            dtypes,
        );
        y
    }

    fn kiln_gelu_grad(x: CubeTensor, dy: CubeTensor) -> CubeTensor {
        let [x, dy] = [x, dy].map(into_contiguous);
        assert!(
            x.shape() == dy.shape() && x.dtype == dy.dtype,
            "the GELU's gradient at x {:?} {:?} from dy {:?} {:?}: one shape and dtype",
            x.shape(),
            x.dtype,
            dy.shape(),
            dy.dtype
        );
        let n = x.shape().num_elements();
        let (client, dtype) = (x.client.clone(), x.dtype);
        let dx = empty_device_dtype(client.clone(), x.device.clone(), x.shape(), dtype);
        let dtypes = [dtype, burn::tensor::DType::F32].map(dtype_to_storage_type);
        gelu_grad_kernel::launch(
            &client,
            CubeCount::Static(cubes(n), 1, 1),
            CubeDim::new_1d(UNITS),
            x.into_tensor_arg(),
            dy.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            n as u32,
            dtypes,
        );
        dx
    }
}

#[derive(Debug)]
struct GeluBackward;

impl<B: Backend + CubeGeluOps> Backward<B, 1> for GeluBackward {
    /// The input.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let x = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dy| B::kiln_gelu_grad(x, dy));
    }
}

impl<B: Backend + CubeGeluOps, C: CheckpointStrategy> CubeGeluOps for Autodiff<B, C> {
    fn kiln_gelu_grad(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::kiln_gelu_grad(Self::inner(x), Self::inner(dy)))
    }

    fn kiln_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let xp = x.primitive().clone();
        let y = B::kiln_gelu(xp.clone());
        match GeluBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(xp, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}
