//! From a [`RootConfig`] to a finished run: data, devices, the start-up table, the run
//! directory, the trainer, and the exported model.

use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::prelude::*;
use kiln_datasets::text::TextData;
use kiln_datasets::{IdxKind, ImageDataset, ImageSplits};
use kiln_models::load::{SAFETENSORS_FILE, SPEC_FILE, WEIGHTS_FILE};
use kiln_models::{
    Classifier, Gpt, GptConfig, ImageBatch, ModelKind, ModelSpec, TokenBatch, save_safetensors,
};

use crate::checkpoint::{self, write_atomic};
use crate::config::{Accelerator, DataConfig, DatasetKind, HardwareConfig, RootConfig, name_of};
use crate::data::{ImageBatcher, input_spec};
use crate::error::{Error, Result};
use crate::metrics::Summary;
use crate::optim::scaled_lr;
use crate::strategy::{ModelFacts, Setup};
use crate::trainer::{TrainerSettings, Workload, fit, total_steps};

/// Image classification: a [`Classifier`] trained on an [`ImageSplits`].
pub struct ImageWorkload {
    /// The model to build.
    pub spec: ModelSpec,
    /// Training and test images.
    pub splits: ImageSplits,
}

impl Workload for ImageWorkload {
    type Model = Classifier;
    type Batch = ImageBatch;

    fn init_model(&self, device: &Device) -> Classifier {
        self.spec
            .classifier(device)
            .expect("the spec was validated as an image classifier")
    }

    fn train_len(&self) -> usize {
        self.splits.train.len()
    }

    fn train_batch(&self, indices: &[usize], device: &Device) -> ImageBatch {
        ImageBatcher::new(device.clone()).batch(&self.splits.train, indices)
    }

    fn eval_len(&self) -> usize {
        self.splits.test.len()
    }

    fn eval_batch(&self, range: Range<usize>, device: &Device) -> ImageBatch {
        let indices: Vec<usize> = range.collect();
        ImageBatcher::new(device.clone()).batch(&self.splits.test, &indices)
    }

    fn cast_batch(&self, batch: ImageBatch, dtype: burn::tensor::FloatDType) -> ImageBatch {
        ImageBatch {
            images: batch.images.cast(dtype),
            ..batch
        }
    }
}

/// Loads the configured dataset, downloading it first when `data.download` is set and the
/// directory is missing.
pub fn load_data(config: &DataConfig) -> Result<ImageSplits> {
    let kind = match config.dataset {
        DatasetKind::Digits => return Ok(kiln_datasets::digits()),
        DatasetKind::Text => {
            return Err(Error::config(
                "key `data.dataset`: \"text\" is not an image dataset".to_string(),
            ));
        }
        DatasetKind::Mnist => IdxKind::Mnist,
        DatasetKind::FashionMnist => IdxKind::FashionMnist,
    };
    let dir = config.resolved_dir();
    // One process per machine downloads; the others wait for it.
    if config.download && crate::comm::processes().local_index == 0 && !dir.is_dir() {
        println!("downloading {} into {}", kind.name(), dir.display());
        kiln_datasets::download_mnist(&dir, kind)?;
    }
    if config.download {
        crate::comm::process_barrier();
    }
    Ok(kind.load(&dir)?)
}

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

/// Trains the workload `config` describes: an image classifier or a GPT on text.
pub fn train(config: &RootConfig, options: &RunOptions) -> Result<RunResult> {
    match config.model.kind {
        ModelKind::Gpt => train_text(config, options),
        ModelKind::Convnet | ModelKind::Mlp => train_images(config, options),
    }
}

fn train_images(config: &RootConfig, options: &RunOptions) -> Result<RunResult> {
    let splits = load_data(&config.data)?;
    let spec = ModelSpec {
        model: config.model.clone(),
        input: Some(input_spec(&splits.train)),
    };
    spec.validate().map_err(Error::config)?;
    let train: &ImageDataset = &splits.train;
    let rows = vec![(
        "data",
        format!(
            "{}: {} train / {} test, {}x{}, {} classes",
            splits.name,
            train.len(),
            splits.test.len(),
            train.height,
            train.width,
            train.num_classes
        ),
    )];
    let workload = ImageWorkload {
        spec: spec.clone(),
        splits,
    };
    launch_builtin(config, options, &workload, &spec, rows, |_| Ok(()))
}

