//! The Hugging Face layout, read in one place: a model directory's `config.json` (the
//! architecture, transformers 4's `rope_theta`/`rope_scaling` and 5's `rope_parameters`),
//! its weights (`model.safetensors`, or shards listed by `model.safetensors.index.json`; f32,
//! bf16 or f16, cast to f32; names with or without the `model.`/`transformer.` prefix), into
//! [`Llama`] or [`Gpt2`]. What kiln does not implement is refused in one line naming the file
//! and the key.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::prelude::*;
use burn::store::{
    FloatCastAdapter, KeyRemapper, ModuleAdapter, ModuleSnapshot, PyTorchToBurnAdapter,
    SafetensorsStore,
};
use burn::tensor::DType;
use serde_json::Value;

use crate::gpt2::{Gpt2, Gpt2Activation, Gpt2Config};
use crate::llama::{Llama, LlamaConfig, RopeScaling};

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

/// What a load read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HfLoaded {
    /// The weight files read, in order.
    pub files: Vec<PathBuf>,
    /// Tensors loaded.
    pub tensors: usize,
    /// The files' tensors left out on purpose: GPT-2's attention mask buffers, a tied head's
    /// copy, old rotary frequency buffers.
    pub ignored: Vec<String>,
}

/// The weight files of `dir`: `model.safetensors`, or every shard its
/// `model.safetensors.index.json` lists (a missing shard refused, naming it).
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(format!(
            "{}: no model.safetensors or model.safetensors.index.json (kiln reads Hugging Face \
             SafeTensors weights)",
            dir.display()
        ));
    }
    let text = std::fs::read_to_string(&index)
        .map_err(|e| format!("{}: cannot read it: {e}", index.display()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", index.display()))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| format!("{}: key `weight_map`: missing", index.display()))?;
    let mut files: Vec<String> = Vec::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            format!(
                "{}: key `weight_map.{name}`: expected a file name",
                index.display()
            )
        })?;
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let path = dir.join(&f);
            if path.is_file() {
                Ok(path)
            } else {
                Err(format!(
                    "{}: the shard {f} it lists is missing from {}",
                    index.display(),
                    dir.display()
                ))
            }
        })
        .collect()
}

/// One tensor that did not fit, in words.
fn misfit(e: &burn::store::ApplyError) -> String {
    use burn::store::ApplyError as E;
    match e {
        E::ShapeMismatch {
            path,
            expected,
            found,
        } => format!(
            "{path}: shape {:?} in the file, {:?} in the model (Burn's layout)",
            found.as_slice(),
            expected.as_slice()
        ),
        E::DTypeMismatch {
            path,
            expected,
            found,
        } => format!("{path}: {found:?} in the file, {expected:?} in the model"),
        E::AdapterError { path, message } | E::LoadError { path, message } => {
            format!("{path}: {message}")
        }
    }
}

/// Which of a file's tensors are left out on purpose.
type Ignored = Box<dyn Fn(&str) -> bool>;

/// How a family's weight files name their tensors: the prefix the files may lack, and the
/// tensors left out on purpose (GPT-2's mask buffers, a tied head's copy, old rotary
/// frequency buffers).
fn naming(arch: &HfArchitecture) -> (KeyRemapper, Ignored) {
    match arch {
        HfArchitecture::Llama(c) => {
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
        HfArchitecture::Gpt2(c) => {
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
    }
}

/// A Llama-family model of `config` on `device` with the weights of `dir`.
pub fn load_llama(
    dir: &Path,
    config: &LlamaConfig,
    device: &Device,
) -> Result<(Llama, HfLoaded), String> {
    let (remap, ignore) = naming(&HfArchitecture::Llama(config.clone()));
    load_weights(config.init(device), dir, remap, &*ignore)
}

/// GPT-2 of `config` on `device` with the weights of `dir`.
pub fn load_gpt2(
    dir: &Path,
    config: &Gpt2Config,
    device: &Device,
) -> Result<(Gpt2, HfLoaded), String> {
    let (remap, ignore) = naming(&HfArchitecture::Gpt2(config.clone()));
    load_weights(config.init(device), dir, remap, &*ignore)
}

/// `model` — built as `dir`'s `config.json` describes, by whoever calls — with `dir`'s
/// weights, named as its family names them.
pub fn load_into<M: Module>(model: M, dir: &Path) -> Result<(M, HfLoaded), String> {
    let (remap, ignore) = naming(&read_config(dir)?);
    load_weights(model, dir, remap, &*ignore)
}

/// Whether `dir` is a Hugging Face model directory: a `config.json` beside SafeTensors
/// weights (one file or an index).
pub fn is_model_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file()
        && (dir.join("model.safetensors").is_file()
            || dir.join("model.safetensors.index.json").is_file())
}

/// `model` with every tensor of `dir`'s weight files, renamed by `remap`: Linear weights
/// transposed from PyTorch's `[out, in]`, norm weights and biases to Burn's names, floats cast
/// to f32. Every parameter of the model must be found, and every tensor of the files used or
/// `ignore`d.
fn load_weights<M: Module>(
    mut model: M,
    dir: &Path,
    remap: KeyRemapper,
    ignore: &dyn Fn(&str) -> bool,
) -> Result<(M, HfLoaded), String> {
    let files = weight_files(dir)?;
    let mut applied = BTreeSet::new();
    let mut unused = BTreeSet::new();
    let mut ignored = Vec::new();
    for file in &files {
        let adapter = PyTorchToBurnAdapter.chain(FloatCastAdapter::to(DType::F32));
        let mut store = SafetensorsStore::from_file(file)
            .with_from_adapter(adapter)
            .remap(remap.clone())
            .allow_partial(true)
            .validate(false);
        let result = model
            .load_from(&mut store)
            .map_err(|e| format!("{}: cannot read it: {e}", file.display()))?;
        if !result.errors.is_empty() {
            let shown: Vec<String> = result.errors.iter().take(3).map(misfit).collect();
            return Err(format!(
                "{}: {} tensors do not fit the model its config.json describes ({}{})",
                file.display(),
                result.errors.len(),
                shown.join("; "),
                if result.errors.len() > 3 { "; …" } else { "" }
            ));
        }
        applied.extend(result.applied);
        for name in result.unused {
            if ignore(&name) {
                ignored.push(name);
            } else {
                unused.insert(name);
            }
        }
    }
    let missing: Vec<String> = crate::param_paths(&model)
        .into_iter()
        .filter(|p| !applied.contains(p))
        .collect();
    let quote = |names: &mut dyn Iterator<Item = &String>| {
        let all: Vec<&String> = names.collect();
        let shown: Vec<&str> = all.iter().take(3).map(|s| s.as_str()).collect();
        let more = all.len().saturating_sub(3);
        format!(
            "{}{}",
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        )
    };
    if !missing.is_empty() {
        return Err(format!(
            "{}: {} of the model's tensors are not in its weights ({})",
            dir.display(),
            missing.len(),
            quote(&mut missing.iter())
        ));
    }
    if !unused.is_empty() {
        return Err(format!(
            "{}: {} tensors of its weights have no place in the model its config.json describes \
             ({})",
            dir.display(),
            unused.len(),
            quote(&mut unused.iter())
        ));
    }
    Ok((
        model,
        HfLoaded {
            files,
            tensors: applied.len(),
            ignored,
        },
    ))
}
