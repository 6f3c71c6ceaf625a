//! The vocabulary split over a tensor-parallel group: the token embedding's rows and the
//! head's columns cut into equal parts, and a cross-entropy that never gathers the logits
//! (Megatron-LM's vocabulary-parallel embedding and parallel cross-entropy).
//!
//! Rank `r` of `size` holds the ids `r·V/size .. (r+1)·V/size`. Its embedding looks up the
//! tokens it holds (the others give zeros) and the group sums the lookups; its head scores its
//! ids only, and the loss is put together from three sums over the group: the largest score of
//! each position (a stabiliser, no gradient), the sum of the exponentials, and the target's
//! score from the rank that holds it.

use burn::nn::Embedding;
use burn::prelude::*;
use burn::tensor::{FloatDType, TensorData};

use super::group::current;
use super::ops::reduce_from_group;

/// The first id of this rank's part of a vocabulary of `vocab` ids when the thread runs in a
/// tensor-parallel group and the table holds `held` of them (its part); `None` on one device
/// or when the table is whole.
pub fn vocab_start(held: usize, vocab: usize) -> Option<usize> {
    let group = current()?;
    let (rank, size) = (group.0.rank(), group.0.size());
    (size > 1 && held * size == vocab).then_some(rank * held)
}

/// The token embedding of `tokens` from `table`: where it holds the ids from `start` on (a
/// vocabulary-parallel part, [`vocab_start`]), each rank looks up the tokens it holds, the
/// others give zeros, and the group sums the lookups; a whole table (`None`) looks them up.
pub fn embedding(table: &Embedding, tokens: Tensor<2, Int>, start: Option<usize>) -> Tensor<3> {
    let Some(start) = start else {
        return crate::cube::embedding(table, tokens);
    };
    let held = table.weight.dims()[0] as i64;
    let local = tokens.sub_scalar(start as i64);
    let mine = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(held));
    let ids = local.clamp(0, held - 1);
    let rows = crate::cube::embedding(table, ids);
    let dtype = rows.dtype();
    let keep = mine
        .float()
        .cast(FloatDType::from(dtype))
        .unsqueeze_dim::<3>(2);
    reduce_from_group(rows * keep)
}

/// The head's input `x`: where the vocabulary is cut (`start`, [`vocab_start`]) every rank
/// scores its ids from the whole input, whose gradient the group sums going back
/// ([`super::copy_to_group`]); as it is otherwise.
pub fn to_head<const D: usize>(x: Tensor<D>, start: Option<usize>) -> Tensor<D> {
    match start {
        Some(_) => super::copy_to_group(x),
        None => x,
    }
}

/// Each row's largest value over the group (`x`: `[n, 1]`, every rank its own), with no
/// gradient: the stabiliser of a softmax whose columns are spread over the group.
fn group_max(x: Tensor<2>) -> Tensor<2> {
    let Some(group) = current() else {
        return x.detach();
    };
    let (rank, size) = (group.0.rank(), group.0.size());
    let [n, _] = x.dims();
    let device = x.device();
    let mine: Vec<f32> = x
        .detach()
        .try_into_vec_as::<f32>()
        .unwrap_or_else(|e| panic!("tensor parallelism: the row maxima as f32: {e:?}"));
    // Every rank's maxima in its own slot, the others zero: the sum is an all-gather.
    let mut slots = vec![0.0f32; size * n];
    slots[rank * n..(rank + 1) * n].copy_from_slice(&mine);
    if let Err(e) = group.0.all_reduce_sum(&mut slots) {
        panic!("tensor parallelism: the all-reduce of rank {rank} of {size} failed: {e}");
    }
    let max: Vec<f32> = (0..n)
        .map(|i| {
            (0..size)
                .map(|r| slots[r * n + i])
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    Tensor::<2>::from_data(TensorData::new(max, [n, 1]), &device)
}

/// The mean cross-entropy over the targets that train (`ignore` where none does) of logits
/// of which this rank holds the columns of ids `start..start + V/size` (`logits`:
/// `[n, V/size]`, `targets`: `[n]`), in f32: the same loss as one device's over whole
/// logits, computed from three sums over the group.
pub fn cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    start: usize,
    ignore: i64,
) -> Tensor<1> {
    let logits = logits.cast(FloatDType::F32);
    let [n, held] = logits.dims();
    let max = group_max(logits.clone().max_dim(1));
    let shifted = logits - max;
    let sum = reduce_from_group(shifted.clone().exp().sum_dim(1));
    let trains = targets.clone().not_equal_elem(ignore);
    let local = targets.sub_scalar(start as i64);
    let mine = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(held as i64));
    let ids = local.clamp(0, held as i64 - 1).reshape([n, 1]);
    let picked = shifted.gather(1, ids) * mine.float().reshape([n, 1]);
    let target = reduce_from_group(picked);
    let per = (sum.log() - target).reshape([n]);
    let trains = trains.float();
    let count = trains.clone().sum().clamp_min(1.0);
    (per * trains).sum() / count
}
