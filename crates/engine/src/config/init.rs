//! `[init]`: the weights a new run starts from, from a file another run, Burn or PyTorch wrote.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::names::bad;
use crate::error::Result;

/// How the names and layouts of a weights file read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WeightsFormat {
    /// kiln's and Burn's own: the module's paths, linear weights `[in, out]`.
    #[default]
    Kiln,
    /// PyTorch's `state_dict`: linear weights `[out, in]` (transposed on load), normalisation
    /// `weight`/`bias` for Burn's `gamma`/`beta`.
    Pytorch,
}

/// `[init]`: a new run's starting weights. Default: none (the model's own initialisation).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InitConfig {
    /// A run directory (its exported `model.safetensors`, else `model.bpk`), a `.bpk`, a
    /// `.safetensors`, or a PyTorch `.pt`/`.pth` state dict. Absent: no file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<PathBuf>,
    /// `"kiln"` (the default) or `"pytorch"`.
    pub format: WeightsFormat,
    /// Renames applied to the file's names before they meet the model's, in order: pairs of
    /// a regular expression and its replacement (`[["^transformer\\.", ""]]`).
    pub rename: Vec<(String, String)>,
    /// Loads what matches and reports the rest in the start-up table, instead of refusing a
    /// file with missing, unexpected or mis-shaped tensors. Default false.
    pub partial: bool,
}

impl InitConfig {
    /// Whether no file is set (and nothing else).
    pub fn is_default(&self) -> bool {
        self == &Self::default()
    }

    /// Rejects renames that are not regular expressions, and settings without a file.
    pub fn check(&self) -> Result<()> {
        for (i, (pattern, _)) in self.rename.iter().enumerate() {
            if let Err(e) = burn::store::KeyRemapper::new().add_pattern(pattern, "") {
                let e = e
                    .to_string()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                return bad(
                    &format!("init.rename[{i}]"),
                    format!("{pattern:?} is not a regular expression: {e}"),
                );
            }
        }
        if self.from.is_none() && (!self.rename.is_empty() || self.partial) {
            return bad(
                "init.rename",
                "renames and partial loading apply to init.from, which is not set".into(),
            );
        }
        Ok(())
    }
}
