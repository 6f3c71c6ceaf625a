//! `init.from`: a file's tensors into the model, through burn-store (kiln's and Burn's
//! burnpack and SafeTensors, PyTorch's `state_dict` with its adapter), renamed as
//! `init.rename` says; what does not fit is refused in one line, or reported with
//! `init.partial`.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::store::{
    ApplyError, ApplyResult, BurnpackStore, KeyRemapper, ModuleSnapshot, PyTorchToBurnAdapter,
    PytorchStore, SafetensorsStore,
};

use crate::config::{InitConfig, WeightsFormat};
use crate::error::{Error, Result};

/// How many names of each kind a refusal quotes.
const QUOTED: usize = 3;

/// What a load took from its file, and what did not fit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Loaded {
    /// The file read.
    pub file: PathBuf,
    /// Tensors loaded into the model.
    pub applied: usize,
    /// The model's tensors the file did not have (they keep their initial values).
    pub missing: Vec<String>,
    /// The file's tensors the model has no place for.
    pub unused: Vec<String>,
    /// Tensors whose shape or dtype did not fit: `name: file [..], model [..]`.
    pub mismatched: Vec<String>,
}

impl Loaded {
    /// Whether everything fit: every tensor of the model loaded, none of the file left over.
    pub fn whole(&self) -> bool {
        self.missing.is_empty() && self.unused.is_empty() && self.mismatched.is_empty()
    }

