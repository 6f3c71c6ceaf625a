//! The Llama family — Llama 2 and 3, SmolLM, Mistral, Qwen2 — with its modules named as Hugging
//! Face's `LlamaForCausalLM` names them (`model.layers.N.self_attn.q_proj`, …), so that a
//! checkpoint's tensors load by name: RMSNorm, rotary position embedding in the half-split
//! layout (`rotate_half`), grouped-query attention, a SwiGLU MLP, optional attention and MLP
//! biases (Qwen2's on q, k and v only), a tied or untied head, and decoding with a key/value
//! cache.

pub(crate) mod hf;

use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig, RmsNorm, RmsNormConfig,
};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::decoder::{self, Decoder};
pub use crate::gqa::Attention;
use crate::gqa::{LayerCache, Masking};
use crate::lm::KvCache;
use crate::rope::Rope;

/// How a checkpoint stretches its rotary frequencies beyond the context it was trained on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Every frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, those between
    /// blended.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
        /// divided.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are
        /// kept.
        high_freq_factor: f64,
        /// The context the checkpoint was first trained on.
        original_max_position_embeddings: usize,
    },
}

/// Which of the family's Hugging Face architectures a [`Llama`] is: what its `config.json`
/// says, and says again when kiln writes it back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlamaVariant {
    /// `LlamaForCausalLM`: optional biases on every attention projection and on the MLP.
    #[default]
    Llama,
    /// `MistralForCausalLM`: no biases, an optional sliding window.
    Mistral,
    /// `Qwen2ForCausalLM`: biases on the q, k and v projections alone.
    Qwen2,
}

impl LlamaVariant {
    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            LlamaVariant::Llama => "llama",
            LlamaVariant::Mistral => "mistral",
            LlamaVariant::Qwen2 => "qwen2",
        }
    }
}

/// Architecture of a [`Llama`]: the fields of a Hugging Face `config.json` of this family
/// (read by [`crate::hf`]), or a `[model.llama]` section for a model trained from scratch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LlamaConfig {
    /// Which architecture of the family: `llama`, `mistral` or `qwen2`. Default `llama`.
    pub model_type: LlamaVariant,
    /// Vocabulary size; 0 takes it from the data's tokenizer. Default 0.
    pub vocab_size: usize,
    /// Width of the residual stream. Default 256.
    pub hidden_size: usize,
    /// Width of the MLP's gate and up projections. Default 688.
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
    /// How the rotary frequencies are stretched, if at all. Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on the q, k, v and o projections (`llama`'s `attention_bias`; `qwen2` has
    /// them on q, k and v always). Default false.
    pub attention_bias: bool,
    /// Biases on the MLP's projections (`llama` only). Default false.
    pub mlp_bias: bool,
    /// The head shares the token embedding's weights. Default true.
    pub tie_word_embeddings: bool,
    /// `mistral`'s sliding window: a position attends to at most this many positions back.
    /// Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
}

impl Default for LlamaConfig {
    fn default() -> Self {
        Self {
            model_type: LlamaVariant::Llama,
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
            rope_scaling: None,
            attention_bias: false,
            mlp_bias: false,
            tie_word_embeddings: true,
            sliding_window: None,
        }
    }
}

