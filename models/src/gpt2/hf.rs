//! GPT-2 in the Hugging Face layout: its `config.json` (`model_type` `gpt2`) read and written
//! back, and how its weight files name their tensors.

use burn::store::KeyRemapper;
use serde::Deserialize;
use serde_json::Value;

use super::{Gpt2, Gpt2Activation, Gpt2Config};
use crate::family::{Family, HfNaming, from_json};

impl Family for Gpt2 {
    const MODEL_TYPES: &'static [&'static str] = &["gpt2"];
    const CONV1D_PROJECTIONS: bool = true;

    fn validate(config: &Gpt2Config, key: &str) -> Result<(), String> {
        config.validate(key)
    }

    fn vocab_size(config: &Gpt2Config) -> usize {
        config.vocab_size
    }

    fn set_vocab_size(config: &mut Gpt2Config, size: usize) {
        config.vocab_size = size;
    }

    fn from_hf(_model_type: &str, json: &Value) -> Result<Gpt2Config, String> {
        gpt2_config(json)
    }

    fn hf_json(config: &Gpt2Config) -> Option<Value> {
        Some(config_json(config))
    }

    fn hf_naming(config: &Gpt2Config) -> HfNaming {
        naming(config)
    }
}

/// The keys of a GPT-2 `config.json` that kiln reads (the rest is left alone).
#[derive(Deserialize)]
struct HfGpt2 {
    vocab_size: usize,
    n_positions: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_inner: Option<usize>,
    layer_norm_epsilon: Option<f64>,
    activation_function: Option<Gpt2Activation>,
    tie_word_embeddings: Option<bool>,
    scale_attn_weights: Option<bool>,
    scale_attn_by_inverse_layer_idx: Option<bool>,
    add_cross_attention: Option<bool>,
}

/// The config of a `config.json` (`json`) of `model_type` `gpt2`.
fn gpt2_config(json: &Value) -> Result<Gpt2Config, String> {
    let c: HfGpt2 = from_json(json)?;
    for (key, got, want) in [
        ("scale_attn_weights", c.scale_attn_weights, true),
        (
            "scale_attn_by_inverse_layer_idx",
            c.scale_attn_by_inverse_layer_idx,
            false,
        ),
        ("add_cross_attention", c.add_cross_attention, false),
    ] {
        if got.unwrap_or(want) != want {
            return Err(format!("key `{key}`: {} is not implemented", !want));
        }
    }
    Ok(Gpt2Config {
        vocab_size: c.vocab_size,
        n_positions: c.n_positions,
        n_embd: c.n_embd,
        n_layer: c.n_layer,
        n_head: c.n_head,
        n_inner: c.n_inner.unwrap_or(0),
        layer_norm_epsilon: c.layer_norm_epsilon.unwrap_or(1e-5),
        activation_function: c.activation_function.unwrap_or(Gpt2Activation::GeluTanh),
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(true),
    })
}

/// The `config.json` `transformers` reads for `c`, its weights in float32.
fn config_json(c: &Gpt2Config) -> Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.n_positions,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": if c.n_inner == 0 { Value::Null } else { c.n_inner.into() },
        "layer_norm_epsilon": c.layer_norm_epsilon,
        "activation_function": match c.activation_function {
            Gpt2Activation::GeluTanh => "gelu_new",
            Gpt2Activation::Gelu => "gelu",
            Gpt2Activation::Relu => "relu",
        },
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": c.tie_word_embeddings,
        "dtype": "float32",
    })
}

/// The prefix the weight files may lack, and the tensors left out on purpose (the attention
/// mask buffers, a tied head's copy).
fn naming(c: &Gpt2Config) -> HfNaming {
    let tied = c.tie_word_embeddings;
    HfNaming {
        remap: KeyRemapper::new()
            .add_pattern(r"^(wte|wpe|h|ln_f)\.", "transformer.$1.")
            .expect("a valid pattern"),
        ignored: Box::new(move |name: &str| {
            name.ends_with(".attn.bias")
                || name.ends_with(".attn.masked_bias")
                || (tied && name == "lm_head.weight")
        }),
    }
}
