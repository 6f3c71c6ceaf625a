//! Synchronised BatchNorm: batch statistics over the global batch of every replica.
//!
//! With `ddp.sync_batchnorm`, a model whose blocks expose their BatchNorm
//! ([`BlockStack::block_norm`]) runs on the block walk ([`super::run`]), each such block cut
//! into three segments around its norm. At each norm the
//! per-channel mean and variance are all-reduced over ranks (two passes, like the one-device
//! computation), so every replica normalises with the statistics one device would compute on
//! the whole global batch. The norm is then a function of the local input `a` and of the
//! global statistics `m` and `v`; its backward gives the local gradients with respect to `a`,
//! `m` and `v`, and the gradients with respect to `m` and `v` are summed over ranks and folded
//! back into the input gradient (`∂m/∂aᵢ = 1/N`, `∂v/∂aᵢ = 2(aᵢ − m)/N` over the `N` values
//! of a channel in the global batch). Running statistics are updated from the global
//! statistics, so they agree on every replica.

use burn::module::Module;
use burn::nn::BatchNorm;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use kiln_models::fused::{self, batch_norm_with};
use kiln_models::{Activation, BlockStack};

use super::segment::segment_backward;
use crate::comm::{Collective, ReduceOp};
use crate::error::Result;

/// What the backward of a norm needs besides its input and output.
pub(crate) struct NormSaved {
    mean_leaf: Tensor<1>,
    var_leaf: Tensor<1>,
    mean: Tensor<1>,
    count: f32,
}

/// One segment of a synchronised block's forward pass: its input leaf, its output (with the
/// segment's graph), and, for the norm, the statistics it used.
pub(crate) struct Segment {
    input: Activation,
    output: Activation,
    norm: Option<NormSaved>,
}

/// Block `i` (which has a BatchNorm) on `x`, cut around its norm, with the norm's statistics
/// taken over every rank of `comm`: the block's output and its segments for the backward.
/// Every rank must call it for every micro-batch.
pub(crate) fn block_forward<B, M>(
    model: &M,
    i: usize,
    x: Activation,
    comm: &dyn Collective,
    device: &Device,
) -> Result<(Activation, Vec<Segment>)>
where
    M: BlockStack<B> + Module,
{
    let norm = model
        .block_norm(i)
        .expect("block_forward is called for blocks with a norm");
    let mut segments = Vec::with_capacity(3);
    let input = x.detach().require_grad();
    let before = model.before_norm(i, input.clone());
    segments.push(Segment {
        input,
        output: before.clone(),
        norm: None,
    });
    let (leaf, normed, saved) = synced_norm(norm, before.detach(), comm, device)?;
    segments.push(Segment {
        input: leaf,
        output: normed.clone(),
        norm: Some(saved),
    });
    let input = normed.detach().require_grad();
    let output = model.after_norm(i, input.clone());
    segments.push(Segment {
        input,
        output: output.clone(),
        norm: None,
    });
    Ok((output.detach(), segments))
}

/// The backward of a block [`block_forward`] ran, seeded with `upstream`: the gradient for the
/// block below and the block's parameter gradients.
pub(crate) fn block_backward<M: Module>(
    model: &M,
    segments: Vec<Segment>,
    mut upstream: Activation,
    comm: Option<&dyn Collective>,
    device: &Device,
) -> Result<(Activation, GradientsParams)> {
    let mut grads = GradientsAccumulator::new();
    for segment in segments.into_iter().rev() {
        let graph = segment_backward(segment.output, upstream);
        let local = segment
            .input
            .grad(&graph)
            .expect("every segment's output depends on its input");
        upstream = match (&segment.norm, comm) {
            (Some(n), Some(comm)) => {
                let gm = n.mean_leaf.grad(&graph).expect("the norm uses its mean");
                let gv = n.var_leaf.grad(&graph).expect("the norm uses its variance");
                fold_statistics_grads(local, segment.input.detach(), n, gm, gv, comm, device)?
            }
            _ => local,
        };
        grads.accumulate(model, GradientsParams::from_grads(graph, model));
    }
    Ok((upstream, grads.grads()))
}

