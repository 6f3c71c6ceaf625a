//! The built-in program's config: kiln's sections, the model's `[model]` and the data's
//! `[data]` (which set, where, how it is cut), checked against each other.

use std::path::{Path, PathBuf};

use kiln_models::{ModelKind, ModelSection};
use serde::{Deserialize, Serialize};

use crate::app::UserConfig;
use kiln_engine::config::name_of;
use kiln_engine::error::{Error, Result};

/// The recipe `train` runs without `--config` (`recipes/digits-convnet.toml`, which
/// `configs/digits-convnet.toml` links to), built in so that `train` trains with no files and
/// no arguments, from any directory.
pub const RECIPE: &str = include_str!("../../recipes/digits-convnet.toml");

/// How errors name the built-in recipe.
pub const RECIPE_ORIGIN: &str = "built-in configs/digits-convnet.toml";

/// The built-in workloads' config: their `[model]` and `[data]`, and kiln's sections.
pub type Config = UserConfig<ModelSection, DataConfig>;

/// Which dataset a run trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DatasetKind {
    /// The 1,797 8×8 digits embedded in kiln (no files needed).
    Digits,
    /// MNIST IDX files in `data.dir`.
    Mnist,
    /// Fashion-MNIST IDX files in `data.dir`.
    FashionMnist,
    /// A UTF-8 text file in `data.path`, tokenised by character, by a `tokenizer.json` or by a
    /// BPE trained on it (for the language models: `gpt`, `llama`, `gpt2`, `hf`).
    Text,
    /// PNG/JPEG images in `data.dir`: `train/` and `test/` (or `val/`), one sub-folder per
    /// class (torchvision's ImageFolder layout), decoded as batches need them.
    ImageFolder,
    /// A CSV table in `data.path` (numeric columns; `data.target` the class), for
    /// `model.kind = "mlp"`.
    Csv,
    /// Prompt and answer pairs, one JSON object per line of `data.path` (Alpaca's
    /// `instruction`/`input`/`output`, `prompt`/`completion`, or the fields `data.fields`
    /// names), rendered with the checkpoint's chat template, for the language models.
    Instruct,
    /// Conversations, one JSON object per line of `data.path` with a `messages` list of
    /// `{role, content}` (`system`, `user`, `assistant`), rendered with the checkpoint's chat
    /// template, for the language models.
    Chat,
}

impl DatasetKind {
    /// Whether a language model trains on it.
    pub fn is_text(self) -> bool {
        matches!(self, Self::Text | Self::Instruct | Self::Chat)
    }
}

/// `instruct`/`chat`: which tokens the loss is taken on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TrainOn {
    /// The assistant's answers alone (with the template's end of the turn): the prompt's
    /// tokens, the system message's and the template's own have no loss.
    Responses,
    /// Every token of the rendered conversation.
    All,
}

/// `instruct`/`chat`: what happens to an example longer than `data.context` + 1 tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Overlong {
    /// Its first tokens are kept (it still trains where an answer lies in them).
    Truncate,
    /// It is left out, and counted with the records set aside.
    Drop,
}

/// `instruct`/`chat`: the fields of a record, where they are not the usual ones.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FieldNames {
    /// `instruct`: the prompt's field (`instruction` or `prompt` by default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// `instruct`: an input that follows the prompt after a blank line (`input` with
    /// `instruction`; none with `prompt`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// `instruct`: the answer's field (`output` or `completion` by default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response: Option<String>,
    /// `instruct`: a system message's field (`system` by default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// `chat`: the list of turns (`messages` by default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub messages: Option<String>,
}

