//! [`plan`]: the candidates, their probes and the links measured, each candidate predicted and
//! judged against the memory limit.

use std::time::Instant;

use burn::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::candidates::{Candidate, candidates};
use super::kept::{Entry, Kept, build_identity, machine_identity};
use super::links;
use super::predict::{Measured, Prediction, predict, settings_for, unprobed};
use super::probe::resident_bytes;
use super::rungs::{Guard, Rungs, fits, probed, rungs};
use crate::comm::agreed;
use crate::config::{PrecisionMode, RootConfig, StrategyKind};
use crate::error::Result;
use crate::strategy::{ModelFacts, Setup};
use crate::trainer::{TrainerSettings, Workload, refusal, sampler};

pub use crate::config::HEADROOM;

/// The planner's answer for one config.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Ranks of the run, over every process.
    pub world: usize,
    /// Samples per optimizer step every candidate keeps.
    pub samples_per_step: usize,
    /// What the memory figure that must fit is: `"process"` (the CPU's resident memory) or
    /// `"device"`.
    pub memory: String,
    /// The limit, in bytes, if there is one.
    pub limit_bytes: Option<f64>,
    /// Where the limit comes from (`hardware.memory_limit_mib`, the memory available).
    pub limit_source: String,
    /// Candidates that fit, fastest first.
    pub fitting: Vec<Prediction>,
    /// Candidates that do not fit, least memory first.
    pub over: Vec<Prediction>,
    /// Candidates the settings' checks refuse, with the refusal.
    pub refused: Vec<(String, String)>,
    /// What `--strategy auto` would run, where the config leaves the strategy to it on
    /// several ranks (`train plan` says it).
    pub auto: Option<String>,
    /// What was measured.
    pub measured: Measured,
    /// Seconds the planner took.
    pub seconds: f64,
}

impl Plan {
    /// The memory figure of `p` that must fit the limit.
    pub fn need(&self, p: &Prediction) -> f64 {
        p.need(self.memory == "process")
    }
}

/// What the planner is asked: every candidate (`train plan`, a refusal's nearest plan), the
/// candidates of the config's own precision (`--strategy auto`, which keeps the numbers the
/// user asked for), or the run's own settings only (its `summary.json` record, its budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every candidate: every strategy, precision, recompute mode and micro-batch.
    All,
    /// Every candidate in the config's precision.
    SamePrecision,
    /// The config as it is.
    Own,
}

/// What a plan is of besides the config: the devices and their accelerator, whether the model
/// draws random numbers in its forward ([`crate::trainer::Checked::draws`]), and the workload's
/// own settings (a program's `[model]` and `[data]` as TOML), which name the measurements kept
/// between launches together with the config.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// The devices.
    pub devices: &'a [Device],
    /// Their accelerator's name (`cpu`, `cuda`, …).
    pub accelerator: &'a str,
    /// Whether the model draws random numbers in its forward.
    pub draws: bool,
    /// The workload's own settings.
    pub workload: &'a str,
}

/// What every process plans with: process 0's kept measurements (its bytes before any rank
/// measured now where none were kept) and its memory limit, so that every process of a run
/// predicts the same and decides the same.
#[derive(Serialize, Deserialize)]
struct Known {
    entry: Entry,
    limit: Option<f64>,
    source: String,
}

