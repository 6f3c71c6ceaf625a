//! Examples to fine-tune a checkpoint on: prompt and answer pairs or conversations read from
//! JSONL or Parquet files ([`records`]), rendered with the checkpoint's chat template
//! ([`template`], a Jinja template from its `tokenizer_config.json`), tokenized with its
//! `tokenizer.json` and marked where the answers are ([`mod@encode`]), so that the loss can be
//! taken on the answers only.

pub mod encode;
pub mod records;
pub mod template;

pub use encode::{Encoded, TrainOn, encode};
pub use records::{Fields, Message, Records, Rejected, read_records};
pub use template::ChatTemplate;
