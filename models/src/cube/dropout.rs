//! Dropout on a GPU as one kernel whose mask is a hash of the draw's seed and each element's
//! place, forward and backward, alone or added to a residual.
//!
//! Burn's dropout draws a Bernoulli tensor from the backend's random state and multiplies by
//! it; kiln's keyed dropout ([`crate::draw`]) seeds that state for each draw. On a CubeCL
//! device with fusion that is three costs a draw: seeding runs everything the fusion queue
//! holds (each dropout ends the stream's fused segment there), the mask is a tensor as large as
//! the activation written and read again, kept for the backward, and under `bf16-mixed` it is
//! cast besides. Here the mask is recomputed from the seed wherever it is needed, as the
//! attention kernels' is: the forward is one pass over `x`, the backward one over the output's
//! gradient, nothing is stored, and the fusion queue is left alone.
//!
//! A kernel of its own is a place Burn's fusion cannot see through: the residual sum that
//! follows a block's dropout would be an element-wise op alone (fusion leaves a lone op
//! unfused), launched once more forward and backward. So the kernel adds the residual itself
//! where the model asks ([`CubeDropoutOps::kiln_dropout_add`]), and the residual's gradient is
//! the output's as it is.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn_backend::cubecl::dtype_to_storage_type;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::attention::{inv_keep, mix, mix_in, threshold};

/// Units in a cube of the kernel.
const UNITS: u32 = 256;

/// The most cubes the kernel launches (WGPU's limit on a dimension of the cube count); past
/// it each unit takes several elements.
const MOST_CUBES: u32 = 65_535;

/// The most elements a mask's whole tensor may have: the kernel counts places in 32 bits, with
/// room for a unit's stride past the last.
pub const MOST_ELEMENTS: u64 = 1 << 31;

/// A dropout mask drawn by the kernel: element `e` of the whole tensor (row-major) is kept
/// where the top 24 bits of a hash of the seed and `e` reach `prob · 2²⁴`
/// ([`DropoutMask::keeps`]); kept elements are scaled by `1 / (1 − prob)`. A tensor that is a
/// part of the whole (a tensor-parallel rank's) is masked as that part of the whole's mask.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DropoutMask {
    /// The draw's seed.
    pub seed: u64,
    /// The probability of dropping an element.
    pub prob: f32,
    /// The elements of the part between one index of the dimensions before the part's
    /// dimension and the next (the whole tensor's count where there is no part).
    pub part_span: u64,
    /// The whole's elements over the same step.
    pub whole_span: u64,
    /// The part's first element in the whole, within a span.
    pub offset: u64,
}

impl DropoutMask {
    /// The mask of a draw with `seed` dropping with `prob` on a whole tensor of `dims`. `None`
    /// where it has more than [`MOST_ELEMENTS`].
    pub fn whole(seed: u64, prob: f32, dims: &[usize]) -> Option<Self> {
        let elements: u64 = dims.iter().map(|&d| d as u64).product();
        Self::spans(seed, prob, elements, elements, 1, 0)
    }

    /// The mask of a draw with `seed` dropping with `prob` on a tensor of `dims` that is the
    /// `index`-th of `of` equal parts of the whole along dimension `dim` (a tensor-parallel
    /// rank's): that part of the whole's mask. `None` where the whole has more than
    /// [`MOST_ELEMENTS`] or the part does not fit `dims`.
    pub fn part(
        seed: u64,
        prob: f32,
        dims: &[usize],
        dim: usize,
        index: usize,
        of: usize,
    ) -> Option<Self> {
        if dim >= dims.len() || index >= of {
            return None;
        }
        let elements: u64 = dims.iter().map(|&d| d as u64).product();
        let span = dims[dim..].iter().map(|&d| d as u64).product();
        Self::spans(seed, prob, elements, span, of as u64, index as u64)
    }

    /// A tensor of `elements`, `span` of them from one index of the dimensions before the
    /// part's to the next, the `index`-th of `of` parts.
    fn spans(seed: u64, prob: f32, elements: u64, span: u64, of: u64, index: u64) -> Option<Self> {
        if elements * of > MOST_ELEMENTS {
            return None;
        }
        let span = span.max(1);
        Some(Self {
            seed,
            prob,
            part_span: span,
            whole_span: span * of,
            offset: index * span,
        })
    }

    /// The hash of the draw's seed the kernel mixes each place into.
    fn key(&self) -> u32 {
        mix((self.seed as u32) ^ mix((self.seed >> 32) as u32))
    }

    /// The dropped fraction as the kernel compares it: 24 bits of a hash below it drop.
    fn threshold(&self) -> u32 {
        threshold(self.prob)
    }

