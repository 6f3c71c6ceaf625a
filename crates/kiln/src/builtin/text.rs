//! Character-level language modelling: a GPT on random windows of a text, and `train sample`.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::prelude::*;
use kiln_datasets::text::TextData;
use kiln_datasets::tokens::TokenFile;
use kiln_models::{Gpt, GptConfig, ModelSpec, TokenBatch};

use super::config::Config;
use super::launch::launch;
use crate::error::{Error, Result};
use crate::run::{RunOptions, RunResult};
use crate::trainer::Workload;

/// Trains the GPT `config` describes on its text.
pub fn train(config: &Config, options: &RunOptions) -> Result<RunResult> {
    let path = config.data.resolved_path();
    if config.data.download && crate::comm::processes().local_index == 0 && !path.exists() {
        say!("downloading Tiny Shakespeare into {}", path.display());
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
    let (tokenizer, train, val, name, dropped) = read_text(config, &path)?;
    let mut gpt = config.model.gpt.clone();
    let vocab = tokenizer.vocab_size();
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
    for (part, len) in [("training", train.len()), ("validation", val.len())] {
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
                "{name}: {} train / {} val characters, vocabulary {vocab}{}",
                train.len(),
                val.len(),
                dropped.map_or(String::new(), |n| format!(
                    " (from {}; {n} characters outside it left out)",
                    config.data.tokenizer.as_ref().expect("set").display()
                ))
            ),
        ),
        (
            "model flops",
            format!("{:.3e} per token (6N + 12LHQT)", gpt.flops_per_token()),
        ),
    ];
    let eval =
        kiln_datasets::text::eval_starts(val.len(), block, EVAL_SEED, config.data.eval_windows);
    let workload = TextWorkload {
        train,
        val,
        config: gpt,
        seed: config.kiln.run.seed,
        eval,
    };
    launch(config, options, &workload, &spec, rows, |dir| {
        Ok(tokenizer.save(&dir.join(TOKENIZER_FILE))?)
    })
}

/// The text of `path` as tokens: its tokenizer, the training and validation parts, its name,
/// and — with `data.tokenizer` — how many characters the trained vocabulary left out.
fn read_text(
    config: &Config,
    path: &Path,
) -> Result<(
    kiln_datasets::text::CharTokenizer,
    Tokens,
    Tokens,
    String,
    Option<usize>,
)> {
    let mut dropped = None;
    let (tokenizer, train, val, name) = if let Some(from) = &config.data.tokenizer {
        if config.data.on_disk {
            return Err(Error::config(
                "key `data.tokenizer`: a trained vocabulary reads the text in memory; set \
                 data.on_disk = false"
                    .to_string(),
            ));
        }
        let file = if from.is_dir() {
            from.join(TOKENIZER_FILE)
        } else {
            from.clone()
        };
        let trained = kiln_datasets::text::CharTokenizer::load(&file).map_err(|e| {
            Error::config(format!(
                "key `data.tokenizer`: {}",
                crate::config::one_line(&e)
            ))
        })?;
        let (data, left_out) = TextData::from_file_with(path, config.data.train_fraction, trained)?;
        dropped = Some(left_out);
        (
            data.tokenizer,
            Tokens::Memory(data.train),
            Tokens::Memory(data.val),
            data.name,
        )
    } else if config.data.on_disk {
        let cache = token_file(path);
        // One process per machine writes the token file; the others wait for it.
        let file = if crate::comm::processes().local_index == 0 {
            let file = TokenFile::prepare(path, &cache);
            crate::comm::process_barrier();
            file?
        } else {
            crate::comm::process_barrier();
            TokenFile::prepare(path, &cache)?
        };
        let tokenizer = file.tokenizer().clone();
        let cut = kiln_datasets::text::train_part(file.len(), config.data.train_fraction);
        let file = Arc::new(file);
        let name = format!("{} (read from {})", stem(path), cache.display());
        (
            tokenizer,
            Tokens::Disk {
                file: file.clone(),
                start: 0,
                len: cut,
            },
            Tokens::Disk {
                start: cut,
                len: file.len() - cut,
                file,
            },
            name,
        )
    } else {
        let data = TextData::from_file(path, config.data.train_fraction)?;
        (
            data.tokenizer,
            Tokens::Memory(data.train),
            Tokens::Memory(data.val),
            data.name,
        )
    };
    Ok((tokenizer, train, val, name, dropped))
}

/// Seed of the fixed validation windows: the same for every run seed, so that runs are
/// scored on the same text.
const EVAL_SEED: u64 = 0x0e7a_1000;

