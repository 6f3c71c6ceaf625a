//! The Hugging Face layout, read in one place: a model directory's `config.json` (its family
//! picked by `model_type` from the registry, the rest read by the family), its weights
//! (`model.safetensors`, or shards listed by `model.safetensors.index.json`; f32, bf16 or f16,
//! cast to f32; names with or without the `model.`/`transformer.` prefix, as the family names
//! them). What kiln does not implement is refused in one line naming the file and the key.

mod config;
mod weights;

pub use config::{config_json_from, parse_config, read_config};
pub use weights::{HfLoaded, is_model_dir, load, load_into, weight_files};
