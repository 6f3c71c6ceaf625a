//! GPT-2 with its modules named as Hugging Face's `GPT2LMHeadModel` names them
//! (`transformer.h.N.attn.c_attn`, …): learned positions, LayerNorm with biases, the fused
//! `c_attn` projection, the tanh GELU (`gelu_new`), and the head tied to the token embedding.
//! Its projections are [`Conv1D`]s, which store their weight `[in, out]` as GPT-2's checkpoints
//! do (Burn's layout already: nothing is transposed when they load).

pub(crate) mod hf;

use burn::module::Param;
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::blocks::{Activation, BlockStack};
use crate::lm::TokenBatch;
use crate::lm::{KvCache, causal_mask};
use crate::step::{StepOutput, TrainStep};

/// GPT-2's MLP activation (`activation_function`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Gpt2Activation {
    /// The tanh approximation of GELU (`gelu_new`, `gelu_pytorch_tanh`).
    #[serde(rename = "gelu_new", alias = "gelu_pytorch_tanh")]
    GeluTanh,
    /// The exact GELU (`gelu`).
    #[serde(rename = "gelu")]
    Gelu,
    /// `relu`.
    #[serde(rename = "relu")]
    Relu,
}

/// Architecture of a [`Gpt2`]: the fields of a Hugging Face `config.json` of GPT-2 (read by
/// [`crate::hf`]), or a `[model.gpt2]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Gpt2Config {
    /// Vocabulary size; 0 takes it from the data's tokenizer. Default 0.
    pub vocab_size: usize,
    /// Longest context (learned positions). Default 256.
    pub n_positions: usize,
    /// Width of the residual stream. Default 256.
    pub n_embd: usize,
    /// Blocks. Default 4.
    pub n_layer: usize,
    /// Attention heads. Default 4.
    pub n_head: usize,
    /// Width of the MLP; 0 means 4 · `n_embd`. Default 0.
    pub n_inner: usize,
    /// LayerNorm's epsilon. Default 1e-5.
    pub layer_norm_epsilon: f64,
    /// The MLP's activation. Default `gelu_new`.
    pub activation_function: Gpt2Activation,
    /// The head shares the token embedding's weights. Default true.
    pub tie_word_embeddings: bool,
}

impl Default for Gpt2Config {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            n_positions: 256,
            n_embd: 256,
            n_layer: 4,
            n_head: 4,
            n_inner: 0,
            layer_norm_epsilon: 1e-5,
            activation_function: Gpt2Activation::GeluTanh,
            tie_word_embeddings: true,
        }
    }
}

impl Gpt2Config {
    /// Width of the MLP.
    pub fn inner(&self) -> usize {
        if self.n_inner == 0 {
            4 * self.n_embd
        } else {
            self.n_inner
        }
    }

