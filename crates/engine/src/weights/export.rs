//! `[export]`: a run's final weights as `model.bpk` and `model.safetensors`, LoRA adapters
//! folded into their base weights (the files load into the plain model), the safetensors in
//! kiln's or PyTorch's names and layouts, and the adapters alone on request.

use std::path::Path;

use burn::module::Module;
use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot, SafetensorsStore};
use kiln_models::load::{SAFETENSORS_FILE, WEIGHTS_FILE};

use crate::config::{ExportFormat, RootConfig, one_line};
use crate::error::{Error, Result};

/// The file of the adapters alone (`export.adapters = true`).
pub const ADAPTERS_FILE: &str = "adapters.safetensors";

/// Writes `model`'s final weights into `run_dir`, each file atomically: `model.bpk` (kiln's)
/// and `model.safetensors` (in `export.format`), adapters folded in; with `export.adapters`
/// also `adapters.safetensors`, the factors alone under their paths (`….weight.lora.a`).
/// With `export.format = "hf"` also the Hugging Face directory `hf/`, and with
/// `export.adapters` the PEFT adapter directory `hf-adapter/` (the run's `[finetune.lora]`
/// onto its `init.from`).
pub fn export<M: Module + ModuleSnapshot>(
    run_dir: &Path,
    model: &M,
    config: &RootConfig,
) -> Result<()> {
    let export = &config.export;
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
        if let (ExportFormat::Hf, Some(lora)) = (export.format, &config.finetune.lora) {
            let hf_dir = run_dir.join(HF_DIR);
            super::peft::write(run_dir, &hf_dir, model, lora, config.init.from.as_deref())?;
        }
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
    if export.format == ExportFormat::Pytorch {
        store = store.with_to_adapter(BurnToPyTorchAdapter);
    }
    save(&merged, &mut store, &tmp, &run_dir.join(SAFETENSORS_FILE))?;
    if export.format == ExportFormat::Hf {
        hf_weights(&run_dir.join(HF_DIR), &merged, export.shard_mb)?;
    }
    Ok(())
}

/// The Hugging Face directory inside a run (`export.format = "hf"`).
pub const HF_DIR: &str = "hf";

/// `model`'s weights as a Hugging Face checkpoint in `dir` (beside the `config.json` and
/// `tokenizer.json` the workload wrote there when the run started): PyTorch's layouts and
/// names (the tied head is no parameter, so it is left out), metadata `format = "pt"` (which
/// `transformers` requires), one `model.safetensors` or, past `shard_mb` MiB, shards
/// `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`. Each file is written
/// under a temporary name and renamed; earlier weights files of the directory are removed
/// first.
fn hf_weights<M: Module + ModuleSnapshot>(dir: &Path, model: &M, shard_mb: f64) -> Result<()> {
    if !dir.join("config.json").is_file() {
        return Err(Error::config(format!(
            "key `export.format`: \"hf\" needs the model's config.json in {}, which this \
             workload does not write (the built-in language models with a Hugging Face layout \
             do)",
            dir.display()
        )));
    }
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("model") && (name.ends_with(".safetensors") || name.ends_with(".json"))
        {
            std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
        }
    }
    // Parameters in module order, cut into shards of at most `shard_mb` MiB (one parameter
    // larger than that is a shard of its own).
    let limit = (shard_mb * 1024.0 * 1024.0) as usize;
    let mut shards: Vec<(Vec<String>, usize)> = vec![(Vec::new(), 0)];
    // Names as the adapter writes them (a norm's `gamma` is PyTorch's `weight`): the shard
    // filter matches the written names.
    for t in model.collect(None, Some(Box::new(BurnToPyTorchAdapter)), true) {
        let bytes = t.byte_len();
        let last = shards.last_mut().expect("one shard");
        if last.1 > 0 && last.1 + bytes > limit {
            shards.push((vec![t.name], bytes));
        } else {
            last.0.push(t.name);
            last.1 += bytes;
        }
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0;
    for (i, (paths, bytes)) in shards.into_iter().enumerate() {
        let name = if n == 1 {
            SAFETENSORS_FILE.to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        let file = dir.join(&name);
        let tmp = dir.join(format!(".{name}.tmp"));
        let mut store = SafetensorsStore::from_file(&tmp)
            .overwrite(true)
            .with_to_adapter(BurnToPyTorchAdapter)
            .skip_enum_variants(true)
            .metadata("format", "pt");
        // The shard holds the names collected for it (the store filters on the same names).
        for tensor in &paths {
            weight_map.insert(tensor.clone(), name.clone().into());
        }
        if n > 1 {
            store = store.with_full_paths(paths);
        }
        save(model, &mut store, &tmp, &file)?;
        total += bytes;
    }
    if n > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        crate::files::write_atomic(
            &dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)
                .expect("an index serialises")
                .as_bytes(),
        )?;
    }
    Ok(())
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
    // The store writes through a private temporary file (mode 0600): an export is for
    // sharing, so it gets the permissions of the run's other files.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o644))
            .map_err(|e| Error::io(tmp, e))?;
    }
    std::fs::rename(tmp, file).map_err(|e| Error::io(file, e))
}