fn train_text(config: &RootConfig, options: &RunOptions) -> Result<RunResult> {
    let path = config.data.resolved_path();
    if config.data.download && crate::comm::processes().local_index == 0 && !path.exists() {
        println!("downloading Tiny Shakespeare into {}", path.display());
        kiln_datasets::text::download_text(kiln_datasets::text::TINY_SHAKESPEARE_URL, &path)?;
    }
    if config.data.download {
        crate::comm::process_barrier();
    }
    if !path.is_file() {
        return Err(Error::data(format!(
            "{}: text file does not exist (run `cargo xtask fetch-data text`, set data.path, or \
             set data.download = true for Tiny Shakespeare)",
            path.display()
        )));
    }
    let data = TextData::from_file(&path, config.data.train_fraction)?;
    let mut gpt = config.model.gpt.clone();
    let vocab = data.tokenizer.vocab_size();
    if gpt.vocab_size == 0 {
        gpt.vocab_size = vocab;
    } else if gpt.vocab_size < vocab {
        return Err(Error::config(format!(
            "key `model.gpt.vocab_size`: {} is smaller than the {vocab} characters of {}",
            gpt.vocab_size,
            path.display()
        )));
    }
    let block = gpt.block_size;
    for (part, len) in [
        ("training", data.train.len()),
        ("validation", data.val.len()),
    ] {
        if len <= block + 1 {
            return Err(Error::data(format!(
                "{}: the {part} part holds {len} characters, fewer than one window of \
                 model.gpt.block_size + 1 = {}",
                path.display(),
                block + 1
            )));
        }
    }
    let mut model = config.model.clone();
    model.gpt = gpt.clone();
    let spec = ModelSpec { model, input: None };
    spec.validate().map_err(Error::config)?;
    let rows = vec![
        (
            "data",
            format!(
                "{}: {} train / {} val characters, vocabulary {vocab}",
                data.name,
                data.train.len(),
                data.val.len()
            ),
        ),
        (
            "model flops",
            format!("{:.3e} per token (6N + 12LHQT)", gpt.flops_per_token()),
        ),
    ];
    let eval = kiln_datasets::text::eval_starts(
        data.val.len(),
        block,
        EVAL_SEED,
        config.data.eval_windows,
    );
    let tokenizer = data.tokenizer.clone();
    let workload = TextWorkload {
        data,
        config: gpt,
        seed: config.run.seed,
        eval,
    };
    launch_builtin(config, options, &workload, &spec, rows, |dir| {
        Ok(tokenizer.save(&dir.join(TOKENIZER_FILE))?)
    })
}

/// Seed of the fixed validation windows: the same for every run seed, so that runs are
/// scored on the same text.
const EVAL_SEED: u64 = 0x0e7a_1000;

/// File of the tokenizer inside a text run's directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// A built-in workload's run: its model spec (`model.toml`) beside the workload's own files.
fn launch_builtin<W>(
    config: &RootConfig,
    options: &RunOptions,
    workload: &W,
    spec: &ModelSpec,
    rows: Vec<(&str, String)>,
    save_extra: impl FnOnce(&Path) -> Result<()>,
) -> Result<RunResult>
where
    W: Workload,
    W::Model: burn::store::ModuleSnapshot,
{
    let info = RunInfo {
        model: name_of(&config.model.kind),
        rows: rows.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        builtin_sections: true,
        sections: Vec::new(),
    };
    train_workload(config, options, workload, info, |dir| {
        write_atomic(
            &dir.join(SPEC_FILE),
            toml::to_string_pretty(spec)
                .expect("spec serialises")
                .as_bytes(),
        )?;
        save_extra(dir)
    })
}

