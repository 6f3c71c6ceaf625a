//! Checkpoints: `checkpoints/step-N/` directories written atomically (a temporary directory
//! renamed into place), holding the model, the optimizer state and the loop state.
//!
//! Nothing in a checkpoint depends on the strategy or the number of ranks: the model is the
//! whole model (gathered by the strategy), and the optimizer state is kept per parameter, under
//! the parameter's module path and in its shape ([`OptimState`]), whatever shards it was
//! stepped in. Any checkpoint therefore resumes under any strategy and device count.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::prelude::*;
use burn::store::burn_pack::{self, Reader, Writer};
use serde::{Deserialize, Serialize};

use crate::config::{OptimizerKind, one_line};
use crate::error::{Error, Result};
use crate::files::{write_atomic, write_synced};
use crate::optim::OptimState;
pub use crate::state::LoopState;

/// Metadata key of the optimizer file naming the optimizer that wrote it.
const OPTIMIZER_KEY: &str = "kiln.optimizer";
/// Metadata key of the optimizer file naming its layout.
const LAYOUT_KEY: &str = "kiln.layout";
/// The one layout kiln writes: one tensor per parameter and state leaf.
const LAYOUT: &str = "per-parameter";

/// File of the model weights inside a checkpoint.
pub const MODEL_FILE: &str = "model.bpk";
/// File of the optimizer state inside a checkpoint.
pub const OPTIM_FILE: &str = "optimizer.bpk";
/// File of the loop state inside a checkpoint; written last, so its presence marks a
/// complete checkpoint.
pub const STATE_FILE: &str = "state.json";

/// A file of a checkpoint as its `state.json` records it: the size and the SHA-256 of its
/// bytes, so that a resume trusts no file that changed after it was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Its length in bytes.
    pub bytes: u64,
    /// The SHA-256 of its bytes, in hexadecimal.
    pub sha256: String,
}

/// What `state.json` holds: the loop state, and the digest of every other file of the
/// checkpoint (absent in checkpoints of an older kiln, which are read unverified).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    #[serde(flatten)]
    state: LoopState,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    files: BTreeMap<String, FileDigest>,
}

/// The size and SHA-256 of the file at `path`, read in one pass.
pub fn digest(path: &Path) -> Result<FileDigest> {
    use sha2::Digest;
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = sha2::Sha256::new();
    let bytes = std::io::copy(&mut file, &mut hasher).map_err(|e| Error::io(path, e))?;
    let sha256 = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(FileDigest { bytes, sha256 })
}

/// The directory of the checkpoint taken after `step` steps.
pub fn step_dir(run_dir: &Path, step: usize) -> PathBuf {
    run_dir.join("checkpoints").join(format!("step-{step:08}"))
}

/// A checkpoint's validation score, for keeping the best one.
#[derive(Debug, Clone, Copy)]
pub struct Score<'a> {
    /// `val_loss` (lower is better) or `val_accuracy` (higher is better).
    pub metric: &'a str,
    /// Its value at the checkpoint's step.
    pub value: f64,
}

/// File (inside `checkpoints/`) naming the best checkpoint by `train.best_metric`.
pub const BEST_FILE: &str = "best.json";

/// The best checkpoint so far: its step and score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Best {
    /// The checkpoint's step.
    pub step: usize,
    /// `val_loss` or `val_accuracy`.
    pub metric: String,
    /// Its value.
    pub value: f64,
}