    /// Checks the configuration, with the vocabulary size resolved; `key` names the section.
    pub fn validate(&self, key: &str) -> Result<(), String> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_embd", self.n_embd),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
        ] {
            if v == 0 {
                return Err(format!("{key}.{name} must be at least 1, got 0"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!(
                "{key}.n_embd ({}) must be a multiple of {key}.n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        Ok(())
    }

    /// Builds the model on `device` with GPT-2's initialisation: N(0, 0.02) weights, residual
    /// projections scaled by 1/√(2·n_layer), zero biases, unit LayerNorm gains.
    pub fn init(&self, device: &Device) -> Gpt2 {
        let c = self.n_embd;
        let conv = |i: usize, o: usize, std: f64| Conv1D {
            weight: Initializer::Normal { mean: 0.0, std }.init([i, o], device),
            bias: Initializer::Zeros.init([o], device),
        };
        let residual = 0.02 / (2.0 * self.n_layer as f64).sqrt();
        let ln = || {
            LayerNormConfig::new(c)
                .with_epsilon(self.layer_norm_epsilon)
                .init(device)
        };
        let h = (0..self.n_layer)
            .map(|_| Gpt2Block {
                ln_1: ln(),
                attn: Gpt2Attention {
                    c_attn: conv(c, 3 * c, 0.02),
                    c_proj: conv(c, c, residual),
                },
                ln_2: ln(),
                mlp: Gpt2Mlp {
                    c_fc: conv(c, self.inner(), 0.02),
                    c_proj: conv(self.inner(), c, residual),
                },
            })
            .collect();
        let normal = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        Gpt2 {
            transformer: Gpt2Model {
                wte: EmbeddingConfig::new(self.vocab_size, c)
                    .with_initializer(normal.clone())
                    .init(device),
                wpe: EmbeddingConfig::new(self.n_positions, c)
                    .with_initializer(normal.clone())
                    .init(device),
                h,
                ln_f: ln(),
            },
            lm_head: (!self.tie_word_embeddings).then(|| {
                LinearConfig::new(c, self.vocab_size)
                    .with_bias(false)
                    .with_initializer(normal)
                    .init(device)
            }),
            config: self.clone(),
        }
    }

    /// Parameters of the model this config builds.
    pub fn num_params(&self) -> usize {
        let (c, f) = (self.n_embd, self.inner());
        let block = 4 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * f + f) + (f * c + c);
        let head = if self.tie_word_embeddings {
            0
        } else {
            c * self.vocab_size
        };
        (self.vocab_size + self.n_positions) * c + self.n_layer * block + 2 * c + head
    }

    /// Training FLOPs per token: 6·N (N without the embeddings) + 12·L·H·Q·T at a context of
    /// `context` tokens.
    pub fn flops_per_token(&self, context: usize) -> f64 {
        let n = (self.num_params() - (self.vocab_size + self.n_positions) * self.n_embd) as f64;
        let (l, h, q) = (
            self.n_layer as f64,
            self.n_head as f64,
            (self.n_embd / self.n_head) as f64,
        );
        6.0 * n + 12.0 * l * h * q * context as f64
    }
}

/// GPT-2's projection: `x · weight + bias` with `weight` stored `[in, out]`.
#[derive(Module, Debug)]
pub struct Conv1D {
    /// `[in, out]`.
    pub weight: Param<Tensor<2>>,
    /// `[out]`.
    pub bias: Param<Tensor<1>>,
}

impl Conv1D {
    /// A column-parallel projection in a tensor-parallel group (the weight's and bias's
    /// columns a rank's part, the input's gradient summed over the group); on one device,
    /// [`Conv1D::forward`].
    fn column(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward(crate::tp::copy_to_group(x))
    }

    /// A row-parallel projection in a tensor-parallel group (the weight's rows a rank's part,
    /// the products summed over the group, the whole bias added once); on one device,
    /// [`Conv1D::forward`].
    fn row(&self, x: Tensor<3>) -> Tensor<3> {
        if crate::tp::current().is_none() {
            return self.forward(x);
        }
        let y = crate::modules::on_rows(x, |rows| {
            crate::fused::linear(rows, self.weight.val(), None)
        });
        crate::tp::reduce_from_group(y) + self.bias.val().unsqueeze()
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        // One matrix product over the B·T rows (see `crate::modules::linear_rows`).
        crate::modules::on_rows(x, |rows| {
            crate::fused::linear(rows, self.weight.val(), Some(self.bias.val()))
        })
    }
}

/// Causal self-attention with the fused q/k/v projection.
#[derive(Module, Debug)]
pub struct Gpt2Attention {
    c_attn: Conv1D,
    c_proj: Conv1D,
}

impl Gpt2Attention {
    /// `x` attended causally (within documents with `starts`, see
    /// [`TokenBatch::documents`]); with a `cache`, after its positions, which `mask` covers.
    fn forward(
        &self,
        x: Tensor<3>,
        heads: usize,
        (mask, starts): (Option<Tensor<2, Bool>>, Option<&Tensor<2, Int>>),
        cache: Option<&mut (Option<Tensor<4>>, Option<Tensor<4>>)>,
    ) -> Tensor<3> {
        // In a tensor-parallel group a rank holds `heads / size` heads: its columns of q, of
        // k and of v.
        let heads = heads / crate::tp::place().1;
        let [b, t, _] = x.dims();
        let qkv = self.c_attn.column(x);
        let c = qkv.dims()[2] / 3;
        let d = c / heads;
        let split = |i: usize| {
            qkv.clone()
                .slice([0..b, 0..t, i * c..(i + 1) * c])
                .reshape([b, t, heads, d])
                .swap_dims(1, 2)
        };
        let (q, mut k, mut v) = (split(0), split(1), split(2));
        let Some((ck, cv)) = cache else {
            // No cache: the mask is the plain causal one, which the fused kernel applies.
            let y = crate::fused::attention_within(q, k, v, starts, None);
            return self.c_proj.row(y.swap_dims(1, 2).reshape([b, t, c]));
        };
        {
            if let Some(old) = ck.take() {
                k = Tensor::cat(vec![old, k], 2);
            }
            if let Some(old) = cv.take() {
                v = Tensor::cat(vec![old, v], 2);
            }
            *ck = Some(k.clone());
            *cv = Some(v.clone());
        }
        let s = k.dims()[2];
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f64).sqrt());
        let scores = match mask {
            Some(m) => scores.mask_fill(
                m.reshape([1, 1, t, s]).expand([b, heads, t, s]),
                f32::NEG_INFINITY,
            ),
            None => scores,
        };
        let weights = burn::tensor::activation::softmax(scores, 3);
        let y = weights.matmul(v).swap_dims(1, 2).reshape([b, t, c]);
        self.c_proj.row(y)
    }
}

