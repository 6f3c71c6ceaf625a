//! Models for kiln (ConvNet, MLP, GPT, and the Hugging Face families Llama, GPT-2 and Phi-3,
//! listed in [`registry`]): plain Burn modules with no parallelism imports.
//!
//! Every model implements [`TrainStep`] ("batch in, loss and outputs out") so that kiln's
//! trainer can drive it, and exposes an ordinary `forward` for inference. A model is described
//! by a serialisable [`ModelSpec`] (architecture + input shape), which is all another Rust
//! program needs, together with a weights file, to rebuild and run it: see [`load`].
#![deny(missing_docs)]

pub mod blocks;
pub mod convnet;
pub mod cube;
mod decoder;
pub mod draw;
pub mod family;
pub mod fused;
pub mod gpt;
pub mod gpt2;
mod gqa;
pub mod hf;
pub mod llama;
pub mod lm;
pub mod load;
pub mod metric;
pub mod mlp;
pub mod modules;
pub mod phi3;
pub mod registry;
pub mod rope;
pub mod step;
pub mod tp;

pub use blocks::{Activation, BlockStack};
pub use convnet::{ConvNet, ConvNetConfig};
pub use family::Family;
pub use gpt::{Gpt, GptConfig};
pub use gpt2::{Gpt2, Gpt2Config};
pub use hf::HfLoaded;
pub use llama::{Llama, LlamaConfig};
pub use lm::{CausalLm, IGNORE, KvCache, Sampling, TokenBatch};
pub use load::{
    Classifier, LoadError, ModelSpec, load_classifier, load_family_run, load_lm_run, load_run,
    read_spec, save_safetensors,
};
pub use metric::{Combine, SetMetric};
pub use mlp::{Mlp, MlpConfig};
pub use modules::{linear_rows, materialized, on_rows, param_ids, param_paths, with_rng};
pub use phi3::{Phi3, Phi3Config};
pub use registry::{FamilyVisitor, LanguageModel, ModelKind, ModelSection, Registered};
pub use step::{ImageBatch, InputSpec, ParamGroup, StepOutput, TrainStep, classification_output};
