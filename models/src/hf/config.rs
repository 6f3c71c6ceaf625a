//! A model directory's `config.json`: read into an [`HfArchitecture`] (transformers 4's
//! `rope_theta`/`rope_scaling` and 5's `rope_parameters`), and written back for one.

use std::path::Path;

use serde_json::Value;

use super::keys::Keys;
use crate::gpt2::Gpt2Config;
use crate::llama::LlamaConfig;

/// The architectures kiln reads from a `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub enum HfArchitecture {
    /// `model_type` `llama`, `mistral` or `qwen2`.
    Llama(LlamaConfig),
    /// `model_type` `gpt2`.
    Gpt2(Gpt2Config),
}

impl HfArchitecture {
    /// The family's name (`llama`, `gpt2`).
    pub fn family(&self) -> &'static str {
        match self {
            HfArchitecture::Llama(_) => "llama",
            HfArchitecture::Gpt2(_) => "gpt2",
        }
    }

    /// Whether the family's projections store their weight `[in, out]` (GPT-2's `Conv1D`):
    /// PEFT's `fan_in_fan_out`.
    pub fn conv1d_projections(&self) -> bool {
        matches!(self, HfArchitecture::Gpt2(_))
    }

    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            HfArchitecture::Llama(c) => c.vocab_size,
            HfArchitecture::Gpt2(c) => c.vocab_size,
        }
    }
}

/// Reads `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<HfArchitecture, String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: cannot read it: {e}", path.display()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    parse_config(&json).map_err(|e| format!("{}: {e}", path.display()))
}

/// The architecture a `config.json`'s value describes.
pub fn parse_config(json: &Value) -> Result<HfArchitecture, String> {
    let kind = json
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or("key `model_type`: missing (kiln reads llama, mistral, qwen2 and gpt2)")?;
    let c = Keys(json);
    match kind {
        "llama" | "mistral" | "qwen2" => {
            crate::llama::hf::llama_config(kind, &c).map(HfArchitecture::Llama)
        }
        "gpt2" => crate::gpt2::hf::gpt2_config(&c).map(HfArchitecture::Gpt2),
        other => Err(format!(
            "key `model_type`: {other:?} is an architecture kiln does not have (it reads llama, \
             mistral, qwen2 and gpt2)"
        )),
    }
}

/// The `config.json` `transformers` reads for `arch`, its weights in float32: Llama's (Qwen2's
/// where the biases are on q, k and v only, Mistral's with a sliding window) or GPT-2's.
pub fn config_json(arch: &HfArchitecture) -> Value {
    match arch {
        HfArchitecture::Llama(c) => crate::llama::hf::config_json(c),
        HfArchitecture::Gpt2(c) => crate::gpt2::hf::config_json(c),
    }
}

/// A checkpoint's own `config.json` (`original`) made to describe float32 weights: every
/// field it has kept, so that token ids and generation settings stay as they were.
pub fn config_json_from(original: &Path) -> Result<Value, String> {
    let path = original.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: cannot read it: {e}", path.display()))?;
    let mut json: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    let o = json
        .as_object_mut()
        .ok_or_else(|| format!("{}: not a JSON object", path.display()))?;
    o.insert("dtype".into(), "float32".into());
    if o.contains_key("torch_dtype") {
        o.insert("torch_dtype".into(), "float32".into());
    }
    Ok(json)
}
