//! Grouped-query self-attention with rotary positions (the rotary decoders'), and which keys
//! each query sees: a plain causal span (the fused kernel), a span after cached positions or
//! under a sliding window (a mask), packed examples (the fused kernel within each, or a mask
//! per batch row under a window).

use burn::nn::Linear;
use burn::prelude::*;

use crate::fused::repeat_heads;
use crate::lm::causal_mask;
use crate::rope::Rope;

/// A layer's key/value cache: the keys and values of the positions before.
pub(crate) type LayerCache = (Option<Tensor<4>>, Option<Tensor<4>>);

/// Grouped-query self-attention with rotary positions.
#[derive(Module, Debug)]
pub struct Attention {
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
}

impl Attention {
    /// `[b, t, c]` → `[b, t, c]` at positions given by `rope`; with a `cache`, the keys and
    /// values of earlier positions are read from it and this call's appended (then `mask`
    /// covers the cached positions too).
    pub(crate) fn forward(
        &self,
        x: Tensor<3>,
        rope: &Rope,
        mask: &Masking,
        heads: (usize, usize),
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        use crate::tp::{column_rows, row_rows};
        let (rank, size) = crate::tp::place();
        // In a tensor-parallel group a rank holds `h / size` query heads; its key/value heads
        // are its part when the group divides them, else every head, of which it takes the
        // one its query heads read (`TensorParallel for Llama`).
        let (h, kv) = heads;
        let local = h / size;
        let q = column_rows(&self.q_proj, x.clone());
        let k = column_rows(&self.k_proj, x.clone());
        let v = column_rows(&self.v_proj, x);
        let width = |p: &Linear| p.weight.dims()[1];
        let (k, v, kv) = if size > 1 && width(&self.k_proj) == width(&self.q_proj) / local * kv {
            let d = width(&self.q_proj) / local;
            let head = rank * local / (h / kv);
            let pick = |y: Tensor<3>| y.narrow(2, head * d, d);
            (pick(k), pick(v), 1)
        } else {
            (k, v, kv / size)
        };
        let y = attend([q, k, v], rope, mask, (local, kv), cache);
        row_rows(&self.o_proj, y)
    }
}

/// Projected queries `[b, t, h·d]`, keys and values `[b, t, kv·d]` (`heads` = (h, kv)):
/// queries and keys rotated by `rope`, each key/value head serving h / kv query heads, the
/// keys `mask` hides left out; `[b, t, h·d]` for the output projection. With a `cache`, the
/// keys and values of earlier positions are read from it and these appended.
pub(crate) fn attend(
    [q, k, v]: [Tensor<3>; 3],
    rope: &Rope,
    mask: &Masking,
    heads: (usize, usize),
    cache: Option<&mut LayerCache>,
) -> Tensor<3> {
    let [b, t, _] = q.dims();
    let (h, kv) = heads;
    let split = |y: Tensor<3>, n: usize| {
        let d = y.dims()[2] / n;
        y.reshape([b, t, n, d]).swap_dims(1, 2)
    };
    let q = rope.apply(split(q, h));
    let mut k = rope.apply(split(k, kv));
    let mut v = split(v, kv);
    if let Some((ck, cv)) = cache {
        if let Some(old) = ck.take() {
            k = Tensor::cat(vec![old, k], 2);
        }
        if let Some(old) = cv.take() {
            v = Tensor::cat(vec![old, v], 2);
        }
        *ck = Some(k.clone());
        *cv = Some(v.clone());
    }
    let d = q.dims()[3];
    let s = k.dims()[2];
    // The composed product, the keys `hidden` hides (one mask for every row, or one per row)
    // at −∞; each key/value head serves h / kv query heads.
    let composed = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, hidden: Option<Tensor<4, Bool>>| {
        let (k, v) = (repeat_heads(k, h), repeat_heads(v, h));
        let scores = q
            .matmul(k.swap_dims(2, 3))
            .mul_scalar(1.0 / (d as f64).sqrt());
        let scores = match hidden {
            Some(m) => scores.mask_fill(m.expand([b, h, t, s]), f32::NEG_INFINITY),
            None => scores,
        };
        burn::tensor::activation::softmax(scores, 3).matmul(v)
    };
    let y = match mask {
        // Every query sees itself and what came before: one fused kernel on the CPU, the
        // GPU's kernels (which read a key/value head for its query heads) on a CubeCL device.
        Masking::Causal => crate::fused::causal_attention(q, k, v, None),
        // The same within each packed example.
        Masking::Within(starts) => crate::fused::attention_within(q, k, v, Some(starts), None),
        Masking::Keys(mask) => {
            let hidden = mask.as_ref().map(|m| (**m).clone().reshape([1, 1, t, s]));
            composed(q, k, v, hidden)
        }
        Masking::Batch(hidden) => composed(q, k, v, Some(hidden.clone().reshape([b, 1, t, s]))),
    };
    y.swap_dims(1, 2).reshape([b, t, h * d])
}

/// Which keys each query of a span may see.
pub(crate) enum Masking {
    /// Itself and every earlier position (a span from the first position, no window shorter
    /// than it): the fused causal attention, no mask built.
    Causal,
    /// Where the mask is `true` a key is hidden (`[t, start + t]`); `None`: every key seen.
    Keys(Option<Box<Tensor<2, Bool>>>),
    /// Causal within each packed example: the examples' starts (`[b, t]`, see
    /// [`crate::lm::TokenBatch::documents`]).
    Within(Tensor<2, Int>),
    /// Where the mask is `true` a key is hidden, per batch row (`[b, t, t]`: packed examples
    /// with a sliding window).
    Batch(Tensor<3, Bool>),
}

impl Masking {
    /// The keys `t` new positions after `start` cached ones see, within `window`.
    pub(crate) fn span(start: usize, t: usize, window: Option<usize>, device: &Device) -> Self {
        // From the first position, with no window shorter than the span: plain causal.
        let causal = start == 0 && t > 1 && window.is_none_or(|w| w >= t);
        if causal {
            Masking::Causal
        } else {
            Masking::Keys(
                (t > 1 || window.is_some())
                    .then(|| Box::new(causal_mask(start, t, window, device))),
            )
        }
    }

    /// The keys of packed rows (`starts`, see [`crate::lm::TokenBatch::documents`]): within each example
    /// and `window`.
    pub(crate) fn within(starts: &Tensor<2, Int>, window: Option<usize>) -> Self {
        let [b, t] = starts.dims();
        match window {
            Some(w) if w < t => {
                let device = starts.device();
                let keys = Tensor::<1, Int>::arange(0..t as i64, &device)
                    .reshape([1, 1, t])
                    .expand([b, t, t]);
                let queries = keys.clone().swap_dims(1, 2);
                let start = starts.clone().reshape([b, t, 1]).expand([b, t, t]);
                // A later key, one before the example, or one the window has left behind.
                let hidden = keys
                    .clone()
                    .greater(queries.clone())
                    .bool_or(keys.clone().lower(start))
                    .bool_or((queries - keys).greater_equal_elem(w as i64));
                Masking::Batch(hidden)
            }
            _ => Masking::Within(starts.clone()),
        }
    }
}
