//! Language modelling on a text: kiln's GPT, or a Llama-family model or GPT-2 — from scratch
//! or from a Hugging Face checkpoint — on random windows of a text tokenised by character, by
//! a checkpoint's `tokenizer.json`, or by a byte-level BPE trained on the text; and `train
//! sample`.

use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use kiln_models::{
    CausalLm, FamilyVisitor, ModelKind, ModelSection, ModelSpec, Registered, TokenBatch,
};

use super::config::Config;
use super::launch::launch;
pub use super::vocab::{TOKENIZER_FILE, Tokens, Vocab, token_file};
use super::vocab::{TextParts, read_text};
use kiln_engine::error::{Error, Result};
use kiln_engine::run::{RunOptions, RunResult};
use kiln_engine::trainer::Workload;

/// Trains the language model `config` describes on its text.
pub fn train(config: &Config, options: &RunOptions) -> Result<RunResult> {
    let path = config.data.resolved_path();
    if config.data.download && kiln_engine::comm::processes().local_index == 0 && !path.exists() {
        say!("downloading Tiny Shakespeare into {}", path.display());
        kiln_datasets::text::download_text(kiln_datasets::text::TINY_SHAKESPEARE_URL, &path)?;
    }
    if config.data.download {
        kiln_engine::comm::process_barrier();
    }
    if !path.is_file() {
        return Err(Error::data(format!(
            "{}: text file does not exist (run `cargo xtask fetch-data text`, set data.path, or \
             set data.download = true for Tiny Shakespeare)",
            path.display()
        )));
    }
    let text = read_text(config, &path)?;
    let vocab = text.vocab.size();
    let run = Windows {
        config,
        options,
        text,
    };
    with_family(config, vocab, &path, run)
}

/// What runs once the model's family, its architecture and the context are known (from the
/// config and, for `model.kind = "hf"`, the checkpoint's `config.json`).
pub(super) trait WithFamily {
    /// Runs with family `M` of architecture `model_config`, windows of `context` tokens;
    /// `model` is the `[model]` section the run records (a checkpoint's family resolved).
    fn run<M: Registered>(
        self,
        model_config: M::Config,
        context: usize,
        model: ModelSection,
    ) -> Result<RunResult>;
}

/// The language model of `config` (its vocabulary resolved against the `vocab` ids of the
/// tokenizer of `source`) handed to `then`.
pub(super) fn with_family(
    config: &Config,
    vocab: usize,
    source: &Path,
    then: impl WithFamily,
) -> Result<RunResult> {
    let resolve = Resolve {
        then,
        model: config.model.clone(),
        vocab,
        source,
        context: config.data.context,
        checkpoint: None,
    };
    if config.model.kind != ModelKind::Hf {
        return config.model.visit(resolve).unwrap_or_else(|| {
            Err(Error::config(format!(
                "key `model.kind`: {:?} does not train on text",
                kiln_engine::config::name_of(&config.model.kind)
            )))
        });
    }
    let dir = config.kiln.init.from.clone().ok_or_else(|| {
        Error::config(
            "key `model.kind`: \"hf\" takes its architecture from the Hugging Face directory \
             init.from names; set init.from",
        )
    })?;
    let resolved = kiln_models::hf::read_config(&dir)
        .map_err(|e| Error::config(format!("key `init.from`: {e}")))?;
    let resolve = Resolve {
        checkpoint: Some(&dir),
        ..resolve
    };
    resolved
        .visit(resolve)
        .expect("a config.json resolves to a language model")
}

/// The family's settings with the vocabulary resolved and the context chosen, recorded in
/// the run's `[model]` section (a checkpoint's family in place of `hf`), handed to `then`.
struct Resolve<'a, T> {
    then: T,
    model: ModelSection,
    vocab: usize,
    source: &'a Path,
    context: Option<usize>,
    /// The Hugging Face directory the family was read from, for `hf`.
    checkpoint: Option<&'a Path>,
}

impl<T: WithFamily> FamilyVisitor for Resolve<'_, T> {
    type Output = Result<RunResult>;

    fn visit<M: Registered>(self, config: &M::Config) -> Result<RunResult> {
        let mut c = config.clone();
        let size = M::vocab_size(&c);
        match self.checkpoint {
            Some(dir) if self.vocab > size => {
                return Err(Error::config(format!(
                    "key `data.tokenizer`: its {} ids do not fit the {size} of {}'s \
                     config.json (vocab_size); use the checkpoint's own tokenizer.json",
                    self.vocab,
                    dir.display()
                )));
            }
            Some(_) => {}
            None => {
                let key = format!("model.{}", M::NAME);
                M::set_vocab_size(&mut c, resolve_vocab(&key, size, self.vocab, self.source)?);
            }
        }
        let mut model = self.model;
        model.kind = M::KIND;
        *M::config_mut(&mut model) = c.clone();
        let context = self.context.unwrap_or(M::context(&c));
        self.then.run::<M>(c, context, model)
    }
}

