//! The fused kernels as a Burn backend extension: [`FusedOps`] on Flex (forward only) and on
//! `Autodiff<Flex>` (forward, and a backward written by hand that runs the backward kernels).
//! Only f32 tensors reach it (see [`super::fused_here`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Flex, backend_extension};
use burn::tensor::{DType, Shape, TensorData};

use super::kernels::{self, View4};

/// The fused operations. Each takes and returns f32 tensors on Flex.
#[backend_extension(Flex, Autodiff)]
pub trait FusedOps: burn::backend::Backend {
    /// LayerNorm over the last dimension (`beta` zeros for none).
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;
    /// The exact GELU.
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Mean cross-entropy of `logits` `[N, V]` against `targets` `[N]`, shape `[1]`.
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self>;
    /// Causal attention of `q`, `k`, `v` (`[B, H, T, D]`), scaled by 1/√D.
    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// A tensor's elements in row-major order (copied only when its layout is not that).
fn contiguous(t: &FlexTensor) -> FlexTensor {
    assert_eq!(
        t.dtype(),
        DType::F32,
        "fused kernels take f32, got {:?}",
        t.dtype()
    );
    t.to_contiguous()
}

fn f32s(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>().expect("a contiguous f32 tensor")
}

fn tensor(values: Vec<f32>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape.into()))
}

fn dims(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}

/// A 4-d tensor read through its strides (last stride 1 or not).
fn view4(t: &FlexTensor) -> View4<'_> {
    assert_eq!(
        t.dtype(),
        DType::F32,
        "fused kernels take f32, got {:?}",
        t.dtype()
    );
    let strides = t.layout().strides();
    assert_eq!(
        strides.len(),
        4,
        "attention takes [batch, heads, time, head_dim]"
    );
    View4 {
        data: t.storage::<f32>(),
        offset: t.layout().start_offset(),
        strides: [strides[0], strides[1], strides[2], strides[3]],
    }
}

/// A `[B, T, H, D]` buffer seen as the `[B, H, T, D]` tensor it holds.
fn heads_view(values: Vec<f32>, [b, h, t, d]: [usize; 4]) -> FlexTensor {
    tensor(values, [b, t, h, d]).transpose(1, 2)
}

fn targets(t: &IntTensor<Flex>) -> Vec<usize> {
    let t = t.to_contiguous();
    let as_index = |i: i64, n: usize| -> usize {
        usize::try_from(i).unwrap_or_else(|_| panic!("target {i} of row {n} is negative"))
    };
    match t.dtype() {
        DType::I64 => t
            .as_slice::<i64>()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(n, &i)| as_index(i, n))
            .collect(),
        DType::I32 => t
            .as_slice::<i32>()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(n, &i)| as_index(i as i64, n))
            .collect(),
        other => panic!("cross-entropy targets must be i64 or i32, got {other:?}"),
    }
}