/// How a workload's run describes itself besides what kiln knows.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    /// The model's name in the start-up table.
    pub model: String,
    /// More rows of the start-up table (`("data", "…")`).
    pub rows: Vec<(String, String)>,
    /// Whether the run's `config.toml` keeps the `[model]` and `[data]` sections. They
    /// describe kiln's built-in workloads; a workload of one's own leaves them out.
    pub builtin_sections: bool,
    /// Sections of the workload's own written into `config.toml` (a program's `[model]` and
    /// `[data]`, so that `--resume` reads them back).
    pub sections: Vec<(String, toml::Value)>,
}

/// Trains `workload` as `config` says, with everything `train` gives: devices, strategy,
/// precision and recompute, the run directory (`config.toml`, metrics, checkpoints,
/// `summary.json`), resume (`options.resume_from`), the start-up table, and the exported
/// model (`model.bpk`, `model.safetensors`). `save_extra` writes the workload's own files
/// into the run directory (on process 0, before training). `config`'s `[model]` and `[data]`
/// sections are not read: the workload is the model and the data.
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

    // Process 0 chooses the run directory and writes the run's files; the others follow it.
    let first = crate::comm::processes().index == 0;
    let run_dir = PathBuf::from(crate::comm::agree(|| {
        let run_dir = choose_run_dir(config, options)?;
        std::fs::create_dir_all(&run_dir).map_err(|e| Error::io(&run_dir, e))?;
        let mut saved = config.clone();
        saved.run.dir = Some(run_dir.clone());
        let mut table: toml::Table =
            toml::from_str(&saved.to_toml()).expect("a config's TOML reads back");
        if !info.builtin_sections {
            table.remove("model");
            table.remove("data");
        }
        for (name, value) in &info.sections {
            table.insert(name.clone(), value.clone());
        }
        let text = toml::to_string_pretty(&table).expect("a table serialises");
        write_atomic(&run_dir.join("config.toml"), text.as_bytes())?;
        save_extra(&run_dir)?;
        Ok(run_dir.display().to_string())
    })?);

    let mut settings = TrainerSettings::from_config(config, devices, accelerator, run_dir.clone());
    settings.output.resume_from = options.resume_from.clone();
    settings.output.progress = options.verbose && first;
    if options.verbose && first {
        print_table(config, workload, &settings, &run_dir, &info);
    }

    let (summary, model) = fit(workload, &settings)?;
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

/// Character-level language modelling: a [`Gpt`] on random windows of a text.
pub struct TextWorkload {
    /// The tokenised text.
    pub data: TextData,
    /// The model (vocabulary size resolved).
    pub config: GptConfig,
    /// Seed of the window sampling.
    pub seed: u64,
    /// Start offsets of the fixed validation windows.
    pub eval: Vec<usize>,
}

impl TextWorkload {
    fn windows(&self, tokens: &[u32], starts: &[usize], device: &Device) -> TokenBatch {
        let t = self.config.block_size;
        let mut inputs = Vec::with_capacity(starts.len() * t);
        let mut targets = Vec::with_capacity(starts.len() * t);
        for &s in starts {
            inputs.extend(tokens[s..s + t].iter().map(|&x| i64::from(x)));
            targets.extend(tokens[s + 1..s + t + 1].iter().map(|&x| i64::from(x)));
        }
        let n = starts.len();
        TokenBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [n, t]), device),
            targets: Tensor::from_data(TensorData::new(targets, [n, t]), device),
        }
    }
}

impl Workload for TextWorkload {
    type Model = Gpt;
    type Batch = TokenBatch;

    fn init_model(&self, device: &Device) -> Gpt {
        self.config.init(device)
    }

    /// One "epoch" is as many windows as the training text has blocks.
    fn train_len(&self) -> usize {
        (self.data.train.len() / self.config.block_size).max(1)
    }

    fn train_batch(&self, starts: &[usize], device: &Device) -> TokenBatch {
        self.windows(&self.data.train, starts, device)
    }

    fn eval_len(&self) -> usize {
        self.eval.len()
    }

    fn eval_batch(&self, range: Range<usize>, device: &Device) -> TokenBatch {
        self.windows(&self.data.val, &self.eval[range], device)
    }

    /// Token ids are integers: nothing to cast.
    fn cast_batch(&self, batch: TokenBatch, _dtype: burn::tensor::FloatDType) -> TokenBatch {
        batch
    }

