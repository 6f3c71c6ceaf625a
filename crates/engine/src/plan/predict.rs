//! A candidate's prediction: its ranks as the launcher would lay them out (the core split
//! included), each rank's bytes — the strategy's estimate of its parameters, gradients and
//! optimizer state, and the probe's measured step bytes at its micro-batch — the process's
//! resident memory, and the step's seconds: the probe's compute, the optimizer's cost per
//! element, each collective measured, and the overlap the strategy has.

use std::collections::BTreeMap;

use serde::Serialize;

use super::candidates::Candidate;
use super::kept::Keeping;
use super::links::Links;
use super::probe::Point;
use crate::config::{RootConfig, StrategyKind, name_of};
use crate::cores::CoreSplit;
use crate::error::Result;
use crate::strategy::{ModelFacts, Op, Setup, Traffic};
use crate::trainer::TrainerSettings;

/// Two probe points of one precision and recompute mode, read as straight lines in the
/// micro-batch.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Fit {
    /// The smaller micro-batch's point.
    pub lo: Point,
    /// The larger micro-batch's point.
    pub hi: Point,
}

impl Fit {
    /// `f` at micro-batch `b`: the line through the two points (in proportion to the
    /// micro-batch from one point). Beyond the larger point, the larger of the line and the
    /// proportion, bytes and seconds alike: a key whose largest micro-batches were not probed
    /// under a limit (`rungs.rs`) is predicted neither smaller nor faster per sample than
    /// either reading of what was. (Without a limit no candidate lies beyond the larger.)
    pub(crate) fn at(&self, b: usize, f: fn(&Point) -> f64) -> f64 {
        let (x0, x1) = (self.lo.batch as f64, self.hi.batch as f64);
        let (y0, y1) = (f(&self.lo), f(&self.hi));
        let proportion = y1 * b as f64 / x1.max(1.0);
        if x1 <= x0 {
            return proportion;
        }
        let slope = ((y1 - y0) / (x1 - x0)).max(0.0);
        let line = (y1 + slope * (b as f64 - x1)).max(0.0);
        if b as f64 > x1 {
            line.max(proportion)
        } else {
            line
        }
    }

    /// The pages the allocator keeps per rank at micro-batch `b`: the larger of the two
    /// probes' (it does not follow the batch closely, and moves from launch to launch: each
    /// probe is one draw of it, as the run is another; their mean put 5 of 27 runs of `bench
    /// plan` 10-18 % above their prediction); beyond the larger point, that in proportion to
    /// the micro-batch (the GPT's pipeline under a limit kept 12.5 MiB a rank at 3 samples and
    /// 30.9 at 12).
    pub(crate) fn extra_at(&self, b: usize) -> f64 {
        let most = self.hi.resident_extra.max(self.lo.resident_extra);
        let top = self.hi.batch.max(self.lo.batch).max(1);
        if b > top {
            most * b as f64 / top as f64
        } else {
            most
        }
    }
}

/// What the planner measured before it predicts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Measured {
    /// Heap bytes live in the process before any rank is built (data, the workload).
    pub base_heap: f64,
    /// Resident bytes of the process beyond its heap then (code, stacks, kept pages).
    pub base_outside_heap: f64,
    /// Whether the devices are the CPU's (memory is the process's resident set).
    pub cpu: bool,
    /// The machine's cores.
    pub cores: usize,
    /// Threads the probe ran at once.
    pub probe_threads: usize,
    /// Probe lines by `precision/recompute`.
    pub fits: BTreeMap<String, Fit>,
    /// The collectives on the run's ranks.
    pub links: Links,
    /// Whether these measurements were read back from an earlier launch's, and where they are
    /// kept.
    pub kept: Keeping,
}

/// The key of a candidate's probe: the strategy its ranks run (a pipeline with its stage
/// count), its precision and its recompute mode.
pub(crate) fn fit_key(s: &TrainerSettings) -> String {
    // A strategy that steps as another (zero1's forward, backward and buffers are ddp's)
    // names that one's probe.
    let setup = s.setup();
    let kind = setup.rules().probe_as(&setup);
    // Inside tensor-parallel groups a rank runs its part: a probe of its own.
    let mesh = if setup.tp > 1 {
        format!("tp{}/", setup.tp)
    } else {
        String::new()
    };
    format!(
        "{mesh}{kind}/{}/{}",
        name_of(&s.precision.mode),
        name_of(&s.recompute.mode)
    )
}