fn layer_norm_forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    eps: f64,
) -> (FlexTensor, FlexTensor) {
    let shape = dims(x);
    let c = *shape.last().expect("LayerNorm of a scalar");
    let (x, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
    let x = f32s(&x);
    let rows = x.len() / c.max(1);
    let mut y = vec![0.0f32; x.len()];
    let mut stats = vec![0.0f32; rows * 2];
    kernels::layer_norm_forward(
        x,
        c,
        f32s(&gamma),
        f32s(&beta),
        eps as f32,
        &mut y,
        &mut stats,
    );
    (tensor(y, shape), tensor(stats, [rows, 2]))
}

fn gelu_forward(x: &FlexTensor) -> FlexTensor {
    let shape = dims(x);
    let x = contiguous(x);
    let x = f32s(&x);
    let mut y = vec![0.0f32; x.len()];
    kernels::gelu_forward(x, &mut y);
    tensor(y, shape)
}

fn cross_entropy_forward(logits: &FlexTensor, targets: &[usize]) -> (FlexTensor, FlexTensor) {
    let [n, v]: [usize; 2] = dims(logits)
        .try_into()
        .expect("cross-entropy takes [rows, classes]");
    assert_eq!(
        targets.len(),
        n,
        "{n} rows of logits, {} targets",
        targets.len()
    );
    if let Some((row, &t)) = targets.iter().enumerate().find(|(_, t)| **t >= v) {
        panic!("target {t} of row {row} is not below the {v} classes");
    }
    let logits = contiguous(logits);
    let mut lse = vec![0.0f32; n];
    let mut scratch = vec![0.0f32; v];
    let total = kernels::cross_entropy_forward(f32s(&logits), v, targets, &mut lse, &mut scratch);
    (
        tensor(vec![(total / n as f64) as f32], [1]),
        tensor(lse, [n]),
    )
}

fn attention_shape(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor) -> [usize; 4] {
    let shape: [usize; 4] = dims(q)
        .try_into()
        .expect("attention takes [batch, heads, time, head_dim]");
    assert!(
        dims(k) == shape && dims(v) == shape,
        "q, k and v differ in shape"
    );
    shape
}

/// The output (a `[B, H, T, D]` view of a `[B, T, H, D]` buffer) and the rows' log-sum-exp.
fn attention_forward(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor) -> (FlexTensor, FlexTensor) {
    let shape = attention_shape(q, k, v);
    let [b, h, t, d] = shape;
    let mut out = vec![0.0f32; b * h * t * d];
    let mut lse = vec![0.0f32; b * h * t];
    let scale = 1.0 / (d as f32).sqrt();
    kernels::attention_forward(
        view4(q),
        view4(k),
        view4(v),
        shape,
        scale,
        &mut out,
        &mut lse,
    );
    (heads_view(out, shape), tensor(lse, [b * h * t]))
}

impl FusedOps for Flex {
    fn fused_layer_norm(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        eps: f64,
    ) -> FlexTensor {
        layer_norm_forward(&x, &gamma, &beta, eps).0
    }

    fn fused_gelu(x: FlexTensor) -> FlexTensor {
        gelu_forward(&x)
    }

    fn fused_cross_entropy(logits: FlexTensor, t: IntTensor<Flex>) -> FlexTensor {
        cross_entropy_forward(&logits, &targets(&t)).0
    }

    fn fused_causal_attention(q: FlexTensor, k: FlexTensor, v: FlexTensor) -> FlexTensor {
        attention_forward(&q, &k, &v).0
    }
}

#[derive(Debug)]
struct LayerNormBackward;

impl Backward<Flex, 3> for LayerNormBackward {
    /// Input, gamma, the rows' mean and 1/std.
    type State = (FlexTensor, FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma, node_beta] = ops.parents;
        let dy = contiguous(&grads.consume::<Flex>(&ops.node));
        let (x, gamma, stats) = ops.state;
        let shape = dims(&x);
        let c = *shape.last().unwrap();
        let (x, gamma) = (contiguous(&x), contiguous(&gamma));
        let mut dx = vec![0.0f32; f32s(&x).len()];
        let mut dgamma = vec![0.0f32; c];
        let mut dbeta = vec![0.0f32; c];
        let mut scratch = vec![0.0f32; c];
        kernels::layer_norm_backward(
            f32s(&x),
            c,
            f32s(&gamma),
            f32s(&stats),
            f32s(&dy),
            &mut dx,
            &mut dgamma,
            &mut dbeta,
            &mut scratch,
        );
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, tensor(dx, shape));
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
struct GeluBackward;

impl Backward<Flex, 1> for GeluBackward {
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dy = contiguous(&grads.consume::<Flex>(&ops.node));
        if let Some(node) = node {
            let shape = dims(&ops.state);
            let x = contiguous(&ops.state);
            let mut dx = vec![0.0f32; f32s(&x).len()];
            kernels::gelu_backward(f32s(&x), f32s(&dy), &mut dx);
            grads.register::<Flex>(node.id, tensor(dx, shape));
        }
    }
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl Backward<Flex, 1> for CrossEntropyBackward {
    /// Logits, targets, the rows' log-sum-exp.
    type State = (FlexTensor, std::sync::Arc<Vec<usize>>, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dloss = contiguous(&grads.consume::<Flex>(&ops.node));
        if let Some(node) = node {
            let (logits, targets, lse) = ops.state;
            let [n, v]: [usize; 2] = dims(&logits).try_into().unwrap();
            let logits = contiguous(&logits);
            let scale = f32s(&dloss)[0] / n as f32;
            let mut dlogits = vec![0.0f32; n * v];
            kernels::cross_entropy_backward(
                f32s(&logits),
                v,
                &targets,
                f32s(&lse),
                scale,
                &mut dlogits,
            );
            grads.register::<Flex>(node.id, tensor(dlogits, [n, v]));
        }
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl Backward<Flex, 3> for AttentionBackward {
    /// q, k, v, the output laid out `[B, T, H, D]` and the rows' log-sum-exp.
    type State = (FlexTensor, FlexTensor, FlexTensor, FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let dout = grads.consume::<Flex>(&ops.node);
        let (q, k, v, out, lse) = ops.state;
        let shape = attention_shape(&q, &k, &v);
        let n = shape.iter().product();
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
        let scale = 1.0 / (shape[3] as f32).sqrt();
        kernels::attention_backward(
            view4(&q),
            view4(&k),
            view4(&v),
            out.storage::<f32>(),
            f32s(&lse),
            view4(&dout),
            shape,
            scale,
            &mut dq,
            &mut dk,
            &mut dv,
        );
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<Flex>(node.id, heads_view(grad, shape));
            }
        }
    }
}

impl<C: CheckpointStrategy> FusedOps for Autodiff<Flex, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let prep = LayerNormBackward.prepare::<C>([x.node(), gamma.node(), beta.node()]);
        match prep.compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, stats) =
                    layer_norm_forward(x.primitive(), gamma.primitive(), beta.primitive(), eps);
                prep.finish((x.primitive().clone(), gamma.primitive().clone(), stats), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(
                layer_norm_forward(x.primitive(), gamma.primitive(), beta.primitive(), eps).0,
            ),
        }
    }

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match GeluBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = gelu_forward(x.primitive());
                prep.finish(x.primitive().clone(), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(gelu_forward(x.primitive())),
        }
    }

    fn fused_cross_entropy(logits: FloatTensor<Self>, t: IntTensor<Self>) -> FloatTensor<Self> {
        let t = targets(&t);
        match CrossEntropyBackward
            .prepare::<C>([logits.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (loss, lse) = cross_entropy_forward(logits.primitive(), &t);
                prep.finish(
                    (logits.primitive().clone(), std::sync::Arc::new(t), lse),
                    loss,
                )
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(cross_entropy_forward(logits.primitive(), &t).0)
            }
        }
    }

    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let prep = AttentionBackward.prepare::<C>([q.node(), k.node(), v.node()]);
        match prep.compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (y, lse) = attention_forward(q.primitive(), k.primitive(), v.primitive());
                let state = (
                    q.primitive().clone(),
                    k.primitive().clone(),
                    v.primitive().clone(),
                    y.clone(),
                    lse,
                );
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(attention_forward(q.primitive(), k.primitive(), v.primitive()).0)
            }
        }
    }
}
