//! What the causal language models share: the next-token loss, the causal mask (with an
//! optional sliding window), the key/value cache and greedy or sampled decoding with it.

use burn::prelude::*;

use crate::modules::{DeviceKey, device_key, kept_per_thread};

/// The target of a position that takes no part in the loss — a prompt's token when only
/// the answers train, padding: PyTorch's `ignore_index`, so that labels made for
/// `transformers` read the same.
pub const IGNORE: i64 = -100;

/// A batch of token windows: `targets` are `inputs` shifted by one position.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    /// Token ids, shape `[batch, time]`.
    pub inputs: Tensor<2, Int>,
    /// Next-token ids, shape `[batch, time]`; [`IGNORE`] where a position has no loss.
    pub targets: Tensor<2, Int>,
    /// How many targets are not [`IGNORE`], counted where the batch was built (the loss is
    /// their mean, and the log's tokens per second counts them); `None`: every one.
    pub trained: Option<usize>,
    /// What the batch's mean loss is multiplied by: its share of the trained targets of the
    /// whole step times the step's batches (over micro-batches and ranks), so that a step
    /// whose batches train different numbers of targets takes the mean over all of them, as
    /// one batch of the whole step would; `None`: 1.
    pub loss_weight: Option<f32>,
    /// Several examples packed into each row: where each position's example begins in its
    /// row (`[batch, time]`). Attention stays within an example and positions restart at
    /// each, so a packed row computes what its examples would one by one; `None`: one
    /// sequence per row.
    pub documents: Option<Tensor<2, Int>>,
}

impl TokenBatch {
    /// A batch whose every target trains.
    pub fn new(inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Self {
        Self {
            inputs,
            targets,
            trained: None,
            loss_weight: None,
            documents: None,
        }
    }

    /// The targets the loss is the mean over: `trained`, or every one.
    pub fn trained_tokens(&self) -> usize {
        self.trained
            .unwrap_or_else(|| self.targets.shape().num_elements())
    }
}

/// Each position's place within its example, from the examples' starts `[batch, time]` (see
/// [`TokenBatch::documents`]): 0 at an example's first token.
pub fn positions_within(starts: &Tensor<2, Int>) -> Tensor<2, Int> {
    let [b, t] = starts.dims();
    Tensor::<1, Int>::arange(0..t as i64, &starts.device())
        .reshape([1, t])
        .expand([b, t])
        - starts.clone()
}

/// Mean next-token cross-entropy of `logits` (`[b, t, vocab]`) against `targets` (`[b, t]`),
/// computed in f32 whatever the logits' dtype, over the targets that are not [`IGNORE`].
pub fn lm_loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    // One fused kernel on the CPU.
    crate::fused::cross_entropy(logits.reshape([b * t, v]), targets.reshape([b * t]))
}

/// A language model's step output on `batch` from its `logits`: the mean next-token loss over
/// the targets that train (times the batch's `loss_weight`), their count (the log's tokens
/// per second), the batch's samples.
pub fn lm_output(logits: Tensor<3>, batch: &TokenBatch) -> crate::step::StepOutput {
    lm_output_cut(logits, batch, None)
}

/// [`lm_output`] where a tensor-parallel group may cut the vocabulary: with `vocab_start`
/// (the first id this rank holds, [`crate::tp::vocab::vocab_start`]) `logits` are this rank's
/// columns and the loss is the parallel cross-entropy, which gathers no logits.
pub fn lm_output_cut(
    logits: Tensor<3>,
    batch: &TokenBatch,
    vocab_start: Option<usize>,
) -> crate::step::StepOutput {
    let samples = batch.inputs.dims()[0];
    let mut loss = match vocab_start {
        None => lm_loss(logits, batch.targets.clone()),
        Some(start) => {
            let [b, t, v] = logits.dims();
            let targets = batch.targets.clone().reshape([b * t]);
            let logits = logits.reshape([b * t, v]);
            crate::tp::vocab::cross_entropy(logits, targets, start, IGNORE)
        }
    };
    if let Some(w) = batch.loss_weight {
        loss = loss.mul_scalar(w);
    }
    crate::step::StepOutput::new(loss, samples).with_tokens(batch.trained_tokens())
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

/// How a continuation picks each next id, and where it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely id.
    pub temperature: f64,
    /// Draw only among the `k` most likely ids.
    pub top_k: Option<usize>,
    /// Draw only among the fewest most likely ids whose probabilities (at the temperature)
    /// add up to at least `p` (nucleus sampling), in (0, 1].
    pub top_p: Option<f64>,
    /// Ids that end the continuation (an end-of-turn or end-of-sequence token): the one
    /// drawn is kept as the last id.
    pub stop: Vec<u32>,
}

