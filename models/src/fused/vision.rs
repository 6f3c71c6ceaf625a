//! The image models' fused kernels (convolution, BatchNorm in training) as a Burn backend
//! extension: [`VisionOps`] on Flex (forward only) and on `Autodiff<Flex>` (forward, and a
//! backward written by hand). Only f32 tensors reach it (see [`super::fused_here`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Flex, backend_extension};

use super::conv::{self, ConvGeometry};
use super::conv_rows;
use super::ext::record;
use super::flex::{contiguous, dims, f32s, tensor};

/// The fused image operations. Each takes and returns f32 tensors on Flex.
#[backend_extension(Flex, Autodiff)]
pub trait VisionOps: burn::backend::Backend {
    /// Convolution of `x` (`[B, C, H, W]`) by `w` (`[O, C, kh, kw]`) of stride 1, no dilation,
    /// one group, `pad_h`/`pad_w` zeros on both sides: `[B, O, Ho, Wo]`.
    fn fused_conv2d(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        pad_h: usize,
        pad_w: usize,
    ) -> FloatTensor<Self>;
    /// [`Self::fused_conv2d`] plus a bias `b` (`[O]`).
    fn fused_conv2d_bias(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        pad_h: usize,
        pad_w: usize,
    ) -> FloatTensor<Self>;
    /// BatchNorm of `x` (`[B, C, ...]`) with the batch's statistics: the output, each
    /// channel's mean and biased variance (these two not differentiated).
    fn fused_batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// `(x − mean)·γ/√(var + ε) + β` per channel of `x` (`[B, C, ...]`), differentiable in
    /// all five (the statistics given, as a synchronised BatchNorm has them).
    fn fused_batch_norm_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        var: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;
    /// Per channel of `x` (`[B, C, ...]`), `Σ (x − center)` or (`squared`) `Σ (x − center)²`
    /// over every other dimension: `[C]`, not differentiated.
    fn fused_channel_sums(
        x: FloatTensor<Self>,
        center: FloatTensor<Self>,
        squared: bool,
    ) -> FloatTensor<Self>;
}

/// A convolution's geometry from its operands' shapes.
fn geometry(x: &FlexTensor, w: &FlexTensor, padding: [usize; 2]) -> ConvGeometry {
    let [batch, channels, height, width]: [usize; 4] =
        dims(x).try_into().expect("conv2d takes [B, C, H, W]");
    let [out_channels, c, kh, kw]: [usize; 4] = dims(w)
        .try_into()
        .expect("conv2d's weight is [O, C, kh, kw]");
    assert_eq!(
        c, channels,
        "conv2d: {channels} channels in, a weight for {c}"
    );
    ConvGeometry {
        batch,
        channels,
        height,
        width,
        out_channels,
        kernel: [kh, kw],
        padding,
    }
}

fn conv_forward(
    x: &FlexTensor,
    w: &FlexTensor,
    b: Option<&FlexTensor>,
    p: [usize; 2],
) -> FlexTensor {
    let g = geometry(x, w, p);
    let (x, w, b) = (contiguous(x), contiguous(w), b.map(contiguous));
    let (x, w, b) = (f32s(&x), f32s(&w), b.as_ref().map(f32s));
    let y = if conv_rows::fits(&g) {
        conv_rows::forward(&g, x, w, b)
    } else {
        conv::conv_forward(&g, x, w, b)
    };
    let [ho, wo] = g.out_hw();
    tensor(y, [g.batch, g.out_channels, ho, wo])
}

/// `[B, C, S]` of a `[B, C, ...]` tensor.
fn planes(x: &FlexTensor) -> [usize; 3] {
    let d = dims(x);
    assert!(d.len() >= 2, "BatchNorm takes [batch, channels, ...]");
    [d[0], d[1], d[2..].iter().product()]
}

/// The output, mean and variance of BatchNorm in training.
fn batch_norm_forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    eps: f64,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let [b, c, s] = planes(x);
    let (x_c, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
    let mut y = vec![0.0f32; b * c * s];
    let (mut mean, mut var) = (vec![0.0f32; c], vec![0.0f32; c]);
    conv::batch_norm_forward(
        f32s(&x_c),
        [b, c, s],
        f32s(&gamma),
        f32s(&beta),
        eps as f32,
        &mut y,
        &mut mean,
        &mut var,
    );
    (tensor(y, dims(x)), tensor(mean, [c]), tensor(var, [c]))
}

