//! A model directory's `config.json`: read into the `[model]` section of its family (see
//! [`ModelSection::from_hf_json`]: the registry picks the family by `model_type`, the family
//! reads the rest), or kept as a checkpoint wrote it.

use std::path::Path;

use serde_json::Value;

use crate::registry::ModelSection;

/// Reads `dir/config.json`: the `[model]` section of its family, `kind` set to it.
pub fn read_config(dir: &Path) -> Result<ModelSection, String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: cannot read it: {e}", path.display()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    parse_config(&json).map_err(|e| format!("{}: {e}", path.display()))
}

/// The `[model]` section a `config.json`'s value describes.
pub fn parse_config(json: &Value) -> Result<ModelSection, String> {
    ModelSection::from_hf_json(json)
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