/// Plans `workload` under `config` on `target`'s devices.
///
/// The measurements a prediction rests on are process 0's, read back from the entry an
/// earlier launch of the same model, settings and machine kept (`plan/kept.rs`) or measured
/// now and kept; every process uses the same, so one rule decides the same way on every
/// process and every launch. Each probe key is measured at the smallest and largest
/// micro-batch of every candidate with that key, whatever the scope: a candidate's prediction
/// does not depend on which others were weighed beside it. Under a memory limit the larger
/// only where what is measured predicts that its probe fits (`rungs.rs`): the probes keep the
/// process under the limit as the run does.
pub fn plan<W: Workload>(
    workload: &W,
    config: &RootConfig,
    target: &Target,
    scope: Scope,
) -> Result<Plan> {
    let started = Instant::now();
    let (devices, accelerator) = (target.devices, target.accelerator);
    // The allocator as a run sets it, so that what the probe measures is what a run holds.
    crate::heap::pages_for_a_run(config.hardware.memory_limit_mib.is_some());
    crate::heap::release_free();
    let base_heap = crate::heap::live().unwrap_or(0) as f64;
    let floor_now = (base_heap, (resident_bytes() - base_heap).max(0.0));
    let cpu = accelerator.starts_with("cpu");
    let model = kiln_models::with_rng(|| {
        kiln_models::materialized(workload.init_model(&devices[0].clone().autodiff()))
    });
    let world = devices.len() * crate::comm::processes().count;
    // Under tensor parallelism a rank holds its part: the layout the estimates read, for the
    // config's group size and each other one the model can be cut into inside a process.
    let parts = Parts::of::<W::Batch, _>(&model, config.parallel.tp, world, devices.len());
    let facts = parts.of_tp(config.parallel.tp).clone();
    let own = settings_for(config, devices, accelerator, &facts)?;
    let samples = sampler(workload.train_len(), &own)?.samples_per_step();
    // Every candidate the settings' checks allow (the probe's micro-batches come from them),
    // and those of the scope.
    let every = allowed_of(
        workload,
        &model,
        config,
        target,
        samples,
        &parts,
        Scope::All,
    );
    let (allowed, refused) = if scope == Scope::All {
        every.clone()
    } else {
        allowed_of(workload, &model, config, target, samples, &parts, scope)
    };
    let rungs = rungs(every.0.iter().chain(&allowed));
    drop(model);
    let signature = || signature(config, target, &facts, workload.train_len());
    let (mut kept, known) = known(config, signature, floor_now, cpu)?;
    let (base_heap, base_outside_heap) = known.entry.floor.unwrap_or_default();
    let limit_bytes = known.limit;
    // A candidate whose held state alone is over the limit is not probed (its probe would
    // need that memory): it does not fit, by at least that much.
    let floor = if cpu {
        base_heap + base_outside_heap
    } else {
        0.0
    };
    let mut unfit = Vec::new();
    let mut held = Vec::with_capacity(allowed.len());
    for (c, s) in allowed {
        let p = unprobed(&c, config, &s, parts.of_tp(c.config.parallel.tp), floor)?;
        if limit_bytes.is_some_and(|l| p.need(cpu) * (1.0 + HEADROOM) > l) {
            unfit.push(p);
        } else {
            held.push((p, s));
        }
    }
    let cores = config.hardware.cores();
    let how = (cpu.then_some(cores), target.draws, facts.layout.total());
    let guard = Guard {
        limit: limit_bytes,
        cpu,
    };
    let fresh = fresh(workload, &held, &rungs, &known.entry, (how, guard), &own)?;
    let measured = Measured {
        base_heap,
        base_outside_heap,
        cpu,
        cores,
        probe_threads: own.parallel.devices.len(),
        fits: fits(&held, &rungs, &fresh, &known.entry),
        links: fresh
            .links
            .or(known.entry.links)
            .unwrap_or_else(|| links::Links::none(facts.layout.total())),
        kept: kept.store(&fresh),
    };
    let mut plan = Plan {
        world,
        samples_per_step: samples,
        memory: if cpu { "process" } else { "device" }.to_string(),
        limit_bytes,
        limit_source: known.source,
        fitting: Vec::new(),
        over: unfit,
        refused,
        measured,
        auto: None,
        seconds: 0.0,
    };
    for (p, s) in held {
        let p = predict(
            p,
            &s,
            parts.of_tp(s.parallel.mesh.tp),
            &plan.measured,
            samples,
        )?;
        if limit_bytes.is_some_and(|l| plan.need(&p) * (1.0 + HEADROOM) > l) {
            plan.over.push(p);
        } else {
            plan.fitting.push(p);
        }
    }
    plan.fitting
        .sort_by(|a, b| b.samples_per_sec.total_cmp(&a.samples_per_sec));
    plan.over
        .sort_by(|a, b| a.need(cpu).total_cmp(&b.need(cpu)));
    if scope == Scope::All && is_auto(config) && world > 1 {
        plan.auto = Some(match plan.choose(config, facts.buffers) {
            Ok(choice) => choice.words,
            Err(e) => e.to_string(),
        });
    }
    plan.seconds = started.elapsed().as_secs_f64();
    Ok(plan)
}

