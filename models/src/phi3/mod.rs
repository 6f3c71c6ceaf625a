//! Phi-3 (`Phi3ForCausalLM`: Phi-3, Phi-3.5 and Phi-4-mini) with its modules named as
//! Hugging Face's are (`model.layers.N.self_attn.qkv_proj`, …), so that a checkpoint's tensors
//! load by name: the Llama's shape — RMSNorm, grouped-query attention with rotary positions, a
//! SwiGLU MLP — with the query, key and value projections in one Linear, the MLP's gate and up
//! projections in one, rotary positions on a part of each head (`partial_rotary_factor`), an
//! optional sliding window, no biases.

mod hf;

use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig, RmsNorm, RmsNormConfig,
};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::decoder::{self, Decoder};
use crate::gqa::{LayerCache, Masking};
use crate::lm::KvCache;
use crate::rope::Rope;

/// Architecture of a [`Phi3`]: the fields of a Hugging Face `config.json` of `model_type`
/// `phi3` (read by [`crate::hf`]), or a `[model.phi3]` section for a model trained from
/// scratch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Phi3Config {
    /// Vocabulary size; 0 takes it from the data's tokenizer. Default 0.
    pub vocab_size: usize,
    /// Width of the residual stream. Default 256.
    pub hidden_size: usize,
    /// Width of the MLP's gate and of its up projection (`gate_up_proj` holds both).
    /// Default 688.
    pub intermediate_size: usize,
    /// Decoder layers. Default 4.
    pub num_hidden_layers: usize,
    /// Query heads. Default 4.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); 0 means as many as query heads. Default 0.
    pub num_key_value_heads: usize,
    /// Width of a head; 0 means `hidden_size / num_attention_heads`. Default 0.
    pub head_dim: usize,
    /// Longest context, in tokens. Default 256.
    pub max_position_embeddings: usize,
    /// RMSNorm's epsilon. Default 1e-5.
    pub rms_norm_eps: f64,
    /// The rotary embedding's base. Default 10000.
    pub rope_theta: f64,
    /// The share of each head's width that rotates (Phi-4-mini's 0.75); the rest passes.
    /// Default 1.
    pub partial_rotary_factor: f64,
    /// The head shares the token embedding's weights. Default false.
    pub tie_word_embeddings: bool,
    /// A position attends to at most this many positions back. Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
}

impl Default for Phi3Config {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            hidden_size: 256,
            intermediate_size: 688,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 0,
            head_dim: 0,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            partial_rotary_factor: 1.0,
            tie_word_embeddings: false,
            sliding_window: None,
        }
    }
}

impl Phi3Config {
    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        if self.num_key_value_heads == 0 {
            self.num_attention_heads
        } else {
            self.num_key_value_heads
        }
    }

    /// Width of one head.
    pub fn head_width(&self) -> usize {
        if self.head_dim == 0 {
            self.hidden_size / self.num_attention_heads.max(1)
        } else {
            self.head_dim
        }
    }

    /// The dimensions of a head that rotate (`transformers`' `int(head_dim · factor)`).
    pub fn rotary_width(&self) -> usize {
        (self.head_width() as f64 * self.partial_rotary_factor) as usize
    }

    /// Checks the configuration, with the vocabulary size resolved; `key` names the section.
    pub fn validate(&self, key: &str) -> Result<(), String> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(format!("{key}.{name} must be at least 1, got 0"));
            }
        }
        if self.head_dim == 0 && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "{key}.hidden_size ({}) must be a multiple of {key}.num_attention_heads ({}) \
                 unless {key}.head_dim is set",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(format!(
                "{key}.num_attention_heads ({}) must be a multiple of \
                 {key}.num_key_value_heads ({})",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        let r = self.rotary_width();
        if !(self.partial_rotary_factor > 0.0 && self.partial_rotary_factor <= 1.0)
            || r < 2
            || !r.is_multiple_of(2)
        {
            return Err(format!(
                "{key}.partial_rotary_factor: {} rotates {r} of a head's {} dimensions; it must \
                 be in (0, 1] and rotate an even number, at least 2",
                self.partial_rotary_factor,
                self.head_width()
            ));
        }
        if !(self.rope_theta > 0.0 && self.rms_norm_eps > 0.0) {
            return Err(format!(
                "{key}.rope_theta and {key}.rms_norm_eps must be positive, got {} and {}",
                self.rope_theta, self.rms_norm_eps
            ));
        }
        Ok(())
    }

    /// The rotary embedding's inverse frequencies, one per pair of a head's rotating
    /// dimensions, as Hugging Face computes them (in f32).
    pub fn inv_freq(&self) -> Vec<f32> {
        let r = self.rotary_width();
        let base = self.rope_theta as f32;
        (0..r / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / r as f32))
            .collect()
    }

    /// Builds the model on `device`: N(0, 0.02) weights, unit norm gains.
    pub fn init(&self, device: &Device) -> Phi3 {
        let linear = |i: usize, o: usize| {
            LinearConfig::new(i, o)
                .with_bias(false)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device)
        };
        let norm = || {
            RmsNormConfig::new(self.hidden_size)
                .with_epsilon(self.rms_norm_eps)
                .init(device)
        };
        let (c, d, f) = (self.hidden_size, self.head_width(), self.intermediate_size);
        let (h, kv) = (self.num_attention_heads, self.kv_heads());
        let layers = (0..self.num_hidden_layers)
            .map(|_| Phi3DecoderLayer {
                input_layernorm: norm(),
                self_attn: Phi3Attention {
                    qkv_proj: linear(c, (h + 2 * kv) * d),
                    o_proj: linear(h * d, c),
                },
                post_attention_layernorm: norm(),
                mlp: Phi3Mlp {
                    gate_up_proj: linear(c, 2 * f),
                    down_proj: linear(f, c),
                },
            })
            .collect();
        Phi3 {
            model: Phi3Model {
                embed_tokens: EmbeddingConfig::new(self.vocab_size, c)
                    .with_initializer(Initializer::Normal {
                        mean: 0.0,
                        std: 0.02,
                    })
                    .init(device),
                layers,
                norm: norm(),
            },
            lm_head: (!self.tie_word_embeddings).then(|| linear(c, self.vocab_size)),
            config: self.clone(),
        }
    }

    /// Parameters of the model this config builds.
    pub fn num_params(&self) -> usize {
        let (c, d, f) = (self.hidden_size, self.head_width(), self.intermediate_size);
        let (h, kv) = (self.num_attention_heads, self.kv_heads());
        let layer = c * (h + 2 * kv) * d + h * d * c + 3 * c * f + 2 * c;
        let head = if self.tie_word_embeddings {
            0
        } else {
            c * self.vocab_size
        };
        self.vocab_size * c + self.num_hidden_layers * layer + c + head
    }

    /// Training FLOPs per token: 6·N (N without the embedding) + 12·L·H·D·T at a context of
    /// `context` tokens.
    pub fn flops_per_token(&self, context: usize) -> f64 {
        let n = (self.num_params() - self.vocab_size * self.hidden_size) as f64;
        let (l, h, d) = (
            self.num_hidden_layers as f64,
            self.num_attention_heads as f64,
            self.head_width() as f64,
        );
        6.0 * n + 12.0 * l * h * d * context as f64
    }
}

