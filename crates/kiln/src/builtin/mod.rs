//! kiln's own `train` program: the built-in workloads — an image classifier ([`image`]) and a
//! language model on a text ([`text`]: kiln's GPT, Llama, GPT-2, a Hugging Face checkpoint) —
//! with their `[model]` and `[data]` sections, built on
//! [`App`](crate::App) exactly as a program of one's own is. The engine below knows none of
//! this: it trains whatever [`Workload`](kiln_engine::trainer::Workload) it is handed.
//!
//! `[model]` is `kiln_models::ModelSection` (`kind` = `convnet`, `mlp`, `gpt`, `llama`, `gpt2`
//! or `hf`); `[data]` is
//! [`DataConfig`]. The `train` binary is
//! ```ignore
//! kiln::App::new("train", "…")
//!     .recipe(kiln::builtin::RECIPE)
//!     .command("sample", "…", kiln::builtin::talk::sample)
//!     .command("chat", "…", kiln::builtin::talk::chat)
//!     .command("answer", "…", kiln::builtin::answers::answer)
//!     .main_with(kiln::builtin::check, kiln::builtin::train)
//! ```

pub mod answers;
mod config;
pub mod folder;
pub mod image;
pub mod instruct;
mod launch;
pub mod sequences;
pub mod table;
pub mod talk;
pub mod text;
mod vocab;

pub use config::{
    Config, DataConfig, DatasetKind, FieldNames, Overlong, RECIPE, RECIPE_ORIGIN, TrainOn, check,
    load,
};

use kiln_models::ModelKind;

use kiln_engine::error::Result;
use kiln_engine::run::{RunOptions, RunResult};

/// Trains the workload `config` describes: an image classifier or a GPT on text.
pub fn train(config: &Config, options: &RunOptions) -> Result<RunResult> {
    match config.model.kind {
        kind if kind.is_language_model() => match config.data.dataset {
            DatasetKind::Instruct | DatasetKind::Chat => instruct::train(config, options),
            _ => text::train(config, options),
        },
        _ if config.data.dataset == DatasetKind::Csv => table::train(config, options),
        ModelKind::Convnet | ModelKind::Mlp if config.data.dataset == DatasetKind::ImageFolder => {
            folder::train(config, options)
        }
        _ => image::train(config, options),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn load_set(overrides: &[&str]) -> Result<Config> {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        load(None, &o)
    }

    #[test]
    fn overrides_reach_the_builtin_sections() {
        let c = load_set(&["data.dir=/some/path", "model.mlp.hidden=[64]"]).unwrap();
        assert_eq!(c.data.dir.as_deref(), Some(Path::new("/some/path")));
        assert_eq!(c.model.mlp.hidden, vec![64]);
    }

    #[test]
    fn builtin_sections_refuse_what_cannot_work() {
        for (o, key) in [
            ("data.train_fraction=1", "data.train_fraction"),
            ("data.eval_windows=0", "data.eval_windows"),
            ("data.dataset=\"text\"", "data.dataset"),
            ("model.kid=1", "model.kid"),
        ] {
            let e = load_set(&[o]).unwrap_err().to_string();
            assert!(e.contains(key), "{o}: {e}");
        }
    }
}
