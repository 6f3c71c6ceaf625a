//! The Linear on a GPU with its weight's gradient summed by parts of the rows.
//!
//! Burn's `linear` differentiates its weight as one product `xᵀ · dy` (`[in, rows] ·
//! [rows, out]`): a GPT's `in × out` is small (384 × 384 in the GPT GPU recipe's projection)
//! while `rows` is the whole batch's tokens (16,384), so the product has few output tiles, each
//! walking all the rows — a few dozen cubes on a GPU of 132 multiprocessors. On an H200 those
//! four products a layer ran at 10-33 TFLOP/s where the same layer's others ran at 52-61, and
//! the tied head's took 1.05 ms of a 56 ms step (BENCHMARKS.md). CubeCL's tuned routines have no
//! split of the reduction.
//!
//! Here the rows are cut into `P` parts and the forward is the batched product of each part
//! with the weight broadcast to all (`[P, rows/P, in] · [1, in, out]`): the same arithmetic, each
//! output element summing over `in` in one product as before. Burn's autodiff differentiates
//! the broadcast weight as `P` products `x_pᵀ · dy_p` (`P` times the cubes, each walking
//! `rows/P` rows) and their sum over the parts; the bias's gradient sums over parts and rows in
//! one reduction. The input's gradient is `dy · weightᵀ` as before. Only Burn's ops: the same
//! code runs on every backend, and the split's cost is the parts' partial gradients
//! (`P · in · out` elements, 2²³ at most) and their sum.

use burn::prelude::*;

/// The rows each part of the weight's gradient sums at least.
pub const LEAST_PART_ROWS: usize = 256;

/// The partial gradients' elements at most (32 MiB in f32): the split's memory.
const MOST_PARTIAL: usize = 1 << 23;

/// The side of the output tile the parts are counted in (CubeCL's largest tiles).
const TILE: usize = 128;

/// The tiles the parts' products together aim for: a few waves of a large GPU's
/// multiprocessors (an H200 has 132).
const TILES_AIMED: usize = 512;

/// The parts a weight's gradient over `rows` rows of `inputs` → `outputs` is summed by: the
/// fewest powers of two that give 512 output tiles of 128 × 128 together, each part
/// [`LEAST_PART_ROWS`] rows at least and dividing `rows`, 2²³ partial elements at most.
/// 1: one product, as Burn's.
pub fn weight_parts(rows: usize, inputs: usize, outputs: usize) -> usize {
    let tiles = inputs.div_ceil(TILE) * outputs.div_ceil(TILE);
    let aimed = TILES_AIMED.div_ceil(tiles.max(1));
    let mut parts = 1;
    while parts < aimed {
        let next = parts * 2;
        if !rows.is_multiple_of(next)
            || rows / next < LEAST_PART_ROWS
            || next * inputs * outputs > MOST_PARTIAL
        {
            break;
        }
        parts = next;
    }
    parts
}

/// `x · weight + bias` (`x` `[rows, in]`, `weight` `[in, out]`, `bias` `[out]`) as the batched
/// product of `parts` parts of the rows with the weight broadcast (see the module's page): the
/// weight's gradient summed by parts. `parts` must divide the rows.
pub fn linear_by_parts(
    x: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    parts: usize,
) -> Tensor<2> {
    let [rows, inputs] = x.dims();
    let [inputs2, outputs] = weight.dims();
    assert_eq!(
        inputs, inputs2,
        "linear: input rows of {inputs}, weight of {inputs2} inputs"
    );
    assert!(
        parts > 0 && rows.is_multiple_of(parts),
        "linear by parts: {rows} rows in {parts} parts"
    );
    let y = x
        .reshape([parts, rows / parts, inputs])
        .matmul(weight.unsqueeze_dim::<3>(0));
    let y = match bias {
        Some(b) => y + b.reshape([1, 1, outputs]),
        None => y,
    };
    y.reshape([rows, outputs])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cube::test_values::{assert_close, numbers, values};
    use burn::tensor::TensorData;

    #[test]
    fn the_rows_are_cut_in_powers_of_two_within_the_tile_row_and_memory_bounds() {
        // The GPT GPU recipe: 64 × 256 rows; the projection, qkv, MLP in and out, tied head.
        let rows = 16_384;
        // The projection's 9 tiles ask for 64 parts; 2²³ partial elements allow 32.
        assert_eq!(weight_parts(rows, 384, 384), 32);
        assert_eq!(weight_parts(rows, 384, 1_152), 16);
        assert_eq!(weight_parts(rows, 384, 1_536), 8);
        assert_eq!(weight_parts(rows, 1_536, 384), 8);
        assert_eq!(weight_parts(rows, 384, 65), 64);
        // Parts of 256 rows at least, dividing the rows.
        assert_eq!(weight_parts(128, 32, 32), 1);
        assert_eq!(weight_parts(1_000, 32, 32), 2);
        assert_eq!(weight_parts(1_001, 32, 32), 1);
        // A weight that fills the tiles alone is one product.
        assert_eq!(weight_parts(rows, 4_096, 4_096), 1);
        // Where the tiles ask for more, the rows stop it (256 a part at least).
        assert_eq!(weight_parts(2_048, 64, 64), 8);
    }

    /// The output and the gradients of x, the weight and the bias of `f` under a weighted sum.
    fn output_and_grads(
        device: &Device,
        (rows, inputs, outputs): (usize, usize, usize),
        f: impl Fn(Tensor<2>, Tensor<2>, Tensor<1>) -> Tensor<2>,
    ) -> [Vec<f32>; 4] {
        let leaf = |shape: Vec<usize>, seed| {
            let n = shape.iter().product();
            Tensor::<2>::from_data(TensorData::new(numbers(n, seed), shape), device).require_grad()
        };
        let x = leaf(vec![rows, inputs], 1);
        let w = leaf(vec![inputs, outputs], 2);
        let b = Tensor::<1>::from_data(TensorData::new(numbers(outputs, 3), [outputs]), device)
            .require_grad();
        let y = f(x.clone(), w.clone(), b.clone());
        let weights = Tensor::<2>::from_data(
            TensorData::new(numbers(rows * outputs, 4), [rows, outputs]),
            device,
        );
        let grads = (y.clone() * weights).sum().backward();
        [
            values(y),
            values(x.grad(&grads).unwrap()),
            values(w.grad(&grads).unwrap()),
            values(b.grad(&grads).unwrap()),
        ]
    }

    #[test]
    fn by_parts_the_linear_gives_burns_output_and_gradients() {
        let device = Device::flex().autodiff();
        for (shape, parts) in [((1_024, 24, 40), 4), ((512, 7, 3), 2), ((96, 5, 9), 3)] {
            let split = output_and_grads(&device, shape, |x, w, b| {
                linear_by_parts(x, w, Some(b), parts)
            });
            let burn = output_and_grads(&device, shape, |x, w, b| {
                burn::tensor::module::linear(x, w, Some(b))
            });
            for (name, (a, b)) in ["output", "dx", "dweight", "dbias"]
                .iter()
                .zip(split.iter().zip(&burn))
            {
                assert_close(&format!("{shape:?} in {parts} parts, {name}"), a, b);
            }
        }
    }
}
