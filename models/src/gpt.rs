//! A small decoder-only transformer in the nanoGPT shape: token and learned position
//! embeddings, pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP with
//! residual connections, a final LayerNorm and an output head tied to the token embedding.

use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig,
    Linear, LinearConfig,
};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::blocks::{Activation, BlockStack};
use crate::lm::TokenBatch;
use crate::step::{StepOutput, TrainStep};

/// The LayerNorms' epsilon (Burn keeps a LayerNorm's own private; the fused kernel is told).
const LN_EPSILON: f64 = 1e-5;

/// Architecture of a [`Gpt`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptConfig {
    /// Number of transformer blocks. Default 4.
    pub n_layer: usize,
    /// Attention heads per block. Default 4.
    pub n_head: usize,
    /// Width of the residual stream. Default 128.
    pub n_embd: usize,
    /// Longest context, in tokens. Default 64.
    pub block_size: usize,
    /// Vocabulary size; 0 takes it from the data's tokenizer. Default 0.
    pub vocab_size: usize,
    /// Dropout probability after attention, MLP and embeddings. Default 0.
    pub dropout: f64,
    /// Whether linear layers and LayerNorms have biases. Default false.
    pub bias: bool,
}

impl Default for GptConfig {
    fn default() -> Self {
        Self {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            vocab_size: 0,
            dropout: 0.0,
            bias: false,
        }
    }
}

/// Causal multi-head self-attention.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    qkv: Linear,
    proj: Linear,
    dropout: Dropout,
    n_head: usize,
}

impl CausalSelfAttention {
    /// `[batch, time, n_embd]` → `[batch, time, n_embd]`; position t attends to 0..=t only.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_within(x, None)
    }

    /// [`CausalSelfAttention::forward`] within documents: position t attends to
    /// `starts[t]..=t` (see [`TokenBatch::documents`]).
    /// Under tensor parallelism (`crate::tp`) the projection `qkv` is column-parallel by
    /// heads and `proj` row-parallel: a rank attends with its `n_head / size` heads.
    pub fn forward_within(&self, x: Tensor<3>, starts: Option<&Tensor<2, Int>>) -> Tensor<3> {
        crate::draw::dropout(&self.dropout, self.projected(x, starts), None)
    }

    /// `residual + self.forward_within(x, starts)`: on a GPU the dropout and the sum are one
    /// kernel ([`crate::draw::dropout_add`]).
    pub fn added_within(
        &self,
        residual: Tensor<3>,
        x: Tensor<3>,
        starts: Option<&Tensor<2, Int>>,
    ) -> Tensor<3> {
        let y = self.projected(x, starts);
        crate::draw::dropout_add(&self.dropout, residual, y, None)
    }

    /// The attention's output projected, before its dropout.
    fn projected(&self, x: Tensor<3>, starts: Option<&Tensor<2, Int>>) -> Tensor<3> {
        let qkv = crate::tp::column_rows(&self.qkv, x);
        let heads = self.n_head / crate::tp::place().1;
        // Dropout on the weights of this rank's heads: their part of the whole's mask.
        let dropout = crate::draw::DropoutPart {
            dropout: &self.dropout,
            part: crate::tp::part(1),
        };
        let y = crate::fused::packed_within(qkv, heads, starts, Some(dropout));
        crate::tp::row_rows(&self.proj, y)
    }
}

/// The position-wise MLP: `n_embd → 4·n_embd → GELU → n_embd`.
#[derive(Module, Debug)]
pub struct Mlp {
    fc: Linear,
    proj: Linear,
    dropout: Dropout,
}

