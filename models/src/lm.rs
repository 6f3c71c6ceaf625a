//! What the causal language models share: the next-token loss, the causal mask (with an
//! optional sliding window), the key/value cache and greedy or sampled decoding with it.

use burn::prelude::*;

use crate::modules::{DeviceKey, device_key, kept_per_thread};

/// Mean next-token cross-entropy of `logits` (`[b, t, vocab]`) against `targets` (`[b, t]`),
/// computed in f32 whatever the logits' dtype.
pub fn lm_loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    crate::gpt::Gpt::loss(logits, targets)
}

/// The positions `t` queries (at `start..start + t`) may not see among the `start + t` keys:
/// `true` for a key after the query, and, with a `window`, for a key `window` or more positions
/// before it. `[t, start + t]`.
///
/// Built once per thread for each span and device and kept (a block walk asks for it in every
/// block, a run in every step).
pub fn causal_mask(
    start: usize,
    t: usize,
    window: Option<usize>,
    device: &Device,
) -> Tensor<2, Bool> {
    type Masks = Vec<((usize, usize, Option<usize>, DeviceKey), Tensor<2, Bool>)>;
    thread_local! {
        static MASKS: std::cell::RefCell<Masks> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let key = (start, t, window, device_key(device));
    kept_per_thread(&MASKS, key, || build_mask(start, t, window, device))
}

fn build_mask(start: usize, t: usize, window: Option<usize>, device: &Device) -> Tensor<2, Bool> {
    let s = start + t;
    let mut masked = Vec::with_capacity(t * s);
    for i in 0..t {
        let q = start + i;
        for k in 0..s {
            let before = window.is_some_and(|w| k + w <= q);
            masked.push(k > q || before);
        }
    }
    Tensor::from_data(TensorData::new(masked, [t, s]), device)
}

/// The keys and values of the positions a model has seen, per layer (`[b, kv heads, positions,
/// d]`), and how many positions that is.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Positions cached.
    pub len: usize,
    /// Per layer: keys and values.
    pub layers: Vec<(Option<Tensor<4>>, Option<Tensor<4>>)>,
}

/// Continues `prompt` by `tokens` ids through `step` (logits of new ids after a cache's
/// positions, which it extends): the prompt once, then one position per token. `how`: the
/// temperature (0 takes the most likely id), the top-k, and the longest context — past it the
/// cache starts again from the last half of the context. `uniform` draws numbers in [0, 1).
pub fn generate(
    prompt: &[u32],
    tokens: usize,
    how: (f64, Option<usize>, usize),
    device: &Device,
    mut step: impl FnMut(Tensor<2, Int>, &mut KvCache) -> Tensor<3>,
    mut uniform: impl FnMut() -> f64,
) -> Vec<u32> {
    let (temperature, top_k, longest) = how;
    let mut ids = prompt.to_vec();
    let mut cache = KvCache::default();
    let start = ids.len().saturating_sub(longest);
    let mut fresh: Vec<u32> = ids[start..].to_vec();
    for _ in 0..tokens {
        if cache.len + fresh.len() > longest {
            cache = KvCache::default();
            fresh = ids[ids.len().saturating_sub(longest / 2)..].to_vec();
        }
        let t = fresh.len();
        let input = Tensor::<2, Int>::from_data(
            TensorData::new(fresh.iter().map(|&i| i64::from(i)).collect(), [1, t]),
            device,
        );
        let logits = step(input, &mut cache)
            .slice([0..1, t - 1..t])
            .reshape([-1]);
        let logits: Vec<f32> = logits.into_data().iter::<f32>().collect();
        let next = crate::gpt::sample(&logits, temperature, top_k, uniform());
        ids.push(next);
        fresh = vec![next];
    }
    ids
}

/// A causal language model kiln trains on token windows and decodes from: kiln's GPT, and the
/// Hugging Face families [`crate::llama::Llama`] and [`crate::gpt2::Gpt2`].
pub trait CausalLm:
    crate::step::TrainStep<crate::gpt::TokenBatch>
    + crate::blocks::BlockStack<crate::gpt::TokenBatch>
    + Sized
{
    /// Its architecture.
    type Config: Clone + std::fmt::Debug + Send + Sync + 'static;

    /// A freshly initialised model of `config` on `device`.
    fn init(config: &Self::Config, device: &Device) -> Self;

    /// The longest context `config` allows, in tokens.
    fn context(config: &Self::Config) -> usize;

    /// Training FLOPs per token at a context of `context` tokens.
    fn flops_per_token(config: &Self::Config, context: usize) -> f64;

    /// Logits `[batch, time, vocab]` of token ids `[batch, time]`.
    fn logits(&self, tokens: Tensor<2, Int>) -> Tensor<3>;

    /// `prompt` continued by `tokens` ids (temperature 0: the most likely each time).
    fn continue_ids(
        &self,
        prompt: &[u32],
        tokens: usize,
        temperature: f64,
        top_k: Option<usize>,
        uniform: &mut dyn FnMut() -> f64,
    ) -> Vec<u32>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_hides_the_future_and_what_lies_past_the_window() {
        let device = Device::flex();
        let m: Vec<bool> = causal_mask(0, 3, None, &device)
            .into_data()
            .try_to_vec()
            .unwrap();
        assert_eq!(
            m,
            [false, true, true, false, false, true, false, false, false]
        );
        // Two cached positions, two new ones, a window of 2: query 2 sees 1 and 2, query 3
        // sees 2 and 3.
        let m: Vec<bool> = causal_mask(2, 2, Some(2), &device)
            .into_data()
            .try_to_vec()
            .unwrap();
        assert_eq!(m, [true, false, false, true, true, true, false, false]);
    }
}