/// `norm` applied to `a` with the statistics of the global batch: the input leaf, the output
/// and what the backward needs. Updates the norm's running statistics.
fn synced_norm(
    norm: &BatchNorm,
    a: Activation,
    comm: &dyn Collective,
    device: &Device,
) -> Result<(Activation, Activation, NormSaved)> {
    let channels = a.dims()[1];
    let local_count = (a.dims().iter().product::<usize>() / channels) as f32;
    // First pass: the mean.
    let mut sums = channel_sums(&a, None, false);
    sums.push(local_count);
    comm.all_reduce(&mut sums, ReduceOp::Sum)?;
    let count = sums.pop().expect("the count was pushed");
    // The statistics take the dtype the norm computes in (bf16 under a `-true` precision).
    let dtype = crate::params::float_dtype(norm.gamma.val().dtype());
    let mean: Vec<f32> = sums.iter().map(|s| s / count).collect();
    // Second pass: the (biased) variance around the global mean, as one device computes it.
    let mut squares = channel_sums(&a, Some(&mean), true);
    comm.all_reduce(&mut squares, ReduceOp::Sum)?;
    let var: Vec<f32> = squares.iter().map(|s| s / count).collect();
    let mean = Tensor::<1>::from_data(TensorData::new(mean, [channels]), device).cast(dtype);
    let var = Tensor::<1>::from_data(TensorData::new(var, [channels]), device).cast(dtype);

    let momentum = norm.momentum as f32;
    let running_mean = norm.running_mean.value_sync().to_device(device);
    let running_var = norm.running_var.value_sync().to_device(device);
    norm.running_mean.update(
        (running_mean.mul_scalar(1.0 - momentum) + mean.clone().mul_scalar(momentum)).detach(),
    );
    norm.running_var.update(
        (running_var.mul_scalar(1.0 - momentum) + var.clone().mul_scalar(momentum)).detach(),
    );

    let mean_leaf = mean.clone().require_grad();
    let var_leaf = var.require_grad();
    let leaf = a.require_grad();
    let stats = [
        norm.gamma.val(),
        norm.beta.val(),
        mean_leaf.clone(),
        var_leaf.clone(),
    ];
    let normed = match leaf.clone() {
        Activation::Rank2(t) => Activation::Rank2(batch_norm_with(t, stats, norm.epsilon)),
        Activation::Rank3(t) => Activation::Rank3(batch_norm_with(t, stats, norm.epsilon)),
        Activation::Rank4(t) => Activation::Rank4(batch_norm_with(t, stats, norm.epsilon)),
    };
    Ok((
        leaf,
        normed,
        NormSaved {
            mean_leaf,
            var_leaf,
            mean,
            count,
        },
    ))
}

/// The input gradient of a synchronised norm: the local part plus the mean and variance
/// gradients of every rank, carried back to this rank's inputs.
fn fold_statistics_grads(
    local: Activation,
    a: Activation,
    n: &NormSaved,
    gm: Tensor<1>,
    gv: Tensor<1>,
    comm: &dyn Collective,
    device: &Device,
) -> Result<Activation> {
    let channels = gm.dims()[0];
    let mut both = host(gm);
    both.extend(host(gv));
    comm.all_reduce(&mut both, ReduceOp::Sum)?;
    let (gm, gv) = both.split_at(channels);
    let dtype = crate::params::float_dtype(n.mean.dtype());
    let per = |v: &[f32], factor: f32| {
        let v: Vec<f32> = v.iter().map(|x| x * factor / n.count).collect();
        Tensor::<1>::from_data(TensorData::new(v, [channels]), device).cast(dtype)
    };
    let through_mean = per(gm, 1.0);
    let through_var = per(gv, 2.0);
    let centered = sub_channels(a, n.mean.clone());
    Ok(add(local, affine(centered, through_var, through_mean)))
}

fn host(t: Tensor<1>) -> Vec<f32> {
    t.into_data().convert::<f32>().iter::<f32>().collect()
}

/// `[C]` values shaped to broadcast along dimension 1 of a rank-`D` tensor.
fn along_channels<const D: usize>(v: Tensor<1>) -> Tensor<D> {
    let mut shape = [1usize; D];
    shape[1] = v.dims()[0];
    v.reshape(shape)
}

/// Per-channel sums of `a` on the host ([`kiln_models::fused::channel_sums`]).
fn channel_sums(a: &Activation, center: Option<&[f32]>, squared: bool) -> Vec<f32> {
    match a {
        Activation::Rank2(t) => fused::channel_sums(t, center, squared),
        Activation::Rank3(t) => fused::channel_sums(t, center, squared),
        Activation::Rank4(t) => fused::channel_sums(t, center, squared),
    }
}

/// `a − mean` per channel.
fn sub_channels(a: Activation, mean: Tensor<1>) -> Activation {
    match a {
        Activation::Rank2(t) => Activation::Rank2(t - along_channels(mean)),
        Activation::Rank3(t) => Activation::Rank3(t - along_channels(mean)),
        Activation::Rank4(t) => Activation::Rank4(t - along_channels(mean)),
    }
}

/// `a · scale + shift` per channel.
fn affine(a: Activation, scale: Tensor<1>, shift: Tensor<1>) -> Activation {
    match a {
        Activation::Rank2(t) => {
            Activation::Rank2(t * along_channels(scale) + along_channels(shift))
        }
        Activation::Rank3(t) => {
            Activation::Rank3(t * along_channels(scale) + along_channels(shift))
        }
        Activation::Rank4(t) => {
            Activation::Rank4(t * along_channels(scale) + along_channels(shift))
        }
    }
}

fn add(a: Activation, b: Activation) -> Activation {
    match (a, b) {
        (Activation::Rank2(x), Activation::Rank2(y)) => Activation::Rank2(x + y),
        (Activation::Rank3(x), Activation::Rank3(y)) => Activation::Rank3(x + y),
        (Activation::Rank4(x), Activation::Rank4(y)) => Activation::Rank4(x + y),
        _ => unreachable!("a norm's input and its gradient have the same rank"),
    }
}