    /// The factor of a kept element.
    fn inv_keep(&self) -> f32 {
        inv_keep(self.prob)
    }

    /// The place in the whole of the tensor's element `e` (row-major).
    fn whole_index(&self, e: u64) -> u64 {
        e / self.part_span * self.whole_span + self.offset + e % self.part_span
    }

    /// Whether the tensor's element `e` (row-major) is kept — what the kernel computes.
    pub fn keeps(&self, e: usize) -> bool {
        let whole = self.whole_index(e as u64) as u32;
        (mix(self.key() ^ mix(whole)) >> 8) >= self.threshold()
    }
}

/// Dropout with a hashed mask on a CubeCL device, alone or added to a residual.
#[backend_extension(Cube, Fusion, Autodiff)]
pub trait CubeDropoutOps: Backend {
    /// `x` with `mask` applied (dropped elements 0, kept ones scaled by `1 / (1 − prob)`), and
    /// where `added`, `residual` added (one shape and dtype; `residual` unread otherwise). Not
    /// differentiated.
    #[fusion(dtype = x, shape = x)]
    fn kiln_dropout_apply(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        mask: DropoutMask,
        added: bool,
    ) -> FloatTensor<Self>;

    /// `x` with `mask` applied, differentiated: the gradient is the output's with the same
    /// mask applied.
    #[fusion(dtype = x, shape = x)]
    fn kiln_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self>;

    /// `residual` plus `x` with `mask` applied, differentiated: `residual`'s gradient is the
    /// output's, `x`'s the output's with the same mask applied.
    #[fusion(dtype = x, shape = x)]
    fn kiln_dropout_add(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        mask: DropoutMask,
    ) -> FloatTensor<Self>;
}

/// `y = x · keep(e) / (1 − p)`, plus `residual` where `added`, element by element over `n`
/// elements, each unit every `stride`-th from its place; `keep(e)` as [`DropoutMask::keeps`]
/// (`part`: the tensor is a part of the whole, each element's place in it computed).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dropout_kernel<E: Float, F: Float>(
    residual: &Tensor<E>,
    x: &Tensor<E>,
    y: &mut Tensor<E>,
    n: u32,
    key: u32,
    threshold: u32,
    inv_keep: f32,
    part_span: u32,
    whole_span: u32,
    offset: u32,
    #[comptime] added: bool,
    #[comptime] part: bool,
    #[define(E, F)] _dtypes: [ElemType; 2],
) {
    let stride = CUBE_COUNT_X * CUBE_DIM_X;
    let scale = F::cast_from(inv_keep);
    let mut i = ABSOLUTE_POS_X;
    while i < n {
        // A whole tensor's place is its index: no division an element.
        let mut whole = i;
        if part {
            whole = (i / part_span) * whole_span + offset + i % part_span;
        }
        let mut v = F::new(0.0);
        if added {
            v = F::cast_from(residual[i as usize]);
        }
        if (mix_in(key ^ mix_in(whole)) >> 8) >= threshold {
            v += F::cast_from(x[i as usize]) * scale;
        }
        y[i as usize] = E::cast_from(v);
        i += stride;
    }
}

impl CubeDropoutOps for CubeBackend {
    fn kiln_dropout_apply(
        residual: CubeTensor,
        x: CubeTensor,
        mask: DropoutMask,
        added: bool,
    ) -> CubeTensor {
        let [residual, x] = [residual, x].map(into_contiguous);
        assert!(
            !added || (residual.shape() == x.shape() && residual.dtype == x.dtype),
            "dropout added to a residual {:?} {:?}: x is {:?} {:?}, one shape and dtype",
            residual.shape(),
            residual.dtype,
            x.shape(),
            x.dtype
        );
        let n = x.shape().num_elements();
        assert!(
            n as u64 <= MOST_ELEMENTS,
            "dropout's kernel counts {MOST_ELEMENTS} elements at most, got {n}"
        );
        let (client, dtype) = (x.client.clone(), x.dtype);
        let y = empty_device_dtype(client.clone(), x.device.clone(), x.shape(), dtype);
        let dtypes = [dtype, burn::tensor::DType::F32].map(dtype_to_storage_type);
        let cubes = (n.div_ceil(UNITS as usize) as u32).clamp(1, MOST_CUBES);
        dropout_kernel::launch(
            &client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_1d(UNITS),
            residual.into_tensor_arg(),
            x.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            n as u32,
            mask.key(),
            mask.threshold(),
            mask.inv_keep(),
            mask.part_span as u32,
            mask.whole_span as u32,
            mask.offset as u32,
            added,
            mask.part_span != mask.whole_span,
            dtypes,
        );
        y
    }