/// The MLP: `c_proj(act(c_fc(x)))`.
#[derive(Module, Debug)]
pub struct Gpt2Mlp {
    c_fc: Conv1D,
    c_proj: Conv1D,
}

/// One pre-LayerNorm block.
#[derive(Module, Debug)]
pub struct Gpt2Block {
    ln_1: LayerNorm,
    attn: Gpt2Attention,
    ln_2: LayerNorm,
    mlp: Gpt2Mlp,
}

impl Gpt2Block {
    fn forward(
        &self,
        x: Tensor<3>,
        config: &Gpt2Config,
        attend: (Option<Tensor<2, Bool>>, Option<&Tensor<2, Int>>),
        cache: Option<&mut (Option<Tensor<4>>, Option<Tensor<4>>)>,
    ) -> Tensor<3> {
        let eps = config.layer_norm_epsilon;
        let ln = |norm: &LayerNorm, x: Tensor<3>| crate::fused::layer_norm(norm, eps, x);
        let a = self
            .attn
            .forward(ln(&self.ln_1, x.clone()), config.n_head, attend, cache);
        let x = x + a;
        let h = self.mlp.c_fc.column(ln(&self.ln_2, x.clone()));
        let h = match config.activation_function {
            Gpt2Activation::GeluTanh => burn::tensor::activation::gelu_approximate(h),
            Gpt2Activation::Gelu => crate::fused::gelu(h),
            Gpt2Activation::Relu => burn::tensor::activation::relu(h),
        };
        x + self.mlp.c_proj.row(h)
    }
}

/// The transformer: embeddings, blocks and the final LayerNorm (`GPT2Model`).
#[derive(Module, Debug)]
pub struct Gpt2Model {
    /// Token embedding (also the head when tied).
    pub wte: Embedding,
    /// Learned position embedding.
    pub wpe: Embedding,
    /// The blocks, exposed so that recomputation and pipelines can split them.
    pub h: Vec<Gpt2Block>,
    /// The final LayerNorm.
    pub ln_f: LayerNorm,
}

/// GPT-2 with its language-modelling head (`GPT2LMHeadModel`).
#[derive(Module, Debug)]
pub struct Gpt2 {
    /// The transformer.
    pub transformer: Gpt2Model,
    /// The head; `None` when tied to the token embedding.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    config: Gpt2Config,
}

