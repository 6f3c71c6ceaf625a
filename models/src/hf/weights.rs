//! A model directory's weights (`model.safetensors`, or the shards its index lists; f32, bf16
//! or f16, cast to f32; names with or without the `model.`/`transformer.` prefix) into a
//! model of a registered family.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::prelude::*;
use burn::store::{
    FloatCastAdapter, ModuleAdapter, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore,
};
use burn::tensor::DType;
use serde_json::Value;

use super::config::read_config;
use crate::family::{Family, HfNaming};

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

/// A model of family `M` and `config` on `device` with the weights of `dir`.
pub fn load<M: Family>(
    dir: &Path,
    config: &M::Config,
    device: &Device,
) -> Result<(M, HfLoaded), String> {
    load_weights(M::init(config, device), dir, M::hf_naming(config))
}

/// `model` — built as `dir`'s `config.json` describes, by whoever calls — with `dir`'s
/// weights, named as its family names them.
pub fn load_into<M: Module>(model: M, dir: &Path) -> Result<(M, HfLoaded), String> {
    load_weights(model, dir, read_config(dir)?.hf_naming())
}

/// Whether `dir` is a Hugging Face model directory: a `config.json` beside SafeTensors
/// weights (one file or an index).
pub fn is_model_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file()
        && (dir.join("model.safetensors").is_file()
            || dir.join("model.safetensors.index.json").is_file())
}

/// `model` with every tensor of `dir`'s weight files, renamed as `naming` says: Linear weights
/// transposed from PyTorch's `[out, in]`, norm weights and biases to Burn's names, floats cast
/// to f32. Every parameter of the model must be found, and every tensor of the files used or
/// left out on purpose.
fn load_weights<M: Module>(
    mut model: M,
    dir: &Path,
    naming: HfNaming,
) -> Result<(M, HfLoaded), String> {
    let HfNaming {
        remap,
        ignored: ignore,
    } = naming;
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
    let missing: Vec<String> = crate::modules::param_paths(&model)
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