/// Random windows of a text.
struct Windows<'a> {
    config: &'a Config,
    options: &'a RunOptions,
    text: TextParts,
}

impl WithFamily for Windows<'_> {
    fn run<M: Registered>(
        self,
        model_config: M::Config,
        context: usize,
        model: ModelSection,
    ) -> Result<RunResult> {
        language::<M>(
            self.config,
            self.options,
            self.text,
            model_config,
            context,
            model,
        )
    }
}

/// The model's vocabulary: `size` as configured (0: the tokenizer's `vocab`), at least the
/// tokenizer's.
fn resolve_vocab(section: &str, size: usize, vocab: usize, path: &Path) -> Result<usize> {
    if size == 0 {
        return Ok(vocab);
    }
    if size < vocab {
        return Err(Error::config(format!(
            "key `{section}.vocab_size`: {size} is smaller than the {vocab} ids of {}'s \
             tokenizer",
            path.display()
        )));
    }
    Ok(size)
}

/// Trains `M` of `model_config` on `text`'s windows of `context` tokens; `model` is the
/// `[model]` section the run's `model.toml` records (a checkpoint's family resolved).
fn language<M>(
    config: &Config,
    options: &RunOptions,
    text: TextParts,
    model_config: M::Config,
    context: usize,
    model: ModelSection,
) -> Result<RunResult>
where
    M: Registered,
{
    let longest = M::context(&model_config);
    if context == 0 || context > longest {
        return Err(Error::config(format!(
            "key `data.context`: {context} tokens per window; the model takes 1 to {longest}"
        )));
    }
    let path = config.data.resolved_path();
    for (part, len) in [
        ("training", text.train.len()),
        ("validation", text.val.len()),
    ] {
        if len <= context + 1 {
            return Err(Error::data(format!(
                "{}: the {part} part holds {len} {}, fewer than one window of {} + 1",
                path.display(),
                text.vocab.unit(),
                context
            )));
        }
    }
    let spec = ModelSpec { model, input: None };
    spec.validate().map_err(Error::config)?;
    let hf = hf_config::<M>(config, &model_config)?;
    let rows = vec![
        (
            "data",
            format!(
                "{}: {} train / {} val {}{}, vocabulary {}{}; windows of {context}",
                text.name,
                text.train.len(),
                text.val.len(),
                text.vocab.unit(),
                text.chars_per_token.map_or(String::new(), |c| format!(
                    " ({c:.3} characters per token on val)"
                )),
                text.vocab.size(),
                text.dropped.map_or(String::new(), |n| format!(
                    " (from {}; {n} characters outside it left out)",
                    config.data.tokenizer.as_ref().expect("set").display()
                ))
            ),
        ),
        (
            "model flops",
            format!(
                "{:.3e} per token (6N + 12LHQT)",
                M::flops_per_token(&model_config, context)
            ),
        ),
    ];
    let eval = kiln_datasets::text::eval_starts(
        text.val.len(),
        context,
        EVAL_SEED,
        config.data.eval_windows,
    );
    let workload = TextWorkload::<M> {
        train: text.train,
        val: text.val,
        config: model_config,
        context,
        seed: config.kiln.run.seed,
        eval,
    };
    let vocab = text.vocab;
    launch(config, options, &workload, &spec, rows, |dir| {
        vocab.save(&dir.join(TOKENIZER_FILE))?;
        if let Some(json) = hf {
            let hf_dir = write_hf_config(dir, &json)?;
            if let Vocab::Subword(_) = vocab {
                vocab.save(&hf_dir.join(TOKENIZER_FILE))?;
            }
        }
        Ok(())
    })
}

/// The run's Hugging Face directory made, with its `config.json` (`json`) now — the tokenizer
/// follows, the weights at the end. Returns the directory.
pub(super) fn write_hf_config(run_dir: &Path, json: &serde_json::Value) -> Result<PathBuf> {
    let hf_dir = run_dir.join(kiln_engine::weights::HF_DIR);
    std::fs::create_dir_all(&hf_dir).map_err(|e| Error::io(&hf_dir, e))?;
    let text = serde_json::to_string_pretty(json).expect("a config serialises");
    kiln_engine::files::write_atomic(&hf_dir.join("config.json"), text.as_bytes())?;
    Ok(hf_dir)
}

