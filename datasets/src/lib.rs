//! Dataset loaders for kiln.
//!
//! This crate knows nothing about tensors: it turns files on disk (IDX files as used by MNIST and
//! Fashion-MNIST) or the small digits set embedded in the binary into plain `u8` buffers, and
//! plain-text corpora into character token ids, and validates them thoroughly so that a bad
//! download fails at start-up with a precise message instead of producing a silently broken
//! training run.
#![deny(missing_docs)]

mod char_json;
pub mod chat;
mod digits;
mod download;
mod error;
#[cfg(feature = "images")]
pub mod folder;
mod idx;
mod images;
pub mod rng;
pub mod subword;
pub mod table;
pub mod text;
pub mod tokens;

pub use digits::{DIGITS_SEED, DIGITS_TEST, DIGITS_TOTAL, DIGITS_TRAIN, digits};
pub use download::download_mnist;
pub use error::DatasetError;
pub use idx::{IdxKind, load_idx_dir, read_idx_images, read_idx_labels};
pub use images::{ImageDataset, ImageSplits};
pub use text::{
    CharTokenizer, TINY_SHAKESPEARE_URL, TextData, download_text, eval_starts, rank_share,
    window_starts,
};
