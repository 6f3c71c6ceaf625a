//! Where the workers start: rank 0's initial weights (or a checkpoint's), the loop's position
//! and the optimizer state to continue, read and checked before any worker runs.

use std::path::Path;

use burn::module::Module;
use burn::store::ModuleRecord;

use super::settings::TrainerSettings;
use super::workload::Workload;
use crate::checkpoint;
use crate::config::name_of;
use crate::data::DistributedSampler;
use crate::error::{Error, Result};
use crate::optim::{OptimState, Source};
use crate::params::FlatLayout;
use crate::state::LoopState;
use crate::strategy::{Setup, block_ids};

/// Optimizer states by parameter group (`""` alone for a model with one optimizer).
type GroupStates = Vec<(String, OptimState)>;

/// The optimizer states a resumed run continues.
pub(crate) enum Resumed {
    /// A gathered checkpoint's, read whole: each rank takes its part.
    Whole(GroupStates),
    /// A sharded checkpoint's (checked to fit the model), of these groups: each rank reads the
    /// ranges it needs — of the parameters too when `params` (the model every rank starts
    /// from was read without them).
    Sharded {
        source: checkpoint::Sharded,
        groups: Vec<String>,
        params: bool,
    },
}

/// What the workers start from.
pub(crate) struct Start {
    /// Every rank builds its own module and loads these weights into it, so that ranks share
    /// no Burn `RunningState`.
    pub weights: ModuleRecord,
    /// Where the loop stands.
    pub state: LoopState,
    /// The optimizer states to continue.
    pub optim: Option<Resumed>,
    /// The model's parameter groups, in the order a step trains them (none for a model with
    /// one optimizer).
    pub groups: Vec<String>,
    /// The model draws random numbers in a training forward (dropout).
    pub draws: bool,
}

/// Builds the initial model and reads the checkpoint to resume from, if any (the settings
/// and the model were checked by [`super::check`], which also found whether the model
/// `draws`).
pub(super) fn prepare<W: Workload>(
    workload: &W,
    settings: &TrainerSettings,
    setup: &Setup,
    sampler: &DistributedSampler,
    draws: bool,
) -> Result<Start> {
    // Rank 0's initial weights (or the checkpoint's) are what every rank starts from.
    let main_device = settings.parallel.devices[0].clone().autodiff();
    // Seeding and initialisation happen under kiln-models' random-number lock, so that runs
    // sharing the process cannot interleave their draws.
    let initial = kiln_models::with_rng(|| {
        main_device.seed(settings.seed);
        kiln_models::materialized(workload.init_model(&main_device))
    });
    let state = LoopState {
        step: 0,
        epoch: 0,
        step_in_epoch: 0,
        seed: settings.seed,
        world_size: settings.world(),
        samples_per_step: sampler.samples_per_step(),
        lr: 0.0,
        samples: 0,
        wall_seconds: 0.0,
        scaler: setup.policy.scaler(),
        early: None,
        plateaus: Vec::new(),
    };
    let groups = kiln_models::TrainStep::<W::Batch>::param_groups(&initial)
        .into_iter()
        .map(|g| g.name)
        .collect();
    let Some(dir) = &settings.output.resume_from else {
        return Ok(Start {
            weights: initial.into_record(),
            state,
            optim: None,
            groups,
            draws,
        });
    };
    let (model, state, optim) = resume::<W::Batch, _>(dir, initial, state, settings)?;
    Ok(Start {
        weights: model.into_record(),
        state,
        optim: Some(optim),
        groups,
        draws,
    })
}

