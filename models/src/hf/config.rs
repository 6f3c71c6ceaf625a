//! A model directory's `config.json`: read into an [`HfArchitecture`] (transformers 4's
//! `rope_theta`/`rope_scaling` and 5's `rope_parameters`), and written back for one.

use std::path::Path;

use serde_json::Value;

use crate::gpt2::{Gpt2Activation, Gpt2Config};
use crate::llama::{LlamaConfig, RopeScaling};

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
        "llama" | "mistral" | "qwen2" => llama_config(kind, &c).map(HfArchitecture::Llama),
        "gpt2" => gpt2_config(&c).map(HfArchitecture::Gpt2),
        other => Err(format!(
            "key `model_type`: {other:?} is an architecture kiln does not have (it reads llama, \
             mistral, qwen2 and gpt2)"
        )),
    }
}

/// A `config.json`'s keys, read with one-line errors.
struct Keys<'a>(&'a Value);

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize, String> {
        self.opt_usize(key)?
            .ok_or_else(|| format!("key `{key}`: missing (a whole number)"))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| format!("key `{key}`: expected a whole number, got {v}")),
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| format!("key `{key}`: expected a number, got {v}")),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| format!("key `{key}`: expected true or false, got {v}")),
        }
    }

    fn str_or<'b>(&'b self, key: &str, default: &'b str) -> Result<&'b str, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| format!("key `{key}`: expected a string, got {v}")),
        }
    }
}

fn llama_config(kind: &str, c: &Keys) -> Result<LlamaConfig, String> {
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

fn gpt2_config(c: &Keys) -> Result<Gpt2Config, String> {
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

/// The `config.json` `transformers` reads for `arch`, its weights in float32: Llama's (Qwen2's
/// where the biases are on q, k and v only, Mistral's with a sliding window) or GPT-2's.
pub fn config_json(arch: &HfArchitecture) -> Value {
    match arch {
        HfArchitecture::Llama(c) => {
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
                    rope["original_max_position_embeddings"] =
                        (*original_max_position_embeddings).into();
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
        HfArchitecture::Gpt2(c) => serde_json::json!({
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
        }),
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