/// Attention with the query, key and value projections in one Linear (`qkv_proj`: the
/// queries' `h·d` columns, then the keys' `kv·d`, then the values').
#[derive(Module, Debug)]
pub struct Phi3Attention {
    qkv_proj: Linear,
    o_proj: Linear,
}

impl Phi3Attention {
    fn forward(
        &self,
        x: Tensor<3>,
        rope: &Rope,
        mask: &Masking,
        (h, kv): (usize, usize),
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let [b, t, _] = x.dims();
        // In a tensor-parallel group a rank holds its share of the query and of the key/value
        // heads (`Split::Heads` of `qkv_proj`).
        let size = crate::tp::place().1;
        let (h, kv) = (h / size, kv / size);
        let qkv = crate::tp::column_rows(&self.qkv_proj, x);
        let d = qkv.dims()[2] / (h + 2 * kv);
        let cut = |from: usize, to: usize| qkv.clone().slice([0..b, 0..t, from * d..to * d]);
        let parts = [cut(0, h), cut(h, h + kv), cut(h + kv, h + 2 * kv)];
        let y = crate::gqa::attend(parts, rope, mask, (h, kv), cache);
        crate::tp::row_rows(&self.o_proj, y)
    }
}

/// The SwiGLU MLP with its gate and up projections in one Linear (`gate_up_proj`: the gate's
/// columns, then the up projection's): `down(silu(gate) · up)`.
#[derive(Module, Debug)]
pub struct Phi3Mlp {
    gate_up_proj: Linear,
    down_proj: Linear,
}

impl Phi3Mlp {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, _] = x.dims();
        // In a tensor-parallel group: the gate's and the up projection's columns, then down
        // by rows.
        let both = crate::tp::column_rows(&self.gate_up_proj, x);
        let f = both.dims()[2] / 2;
        let gate = both.clone().slice([0..b, 0..t, 0..f]);
        let up = both.slice([0..b, 0..t, f..2 * f]);
        crate::tp::row_rows(&self.down_proj, crate::fused::swiglu(gate, up))
    }
}

/// One pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct Phi3DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Phi3Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Phi3Mlp,
}

/// The decoder: the token embedding, the layers and the final norm (`Phi3Model`).
#[derive(Module, Debug)]
pub struct Phi3Model {
    /// The token embedding (also the head when tied).
    pub embed_tokens: Embedding,
    /// The decoder layers, exposed so that recomputation and pipelines can split them.
    pub layers: Vec<Phi3DecoderLayer>,
    /// The final RMSNorm.
    pub norm: RmsNorm,
}

/// A Phi-3 causal language model (`Phi3ForCausalLM`).
#[derive(Module, Debug)]
pub struct Phi3 {
    /// The decoder.
    pub model: Phi3Model,
    /// The output head; `None` when tied to the token embedding.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    config: Phi3Config,
}

