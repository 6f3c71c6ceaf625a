//! [`train_workload`]: a config and a workload to a finished run.

use std::path::{Path, PathBuf};

use crate::config::RootConfig;
use crate::cores::CoreSplit;
use crate::error::{Error, Result};
use crate::files::write_atomic;
use crate::runlock::RunLock;
use crate::strategy::{ModelFacts, Setup};
use crate::trainer::{TrainerSettings, Workload, fit_checked};

use super::devices::resolve_devices;
use super::info::{RunInfo, RunOptions, RunResult};
use super::resume::{check_resume, choose_run_dir, saved_table};
use super::table::print_table;
use super::tuned::Tuned;

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
    kiln_models::fused::set_enabled(config.hardware.fused_kernels);
    kiln_models::cube::set_enabled(config.hardware.fused_kernels);
    if config.hardware.fused_kernels {
        kiln_models::cube::set_kernels(&config.hardware.gpu_kernels);
    }
    crate::heap::pages_for_a_run(config.hardware.memory_limit_mib.is_some());
    let chosen = resolve_devices(&config.hardware)?;
    let (devices, accelerator) = (chosen.devices, chosen.name);
    super::devices::start(&devices, &accelerator)?;
    // The starting weights and what trains, checked against the model before anything is
    // written.
    let resuming = options.resume_from.is_some();
    // An evaluation scores the weights as the file holds them: no adapters, no quantisation.
    let tune = if options.evaluate {
        crate::config::FinetuneConfig::default()
    } else {
        config.finetune.clone()
    };
    let tuned = Tuned::new(workload, &config.init, &tune, resuming, &devices[0])?;
    let workload = &tuned;
    let processes = crate::comm::processes();
    // What the strategy refuses on this launch's ranks, and of this model, is refused before
    // anything is written: a refused run leaves no directory behind.
    let drop_last = info.drop_last || workload.drop_last();
    let resume_from = options.resume_from.clone();
    let ready = |config: &RootConfig| {
        prepare(
            workload,
            config,
            &devices,
            &accelerator,
            drop_last,
            resume_from.clone(),
        )
    };
    let (mut settings, mut facts, mut checked) = ready(config)?;
    let about = info.about();
    let target = crate::plan::Target {
        devices: &devices,
        accelerator: &accelerator,
        draws: checked.draws(),
        workload: &about,
    };
    if let Some(json) = options.plan {
        return super::planned::print(workload, config, &target, json);
    }
    // `--strategy auto` on several ranks: ddp as asked where it fits, else the fastest plan
    // that fits (made and checked again); any other run keeps the plan of its settings, and is
    // refused over its limit.
    let mut info = info;
    let settled =
        super::planned::settle(workload, config, &target, facts.buffers, options.evaluate)?;
    info.rows
        .extend(settled.words.map(|w| ("plan".to_string(), w)));
    let plan = settled.record;
    let config = settled.config.as_ref().unwrap_or(config);
    if settled.remade {
        (settings, facts, checked) = ready(config)?;
    }
    // A resume is checked against its checkpoint before anything in the run changes.
    let first = processes.index == 0;
    if let Some(checkpoint) = &options.resume_from {
        let samples = checked.samples_per_step();
        let (step, changed) =
            check_resume(config, &info, workload, checkpoint, samples, &devices[0])?;
        if options.verbose && first {
            say_resuming(config, checkpoint, step, &changed);
        }
    }
    if options.evaluate {
        return super::eval::evaluate(workload, settings, checked, options.verbose && first);
    }
    if let Some(floats) = facts.tp_floats {
        info.rows.push((
            "tp traffic".to_string(),
            format!(
                "{floats} floats all-reduced per step in each tensor-parallel group ({:.1} MiB), \
                 predicted",
                floats as f64 * 4.0 / (1024.0 * 1024.0)
            ),
        ));
    }
    let (run_dir, lock) = hold_run_dir(config, options, &mut info, save_extra)?;
    settings.output.run_dir = run_dir.clone();
    settings.output.progress = options.verbose && first;
    if options.verbose && first {
        print_table(
            config,
            workload,
            &settings,
            chosen.why.as_deref(),
            &info,
            &facts,
        );
    }

    let (mut summary, model) = fit_checked(workload, &settings, checked)?;
    summary.plan = plan;
    summary.tp_floats_predicted = facts.tp_floats;
    if let (true, Some(plan)) = (first, summary.plan.as_mut()) {
        plan.kept_check =
            crate::plan::check_kept(plan, summary.peak_rss_mib, crate::plan::HEADROOM);
        if let (true, Some(words)) = (options.verbose, &plan.kept_check) {
            println!("plan: {words}");
        }
    }
    if first {
        crate::weights::export(&run_dir, &model, config)?;
        let json = serde_json::to_vec_pretty(&summary).expect("summary serialises");
        write_atomic(&run_dir.join("summary.json"), &json)?;
    }
    // The run is over: its directory is free.
    drop(lock);
    Ok(RunResult {
        dir: run_dir,
        summary,
        evaluated: false,
    })
}

