//! The start-up table: every resolved setting, printed by process 0 before the first step.

use crate::config::{RootConfig, name_of};
use crate::optim::scaled_lr;
use crate::strategy::{ModelFacts, Setup};
use crate::trainer::{TrainerSettings, Workload, total_steps};

use super::info::RunInfo;
use super::tuned::Tuned;

/// The start-up table's memory line: the expected peak bytes per rank of parameters,
/// gradients and optimizer state, for `model`.
fn memory_line(s: &TrainerSettings, setup: &Setup, model: &ModelFacts, frozen: usize) -> String {
    let e = match setup.estimate(&model.layout, &s.optim) {
        Ok(e) => e,
        Err(e) => return format!("not estimated: {e}"),
    };
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    // Frozen weights take no gradient and no optimizer state; every rank holds them whole.
    let frozen = if frozen > 0 {
        format!(
            ", frozen weights {:.2} MiB in all (zero3 and pipeline ranks hold a part)",
            mib(4 * frozen)
        )
    } else {
        String::new()
    };
    format!(
        "per rank, expected: parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} \
         MiB{frozen} (activations not included)",
        mib(e.params),
        mib(e.grads),
        mib(e.optim)
    )
}

/// Prints the start-up table: where the run goes, what it runs on, how the strategy and the
/// precision split the work, the batch, the learning rates, the model and the data.
pub(super) fn print_table<W: Workload>(
    config: &RootConfig,
    w: &Tuned<'_, W>,
    s: &TrainerSettings,
    auto: Option<&str>,
    info: &RunInfo,
    facts: &ModelFacts,
) {
    // Counted as frozen only where [finetune] froze them (a model's buffers are not weights).
    let frozen = if config.finetune.is_default() {
        0
    } else {
        w.counts.1 - w.counts.0
    };
    let (world, t, setup) = (s.world(), &s.train, s.setup());
    let cpu = s.parallel.accelerator.starts_with("cpu");
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
        ("run".to_string(), s.output.run_dir.display().to_string()),
        (
            "accelerator".into(),
            match auto {
                Some(why) => format!("{} (auto: {why})", s.parallel.accelerator),
                None => s.parallel.accelerator.clone(),
            },
        ),
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
            match (
                s.parallel.sub_replicas,
                if cpu {
                    "per-core sub-replicas"
                } else {
                    "replicas"
                },
            ) {
                (k, what) if k > 1 && world == k => {
                    format!("single (one device as {k} {what}: the ddp step)")
                }
                (k, what) if k > 1 => format!(
                    "ddp ({} devices × {k} {what}, gradients all-reduced)",
                    world / k
                ),
                (_, _) => setup.describe(),
            },
        ),
        ("world size".into(), world.to_string()),
        ("memory".into(), memory_line(s, &setup, facts, frozen)),
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
        let what = if cpu { "cpu cores" } else { "replicas" };
        rows.push((what.into(), words.clone()));
    }
    rows.extend(lr_rows(s, &facts.groups));
    let (trainable, total) = w.counts;
    rows.push((
        "model".into(),
        if trainable == total {
            format!("{}, {total} parameters", info.model)
        } else {
            format!(
                "{}, {total} parameters, {trainable} trainable ({:.2} %)",
                info.model,
                100.0 * trainable as f64 / total.max(1) as f64
            )
        },
    ));
    if let Some(loaded) = &w.loaded {
        rows.push(("init".into(), loaded.describe()));
    }
    if let Some(words) = tune_line(config) {
        rows.push(("finetune".into(), words));
    }
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
        let scaled = match optim.scale_lr {
            crate::config::LrScaling::None => String::new(),
            ref how => format!(" ({} scaling of {:.3e})", name_of(how), optim.lr),
        };
        format!(
            "{:.3e}{scaled}, {} schedule",
            scaled_lr(optim, replicas, micros),
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

/// The start-up table's words for `[finetune]`, if it changes anything.
fn tune_line(config: &RootConfig) -> Option<String> {
    let f = &config.finetune;
    let mut parts = Vec::new();
    if !f.freeze.is_empty() {
        parts.push(format!("frozen: {}", f.freeze.join(", ")));
    }
    if let Some(l) = &f.lora {
        parts.push(format!(
            "LoRA rank {} alpha {} on {} (every other parameter frozen)",
            l.rank,
            l.alpha,
            l.targets.join(", ")
        ));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}
