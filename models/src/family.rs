//! What a language-model family is to kiln: a [`CausalLm`] with a config section of its own
//! and, where it has one, its Hugging Face layout (the `model_type`s it reads, its
//! `config.json` read and written back, the names of its weight files' tensors). Each family
//! implements [`Family`] in its own module; [`crate::registry`] lists them.

use burn::store::KeyRemapper;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::lm::CausalLm;

/// A causal language model family, as its own module describes it.
pub trait Family: CausalLm {
    /// The Hugging Face `model_type`s it reads; empty for a family with no Hugging Face
    /// layout (kiln's GPT).
    const MODEL_TYPES: &'static [&'static str] = &[];

    /// Whether its projections store their weight `[in, out]` (GPT-2's `Conv1D`): PEFT's
    /// `fan_in_fan_out`.
    const CONV1D_PROJECTIONS: bool = false;

    /// Checks `config`, its vocabulary resolved; `key` names its section (`model.llama`).
    fn validate(config: &Self::Config, key: &str) -> Result<(), String>;

    /// The vocabulary size (0 in a section: the tokenizer's, set before [`Family::validate`]).
    fn vocab_size(config: &Self::Config) -> usize;

    /// Sets the vocabulary size.
    fn set_vocab_size(config: &mut Self::Config, size: usize);

    /// The config a `config.json` of `model_type` (one of [`Family::MODEL_TYPES`]) describes.
    fn from_hf(model_type: &str, json: &Value) -> Result<Self::Config, String> {
        let _ = json;
        Err(format!(
            "key `model_type`: {model_type:?} is not a layout of this family"
        ))
    }

    /// The `config.json` `transformers` reads for `config`, its weights in float32, with the
    /// family's own `model_type`; `None` for a family with no Hugging Face layout.
    fn hf_json(config: &Self::Config) -> Option<Value> {
        let _ = config;
        None
    }

    /// How its weight files name their tensors.
    fn hf_naming(config: &Self::Config) -> HfNaming {
        let _ = config;
        HfNaming::default()
    }
}

/// How a family's weight files name their tensors: the prefix the files may lack, and the
/// tensors left out on purpose (GPT-2's mask buffers, a tied head's copy, old rotary
/// frequency buffers).
pub struct HfNaming {
    /// Names as the files have them, made the model's.
    pub remap: KeyRemapper,
    /// Whether a file's tensor is left out on purpose.
    pub ignored: Box<dyn Fn(&str) -> bool>,
}

impl Default for HfNaming {
    fn default() -> Self {
        Self {
            remap: KeyRemapper::new(),
            ignored: Box::new(|_| false),
        }
    }
}

/// `json` read as `T` with serde, an error naming the key where it went wrong (`key
/// \`rope_parameters.factor\`: invalid type: …`) or the one that is missing.
pub fn from_json<T: DeserializeOwned>(json: &Value) -> Result<T, String> {
    serde_path_to_error::deserialize::<_, T>(json).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.inner().to_string()
        } else {
            format!("key `{path}`: {}", e.inner())
        }
    })
}