/// What the planner predicts of one candidate.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    /// Strategy words (a pipeline's stages × micro-batches and schedule).
    pub strategy: String,
    /// Precision.
    pub precision: String,
    /// Recompute mode.
    pub recompute: String,
    /// Samples per micro-batch per device.
    pub batch_size: usize,
    /// Accumulation steps.
    pub accumulate: usize,
    /// Ranks in this process (devices × per-core sub-replicas).
    pub ranks: usize,
    /// Bytes per rank: parameters (with the compute copy and gathered units).
    pub params_bytes: f64,
    /// Bytes per rank: gradients.
    pub grads_bytes: f64,
    /// Bytes per rank: optimizer state.
    pub optim_bytes: f64,
    /// Bytes per rank at the step's peak beyond those: activations and the step's temporaries
    /// (measured by the probe).
    pub activation_bytes: f64,
    /// Peak bytes per device (a CPU device: its ranks together).
    pub device_bytes: f64,
    /// Peak resident bytes of the process (on a GPU: its host memory is not planned; the
    /// devices' sum).
    pub process_bytes: f64,
    /// Seconds per optimizer step.
    pub step_seconds: f64,
    /// Seconds of it in compute (forward, backward and building batches).
    pub compute_seconds: f64,
    /// Seconds of it in the optimizer step.
    pub update_seconds: f64,
    /// Seconds of it in collectives not hidden behind compute.
    pub comm_seconds: f64,
    /// Samples per second.
    pub samples_per_sec: f64,
    /// The flags that run it from the config given.
    pub flags: Vec<String>,
    /// Whether it is the config as given (a strategy named, not `auto`).
    pub own: bool,
    /// Whether the probe measured it; `false` for a plan whose held state alone is over the
    /// limit (its bytes are then that state's, a lower bound, and its times are not known).
    pub probed: bool,
    /// The config that runs it.
    #[serde(skip)]
    pub config: RootConfig,
}

impl Prediction {
    /// The memory figure that must fit a limit: the process's resident memory on the CPU
    /// (`per_process`), a device's elsewhere.
    pub fn need(&self, per_process: bool) -> f64 {
        if per_process {
            self.process_bytes
        } else {
            self.device_bytes
        }
    }
}

/// Predicts the candidate `held` describes (its bytes between steps, [`unprobed`]) with
/// `measured`: the step's bytes and its seconds. `settings` are the trainer's for its config,
/// the core split applied; `samples` per step.
pub(crate) fn predict(
    held: Prediction,
    settings: &TrainerSettings,
    facts: &ModelFacts,
    measured: &Measured,
    samples: usize,
) -> Result<Prediction> {
    let setup = settings.setup();
    let fit = measured
        .fits
        .get(&fit_key(settings))
        .expect("every candidate's precision and recompute mode was probed");
    let b = settings.train.batch_size;
    let ranks = held.ranks;
    let (stages, flush) = (setup.stages(), setup.flush());
    let rules = setup.rules();
    let mut p = held;
    add_step_bytes(&mut p, settings, fit, b, measured.cpu);

    // Seconds. The probe ran `probe_threads` ranks at once; on the CPU more ranks than cores
    // share them.
    let contention = if measured.cpu {
        let c = measured.cores.max(1) as f64;
        (ranks as f64 / c).max(1.0) / (measured.probe_threads as f64 / c).max(1.0)
    } else {
        1.0
    };
    // A pipeline stage's waits for its neighbours are its schedule's bubbles: they count.
    let waits = if rules.waits_are_work() {
        fit.at(b, |p| p.inside_sync_s)
    } else {
        0.0
    };
    let micro = (fit.at(b, |p| p.compute_s) + fit.at(b, |p| p.data_s) + waits) * contention;
    let micros = settings.micro_batches();
    // The probe's flush ran `stages` micro-batches through the stages; a flush of `flush`
    // takes `flush + stages - 1` slots where that one took `2 stages - 1` (one stage, one
    // micro-batch a flush: a slot per micro-batch).
    let accumulate = micros / flush;
    let slots = (flush + stages - 1) as f64 / (2 * stages - 1) as f64;
    let compute = accumulate as f64 * slots * micro;
    let total = facts.layout.total();
    // The optimizer step does not depend on the batch: the less disturbed of the two.
    let update = fit.lo.update_s.min(fit.hi.update_s) * contention;
    let comm = comm_seconds(&setup, &measured.links, total, micros, ranks);
    let hidden = if setup.overlap {
        comm.min(compute * 2.0 / 3.0)
    } else {
        0.0
    };
    let step = compute + update + comm - hidden;
    p.step_seconds = step;
    p.compute_seconds = compute;
    p.update_seconds = update;
    p.comm_seconds = comm - hidden;
    p.samples_per_sec = samples as f64 / step.max(1e-12);
    p.probed = true;
    Ok(p)
}