impl Sampling {
    /// The most likely id each time, no stop.
    pub fn greedy() -> Self {
        Self::at(0.0)
    }

    /// Sampling at `temperature` over every id, no stop.
    pub fn at(temperature: f64) -> Self {
        Self {
            temperature,
            top_k: None,
            top_p: None,
            stop: Vec::new(),
        }
    }

    /// The id drawn from `logits` with the uniform number `u` in [0, 1).
    pub fn pick(&self, logits: &[f32], u: f64) -> u32 {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if self.temperature <= 0.0 {
            return order[0] as u32;
        }
        let keep = self.top_k.unwrap_or(logits.len()).clamp(1, logits.len());
        let mut top = &order[..keep];
        let max = f64::from(logits[top[0]]);
        let mut weights: Vec<f64> = top
            .iter()
            .map(|&i| ((f64::from(logits[i]) - max) / self.temperature).exp())
            .collect();
        if let Some(p) = self.top_p {
            // The most likely first: keep the shortest prefix that reaches p.
            let total: f64 = weights.iter().sum();
            let mut sum = 0.0;
            let mut n = weights.len();
            for (k, w) in weights.iter().enumerate() {
                sum += w / total;
                if sum >= p {
                    n = k + 1;
                    break;
                }
            }
            top = &top[..n];
            weights.truncate(n);
        }
        let total: f64 = weights.iter().sum();
        let mut target = u * total;
        for (&i, w) in top.iter().zip(&weights) {
            if target < *w {
                return i as u32;
            }
            target -= w;
        }
        top[top.len() - 1] as u32
    }
}

/// Continues `prompt` by up to `tokens` ids through `step` (logits of new ids after a cache's
/// positions, which it extends): the prompt once, then one position per token, each picked as
/// `how` says, ending early at one of its stop ids. Past `longest` positions the cache starts
/// again from the last half of the context. `uniform` draws numbers in [0, 1).
pub fn generate(
    prompt: &[u32],
    tokens: usize,
    (how, longest): (&Sampling, usize),
    device: &Device,
    mut step: impl FnMut(Tensor<2, Int>, &mut KvCache) -> Tensor<3>,
    mut uniform: impl FnMut() -> f64,
) -> Vec<u32> {
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
        let next = how.pick(&logits, uniform());
        ids.push(next);
        if how.stop.contains(&next) {
            break;
        }
        fresh = vec![next];
    }
    ids
}

/// A causal language model kiln trains on token windows and decodes from: each family the
/// [`crate::registry`] lists.
pub trait CausalLm:
    crate::step::TrainStep<TokenBatch> + crate::blocks::BlockStack<TokenBatch> + Sized
{
    /// Its architecture: a config section (serialised in a run's `model.toml`).
    type Config: Clone
        + std::fmt::Debug
        + Default
        + PartialEq
        + serde::Serialize
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static;

    /// A freshly initialised model of `config` on `device`.
    fn init(config: &Self::Config, device: &Device) -> Self;

    /// The longest context `config` allows, in tokens.
    fn context(config: &Self::Config) -> usize;

    /// Training FLOPs per token at a context of `context` tokens.
    fn flops_per_token(config: &Self::Config, context: usize) -> f64;

    /// Logits `[batch, time, vocab]` of token ids `[batch, time]`.
    fn logits(&self, tokens: Tensor<2, Int>) -> Tensor<3>;

    /// `prompt` continued by up to `tokens` ids, picked as `how` says (temperature 0: the
    /// most likely each time), ending early at one of its stop ids.
    fn continue_ids(
        &self,
        prompt: &[u32],
        tokens: usize,
        how: &Sampling,
        uniform: &mut dyn FnMut() -> f64,
    ) -> Vec<u32>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_keeps_to_top_k_and_top_p() {
        let logits = [0.0, 5.0, 1.0, 4.0];
        assert_eq!(Sampling::greedy().pick(&logits, 0.7), 1);
        let k2 = Sampling {
            top_k: Some(2),
            ..Sampling::at(1.0)
        };
        let mut seen = std::collections::BTreeSet::new();
        for u in [0.0, 0.3, 0.6, 0.8, 0.99] {
            seen.insert(k2.pick(&logits, u));
        }
        assert_eq!(seen, [1, 3].into());
        // At temperature 1, id 1 holds 0.70 of the mass and ids 1 and 3 0.96: p = 0.5 keeps id
        // 1 alone, p = 0.9 both, and u near 1 reaches id 3 only then.
        let p = |p| Sampling {
            top_p: Some(p),
            ..Sampling::at(1.0)
        };
        assert_eq!(p(0.5).pick(&logits, 0.99), 1);
        assert_eq!(p(0.9).pick(&logits, 0.99), 3);
        assert_eq!(Sampling::at(1.0).pick(&logits, 0.999), 0);
    }

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
