//! Where a run goes and where a resume comes from: the run directory, the checkpoint a
//! `--resume` names, and the check that it loads into the new settings' model.

use std::path::{Path, PathBuf};

use burn::prelude::*;

use crate::checkpoint;
use crate::config::RootConfig;
use crate::error::{Error, Result};
use crate::trainer::Workload;

use super::info::{RunInfo, RunOptions};

/// The run's `config.toml` as a table: kiln's sections, the run directory, the workload's own.
pub(super) fn saved_table(config: &RootConfig, info: &RunInfo, run_dir: &Path) -> toml::Table {
    let mut saved = config.clone();
    saved.run.dir = Some(run_dir.to_path_buf());
    let mut table: toml::Table =
        toml::from_str(&saved.to_toml()).expect("a config's TOML reads back");
    for (name, value) in &info.sections {
        table.insert(name.clone(), value.clone());
    }
    table
}

/// Every key of `table` with its value, dotted (`model.gpt.n_embd`).
fn flatten(table: &toml::Table, prefix: &str, out: &mut Vec<(String, String)>) {
    for (key, value) in table {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            toml::Value::Table(t) => flatten(t, &path, out),
            v => out.push((path, v.to_string())),
        }
    }
}

/// The keys whose values differ between the run's saved config and `config`, as
/// `key old → new` (a key one side lacks reads `unset`).
fn changed_keys(run_dir: &Path, config: &RootConfig, info: &RunInfo) -> Result<Vec<String>> {
    let path = run_dir.join("config.toml");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Vec::new());
    };
    let old: toml::Table = toml::from_str(&text).map_err(|e| {
        Error::config(format!(
            "{}: invalid TOML: {}",
            path.display(),
            crate::config::one_line(&e)
        ))
    })?;
    let (mut before, mut after) = (Vec::new(), Vec::new());
    flatten(&old, "", &mut before);
    flatten(&saved_table(config, info, run_dir), "", &mut after);
    let value = |all: &[(String, String)], key: &str| {
        all.iter()
            .find(|(k, _)| k == key)
            .map_or("unset".to_string(), |(_, v)| v.clone())
    };
    let mut keys: Vec<&String> = before.iter().chain(&after).map(|(k, _)| k).collect();
    keys.sort();
    keys.dedup();
    Ok(keys
        .into_iter()
        .filter(|k| *k != "run.dir")
        .map(|k| (k, value(&before, k), value(&after, k)))
        .filter(|(_, a, b)| a != b)
        .map(|(k, a, b)| format!("{k} {a} → {b}"))
        .collect())
}

/// Checks that the checkpoint a resume starts from loads into the model `config` describes
/// and took `samples_per_step` as this run will, before anything in the run directory
/// changes; returns the checkpoint's step and the settings changed from the run's config. A model the checkpoint does not fit is one error naming the changed keys.
pub(super) fn check_resume<W: Workload>(
    config: &RootConfig,
    info: &RunInfo,
    workload: &W,
    checkpoint: &Path,
    samples_per_step: usize,
    device: &Device,
) -> Result<(usize, Vec<String>)> {
    let run_dir = config.run_dir();
    // Nothing trains from damaged bytes, whoever named the checkpoint.
    let checked = checkpoint::verify(checkpoint)?;
    let (state, verified) = (checked.state, checked.verified);
    crate::trainer::same_samples_per_step(checkpoint, &state, samples_per_step)?;
    let changed = changed_keys(&run_dir, config, info)?;
    if let Some(init) = changed.iter().find(|c| c.starts_with("init.")) {
        return Err(Error::config(format!(
            "key `init.from`: a resume continues {} from its checkpoint, which holds every \
             weight, and init.from only starts a new run ({init}); resume without changing \
             [init], or start a new run (another run.name)",
            run_dir.display()
        )));
    }
    let model = kiln_models::with_rng(|| kiln_models::materialized(workload.init_model(device)));
    if let Err(e) = checkpoint::check_model(checkpoint, model) {
        // A model's shape comes from its own section: name those keys when they changed. A
        // file whose digest was verified is whole, so another change is what does not fit; an
        // unverified one (an older kiln's) may be damaged, and its error names it.
        let model_keys: Vec<String> = changed
            .iter()
            .filter(|c| c.starts_with("model.") || c.starts_with("finetune."))
            .cloned()
            .collect();
        let changed = match (model_keys.is_empty(), verified) {
            (false, _) => model_keys,
            (true, true) => changed,
            (true, false) => Vec::new(),
        };
        if changed.is_empty() {
            return Err(e);
        }
        return Err(Error::config(format!(
            "cannot resume {} from {}: its model does not take the settings changed from the \
             run's config: {}; resume without changing them",
            run_dir.display(),
            checkpoint.display(),
            changed.join("; ")
        )));
    }
    Ok((state.step, changed))
}

/// The run directory: the configured one, or — for a new run whose named directory already
/// holds a run — the first free `<name>-N`, so that no earlier run is overwritten.
pub(super) fn choose_run_dir(config: &RootConfig, options: &RunOptions) -> Result<PathBuf> {
    let dir = config.run_dir();
    // A directory a live run holds is refused by name, whether resumed or named.
    if options.resume_from.is_some() || options.explicit_dir || config.run.dir.is_some() {
        crate::runlock::RunLock::check(&dir)?;
    }
    if options.resume_from.is_some() || !holds_run(&dir) {
        return Ok(dir);
    }
    if options.explicit_dir || config.run.dir.is_some() {
        return Err(Error::config(format!(
            "{}: already holds a run; continue it with --resume {} or choose another directory",
            dir.display(),
            dir.display()
        )));
    }
    let found = (1..10_000)
        .map(|n| dir.with_file_name(format!("{}-{n}", config.run.name)))
        .find(|d| !holds_run(d))
        .expect("a free run directory");
    Ok(found)
}

fn holds_run(dir: &Path) -> bool {
    dir.join("config.toml").exists() || dir.join("checkpoints").exists()
}

/// Where to resume from, given what the user passed to `--resume`: a run directory (its newest
/// checkpoint whose files verify) or one checkpoint directory (which must verify). Returns
/// (run directory, checkpoint directory). Newer checkpoints that did not verify are skipped,
/// said in one line on process 0, naming each and its damaged file; nothing is ever trained
/// from damaged bytes.
pub fn resolve_resume(path: &Path) -> Result<(PathBuf, PathBuf)> {
    if !path.exists() {
        return Err(Error::checkpoint(format!(
            "{}: no such run directory to resume",
            path.display()
        )));
    }
    if path.join(checkpoint::STATE_FILE).is_file() {
        let run = path
            .parent()
            .and_then(Path::parent)
            .ok_or_else(|| Error::checkpoint(format!("{}: not inside a run", path.display())))?;
        checkpoint::verify(path)?;
        return Ok((run.to_path_buf(), path.to_path_buf()));
    }
    let checkpoint::Newest { step, dir, damaged } = checkpoint::newest_whole(path)?;
    if !damaged.is_empty() && crate::comm::Processes::from_env().index == 0 {
        let what: Vec<String> = damaged
            .iter()
            .map(|(s, e)| format!("step {s} ({})", e.message()))
            .collect();
        eprintln!(
            "warning: skipping damaged checkpoint{} {}; resuming from step {step}, the newest \
             whole one",
            if damaged.len() == 1 { "" } else { "s" },
            what.join("; ")
        );
    }
    Ok((path.to_path_buf(), dir))
}