    fn kiln_dropout(x: CubeTensor, mask: DropoutMask) -> CubeTensor {
        Self::kiln_dropout_apply(x.clone(), x, mask, false)
    }

    fn kiln_dropout_add(residual: CubeTensor, x: CubeTensor, mask: DropoutMask) -> CubeTensor {
        Self::kiln_dropout_apply(residual, x, mask, true)
    }
}

/// The gradient of `dy` through a mask (the mask applied to it).
fn masked<B: CubeDropoutOps>(dy: FloatTensor<B>, mask: DropoutMask) -> FloatTensor<B> {
    B::kiln_dropout_apply(dy.clone(), dy, mask, false)
}

#[derive(Debug)]
struct DropoutBackward;

impl<B: Backend + CubeDropoutOps> Backward<B, 1> for DropoutBackward {
    /// The mask: recomputed, not stored.
    type State = DropoutMask;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let mask = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dy| masked::<B>(dy, mask));
    }
}

#[derive(Debug)]
struct DropoutAddBackward;

impl<B: Backend + CubeDropoutOps> Backward<B, 2> for DropoutAddBackward {
    /// The mask: recomputed, not stored.
    type State = DropoutMask;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let mask = ops.state;
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |dy| dy,
            |dy| masked::<B>(dy, mask),
        );
    }
}

impl<B: Backend + CubeDropoutOps, C: CheckpointStrategy> CubeDropoutOps for Autodiff<B, C> {
    fn kiln_dropout_apply(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        mask: DropoutMask,
        added: bool,
    ) -> FloatTensor<Self> {
        let (residual, x) = (Self::inner(residual), Self::inner(x));
        Self::from_inner(B::kiln_dropout_apply(residual, x, mask, added))
    }

    fn kiln_dropout(x: FloatTensor<Self>, mask: DropoutMask) -> FloatTensor<Self> {
        let xp = x.primitive().clone();
        let y = B::kiln_dropout_apply(xp.clone(), xp, mask, false);
        match DropoutBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(mask, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn kiln_dropout_add(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        mask: DropoutMask,
    ) -> FloatTensor<Self> {
        let (rp, xp) = (residual.primitive().clone(), x.primitive().clone());
        let y = B::kiln_dropout_apply(rp, xp, mask, true);
        match DropoutAddBackward
            .prepare::<C>([residual.node(), x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(mask, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parts_mask_is_the_wholes_and_the_kept_fraction_is_near_one_minus_p() {
        let whole = DropoutMask::whole(42, 0.25, &[3, 8, 5]).unwrap();
        for index in 0..4 {
            let mask = DropoutMask::part(42, 0.25, &[3, 2, 5], 1, index, 4).unwrap();
            for (e, (a, (m, c))) in (0..3)
                .flat_map(|a| (0..2).flat_map(move |m| (0..5).map(move |c| (a, (m, c)))))
                .enumerate()
            {
                let w = (a * 8 + index * 2 + m) * 5 + c;
                assert_eq!(mask.keeps(e), whole.keeps(w), "part {index}, element {e}");
            }
        }
        let big = DropoutMask::whole(7, 0.25, &[100_000]).unwrap();
        let kept = (0..100_000).filter(|&e| big.keeps(e)).count();
        let fraction = kept as f64 / 100_000.0;
        assert!((fraction - 0.75).abs() < 0.01, "kept {fraction}");
        let other = DropoutMask::whole(8, 0.25, &[100_000]).unwrap();
        let same = (0..100_000)
            .filter(|&e| big.keeps(e) == other.keeps(e))
            .count();
        // Independent masks agree on 0.75² + 0.25² = 62.5 % of the places.
        assert!((same as f64 / 1e5 - 0.625).abs() < 0.01, "agree {same}");
    }

    #[test]
    fn a_whole_past_the_kernels_count_or_a_part_off_the_dims_is_refused() {
        assert!(DropoutMask::whole(1, 0.1, &[1 << 16, 1 << 16]).is_none());
        assert!(DropoutMask::whole(1, 0.1, &[1 << 15, 1 << 16]).is_some());
        assert!(DropoutMask::part(1, 0.1, &[1 << 15, 1 << 15], 1, 0, 4).is_none());
        assert!(DropoutMask::part(1, 0.1, &[8], 1, 0, 4).is_none());
        assert!(DropoutMask::part(1, 0.1, &[8, 2], 1, 4, 4).is_none());
    }
}