impl Mlp {
    /// Applies the MLP to every position (under tensor parallelism, `fc` column-parallel and
    /// `proj` row-parallel).
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        crate::draw::dropout(&self.dropout, self.projected(x), None)
    }

    /// `residual + self.forward(x)`: on a GPU the dropout and the sum are one kernel
    /// ([`crate::draw::dropout_add`]).
    pub fn added(&self, residual: Tensor<3>, x: Tensor<3>) -> Tensor<3> {
        crate::draw::dropout_add(&self.dropout, residual, self.projected(x), None)
    }

    /// The MLP's output before its dropout.
    fn projected(&self, x: Tensor<3>) -> Tensor<3> {
        // The exact GELU, fused on the CPU.
        let x = crate::fused::gelu(crate::tp::column_rows(&self.fc, x));
        crate::tp::row_rows(&self.proj, x)
    }
}

/// One pre-LayerNorm transformer block.
#[derive(Module, Debug)]
pub struct Block {
    ln_1: LayerNorm,
    attn: CausalSelfAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    /// `x + attn(ln(x))`, then `x + mlp(ln(x))`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_within(x, None)
    }

    /// [`Block::forward`] with attention within documents (see [`TokenBatch::documents`]).
    pub fn forward_within(&self, x: Tensor<3>, starts: Option<&Tensor<2, Int>>) -> Tensor<3> {
        let ln = |norm: &LayerNorm, x: Tensor<3>| crate::fused::layer_norm(norm, LN_EPSILON, x);
        let x = self.attn.added_within(x.clone(), ln(&self.ln_1, x), starts);
        self.mlp.added(x.clone(), ln(&self.ln_2, x))
    }
}

/// The decoder-only transformer.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding, also the output head (weight tying).
    pub wte: Embedding,
    /// Learned position embedding.
    pub wpe: Embedding,
    drop: Dropout,
    /// The block stack, exposed so that recomputation can wrap blocks from outside.
    pub blocks: Vec<Block>,
    /// Final LayerNorm.
    pub ln_f: LayerNorm,
    /// The vocabulary's size (the embedding holds a part of it in a tensor-parallel group).
    #[module(skip)]
    vocab: usize,
}

impl GptConfig {
    /// Checks the configuration, with the vocabulary size already resolved.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(format!("model.gpt.{key} must be at least 1, got 0"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!(
                "model.gpt.n_embd ({}) must be a multiple of model.gpt.n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!(
                "model.gpt.dropout must be in [0, 1), got {}",
                self.dropout
            ));
        }
        Ok(())
    }

    /// Builds the model on `device` with nanoGPT's initialisation: N(0, 0.02) weights, residual
    /// output projections scaled by 1/√(2·n_layer), zero biases, unit LayerNorm gains.
    pub fn init(&self, device: &Device) -> Gpt {
        let std = 0.02;
        let normal = |std: f64| Initializer::Normal { mean: 0.0, std };
        let residual = normal(std / (2.0 * self.n_layer as f64).sqrt());
        let linear = |i: usize, o: usize, init: Initializer| {
            let mut l = LinearConfig::new(i, o)
                .with_bias(self.bias)
                .with_initializer(init)
                .init(device);
            if let Some(bias) = l.bias.take() {
                l.bias = Some(bias.map(|b| b.zeros_like()));
            }
            l
        };
        let ln = || {
            LayerNormConfig::new(self.n_embd)
                .with_bias(self.bias)
                .with_epsilon(LN_EPSILON)
                .init(device)
        };
        let dropout = || DropoutConfig::new(self.dropout).init();
        let c = self.n_embd;
        let blocks = (0..self.n_layer)
            .map(|_| Block {
                ln_1: ln(),
                attn: CausalSelfAttention {
                    qkv: linear(c, 3 * c, normal(std)),
                    proj: linear(c, c, residual.clone()),
                    dropout: dropout(),
                    n_head: self.n_head,
                },
                ln_2: ln(),
                mlp: Mlp {
                    fc: linear(c, 4 * c, normal(std)),
                    proj: linear(4 * c, c, residual.clone()),
                    dropout: dropout(),
                },
            })
            .collect();
        Gpt {
            wte: EmbeddingConfig::new(self.vocab_size, c)
                .with_initializer(normal(std))
                .init(device),
            wpe: EmbeddingConfig::new(self.block_size, c)
                .with_initializer(normal(std))
                .init(device),
            drop: dropout(),
            blocks,
            ln_f: ln(),
            vocab: self.vocab_size,
        }
    }

    /// Parameters of the model this config builds (weights tied, so the head adds none).
    pub fn num_params(&self) -> usize {
        let c = self.n_embd;
        let bias = usize::from(self.bias);
        let linear = |i: usize, o: usize| i * o + bias * o;
        let ln = c + bias * c;
        let block = 2 * ln + linear(c, 3 * c) + linear(c, c) + linear(c, 4 * c) + linear(4 * c, c);
        self.vocab_size * c + self.block_size * c + self.n_layer * block + ln
    }

    /// Training FLOPs per token as nanoGPT estimates them: 6·N + 12·L·H·Q·T, with N the
    /// parameters without the position embedding, Q the head size and T the context length.
    pub fn flops_per_token(&self) -> f64 {
        let n = (self.num_params() - self.block_size * self.n_embd) as f64;
        let (l, h, q, t) = (
            self.n_layer as f64,
            self.n_head as f64,
            (self.n_embd / self.n_head) as f64,
            self.block_size as f64,
        );
        6.0 * n + 12.0 * l * h * q * t
    }
}