/// Process 0's kept measurements (opened by `signature` where `hardware.plan_cache` keeps
/// them) with its bytes before any rank (`floor_now`) where none were kept, and its memory
/// limit, on every process.
fn known(
    config: &RootConfig,
    signature: impl FnOnce() -> String,
    floor_now: (f64, f64),
    cpu: bool,
) -> Result<(Kept, Known)> {
    let kept = if crate::comm::processes().index > 0 {
        Kept::off(None)
    } else if config.hardware.plan_cache {
        Kept::open(&signature())
    } else {
        Kept::off(Some(
            "hardware.plan_cache = false: measured now, not kept".into(),
        ))
    };
    let known: Known = agreed(|| {
        let mut entry = kept.entry().clone();
        entry.floor.get_or_insert(floor_now);
        let (limit, source) = limit(config, cpu);
        Ok(Known {
            entry,
            limit,
            source,
        })
    })?;
    Ok((kept, known))
}

/// What `known` lacks, measured now on every process ([`measure`]; the probes' collectives
/// span them all), and process 0's measurements on every process.
fn fresh<W: Workload>(
    workload: &W,
    held: &[(Prediction, TrainerSettings)],
    rungs: &Rungs,
    known: &Entry,
    how: ((Option<usize>, bool, usize), Guard),
    own: &TrainerSettings,
) -> Result<Entry> {
    let mut failed = None;
    let here = match measure(workload, held, rungs, known, how, own) {
        Ok(entry) => entry,
        Err(e) => {
            failed = Some(e);
            Entry::default()
        }
    };
    let fresh: Entry = agreed(|| match failed.take() {
        Some(e) => Err(e),
        None => Ok(here),
    })?;
    match failed {
        Some(e) => Err(e),
        None => Ok(fresh),
    }
}

/// Candidates of `scope` with their trainer settings, those the settings' checks allow, and
/// one line per refused strategy.
type Allowed = (Vec<(Candidate, TrainerSettings)>, Vec<(String, String)>);

/// The candidates `scope` weighs that the settings' checks allow, and the refusals.
fn allowed_of<W: Workload>(
    workload: &W,
    model: &W::Model,
    config: &RootConfig,
    target: &Target,
    samples: usize,
    parts: &Parts,
    scope: Scope,
) -> Allowed {
    let world = target.devices.len() * crate::comm::processes().count;
    let mut allowed = Vec::new();
    let mut refused = Vec::new();
    for c in listed(config, world, samples, parts, scope) {
        let facts = parts.of_tp(c.config.parallel.tp);
        let checked = settings_for(&c.config, target.devices, target.accelerator, facts)
            .and_then(|s| refusal(workload, model, &s).map(|()| s));
        match checked {
            Ok(s) => allowed.push((c, s)),
            Err(e) => {
                // One line per refusal, however many of its variants were weighed.
                let row = (c.strategy_words(), e.to_string());
                if !refused.contains(&row) {
                    refused.push(row);
                }
            }
        }
    }
    (allowed, refused)
}