    /// What did not fit, in one line: the first few names of each kind.
    pub fn misfits(&self) -> String {
        let kinds = [
            ("missing from the file", &self.missing),
            ("in the file and not the model", &self.unused),
            ("of another shape or dtype", &self.mismatched),
        ];
        kinds
            .iter()
            .filter(|(_, names)| !names.is_empty())
            .map(|(what, names)| {
                let shown: Vec<&str> = names.iter().take(QUOTED).map(String::as_str).collect();
                let more = names.len().saturating_sub(QUOTED);
                let more = if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                };
                format!("{} {what} ({}{more})", names.len(), shown.join(", "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The start-up table's words for it.
    pub fn describe(&self) -> String {
        let base = format!("{} tensors from {}", self.applied, self.file.display());
        if self.whole() {
            base
        } else {
            format!("{base}; partial: {}", self.misfits())
        }
    }
}

/// The file `init.from` names: the path itself, or in a run directory its exported
/// `model.safetensors` (else `model.bpk`).
pub fn resolve(from: &Path) -> Result<PathBuf> {
    if from.is_dir() {
        for name in ["model.safetensors", "model.bpk"] {
            let file = from.join(name);
            if file.is_file() {
                return Ok(file);
            }
        }
        return Err(Error::config(format!(
            "key `init.from`: {} is a directory without model.safetensors or model.bpk (a run \
             directory exports them when it finishes)",
            from.display()
        )));
    }
    if !from.is_file() {
        return Err(Error::config(format!(
            "key `init.from`: {}: no such file or run directory",
            from.display()
        )));
    }
    Ok(from.to_path_buf())
}

/// `model` with the tensors of `init.from` in it. Refused in one line, naming the first few
/// of each, when the file has tensors the model lacks, lacks some the model has, or has them in
/// another shape — unless `init.partial`, which loads what fits and returns the rest.
pub fn load<M: Module>(mut model: M, init: &InitConfig) -> Result<(M, Loaded)> {
    let Some(from) = &init.from else {
        return Ok((model, Loaded::default()));
    };
    // A Hugging Face model directory: its family's names, shards and dtypes.
    if kiln_models::hf::is_model_dir(from) {
        let (model, hf) = kiln_models::hf::load_into(model, from)
            .map_err(|e| Error::config(format!("key `init.from`: {e}")))?;
        return Ok((
            model,
            Loaded {
                file: from.clone(),
                applied: hf.tensors,
                ..Loaded::default()
            },
        ));
    }
    let file = resolve(from)?;
    let remapper = init
        .rename
        .iter()
        .try_fold(KeyRemapper::new(), |r, (from, to)| {
            r.add_pattern(from, to.as_str())
        })
        .map_err(|e| Error::config(format!("key `init.rename`: {e}")))?;
    let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("");
    let pytorch = init.format == WeightsFormat::Pytorch;
    let unreadable = |e: &dyn std::fmt::Display| {
        Error::config(format!(
            "key `init.from`: {}: cannot read it as {} weights: {}",
            file.display(),
            if pytorch { "PyTorch" } else { "kiln" },
            crate::config::one_line(e)
        ))
    };
    let result: ApplyResult = match ext {
        "safetensors" => {
            let mut store = SafetensorsStore::from_file(&file)
                .remap(remapper)
                .allow_partial(true)
                .validate(false);
            if pytorch {
                store = store.with_from_adapter(PyTorchToBurnAdapter);
            }
            model.load_from(&mut store).map_err(|e| unreadable(&e))?
        }
        "bpk" => {
            if pytorch {
                return Err(Error::config(format!(
                    "key `init.format`: {} is a burnpack file (kiln's and Burn's), not PyTorch's; \
                     set init.format = \"kiln\"",
                    file.display()
                )));
            }
            let mut store = BurnpackStore::from_file(&file)
                .remap(remapper)
                .allow_partial(true)
                .validate(false);
            model.load_from(&mut store).map_err(|e| unreadable(&e))?
        }
        "pt" | "pth" => {
            if !pytorch {
                return Err(Error::config(format!(
                    "key `init.format`: {} is a PyTorch file; set init.format = \"pytorch\"",
                    file.display()
                )));
            }
            let mut store = PytorchStore::from_file(&file)
                .remap(remapper)
                .allow_partial(true)
                .validate(false);
            model.load_from(&mut store).map_err(|e| unreadable(&e))?
        }
        _ => {
            return Err(Error::config(format!(
                "key `init.from`: {}: expected a run directory, a .bpk, a .safetensors, or a \
                 PyTorch .pt/.pth",
                file.display()
            )));
        }
    };
    let loaded = Loaded {
        applied: result.applied.len(),
        missing: result.missing.iter().map(|(p, _)| p.clone()).collect(),
        unused: result.unused.clone(),
        mismatched: result.errors.iter().map(mismatch).collect(),
        file,
    };
    if !init.partial && !loaded.whole() {
        // PyTorch's layout read as kiln's: transposed matrices, norms' `weight` for `gamma`.
        let transposed = result.errors.iter().any(|e| {
            matches!(e, ApplyError::ShapeMismatch { expected, found, .. }
                if found.len() == 2 && found.to_vec() == [expected[1], expected[0]])
        });
        let norm_names = loaded.missing.iter().any(|m| {
            m.strip_suffix(".gamma")
                .is_some_and(|p| loaded.unused.contains(&format!("{p}.weight")))
        });
        let hint = if !pytorch && (transposed || norm_names) {
            "; it reads as PyTorch's layout (linear weights [out, in], norms' `weight`): set \
             init.format = \"pytorch\""
        } else {
            "; rename the file's tensors (init.rename) or load what fits (init.partial = true)"
        };
        return Err(Error::config(format!(
            "key `init.from`: {} does not fit the model: {}{hint}",
            loaded.file.display(),
            loaded.misfits()
        )));
    }
    if loaded.applied == 0 {
        return Err(Error::config(format!(
            "key `init.from`: {}: none of its tensors fits the model (is it another \
             architecture, or PyTorch's names without init.format = \"pytorch\"?)",
            loaded.file.display()
        )));
    }
    Ok((model, loaded))
}

/// One tensor that did not fit, as a refusal names it.
fn mismatch(e: &ApplyError) -> String {
    match e {
        ApplyError::ShapeMismatch {
            path,
            expected,
            found,
        } => format!(
            "{path}: file {:?}, model {:?}",
            found.to_vec(),
            expected.to_vec()
        ),
        ApplyError::DTypeMismatch {
            path,
            expected,
            found,
        } => format!("{path}: file {found:?}, model {expected:?}"),
        ApplyError::AdapterError { path, message } | ApplyError::LoadError { path, message } => {
            format!("{path}: {message}")
        }
    }
}