/// One training forward of a fresh model (a forward in training mode moves BatchNorm's running
/// statistics, so not the initial one) on the first two samples, in the precision the ranks
/// compute in: whether the model draws random numbers in it (dropout), or the one-line error
/// of a forward that cannot run in that precision (a tensor the model creates in the device's
/// f32 meeting bf16 weights). It runs on a thread of its own, whose panic is reported here.
pub(super) fn probe<W: Workload>(
    workload: &W,
    settings: &TrainerSettings,
    setup: &Setup,
) -> Result<bool> {
    use kiln_models::TrainStep;
    let device = settings.parallel.devices[0].clone().autodiff();
    let policy = &setup.policy;
    let run = || {
        // Materialised first: Burn draws a parameter's initial values lazily, at its first
        // use, which would read as the forward drawing random numbers.
        let model =
            kiln_models::with_rng(|| kiln_models::materialized(workload.init_model(&device)));
        let model = policy.master_model(model);
        let model = policy.compute_copy(&model).unwrap_or(model);
        let indices: Vec<usize> = (0..workload.train_len().min(2)).collect();
        let groups = TrainStep::<W::Batch>::param_groups(&model).len();
        // The batches are built first (a file that does not load is the data's error, not
        // the model's), as the loop builds them.
        let mut batches = (0..groups.max(1))
            .map(|_| {
                crate::data::building(settings.seed, 0, || {
                    workload.try_train_batch(&indices, 0, &device)
                })
                .map(|b| policy.cast_batch(b, |b, dtype| workload.cast_batch(b, dtype)))
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter();
        Ok(crate::exec::draws::model_draws(&device, &mut || {
            if groups == 0 {
                let _ = model.step(batches.next().expect("one batch"));
            }
            for g in 0..groups {
                let _ = model.group_step(g, batches.next().expect("one batch per group"));
            }
        }))
    };
    // A probe's panic is a refusal, reported as one line: the hook never prints it.
    crate::panics::quiet_worker_panics();
    let outcome = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name(crate::panics::PROBE_THREAD.into())
            .spawn_scoped(scope, run)
            .expect("spawn the probe thread")
            .join()
    });
    outcome.map_err(|payload| {
        let message = crate::panics::panic_message(&payload);
        probe_failure(policy, message)
    })?
}

/// A probe's panic as the run's one-line error.
fn probe_failure(policy: &crate::precision::Policy, message: String) -> Error {
    {
        let message = message.split_whitespace().collect::<Vec<_>>().join(" ");
        if policy.compute != burn::tensor::FloatDType::F32 && message.contains("dtype") {
            Error::config(format!(
                "key `precision.mode`: {:?} runs the model in {:?}, but its forward mixed \
                 dtypes ({message}): a float tensor the model creates on the device \
                 (Tensor::zeros, ones, full, random, from_data) comes out in the device's F32; \
                 create it in the dtype of the tensor it meets, e.g. \
                 `Tensor::zeros(shape, (&device, x.dtype()))`, or use precision \"32\"",
                policy.name(),
                policy.compute,
            ))
        } else {
            Error::Model(format!(
                "the model's first forward failed (on samples 0 and 1): {message}"
            ))
        }
    }
}

/// Refuses to continue the checkpoint in `dir`, whose loop state is `saved`, with another
/// number of samples per step than it took: the data order would not continue.
pub(crate) fn same_samples_per_step(dir: &Path, saved: &LoopState, fresh: usize) -> Result<()> {
    if saved.samples_per_step == fresh {
        return Ok(());
    }
    Err(Error::checkpoint(format!(
        "{}: checkpoint took {} samples per step, this run takes {fresh} (batch × devices × \
         accumulation must match to continue the same data order)",
        dir.display(),
        saved.samples_per_step,
    )))
}

/// The optimizer state of `group` in the checkpoint `dir`, checked to fit `layout` (an error
/// names the file).
fn load_fitting(dir: &Path, group: &str, layout: &FlatLayout) -> Result<OptimState> {
    let loaded = checkpoint::load_group_optimizer(dir, group)?;
    loaded.leaves(layout).map_err(|e| match e {
        Error::Checkpoint(m) => Error::checkpoint(format!(
            "{}: {m}",
            dir.join(checkpoint::optim_file(group)).display()
        )),
        other => other,
    })?;
    Ok(loaded)
}