impl Gpt {
    /// Runs the embeddings: `[batch, time]` token ids → `[batch, time, n_embd]`.
    pub fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.embed_within(tokens, None)
    }

    /// [`Gpt::embed`] of packed rows: positions restart where each example begins (see
    /// [`TokenBatch::documents`]).
    pub fn embed_within(
        &self,
        tokens: Tensor<2, Int>,
        starts: Option<&Tensor<2, Int>>,
    ) -> Tensor<3> {
        let t = tokens.dims()[1];
        let tokens = crate::tp::vocab::embedding(&self.wte, tokens, self.vocab_start());
        let x = match starts {
            None => tokens + crate::modules::position_rows(&self.wpe, 0, t),
            Some(s) => tokens + crate::cube::embedding(&self.wpe, crate::lm::positions_within(s)),
        };
        crate::draw::dropout(&self.drop, x, None)
    }

    /// The first id of the vocabulary part this rank's embedding holds, in a tensor-parallel
    /// group that cuts it; `None` otherwise.
    fn vocab_start(&self) -> Option<usize> {
        crate::tp::vocab::vocab_start(self.wte.weight.dims()[0], self.vocab)
    }

    /// The step's output from the last block's `x`: the head and the loss, with the
    /// vocabulary's parts and the parallel cross-entropy where a group cuts it.
    fn output(&self, x: Tensor<3>, batch: &TokenBatch) -> StepOutput {
        crate::lm::lm_output_cut(self.head(x), batch, self.vocab_start())
    }

    /// Final LayerNorm and the tied head: `[batch, time, n_embd]` → logits `[batch, time, vocab]`
    /// (in a tensor-parallel group that cuts the vocabulary, the columns of this rank's part).
    pub fn head(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, c] = x.dims();
        let x = crate::fused::layer_norm(&self.ln_f, LN_EPSILON, x).reshape([b * t, c]);
        let x = crate::tp::vocab::to_head(x, self.vocab_start());
        let weight = self.wte.weight.val();
        let vocab = weight.dims()[0];
        crate::cube::product(x, weight.transpose()).reshape([b, t, vocab])
    }

    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.forward_within(tokens, None)
    }

    /// [`Gpt::forward`] of packed rows (see [`TokenBatch::documents`]).
    pub fn forward_within(
        &self,
        tokens: Tensor<2, Int>,
        starts: Option<&Tensor<2, Int>>,
    ) -> Tensor<3> {
        let mut x = self.embed_within(tokens, starts);
        for block in &self.blocks {
            x = block.forward_within(x, starts);
        }
        self.head(x)
    }

    /// Mean next-token cross-entropy of `logits` against `targets`, computed in f32 whatever
    /// the logits' dtype (softmax and its log lose too much in 16-bit floats).
    pub fn loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        crate::lm::lm_loss(logits, targets)
    }

    /// Continues `prompt` by up to `tokens` ids, each picked as `how` says from the logits of
    /// the last `block_size` positions (no cache: the GPT recomputes them), ending early at
    /// one of its stop ids. `uniform` supplies numbers in [0, 1), so that sampling is
    /// reproducible.
    pub fn generate(
        &self,
        prompt: &[u32],
        tokens: usize,
        how: &crate::lm::Sampling,
        block_size: usize,
        mut uniform: impl FnMut() -> f64,
    ) -> Vec<u32> {
        let device = self.wte.weight.val().device();
        let mut ids: Vec<u32> = prompt.to_vec();
        for _ in 0..tokens {
            let start = ids.len().saturating_sub(block_size);
            let context: Vec<i64> = ids[start..].iter().map(|&i| i64::from(i)).collect();
            let t = context.len();
            let input = Tensor::<2, Int>::from_data(TensorData::new(context, [1, t]), &device);
            let logits = self.forward(input).slice([0..1, t - 1..t]).reshape([-1]);
            let logits: Vec<f32> = logits.into_data().iter::<f32>().collect();
            let next = how.pick(&logits, uniform());
            ids.push(next);
            if how.stop.contains(&next) {
                break;
            }
        }
        ids
    }
}