/// The run directory, chosen and held (one directory, one run) by process 0, which writes the
/// run's files there; the other processes follow it. A lock taken over from a gone holder is a
/// row of the start-up table.
fn hold_run_dir(
    config: &RootConfig,
    options: &RunOptions,
    info: &mut RunInfo,
    save_extra: impl FnOnce(&Path) -> Result<()>,
) -> Result<(PathBuf, Option<RunLock>)> {
    let mut lock = None;
    let run_dir = PathBuf::from(crate::comm::agree(|| {
        let run_dir = choose_run_dir(config, options)?;
        std::fs::create_dir_all(&run_dir).map_err(|e| Error::io(&run_dir, e))?;
        let held = lock.insert(RunLock::acquire(&run_dir, "train")?);
        if let Some((holder, why)) = &held.took_over {
            info.rows.push((
                "run lock".to_string(),
                format!("taken over from {}: {why}", holder.describe()),
            ));
        }
        let table = saved_table(config, info, &run_dir);
        let text = toml::to_string_pretty(&table).expect("a table serialises");
        write_atomic(&run_dir.join("config.toml"), text.as_bytes())?;
        save_extra(&run_dir)?;
        Ok(run_dir.display().to_string())
    })?);
    Ok((run_dir, lock))
}

/// The trainer's settings for `config` on `devices` (of `accelerator`), every refusal checked
/// before anything is written, and what the launcher needs to know of the model (the core
/// split, the start-up table).
fn prepare<W: Workload>(
    workload: &W,
    config: &RootConfig,
    devices: &[burn::prelude::Device],
    accelerator: &str,
    drop_last: bool,
    resume_from: Option<PathBuf>,
) -> Result<(TrainerSettings, ModelFacts, crate::trainer::Checked)> {
    let processes = crate::comm::processes();
    let setup = Setup::new(config, devices.len() * processes.count);
    setup.check()?;
    let cpu = accelerator.starts_with("cpu");
    let mut settings = TrainerSettings::from_config(
        config,
        devices.to_vec(),
        accelerator.to_string(),
        config.run_dir(),
    );
    let probe = kiln_models::with_rng(|| {
        kiln_models::materialized(workload.init_model(&devices[0].clone().autodiff()))
    });
    // Under tensor parallelism a rank holds its part: the memory line counts that; the
    // group's traffic is the whole model's to predict.
    let tp = config.parallel.tp;
    let tp_floats = (tp > 1)
        .then(|| kiln_models::BlockStack::<W::Batch>::tensor_parallel(&probe))
        .flatten()
        .and_then(|t| t.tp_floats(config.train.batch_size, tp))
        .filter(|_| setup.stages() == 1)
        .map(|f| {
            // What the walk recomputes runs its forward's sums again: the stem's with any
            // block's. (A pipeline's stages each hold some of the blocks: not predicted.)
            let walk = setup.rules().recomputes(&setup);
            let n = kiln_models::BlockStack::<W::Batch>::num_blocks(&probe);
            let again = (0..n).filter(|&i| walk.recomputes(i, n)).count();
            let stem = if again > 0 { f.stem } else { 0 };
            (f.total + stem + again * f.block) * config.train.accumulate
        });
    let probe = crate::strategy::rank_part::<W::Batch, _>(probe, tp);
    let mut facts = ModelFacts::of::<W::Batch, _>(&probe);
    facts.tp_floats = tp_floats;
    drop(probe);
    // A CPU device runs as per-core sub-replicas where they fit the strategy and the model.
    let split = CoreSplit::plan(config, devices.len(), cpu, processes.count, &facts)?;
    split.apply(&mut settings, &facts);
    settings.drop_last = drop_last;
    settings.output.resume_from = resume_from;
    let checked = crate::trainer::check(workload, &settings)?;
    Ok((settings, facts, checked))
}

/// The line a resumed run starts with: from which checkpoint, and the settings that changed.
fn say_resuming(config: &RootConfig, checkpoint: &Path, step: usize, changed: &[String]) {
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
