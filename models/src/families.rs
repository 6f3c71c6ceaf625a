//! The families kiln trains as causal language models: kiln's GPT and the Hugging Face
//! Llama and GPT-2, each a [`CausalLm`] in its own module; here, which Hugging Face architecture each is
//! (the one place the family list and the architectures meet).

use crate::hf::HfArchitecture;
use crate::lm::CausalLm;

/// A causal language model whose architecture may be one of Hugging Face's: kiln writes its
/// `config.json` from [`HfFamily::hf_architecture`] when it exports the model that way.
pub trait HfFamily: CausalLm {
    /// The Hugging Face architecture `config` is, if it is one (not kiln's GPT).
    fn hf_architecture(config: &Self::Config) -> Option<HfArchitecture>;
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