impl Gpt2 {
    /// The architecture.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    /// The first id of the vocabulary part this rank holds, in a tensor-parallel group that
    /// cuts it; `None` otherwise.
    fn vocab_start(&self) -> Option<usize> {
        let held = self.transformer.wte.weight.dims()[0];
        crate::tp::vocab::vocab_start(held, self.config.vocab_size)
    }

    /// The token embedding of `tokens` (the group's sum of its parts where it is cut).
    fn tokens(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        crate::tp::vocab::embedding(&self.transformer.wte, tokens, self.vocab_start())
    }

    /// The step's output from the logits (this rank's columns where the vocabulary is cut:
    /// the parallel cross-entropy).
    fn output(&self, logits: Tensor<3>, batch: &TokenBatch) -> StepOutput {
        crate::lm::lm_output_cut(logits, batch, self.vocab_start())
    }

    /// Token and position embeddings of `tokens` at positions `start..`.
    fn embed(&self, tokens: Tensor<2, Int>, start: usize) -> Tensor<3> {
        let t = tokens.dims()[1];
        self.tokens(tokens) + crate::modules::position_rows(&self.transformer.wpe, start, t)
    }

    /// The embeddings of a batch: positions from 0, or restarting at each example of packed
    /// rows (`starts`, see [`TokenBatch::documents`]).
    fn embed_within(&self, tokens: Tensor<2, Int>, starts: Option<&Tensor<2, Int>>) -> Tensor<3> {
        match starts {
            None => self.embed(tokens, 0),
            Some(s) => {
                let positions = crate::lm::positions_within(s);
                self.tokens(tokens) + crate::cube::embedding(&self.transformer.wpe, positions)
            }
        }
    }

    /// The final LayerNorm and the head: `[b, t, c]` → logits `[b, t, vocab]`.
    pub fn head(&self, x: Tensor<3>) -> Tensor<3> {
        let eps = self.config.layer_norm_epsilon;
        let x = crate::fused::layer_norm(&self.transformer.ln_f, eps, x);
        let x = crate::tp::vocab::to_head(x, self.vocab_start());
        match &self.lm_head {
            Some(head) => crate::modules::linear_rows(head, x),
            None => {
                let [b, t, c] = x.dims();
                let weight = self.transformer.wte.weight.val();
                let vocab = weight.dims()[0];
                crate::cube::product(x.reshape([b * t, c]), weight.transpose())
                    .reshape([b, t, vocab])
            }
        }
    }

    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.forward_within(tokens, None)
    }

    /// [`Gpt2::forward`] of packed rows (see [`TokenBatch::documents`]).
    pub fn forward_within(
        &self,
        tokens: Tensor<2, Int>,
        starts: Option<&Tensor<2, Int>>,
    ) -> Tensor<3> {
        let mut x = self.embed_within(tokens, starts);
        for block in &self.transformer.h {
            x = block.forward(x, &self.config, (None, starts), None);
        }
        self.head(x)
    }

    /// Logits of `tokens` following the positions `cache` holds, which takes their keys and
    /// values.
    pub fn forward_cached(&self, tokens: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        let t = tokens.dims()[1];
        let start = cache.len;
        let device = tokens.device();
        let mask = (t > 1).then(|| causal_mask(start, t, None, &device));
        cache.layers.resize(self.transformer.h.len(), (None, None));
        let mut x = self.embed(tokens, start);
        for (block, kv) in self.transformer.h.iter().zip(cache.layers.iter_mut()) {
            x = block.forward(x, &self.config, (mask.clone(), None), Some(kv));
        }
        cache.len += t;
        self.head(x)
    }

    /// Continues `prompt` by `tokens` ids with a key/value cache (see
    /// [`crate::llama::Llama::generate`]).
    pub fn generate(
        &self,
        prompt: &[u32],
        tokens: usize,
        how: &crate::lm::Sampling,
        uniform: impl FnMut() -> f64,
    ) -> Vec<u32> {
        let device = self.transformer.wte.weight.val().device();
        crate::lm::generate(
            prompt,
            tokens,
            (how, self.config.n_positions),
            &device,
            |ids, cache| self.forward_cached(ids, cache),
            uniform,
        )
    }
}