/// Adds to `p` (a candidate's bytes between steps, [`unprobed`]) its step's bytes at
/// micro-batch `b`, read from `fit`; `cpu`: the devices are the CPU's (the process's resident
/// memory counts the pages its allocator keeps).
pub(crate) fn add_step_bytes(
    p: &mut Prediction,
    settings: &TrainerSettings,
    fit: &Fit,
    b: usize,
    cpu: bool,
) {
    let setup = settings.setup();
    // A rank holds its share of a micro-batch's activations (a pipeline stage's 1/stages) for
    // every micro-batch in flight (a pipeline's were probed with as many micro-batches as
    // stages under 1F1B: all of them in flight).
    let step_bytes = fit.at(b, |p| p.step_bytes);
    let activation = step_bytes * setup.rules().in_flight(&setup) as f64 / setup.stages() as f64;
    let sub = settings.parallel.sub_replicas.max(1);
    // Pages the allocator keeps per rank, in the process's resident memory.
    let extra = if cpu { fit.extra_at(b) } else { 0.0 };
    p.activation_bytes = activation;
    p.device_bytes += activation * sub as f64;
    p.process_bytes += p.ranks as f64 * (activation + extra);
}

/// A candidate before the probe: what its ranks hold between steps (the strategy's estimate per
/// rank; `floor`, the process's bytes before any rank), its step not yet known. Where this
/// alone is over the limit the candidate is not probed and stays so; otherwise [`predict`]
/// adds its step.
pub(crate) fn unprobed(
    candidate: &Candidate,
    base: &RootConfig,
    settings: &TrainerSettings,
    facts: &ModelFacts,
    floor: f64,
) -> Result<Prediction> {
    let c = &candidate.config;
    let e = settings.setup().estimate(&facts.layout, &settings.optim)?;
    let held = (e.params + e.grads + e.optim) as f64;
    let ranks = settings.parallel.devices.len();
    let sub = settings.parallel.sub_replicas.max(1);
    let flags = candidate.flags(base);
    Ok(Prediction {
        strategy: candidate.strategy_words(),
        precision: name_of(&c.precision.mode),
        recompute: name_of(&c.recompute.mode),
        batch_size: c.train.batch_size,
        accumulate: c.train.accumulate,
        ranks,
        params_bytes: e.params as f64,
        grads_bytes: e.grads as f64,
        optim_bytes: e.optim as f64,
        activation_bytes: 0.0,
        device_bytes: held * sub as f64,
        process_bytes: floor + held * ranks as f64,
        step_seconds: 0.0,
        compute_seconds: 0.0,
        update_seconds: 0.0,
        comm_seconds: 0.0,
        samples_per_sec: 0.0,
        own: base.strategy.name != StrategyKind::Auto && flags.is_empty(),
        flags,
        probed: false,
        config: c.clone(),
    })
}

/// The collectives' seconds of one step under `setup` over `total` parameters, `micros`
/// micro-batches, `local` of the ranks in this process: each collective the strategy says
/// its step calls ([`crate::strategy::Costs::traffic`]), timed on the run's links.
fn comm_seconds(setup: &Setup, l: &Links, total: usize, micros: usize, local: usize) -> f64 {
    if l.ranks < 2 {
        return 0.0;
    }
    let traffic = setup.rules().traffic(setup, total, local);
    let time = |t: &Traffic| {
        let one = match t.op {
            Op::AllReduce => l.all_reduce(t.floats),
            Op::ReduceScatter => l.reduce_scatter(t.floats),
            Op::AllGather => l.all_gather(t.floats),
        };
        t.times as f64 * one / t.every as f64
    };
    let sum = |per_micro: bool| -> f64 {
        traffic
            .iter()
            .filter(|t| t.per_micro_batch == per_micro)
            .map(time)
            .fold(0.0, |a, x| a + x)
    };
    micros as f64 * sum(true) + sum(false)
}

