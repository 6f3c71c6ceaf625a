//! `[export]`: a run's final weights as `model.bpk` and `model.safetensors`, LoRA adapters
//! folded into their base weights (the files load into the plain model), the safetensors in
//! kiln's or PyTorch's names and layouts, and the adapters alone on request.

use std::path::Path;

use burn::module::Module;
use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot, SafetensorsStore};
use kiln_models::load::{SAFETENSORS_FILE, WEIGHTS_FILE};

use crate::config::{ExportConfig, WeightsFormat, one_line};
use crate::error::{Error, Result};

/// The file of the adapters alone (`export.adapters = true`).
pub const ADAPTERS_FILE: &str = "adapters.safetensors";

/// Writes `model`'s final weights into `run_dir`, each file atomically: `model.bpk` (kiln's)
/// and `model.safetensors` (in `export.format`), adapters folded in; with `export.adapters`
/// also `adapters.safetensors`, the factors alone under their paths (`….weight.lora.a`).
pub fn export<M: Module + ModuleSnapshot>(
    run_dir: &Path,
    model: &M,
    export: &ExportConfig,
) -> Result<()> {
    if export.adapters {
        let adapters = super::tune::param_infos(model)
            .iter()
            .filter(|p| is_adapter(&p.path))
            .count();
        if adapters == 0 {
            return Err(Error::config(
                "key `export.adapters`: the model has no LoRA adapters to write \
                 ([finetune.lora] is not set)"
                    .to_string(),
            ));
        }
        let tmp = run_dir.join(format!(".{ADAPTERS_FILE}.tmp"));
        let mut store = SafetensorsStore::from_file(&tmp)
            .overwrite(true)
            .with_predicate(|path, _| is_adapter(path));
        save(model, &mut store, &tmp, &run_dir.join(ADAPTERS_FILE))?;
    }
    // `materialize` folds every adapter into its base (`base + scale · a b`) and drops it.
    let merged = model.clone().materialize();
    let tmp = run_dir.join(format!(".{WEIGHTS_FILE}.tmp"));
    merged
        .clone()
        .save_file(&tmp)
        .map_err(|e| Error::checkpoint(format!("{}: {}", tmp.display(), one_line(&e))))?;
    std::fs::rename(&tmp, run_dir.join(WEIGHTS_FILE)).map_err(|e| Error::io(run_dir, e))?;
    let tmp = run_dir.join(format!(".{SAFETENSORS_FILE}.tmp"));
    let mut store = SafetensorsStore::from_file(&tmp).overwrite(true);
    if export.format == WeightsFormat::Pytorch {
        store = store.with_to_adapter(BurnToPyTorchAdapter);
    }
    save(&merged, &mut store, &tmp, &run_dir.join(SAFETENSORS_FILE))
}

/// Whether `path` is a LoRA factor's.
fn is_adapter(path: &str) -> bool {
    path.contains(".lora.")
}

/// `model` into `store` (writing `tmp`), then `tmp` renamed to `file`.
fn save<M: ModuleSnapshot>(
    model: &M,
    store: &mut SafetensorsStore,
    tmp: &Path,
    file: &Path,
) -> Result<()> {
    model
        .save_into(store)
        .map_err(|e| Error::checkpoint(format!("{}: {}", tmp.display(), one_line(&e))))?;
    std::fs::rename(tmp, file).map_err(|e| Error::io(file, e))
}
