//! The families kiln trains as causal language models: kiln's GPT and the Hugging Face
//! Llama and GPT-2, each as a [`CausalLm`] and as an [`HfFamily`].

use burn::prelude::*;

use crate::hf::HfArchitecture;
use crate::lm::CausalLm;

/// A causal language model whose architecture may be one of Hugging Face's: kiln writes its
/// `config.json` from [`HfFamily::hf_architecture`] when it exports the model that way.
pub trait HfFamily: CausalLm {
    /// The Hugging Face architecture `config` is, if it is one (not kiln's GPT).
    fn hf_architecture(config: &Self::Config) -> Option<HfArchitecture>;
}

impl CausalLm for crate::gpt::Gpt {
    type Config = crate::gpt::GptConfig;

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

impl CausalLm for crate::llama::Llama {
    type Config = crate::llama::LlamaConfig;

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

impl CausalLm for crate::gpt2::Gpt2 {
    type Config = crate::gpt2::Gpt2Config;

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

impl HfFamily for crate::gpt::Gpt {
    fn hf_architecture(_config: &Self::Config) -> Option<HfArchitecture> {
        None
    }
}

impl HfFamily for crate::llama::Llama {
    fn hf_architecture(config: &Self::Config) -> Option<HfArchitecture> {
        Some(HfArchitecture::Llama(config.clone()))
    }
}

impl HfFamily for crate::gpt2::Gpt2 {
    fn hf_architecture(config: &Self::Config) -> Option<HfArchitecture> {
        Some(HfArchitecture::Gpt2(config.clone()))
    }
}