fn batch_norm_stats_forward(
    x: &FlexTensor,
    [gamma, beta, mean, var]: [&FlexTensor; 4],
    eps: f64,
) -> FlexTensor {
    let dims3 = planes(x);
    let x_c = contiguous(x);
    let [gamma, beta, mean, var] = [gamma, beta, mean, var].map(contiguous);
    let mut y = vec![0.0f32; x_c.layout().num_elements()];
    conv::batch_norm_apply(
        f32s(&x_c),
        dims3,
        f32s(&gamma),
        f32s(&beta),
        (f32s(&mean), f32s(&var)),
        eps as f32,
        &mut y,
    );
    tensor(y, dims(x))
}

fn channel_sums(x: &FlexTensor, center: &FlexTensor, squared: bool) -> FlexTensor {
    let dims3 = planes(x);
    let (x, center) = (contiguous(x), contiguous(center));
    let sums = conv::channel_sums(f32s(&x), dims3, f32s(&center), squared);
    tensor(sums.into_iter().map(|v| v as f32).collect(), [dims3[1]])
}

impl VisionOps for Flex {
    fn fused_conv2d(x: FlexTensor, w: FlexTensor, pad_h: usize, pad_w: usize) -> FlexTensor {
        conv_forward(&x, &w, None, [pad_h, pad_w])
    }

    fn fused_conv2d_bias(
        x: FlexTensor,
        w: FlexTensor,
        b: FlexTensor,
        pad_h: usize,
        pad_w: usize,
    ) -> FlexTensor {
        conv_forward(&x, &w, Some(&b), [pad_h, pad_w])
    }

    fn fused_batch_norm_train(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        eps: f64,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        batch_norm_forward(&x, &gamma, &beta, eps)
    }

    fn fused_batch_norm_stats(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        mean: FlexTensor,
        var: FlexTensor,
        eps: f64,
    ) -> FlexTensor {
        batch_norm_stats_forward(&x, [&gamma, &beta, &mean, &var], eps)
    }

    fn fused_channel_sums(x: FlexTensor, center: FlexTensor, squared: bool) -> FlexTensor {
        channel_sums(&x, &center, squared)
    }
}

#[derive(Debug)]
struct ConvBackward;

impl<const N: usize> Backward<Flex, N> for ConvBackward {
    /// Input, weight, padding.
    type State = (FlexTensor, FlexTensor, [usize; 2]);

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = contiguous(&grads.consume::<Flex>(&ops.node));
        let (x, w, padding) = ops.state;
        let g = geometry(&x, &w, padding);
        let want = std::array::from_fn(|i| ops.parents.get(i).is_some_and(Option::is_some));
        let (x_c, w_c) = (contiguous(&x), contiguous(&w));
        let (x_s, w_s, dy) = (f32s(&x_c), f32s(&w_c), f32s(&dy));
        let [dx, dw, db] = if conv_rows::fits(&g) {
            conv_rows::backward(&g, x_s, w_s, dy, want)
        } else {
            conv::conv_backward(&g, x_s, w_s, dy, want)
        };
        let shapes = [dims(&x), dims(&w), vec![g.out_channels]];
        let computed = [dx, dw, db].into_iter().zip(shapes);
        for (node, (grad, shape)) in ops.parents.into_iter().zip(computed) {
            if let (Some(node), Some(grad)) = (node, grad) {
                grads.register::<Flex>(node.id, tensor(grad, shape));
            }
        }
    }
}

#[derive(Debug)]
struct BatchNormBackward;

