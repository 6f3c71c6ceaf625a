//! Phi-3 in the Hugging Face layout: its `config.json` (`model_type` `phi3`; transformers 4's
//! `rope_theta`/`rope_scaling`/`partial_rotary_factor` and 5's `rope_parameters`) read and
//! written back, and how its weight files name their tensors.

use serde::Deserialize;
use serde_json::Value;

use super::{Phi3, Phi3Config};
use crate::family::{Family, HfNaming, from_json};

impl Family for Phi3 {
    const MODEL_TYPES: &'static [&'static str] = &["phi3"];

    fn validate(config: &Phi3Config, key: &str) -> Result<(), String> {
        config.validate(key)
    }

    fn vocab_size(config: &Phi3Config) -> usize {
        config.vocab_size
    }

    fn set_vocab_size(config: &mut Phi3Config, size: usize) {
        config.vocab_size = size;
    }

    fn from_hf(_model_type: &str, json: &Value) -> Result<Phi3Config, String> {
        phi3_config(json)
    }

    fn hf_json(config: &Phi3Config) -> Option<Value> {
        Some(config_json(config))
    }

    fn hf_naming(config: &Phi3Config) -> HfNaming {
        crate::decoder::hf_naming(config.tie_word_embeddings)
    }
}

/// The keys of a Phi-3 `config.json` that kiln reads (the rest is left alone).
#[derive(Deserialize)]
struct HfPhi3 {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    /// transformers 5's rotary settings.
    rope_parameters: Option<Value>,
    /// transformers 4's rotary scaling.
    rope_scaling: Option<Value>,
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
}

/// The config of a `config.json` (`json`) of `model_type` `phi3`.
fn phi3_config(json: &Value) -> Result<Phi3Config, String> {
    let c: HfPhi3 = from_json(json)?;
    let act = c.hidden_act.as_deref().unwrap_or("silu");
    if act != "silu" {
        return Err(format!(
            "key `hidden_act`: {act:?} is not implemented (kiln's Phi-3 uses silu)"
        ));
    }
    let (rope, key) = match &c.rope_parameters {
        Some(p) => (Some(p), "rope_parameters"),
        None => (c.rope_scaling.as_ref(), "rope_scaling"),
    };
    let number = |name: &str| match rope.and_then(|p| p.get(name)) {
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("key `{key}.{name}`: expected a number, got {v}")),
        None => Ok(None),
    };
    if let Some(p) = rope {
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if kind != "default" {
            return Err(format!(
                "key `{key}.rope_type`: {kind:?} is not implemented (kiln's Phi-3 has the \
                 default rotary embedding, not longrope's per-frequency factors)"
            ));
        }
    }
    Ok(Phi3Config {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads.unwrap_or(0),
        head_dim: c.head_dim.unwrap_or(0),
        max_position_embeddings: c.max_position_embeddings.unwrap_or(4096),
        rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-5),
        rope_theta: number("rope_theta")?.or(c.rope_theta).unwrap_or(10000.0),
        partial_rotary_factor: number("partial_rotary_factor")?
            .or(c.partial_rotary_factor)
            .unwrap_or(1.0),
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
        sliding_window: c.sliding_window,
    })
}

/// The `config.json` `transformers` reads for `c`, its weights in float32.
fn config_json(c: &Phi3Config) -> Value {
    let mut json = serde_json::json!({
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.kv_heads(),
        "max_position_embeddings": c.max_position_embeddings,
        "original_max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "rope_theta": c.rope_theta,
        "partial_rotary_factor": c.partial_rotary_factor,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary_factor,
        },
        "sliding_window": c.sliding_window,
        "tie_word_embeddings": c.tie_word_embeddings,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
        // transformers' defaults are Phi-3's own ids (32000 pads the embedding), which a
        // smaller vocabulary does not have.
        "bos_token_id": null,
        "eos_token_id": null,
        "pad_token_id": null,
        "dtype": "float32",
    });
    json["head_dim"] = c.head_width().into();
    json
}