/// `[data]`: dataset choice and location.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// `digits` (embedded), `mnist` or `fashion-mnist`. Default `digits`.
    pub dataset: DatasetKind,
    /// Directory of the IDX files for `mnist`/`fashion-mnist`. Default `data/<dataset>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// Download the dataset from its canonical URL when `dir` is missing. Default false.
    pub download: bool,
    /// Drop the last incomplete global batch of an epoch instead of wrapping around.
    /// Default false.
    pub drop_last: bool,
    /// The text file of the `text` dataset. Default `data/text/moby-dick.txt`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Fraction of the text (from its start) used for training; the rest is validation.
    /// Default 0.9.
    pub train_fraction: f64,
    /// Number of fixed validation windows the `text` dataset is scored on. Default 240.
    pub eval_windows: usize,
    /// `image-folder`: the `[height, width]` images are resized to. Default: the first
    /// training image's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_size: Option<[usize; 2]>,
    /// `image-folder`: 1 (grey) or 3 (RGB). Default: the first training image's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub channels: Option<usize>,
    /// `image-folder`: random crop (within a zero border of 1/8 of each side) and left–right
    /// flip of every training image, drawn from (seed, step, sample). Default false.
    pub augment: bool,
    /// `text`: read the training and validation windows from a token file written beside the
    /// text (`<path>.kiln-tokens`, 16-bit ids, reused while the text is unchanged) instead of
    /// holding the text in memory: a corpus larger than memory trains. The same tokens and
    /// windows either way. Default false.
    pub on_disk: bool,
    /// `text`: the vocabulary of a trained model — its run directory or its `tokenizer.json`
    /// — instead of one built from the text: what fine-tuning a text GPT on another text
    /// needs. The text's characters outside it are left out (the start-up table counts them).
    /// Not with `on_disk`. Default: the text's own. `instruct`/`chat`: the directory (or its
    /// `tokenizer.json`) of the tokenizer and chat template. Default: `init.from`'s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// `text`: tokens per training and validation window. Default: the model's longest
    /// context (a GPT's `block_size`, a Llama's `max_position_embeddings`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
    /// `text`: train a byte-level BPE tokenizer of this many ids on the text's training part
    /// at the start (Hugging Face's `tokenizers`, saved in the run as `tokenizer.json`)
    /// instead of one id per character. Default: characters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bpe_vocab: Option<usize>,
    /// `csv`: the target column (classes numbered from 0). Default `label`.
    pub target: String,
    /// `csv`: the feature columns. Default: every column but the target.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
    /// `csv`: a table of evaluation rows (the same columns); `instruct`/`chat`: a JSONL file
    /// of validation records. Default: the rows or records left after `train_fraction` of a
    /// seeded shuffle.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_path: Option<PathBuf>,
    /// `instruct`/`chat`: the fields of a record, where they are not the usual ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fields: Option<FieldNames>,
    /// `instruct`/`chat`: `responses` (the loss on the answers alone) or `all`. Default
    /// `responses`.
    pub train_on: TrainOn,
    /// `instruct`/`chat`: `truncate` or `drop` an example longer than the context. Default
    /// `truncate`.
    pub overlong: Overlong,
    /// `instruct`/`chat`: the largest share of the records that may be set aside (a line that
    /// does not parse, a record without its fields, an unknown role, a template that does not
    /// render it, an example dropped for its length) before the run is refused. Default 0.01.
    pub max_dropped: f64,
    /// `instruct`/`chat`: pack the training examples into rows of `data.context` tokens
    /// (attention within each example, positions from 0 in each) instead of padding each to
    /// its batch's longest. Default false.
    pub pack: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: DatasetKind::Digits,
            dir: None,
            download: false,
            drop_last: false,
            path: None,
            train_fraction: 0.9,
            eval_windows: 240,
            image_size: None,
            channels: None,
            augment: false,
            on_disk: false,
            tokenizer: None,
            context: None,
            bpe_vocab: None,
            target: "label".to_string(),
            features: Vec::new(),
            eval_path: None,
            fields: None,
            train_on: TrainOn::Responses,
            overlong: Overlong::Truncate,
            max_dropped: 0.01,
            pack: false,
        }
    }
}

impl DataConfig {
    /// The directory the IDX files are read from.
    pub fn resolved_dir(&self) -> PathBuf {
        self.dir.clone().unwrap_or_else(|| match self.dataset {
            DatasetKind::Digits => PathBuf::from("data/digits"),
            DatasetKind::Mnist => PathBuf::from("data/mnist"),
            DatasetKind::FashionMnist => PathBuf::from("data/fashion-mnist"),
            DatasetKind::Text => PathBuf::from("data/text"),
            DatasetKind::ImageFolder => PathBuf::from("data/image-folder"),
            DatasetKind::Csv | DatasetKind::Instruct | DatasetKind::Chat => PathBuf::from("data"),
        })
    }