impl LlamaConfig {
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
        if !self.head_width().is_multiple_of(2) {
            return Err(format!(
                "{key}: a head's width ({}) must be even for the rotary embedding",
                self.head_width()
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
        let variant = self.model_type.model_type();
        if self.model_type != LlamaVariant::Llama && (self.attention_bias || self.mlp_bias) {
            return Err(format!(
                "{key}.attention_bias and {key}.mlp_bias are llama's; {key}.model_type = \
                 {variant:?} has none of them"
            ));
        }
        if self.model_type != LlamaVariant::Mistral && self.sliding_window.is_some() {
            return Err(format!(
                "{key}.sliding_window is mistral's, not {variant:?}'s (set {key}.model_type = \
                 \"mistral\")"
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

    /// The rotary embedding's inverse frequencies, one per pair of a head's dimensions, as
    /// Hugging Face computes them (in f32), stretched as `rope_scaling` says.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_width();
        let base = self.rope_theta as f32;
        let plain: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        match &self.rope_scaling {
            None => plain,
            Some(RopeScaling::Linear { factor }) => {
                plain.iter().map(|f| f / *factor as f32).collect()
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = *original_max_position_embeddings as f32;
                let (factor, low, high) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                );
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                plain
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen > low_wavelen {
                            f / factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Builds the model on `device`: N(0, 0.02) weights, zero biases, unit norm gains.
    pub fn init(&self, device: &Device) -> Llama {
        let normal = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let linear = |i: usize, o: usize, bias: bool| {
            let mut l = LinearConfig::new(i, o)
                .with_bias(bias)
                .with_initializer(normal.clone())
                .init(device);
            if let Some(b) = l.bias.take() {
                l.bias = Some(b.map(|b| b.zeros_like()));
            }
            l
        };
        let norm = || {
            RmsNormConfig::new(self.hidden_size)
                .with_epsilon(self.rms_norm_eps)
                .init(device)
        };
        let (c, d) = (self.hidden_size, self.head_width());
        let (h, kv) = (self.num_attention_heads, self.kv_heads());
        let qkv = self.attention_bias || self.model_type == LlamaVariant::Qwen2;
        let layers = (0..self.num_hidden_layers)
            .map(|_| DecoderLayer {
                input_layernorm: norm(),
                self_attn: Attention {
                    q_proj: linear(c, h * d, qkv),
                    k_proj: linear(c, kv * d, qkv),
                    v_proj: linear(c, kv * d, qkv),
                    o_proj: linear(h * d, c, self.attention_bias),
                },
                post_attention_layernorm: norm(),
                mlp: SwiGlu {
                    gate_proj: linear(c, self.intermediate_size, self.mlp_bias),
                    up_proj: linear(c, self.intermediate_size, self.mlp_bias),
                    down_proj: linear(self.intermediate_size, c, self.mlp_bias),
                },
            })
            .collect();
        Llama {
            model: LlamaModel {
                embed_tokens: EmbeddingConfig::new(self.vocab_size, c)
                    .with_initializer(normal.clone())
                    .init(device),
                layers,
                norm: norm(),
            },
            lm_head: (!self.tie_word_embeddings).then(|| linear(c, self.vocab_size, false)),
            config: self.clone(),
        }
    }

    /// Parameters of the model this config builds.
    pub fn num_params(&self) -> usize {
        let (c, d, f) = (self.hidden_size, self.head_width(), self.intermediate_size);
        let (h, kv) = (self.num_attention_heads, self.kv_heads());
        let qkv = usize::from(self.attention_bias || self.model_type == LlamaVariant::Qwen2);
        let o = usize::from(self.attention_bias);
        let m = usize::from(self.mlp_bias);
        let attention = c * h * d + 2 * c * kv * d + h * d * c + qkv * (h * d + 2 * kv * d) + o * c;
        let mlp = 3 * c * f + m * (2 * f + c);
        let layer = attention + mlp + 2 * c;
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

/// The SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
#[derive(Module, Debug)]
pub struct SwiGlu {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl SwiGlu {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        // In a tensor-parallel group: gate and up by columns, down by rows.
        let gate = crate::tp::column_rows(&self.gate_proj, x.clone());
        let up = crate::tp::column_rows(&self.up_proj, x);
        crate::tp::row_rows(&self.down_proj, crate::fused::swiglu(gate, up))
    }
}

/// One pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: SwiGlu,
}

impl DecoderLayer {
    fn forward(
        &self,
        x: Tensor<3>,
        rope: &Rope,
        mask: &Masking,
        heads: (usize, usize),
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let a = self.self_attn.forward(
            crate::fused::rms_norm(&self.input_layernorm, x.clone()),
            rope,
            mask,
            heads,
            cache,
        );
        let x = x + a;
        let h = crate::fused::rms_norm(&self.post_attention_layernorm, x.clone());
        x + self.mlp.forward(h)
    }
}

/// The decoder: the token embedding, the layers and the final norm (`LlamaModel`).
#[derive(Module, Debug)]
pub struct LlamaModel {
    /// The token embedding (also the head when tied).
    pub embed_tokens: Embedding,
    /// The decoder layers, exposed so that recomputation and pipelines can split them.
    pub layers: Vec<DecoderLayer>,
    /// The final RMSNorm.
    pub norm: RmsNorm,
}

/// A Llama-family causal language model (`LlamaForCausalLM`).
#[derive(Module, Debug)]
pub struct Llama {
    /// The decoder.
    pub model: LlamaModel,
    /// The output head; `None` when tied to the token embedding.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    config: LlamaConfig,
}

impl Llama {
    /// The architecture.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The final norm and the head: `[b, t, c]` → logits `[b, t, vocab]`.
    pub fn head(&self, x: Tensor<3>) -> Tensor<3> {
        decoder::head(self, x)
    }

    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        decoder::forward_within(self, tokens, None)
    }

    /// [`Llama::forward`] of packed rows (see [`crate::lm::TokenBatch::documents`]).
    pub fn forward_within(
        &self,
        tokens: Tensor<2, Int>,
        starts: Option<&Tensor<2, Int>>,
    ) -> Tensor<3> {
        decoder::forward_within(self, tokens, starts)
    }

    /// Logits `[batch, time, vocab]` of `tokens` following the positions `cache` holds, which
    /// takes their keys and values.
    pub fn forward_cached(&self, tokens: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        decoder::forward_cached(self, tokens, cache)
    }

    /// Continues `prompt` by up to `tokens` ids, each picked as `how` says, with a key/value
    /// cache: the prompt once, then one position per new token; ends early at a stop id.
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

impl Decoder for Llama {
    type Layer = DecoderLayer;

    fn embed_tokens(&self) -> &Embedding {
        &self.model.embed_tokens
    }

    fn layers(&self) -> &[DecoderLayer] {
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

    fn vocab(&self) -> usize {
        self.config.vocab_size
    }

    fn max_positions(&self) -> usize {
        self.config.max_position_embeddings
    }

    fn layer(
        &self,
        layer: &DecoderLayer,
        x: Tensor<3>,
        rope: &Rope,
        mask: &Masking,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        layer.forward(x, rope, mask, self.heads(), cache)
    }
}

decoder::decoder_steps!(Llama);

/// Megatron's split of a Llama layer: the query heads by columns (q), the key/value heads by
/// columns where the group divides them and whole where it does not (each rank then reads the
/// head its query heads share, and the heads' gradients are summed over the group), the output
/// projection by rows; the MLP's gate and up by columns, its down projection by rows. The
/// embedding, the norms and the head are whole on every rank.
impl crate::tp::TensorParallel for Llama {
    fn tp_ready(&self) -> bool {
        true
    }

    fn tp_check(&self, size: usize) -> Result<(), String> {
        let c = &self.config;
        let (h, kv) = (c.num_attention_heads, c.kv_heads());
        if size == 1 {
            return Ok(());
        }
        crate::tp::must_divide("model.llama.num_attention_heads", h, size)?;
        if !kv.is_multiple_of(size) && !size.is_multiple_of(kv) {
            return Err(format!(
                "model.llama.num_key_value_heads ({kv}) and the tensor-parallel size ({size}) \
                 must divide one another (the key/value heads split, or each rank reads one)"
            ));
        }
        crate::tp::must_divide("model.llama.intermediate_size", c.intermediate_size, size)
    }

    fn tp_split(&self, path: &str, size: usize) -> crate::tp::Split {
        use crate::tp::Split;
        let kv_cut = self.config.kv_heads().is_multiple_of(size);
        let within = |suffix: &str| path.starts_with("model.layers.") && path.ends_with(suffix);
        let kv = |cut: Split| if kv_cut { cut } else { Split::Summed };
        if let Some(vocab) = decoder::vocab_split(path, self.config.vocab_size, size) {
            vocab
        } else if within(".q_proj.weight")
            || within(".gate_proj.weight")
            || within(".up_proj.weight")
        {
            Split::columns(1)
        } else if within(".q_proj.bias") || within(".gate_proj.bias") || within(".up_proj.bias") {
            Split::first(1)
        } else if within(".k_proj.weight") || within(".v_proj.weight") {
            kv(Split::columns(1))
        } else if within(".k_proj.bias") || within(".v_proj.bias") {
            kv(Split::first(1))
        } else if within(".o_proj.weight") || within(".down_proj.weight") {
            Split::ROWS
        } else {
            Split::Whole
        }
    }
}

impl crate::lm::CausalLm for Llama {
    type Config = LlamaConfig;

    fn init(config: &Self::Config, device: &Device) -> Self {
        config.init(device)
    }

    fn context(config: &Self::Config) -> usize {
        config.max_position_embeddings
    }

    fn flops_per_token(config: &Self::Config, context: usize) -> f64 {
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