/// The checkpoint in `dir` applied to a fresh start: its model, its position (with this run's
/// seed, world and scaler policy) and every parameter group's optimizer state, each checked
/// against the model and the settings.
fn resume<B, M: kiln_models::BlockStack<B> + Module>(
    dir: &Path,
    model: M,
    fresh: LoopState,
    settings: &TrainerSettings,
) -> Result<(M, LoopState, Resumed)> {
    // Checkpoint writers killed mid-write leave temporary directories; they go now.
    if settings.parallel.processes.index == 0 {
        let removed = checkpoint::remove_stale(&settings.output.run_dir)?;
        if !removed.is_empty() {
            say!(
                "removed {} temporary checkpoint director{} that a killed writer left: {}",
                removed.len(),
                if removed.len() == 1 { "y" } else { "ies" },
                removed
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let mut state = checkpoint::read_state(dir)?;
    same_samples_per_step(dir, &state, fresh.samples_per_step)?;
    let sharded = checkpoint::is_sharded(dir)
        .then(|| checkpoint::Sharded::open(dir))
        .transpose()?;
    // A strategy whose ranks hold a shard of the parameters reads its own ranges of them.
    let setup = settings.setup();
    let own_params = setup.rules().reads_own_params() && setup.tp == 1;
    let model = match &sharded {
        Some(source) if own_params => source.load_rest(model)?,
        Some(source) => source.load_model(model)?,
        None => checkpoint::load_model(dir, model)?,
    };
    // Fail before the workers start if an optimizer state does not fit the model.
    let groups = model.param_groups();
    let parts: Vec<(String, FlatLayout, String)> = if groups.is_empty() {
        let layout = FlatLayout::new(&model, &block_ids(&model), 1);
        vec![(String::new(), layout, "optim.name".to_string())]
    } else {
        groups
            .iter()
            .map(|g| {
                let layout = FlatLayout::of_params(&model, &g.params, 1);
                let key = format!("groups.{}.optim.name", g.name);
                (g.name.clone(), layout, key)
            })
            .collect()
    };
    let own = setup.rules().own_state();
    let resumed = match sharded {
        Some(source) => {
            let mut groups = Vec::with_capacity(parts.len() + 1);
            for (group, layout, key) in &parts {
                source.fits(group, layout)?;
                let kind = source.optimizer(group).map(|o| o.0);
                fits_optimizer(dir, group, kind, settings, key)?;
                groups.push(group.clone());
            }
            // A strategy's own state (DiLoCo's outer loop), when this checkpoint has one; a
            // checkpoint of another strategy starts it fresh.
            if let Some(own) = own.filter(|own| source.optimizer(own).is_some()) {
                let layout = FlatLayout::new(&model, &block_ids(&model), 1);
                source.fits(own, &layout)?;
                groups.push(own.to_string());
            }
            Resumed::Sharded {
                source,
                groups,
                params: own_params,
            }
        }
        None => {
            let mut states = Vec::with_capacity(parts.len());
            for (group, layout, key) in parts {
                let loaded = load_fitting(dir, &group, &layout)?;
                fits_optimizer(dir, &group, Some(loaded.kind), settings, &key)?;
                states.push((group, loaded));
            }
            if let Some(own) = own
                && dir.join(checkpoint::optim_file(own)).is_file()
            {
                let layout = FlatLayout::new(&model, &block_ids(&model), 1);
                states.push((own.to_string(), load_fitting(dir, own, &layout)?));
            }
            Resumed::Whole(states)
        }
    };
    state.seed = fresh.seed;
    state.world_size = fresh.world_size;
    // A checkpoint of a run without a scaler continues with a fresh one, and a run that no
    // longer scales drops it.
    let saved = state.scaler.take();
    state.scaler = fresh.scaler.map(|fresh| saved.unwrap_or(fresh));
    Ok((model, state, resumed))
}

/// Refuses a checkpoint whose optimizer for `group` is not the one the settings name (`key`).
fn fits_optimizer(
    dir: &Path,
    group: &str,
    kind: Option<crate::config::OptimizerKind>,
    settings: &TrainerSettings,
    key: &str,
) -> Result<()> {
    let wanted = settings.group_optim(group).name;
    match kind {
        Some(kind) if kind == wanted => Ok(()),
        Some(kind) => Err(Error::checkpoint(format!(
            "{}: the optimizer state is {}'s, but {key} = {:?}",
            dir.join(checkpoint::optim_file(group)).display(),
            name_of(&kind),
            name_of(&wanted)
        ))),
        None => Err(Error::checkpoint(format!(
            "{}: holds no optimizer state for {}",
            dir.display(),
            if group.is_empty() {
                "the model's optimizer".to_string()
            } else {
                format!("parameter group {group:?}")
            }
        ))),
    }
}
