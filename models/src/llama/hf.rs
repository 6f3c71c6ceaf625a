//! The Llama family in the Hugging Face layout: its `config.json` (`model_type` `llama`,
//! `mistral` or `qwen2`; transformers 4's `rope_theta`/`rope_scaling` and 5's
//! `rope_parameters`) read and written back, and how its weight files name their tensors.

use serde::Deserialize;
use serde_json::Value;

use super::{Llama, LlamaConfig, LlamaVariant, RopeScaling};
use crate::family::{Family, HfNaming, from_json};

impl Family for Llama {
    const MODEL_TYPES: &'static [&'static str] = &["llama", "mistral", "qwen2"];

    fn validate(config: &LlamaConfig, key: &str) -> Result<(), String> {
        config.validate(key)
    }

    fn vocab_size(config: &LlamaConfig) -> usize {
        config.vocab_size
    }

    fn set_vocab_size(config: &mut LlamaConfig, size: usize) {
        config.vocab_size = size;
    }

    fn from_hf(model_type: &str, json: &Value) -> Result<LlamaConfig, String> {
        llama_config(model_type, json)
    }

    fn hf_json(config: &LlamaConfig) -> Option<Value> {
        Some(config_json(config))
    }

    fn hf_naming(config: &LlamaConfig) -> HfNaming {
        crate::decoder::hf_naming(config.tie_word_embeddings)
    }
}

/// The keys of a `config.json` of the family that kiln reads (the rest is left alone).
#[derive(Deserialize)]
struct HfLlama {
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
    /// transformers 5's rotary settings.
    rope_parameters: Option<Value>,
    /// transformers 4's rotary scaling.
    rope_scaling: Option<Value>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
}

/// The config of a `config.json` (`json`) of `model_type` `llama`, `mistral` or `qwen2`.
fn llama_config(model_type: &str, json: &Value) -> Result<LlamaConfig, String> {
    let c: HfLlama = from_json(json)?;
    let act = c.hidden_act.as_deref().unwrap_or("silu");
    if act != "silu" {
        return Err(format!(
            "key `hidden_act`: {act:?} is not implemented (kiln's Llama family uses silu)"
        ));
    }
    let max_position_embeddings = c.max_position_embeddings.unwrap_or(2048);
    // transformers 5 keeps the rotary settings in `rope_parameters`; 4 in `rope_theta` and
    // `rope_scaling`.
    let (rope, rope_key) = match &c.rope_parameters {
        Some(p) => (Some(p), "rope_parameters"),
        None => (c.rope_scaling.as_ref(), "rope_scaling"),
    };
    let theta = match rope.and_then(|p| p.get("rope_theta")) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| format!("key `{rope_key}.rope_theta`: expected a number, got {v}"))?,
        None => c.rope_theta.unwrap_or(10000.0),
    };
    let rope_scaling = match rope {
        None => None,
        Some(p) => rope_scaling(p, rope_key, max_position_embeddings)?,
    };
    let variant = match model_type {
        "mistral" => LlamaVariant::Mistral,
        "qwen2" => LlamaVariant::Qwen2,
        _ => LlamaVariant::Llama,
    };
    if variant == LlamaVariant::Qwen2 && c.use_sliding_window == Some(true) {
        return Err(
            "key `use_sliding_window`: true is not implemented (Qwen2's per-layer sliding window)"
                .into(),
        );
    }
    let llama = variant == LlamaVariant::Llama;
    Ok(LlamaConfig {
        model_type: variant,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads.unwrap_or(0),
        head_dim: c.head_dim.unwrap_or(0),
        max_position_embeddings,
        rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6),
        rope_theta: theta,
        rope_scaling,
        attention_bias: llama && c.attention_bias.unwrap_or(false),
        mlp_bias: llama && c.mlp_bias.unwrap_or(false),
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
        sliding_window: c
            .sliding_window
            .filter(|_| variant == LlamaVariant::Mistral),
    })
}

/// The rotary scaling of `p` (`rope_parameters` or `rope_scaling`); `None` for the default.
/// `context` is the `max_position_embeddings` that llama3's scaling falls back on.
fn rope_scaling(p: &Value, key: &str, context: usize) -> Result<Option<RopeScaling>, String> {
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |name: &str| {
        p.get(name)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("key `{key}.{name}`: missing (a number, for {kind:?})"))
    };
    Ok(match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: match p.get("original_max_position_embeddings") {
                Some(v) => v.as_u64().ok_or_else(|| {
                    format!("key `{key}.original_max_position_embeddings`: expected a whole number")
                })? as usize,
                None => context,
            },
        }),
        other => {
            return Err(format!(
                "key `{key}.rope_type`: {other:?} is not implemented (kiln has default, linear \
                 and llama3)"
            ));
        }
    })
}

/// The `config.json` `transformers` reads for `c`, its weights in float32, of its own
/// `model_type`.
fn config_json(c: &LlamaConfig) -> Value {
    let (model_type, architecture) = match c.model_type {
        LlamaVariant::Llama => ("llama", "LlamaForCausalLM"),
        LlamaVariant::Mistral => ("mistral", "MistralForCausalLM"),
        LlamaVariant::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
    };
    let mut rope = serde_json::json!({"rope_theta": c.rope_theta, "rope_type": "default"});
    match &c.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            rope["rope_type"] = "linear".into();
            rope["factor"] = (*factor).into();
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            rope["rope_type"] = "llama3".into();
            rope["factor"] = (*factor).into();
            rope["low_freq_factor"] = (*low_freq_factor).into();
            rope["high_freq_factor"] = (*high_freq_factor).into();
            rope["original_max_position_embeddings"] = (*original_max_position_embeddings).into();
        }
    }
    let mut json = serde_json::json!({
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.kv_heads(),
        "head_dim": c.head_width(),
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": c.tie_word_embeddings,
        "dtype": "float32",
    });
    if c.model_type == LlamaVariant::Llama {
        json["attention_bias"] = c.attention_bias.into();
        json["mlp_bias"] = c.mlp_bias.into();
    }
    if let Some(w) = c.sliding_window {
        json["sliding_window"] = w.into();
    }
    json
}
