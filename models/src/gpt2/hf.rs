//! GPT-2 in the Hugging Face layout: its `config.json` (`model_type` `gpt2`) read and written
//! back, and how its weight files name their tensors.

use burn::store::KeyRemapper;
use serde_json::Value;

use super::{Gpt2Activation, Gpt2Config};
use crate::hf::keys::{Ignored, Keys};

/// The config of a `config.json` of `model_type` `gpt2`.
pub(crate) fn gpt2_config(c: &Keys) -> Result<Gpt2Config, String> {
    let activation = match c.str_or("activation_function", "gelu_new")? {
        "gelu_new" | "gelu_pytorch_tanh" => Gpt2Activation::GeluTanh,
        "gelu" => Gpt2Activation::Gelu,
        "relu" => Gpt2Activation::Relu,
        other => {
            return Err(format!(
                "key `activation_function`: {other:?} is not implemented (kiln has gelu_new, \
                 gelu_pytorch_tanh, gelu and relu)"
            ));
        }
    };
    for (key, want) in [
        ("scale_attn_weights", true),
        ("scale_attn_by_inverse_layer_idx", false),
        ("add_cross_attention", false),
    ] {
        if c.bool_or(key, want)? != want {
            return Err(format!("key `{key}`: {} is not implemented", !want));
        }
    }
    Ok(Gpt2Config {
        vocab_size: c.usize("vocab_size")?,
        n_positions: c.usize("n_positions")?,
        n_embd: c.usize("n_embd")?,
        n_layer: c.usize("n_layer")?,
        n_head: c.usize("n_head")?,
        n_inner: c.opt_usize("n_inner")?.unwrap_or(0),
        layer_norm_epsilon: c.f64_or("layer_norm_epsilon", 1e-5)?,
        activation_function: activation,
        tie_word_embeddings: c.bool_or("tie_word_embeddings", true)?,
    })
}

/// The `config.json` `transformers` reads for `c`, its weights in float32.
pub(crate) fn config_json(c: &Gpt2Config) -> Value {
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
pub(crate) fn naming(c: &Gpt2Config) -> (KeyRemapper, Ignored) {
    let tied = c.tie_word_embeddings;
    (
        KeyRemapper::new()
            .add_pattern(r"^(wte|wpe|h|ln_f)\.", "transformer.$1.")
            .expect("a valid pattern"),
        Box::new(move |name: &str| {
            name.ends_with(".attn.bias")
                || name.ends_with(".attn.masked_bias")
                || (tied && name == "lm_head.weight")
        }),
    )
}