/// The text that names a plan's kept measurements: the build, the machine, the devices and
/// processes, the model's parameters, and every setting the measurements depend on (those a
/// candidate changes — strategy, precision, recompute, micro-batch — are in each point's own
/// name; those that change no measurement — the run's name, length, logging, limit — are left
/// out, so that a longer run or another limit reads the same entry).
fn signature(config: &RootConfig, target: &Target, facts: &ModelFacts, train_len: usize) -> String {
    let mut c = config.clone();
    c.run = Default::default();
    c.train = crate::config::TrainConfig {
        grad_clip: c.train.grad_clip,
        ..Default::default()
    };
    c.monitor = Default::default();
    c.export = Default::default();
    c.schedule = Default::default();
    c.hardware.memory_limit_mib = None;
    c.hardware.memory_limit_force = false;
    c.strategy.name = StrategyKind::Auto;
    c.pipeline = crate::config::PipelineConfig {
        cuts: c.pipeline.cuts.clone(),
        ..Default::default()
    };
    c.precision.mode = PrecisionMode::F32;
    c.recompute.mode = crate::config::RecomputeMode::None;
    let layout: String = facts
        .layout
        .entries
        .iter()
        .map(|e| format!("{} {:?}\n", e.path, e.shape))
        .collect();
    let layout = Sha256::digest(layout.as_bytes());
    let layout: String = layout[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}\n{}\n{} devices of {} ({:?}), {} process(es)\nmodel: {} parameters in {} tensors \
         (layout {layout}), {} blocks, draws {}; {train_len} training samples\n{}\n{}",
        build_identity(),
        machine_identity(),
        target.devices.len(),
        target.accelerator,
        target.devices,
        crate::comm::processes().count,
        facts.layout.total(),
        facts.layout.entries.len(),
        facts.blocks,
        target.draws,
        target.workload,
        c.to_toml()
    )
}

/// What the planner knows of the model for each tensor-parallel group size it weighs: the
/// facts of a rank's part (the whole model's for 1).
pub(crate) struct Parts {
    /// `(tp, facts)`, the config's size first.
    sizes: Vec<(usize, ModelFacts)>,
}

impl Parts {
    /// The facts of `model` for the config's `tp` and, where the model says how it is cut, for
    /// every other group size of 1 or more that divides both the `world` and the `local`
    /// devices of a process (a group stays inside one) and that the model accepts.
    fn of<B, M: kiln_models::BlockStack<B> + burn::module::Module>(
        model: &M,
        tp: usize,
        world: usize,
        local: usize,
    ) -> Self {
        let part = |t: usize| crate::strategy::part_if_cut::<B, M>(model, t);
        let own = part(tp).unwrap_or_else(|| model.clone());
        let mut sizes = vec![(tp, ModelFacts::of::<B, _>(&own))];
        for t in 1..=local {
            if t == tp || !world.is_multiple_of(t) || !local.is_multiple_of(t) {
                continue;
            }
            // Only a size the model is cut into: it says how, accepts that many ranks and
            // holds no weight that cannot be cut (a quantized base).
            if let Some(p) = part(t) {
                sizes.push((t, ModelFacts::of::<B, _>(&p)));
            }
        }
        Self { sizes }
    }

    /// The group sizes weighed, the config's first.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        self.sizes.iter().map(|(t, _)| *t).collect()
    }

    /// The facts for group size `tp` (the config's where it is not weighed).
    pub(crate) fn of_tp(&self, tp: usize) -> &ModelFacts {
        self.sizes
            .iter()
            .find(|(t, _)| *t == tp)
            .map_or(&self.sizes[0].1, |(_, f)| f)
    }
}

/// `list`'s candidates for `base` at each tensor-parallel group size `parts` weighs (the data
/// dimension's replicas then what the devices leave).
fn each_tp(
    base: &RootConfig,
    parts: &Parts,
    list: impl Fn(&RootConfig, &ModelFacts) -> Vec<Candidate>,
) -> Vec<Candidate> {
    parts
        .sizes()
        .into_iter()
        .flat_map(|tp| {
            let mut c = base.clone();
            if tp != base.parallel.tp {
                c.parallel.tp = tp;
                c.parallel.dp = None;
            }
            list(&c, parts.of_tp(tp))
        })
        .collect()
}