    /// The text file of the `text` dataset.
    pub fn resolved_path(&self) -> PathBuf {
        self.path
            .clone()
            .unwrap_or_else(|| PathBuf::from("data/text/moby-dick.txt"))
    }
}

impl DataConfig {
    /// Rejects values that parse but cannot work, naming the key.
    pub fn check(&self) -> Result<()> {
        let f = self.train_fraction;
        if f.is_nan() || f <= 0.0 || f >= 1.0 {
            return Err(Error::config(format!(
                "key `data.train_fraction`: must be between 0 and 1, got {f}"
            )));
        }
        if self.eval_windows == 0 {
            return Err(Error::config(
                "key `data.eval_windows`: must be at least 1, got 0",
            ));
        }
        if let Some(c) = self.channels
            && c != 1
            && c != 3
        {
            return Err(Error::config(format!(
                "key `data.channels`: must be 1 (grey) or 3 (RGB), got {c}"
            )));
        }
        let m = self.max_dropped;
        if !(0.0..=1.0).contains(&m) {
            return Err(Error::config(format!(
                "key `data.max_dropped`: a share of the records from 0 to 1, got {m}"
            )));
        }
        if self.context == Some(0) {
            return Err(Error::config(
                "key `data.context`: must be at least 1, got 0",
            ));
        }
        if let Some(n) = self.bpe_vocab
            && n <= 257
        {
            return Err(Error::config(format!(
                "key `data.bpe_vocab`: {n} ids leave no room for merges (a byte-level BPE holds \
                 the 256 bytes and one special token); ask for more than 257"
            )));
        }
        if self.bpe_vocab.is_some() && self.tokenizer.is_some() {
            return Err(Error::config(
                "key `data.bpe_vocab`: trains a tokenizer, and data.tokenizer names one; set one \
                 of them",
            ));
        }
        if let Some([h, w]) = self.image_size
            && (h == 0 || w == 0)
        {
            return Err(Error::config(format!(
                "key `data.image_size`: must be [height, width] in pixels, both positive, got                  [{h}, {w}]"
            )));
        }
        Ok(())
    }
}

/// Rejects a `[data]` that cannot work, or that does not fit `[model]` (a GPT trains on text,
/// an image model on images).
pub fn check(config: &Config) -> Result<()> {
    config.data.check()?;
    let text_model = config.model.kind.is_language_model();
    let text_data = config.data.dataset.is_text();
    if text_model != text_data {
        return Err(Error::config(format!(
            "key `data.dataset`: {:?} does not fit model.kind = {:?} (language models train \
             on \"text\", \"instruct\" and \"chat\", image models on image datasets)",
            name_of(&config.data.dataset),
            name_of(&config.model.kind)
        )));
    }
    if config.kiln.export.format == kiln_engine::config::ExportFormat::Hf
        && !config.model.has_hf_layout()
    {
        return Err(Error::config(format!(
            "key `export.format`: \"hf\" writes a family with a Hugging Face layout; \
             model.kind = {:?} has none (\"pytorch\" writes its PyTorch layout)",
            name_of(&config.model.kind)
        )));
    }
    if config.data.dataset == DatasetKind::Csv && config.model.kind != ModelKind::Mlp {
        return Err(Error::config(format!(
            "key `model.kind`: the csv dataset trains the \"mlp\", not {:?} (a table's rows \
             have no image to convolve)",
            name_of(&config.model.kind)
        )));
    }
    Ok(())
}

/// Reads a config file of the built-in workloads (none: every default), applies `--set`
/// overrides and checks the result as `train` does.
pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config> {
    let (table, origin) = kiln_engine::config::read_source(path, overrides)?;
    let config = Config::from_source(table, &origin)?;
    check(&config).map_err(|e| origin.name(e))?;
    Ok(config)
}
