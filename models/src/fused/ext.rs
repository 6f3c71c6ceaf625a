//! The fused kernels as a Burn backend extension: [`FusedOps`] on Flex (forward only) and on
//! `Autodiff<Flex>` (forward, and a backward written by hand that runs the backward kernels).
//! Only f32 tensors reach it (see [`super::fused_here`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, OpsPrep};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Flex, backend_extension};
use burn::tensor::{DType, Shape};

use super::flex::{
    attention_forward, attention_shape, contiguous, cross_entropy_forward, dims, f32s,
    gelu_forward, heads_of, layer_norm_forward, linear_backward, linear_forward, operand,
    packed_forward, packed_shape, relu_max_pool2_forward, rms_norm_forward, scored, starts,
    swiglu_forward, targets, tensor, view4,
};
use super::{gated, kernels};

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
    /// RMSNorm over the last dimension.
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;
    /// `silu(gate) · up`.
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// ReLU then 2×2 max-pooling of stride 2 (`[B, C, H, W]` → `[B, C, H/2, W/2]`).
    fn fused_relu_max_pool2(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Mean cross-entropy of `logits` `[N, V]` against `targets` `[N]`, shape `[1]`.
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self>;
    /// Causal attention of `q`, `k`, `v` (`[B, H, T, D]`), scaled by 1/√D; `starts`: each
    /// row's first key (`[B, T]`: the first position of its document in a packed row), or
    /// empty (every row sees the keys from 0).
    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
    ) -> FloatTensor<Self>;
    /// Causal attention of a packed projection `qkv` (`[B, T, 3·C]`: q, k and v side by side,
    /// each of `heads` heads), `[B, T, C]` with the heads side by side; `starts` as
    /// [`FusedOps::fused_causal_attention`]'s.
    fn fused_causal_attention_packed(
        qkv: FloatTensor<Self>,
        heads: usize,
        starts: IntTensor<Self>,
    ) -> FloatTensor<Self>;
    /// `x · w` (`[M, K] · [K, N]`).
    fn fused_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `x · w + b` (`b`: `[N]`).
    fn fused_linear_bias(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
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

    fn fused_rms_norm(x: FlexTensor, gamma: FlexTensor, eps: f64) -> FlexTensor {
        rms_norm_forward(&x, &gamma, eps).0
    }

    fn fused_swiglu(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
        swiglu_forward(&gate, &up)
    }

    fn fused_relu_max_pool2(x: FlexTensor) -> FlexTensor {
        relu_max_pool2_forward(&x).0
    }

    fn fused_cross_entropy(logits: FlexTensor, t: IntTensor<Flex>) -> FlexTensor {
        cross_entropy_forward(&logits, &targets(&t)).0
    }

    fn fused_causal_attention(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        s: IntTensor<Flex>,
    ) -> FlexTensor {
        attention_forward(&q, &k, &v, &starts(&s)).0
    }

    fn fused_causal_attention_packed(
        qkv: FlexTensor,
        heads: usize,
        s: IntTensor<Flex>,
    ) -> FlexTensor {
        packed_forward(&qkv, heads, &starts(&s)).0
    }

    fn fused_linear(x: FlexTensor, w: FlexTensor) -> FlexTensor {
        linear_forward(&x, &w, None)
    }

    fn fused_linear_bias(x: FlexTensor, w: FlexTensor, b: FlexTensor) -> FlexTensor {
        linear_forward(&x, &w, Some(&b))
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
struct RmsNormBackward;

impl Backward<Flex, 2> for RmsNormBackward {
    /// Input, gamma, each row's 1/rms.
    type State = (FlexTensor, FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma] = ops.parents;
        let dy = contiguous(&grads.consume::<Flex>(&ops.node));
        let (x, gamma, inv) = ops.state;
        let shape = dims(&x);
        let c = *shape.last().unwrap();
        let (x, gamma) = (contiguous(&x), contiguous(&gamma));
        let mut dx = vec![0.0f32; f32s(&x).len()];
        let mut dgamma = vec![0.0f32; c];
        gated::rms_norm_backward(
            f32s(&x),
            c,
            f32s(&gamma),
            f32s(&inv),
            f32s(&dy),
            &mut dx,
            &mut dgamma,
        );
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, tensor(dx, shape));
        }
        if let Some(node) = node_gamma {
            grads.register::<Flex>(node.id, tensor(dgamma, [c]));
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl Backward<Flex, 2> for SwigluBackward {
    /// The gate and up inputs.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let dy = contiguous(&grads.consume::<Flex>(&ops.node));
        let (gate, up) = ops.state;
        let shape = dims(&gate);
        let (gate, up) = (contiguous(&gate), contiguous(&up));
        let n = f32s(&gate).len();
        let (mut dgate, mut dup) = (vec![0.0f32; n], vec![0.0f32; n]);
        gated::swiglu_backward(f32s(&gate), f32s(&up), f32s(&dy), &mut dgate, &mut dup);
        if let Some(node) = node_gate {
            grads.register::<Flex>(node.id, tensor(dgate, shape.clone()));
        }
        if let Some(node) = node_up {
            grads.register::<Flex>(node.id, tensor(dup, shape));
        }
    }
}

#[derive(Debug)]
struct PoolBackward;

impl Backward<Flex, 1> for PoolBackward {
    /// The input's shape, and which element of each window gave each output.
    type State = ([usize; 4], std::sync::Arc<Vec<u8>>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dy = contiguous(&grads.consume::<Flex>(&ops.node));
        if let Some(node) = node {
            let ([b, c, h, w], arg) = ops.state;
            let mut dx = vec![0.0f32; b * c * h * w];
            gated::relu_max_pool2_backward(f32s(&dy), &arg, b * c, [h, w], &mut dx);
            grads.register::<Flex>(node.id, tensor(dx, [b, c, h, w]));
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
            let scale = f32s(&dloss)[0] / scored(&targets) as f32;
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

/// Each row's first key, as the attention's forward took them.
type Starts = std::sync::Arc<Vec<usize>>;

impl Backward<Flex, 3> for AttentionBackward {
    /// q, k, v, the output laid out `[B, T, H, D]`, the rows' log-sum-exp and first keys.
    type State = (
        FlexTensor,
        FlexTensor,
        FlexTensor,
        FlexTensor,
        FlexTensor,
        Starts,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let dout = grads.consume::<Flex>(&ops.node);
        let (q, k, v, out, lse, starts) = ops.state;
        let shape = attention_shape(&q, &k, &v);
        let [b, h, t, d] = shape;
        let c = h * d;
        // One [B, T, 3, H, D] buffer; the three gradients are views of it.
        let mut all = vec![0.0f32; 3 * b * t * c];
        kernels::attention_backward(
            view4(&q),
            view4(&k),
            view4(&v),
            out.storage::<f32>(),
            f32s(&lse),
            view4(&dout),
            shape,
            1.0 / (d as f32).sqrt(),
            &starts,
            &mut all,
            [3 * c, 0, c, 2 * c],
        );
        let all = tensor(all, [b, t, 3 * c]);
        for (i, node) in [node_q, node_k, node_v].into_iter().enumerate() {
            if let Some(node) = node {
                let strides = vec![(t * 3 * c) as isize, d as isize, 3 * c as isize, 1];
                let layout = Layout::new(Shape::from(shape.to_vec()), strides, i * c);
                let grad = FlexTensor::from_arc(all.data_arc(), layout, DType::F32);
                grads.register::<Flex>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct PackedAttentionBackward;

impl Backward<Flex, 1> for PackedAttentionBackward {
    /// The packed projection, the output, the rows' log-sum-exp, the heads, the first keys.
    type State = (FlexTensor, FlexTensor, FlexTensor, usize, Starts);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let dout = operand(&grads.consume::<Flex>(&ops.node));
        let Some(node) = node else { return };
        let (qkv, out, lse, heads, starts) = ops.state;
        let qkv = operand(&qkv);
        let shape = packed_shape(&qkv, heads);
        let [b, h, t, d] = shape;
        let c = h * d;
        let mut dqkv = vec![0.0f32; 3 * b * t * c];
        kernels::attention_backward(
            heads_of(&qkv, 0, shape),
            heads_of(&qkv, c, shape),
            heads_of(&qkv, 2 * c, shape),
            out.storage::<f32>(),
            f32s(&lse),
            heads_of(&dout, 0, shape),
            shape,
            1.0 / (d as f32).sqrt(),
            &starts,
            &mut dqkv,
            [3 * c, 0, c, 2 * c],
        );
        grads.register::<Flex>(node.id, tensor(dqkv, [b, t, 3 * c]));
    }
}

/// A Linear's backward, with a bias (three parents: input, weight, bias) or without (two).
#[derive(Debug)]
struct LinearBackward;

impl<const N: usize> Backward<Flex, N> for LinearBackward {
    /// The input and the weight.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<Flex>(&ops.node);
        let (x, w) = ops.state;
        let want = std::array::from_fn(|i| ops.parents.get(i).is_some_and(Option::is_some));
        let computed = linear_backward(&x, &w, &dy, want);
        for (node, grad) in ops.parents.into_iter().zip(computed) {
            if let (Some(node), Some(grad)) = (node, grad) {
                grads.register::<Flex>(node.id, grad);
            }
        }
    }
}

/// `y`, an op's output computed on Flex, as the output on `Autodiff<Flex>` of the op whose
/// backward `prep` prepared: recorded with its backward's `state` (made only then) where an
/// input is tracked, untracked otherwise. Every fused op's autodiff arm, here and in
/// [`super::vision`] and [`super::seed`], ends so.
pub(super) fn record<BO, S, C, const N: usize>(
    prep: OpsPrep<BO, Flex, S, C, N>,
    state: impl FnOnce() -> S,
    y: FlexTensor,
) -> FloatTensor<Autodiff<Flex, C>>
where
    BO: Backward<Flex, N, State = S>,
    S: Clone + Send + std::fmt::Debug + 'static,
    C: CheckpointStrategy,
{
    match prep.compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state(), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    }
}

impl<C: CheckpointStrategy> FusedOps for Autodiff<Flex, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let (p, g) = (x.primitive(), gamma.primitive());
        let (y, stats) = layer_norm_forward(p, g, beta.primitive(), eps);
        let prep = LayerNormBackward.prepare::<C>([x.node(), gamma.node(), beta.node()]);
        record(prep, || (p.clone(), g.clone(), stats), y)
    }

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let y = gelu_forward(x.primitive());
        record(
            GeluBackward.prepare::<C>([x.node()]),
            || x.primitive().clone(),
            y,
        )
    }

    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let (p, g) = (x.primitive(), gamma.primitive());
        let (y, inv) = rms_norm_forward(p, g, eps);
        let prep = RmsNormBackward.prepare::<C>([x.node(), gamma.node()]);
        record(prep, || (p.clone(), g.clone(), inv), y)
    }

    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (g, u) = (gate.primitive(), up.primitive());
        let y = swiglu_forward(g, u);
        let prep = SwigluBackward.prepare::<C>([gate.node(), up.node()]);
        record(prep, || (g.clone(), u.clone()), y)
    }

    fn fused_relu_max_pool2(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let (y, arg) = relu_max_pool2_forward(x.primitive());
        let shape = || -> [usize; 4] { dims(x.primitive()).try_into().unwrap() };
        record(PoolBackward.prepare::<C>([x.node()]), || (shape(), arg), y)
    }

    fn fused_cross_entropy(logits: FloatTensor<Self>, t: IntTensor<Self>) -> FloatTensor<Self> {
        let t = targets(&t);
        let (loss, lse) = cross_entropy_forward(logits.primitive(), &t);
        let state = || (logits.primitive().clone(), std::sync::Arc::new(t), lse);
        record(
            CrossEntropyBackward.prepare::<C>([logits.node()]),
            state,
            loss,
        )
    }

    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let (qp, kp, vp) = (q.primitive(), k.primitive(), v.primitive());
        let s = std::sync::Arc::new(starts(&s));
        let (y, lse) = attention_forward(qp, kp, vp, &s);
        let prep = AttentionBackward.prepare::<C>([q.node(), k.node(), v.node()]);
        let state = || (qp.clone(), kp.clone(), vp.clone(), y.clone(), lse, s);
        record(prep, state, y.clone())
    }

    fn fused_causal_attention_packed(
        qkv: FloatTensor<Self>,
        heads: usize,
        s: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let s = std::sync::Arc::new(starts(&s));
        let (y, lse) = packed_forward(qkv.primitive(), heads, &s);
        let state = || (qkv.primitive().clone(), y.clone(), lse, heads, s);
        record(
            PackedAttentionBackward.prepare::<C>([qkv.node()]),
            state,
            y.clone(),
        )
    }

    fn fused_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let y = linear_forward(x.primitive(), w.primitive(), None);
        let state = || (x.primitive().clone(), w.primitive().clone());
        record(LinearBackward.prepare::<C>([x.node(), w.node()]), state, y)
    }

    fn fused_linear_bias(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let y = linear_forward(x.primitive(), w.primitive(), Some(b.primitive()));
        let state = || (x.primitive().clone(), w.primitive().clone());
        record(
            LinearBackward.prepare::<C>([x.node(), w.node(), b.node()]),
            state,
            y,
        )
    }
}
