//! A text as tokens for the language models: the vocabulary (one id per character, a
//! Hugging Face `tokenizer.json`, or a byte-level BPE trained on the text), the training and
//! validation parts (in memory, or read from a token file), as `[data]` says.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_datasets::subword::SubwordTokenizer;
use kiln_datasets::text::{CharTokenizer, TextData};
use kiln_datasets::tokens::TokenFile;

use super::config::Config;
use kiln_engine::error::{Error, Result};

/// File of the tokenizer inside a text run's directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The ids a text run's tokens come from.
#[derive(Debug, Clone)]
pub enum Vocab {
    /// One id per character.
    Chars(CharTokenizer),
    /// Subword ids of a Hugging Face `tokenizer.json`.
    Subword(Box<SubwordTokenizer>),
}

impl Vocab {
    /// The number of ids.
    pub fn size(&self) -> usize {
        match self {
            Vocab::Chars(t) => t.vocab_size(),
            Vocab::Subword(t) => t.vocab_size(),
        }
    }

    /// What one id is, in words.
    pub(super) fn unit(&self) -> &'static str {
        match self {
            Vocab::Chars(_) => "characters",
            Vocab::Subword(_) => "tokens",
        }
    }

    /// Reads a run's or a checkpoint's `tokenizer.json` (or the directory holding one):
    /// kiln's character vocabulary or a Hugging Face tokenizer, as its content says.
    pub fn load(path: &Path) -> Result<Self> {
        let file = kiln_datasets::subword::tokenizer_file(path);
        if kiln_datasets::subword::is_subword_file(&file) {
            Ok(Vocab::Subword(Box::new(SubwordTokenizer::load(&file)?)))
        } else {
            Ok(Vocab::Chars(CharTokenizer::load(&file)?))
        }
    }

    /// Writes the vocabulary to `path`.
    pub fn save(&self, path: &Path) -> Result<()> {
        match self {
            Vocab::Chars(t) => Ok(t.save(path)?),
            Vocab::Subword(t) => Ok(t.save(path)?),
        }
    }

    /// The ids of `text`.
    pub fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        match self {
            Vocab::Chars(t) => t.encode(text).map_err(|e| e.to_string()),
            Vocab::Subword(t) => t.encode(text),
        }
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> std::result::Result<String, String> {
        match self {
            Vocab::Chars(t) => Ok(t.decode(ids)),
            Vocab::Subword(t) => t.decode(ids),
        }
    }
}

/// A text as tokens: its vocabulary, the training and validation parts, its name, and — with
/// a character vocabulary from `data.tokenizer` — how many characters it left out.
pub(super) struct TextParts {
    pub vocab: Vocab,
    pub train: Tokens,
    pub val: Tokens,
    pub name: String,
    pub dropped: Option<usize>,
    /// Subword tokens: the validation part's characters per token (a loss per token in
    /// nats, divided by this and ln 2, is bits per character).
    pub chars_per_token: Option<f64>,
}

/// The text of `path` as [`TextParts`], tokenised as `[data]` says: `data.tokenizer` (a
/// Hugging Face tokenizer, or a trained character vocabulary), a byte-level BPE trained on
/// the training part (`data.bpe_vocab`), or the text's own characters (in memory or from a
/// token file, `data.on_disk`).
pub(super) fn read_text(config: &Config, path: &Path) -> Result<TextParts> {
    let d = &config.data;
    let subword_from = d
        .tokenizer
        .as_ref()
        .filter(|t| kiln_datasets::subword::is_subword_file(t));
    if subword_from.is_some() || d.bpe_vocab.is_some() {
        if d.on_disk {
            return Err(Error::config(
                "key `data.on_disk`: subword tokens are read in memory; set data.on_disk = false"
                    .to_string(),
            ));
        }
        let (name, whole) = kiln_datasets::text::read_text_file(path)?;
        let cut = kiln_datasets::text::char_boundary(&whole, d.train_fraction);
        let (train_text, val_text) = whole.split_at(cut);
        let tokenizer = match subword_from {
            Some(from) => SubwordTokenizer::load(from)?,
            None => {
                let size = d.bpe_vocab.expect("checked");
                SubwordTokenizer::train_byte_level(train_text, size).map_err(|e| {
                    Error::data(format!("{}: training a BPE tokenizer: {e}", path.display()))
                })?
            }
        };
        let encode = |part: &str| {
            tokenizer
                .encode(part)
                .map_err(|e| Error::data(format!("{}: cannot tokenise it: {e}", path.display())))
        };
        let (train, val) = (encode(train_text)?, encode(val_text)?);
        let chars_per_token = val_text.chars().count() as f64 / val.len().max(1) as f64;
        return Ok(TextParts {
            chars_per_token: Some(chars_per_token),
            vocab: Vocab::Subword(Box::new(tokenizer)),
            train: Tokens::Memory(train),
            val: Tokens::Memory(val),
            name,
            dropped: None,
        });
    }
    let mut dropped = None;
    let (tokenizer, train, val, name) = if let Some(from) = &d.tokenizer {
        if d.on_disk {
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
        let trained = CharTokenizer::load(&file).map_err(|e| {
            Error::config(format!(
                "key `data.tokenizer`: {}",
                kiln_engine::config::one_line(&e)
            ))
        })?;
        let (data, left_out) = TextData::from_file_with(path, d.train_fraction, trained)?;
        dropped = Some(left_out);
        (
            data.tokenizer,
            Tokens::Memory(data.train),
            Tokens::Memory(data.val),
            data.name,
        )
    } else if d.on_disk {
        let cache = token_file(path);
        // One process per machine writes the token file; the others wait for it.
        let file = if kiln_engine::comm::processes().local_index == 0 {
            let file = TokenFile::prepare(path, &cache);
            kiln_engine::comm::process_barrier();
            file?
        } else {
            kiln_engine::comm::process_barrier();
            TokenFile::prepare(path, &cache)?
        };
        let tokenizer = file.tokenizer().clone();
        let cut = kiln_datasets::text::train_part(file.len(), d.train_fraction);
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
        let data = TextData::from_file(path, d.train_fraction)?;
        (
            data.tokenizer,
            Tokens::Memory(data.train),
            Tokens::Memory(data.val),
            data.name,
        )
    };
    Ok(TextParts {
        vocab: Vocab::Chars(tokenizer),
        train,
        val,
        name,
        dropped,
        chars_per_token: None,
    })
}

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
    pub(super) fn extend(&self, at: usize, n: usize, out: &mut Vec<u32>) -> Result<()> {
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
