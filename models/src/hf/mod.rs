//! The Hugging Face layout, read in one place: a model directory's `config.json` (the
//! architecture, transformers 4's `rope_theta`/`rope_scaling` and 5's `rope_parameters`),
//! its weights (`model.safetensors`, or shards listed by `model.safetensors.index.json`; f32,
//! bf16 or f16, cast to f32; names with or without the `model.`/`transformer.` prefix), into
//! [`Llama`](crate::llama::Llama) or [`Gpt2`](crate::gpt2::Gpt2). What kiln does not implement is refused in one line naming the file
//! and the key.

mod config;
pub(crate) mod keys;
mod weights;

pub use config::{HfArchitecture, config_json, config_json_from, parse_config, read_config};
pub use weights::{HfLoaded, is_model_dir, load_gpt2, load_into, load_llama, weight_files};
