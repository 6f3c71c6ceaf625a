//! [`plan`]: the candidates, their probes and the links measured, each candidate predicted and
//! judged against the memory limit.

use std::collections::BTreeMap;
use std::time::Instant;

use burn::prelude::*;
use serde::Serialize;

use super::candidates::{Candidate, candidates};
use super::links;
use super::predict::{Fit, Measured, Prediction, fit_key, predict, settings_for, unprobed};
use super::probe::{ProbeSetup, probe, resident_bytes};
use crate::config::{PrecisionMode, RootConfig, StrategyKind};
use crate::error::Result;
use crate::strategy::ModelFacts;
use crate::trainer::{TrainerSettings, Workload, refusal, sampler};

/// The share of a limit kept free for the prediction's error: a plan fits when its need and
/// this much more do (`cargo xtask bench plan` measures the error; BENCHMARKS.md).
pub const HEADROOM: f64 = 0.10;

/// The planner's answer for one config.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
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

/// Plans `workload` under `config` on `devices` (of `accelerator`); `draws`: the model draws
/// random numbers in its forward ([`crate::trainer::Checked::draws`]).
pub fn plan<W: Workload>(
    workload: &W,
    config: &RootConfig,
    devices: &[Device],
    accelerator: &str,
    scope: Scope,
    draws: bool,
) -> Result<Plan> {
    let started = Instant::now();
    crate::heap::release_free();
    let base_heap = crate::heap::live().unwrap_or(0) as f64;
    let base_outside_heap = (resident_bytes() - base_heap).max(0.0);
    let cpu = accelerator.starts_with("cpu");
    let model = kiln_models::with_rng(|| {
        kiln_models::materialized(workload.init_model(&devices[0].clone().autodiff()))
    });
    let facts = ModelFacts::of::<W::Batch, _>(&model);
    let world = devices.len() * crate::comm::processes().count;
    let own = settings_for(config, devices, accelerator, &facts);
    let samples = sampler(workload.train_len(), &own)?.samples_per_step();
    let list = listed(config, world, samples, &facts, scope);
    // The candidates the settings' checks allow, with their trainer settings.
    let mut allowed = Vec::new();
    let mut refused = Vec::new();
    for c in list {
        let s = settings_for(&c.config, devices, accelerator, &facts);
        match refusal(workload, &model, &s) {
            Ok(()) => allowed.push((c, s)),
            Err(e) => {
                // One line per refusal, however many of its variants were weighed.
                let row = (c.strategy_words(), e.to_string());
                if !refused.contains(&row) {
                    refused.push(row);
                }
            }
        }
    }
    drop(model);
    // A candidate whose held state alone is over the limit is not probed (its probe would
    // need that memory): it does not fit, by at least that much.
    let (limit_bytes, limit_source) = limit(config, cpu);
    let floor = if cpu {
        base_heap + base_outside_heap
    } else {
        0.0
    };
    let mut unfit = Vec::new();
    let mut held = Vec::with_capacity(allowed.len());
    for (c, s) in allowed {
        let p = unprobed(&c, config, &s, &facts, floor)?;
        if limit_bytes.is_some_and(|l| p.need(cpu) * (1.0 + HEADROOM) > l) {
            unfit.push(p);
        } else {
            held.push((p, s));
        }
    }
    let cores = config.hardware.cores();
    let fits = probed(workload, &held, cpu.then_some(cores), draws)?;
    let links = links::measure(
        crate::comm::world_group(own.parallel.devices.len())?,
        facts.layout.total(),
    )?;
    let measured = Measured {
        base_heap,
        base_outside_heap,
        cpu,
        cores,
        probe_threads: own.parallel.devices.len(),
        fits,
        links,
    };
    let mut plan = Plan {
        samples_per_step: samples,
        memory: if cpu { "process" } else { "device" }.to_string(),
        limit_bytes,
        limit_source,
        fitting: Vec::new(),
        over: unfit,
        refused,
        measured,
        auto: None,
        seconds: 0.0,
    };
    for (p, s) in held {
        let p = predict(p, &s, &facts, &plan.measured, samples)?;
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

/// The candidates `scope` weighs for `config` on `world` ranks with `samples` per step.
fn listed(
    config: &RootConfig,
    world: usize,
    samples: usize,
    facts: &ModelFacts,
    scope: Scope,
) -> Vec<Candidate> {
    let processes = crate::comm::processes().count;
    let mut resolved = config.clone();
    resolved.strategy.name = config.strategy.name.resolve(world);
    let own = config.precision.mode;
    match scope {
        Scope::All => {
            let mut precisions = vec![own];
            for m in [PrecisionMode::F32, PrecisionMode::Bf16Mixed] {
                if !precisions.contains(&m) {
                    precisions.push(m);
                }
            }
            candidates(&resolved, world, processes, samples, facts, &precisions)
        }
        Scope::SamePrecision => candidates(&resolved, world, processes, samples, facts, &[own]),
        Scope::Own => vec![Candidate { config: resolved }],
    }
}

/// The probe's two points for every key among the `allowed` candidates: the smallest and
/// largest micro-batch of the candidates it serves, so that every prediction lies between two
/// measurements.
fn probed<W: Workload>(
    workload: &W,
    allowed: &[(Prediction, TrainerSettings)],
    cpu_cores: Option<usize>,
    draws: bool,
) -> Result<BTreeMap<String, Fit>> {
    crate::panics::quiet_worker_panics();
    let mut fits = BTreeMap::new();
    for (_, settings) in allowed {
        let key = fit_key(settings);
        if fits.contains_key(&key) {
            continue;
        }
        let batches = allowed
            .iter()
            .filter(|(_, o)| fit_key(o) == key)
            .map(|(_, o)| o.train.batch_size);
        let hi = batches.clone().max().unwrap_or(1);
        let lo = batches.min().unwrap_or(1).min(hi / 2).max(1);
        let setup = |batch: usize| {
            let mut s = settings.clone();
            s.train.batch_size = batch;
            s.train.accumulate = 1;
            // A pipeline is probed with one micro-batch per stage under 1F1B.
            s.parallel.pipeline.microbatches = s.parallel.pipeline.stages;
            s.parallel.pipeline.schedule = crate::config::PipelineSchedule::OneFOneB;
            ProbeSetup {
                settings: s,
                cpu_cores,
                draws,
            }
        };
        let first = fits.is_empty();
        let hi_point = probe(workload, &setup(hi), hi, first)?;
        let lo_point = if lo < hi {
            probe(workload, &setup(lo), lo, false)?
        } else {
            hi_point
        };
        fits.insert(
            key,
            Fit {
                lo: lo_point,
                hi: hi_point,
            },
        );
    }
    Ok(fits)
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