    fn sample(
        &self,
        micro_step: usize,
        rank: usize,
        world: usize,
        batch: usize,
    ) -> Option<Vec<usize>> {
        let all = kiln_datasets::text::window_starts(
            self.data.train.len(),
            self.config.block_size,
            self.seed,
            micro_step as u64,
            world * batch,
        );
        Some(all[rank * batch..(rank + 1) * batch].to_vec())
    }

    fn tokens_per_sample(&self) -> Option<usize> {
        Some(self.config.block_size)
    }

    fn flops_per_sample(&self) -> Option<f64> {
        Some(self.config.flops_per_token() * self.config.block_size as f64)
    }
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

fn print_table<W: Workload>(
    config: &RootConfig,
    w: &W,
    s: &TrainerSettings,
    run_dir: &Path,
    info: &RunInfo,
) {
    let world = s.world();
    let t = &s.train;
    let (replicas, micros) = (s.data_world(), s.micro_batches());
    let per_step = t.batch_size * replicas * micros;
    let spe = crate::data::DistributedSampler::new(
        w.train_len(),
        s.seed,
        replicas,
        t.batch_size,
        micros,
        s.drop_last,
    )
    .steps_per_epoch();
    let total = total_steps(t, spe);
    let probe = kiln_models::with_rng(|| w.init_model(&Device::flex().autodiff()));
    let params = probe.num_params();
    let setup = s.setup();
    let facts = ModelFacts::of::<W::Batch, _>(&probe);
    let memory = memory_line(s, &setup, &facts);
    let local_devices = config.hardware.devices.indices().len();
    let mut rows = vec![
        ("run", run_dir.display().to_string()),
        ("accelerator", s.parallel.accelerator.clone()),
        (
            "devices",
            if s.parallel.processes.count > 1 {
                format!(
                    "{} processes × {} devices {:?} = {world} ranks",
                    s.parallel.processes.count,
                    s.parallel.devices.len(),
                    config.hardware.devices.indices()
                )
            } else {
                format!("{world} {:?}", config.hardware.devices.indices())
            },
        ),
        ("strategy", setup.describe()),
        ("world size", world.to_string()),
        ("memory", memory),
        (
            "precision",
            format!(
                "{}; {}",
                setup.policy.describe(local_devices > 1),
                setup.recompute_line()
            ),
        ),
        (
            "batch",
            if setup.stages() > 1 || setup.flush() > 1 {
                format!(
                    "{} per micro-batch × {} micro-batches × {replicas} pipelines × {} \
                     accumulation = {per_step} per step",
                    t.batch_size,
                    setup.flush(),
                    t.accumulate
                )
            } else {
                format!(
                    "{} per device × {world} devices × {} accumulation = {per_step} per step",
                    t.batch_size, t.accumulate
                )
            },
        ),
    ];
    let lr_line = |optim: &crate::config::OptimConfig, schedule: &crate::config::ScheduleConfig| {
        format!(
            "{:.3e} ({} scaling of {:.3e}), {} schedule",
            scaled_lr(optim, replicas, micros),
            name_of(&optim.scale_lr),
            optim.lr,
            name_of(&schedule.kind)
        )
    };
    let groups = kiln_models::TrainStep::<W::Batch>::param_groups(&probe);
    let mut lr_rows = Vec::new();
    if groups.is_empty() {
        lr_rows.push(("lr".to_string(), lr_line(&s.optim, &s.schedule)));
    } else {
        for g in &groups {
            let optim = s.group_optim(&g.name);
            lr_rows.push((
                format!("lr {}", g.name),
                format!(
                    "{} {}",
                    name_of(&optim.name),
                    lr_line(optim, s.group_schedule(&g.name))
                ),
            ));
        }
    }
    rows.extend(lr_rows.iter().map(|(k, v)| (k.as_str(), v.clone())));
    rows.push(("model", format!("{}, {params} parameters", info.model)));
    rows.extend(info.rows.iter().map(|(k, v)| (k.as_str(), v.clone())));
    rows.push(("steps", format!("{spe} per epoch, {total} in all")));
    println!("kiln");
    for (k, v) in rows {
        println!("  {k:<12} {v}");
    }
}
