//! With `export.format = "hf"` and `export.adapters`: the LoRA adapters alone as the `peft`
//! package writes them, in `hf-adapter/` of the run — `adapter_model.safetensors` and
//! `adapter_config.json` — to load onto the checkpoint the run started from
//! (`PeftModel.from_pretrained(base, DIR)`).
//!
//! Burn's factors and PEFT's are the same product in transposed layouts: a weight `[in, out]`
//! becomes `base + (alpha / r) · a b` with `a [in, r]`, `b [r, out]`; PEFT's `lora_A.weight`
//! is `[r, in]` and `lora_B.weight` `[out, r]`, its update `(alpha / r) · B A` on the
//! `[out, in]` weight. So `A = aᵀ`, `B = bᵀ`, and the same `r` and `lora_alpha`. GPT-2's
//! `Conv1D` keeps `[in, out]` weights: its factors are the same, with `fan_in_fan_out = true`.

use std::collections::BTreeMap;
use std::path::Path;

use burn::store::ModuleSnapshot;
use burn::tensor::DType;

use crate::config::LoraConfig;
use crate::error::{Error, Result};
use crate::files::write_atomic;

/// The PEFT adapter directory inside a run.
pub const PEFT_DIR: &str = "hf-adapter";

/// `model`'s LoRA factors into `run_dir/hf-adapter` (`hf_dir/config.json`, written already,
/// names the family); `base` is the checkpoint the adapters go onto, recorded as
/// `base_model_name_or_path`.
pub(super) fn write<M: ModuleSnapshot>(
    run_dir: &Path,
    hf_dir: &Path,
    model: &M,
    lora: &LoraConfig,
    base: Option<&Path>,
) -> Result<()> {
    let config_path = hf_dir.join("config.json");
    let hf_config: serde_json::Value = std::fs::read_to_string(&config_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| Error::checkpoint(format!("{}: not readable", config_path.display())))?;
    let conv1d = kiln_models::hf::parse_config(&hf_config)
        .map_err(|e| Error::checkpoint(format!("{}: {e}", config_path.display())))?
        .conv1d_projections();
    // PEFT's names and `[r, in]` / `[out, r]` data, sorted by name.
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    let mut modules = Vec::new();
    for t in model.collect(None, None, true) {
        let (module, factor) = match t.name.strip_suffix(".weight.lora.a") {
            Some(m) => (m.to_string(), "lora_A"),
            None => match t.name.strip_suffix(".weight.lora.b") {
                Some(m) => (m.to_string(), "lora_B"),
                None => continue,
            },
        };
        let name = t.name.clone();
        let bad = |why: String| Error::checkpoint(format!("adapter {name}: {why}"));
        let (_, dtype, shape, _, bytes) = t.into_parts().map_err(|e| bad(e.to_string()))?;
        if dtype != DType::F32 || shape.len() != 2 {
            return Err(bad(format!(
                "{dtype:?} {:?}: expected a 2-D float32 factor",
                shape.as_slice()
            )));
        }
        let (rows, cols) = (shape[0], shape[1]);
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut transposed = vec![0.0f32; values.len()];
        for i in 0..rows {
            for j in 0..cols {
                transposed[j * rows + i] = values[i * cols + j];
            }
        }
        if factor == "lora_A" {
            modules.push(module.clone());
        }
        tensors.insert(
            format!("base_model.model.{module}.{factor}.weight"),
            (vec![cols, rows], transposed),
        );
    }
    let dir = run_dir.join(PEFT_DIR);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    write_atomic(
        &dir.join("adapter_model.safetensors"),
        &safetensors(&tensors),
    )?;
    // The adapted modules exactly: a regular expression PEFT matches against whole names.
    let escaped: Vec<String> = modules.iter().map(|m| m.replace('.', "\\.")).collect();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": conv1d,
        "target_modules": format!("^({})$", escaped.join("|")),
        "use_rslora": false,
        "inference_mode": true,
        "base_model_name_or_path": base.map(|b| b.display().to_string()),
    });
    write_atomic(
        &dir.join("adapter_config.json"),
        serde_json::to_string_pretty(&config)
            .expect("a config serialises")
            .as_bytes(),
    )
}

/// A SafeTensors file of float32 tensors (metadata `format = "pt"`), in name order.
fn safetensors(tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, (shape, data)) in tensors {
        let end = offset + 4 * data.len();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&header).expect("a header serialises");
    // The data starts 8-byte aligned: the header padded with spaces.
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len() + offset);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (_, data) in tensors.values() {
        for v in data {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}