/// Draws an id from `softmax(logits / temperature)` over the `top_k` largest logits, using one
/// uniform number `u` in [0, 1). A temperature of 0 picks the most likely id.
pub fn sample(logits: &[f32], temperature: f64, top_k: Option<usize>, u: f64) -> u32 {
    let how = crate::lm::Sampling {
        top_k,
        ..crate::lm::Sampling::at(temperature)
    };
    how.pick(logits, u)
}

/// Megatron's split: each block's attention by heads (`qkv`'s q, k and v columns, `proj`'s
/// rows) and its MLP (`fc`'s columns, `proj`'s rows); the embeddings, the LayerNorms and the
/// row-parallel Linears' biases whole on every rank.
impl crate::tp::TensorParallel for Gpt {
    fn tp_ready(&self) -> bool {
        true
    }

    fn tp_check(&self, size: usize) -> Result<(), String> {
        let heads = self.blocks.first().map_or(0, |b| b.attn.n_head);
        crate::tp::must_divide("model.gpt.n_head", heads, size)?;
        Ok(())
    }

    fn tp_draws_keyed(&self) -> bool {
        true
    }

    fn tp_floats(&self, samples: usize, size: usize) -> Option<crate::tp::TpFloats> {
        let [t, c] = self.wpe.weight.dims();
        let activation = samples * t * c;
        let cut = size > 1;
        // Per block: `g` after the attention's and the MLP's row-parallel Linears going
        // forward, `f` before their column-parallel ones going back.
        let block = if cut { 2 * activation } else { 0 };
        // A cut vocabulary: the embedding's sum going forward, the head's `f` going back, and
        // the cross-entropy's three sums (the maxima gathered as `size` slots).
        let vocab = cut && self.vocab.is_multiple_of(size);
        let stem = if vocab { activation } else { 0 };
        let head = if vocab {
            activation + (size + 2) * samples * t
        } else {
            0
        };
        Some(crate::tp::TpFloats {
            total: 2 * block * self.blocks.len() + stem + head,
            stem,
            block,
        })
    }

    fn tp_split(&self, path: &str, size: usize) -> crate::tp::Split {
        use crate::tp::Split;
        let within = |suffix: &str| path.starts_with("blocks.") && path.ends_with(suffix);
        if path == "wte.weight" && self.vocab.is_multiple_of(size) {
            // The vocabulary by rows: the embedding's and the tied head's.
            Split::first(1)
        } else if within(".attn.qkv.weight") {
            Split::columns(3)
        } else if within(".attn.qkv.bias") {
            Split::first(3)
        } else if within(".mlp.fc.weight") {
            Split::columns(1)
        } else if within(".mlp.fc.bias") {
            Split::first(1)
        } else if within(".attn.proj.weight") || within(".mlp.proj.weight") {
            Split::ROWS
        } else {
            Split::Whole
        }
    }
}