/// File of the tokenizer inside a text run's directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The token file of the text at `path`: beside it, `<path>.kiln-tokens`.
pub fn token_file(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".kiln-tokens");
    PathBuf::from(name)
}

fn stem(path: &Path) -> String {
    path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// Where a part of a text's tokens is read from.
pub enum Tokens {
    /// Held in memory.
    Memory(Vec<u32>),
    /// Read from a token file window by window: its tokens `start .. start + len`.
    Disk {
        /// The token file.
        file: Arc<TokenFile>,
        /// The part's first token in the file.
        start: usize,
        /// The part's tokens.
        len: usize,
    },
}

impl Tokens {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Tokens::Memory(t) => t.len(),
            Tokens::Disk { len, .. } => *len,
        }
    }

    /// Whether the part holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends tokens `at .. at + n` of the part to `out`.
    fn extend(&self, at: usize, n: usize, out: &mut Vec<u32>) -> Result<()> {
        match self {
            Tokens::Memory(t) => out.extend_from_slice(&t[at..at + n]),
            Tokens::Disk { file, start, .. } => {
                let from = out.len();
                out.resize(from + n, 0);
                file.read(start + at, &mut out[from..])?;
            }
        }
        Ok(())
    }
}

/// Character-level language modelling: a [`Gpt`] on random windows of a text.
pub struct TextWorkload {
    /// The training part of the tokenised text.
    pub train: Tokens,
    /// The validation part, which follows it.
    pub val: Tokens,
    /// The model (vocabulary size resolved).
    pub config: GptConfig,
    /// Seed of the window sampling.
    pub seed: u64,
    /// Start offsets of the fixed validation windows.
    pub eval: Vec<usize>,
}

impl TextWorkload {
    fn windows(&self, tokens: &Tokens, starts: &[usize], device: &Device) -> Result<TokenBatch> {
        let t = self.config.block_size;
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
        Ok(TokenBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [n, t]), device),
            targets: Tensor::from_data(TensorData::new(targets, [n, t]), device),
        })
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
        (self.train.len() / self.config.block_size).max(1)
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
            self.config.block_size,
            self.seed,
            step as u64,
            slots * batch,
        );
        Some(all[slot * batch..(slot + 1) * batch].to_vec())
    }

    fn tokens_per_sample(&self) -> Option<usize> {
        Some(self.config.block_size)
    }

    fn flops_per_sample(&self) -> Option<f64> {
        Some(self.config.flops_per_token() * self.config.block_size as f64)
    }
}

/// `train sample`: continue a prompt with a trained GPT.
#[derive(Debug, clap::Args)]
pub struct SampleArgs {
    /// The run directory of a GPT run.
    #[arg(long, value_name = "PATH")]
    pub run: PathBuf,
    /// Text to continue (every character must be in the run's vocabulary).
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Number of characters to generate.
    #[arg(long, default_value_t = 500)]
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely character.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample only among the K most likely characters.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// `train sample`: prints the continuation of a prompt by a trained GPT run.
pub fn sample(args: SampleArgs) -> Result<()> {
    say!("{}", generate(&args)?);
    Ok(())
}

/// Generates text from a trained GPT run; returns prompt + continuation.
pub fn generate(args: &SampleArgs) -> Result<String> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return Err(Error::config(format!(
            "--temperature {}: expected a number >= 0",
            args.temperature
        )));
    }
    if args.top_k == Some(0) {
        return Err(Error::config("--top-k 0: expected at least 1".to_string()));
    }
    let tokenizer_path = args.run.join(TOKENIZER_FILE);
    if !tokenizer_path.is_file() {
        return Err(Error::checkpoint(format!(
            "{}: not found; is {} a GPT run directory?",
            tokenizer_path.display(),
            args.run.display()
        )));
    }
    let tokenizer = kiln_datasets::text::CharTokenizer::load(&tokenizer_path)?;
    let device = burn::prelude::Device::flex();
    let (model, config) = kiln_models::load_gpt_run(&args.run, &device)
        .map_err(|e| Error::checkpoint(e.to_string()))?;
    let prompt = tokenizer
        .encode(&args.prompt)
        .map_err(|e| Error::config(format!("--prompt: {e}")))?;
    if prompt.is_empty() {
        return Err(Error::config("--prompt: must not be empty".to_string()));
    }
    let mut rng = kiln_datasets::rng::SplitMix64::new(args.seed);
    let ids = model.generate(
        &prompt,
        args.tokens,
        args.temperature,
        args.top_k,
        config.block_size,
        || rng.next_f64(),
    );
    Ok(tokenizer.decode(&ids))
}