/// The candidates `scope` weighs for `config` on `world` ranks with `samples` per step.
fn listed(
    config: &RootConfig,
    world: usize,
    samples: usize,
    parts: &Parts,
    scope: Scope,
) -> Vec<Candidate> {
    let processes = crate::comm::processes().count;
    let mut resolved = config.clone();
    resolved.strategy.name = config.strategy_on(world);
    let own = config.precision.mode;
    match scope {
        Scope::All => {
            let mut precisions = vec![own];
            for m in [PrecisionMode::F32, PrecisionMode::Bf16Mixed] {
                if !precisions.contains(&m) {
                    precisions.push(m);
                }
            }
            each_tp(&resolved, parts, |base, facts| {
                candidates(base, world, processes, samples, facts, &precisions)
            })
        }
        Scope::SamePrecision => each_tp(&resolved, parts, |base, facts| {
            candidates(base, world, processes, samples, facts, &[own])
        }),
        Scope::Own => {
            let words = Setup::new(&resolved, world).words();
            vec![Candidate {
                config: resolved,
                words,
            }]
        }
    }
}

/// What `known` lacks, measured now on every process: each key's probe points (see
/// [`probed`]) and the collectives' seconds over the run's ranks (`own`); `how`: the
/// machine's cores when the devices are the CPU's, whether the model draws random numbers, and
/// the model's trainable floats; and the limit the probes keep under.
fn measure<W: Workload>(
    workload: &W,
    held: &[(Prediction, TrainerSettings)],
    rungs: &Rungs,
    known: &Entry,
    how: ((Option<usize>, bool, usize), Guard),
    own: &TrainerSettings,
) -> Result<Entry> {
    let ((cpu_cores, draws, floats), guard) = how;
    let mut fresh = Entry {
        floor: known.floor,
        ..Entry::default()
    };
    probed(
        workload,
        held,
        rungs,
        known,
        (cpu_cores, draws),
        guard,
        &mut fresh,
    )?;
    if known.links.is_none() {
        let ranks = own.parallel.devices.len();
        fresh.links = Some(links::measure(crate::comm::world_group(ranks)?, floats)?);
    }
    Ok(fresh)
}

/// The memory limit in bytes and where it comes from: `hardware.memory_limit_mib`, or on the
/// CPU the memory available to the process (what it holds now and what the system has free).
fn limit(config: &RootConfig, cpu: bool) -> (Option<f64>, String) {
    if let Some(mib) = config.hardware.memory_limit_mib {
        return (
            Some(mib * 1024.0 * 1024.0),
            "hardware.memory_limit_mib".to_string(),
        );
    }
    if cpu && let Some(available) = available_bytes() {
        // Processes on one machine share what it has free (OpenMPI says how many there are).
        let here = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or(1.0)
            .max(1.0);
        return (
            Some(available / here + resident_bytes()),
            "the memory available to the process".to_string(),
        );
    }
    (None, "none".to_string())
}

/// The memory the system has available (Linux's `MemAvailable`, capped by the cgroup's limit).
fn available_bytes() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: f64 = text
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let mut bytes = kib * 1024.0;
    if let Ok(max) = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        && let Ok(max) = max.trim().parse::<f64>()
    {
        let used = std::fs::read_to_string("/sys/fs/cgroup/memory.current")
            .ok()
            .and_then(|u| u.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        bytes = bytes.min((max - used).max(0.0));
    }
    Some(bytes)
}

/// Whether `kind` is one the planner picks for `auto`.
pub(crate) fn is_auto(config: &RootConfig) -> bool {
    config.strategy.name == StrategyKind::Auto
}
