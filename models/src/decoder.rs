//! What the rotary decoders share — the Llama's shape, which Phi-3 has too: a token
//! embedding, pre-norm layers of grouped-query attention with rotary positions and a gated
//! MLP, a final RMSNorm and a tied or untied head. A family says how one of its layers runs
//! ([`Decoder::layer`]) and where its parts are; the forward (plain, packed, cached),
//! decoding and the block walk are written here once.

use burn::nn::{Embedding, Linear, RmsNorm};
use burn::prelude::*;
use burn::store::KeyRemapper;

use crate::blocks::Activation;
use crate::family::HfNaming;
use crate::gqa::{LayerCache, Masking};
use crate::lm::{KvCache, TokenBatch};
use crate::rope::Rope;

/// A rotary decoder, as its family builds it.
pub(crate) trait Decoder {
    /// One decoder layer.
    type Layer: Module;

    /// The token embedding (also the head when tied).
    fn embed_tokens(&self) -> &Embedding;
    /// The decoder layers.
    fn layers(&self) -> &[Self::Layer];
    /// The final norm.
    fn norm(&self) -> &RmsNorm;
    /// The output head; `None` when tied to the token embedding.
    fn lm_head(&self) -> Option<&Linear>;
    /// The rotary embedding's inverse frequencies (fewer than half a head's width when only
    /// part of each head rotates).
    fn inv_freq(&self) -> Vec<f32>;
    /// The sliding window, if any.
    fn window(&self) -> Option<usize>;
    /// Query and key/value heads.
    fn heads(&self) -> (usize, usize);
    /// The vocabulary's size (the embedding holds a part of it where a tensor-parallel group
    /// cuts it).
    fn vocab(&self) -> usize;
    /// How the family is cut over a tensor-parallel group, if it says (see
    /// [`crate::blocks::BlockStack::tensor_parallel`]); `None` by default.
    fn tensor_parallel(&self) -> Option<&dyn crate::tp::TensorParallel> {
        None
    }
    /// The longest context.
    fn max_positions(&self) -> usize;
    /// `layer` on `x` `[b, t, c]` at the positions of `rope`, its keys as `mask` says, with
    /// a `cache` when decoding.
    fn layer(
        &self,
        layer: &Self::Layer,
        x: Tensor<3>,
        rope: &Rope,
        mask: &Masking,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3>;
}

/// The rotary tables and the attention mask of `t` new positions after `start` cached ones.
pub(crate) fn positions<D: Decoder>(
    d: &D,
    start: usize,
    t: usize,
    device: &Device,
) -> (Rope, Masking) {
    let rope = Rope::new(&d.inv_freq(), start, t, device);
    (rope, Masking::span(start, t, d.window(), device))
}

/// The rotary tables and the attention mask of packed rows (`starts`, see
/// [`TokenBatch::documents`]): positions from 0 in each example, attention within it (and
/// within the sliding window, where there is one).
pub(crate) fn positions_within<D: Decoder>(d: &D, starts: &Tensor<2, Int>) -> (Rope, Masking) {
    let within = crate::lm::positions_within(starts);
    let rope = Rope::at(&d.inv_freq(), within);
    (rope, Masking::within(starts, d.window()))
}

/// The first id of the vocabulary part this rank holds, in a tensor-parallel group that cuts
/// it; `None` otherwise.
fn vocab_start<D: Decoder>(d: &D) -> Option<usize> {
    crate::tp::vocab::vocab_start(d.embed_tokens().weight.dims()[0], d.vocab())
}

/// How a rotary decoder's token embedding and head are held over a tensor-parallel group of
/// `size`: their rows and columns cut where `size` divides the `vocab`; `None` for any other
/// parameter (the family's split says).
pub(crate) fn vocab_split(path: &str, vocab: usize, size: usize) -> Option<crate::tp::Split> {
    let cut = vocab.is_multiple_of(size);
    match path {
        "model.embed_tokens.weight" if cut => Some(crate::tp::Split::first(1)),
        "lm_head.weight" if cut => Some(crate::tp::Split::columns(1)),
        _ => None,
    }
}

/// The token embedding of `tokens` (the group's sum of its parts where it is cut).
pub(crate) fn embed<D: Decoder>(d: &D, tokens: Tensor<2, Int>) -> Tensor<3> {
    crate::tp::vocab::embedding(d.embed_tokens(), tokens, vocab_start(d))
}

/// The step's output from the logits (this rank's columns where the vocabulary is cut: the
/// parallel cross-entropy).
pub(crate) fn output<D: Decoder>(
    d: &D,
    logits: Tensor<3>,
    batch: &TokenBatch,
) -> crate::step::StepOutput {
    crate::lm::lm_output_cut(logits, batch, vocab_start(d))
}

/// The final norm and the head: `[b, t, c]` → logits `[b, t, vocab]` (this rank's columns
/// where a tensor-parallel group cuts the vocabulary).
pub(crate) fn head<D: Decoder>(d: &D, x: Tensor<3>) -> Tensor<3> {
    let x = crate::fused::rms_norm(d.norm(), x);
    let x = crate::tp::vocab::to_head(x, vocab_start(d));
    match d.lm_head() {
        Some(head) => crate::modules::linear_rows(head, x),
        None => {
            let [b, t, c] = x.dims();
            let weight = d.embed_tokens().weight.val();
            let vocab = weight.dims()[0];
            crate::cube::product(x.reshape([b * t, c]), weight.transpose()).reshape([b, t, vocab])
        }
    }
}

/// Logits `[batch, time, vocab]` of token ids `[batch, time]`, of packed rows where `starts`
/// is given (see [`TokenBatch::documents`]).
pub(crate) fn forward_within<D: Decoder>(
    d: &D,
    tokens: Tensor<2, Int>,
    starts: Option<&Tensor<2, Int>>,
) -> Tensor<3> {
    let t = tokens.dims()[1];
    let (rope, mask) = match starts {
        Some(s) => positions_within(d, s),
        None => positions(d, 0, t, &tokens.device()),
    };
    let mut x = embed(d, tokens);
    for layer in d.layers() {
        x = d.layer(layer, x, &rope, &mask, None);
    }
    head(d, x)
}

/// Logits `[batch, time, vocab]` of `tokens` following the positions `cache` holds, which
/// takes their keys and values.
pub(crate) fn forward_cached<D: Decoder>(
    d: &D,
    tokens: Tensor<2, Int>,
    cache: &mut KvCache,
) -> Tensor<3> {
    let t = tokens.dims()[1];
    let (rope, mask) = positions(d, cache.len, t, &tokens.device());
    cache.layers.resize(d.layers().len(), (None, None));
    let mut x = embed(d, tokens);
    for (layer, kv) in d.layers().iter().zip(cache.layers.iter_mut()) {
        x = d.layer(layer, x, &rope, &mask, Some(kv));
    }
    cache.len += t;
    head(d, x)
}

/// `prompt` continued by up to `tokens` ids, each picked as `how` says, with a key/value
/// cache: the prompt once, then one position per new token; ends early at a stop id.
pub(crate) fn generate<D: Decoder>(
    d: &D,
    prompt: &[u32],
    tokens: usize,
    how: &crate::lm::Sampling,
    uniform: impl FnMut() -> f64,
) -> Vec<u32> {
    let device = d.embed_tokens().weight.val().device();
    crate::lm::generate(
        prompt,
        tokens,
        (how, d.max_positions()),
        &device,
        |ids, cache| forward_cached(d, ids, cache),
        uniform,
    )
}

/// The block walk's stem: the token embedding.
pub(crate) fn stem<D: Decoder>(d: &D, batch: &TokenBatch) -> Activation {
    Activation::Rank3(embed(d, batch.inputs.clone()))
}

/// The block walk's block `i`, of packed rows where `batch` has documents.
pub(crate) fn block<D: Decoder>(
    d: &D,
    i: usize,
    x: Activation,
    batch: Option<&TokenBatch>,
) -> Activation {
    let x: Tensor<3> = x.into_rank();
    let (rope, mask) = match batch.and_then(|b| b.documents.as_ref()) {
        Some(starts) => positions_within(d, starts),
        None => positions(d, 0, x.dims()[1], &x.device()),
    };
    Activation::Rank3(d.layer(&d.layers()[i], x, &rope, &mask, None))
}

/// The block walk (`BlockStack`: the embedding as the stem, each layer a block, the final
/// norm and head with the loss) and the training step (`TrainStep`: the packed forward and
/// the loss) of the rotary decoder `$model`, written once for every family that is one.
macro_rules! decoder_steps {
    ($model:ty) => {
        impl $crate::blocks::BlockStack<$crate::lm::TokenBatch> for $model {
            fn tensor_parallel(&self) -> Option<&dyn $crate::tp::TensorParallel> {
                $crate::decoder::Decoder::tensor_parallel(self)
            }

            fn num_blocks(&self) -> usize {
                $crate::decoder::Decoder::layers(self).len()
            }

            fn stem(&self, batch: &$crate::lm::TokenBatch) -> $crate::blocks::Activation {
                $crate::decoder::stem(self, batch)
            }

            fn block_params(&self, i: usize) -> Vec<burn::module::ParamId> {
                $crate::modules::param_ids(&$crate::decoder::Decoder::layers(self)[i])
            }

            fn block(&self, i: usize, x: $crate::blocks::Activation) -> $crate::blocks::Activation {
                $crate::decoder::block(self, i, x, None)
            }

            fn block_in(
                &self,
                i: usize,
                x: $crate::blocks::Activation,
                batch: &$crate::lm::TokenBatch,
            ) -> $crate::blocks::Activation {
                $crate::decoder::block(self, i, x, Some(batch))
            }

            fn blocks_read_batch(&self) -> bool {
                true
            }

            fn head(
                &self,
                x: $crate::blocks::Activation,
                batch: &$crate::lm::TokenBatch,
            ) -> $crate::step::StepOutput {
                $crate::decoder::output(self, $crate::decoder::head(self, x.into_rank()), batch)
            }

            fn blocks_deterministic(&self) -> bool {
                true
            }
        }

        impl $crate::step::TrainStep<$crate::lm::TokenBatch> for $model {
            fn step(&self, batch: $crate::lm::TokenBatch) -> $crate::step::StepOutput {
                let starts = batch.documents.as_ref();
                let logits = $crate::decoder::forward_within(self, batch.inputs.clone(), starts);
                $crate::decoder::output(self, logits, &batch)
            }
        }
    };
}
pub(crate) use decoder_steps;

/// How the rotary decoders' weight files name their tensors (the Llama's layout, Phi-3's
/// too): the files may lack the `model.` prefix of the embedding, the layers and the final
/// norm; old rotary frequency buffers and, with a `tied` head, the head's copy are left out.
pub(crate) fn hf_naming(tied: bool) -> HfNaming {
    HfNaming {
        remap: KeyRemapper::new()
            .add_pattern(r"^(embed_tokens|layers|norm)\.", "model.$1.")
            .expect("a valid pattern"),
        ignored: Box::new(move |name: &str| {
            name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight")
        }),
    }
}
