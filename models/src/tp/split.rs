//! How a parameter is cut over a tensor-parallel group ([`Split`]), the part a rank holds of
//! a whole tensor and the whole put back from the parts, and the Linears of a tensor-parallel
//! pair as functions of a plain `Linear` holding the rank's part: [`column()`] (the output's
//! columns split) and [`row()`] (the input's rows split, the parts summed). A model keeps its
//! modules and their names; its weights are the rank's parts, so that a parameter's path is
//! the same on one device and on every rank, and a checkpoint holds the whole.

use std::ops::Range;

use burn::nn::Linear;
use burn::prelude::*;

use super::ops::{copy_to_group, reduce_from_group};

/// How a parameter is held over a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Whole on every rank (a norm's scale, a row-parallel Linear's bias), its gradient the
    /// same on every rank.
    Whole,
    /// Whole on every rank, each rank's gradient a part of the whole's: the parts are summed
    /// over the group before the step (a LoRA factor beside a cut weight: `a` of a
    /// column-parallel Linear, `b` of a row-parallel one).
    Summed,
    /// Cut along `dim` into `size` equal parts, rank `r` holding part `r`; with `groups` > 1
    /// the dimension is `groups` equal blocks side by side (a fused q/k/v projection's three),
    /// each cut so, and a rank holds its part of every block, in block order.
    Parts {
        /// The dimension cut.
        dim: usize,
        /// The blocks side by side along it.
        groups: usize,
    },
    /// Cut along `dim` by heads of a fused q/k/v projection whose key/value heads are fewer
    /// than its query heads (grouped-query attention): the dimension is `q + 2 kv` heads of
    /// one width, the queries' block then the keys' then the values', and a rank holds its
    /// share of each block's heads, in block order.
    Heads {
        /// The dimension cut.
        dim: usize,
        /// Query heads.
        q: usize,
        /// Key (and value) heads.
        kv: usize,
    },
}

impl Split {
    /// Whether the parameter is cut into parts (not whole on every rank).
    pub fn is_cut(self) -> bool {
        self.cut_dim().is_some()
    }

    /// The dimension a cut parameter is cut along.
    pub fn cut_dim(self) -> Option<usize> {
        match self {
            Split::Parts { dim, .. } | Split::Heads { dim, .. } => Some(dim),
            Split::Whole | Split::Summed => None,
        }
    }

    /// The cut dimension and its blocks' shares of it (equal blocks, or a fused projection's
    /// heads); `None` for a parameter that is not cut.
    fn blocks(self) -> Option<(usize, Vec<usize>)> {
        match self {
            Split::Parts { dim, groups } => Some((dim, vec![1; groups])),
            Split::Heads { dim, q, kv } => Some((dim, vec![q, kv, kv])),
            Split::Whole | Split::Summed => None,
        }
    }

    /// A column-parallel Linear's weight (`[d_in, d_out]`: its outputs) in `groups` blocks.
    pub const fn columns(groups: usize) -> Self {
        Split::Parts { dim: 1, groups }
    }
    /// A column-parallel Linear's bias, or anything cut along its first dimension in `groups`
    /// blocks (an embedding's rows: its vocabulary).
    pub const fn first(groups: usize) -> Self {
        Split::Parts { dim: 0, groups }
    }
    /// A row-parallel Linear's weight (`[d_in, d_out]`: its inputs).
    pub const ROWS: Self = Split::Parts { dim: 0, groups: 1 };
}

/// Part `rank` of `n` cut into `size` equal parts, or why it cannot be.
pub fn split_range(n: usize, rank: usize, size: usize) -> Result<Range<usize>, String> {
    if size == 0 || rank >= size {
        return Err(format!("rank {rank} of a group of {size}"));
    }
    if !n.is_multiple_of(size) {
        return Err(format!(
            "{n} cannot be split into {size} equal parts ({n} is not a multiple of {size})"
        ));
    }
    let part = n / size;
    Ok(rank * part..(rank + 1) * part)
}

/// The widths of the blocks of a dimension of `n` with these `shares` of it (a part's blocks
/// keep the whole's proportions).
fn widths(n: usize, shares: &[usize]) -> Result<Vec<usize>, String> {
    let total: usize = shares.iter().sum();
    if total == 0 || shares.iter().any(|s| !(n * s).is_multiple_of(total)) {
        return Err(format!(
            "{n} cannot be blocks in the proportions {shares:?}"
        ));
    }
    Ok(shares.iter().map(|s| n * s / total).collect())
}

/// The ranges of dimension `n` that rank `rank` of `size` holds of blocks with these `shares`.
fn ranges(
    n: usize,
    shares: &[usize],
    rank: usize,
    size: usize,
) -> Result<Vec<Range<usize>>, String> {
    let mut at = 0;
    let mut out = Vec::with_capacity(shares.len());
    for w in widths(n, shares)? {
        let part = split_range(w, rank, size)?;
        out.push(at + part.start..at + part.end);
        at += w;
    }
    Ok(out)
}

/// Rank `rank`'s part of `whole` under `split` in a group of `size`.
pub fn part_of<const D: usize>(
    whole: Tensor<D>,
    split: Split,
    rank: usize,
    size: usize,
) -> Result<Tensor<D>, String> {
    let Some((dim, shares)) = split.blocks() else {
        return Ok(whole);
    };
    let dims = whole.dims();
    if dim >= D {
        return Err(format!("dimension {dim} of a tensor of {D}"));
    }
    let pieces: Vec<Tensor<D>> = ranges(dims[dim], &shares, rank, size)?
        .into_iter()
        .map(|r| whole.clone().narrow(dim, r.start, r.len()))
        .collect();
    Ok(Tensor::cat(pieces, dim))
}