impl BlockStack<TokenBatch> for Gpt {
    fn tensor_parallel(&self) -> Option<&dyn crate::tp::TensorParallel> {
        Some(self)
    }

    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn stem(&self, batch: &TokenBatch) -> Activation {
        Activation::Rank3(self.embed_within(batch.inputs.clone(), batch.documents.as_ref()))
    }

    fn block_params(&self, i: usize) -> Vec<burn::module::ParamId> {
        crate::modules::param_ids(&self.blocks[i])
    }

    fn block(&self, i: usize, x: Activation) -> Activation {
        Activation::Rank3(self.blocks[i].forward(x.into_rank()))
    }

    fn block_in(&self, i: usize, x: Activation, batch: &TokenBatch) -> Activation {
        let starts = batch.documents.as_ref();
        Activation::Rank3(self.blocks[i].forward_within(x.into_rank(), starts))
    }

    fn blocks_read_batch(&self) -> bool {
        true
    }

    fn head(&self, x: Activation, batch: &TokenBatch) -> StepOutput {
        self.output(x.into_rank(), batch)
    }
}

impl TrainStep<TokenBatch> for Gpt {
    fn step(&self, batch: TokenBatch) -> StepOutput {
        let starts = batch.documents.as_ref();
        let mut x = self.embed_within(batch.inputs.clone(), starts);
        for block in &self.blocks {
            x = block.forward_within(x, starts);
        }
        self.output(x, &batch)
    }
}

/// kiln's own: a `[model.gpt]` section, no Hugging Face layout.
impl crate::family::Family for Gpt {
    fn validate(config: &GptConfig, _key: &str) -> Result<(), String> {
        config.validate()
    }

    fn vocab_size(config: &GptConfig) -> usize {
        config.vocab_size
    }

    fn set_vocab_size(config: &mut GptConfig, size: usize) {
        config.vocab_size = size;
    }
}

impl crate::lm::CausalLm for Gpt {
    type Config = GptConfig;

    fn init(config: &Self::Config, device: &Device) -> Self {
        config.init(device)
    }

    fn context(config: &Self::Config) -> usize {
        config.block_size
    }

    fn flops_per_token(config: &Self::Config, _context: usize) -> f64 {
        config.flops_per_token()
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
        let block = self.wpe.weight.val().dims()[0];
        self.generate(prompt, tokens, how, block, uniform)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> GptConfig {
        GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            block_size: 8,
            vocab_size: 11,
            dropout: 0.0,
            bias: true,
        }
    }