/// The trainer's settings for `config` on `devices`, with the core split applied as the
/// launcher applies it; a split the launcher would refuse (`hardware.replicas_per_device`) is
/// refused here too.
pub(crate) fn settings_for(
    config: &RootConfig,
    devices: &[burn::prelude::Device],
    accelerator: &str,
    facts: &ModelFacts,
) -> crate::error::Result<TrainerSettings> {
    let mut s = TrainerSettings::from_config(
        config,
        devices.to_vec(),
        accelerator.to_string(),
        config.run_dir(),
    );
    let processes = crate::comm::processes().count;
    let cpu = accelerator.starts_with("cpu");
    let split = CoreSplit::plan(config, devices.len(), cpu, processes, facts)?;
    split.apply(&mut s, facts);
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(batch: usize, step_bytes: f64, compute_s: f64) -> Point {
        Point {
            batch,
            step_bytes,
            compute_s,
            ..Point::default()
        }
    }

    #[test]
    fn a_fit_is_the_line_through_its_two_points() {
        let fit = Fit {
            lo: point(6, 100.0, 0.05),
            hi: point(12, 160.0, 0.11),
        };
        assert!((fit.at(12, |p| p.step_bytes) - 160.0).abs() < 1e-9);
        assert!((fit.at(3, |p| p.step_bytes) - 70.0).abs() < 1e-9);
        assert!((fit.at(24, |p| p.compute_s) - 0.23).abs() < 1e-9);
        // Never below zero, never falling with the batch.
        let odd = Fit {
            lo: point(6, 100.0, 0.05),
            hi: point(12, 40.0, 0.01),
        };
        assert!((odd.at(3, |p| p.step_bytes) - 40.0).abs() < 1e-9);
        // One point: proportional.
        let one = Fit {
            lo: point(4, 80.0, 0.04),
            hi: point(4, 80.0, 0.04),
        };
        assert!((one.at(2, |p| p.step_bytes) - 40.0).abs() < 1e-9);
        // Beyond the larger point, never below the proportion: the line through (6, 100) and
        // (12, 110) gives 130 at 24, the proportion 220.
        let flat = Fit {
            lo: point(6, 100.0, 0.05),
            hi: point(12, 110.0, 0.11),
        };
        assert!((flat.at(24, |p| p.step_bytes) - 220.0).abs() < 1e-9);
        assert!((flat.at(9, |p| p.step_bytes) - 105.0).abs() < 1e-9);
    }

    #[test]
    fn the_pages_kept_are_the_larger_probes_and_grow_past_the_larger_batch() {
        let kept = |batch, mib: f64| Point {
            batch,
            resident_extra: mib,
            ..Point::default()
        };
        let fit = Fit {
            lo: kept(3, 12.0),
            hi: kept(6, 9.0),
        };
        assert_eq!(fit.extra_at(3), 12.0);
        assert_eq!(fit.extra_at(6), 12.0);
        assert_eq!(fit.extra_at(12), 24.0);
    }

    fn setup_of(kind: StrategyKind, world: usize) -> Setup {
        let mut c = RootConfig::default();
        c.strategy.name = kind;
        c.pipeline.stages = 2;
        c.diloco.inner_steps = 7;
        Setup::new(&c, world)
    }

    #[test]
    fn collectives_per_strategy_follow_their_calls() {
        let l = Links {
            ranks: 2,
            floats: 1000,
            all_reduce_s: 2.0,
            reduce_scatter_s: 1.0,
            all_gather_s: 1.0,
        };
        let t = |k| comm_seconds(&setup_of(k, 2), &l, 1000, 2, 2);
        assert_eq!(t(StrategyKind::Single), 0.0);
        assert_eq!(t(StrategyKind::Ddp), 2.0);
        assert_eq!(t(StrategyKind::Zero1), 3.0);
        assert_eq!(t(StrategyKind::Zero2), 3.0);
        assert_eq!(t(StrategyKind::Zero3), 6.0);
        assert_eq!(t(StrategyKind::Pipeline), 0.0);
        assert_eq!(t(StrategyKind::Diloco), 2.0 + 2.0 / 7.0);
        let none = Links::none(1000);
        assert_eq!(
            comm_seconds(&setup_of(StrategyKind::Ddp, 1), &none, 1000, 1, 1),
            0.0
        );
    }

    /// The strategies' traffic gives, to the bit, what the planner composed itself when it
    /// named each strategy (the formulas kept here as they were).
    #[test]
    fn the_strategies_traffic_is_the_planners_old_arithmetic() {
        let l = Links {
            ranks: 4,
            floats: 12_345,
            all_reduce_s: 0.0371,
            reduce_scatter_s: 0.0193,
            all_gather_s: 0.0217,
        };
        let total = 98_765;
        for micros in [1, 3, 8] {
            let m = micros as f64;
            let (ar, rs, ag) = (
                l.all_reduce(total),
                l.reduce_scatter(total),
                l.all_gather(total),
            );
            let old = [
                (StrategyKind::Ddp, ar),
                (StrategyKind::Zero1, ar + ag),
                (StrategyKind::Zero2, m * rs + ag),
                (StrategyKind::Zero3, m * (2.0 * ag + rs)),
                (StrategyKind::Pipeline, l.all_reduce(total / 2)),
            ];
            for (kind, seconds) in old {
                let new = comm_seconds(&setup_of(kind, 4), &l, total, micros, 4);
                assert_eq!(
                    new.to_bits(),
                    seconds.to_bits(),
                    "{kind:?}, {micros} micro-batches"
                );
            }
            for local in [1, 2] {
                let inner = if local > 1 { ar } else { 0.0 };
                let old = inner + ar / 7.0;
                let new =
                    comm_seconds(&setup_of(StrategyKind::Diloco, 4), &l, total, micros, local);
                assert_eq!(new.to_bits(), old.to_bits(), "diloco, {local} local ranks");
            }
        }
    }
}