/// Writes a checkpoint atomically and deletes all but the newest `keep` ones (and the best
/// one by `score`'s metric, when a score is given). A write that fails leaves no temporary
/// directory behind and the earlier checkpoints as they were.
pub fn save<M: Module>(
    run_dir: &Path,
    model: &M,
    optim: &[(String, OptimState)],
    state: &LoopState,
    keep: usize,
    score: Option<Score>,
) -> Result<PathBuf> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    let final_dir = step_dir(run_dir, state.step);
    let tmp = root.join(format!(".tmp-step-{}-{}", state.step, std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = (|| {
        model.clone().save_file(tmp.join(MODEL_FILE)).map_err(|e| {
            Error::checkpoint(format!(
                "{}: {}",
                tmp.join(MODEL_FILE).display(),
                one_line(&e)
            ))
        })?;
        let mut names = vec![MODEL_FILE.to_string()];
        for (group, state) in optim {
            save_optimizer(&tmp.join(optim_file(group)), state)?;
            names.push(optim_file(group));
        }
        // Each file's digest, read back from the disk, then the state that records them: a
        // checkpoint proves itself on every later read.
        let files = names
            .into_iter()
            .map(|name| Ok((name.clone(), digest(&tmp.join(&name))?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        let manifest = Manifest {
            state: state.clone(),
            files,
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("loop state serialises");
        write_synced(&tmp.join(STATE_FILE), &json)
    })();
    if let Err(e) = written {
        // A full disk or a size limit: nothing half-written stays, the older checkpoints do.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| Error::io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
    if let Some(score) = score {
        let better = match read_best(run_dir) {
            Some(best) if best.metric == score.metric => {
                if score.metric == "val_accuracy" {
                    score.value > best.value
                } else {
                    score.value < best.value
                }
            }
            _ => true,
        };
        if better && score.value.is_finite() {
            let best = Best {
                step: state.step,
                metric: score.metric.to_string(),
                value: score.value,
            };
            let json = serde_json::to_vec_pretty(&best).expect("best serialises");
            write_atomic(&root.join(BEST_FILE), &json)?;
        }
    }
    prune(&root, keep)?;
    Ok(final_dir)
}

/// The best checkpoint recorded in a run, if any.
pub fn read_best(run_dir: &Path) -> Option<Best> {
    let bytes = std::fs::read(run_dir.join("checkpoints").join(BEST_FILE)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Removes the temporary directories that checkpoint writers killed mid-write left under
/// `checkpoints/`; returns them.
pub fn remove_stale(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let root = run_dir.join("checkpoints");
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with(".tmp-step-") {
            let path = entry.path();
            std::fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// Complete checkpoints of a run, oldest first.
pub fn list(run_dir: &Path) -> Vec<(usize, PathBuf)> {
    let root = run_dir.join("checkpoints");
    let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(&root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse().ok()?;
            entry
                .path()
                .join(STATE_FILE)
                .is_file()
                .then(|| (step, entry.path()))
        })
        .collect();
    found.sort();
    found
}

fn prune(root: &Path, keep: usize) -> Result<()> {
    let run_dir = root.parent().unwrap_or(root);
    let all = list(run_dir);
    let best = read_best(run_dir).map(|b| b.step);
    let excess = all.len().saturating_sub(keep.max(1));
    for (step, dir) in &all[..excess] {
        if Some(*step) != best {
            std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
    }
    Ok(())
}

/// The newest complete checkpoint of a run.
pub fn latest(run_dir: &Path) -> Result<(usize, PathBuf)> {
    list(run_dir).pop().ok_or_else(|| {
        Error::checkpoint(format!(
            "{}: no complete checkpoint found (expected checkpoints/step-N/{STATE_FILE})",
            run_dir.join("checkpoints").display()
        ))
    })
}

/// Reads the loop state of a checkpoint (without verifying its files: see [`verify`]).
pub fn read_state(dir: &Path) -> Result<LoopState> {
    read_manifest(dir).map(|m| m.state)
}

fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(STATE_FILE);
    let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        Error::checkpoint(format!(
            "{}: corrupt loop state: {}",
            path.display(),
            one_line(&e)
        ))
    })
}

/// A checkpoint's loop state, once every file its `state.json` records is there whole: the
/// size and the SHA-256 it was written with. The error names the file and the damage —
/// missing, short, long, or bytes that do not match — never a setting. A checkpoint of an
/// older kiln records no digests and is read as it is (`Ok` with `verified` false).
pub fn verify(dir: &Path) -> Result<Verified> {
    let manifest = read_manifest(dir)?;
    for (name, want) in &manifest.files {
        let path = dir.join(name);
        let len = match std::fs::metadata(&path) {
            Ok(m) => m.len(),
            Err(_) => {
                return Err(Error::checkpoint(format!(
                    "{}: missing (state.json records {} bytes)",
                    path.display(),
                    want.bytes
                )));
            }
        };
        if len != want.bytes {
            let how = if len < want.bytes {
                "truncated"
            } else {
                "grown"
            };
            return Err(Error::checkpoint(format!(
                "{}: corrupt: {len} bytes where state.json records {} ({how})",
                path.display(),
                want.bytes
            )));
        }
        if digest(&path)?.sha256 != want.sha256 {
            return Err(Error::checkpoint(format!(
                "{}: corrupt: its bytes do not match the SHA-256 state.json records",
                path.display()
            )));
        }
    }
    Ok(Verified {
        verified: !manifest.files.is_empty(),
        state: manifest.state,
    })
}

/// A checkpoint that [`verify`] read.
#[derive(Debug, Clone)]
pub struct Verified {
    /// Its loop state.
    pub state: LoopState,
    /// Whether its files were checked (a checkpoint of an older kiln records no digests).
    pub verified: bool,
}

/// The checkpoint a resume starts from: the newest whole one, and each newer one that did not
/// verify, with what is wrong with it (its error names the file).
#[derive(Debug)]
pub struct Newest {
    /// Its step.
    pub step: usize,
    /// Its directory.
    pub dir: PathBuf,
    /// The newer checkpoints passed over, newest first.
    pub damaged: Vec<(usize, Error)>,
}

/// The newest checkpoint of a run whose files verify ([`Newest`]); an error when none does.
pub fn newest_whole(run_dir: &Path) -> Result<Newest> {
    let mut damaged = Vec::new();
    for (step, dir) in list(run_dir).into_iter().rev() {
        match verify(&dir) {
            Ok(_) => return Ok(Newest { step, dir, damaged }),
            Err(e) => damaged.push((step, e)),
        }
    }
    if damaged.is_empty() {
        let (step, dir) = latest(run_dir)?;
        return Ok(Newest { step, dir, damaged });
    }
    let all: Vec<String> = damaged
        .iter()
        .map(|(_, e)| e.message().to_string())
        .collect();
    Err(Error::checkpoint(format!(
        "{}: no checkpoint is whole: {}",
        run_dir.join("checkpoints").display(),
        all.join("; ")
    )))
}

/// Loads a checkpoint's weights into `model`.
pub fn load_model<M: Module>(dir: &Path, model: M) -> Result<M> {
    let path = dir.join(MODEL_FILE);
    if !path.is_file() {
        return Err(Error::checkpoint(format!(
            "{}: missing model weights",
            path.display()
        )));
    }
    model.try_load_file(&path).map_err(|e| {
        Error::checkpoint(format!(
            "{}: corrupt model weights: {}",
            path.display(),
            one_line(&e)
        ))
    })
}

/// Writes an optimizer state: a burnpack file with one f32 tensor per parameter and state leaf,
/// named `<parameter path>:<leaf>`, the shared scalars, and the optimizer's name.
pub fn save_optimizer(path: &Path, optim: &OptimState) -> Result<()> {
    let tensors = optim
        .tensors
        .iter()
        .map(|(param, leaf, shape, values)| {
            let (bytes, shape, dtype) = TensorData::new(values.clone(), shape.clone()).into_parts();
            burn_pack::Tensor::new(format!("{param}:{leaf}"), dtype, shape, None, bytes)
        })
        .collect();
    let mut writer = Writer::new(tensors)
        .with_metadata(OPTIMIZER_KEY, &crate::config::name_of(&optim.kind))
        .with_metadata(LAYOUT_KEY, LAYOUT);
    for (key, value) in &optim.scalars {
        writer = writer.with_scalar(key, *value);
    }
    writer
        .write_to_file(path)
        .map_err(|e| Error::checkpoint(format!("{}: {}", path.display(), one_line(&e))))
}

/// The file of parameter group `group`'s optimizer state (`""`: the one optimizer of a
/// model without groups, `optimizer.bpk`; otherwise `optimizer.<group>.bpk`).
pub fn optim_file(group: &str) -> String {
    if group.is_empty() {
        OPTIM_FILE.to_string()
    } else {
        format!("optimizer.{group}.bpk")
    }
}

/// Reads a checkpoint's optimizer state.
pub fn load_optimizer(dir: &Path) -> Result<OptimState> {
    load_group_optimizer(dir, "")
}

/// Reads the optimizer state of parameter group `group` (see [`optim_file`]).
pub fn load_group_optimizer(dir: &Path, group: &str) -> Result<OptimState> {
    let path = dir.join(optim_file(group));
    if !path.is_file() {
        return Err(Error::checkpoint(format!(
            "{}: missing optimizer state",
            path.display()
        )));
    }
    let corrupt = |e: &dyn std::fmt::Display| {
        Error::checkpoint(format!(
            "{}: corrupt optimizer state: {}",
            path.display(),
            one_line(e)
        ))
    };
    let reader = Reader::from_file(&path).map_err(|e| corrupt(&e))?;
    let meta = reader.metadata().clone();
    if meta.get(LAYOUT_KEY).map(String::as_str) != Some(LAYOUT) {
        return Err(Error::checkpoint(format!(
            "{}: not a kiln optimizer state (no {LAYOUT_KEY} = {LAYOUT:?}; written by an older \
             kiln or another program)",
            path.display()
        )));
    }
    let kind = match meta.get(OPTIMIZER_KEY).map(String::as_str) {
        Some("adamw") => OptimizerKind::Adamw,
        Some("sgd") => OptimizerKind::Sgd,
        other => {
            return Err(Error::checkpoint(format!(
                "{}: unknown optimizer {other:?} (expected \"adamw\" or \"sgd\")",
                path.display()
            )));
        }
    };
    let scalars: BTreeMap<_, _> = reader.scalars().clone();
    let mut tensors = Vec::new();
    for tensor in reader.into_tensors().map_err(|e| corrupt(&e))? {
        let (name, dtype, shape, _, bytes) = tensor.into_parts().map_err(|e| corrupt(&e))?;
        let Some((param, leaf)) = name.rsplit_once(':') else {
            return Err(corrupt(&format!(
                "tensor {name:?} is not named <parameter>:<leaf>"
            )));
        };
        let data = TensorData::from_bytes(bytes, shape.clone(), dtype);
        let values: Vec<f32> = data
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| corrupt(&format!("tensor {name:?}: {e:?}")))?;
        if values.len() != shape.num_elements() {
            return Err(corrupt(&format!("tensor {name:?} has the wrong size")));
        }
        tensors.push((param.to_string(), leaf.to_string(), shape.to_vec(), values));
    }
    Ok(OptimState {
        kind,
        tensors,
        scalars,
    })
}

/// `train checkpoints RUN`: one line per checkpoint (oldest first) — its step, whether its files
/// verify (or what is wrong with one), its files and sizes, the best one — and a last line
/// saying which one `--resume` starts from (`None` when none is whole). An error when the run
/// has none.
pub fn report(run: &Path) -> Result<(Vec<String>, Option<usize>)> {
    let all = list(run);
    if all.is_empty() {
        return Err(Error::checkpoint(format!(
            "{}: no complete checkpoint (expected checkpoints/step-N/{STATE_FILE})",
            run.display()
        )));
    }
    let best = read_best(run);
    let mut lines = Vec::new();
    let mut whole = None;
    for (step, dir) in &all {
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let len = e.metadata().ok()?.len();
                let name = e.file_name().into_string().ok()?;
                Some(format!("{name} {}", human_bytes(len)))
            })
            .collect();
        files.sort();
        let state = match verify(dir) {
            Ok(v) => {
                whole = Some(*step);
                if v.verified {
                    "whole".to_string()
                } else {
                    "unverified (no digests: written by an older kiln)".to_string()
                }
            }
            Err(e) => format!("DAMAGED: {}", e.message()),
        };
        let mark = match &best {
            Some(b) if b.step == *step => format!("  best {} {:.6}", b.metric, b.value),
            _ => String::new(),
        };
        lines.push(format!(
            "step {step:>8}  {state}  [{}]{mark}",
            files.join(", ")
        ));
    }
    if let Some(s) = whole {
        lines.push(format!("--resume {} starts from step {s}", run.display()));
    }
    Ok((lines, whole))
}

/// A byte count in B, KiB, MiB or GiB.
fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}
