//! The probe: the real model's steps on the real backend, measured. The run's ranks of this
//! process (threads, each with its rayon share of the cores as a rank has; across processes
//! with the world's) build the candidate's strategy with its precision and recompute and take
//! a few optimizer steps of `batch` samples per micro-batch: the heap the steps add above what
//! the strategies hold between steps (activations, gradients, the compute copy, buffers), the
//! seconds of the forward and backward (collectives inside them left out), of the optimizer
//! step, and of building a batch.

use std::sync::Barrier;
use std::time::Instant;

use burn::prelude::*;
use kiln_models::TrainStep;

use crate::comm::Collective;
use crate::error::{Error, Result};
use crate::precision::Policy;
use crate::strategy::{Context, Mesh, Strategy, build};
use crate::trainer::{TrainerSettings, Workload};

/// What the probe runs: a candidate's trainer settings (its ranks, the core split applied)
/// and the machine's cores when the devices are the CPU's.
#[derive(Clone)]
pub(crate) struct ProbeSetup {
    /// The settings.
    pub settings: TrainerSettings,
    /// The machine's cores when the devices are CPU devices (each thread then runs its
    /// kernels on a rayon pool of its share, as a rank does).
    pub cpu_cores: Option<usize>,
    /// Whether the model draws random numbers in a forward: its forwards are seeded, one at a
    /// time, as the trainer runs them.
    pub draws: bool,
}

/// One probe point: bytes per thread; seconds of a step's slowest thread, the median over the
/// timed steps.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Point {
    /// Samples per micro-batch.
    pub batch: usize,
    /// Bytes a thread's step holds at its peak above what its strategy holds between steps:
    /// the heap's on the CPU, the device pool's where there is one.
    pub step_bytes: f64,
    /// Heap bytes a thread's strategy holds between steps (model, optimizer state).
    pub held_bytes: f64,
    /// Seconds of one micro-batch's forward and backward (every parameter group's).
    pub compute_s: f64,
    /// Seconds of the optimizer step (every group's).
    pub update_s: f64,
    /// Seconds the forward and backward waited in collectives (ZeRO's gathers and
    /// reduce-scatters, a pipeline's activations from the next stage).
    pub inside_sync_s: f64,
    /// Seconds building one batch.
    pub data_s: f64,
    /// Resident bytes the process grew by in the steps beyond the heap it grew by, per thread
    /// (freed pages the allocator keeps, stacks), counted from the strategies built and what
    /// building them freed handed back, as a run's ranks start.
    pub resident_extra: f64,
}

/// Steps the probe takes before it times (the first builds the optimizer state and warms the
/// allocator; a process's first probe takes one more, for the pages it touches first) and
/// steps it times at least.
const WARM: usize = 1;
const TIMED: usize = 3;

/// More steps after those on CPU devices, timed too, so that the resident memory the probe
/// reads has reached what a run's settles at: the pages the allocator keeps grow over a run's
/// first steps and then stay (the GPT recipe under zero3 + bf16-mixed: 243 MiB after 3
/// steps, 271 after 10, 287 after 30, 290 after 100 and 200). Their times go into the median:
/// three steps' median moved a one-device GPT step's prediction between 32.7 and 41.4 ms from
/// launch to launch, where the run took 32–34.
const SETTLE: usize = 25;