impl Backward<Flex, 3> for BatchNormBackward {
    /// Input, gamma, the batch's mean and variance, epsilon.
    type State = (FlexTensor, FlexTensor, FlexTensor, FlexTensor, f64);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let dy = contiguous(&grads.consume::<Flex>(&ops.node));
        let (x, gamma, mean, var, eps) = ops.state;
        let [b, c, s] = planes(&x);
        let (x_c, gamma) = (contiguous(&x), contiguous(&gamma));
        let mut dx = node_x.is_some().then(|| vec![0.0f32; b * c * s]);
        let (mut dgamma, mut dbeta) = (vec![0.0f32; c], vec![0.0f32; c]);
        conv::batch_norm_backward(
            f32s(&x_c),
            [b, c, s],
            f32s(&gamma),
            (f32s(&contiguous(&mean)), f32s(&contiguous(&var))),
            eps as f32,
            f32s(&dy),
            dx.as_deref_mut(),
            &mut dgamma,
            &mut dbeta,
        );
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<Flex>(node.id, tensor(dx, dims(&x)));
        }
        if let Some(node) = node_gamma {
            grads.register::<Flex>(node.id, tensor(dgamma, [c]));
        }
        if let Some(node) = node_beta {
            grads.register::<Flex>(node.id, tensor(dbeta, [c]));
        }
    }
}

#[derive(Debug)]
struct BatchNormStatsBackward;

impl Backward<Flex, 5> for BatchNormStatsBackward {
    /// Input, gamma, mean, variance, epsilon.
    type State = (FlexTensor, FlexTensor, FlexTensor, FlexTensor, f64);

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, rest @ ..] = ops.parents;
        let dy = contiguous(&grads.consume::<Flex>(&ops.node));
        let (x, gamma, mean, var, eps) = ops.state;
        let dims3 = planes(&x);
        let x_c = contiguous(&x);
        let [gamma, mean, var] = [gamma, mean, var].map(|t| contiguous(&t));
        let mut dx = node_x
            .is_some()
            .then(|| vec![0.0f32; x_c.layout().num_elements()]);
        let per_channel = conv::batch_norm_stats_backward(
            f32s(&x_c),
            dims3,
            f32s(&gamma),
            (f32s(&mean), f32s(&var)),
            eps as f32,
            f32s(&dy),
            dx.as_deref_mut(),
        );
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<Flex>(node.id, tensor(dx, dims(&x)));
        }
        // gamma, beta, mean, var
        for (node, grad) in rest.into_iter().zip(per_channel) {
            if let Some(node) = node {
                grads.register::<Flex>(node.id, tensor(grad, [dims3[1]]));
            }
        }
    }
}

impl<C: CheckpointStrategy> VisionOps for Autodiff<Flex, C> {
    fn fused_conv2d(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        pad_h: usize,
        pad_w: usize,
    ) -> FloatTensor<Self> {
        let p = [pad_h, pad_w];
        let y = conv_forward(x.primitive(), w.primitive(), None, p);
        let state = || (x.primitive().clone(), w.primitive().clone(), p);
        record(ConvBackward.prepare::<C>([x.node(), w.node()]), state, y)
    }

    fn fused_conv2d_bias(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        pad_h: usize,
        pad_w: usize,
    ) -> FloatTensor<Self> {
        let p = [pad_h, pad_w];
        let y = conv_forward(x.primitive(), w.primitive(), Some(b.primitive()), p);
        let state = || (x.primitive().clone(), w.primitive().clone(), p);
        record(
            ConvBackward.prepare::<C>([x.node(), w.node(), b.node()]),
            state,
            y,
        )
    }

    fn fused_batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (p, g) = (x.primitive(), gamma.primitive());
        let (y, mean, var) = batch_norm_forward(p, g, beta.primitive(), eps);
        let prep = BatchNormBackward.prepare::<C>([x.node(), gamma.node(), beta.node()]);
        let state = || (p.clone(), g.clone(), mean.clone(), var.clone(), eps);
        let y = record(prep, state, y);
        (
            y,
            <FloatTensor<Self>>::new(mean),
            <FloatTensor<Self>>::new(var),
        )
    }

    fn fused_batch_norm_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        var: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let [p, g, m, v] = [&x, &gamma, &mean, &var].map(|t| t.primitive());
        let y = batch_norm_stats_forward(p, [g, beta.primitive(), m, v], eps);
        let parents = [x.node(), gamma.node(), beta.node(), mean.node(), var.node()];
        let state = || (p.clone(), g.clone(), m.clone(), v.clone(), eps);
        record(BatchNormStatsBackward.prepare::<C>(parents), state, y)
    }

    fn fused_channel_sums(
        x: FloatTensor<Self>,
        center: FloatTensor<Self>,
        squared: bool,
    ) -> FloatTensor<Self> {
        <FloatTensor<Self>>::new(channel_sums(x.primitive(), center.primitive(), squared))
    }
}
