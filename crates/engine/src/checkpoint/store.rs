//! `checkpoints/step-N/`: written whole (a temporary directory renamed into place), listed,
//! pruned, the best one kept, the model and the loop state read back.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Module;
use serde::{Deserialize, Serialize};

use crate::config::one_line;
use crate::error::{Error, Result};
use crate::files::{write_atomic, write_synced};
use crate::optim::OptimState;
use crate::state::LoopState;

use super::manifest::{MODEL_FILE, Manifest, STATE_FILE, digest, read_manifest};
use super::optimizer::{optim_file, save_optimizer};

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
    save_record(
        run_dir,
        model.clone().into_record(),
        optim,
        state,
        keep,
        score,
    )
}

/// [`save`] from the model's record, taken beforehand: a write in the background takes the
/// record on the step's thread, since a model's buffers (Burn's `RunningState`, e.g.
/// BatchNorm statistics) are shared with its clones and the next steps update them in place.
pub fn save_record(
    run_dir: &Path,
    record: burn::store::ModuleRecord,
    optim: &[(String, OptimState)],
    state: &LoopState,
    keep: usize,
    score: Option<Score>,
) -> Result<PathBuf> {
    let root = run_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    let tmp = root.join(format!(".tmp-step-{}-{}", state.step, std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = (|| {
        record.save(tmp.join(MODEL_FILE)).map_err(|e| {
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
            sharded: None,
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("loop state serialises");
        write_synced(&tmp.join(STATE_FILE), &json)
    })();
    if let Err(e) = written {
        // A full disk or a size limit: nothing half-written stays, the older checkpoints do.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    land(run_dir, &tmp, state.step, keep, score)
}

/// Moves the whole checkpoint written in `tmp` into place as step `step`'s, records it as the
/// best when `score` is better, and prunes the older ones to `keep`.
pub(super) fn land(
    run_dir: &Path,
    tmp: &Path,
    step: usize,
    keep: usize,
    score: Option<Score>,
) -> Result<PathBuf> {
    let root = run_dir.join("checkpoints");
    let final_dir = step_dir(run_dir, step);
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| Error::io(&final_dir, e))?;
    }
    std::fs::rename(tmp, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
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
                step,
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

/// The temporary directory every rank writes its share of step `step`'s sharded checkpoint
/// into, made empty (rank 0, before the others write).
pub fn begin_sharded(run_dir: &Path, step: usize) -> Result<PathBuf> {
    let tmp = sharded_tmp(run_dir, step);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    Ok(tmp)
}

/// The temporary directory of step `step`'s sharded checkpoint (one name for every process).
pub fn sharded_tmp(run_dir: &Path, step: usize) -> PathBuf {
    run_dir
        .join("checkpoints")
        .join(format!(".tmp-step-{step}-sharded"))
}

/// Rank 0's end of a sharded checkpoint: once every rank's share is in its temporary
/// directory, `state.json` is written and the checkpoint lands (a failure removes the
/// temporary directory; the earlier checkpoints stay).
pub fn finish_sharded(
    run_dir: &Path,
    world: usize,
    state: &LoopState,
    keep: usize,
    score: Option<Score>,
    cancelled: &dyn Fn() -> bool,
) -> Result<PathBuf> {
    let tmp = sharded_tmp(run_dir, state.step);
    if let Err(e) = super::sharded::seal(&tmp, world, state, cancelled) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    land(run_dir, &tmp, state.step, keep, score)
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

pub(super) fn prune(root: &Path, keep: usize) -> Result<()> {
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

/// Reads the loop state of a checkpoint (without verifying its files: see [`verify`](crate::checkpoint::verify)).
pub fn read_state(dir: &Path) -> Result<LoopState> {
    read_manifest(dir).map(|m| m.state)
}

/// Checks that `model` takes a checkpoint's weights: a gathered checkpoint's loaded, a
/// sharded one's names and shapes (its shards' values are not read).
pub fn check_model<M: Module>(dir: &Path, model: M) -> Result<()> {
    if super::reader::is_sharded(dir) {
        return super::reader::Sharded::open(dir)?.fits_model(model);
    }
    load_model(dir, model).map(|_| ())
}

/// Loads a checkpoint's weights into `model` (gathered or sharded).
pub fn load_model<M: Module>(dir: &Path, model: M) -> Result<M> {
    if super::reader::is_sharded(dir) {
        return super::reader::Sharded::open(dir)?.load_model(model);
    }
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