/// Runs the probe at `batch` samples per thread; `first`: the first probe of a plan.
pub(crate) fn probe<W: Workload>(
    workload: &W,
    p: &ProbeSetup,
    batch: usize,
    first: bool,
) -> Result<Point> {
    let warm = WARM + usize::from(first);
    let devices = &p.settings.parallel.devices;
    let threads = devices.len();
    let comms = crate::comm::world_group(threads)?;
    // Every thread passes every barrier, whatever failed, so that none waits forever.
    let barriers: [Barrier; 4] = std::array::from_fn(|_| Barrier::new(threads));
    // The pages freed before are handed back first: what the steps make resident is counted
    // from the live heap, not hidden in pages kept from earlier.
    crate::heap::release_free();
    let heap_before = crate::heap::live().unwrap_or(0) as f64;
    // The live heap and the resident bytes once the strategies are built, and the heap after
    // their steps.
    let marks = std::sync::Mutex::new([0.0f64; 3]);
    let results: Vec<Result<Times>> = std::thread::scope(|scope| {
        let handles: Vec<_> = devices
            .iter()
            .zip(&comms)
            .enumerate()
            .map(|(i, (device, comm))| {
                let (barriers, marks) = (&barriers, &marks);
                std::thread::Builder::new()
                    .name(format!("kiln-plan-{i}"))
                    .spawn_scoped(scope, move || {
                        let pool = p.cpu_cores.filter(|_| threads > 1).map(|cores| {
                            rayon::ThreadPoolBuilder::new()
                                .num_threads((cores / threads).max(1))
                                .build()
                                .expect("build a rayon pool")
                        });
                        let body = || {
                            let lead = i == 0;
                            // A mesh's groups, as a rank's worker splits them.
                            let tp = p.settings.setup().tp;
                            let mesh = Mesh::split(comm.as_ref(), tp);
                            let strategy = match &mesh {
                                Ok(mesh) => {
                                    one_rank(workload, p, device, comm.as_ref(), mesh.as_ref())
                                }
                                Err(e) => Err(Error::Worker(e.to_string())),
                            };
                            // What building freed goes back, as a rank's does before its
                            // steps: the pages the steps keep are counted from here.
                            crate::heap::release_free();
                            barriers[0].wait();
                            if lead {
                                crate::heap::reset_peak();
                                crate::monitor::restart_resident_peak();
                                let mut m = marks.lock().expect("marks");
                                m[0] = crate::heap::live().unwrap_or(0) as f64;
                                m[1] = resident_bytes();
                            }
                            barriers[1].wait();
                            let ran =
                                strategy.and_then(|s| steps(workload, p, device, s, batch, warm));
                            barriers[2].wait();
                            if lead {
                                // What the strategies hold after their steps (optimizer state
                                // included), before any is dropped.
                                marks.lock().expect("marks")[2] =
                                    crate::heap::live().unwrap_or(0) as f64;
                            }
                            barriers[3].wait();
                            ran.map(|(times, strategy)| {
                                drop(strategy);
                                times
                            })
                        };
                        match &pool {
                            Some(pool) => pool.install(body),
                            None => body(),
                        }
                    })
                    .expect("spawn a probe thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|payload| {
                    Err(Error::Model(format!(
                        "the planner's probe failed: {}",
                        crate::panics::panic_message(&payload)
                    )))
                })
            })
            .collect()
    });
    let times = results.into_iter().collect::<Result<Vec<_>>>()?;
    let [heap_built, rss_built, heap_after] = *marks.lock().expect("marks");
    let heap = Heap {
        before: heap_before,
        built: heap_built,
        after: heap_after,
        peak: crate::heap::peak().unwrap_or(0) as f64,
    };
    Ok(point(batch, &times, &heap, rss_built))
}

/// The probe's heap marks: live before the strategies were built, once built, after their
/// steps; the peak since they were built.
struct Heap {
    before: f64,
    built: f64,
    after: f64,
    peak: f64,
}

/// The probe point of `batch` from each thread's `times`, the heap's marks and the resident
/// bytes once the strategies were built.
fn point(batch: usize, times: &[Times], heap: &Heap, rss_built: f64) -> Point {
    let n = times.len().max(1) as f64;
    // A synchronous step ends when its slowest rank does: each timed step's slowest rank,
    // then the median over the steps.
    let timed = times.iter().map(|t| t.steps.len()).min().unwrap_or(0);
    let slowest = |i: usize| {
        let mut per_step: Vec<f64> = (0..timed)
            .map(|k| times.iter().map(|t| t.steps[k][i]).fold(0.0, f64::max))
            .collect();
        crate::trainer::median(&mut per_step).unwrap_or(0.0)
    };
    // What the steps grew the heap and the resident set by, from the strategies built.
    let grown_heap = (heap.peak - heap.built).max(0.0);
    let grown_resident = (resident_peak() - rss_built).max(0.0);
    // On a device with a memory pool (a GPU) the bytes are the pool's, as each rank's strategy
    // sampled it; on the CPU, the heap's.
    let pools: Option<Vec<(f64, f64)>> = times.iter().map(|t| t.pool).collect();
    let (step_bytes, held_bytes) = match pools {
        Some(pools) if !pools.is_empty() => (
            pools.iter().map(|(p, a)| (p - a).max(0.0)).sum::<f64>() / n,
            pools.iter().map(|(_, a)| a).sum::<f64>() / n,
        ),
        _ => (
            ((heap.peak - heap.after) / n).max(0.0),
            ((heap.after - heap.before) / n).max(0.0),
        ),
    };
    Point {
        batch,
        step_bytes,
        held_bytes,
        compute_s: slowest(0),
        update_s: slowest(1),
        data_s: slowest(2),
        inside_sync_s: slowest(3),
        resident_extra: ((grown_resident - grown_heap) / n).max(0.0),
    }
}

/// One thread's measurements: per timed step, its compute, update, data and inside-sync
/// seconds; where the device has a memory pool (a GPU), the most bytes the strategy saw in use
/// and the bytes in use after the steps.
struct Times {
    steps: Vec<[f64; 4]>,
    pool: Option<(f64, f64)>,
}

