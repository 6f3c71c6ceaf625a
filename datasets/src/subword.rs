//! Subword tokenizers in Hugging Face's `tokenizer.json` format, through Hugging Face's own
//! `tokenizers` crate: the tokenizer a checkpoint ships with (Llama's, GPT-2's byte-level BPE,
//! any the format describes), and a byte-level BPE trained here on a text.
//!
//! The crate is built without its network features (nothing is fetched) and with its
//! pure-Rust regular expressions (`fancy-regex`) rather than the C library Oniguruma: no C
//! build step, so kiln's crates build and publish with a Rust toolchain alone; the
//! pre-tokenizer's patterns (lookahead included) are the same. Encoding is slower than with
//! Oniguruma, which matters once per dataset, not per step.

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

use crate::error::DatasetError;

/// The file name of a tokenizer inside a model directory.
pub const TOKENIZER_JSON: &str = "tokenizer.json";

/// A text's token ids and each one's byte range in the text.
pub type Pieces = (Vec<u32>, Vec<(usize, usize)>);

/// A subword tokenizer: ids of a text's pieces, and the text of ids.
#[derive(Clone)]
pub struct SubwordTokenizer {
    inner: Tokenizer,
}

impl std::fmt::Debug for SubwordTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubwordTokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish_non_exhaustive()
    }
}

/// `path` itself, or `path/tokenizer.json` when `path` is a directory.
pub fn tokenizer_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(TOKENIZER_JSON)
    } else {
        path.to_path_buf()
    }
}

/// Whether the JSON file at `path` (or in the directory) is a Hugging Face tokenizer (its
/// `model` an object with a `type`) rather than kiln's character vocabulary.
pub fn is_subword_file(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(tokenizer_file(path)) else {
        return false;
    };
    // A cheap look at the top level; the full parse is `load`'s.
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("model").and_then(|m| m.get("type")).cloned())
        .is_some()
}

fn bad(path: &Path, reason: impl std::fmt::Display) -> DatasetError {
    DatasetError::BadTokenizer {
        path: Some(path.to_path_buf()),
        reason: reason
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    }
}

impl SubwordTokenizer {
    /// Reads `path` (a `tokenizer.json`, or a directory holding one).
    pub fn load(path: &Path) -> Result<Self, DatasetError> {
        let file = tokenizer_file(path);
        if !file.is_file() {
            return Err(bad(&file, "no such file (a Hugging Face tokenizer.json)"));
        }
        let inner = Tokenizer::from_file(&file).map_err(|e| bad(&file, e))?;
        Ok(Self { inner })
    }

    /// The number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The ids of `text`'s pieces, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The ids of `text`'s pieces, without special tokens, and each piece's byte range in
    /// `text`.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Pieces, String> {
        self.inner
            .encode(text, false)
            .map(|e| (e.get_ids().to_vec(), e.get_offsets().to_vec()))
            .map_err(|e| e.to_string())
    }

    /// The text of the token `id` (an added or special token included).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of the token whose text is `token` (an added or special token included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.decode(ids, false).map_err(|e| e.to_string())
    }

    /// Writes the tokenizer to `path` as a `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<(), DatasetError> {
        let text = self
            .inner
            .to_string(true)
            .map_err(|e| bad(path, format!("cannot write it: {e}")))?;
        crate::text::write_atomically(path, text.as_bytes())
    }

    /// A byte-level BPE (GPT-2's pre-tokenizer, every byte in the alphabet, so no text is
    /// out of vocabulary) of `vocab_size` ids trained on `text`, with `<|endoftext|>` as its
    /// one special token.
    pub fn train_byte_level(text: &str, vocab_size: usize) -> Result<Self, String> {
        let mut trainer = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
            .build();
        let mut tokenizer = TokenizerBuilder::new()
            .with_model(BPE::default())
            .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
            .with_decoder(Some(ByteLevel::default()))
            .with_post_processor(Some(ByteLevel::new(false, false, true)))
            .with_normalizer(None::<tokenizers::normalizers::Sequence>)
            .build()
            .map_err(|e| e.to_string())?;
        // The text in pieces of about 2,000 characters (cut at a character boundary): the
        // trainer counts words per piece.
        let mut pieces = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = rest.len().min(2000);
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            pieces.push(&rest[..cut]);
            rest = &rest[cut..];
        }
        tokenizer
            .train(&mut trainer, pieces.into_iter())
            .map_err(|e| e.to_string())?;
        Ok(Self {
            inner: tokenizer.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trained_byte_level_bpe_round_trips_any_text() {
        let text = "the whale, the whale! Call me Ishmael. ".repeat(40);
        let tok = SubwordTokenizer::train_byte_level(&text, 300).unwrap();
        assert!(tok.vocab_size() > 256 && tok.vocab_size() <= 300);
        let ids = tok.encode("the whale").unwrap();
        assert!(ids.len() < "the whale".len(), "{ids:?}: merges were learnt");
        // Bytes it never saw still encode (byte-level) and decode back.
        let odd = "naïve — ψ";
        assert_eq!(tok.decode(&tok.encode(odd).unwrap()).unwrap(), odd);
        let dir = std::env::temp_dir().join(format!("kiln-subword-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        tok.save(&dir.join(TOKENIZER_JSON)).unwrap();
        assert!(is_subword_file(&dir));
        let back = SubwordTokenizer::load(&dir).unwrap();
        assert_eq!(back.encode(odd).unwrap(), tok.encode(odd).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