    fn tokens(ids: &[i64], device: &Device) -> Tensor<2, Int> {
        Tensor::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), device)
    }

    #[test]
    fn no_position_sees_the_future() {
        let device = Device::flex();
        let model = tiny().init(&device);
        let a = [1, 2, 3, 4, 5, 6, 7, 8];
        let mut b = a;
        b[5] = 9;
        let la = model
            .forward(tokens(&a, &device))
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let lb = model
            .forward(tokens(&b, &device))
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let v = 11;
        // Positions 0..5 are bit-identical; position 5 and later change.
        assert_eq!(la[..5 * v], lb[..5 * v]);
        assert_ne!(la[5 * v..6 * v], lb[5 * v..6 * v]);
    }

    #[test]
    fn head_is_tied_to_the_token_embedding() {
        let device = Device::flex();
        let config = tiny();
        let model = config.init(&device);
        assert_eq!(model.num_params(), config.num_params());
        // Zeroing the embedding row of token 3 makes its logit exactly zero everywhere.
        let mut model = model;
        let weight = model.wte.weight.val();
        let mask = Tensor::<2>::ones([11, 16], &device)
            .slice_assign([3..4, 0..16], Tensor::zeros([1, 16], &device));
        model.wte.weight = model.wte.weight.map(|_| weight * mask);
        let logits = model.forward(tokens(&[1, 2, 4], &device));
        let column: Vec<f32> = logits
            .slice([0..1, 0..3, 3..4])
            .into_data()
            .try_to_vec()
            .unwrap();
        assert!(column.iter().all(|&x| x == 0.0), "{column:?}");
    }

    #[test]
    fn block_stack_is_the_same_computation_as_step() {
        let device = Device::flex();
        let model = tiny().init(&device);
        let batch = || TokenBatch {
            trained: None,
            loss_weight: None,
            documents: None,
            inputs: tokens(&[1, 2, 3, 4, 5, 6, 7, 8], &device),
            targets: tokens(&[2, 3, 4, 5, 6, 7, 8, 9], &device),
        };
        let whole: f32 = model.step(batch()).loss.into_scalar();
        let mut x = model.stem(&batch());
        for i in 0..model.num_blocks() {
            x = model.block(i, x);
        }
        let staged: f32 = BlockStack::head(&model, x, &batch()).loss.into_scalar();
        assert_eq!(whole.to_bits(), staged.to_bits(), "{whole} vs {staged}");
        assert!(model.blocks_deterministic());
        // Every parameter belongs to exactly one block, or to none (embeddings, final norm).
        let all = crate::modules::param_ids(&model);
        let mut claimed: Vec<_> = (0..model.num_blocks())
            .flat_map(|i| model.block_params(i))
            .collect();
        let outside = [
            crate::modules::param_ids(&model.wte),
            crate::modules::param_ids(&model.wpe),
            crate::modules::param_ids(&model.ln_f),
        ]
        .concat();
        assert!(claimed.iter().all(|id| !outside.contains(id)));
        claimed.extend(outside);
        claimed.sort_by_key(|id| id.val());
        claimed.dedup();
        assert_eq!(claimed.len(), all.len());
        // Its dropout's masks are drawn again when a block is recomputed.
        let dropped = GptConfig {
            dropout: 0.1,
            ..tiny()
        }
        .init(&device);
        assert!(dropped.blocks_deterministic());
    }

    #[test]
    fn untrained_loss_is_about_ln_vocab() {
        let device = Device::flex();
        let mut config = tiny();
        config.vocab_size = 65;
        let model = config.init(&device);
        let ids: Vec<i64> = (0..8 * 4).map(|i| (i * 7 % 65) as i64).collect();
        let inputs = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [4, 8]), &device);
        let targets = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|i| (i + 1) % 65).collect::<Vec<_>>(), [4, 8]),
            &device,
        );
        let loss: f32 = Gpt::loss(model.forward(inputs), targets).into_scalar();
        let expected = (65f32).ln();
        assert!(
            (loss - expected).abs() < 0.05 * expected,
            "{loss} vs ln 65 = {expected}"
        );
    }

    #[test]
    fn flops_follow_the_estimate() {
        let c = GptConfig {
            vocab_size: 65,
            ..GptConfig::default()
        };
        let n = (c.num_params() - 64 * 128) as f64;
        assert_eq!(
            c.flops_per_token(),
            6.0 * n + 12.0 * 4.0 * 4.0 * 32.0 * 64.0
        );
    }

    #[test]
    fn sampling_respects_temperature_and_top_k() {
        let logits = [0.0, 5.0, 1.0, 4.0];
        assert_eq!(sample(&logits, 0.0, None, 0.7), 1);
        for u in [0.0, 0.3, 0.6, 0.99] {
            let id = sample(&logits, 1.0, Some(2), u);
            assert!(id == 1 || id == 3, "{id}");
        }
        assert_eq!(sample(&logits, 1.0, Some(1), 0.99), 1);
    }
}
