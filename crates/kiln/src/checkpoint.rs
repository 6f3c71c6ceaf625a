//! Checkpoints: `checkpoints/step-N/` directories written atomically (a temporary directory
//! renamed into place), holding the model, the optimizer and the loop state.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use serde::{Deserialize, Serialize};

use crate::config::one_line;
use crate::error::{Error, Result};

/// File of the model weights inside a checkpoint.
pub const MODEL_FILE: &str = "model.bpk";
/// File of the optimizer state inside a checkpoint.
pub const OPTIM_FILE: &str = "optimizer.bpk";
/// File of the loop state inside a checkpoint; written last, so its presence marks a
/// complete checkpoint.
pub const STATE_FILE: &str = "state.json";

/// Where the loop stood when a checkpoint was taken: enough to continue bit for bit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// Optimizer steps taken so far.
    pub step: usize,
    /// Epoch the next step belongs to.
    pub epoch: usize,
    /// Steps of that epoch already taken (the data-order position).
    pub step_in_epoch: usize,
    /// Seed of the run (the data order is a function of seed and epoch).
    pub seed: u64,
    /// Number of replicas that trained up to here.
    pub world_size: usize,
    /// Samples per optimizer step over all replicas (batch × devices × accumulation); a run
    /// continues the same data order only with the same value.
    pub samples_per_step: usize,
    /// Learning rate of the last step (the schedule is a function of `step`).
    pub lr: f64,
    /// Samples seen so far.
    pub samples: u64,
    /// Seconds of training so far.
    pub wall_seconds: f64,
    /// The loss scaler's state (`16-mixed`), absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaler: Option<crate::precision::LossScaler>,
}

/// The directory of the checkpoint taken after `step` steps.
pub fn step_dir(run_dir: &Path, step: usize) -> PathBuf {
    run_dir.join("checkpoints").join(format!("step-{step:08}"))
}

/// Writes a checkpoint atomically and deletes all but the newest `keep` ones.
pub fn save<M: Module>(
    run_dir: &Path,
    model: &M,
    optim: &ModuleOptimizer,
    state: &LoopState,
    keep: usize,
) -> Result<PathBuf> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    let final_dir = step_dir(run_dir, state.step);
    let tmp = root.join(format!(".tmp-step-{}-{}", state.step, std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    model.clone().save_file(tmp.join(MODEL_FILE)).map_err(|e| {
        Error::checkpoint(format!(
            "{}: {}",
            tmp.join(MODEL_FILE).display(),
            one_line(&e)
        ))
    })?;
    optim.save(tmp.join(OPTIM_FILE)).map_err(|e| {
        Error::checkpoint(format!(
            "{}: {}",
            tmp.join(OPTIM_FILE).display(),
            one_line(&e)
        ))
    })?;
    let json = serde_json::to_vec_pretty(state).expect("loop state serialises");
    write_synced(&tmp.join(STATE_FILE), &json)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| Error::io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
    prune(&root, keep)?;
    Ok(final_dir)
}

/// Writes `bytes` to `path` and flushes them to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(bytes).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}

/// Writes `bytes` to `path` through a temporary file and a rename, so that readers see either
/// the old file or the whole new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    write_synced(&tmp, bytes)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
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
    let excess = all.len().saturating_sub(keep.max(1));
    for (_, dir) in &all[..excess] {
        std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
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

/// Reads the loop state of a checkpoint.
pub fn read_state(dir: &Path) -> Result<LoopState> {
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

/// Loads a checkpoint's optimizer state into `optim`.
pub fn load_optimizer(dir: &Path, optim: ModuleOptimizer) -> Result<ModuleOptimizer> {
    let path = dir.join(OPTIM_FILE);
    if !path.is_file() {
        return Err(Error::checkpoint(format!(
            "{}: missing optimizer state",
            path.display()
        )));
    }
    optim.load(&path).map_err(|e| {
        Error::checkpoint(format!(
            "{}: corrupt optimizer state: {}",
            path.display(),
            one_line(&e)
        ))
    })
}