/// The candidate's strategy on one rank (`comm`) on `device`; in a `mesh`, around the rank's
/// part of the model, over its data-parallel group.
fn one_rank<'a, W: Workload>(
    workload: &W,
    p: &ProbeSetup,
    device: &Device,
    comm: &'a dyn Collective,
    mesh: Option<&'a Mesh>,
) -> Result<Built<'a, W>>
where
    W::Batch: 'a,
{
    let device = device.clone().autodiff();
    let model = kiln_models::with_rng(|| kiln_models::materialized(workload.init_model(&device)));
    let s = &p.settings;
    let setup = s.setup();
    let model = setup.policy.master_model(model);
    let groups = TrainStep::<W::Batch>::param_groups(&model).len().max(1);
    let mut ctx = Context::new(
        &setup,
        mesh.map_or(comm, Mesh::data),
        device,
        s.optim.clone(),
        s.groups
            .iter()
            .map(|(name, g)| (name.clone(), g.optim.clone()))
            .collect(),
    );
    if let Some(mesh) = mesh {
        ctx.tp = Some(mesh.place::<W::Batch, _>(&model)?);
    }
    let strategy = build::<W::Batch, _>(setup.kind, model, ctx)?;
    Ok((strategy, groups))
}

/// A rank's strategy.
type Rank<'a, W> = Box<dyn Strategy<<W as Workload>::Model, <W as Workload>::Batch> + 'a>;

/// A rank's strategy and the parameter groups it steps.
type Built<'a, W> = (Rank<'a, W>, usize);

/// The probe's steps on one thread: `warm` untimed, then `TIMED` timed, then on CPU devices
/// [`SETTLE`] more, timed too.
fn steps<'a, W: Workload>(
    workload: &W,
    p: &ProbeSetup,
    device: &Device,
    built: Built<'a, W>,
    batch: usize,
    warm: usize,
) -> Result<(Times, Rank<'a, W>)>
where
    W::Batch: 'a,
{
    let (mut strategy, groups) = built;
    let device = device.clone().autodiff();
    let s = &p.settings;
    let policy = Policy::new(&s.precision);
    let setup = s.setup();
    let (count, tp) = (setup.flush(), setup.tp);
    let indices: Vec<usize> = (0..batch)
        .map(|i| i % workload.train_len().max(1))
        .collect();
    let objective = |loss: Tensor<1>| loss;
    // A GPU's work ends when the device says so, not when its calls return (the clock read
    // without waiting put a GPU step at a quarter of what it took).
    let wait = || {
        device
            .sync()
            .map_err(|e| Error::Device(format!("{device:?} failed in the probe: {e}")))
    };
    // Per timed step: compute, update, data, inside.
    let settle = if p.cpu_cores.is_some() { SETTLE } else { 0 };
    let mut timed_steps: Vec<[f64; 4]> = Vec::with_capacity(TIMED + settle);
    for step in 0..warm + TIMED + settle {
        let mut this = [0.0f64; 4];
        for g in 0..groups {
            if groups > 1 {
                strategy.select_group(g)?;
            }
            strategy.begin_step()?;
            let t0 = Instant::now();
            let mut batches = Vec::with_capacity(count);
            if strategy.takes_batches() {
                for _ in 0..count {
                    let b = crate::data::building(s.seed, step, || {
                        workload.try_train_batch(&indices, step, &device)
                    })?;
                    batches.push(Ok(
                        policy.cast_batch(b, |b, dtype| workload.cast_batch(b, dtype))
                    ));
                }
            }
            let t1 = Instant::now();
            if p.draws {
                crate::exec::draws::begin(s.seed, 0, tp, step, g, &device);
            }
            let outs = strategy.micro_steps(&mut batches.into_iter(), count, &objective);
            crate::exec::draws::end();
            outs?;
            wait()?;
            let inside = strategy.take_sync_seconds();
            let t2 = Instant::now();
            strategy.optimizer_step(1e-9, None, s.train.grad_clip)?;
            wait()?;
            let sync = strategy.take_sync_seconds();
            let t3 = Instant::now();
            this[0] += (t2 - t1).as_secs_f64() - inside;
            this[1] += (t3 - t2).as_secs_f64() - sync;
            this[2] += (t1 - t0).as_secs_f64();
            this[3] += inside;
        }
        if step >= warm {
            timed_steps.push(this);
        }
    }
    let after = device.memory_pool_usage().map(|u| u.bytes_in_use as f64);
    let pool = strategy
        .memory()
        .pool_peak
        .zip(after)
        .map(|(peak, after)| (peak as f64, after));
    let times = Times {
        steps: timed_steps,
        pool,
    };
    Ok((times, strategy))
}

/// The process's resident bytes now (0 where `/proc` is not there).
pub(crate) fn resident_bytes() -> f64 {
    crate::monitor::process_memory_mib("VmRSS").map_or(0.0, |m| m * 1024.0 * 1024.0)
}

/// The process's peak resident bytes since the last [`crate::monitor::restart_resident_peak`].
fn resident_peak() -> f64 {
    crate::monitor::process_memory_mib("VmHWM").map_or(0.0, |m| m * 1024.0 * 1024.0)
}