/// Megatron's split of a GPT-2 block: the fused `c_attn` by heads (each rank its columns of
/// q, of k and of v), the attention's `c_proj` by rows, the MLP's `c_fc` by columns and its
/// `c_proj` by rows; the embeddings, the LayerNorms and the row-parallel biases whole.
impl crate::tp::TensorParallel for Gpt2 {
    fn tp_ready(&self) -> bool {
        true
    }

    fn tp_check(&self, size: usize) -> Result<(), String> {
        let c = &self.config;
        crate::tp::must_divide("model.gpt2.n_head", c.n_head, size)?;
        crate::tp::must_divide("model.gpt2's MLP width", c.inner(), size)?;
        Ok(())
    }

    fn tp_split(&self, path: &str, size: usize) -> crate::tp::Split {
        use crate::tp::Split;
        let within = |suffix: &str| path.starts_with("transformer.h.") && path.ends_with(suffix);
        let vocab = self.config.vocab_size.is_multiple_of(size);
        if path == "transformer.wte.weight" && vocab {
            // The vocabulary: the embedding's rows (and the tied head's).
            Split::first(1)
        } else if path == "lm_head.weight" && vocab {
            Split::columns(1)
        } else if within(".attn.c_attn.weight") {
            Split::columns(3)
        } else if within(".attn.c_attn.bias") {
            Split::first(3)
        } else if within(".mlp.c_fc.weight") {
            Split::columns(1)
        } else if within(".mlp.c_fc.bias") {
            Split::first(1)
        } else if within(".attn.c_proj.weight") || within(".mlp.c_proj.weight") {
            Split::ROWS
        } else {
            Split::Whole
        }
    }
}

impl BlockStack<TokenBatch> for Gpt2 {
    fn tensor_parallel(&self) -> Option<&dyn crate::tp::TensorParallel> {
        Some(self)
    }

    fn num_blocks(&self) -> usize {
        self.transformer.h.len()
    }

    fn stem(&self, batch: &TokenBatch) -> Activation {
        Activation::Rank3(self.embed_within(batch.inputs.clone(), batch.documents.as_ref()))
    }

    fn block_params(&self, i: usize) -> Vec<burn::module::ParamId> {
        crate::modules::param_ids(&self.transformer.h[i])
    }

    fn block(&self, i: usize, x: Activation) -> Activation {
        let x = x.into_rank();
        Activation::Rank3(self.transformer.h[i].forward(x, &self.config, (None, None), None))
    }

    fn block_in(&self, i: usize, x: Activation, batch: &TokenBatch) -> Activation {
        let attend = (None, batch.documents.as_ref());
        Activation::Rank3(self.transformer.h[i].forward(x.into_rank(), &self.config, attend, None))
    }

    fn blocks_read_batch(&self) -> bool {
        true
    }

    fn head(&self, x: Activation, batch: &TokenBatch) -> StepOutput {
        self.output(Gpt2::head(self, x.into_rank()), batch)
    }

    fn blocks_deterministic(&self) -> bool {
        true
    }
}

impl TrainStep<TokenBatch> for Gpt2 {
    fn step(&self, batch: TokenBatch) -> StepOutput {
        let starts = batch.documents.as_ref();
        self.output(self.forward_within(batch.inputs.clone(), starts), &batch)
    }
}

impl crate::lm::CausalLm for Gpt2 {
    type Config = Gpt2Config;

    fn init(config: &Self::Config, device: &Device) -> Self {
        config.init(device)
    }

    fn context(config: &Self::Config) -> usize {
        config.n_positions
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