/// With `export.format = "hf"`, the `config.json` of the run's Hugging Face directory: a
/// checkpoint's own (`model.kind = "hf"`), else one written for the architecture, of its own
/// `model_type`; refused for a family with no Hugging Face layout (kiln's GPT).
pub(super) fn hf_config<M: Registered>(
    config: &Config,
    model_config: &M::Config,
) -> Result<Option<serde_json::Value>> {
    if config.kiln.export.format != kiln_engine::config::ExportFormat::Hf {
        return Ok(None);
    }
    let written = M::hf_json(model_config).ok_or_else(|| {
        Error::config(format!(
            "key `export.format`: \"hf\" writes a family with a Hugging Face layout; \
             model.kind = {:?} has none (\"pytorch\" writes its PyTorch layout)",
            M::NAME
        ))
    })?;
    let json = match (&config.model.kind, &config.kiln.init.from) {
        (ModelKind::Hf, Some(dir)) => kiln_models::hf::config_json_from(dir)
            .map_err(|e| Error::config(format!("key `init.from`: {e}")))?,
        _ => written,
    };
    Ok(Some(json))
}

/// Seed of the fixed validation windows: the same for every run seed, so that runs are
/// scored on the same text.
const EVAL_SEED: u64 = 0x0e7a_1000;

/// Language modelling: a [`CausalLm`] on random windows of a text.
pub struct TextWorkload<M: CausalLm> {
    /// The training part of the tokenised text.
    pub train: Tokens,
    /// The validation part, which follows it.
    pub val: Tokens,
    /// The model (vocabulary size resolved).
    pub config: M::Config,
    /// Tokens per window.
    pub context: usize,
    /// Seed of the window sampling.
    pub seed: u64,
    /// Start offsets of the fixed validation windows.
    pub eval: Vec<usize>,
}

impl<M: CausalLm> TextWorkload<M> {
    fn windows(&self, tokens: &Tokens, starts: &[usize], device: &Device) -> Result<TokenBatch> {
        let t = self.context;
        let mut window = Vec::with_capacity(t + 1);
        let mut inputs = Vec::with_capacity(starts.len() * t);
        let mut targets = Vec::with_capacity(starts.len() * t);
        for &s in starts {
            window.clear();
            tokens.extend(s, t + 1, &mut window)?;
            inputs.extend(window[..t].iter().map(|&x| i64::from(x)));
            targets.extend(window[1..].iter().map(|&x| i64::from(x)));
        }
        let n = starts.len();
        Ok(TokenBatch::new(
            Tensor::from_data(TensorData::new(inputs, [n, t]), device),
            Tensor::from_data(TensorData::new(targets, [n, t]), device),
        ))
    }
}

impl<M: CausalLm + 'static> Workload for TextWorkload<M> {
    type Model = M;
    type Batch = TokenBatch;

    fn init_model(&self, device: &Device) -> M {
        M::init(&self.config, device)
    }

    /// One "epoch" is as many windows as the training text has blocks.
    fn train_len(&self) -> usize {
        (self.train.len() / self.context).max(1)
    }

    /// kiln calls [`Workload::try_train_batch`]; this form panics on a token file that
    /// cannot be read.
    fn train_batch(&self, starts: &[usize], device: &Device) -> TokenBatch {
        self.windows(&self.train, starts, device)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_train_batch(
        &self,
        starts: &[usize],
        _step: usize,
        device: &Device,
    ) -> Result<TokenBatch> {
        self.windows(&self.train, starts, device)
    }

    fn eval_len(&self) -> usize {
        self.eval.len()
    }

    /// kiln calls [`Workload::try_eval_batch`]; this form panics on a token file that
    /// cannot be read.
    fn eval_batch(&self, range: Range<usize>, device: &Device) -> TokenBatch {
        self.try_eval_batch(range, device)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_eval_batch(&self, range: Range<usize>, device: &Device) -> Result<TokenBatch> {
        self.windows(&self.val, &self.eval[range], device)
    }

    /// Token ids are integers: nothing to cast.
    fn cast_batch(&self, batch: TokenBatch, _dtype: burn::tensor::FloatDType) -> TokenBatch {
        batch
    }

    fn sample(&self, step: usize, slot: usize, slots: usize, batch: usize) -> Option<Vec<usize>> {
        // The step's windows, then this slot's part of them.
        let all = kiln_datasets::text::window_starts(
            self.train.len(),
            self.context,
            self.seed,
            step as u64,
            slots * batch,
        );
        Some(all[slot * batch..(slot + 1) * batch].to_vec())
    }

    fn tokens_per_sample(&self) -> Option<usize> {
        Some(self.context)
    }

    fn flops_per_sample(&self) -> Option<f64> {
        Some(M::flops_per_token(&self.config, self.context) * self.context as f64)
    }
}
