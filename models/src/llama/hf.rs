//! The Llama family in the Hugging Face layout: its `config.json` (`model_type` `llama`,
//! `mistral` or `qwen2`; transformers 4's `rope_theta`/`rope_scaling` and 5's
//! `rope_parameters`) read and written back, and how its weight files name their tensors.

use burn::store::KeyRemapper;
use serde_json::Value;

use super::{LlamaConfig, RopeScaling};
use crate::hf::keys::{Ignored, Keys};

/// The config of a `config.json` of `model_type` `kind` (`llama`, `mistral` or `qwen2`).
pub(crate) fn llama_config(kind: &str, c: &Keys) -> Result<LlamaConfig, String> {
    let act = c.str_or("hidden_act", "silu")?;
    if act != "silu" {
        return Err(format!(
            "key `hidden_act`: {act:?} is not implemented (kiln's Llama family uses silu)"
        ));
    }
    // transformers 5 keeps the rotary settings in `rope_parameters`; 4 in `rope_theta` and
    // `rope_scaling`.
    let (rope, rope_key) = match c.get("rope_parameters") {
        Some(p) => (Some(p), "rope_parameters"),
        None => (c.get("rope_scaling"), "rope_scaling"),
    };
    let theta = match rope.and_then(|p| p.get("rope_theta")) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| format!("key `{rope_key}.rope_theta`: expected a number, got {v}"))?,
        None => c.f64_or("rope_theta", 10000.0)?,
    };
    let rope_scaling = match rope {
        None => None,
        Some(p) => rope_scaling(p, rope_key, c)?,
    };
    let qwen = kind == "qwen2";
    let sliding_window = match kind {
        "mistral" => c.opt_usize("sliding_window")?,
        "qwen2" if c.bool_or("use_sliding_window", false)? => {
            return Err(
                "key `use_sliding_window`: true is not implemented (Qwen2's per-layer sliding \
                 window)"
                    .into(),
            );
        }
        _ => None,
    };
    Ok(LlamaConfig {
        vocab_size: c.usize("vocab_size")?,
        hidden_size: c.usize("hidden_size")?,
        intermediate_size: c.usize("intermediate_size")?,
        num_hidden_layers: c.usize("num_hidden_layers")?,
        num_attention_heads: c.usize("num_attention_heads")?,
        num_key_value_heads: c.opt_usize("num_key_value_heads")?.unwrap_or(0),
        head_dim: c.opt_usize("head_dim")?.unwrap_or(0),
        max_position_embeddings: c.opt_usize("max_position_embeddings")?.unwrap_or(2048),
        rms_norm_eps: c.f64_or("rms_norm_eps", 1e-6)?,
        rope_theta: theta,
        rope_scaling,
        attention_bias: !qwen && c.bool_or("attention_bias", false)?,
        qkv_bias: qwen,
        mlp_bias: c.bool_or("mlp_bias", false)?,
        tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?,
        sliding_window,
    })
}

/// The rotary scaling of `p` (`rope_parameters` or `rope_scaling`); `None` for the default.
fn rope_scaling(p: &Value, key: &str, c: &Keys) -> Result<Option<RopeScaling>, String> {
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
                None => c.usize("max_position_embeddings")?,
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

/// The `config.json` `transformers` reads for `c`, its weights in float32: Llama's (Qwen2's
/// where the biases are on q, k and v only, Mistral's with a sliding window).
pub(crate) fn config_json(c: &LlamaConfig) -> Value {
    let (model_type, architecture) = if c.qkv_bias && !c.attention_bias {
        ("qwen2", "Qwen2ForCausalLM")
    } else if c.sliding_window.is_some() {
        ("mistral", "MistralForCausalLM")
    } else {
        ("llama", "LlamaForCausalLM")
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
    if model_type != "qwen2" {
        json["attention_bias"] = c.attention_bias.into();
        json["mlp_bias"] = c.mlp_bias.into();
    }
    if let Some(w) = c.sliding_window {
        json["sliding_window"] = w.into();
    }
    json
}

/// The prefix the weight files may lack, and the tensors left out on purpose (a tied head's
/// copy, old rotary frequency buffers).
pub(crate) fn naming(c: &LlamaConfig) -> (KeyRemapper, Ignored) {
    let tied = c.tie_word_embeddings;
    (
        KeyRemapper::new()
            .add_pattern(r"^(embed_tokens|layers|norm)\.", "model.$1.")
            .expect("a valid pattern"),
        Box::new(move |name: &str| {
            name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight")
        }),
    )
}
