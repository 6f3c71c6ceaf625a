//! LayerNorm and RMSNorm on a GPU with the scale's (and shift's) gradient summed by parts of
//! the rows.
//!
//! Burn composes both norms and ends with `x̂ · γ (+ β)`, `γ` and `β` broadcast over every row.
//! Their gradients are column sums over all the rows, which Burn's autodiff gives as one
//! reduction with the rows' dimensions folded into one: on an H200 the GPT GPU recipe's 13
//! LayerNorms' took 0.14 ms each, 1.8 ms of the f32 step, to read 25 MB each (BENCHMARKS.md),
//! a few columns of units each walking 16,384 rows. Here the rows are cut into `P` parts and
//! `γ` and `β` expanded over them (`[P, 1, C]`): Burn differentiates the product as a sum over
//! each part's rows, every part's columns at once, and the expansion as a sum over the `P`
//! parts. Only Burn's ops, in Burn's order otherwise: the normalisation is Burn's own
//! composition (f16 widened to f32 for it, as Burn's LayerNorm does).

use burn::nn::{LayerNorm, RmsNorm};
use burn::prelude::*;
use burn::tensor::DType;

/// The rows each part of a norm's scale gradient sums at least.
const LEAST_NORM_PART_ROWS: usize = 256;

/// The parts a norm's scale gradient over `rows` rows is summed by: the most powers of two
/// that divide `rows` with 256 rows a part at least, 1024 at most.
pub fn norm_row_parts(rows: usize) -> usize {
    let mut parts = 1;
    while parts < 1024
        && rows.is_multiple_of(parts * 2)
        && rows / (parts * 2) >= LEAST_NORM_PART_ROWS
    {
        parts *= 2;
    }
    parts
}

/// `x · γ + β` over `x`'s last dimension (`γ`, `β` `[C]`), `γ` and `β` expanded over `parts`
/// parts of the rows (see the module's page). `parts` must divide the rows.
pub fn scale_by_parts<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    parts: usize,
) -> Tensor<D> {
    let dims = x.dims();
    let c = dims[D - 1];
    let rows = x.shape().num_elements() / c.max(1);
    assert!(
        parts > 0 && rows.is_multiple_of(parts),
        "a norm's scale by parts: {rows} rows in {parts} parts"
    );
    let over_parts = |p: Tensor<1>| p.reshape([1, 1, c]).expand([parts, 1, c]);
    let y = x.reshape([parts, rows / parts, c]) * over_parts(gamma);
    let y = match beta {
        Some(b) => y + over_parts(b),
        None => y,
    };
    y.reshape(dims)
}

/// Burn's LayerNorm (`norm`, whose epsilon is `epsilon`) with its scale and shift by
/// [`scale_by_parts`].
pub fn layer_norm_by_parts<const D: usize>(
    norm: &LayerNorm,
    epsilon: f64,
    x: Tensor<D>,
    parts: usize,
) -> Tensor<D> {
    let dtype = x.dtype();
    let wide = |t: Tensor<1>| {
        if dtype == DType::F16 {
            t.cast(DType::F32)
        } else {
            t
        }
    };
    let x = if dtype == DType::F16 {
        x.cast(DType::F32)
    } else {
        x
    };
    let mean = x.clone().mean_dim(D - 1);
    let centered = x - mean;
    let var = (centered.clone() * centered.clone()).mean_dim(D - 1);
    let normalized = centered / (var + epsilon).sqrt();
    let gamma = wide(norm.gamma.val());
    let beta = norm.beta.as_ref().map(|b| wide(b.val()));
    let y = scale_by_parts(normalized, gamma, beta, parts);
    if dtype == DType::F16 {
        y.cast(dtype)
    } else {
        y
    }
}

/// Burn's RMSNorm with its scale by [`scale_by_parts`].
pub fn rms_norm_by_parts<const D: usize>(norm: &RmsNorm, x: Tensor<D>, parts: usize) -> Tensor<D> {
    let dtype = x.dtype();
    let rms = (x.clone().cast(DType::F32).square().mean_dim(D - 1) + norm.epsilon).sqrt();
    scale_by_parts(x / rms.cast(dtype), norm.gamma.val(), None, parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cube::test_values::{assert_close, numbers, values};
    use burn::module::Param;
    use burn::nn::{LayerNormConfig, RmsNormConfig};
    use burn::tensor::TensorData;

    #[test]
    fn the_rows_are_cut_in_powers_of_two_of_256_rows_at_least() {
        assert_eq!(norm_row_parts(16_384), 64);
        assert_eq!(norm_row_parts(8_192), 32);
        assert_eq!(norm_row_parts(511), 1);
        assert_eq!(norm_row_parts(512), 2);
        assert_eq!(norm_row_parts(768), 2);
        assert_eq!(norm_row_parts(257 * 2), 2);
        assert_eq!(norm_row_parts(1 << 20), 1024);
    }

    /// Both norms by parts against Burn's modules on the CPU: the output and the gradients of
    /// x, γ and β within 1e-5 of each tensor's largest value.
    #[test]
    fn by_parts_the_norms_give_burns_output_and_gradients() {
        let device = Device::flex().autodiff();
        let [b, t, c] = [4, 96, 24];
        for parts in [1, 3, 8] {
            let x = || {
                Tensor::<3>::from_data(TensorData::new(numbers(b * t * c, 1), [b, t, c]), &device)
                    .require_grad()
            };
            let weights =
                Tensor::<3>::from_data(TensorData::new(numbers(b * t * c, 4), [b, t, c]), &device);
            let mut layer = LayerNormConfig::new(c).init(&device);
            let scale = |seed| {
                let t = Tensor::<1>::from_data(TensorData::new(numbers(c, seed), [c]), &device);
                Param::from_tensor(t + 1.0)
            };
            layer.gamma = scale(2);
            layer.beta = Some(Param::from_tensor(Tensor::from_data(
                TensorData::new(numbers(c, 3), [c]),
                &device,
            )));
            let mut rms = RmsNormConfig::new(c).init(&device);
            rms.gamma = scale(5);
            // Output, dx, dγ (and dβ) of one way.
            let layer_way = |split: bool| {
                let x = x();
                let y = if split {
                    layer_norm_by_parts(&layer, 1e-5, x.clone(), parts)
                } else {
                    layer.forward(x.clone())
                };
                let grads = (y.clone() * weights.clone()).sum().backward();
                let beta = layer.beta.as_ref().unwrap();
                [
                    values(y),
                    values(x.grad(&grads).unwrap()),
                    values(layer.gamma.val().grad(&grads).unwrap()),
                    values(beta.val().grad(&grads).unwrap()),
                ]
            };
            let rms_way = |split: bool| {
                let x = x();
                let y = if split {
                    rms_norm_by_parts(&rms, x.clone(), parts)
                } else {
                    rms.forward(x.clone())
                };
                let grads = (y.clone() * weights.clone()).sum().backward();
                [
                    values(y),
                    values(x.grad(&grads).unwrap()),
                    values(rms.gamma.val().grad(&grads).unwrap()),
                ]
            };
            for (name, (a, b)) in ["output", "dx", "dgamma", "dbeta"]
                .iter()
                .zip(layer_way(true).iter().zip(&layer_way(false)))
            {
                assert_close(&format!("LayerNorm in {parts} parts, {name}"), a, b);
            }
            for (name, (a, b)) in ["output", "dx", "dgamma"]
                .iter()
                .zip(rms_way(true).iter().zip(&rms_way(false)))
            {
                assert_close(&format!("RMSNorm in {parts} parts, {name}"), a, b);
            }
        }
    }
}
