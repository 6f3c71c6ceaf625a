//! From a [`RootConfig`] and a [`Workload`] to a finished run: devices, the start-up table, the
//! run directory, the trainer, and the exported model. Which workload a config asks for is a
//! program's business (kiln's own: [`crate::builtin`]).

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::prelude::*;
use kiln_models::load::{SAFETENSORS_FILE, WEIGHTS_FILE};
use kiln_models::save_safetensors;

use crate::checkpoint;
use crate::config::{Accelerator, HardwareConfig, RootConfig, name_of};
use crate::cores::CoreSplit;
use crate::error::{Error, Result};
use crate::files::write_atomic;
use crate::metrics::Summary;
use crate::optim::scaled_lr;
use crate::strategy::{ModelFacts, Setup};
use crate::trainer::{TrainerSettings, Workload, fit_checked, total_steps};

/// The devices of the configured accelerator, and the accelerator's name.
pub fn resolve_devices(hw: &HardwareConfig) -> Result<(Vec<Device>, String)> {
    let indices = hw.devices.indices();
    let accelerator = match hw.accelerator {
        Accelerator::Auto if cfg!(feature = "cuda") => Accelerator::Cuda,
        Accelerator::Auto => Accelerator::Cpu,
        a => a,
    };
    match accelerator {
        Accelerator::Cpu => Ok((
            indices.iter().map(|_| Device::flex()).collect(),
            "cpu (flex)".into(),
        )),
        Accelerator::Wgpu => {
            // The adapters this machine offers, in the order `train devices` lists them.
            let adapters: Vec<Device> = std::panic::catch_unwind(|| {
                Device::enumerate(burn::tensor::DeviceType::Wgpu)
                    .into_iter()
                    .collect()
            })
            .unwrap_or_default();
            let devices = indices
                .iter()
                .map(|&i| {
                    adapters.get(i).cloned().ok_or_else(|| {
                        Error::Device(format!(
                            "hardware.devices asks for wgpu adapter {i}, but {} found \
                             (see `train devices`)",
                            match adapters.len() {
                                0 => "none was".to_string(),
                                1 => "only 1 was".to_string(),
                                n => format!("only {n} were"),
                            }
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((devices, "wgpu".into()))
        }
        Accelerator::Cuda => cuda_devices(&indices),
        Accelerator::Auto => unreachable!("auto was resolved above"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_devices(indices: &[usize]) -> Result<(Vec<Device>, String)> {
    Ok((
        indices.iter().map(|&i| Device::cuda(i)).collect(),
        "cuda".into(),
    ))
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices(_indices: &[usize]) -> Result<(Vec<Device>, String)> {
    Err(Error::Device(
        "hardware.accelerator = \"cuda\" needs kiln built with the `cuda` feature \
         (cargo run --release --features cuda --bin train ...)"
            .into(),
    ))
}

/// How a run starts.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue from this checkpoint directory (inside the run directory).
    pub resume_from: Option<PathBuf>,
    /// The run directory was named explicitly (`--run-dir`): never pick another one.
    pub explicit_dir: bool,
    /// Print the start-up table.
    pub verbose: bool,
}

/// What a finished run left behind.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// The run directory.
    pub dir: PathBuf,
    /// The summary also written to `summary.json`.
    pub summary: Summary,
}

/// How a workload's run describes itself besides what kiln knows.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    /// The model's name in the start-up table.
    pub model: String,
    /// More rows of the start-up table (`("data", "…")`).
    pub rows: Vec<(String, String)>,
    /// Sections of the workload's own written into `config.toml` (a program's `[model]` and
    /// `[data]`, so that `--resume` reads them back).
    pub sections: Vec<(String, toml::Value)>,
    /// Drop the last incomplete global batch of an epoch instead of wrapping around (the
    /// built-in recipes' `data.drop_last`).
    pub drop_last: bool,
}

/// Trains `workload` as `config` says, with everything `train` gives: devices, strategy,
/// precision and recompute, the run directory (`config.toml`, metrics, checkpoints,
/// `summary.json`), resume (`options.resume_from`), the start-up table, and the exported
/// model (`model.bpk`, `model.safetensors`). `save_extra` writes the workload's own files
/// into the run directory (on process 0, before training). The workload is the model and the
/// data; `info` describes them.
pub fn train_workload<W>(
    config: &RootConfig,
    options: &RunOptions,
    workload: &W,
    info: RunInfo,
    save_extra: impl FnOnce(&Path) -> Result<()>,
) -> Result<RunResult>
where
    W: Workload,
    W::Model: burn::store::ModuleSnapshot,
{
    let (devices, accelerator) = resolve_devices(&config.hardware)?;
    for d in &devices {
        if !d.supports_dtype(burn::tensor::DType::F32) {
            return Err(Error::Device(format!("{d:?} cannot compute in f32")));
        }
    }

    // What the strategy refuses on this launch's ranks, and of this model, is refused before
    // anything is written: a refused run leaves no directory behind.
    let processes = crate::comm::processes();
    Setup::new(config, devices.len() * processes.count).check()?;
    let cpu = accelerator.starts_with("cpu");
    let mut settings =
        TrainerSettings::from_config(config, devices.clone(), accelerator, config.run_dir());
    // What the launcher needs to know of the model (the core split, the start-up table).
    let probe = kiln_models::with_rng(|| {
        kiln_models::materialized(workload.init_model(&devices[0].clone().autodiff()))
    });
    let facts = ModelFacts::of::<W::Batch, _>(&probe);
    let params = probe.num_params();
    drop(probe);
    // A CPU device runs as per-core sub-replicas where they fit the strategy and the model.
    let split = CoreSplit::plan(config, devices.len(), cpu, processes.count, &facts);
    split.apply(&mut settings, &facts);
    settings.drop_last = info.drop_last || workload.drop_last();
    settings.output.resume_from = options.resume_from.clone();
    let checked = crate::trainer::check(workload, &settings)?;
    // A resume is checked against its checkpoint before anything in the run changes.
    let first = processes.index == 0;
    if let Some(checkpoint) = &options.resume_from {
        let samples = checked.samples_per_step();
        let (step, changed) =
            check_resume(config, &info, workload, checkpoint, samples, &devices[0])?;
        if options.verbose && first {
            let changes = if changed.is_empty() {
                String::new()
            } else {
                format!(
                    "; settings changed from the run's config: {}",
                    changed.join("; ")
                )
            };
            say!(
                "resuming {} from step {step} ({}){changes}",
                config.run_dir().display(),
                checkpoint.display()
            );
        }
    }
    // Process 0 chooses the run directory and writes the run's files; the others follow it.
    let run_dir = PathBuf::from(crate::comm::agree(|| {
        let run_dir = choose_run_dir(config, options)?;
        std::fs::create_dir_all(&run_dir).map_err(|e| Error::io(&run_dir, e))?;
        let table = saved_table(config, &info, &run_dir);
        let text = toml::to_string_pretty(&table).expect("a table serialises");
        write_atomic(&run_dir.join("config.toml"), text.as_bytes())?;
        save_extra(&run_dir)?;
        Ok(run_dir.display().to_string())
    })?);

    settings.output.run_dir = run_dir.clone();
    settings.output.progress = options.verbose && first;
    if options.verbose && first {
        print_table(config, workload, &settings, &run_dir, &info, &facts, params);
    }

    let (summary, model) = fit_checked(workload, &settings, checked)?;
    if first {
        export_model(&run_dir, &model)?;
        let json = serde_json::to_vec_pretty(&summary).expect("summary serialises");
        write_atomic(&run_dir.join("summary.json"), &json)?;
    }
    Ok(RunResult {
        dir: run_dir,
        summary,
    })
}

/// The run's `config.toml` as a table: kiln's sections, the run directory, the workload's own.
fn saved_table(config: &RootConfig, info: &RunInfo, run_dir: &Path) -> toml::Table {
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
fn check_resume<W: Workload>(
    config: &RootConfig,
    info: &RunInfo,
    workload: &W,
    checkpoint: &Path,
    samples_per_step: usize,
    device: &Device,
) -> Result<(usize, Vec<String>)> {
    let run_dir = config.run_dir();
    let state = checkpoint::read_state(checkpoint)?;
    crate::trainer::same_samples_per_step(checkpoint, &state, samples_per_step)?;
    let changed = changed_keys(&run_dir, config, info)?;
    let model = kiln_models::with_rng(|| kiln_models::materialized(workload.init_model(device)));
    if let Err(e) = checkpoint::load_model(checkpoint, model) {
        // A model's shape comes from its own section: name those keys when they changed.
        let model_keys: Vec<String> = changed
            .iter()
            .filter(|c| c.starts_with("model."))
            .cloned()
            .collect();
        let changed = if model_keys.is_empty() {
            changed
        } else {
            model_keys
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

/// Writes the final weights as burnpack and SafeTensors, each atomically.
pub fn export_model<M: Module + burn::store::ModuleSnapshot>(
    run_dir: &Path,
    model: &M,
) -> Result<()> {
    let tmp = run_dir.join(format!(".{WEIGHTS_FILE}.tmp"));
    model
        .clone()
        .save_file(&tmp)
        .map_err(|e| Error::checkpoint(format!("{}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, run_dir.join(WEIGHTS_FILE)).map_err(|e| Error::io(run_dir, e))?;
    let tmp = run_dir.join(format!(".{SAFETENSORS_FILE}.tmp"));
    save_safetensors(model, &tmp).map_err(|e| Error::checkpoint(e.to_string()))?;
    std::fs::rename(&tmp, run_dir.join(SAFETENSORS_FILE)).map_err(|e| Error::io(run_dir, e))
}

/// The run directory: the configured one, or — for a new run whose named directory already
/// holds a run — the first free `<name>-N`, so that no earlier run is overwritten.
fn choose_run_dir(config: &RootConfig, options: &RunOptions) -> Result<PathBuf> {
    let dir = config.run_dir();
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
/// checkpoint) or one checkpoint directory. Returns (run directory, checkpoint directory).
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
        return Ok((run.to_path_buf(), path.to_path_buf()));
    }
    let (_, dir) = checkpoint::latest(path)?;
    Ok((path.to_path_buf(), dir))
}

/// The start-up table's memory line: the expected peak bytes per rank of parameters,
/// gradients and optimizer state, for `model`.
fn memory_line(s: &TrainerSettings, setup: &Setup, model: &ModelFacts) -> String {
    let e = match setup.estimate(&model.layout, &s.optim) {
        Ok(e) => e,
        Err(e) => return format!("not estimated: {e}"),
    };
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    format!(
        "per rank, expected: parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} \
         MiB (activations not included)",
        mib(e.params),
        mib(e.grads),
        mib(e.optim)
    )
}

/// Prints the start-up table: where the run goes, what it runs on, how the strategy and the
/// precision split the work, the batch, the learning rates, the model and the data.
fn print_table<W: Workload>(
    config: &RootConfig,
    w: &W,
    s: &TrainerSettings,
    run_dir: &Path,
    info: &RunInfo,
    facts: &ModelFacts,
    params: usize,
) {
    let (world, t, setup) = (s.world(), &s.train, s.setup());
    let (replicas, micros) = (s.data_world(), s.micro_batches());
    let sampler = crate::data::DistributedSampler::new(
        w.train_len(),
        s.seed,
        replicas,
        t.batch_size,
        micros,
        s.drop_last,
    );
    let spe = sampler.steps_per_epoch();
    let devices = config.hardware.devices.indices();
    let processes = s.parallel.processes.count;
    let mut rows = vec![
        ("run".to_string(), run_dir.display().to_string()),
        ("accelerator".into(), s.parallel.accelerator.clone()),
        (
            "devices".into(),
            if processes > 1 {
                format!(
                    "{processes} processes × {} devices {devices:?} = {world} ranks",
                    devices.len(),
                )
            } else {
                format!("{} {devices:?}", world / s.parallel.sub_replicas.max(1))
            },
        ),
        (
            "strategy".into(),
            match s.parallel.sub_replicas {
                k if k > 1 && world == k => {
                    format!("single (one device as {k} per-core sub-replicas: the ddp step)")
                }
                k if k > 1 => format!(
                    "ddp ({} devices × {k} per-core sub-replicas, gradients all-reduced)",
                    world / k
                ),
                _ => setup.describe(),
            },
        ),
        ("world size".into(), world.to_string()),
        ("memory".into(), memory_line(s, &setup, facts)),
        (
            "precision".into(),
            format!(
                "{}; {}",
                setup.policy.describe(devices.len() > 1),
                setup.recompute_line()
            ),
        ),
        (
            "batch".into(),
            if s.parallel.sub_replicas > 1 {
                // Said as the user's devices take it: the sub-replicas share a device's batch.
                let per_device = t.batch_size * s.parallel.sub_replicas;
                let devices = world / s.parallel.sub_replicas;
                format!(
                    "{per_device} per device × {devices} device{} × {} accumulation = {} per step",
                    if devices == 1 { "" } else { "s" },
                    t.accumulate,
                    sampler.samples_per_step()
                )
            } else {
                setup.batch_line(t.batch_size, t.accumulate, sampler.samples_per_step())
            },
        ),
    ];
    if let Some(words) = &s.parallel.cores {
        rows.push(("cpu cores".into(), words.clone()));
    }
    rows.extend(lr_rows(s, &facts.groups));
    rows.push((
        "model".into(),
        format!("{}, {params} parameters", info.model),
    ));
    rows.extend(info.rows.iter().cloned());
    rows.extend(w.describe());
    let total = total_steps(t, spe);
    rows.push(("steps".into(), format!("{spe} per epoch, {total} in all")));
    say!("kiln");
    for (k, v) in rows {
        say!("  {k:<12} {v}");
    }
}

/// The start-up table's learning-rate rows: one, or one per parameter group of `groups`.
fn lr_rows(s: &TrainerSettings, groups: &[String]) -> Vec<(String, String)> {
    let (replicas, micros) = (s.data_world(), s.micro_batches());
    let lr_line = |optim: &crate::config::OptimConfig, schedule: &crate::config::ScheduleConfig| {
        format!(
            "{:.3e} ({} scaling of {:.3e}), {} schedule",
            scaled_lr(optim, replicas, micros),
            name_of(&optim.scale_lr),
            optim.lr,
            name_of(&schedule.kind)
        )
    };
    if groups.is_empty() {
        return vec![("lr".to_string(), lr_line(&s.optim, &s.schedule))];
    }
    groups
        .iter()
        .map(|g| {
            let optim = s.group_optim(g);
            let line = lr_line(optim, s.group_schedule(g));
            (
                format!("lr {g}"),
                format!("{} {line}", name_of(&optim.name)),
            )
        })
        .collect()
}