impl Phi3 {
    /// The architecture.
    pub fn config(&self) -> &Phi3Config {
        &self.config
    }

    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        decoder::forward_within(self, tokens, None)
    }

    /// Logits `[batch, time, vocab]` of `tokens` following the positions `cache` holds, which
    /// takes their keys and values.
    pub fn forward_cached(&self, tokens: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        decoder::forward_cached(self, tokens, cache)
    }

    /// Continues `prompt` by up to `tokens` ids, each picked as `how` says, with a key/value
    /// cache; ends early at a stop id.
    pub fn generate(
        &self,
        prompt: &[u32],
        tokens: usize,
        how: &crate::lm::Sampling,
        uniform: impl FnMut() -> f64,
    ) -> Vec<u32> {
        decoder::generate(self, prompt, tokens, how, uniform)
    }
}

impl Decoder for Phi3 {
    type Layer = Phi3DecoderLayer;

    fn embed_tokens(&self) -> &Embedding {
        &self.model.embed_tokens
    }

    fn layers(&self) -> &[Phi3DecoderLayer] {
        &self.model.layers
    }

    fn norm(&self) -> &RmsNorm {
        &self.model.norm
    }

    fn lm_head(&self) -> Option<&Linear> {
        self.lm_head.as_ref()
    }

    fn inv_freq(&self) -> Vec<f32> {
        self.config.inv_freq()
    }

    fn window(&self) -> Option<usize> {
        self.config.sliding_window
    }

    fn heads(&self) -> (usize, usize) {
        (self.config.num_attention_heads, self.config.kv_heads())
    }

    fn tensor_parallel(&self) -> Option<&dyn crate::tp::TensorParallel> {
        Some(self)
    }

    fn max_positions(&self) -> usize {
        self.config.max_position_embeddings
    }

    fn vocab(&self) -> usize {
        self.config.vocab_size
    }

    fn layer(
        &self,
        layer: &Phi3DecoderLayer,
        x: Tensor<3>,
        rope: &Rope,
        mask: &Masking,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let normed = crate::fused::rms_norm(&layer.input_layernorm, x.clone());
        let x = x + layer
            .self_attn
            .forward(normed, rope, mask, self.heads(), cache);
        let normed = crate::fused::rms_norm(&layer.post_attention_layernorm, x.clone());
        x + layer.mlp.forward(normed)
    }
}

decoder::decoder_steps!(Phi3);

/// Megatron's split of a Phi-3 layer: the fused `qkv_proj` by heads (a rank's share of the
/// query heads and of the key/value heads: `Split::Heads`), the output projection by rows; the
/// fused `gate_up_proj` by columns in its two blocks, the down projection by rows; the
/// vocabulary where the group divides it. The key/value heads must divide over the group (a
/// fused projection keeps no whole copy of them).
impl crate::tp::TensorParallel for Phi3 {
    fn tp_ready(&self) -> bool {
        true
    }

    fn tp_check(&self, size: usize) -> Result<(), String> {
        let c = &self.config;
        let (h, kv) = (c.num_attention_heads, c.kv_heads());
        if size == 1 {
            return Ok(());
        }
        crate::tp::must_divide("model.phi3.num_attention_heads", h, size)?;
        crate::tp::must_divide("model.phi3.num_key_value_heads", kv, size)?;
        crate::tp::must_divide("model.phi3.intermediate_size", c.intermediate_size, size)
    }

    fn tp_split(&self, path: &str, size: usize) -> crate::tp::Split {
        use crate::tp::Split;
        let c = &self.config;
        let (q, kv) = (c.num_attention_heads, c.kv_heads());
        let within = |suffix: &str| path.starts_with("model.layers.") && path.ends_with(suffix);
        if let Some(vocab) = decoder::vocab_split(path, c.vocab_size, size) {
            vocab
        } else if within(".qkv_proj.weight") {
            Split::Heads { dim: 1, q, kv }
        } else if within(".qkv_proj.bias") {
            Split::Heads { dim: 0, q, kv }
        } else if within(".gate_up_proj.weight") {
            Split::columns(2)
        } else if within(".gate_up_proj.bias") {
            Split::first(2)
        } else if within(".o_proj.weight") || within(".down_proj.weight") {
            Split::ROWS
        } else {
            Split::Whole
        }
    }
}

impl crate::lm::CausalLm for Phi3 {
    type Config = Phi3Config;

    fn init(config: &Phi3Config, device: &Device) -> Self {
        config.init(device)
    }

    fn context(config: &Phi3Config) -> usize {
        config.max_position_embeddings
    }

    fn flops_per_token(config: &Phi3Config, context: usize) -> f64 {
        config.flops_per_token(context)
    }

    fn logits(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.forward(tokens)
    }

    fn continue_ids(
        &self,
        prompt: &[u32],
        tokens: usize,
        how: &crate::lm::Sampling,
        uniform: &mut dyn FnMut() -> f64,
    ) -> Vec<u32> {
        self.generate(prompt, tokens, how, uniform)
    }
}
