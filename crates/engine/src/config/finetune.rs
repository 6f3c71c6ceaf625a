//! `[finetune]` and `[export]`: which parts of a model train (frozen patterns, LoRA adapters)
//! and how its final weights are written.

use serde::{Deserialize, Serialize};

use super::names::bad;
use crate::error::Result;

/// `[finetune]`: parts of the model that do not train, and LoRA adapters. Default: every
/// parameter trains.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FinetuneConfig {
    /// Module path patterns whose parameters are frozen: no gradient, no optimizer state, no
    /// bytes in a gradient collective (`["wte", "blocks.0.*"]`). A pattern is the module path
    /// as the exported names read it, segments joined by `.`; `*` within a segment matches any
    /// text, `**` any number of segments; a pattern names a module and everything inside it.
    pub freeze: Vec<String>,
    /// LoRA adapters (`[finetune.lora]`); absent: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
}

/// `[finetune.lora]`: low-rank adapters on the 2-D weights of the matching modules; every other
/// parameter of the model is frozen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// Rank of each adapter (`a: [in, rank]`, `b: [rank, out]`).
    pub rank: usize,
    /// The adapter's product is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Module path patterns whose 2-D weights get an adapter (`["blocks.*.attn.qkv"]`).
    pub targets: Vec<String>,
    /// QLoRA: the frozen bases of the adapted weights quantised, `"q8"` (8-bit) or `"q4"`
    /// (4-bit), symmetric; absent: not quantised. Refused in one line where the device's
    /// backend cannot run it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quantize: Option<QuantBits>,
}

/// The bits of QLoRA's quantised bases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QuantBits {
    /// 8-bit symmetric.
    Q8,
    /// 4-bit symmetric.
    Q4,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 8,
            alpha: 16.0,
            targets: Vec::new(),
            quantize: None,
        }
    }
}

impl FinetuneConfig {
    /// Whether nothing is frozen and no adapter attached.
    pub fn is_default(&self) -> bool {
        self == &Self::default()
    }

    /// Rejects patterns that cannot be module paths and adapters that cannot be built.
    pub fn check(&self) -> Result<()> {
        for (i, p) in self.freeze.iter().enumerate() {
            check_pattern(&format!("finetune.freeze[{i}]"), p)?;
        }
        if let Some(lora) = &self.lora {
            if lora.rank == 0 {
                return bad("finetune.lora.rank", "must be at least 1".into());
            }
            if !(lora.alpha.is_finite() && lora.alpha > 0.0) {
                return bad(
                    "finetune.lora.alpha",
                    format!("must be a positive number, got {}", lora.alpha),
                );
            }
            if lora.targets.is_empty() {
                return bad(
                    "finetune.lora.targets",
                    "names no module: give the patterns of the modules whose weights get \
                     adapters, e.g. [\"blocks.*.attn.qkv\"]"
                        .into(),
                );
            }
            for (i, p) in lora.targets.iter().enumerate() {
                check_pattern(&format!("finetune.lora.targets[{i}]"), p)?;
            }
        }
        Ok(())
    }
}

/// A pattern is segments of letters, digits, `_`, `-` and `*`, joined by `.`.
fn check_pattern(key: &str, pattern: &str) -> Result<()> {
    let ok = !pattern.is_empty()
        && pattern.split('.').all(|s| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '*'))
        });
    if ok {
        return Ok(());
    }
    bad(
        key,
        format!(
            "{pattern:?} is not a module path pattern (segments of letters, digits, `_`, `-` \
             and `*`, joined by `.`: \"blocks.*.attn.qkv\")"
        ),
    )
}

/// How `model.safetensors` names and lays out the final weights (`export.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExportFormat {
    /// kiln's and Burn's: the module's paths, linear weights `[in, out]`.
    #[default]
    Kiln,
    /// PyTorch's `state_dict`: linear weights `[out, in]`, normalisation `weight`/`bias`.
    Pytorch,
    /// Also a Hugging Face model directory, `hf/` in the run: `config.json`,
    /// `model.safetensors` (or shards over `export.shard_mb` with their index; the tied head
    /// left out), `tokenizer.json` — what `transformers`' `from_pretrained` loads (the
    /// built-in `llama`, `gpt2` and `hf` models).
    Hf,
}

/// `[export]`: the final weights a run writes (`model.bpk`, `model.safetensors`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExportConfig {
    /// Names and layouts of `model.safetensors`: `"kiln"` (the model's paths, linear weights
    /// `[in, out]`), `"pytorch"` (`[out, in]`, normalisation `weight`/`bias`), which loads
    /// into the equivalent PyTorch module with `load_state_dict(..., strict=True)`, or `"hf"`
    /// (kiln's files and a Hugging Face directory `hf/`). `model.bpk` is always kiln's.
    /// Default `"kiln"`.
    pub format: ExportFormat,
    /// Also write the LoRA adapters alone (`adapters.safetensors`); the model files hold them
    /// folded into the base weights. Default false.
    pub adapters: bool,
    /// With `format = "hf"`: the largest weights file, in MiB; more weights go into shards
    /// listed by `model.safetensors.index.json`. Default 5000 (transformers' 5 GB).
    pub shard_mb: f64,
}

impl Default for ExportConfig {
    fn default() -> Self {
        Self {
            format: ExportFormat::Kiln,
            adapters: false,
            shard_mb: 5000.0,
        }
    }
}

impl ExportConfig {
    /// Whether the export is kiln's, without adapters.
    pub fn is_default(&self) -> bool {
        self == &Self::default()
    }

    /// Rejects a shard size that is not a positive number of MiB.
    pub fn check(&self) -> Result<()> {
        if !(self.shard_mb > 0.0 && self.shard_mb.is_finite()) {
            return bad(
                "export.shard_mb",
                format!("{} is not a size: expected MiB above 0", self.shard_mb),
            );
        }
        Ok(())
    }
}