/// The whole tensor from every rank's part (`parts[r]` rank `r`'s), under `split`.
pub fn whole_of<const D: usize>(parts: Vec<Tensor<D>>, split: Split) -> Result<Tensor<D>, String> {
    let size = parts.len();
    let Some((dim, shares)) = split.blocks() else {
        return parts
            .into_iter()
            .next()
            .ok_or_else(|| "no part".to_string());
    };
    let Some(first) = parts.first() else {
        return Err("no part".into());
    };
    // A part's blocks have the whole's shares: block g of the whole is every rank's piece g,
    // in rank order.
    let mut blocks = Vec::with_capacity(shares.len() * size);
    let mut at = 0;
    for w in widths(first.dims()[dim], &shares)? {
        for part in &parts {
            blocks.push(part.clone().narrow(dim, at, w));
        }
        at += w;
    }
    Ok(Tensor::cat(blocks, dim))
}

/// `(outer, n, inner)` of `shape` around dimension `dim`: the elements before it, its length,
/// and the elements after it, so that element `(o, i, j)` sits at `(o * n + i) * inner + j`.
fn around(shape: &[usize], dim: usize) -> Result<(usize, usize, usize), String> {
    if dim >= shape.len() {
        return Err(format!("dimension {dim} of a tensor of {}", shape.len()));
    }
    Ok((
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    ))
}

/// [`part_of`] on a tensor's values in row-major order, `shape` its shape: rank `rank`'s part
/// and the part's shape.
pub fn part_of_values(
    values: &[f32],
    shape: &[usize],
    split: Split,
    rank: usize,
    size: usize,
) -> Result<(Vec<f32>, Vec<usize>), String> {
    let Some((dim, shares)) = split.blocks() else {
        return Ok((values.to_vec(), shape.to_vec()));
    };
    let (outer, n, inner) = around(shape, dim)?;
    if values.len() != outer * n * inner {
        return Err(format!("{} values for a shape {shape:?}", values.len()));
    }
    let ranges = ranges(n, &shares, rank, size)?;
    let held: usize = ranges.iter().map(|r| r.len()).sum();
    let mut out = Vec::with_capacity(outer * held * inner);
    for o in 0..outer {
        for r in &ranges {
            out.extend_from_slice(&values[(o * n + r.start) * inner..(o * n + r.end) * inner]);
        }
    }
    let mut part_shape = shape.to_vec();
    part_shape[dim] = held;
    Ok((out, part_shape))
}

/// [`whole_of`] on values: the whole tensor's values and shape from every rank's part
/// (`parts[r]` rank `r`'s, each of shape `part_shape`).
pub fn whole_of_values(
    parts: &[Vec<f32>],
    part_shape: &[usize],
    split: Split,
) -> Result<(Vec<f32>, Vec<usize>), String> {
    let Some((dim, shares)) = split.blocks() else {
        let first = parts.first().ok_or_else(|| "no part".to_string())?;
        return Ok((first.clone(), part_shape.to_vec()));
    };
    let size = parts.len();
    let (outer, n, inner) = around(part_shape, dim)?;
    let widths = widths(n, &shares)?;
    if let Some(p) = parts.iter().find(|p| p.len() != outer * n * inner) {
        return Err(format!(
            "a part of {} values for a shape {part_shape:?}",
            p.len()
        ));
    }
    let mut out = Vec::with_capacity(outer * n * inner * size);
    for o in 0..outer {
        // Block g of the whole is every rank's piece g, in rank order.
        let mut at = 0;
        for &w in &widths {
            for part in parts {
                let from = (o * n + at) * inner;
                out.extend_from_slice(&part[from..from + w * inner]);
            }
            at += w;
        }
    }
    let mut shape = part_shape.to_vec();
    shape[dim] = n * size;
    Ok((out, shape))
}

/// A column-parallel Linear: `linear` holds this rank's output columns (`Split::columns` of
/// the weight, `Split::first` of the bias); the input passes [`copy_to_group`], so its
/// gradient is the group's sum. The output is this rank's part.
pub fn column<const D: usize>(linear: &Linear, x: Tensor<D>) -> Tensor<D> {
    linear.forward(copy_to_group(x))
}

/// A row-parallel Linear: `linear` holds this rank's input rows (`Split::ROWS` of the weight)
/// and the whole bias; `x` is this rank's part of the input (a column-parallel output). The
/// products are summed over the group ([`reduce_from_group`]) and the bias added once.
pub fn row<const D: usize>(linear: &Linear, x: Tensor<D>) -> Tensor<D> {
    summed_with_bias(
        linear,
        burn::tensor::module::linear(x, linear.weight.val(), None),
    )
}

/// A row-parallel Linear's products `y` summed over the group, then its whole bias added once.
fn summed_with_bias<const D: usize>(linear: &Linear, y: Tensor<D>) -> Tensor<D> {
    let y = reduce_from_group(y);
    match &linear.bias {
        Some(b) => y + b.val().unsqueeze(),
        None => y,
    }
}

/// [`column()`] on `[B, T, C]` as one product over its rows (`crate::modules::linear_rows`): on
/// one device, the same bits as `linear_rows`.
pub fn column_rows(linear: &Linear, x: Tensor<3>) -> Tensor<3> {
    crate::modules::linear_rows(linear, copy_to_group(x))
}

/// [`row()`] on `[B, T, C]` as one product over its rows; on one device `linear_rows` itself (the
/// bias inside the product, as before).
pub fn row_rows(linear: &Linear, x: Tensor<3>) -> Tensor<3> {
    if super::group::current().is_none() {
        return crate::modules::linear_rows(linear, x);
    }
    let y = crate::modules::on_rows(x, |rows| {
        crate::fused::linear(rows, linear.weight.val(), None)
    });
    summed_with_bias(linear, y)
}
