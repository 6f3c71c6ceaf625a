//! A checkpoint's `state.json`: the loop state and the size and SHA-256 of each other file,
//! written last.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use burn::store::burn_pack::Scalar;

use crate::config::one_line;
use crate::error::{Error, Result};
use crate::state::LoopState;

/// File of the model weights inside a checkpoint.
pub const MODEL_FILE: &str = "model.bpk";

/// File of the optimizer state inside a checkpoint.
pub const OPTIM_FILE: &str = "optimizer.bpk";

/// File of the loop state inside a checkpoint; written last, so its presence marks a
/// complete checkpoint.
pub const STATE_FILE: &str = "state.json";

/// A file of a checkpoint as its `state.json` records it: the size and the SHA-256 of its
/// bytes, so that a resume trusts no file that changed after it was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Its length in bytes.
    pub bytes: u64,
    /// The SHA-256 of its bytes, in hexadecimal.
    pub sha256: String,
}

/// What `state.json` holds: the loop state, and the digest of every other file of the
/// checkpoint (absent in checkpoints of an older kiln, which are read unverified).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Manifest {
    #[serde(flatten)]
    pub(super) state: LoopState,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) files: BTreeMap<String, FileDigest>,
    /// A sharded checkpoint's ranks and optimizers (absent in a gathered one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) sharded: Option<ShardedInfo>,
}

/// The size and SHA-256 of the file at `path`, read in one pass.
pub fn digest(path: &Path) -> Result<FileDigest> {
    use sha2::Digest;
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = sha2::Sha256::new();
    let bytes = std::io::copy(&mut file, &mut hasher).map_err(|e| Error::io(path, e))?;
    let sha256 = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(FileDigest { bytes, sha256 })
}

pub(super) fn read_manifest(dir: &Path) -> Result<Manifest> {
    read_json(&dir.join(STATE_FILE), "loop state")
}

/// A checkpoint's JSON file read as `T`; an error names the file and calls what it should
/// have held `what`.
pub(super) fn read_json<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> Result<T> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        Error::checkpoint(format!(
            "{}: corrupt {what}: {}",
            path.display(),
            one_line(&e)
        ))
    })
}

/// What `state.json` says of a sharded checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct ShardedInfo {
    /// The ranks that wrote it.
    pub world: usize,
    /// Every optimizer's kind and scalars.
    pub optimizers: Vec<StoredOptimizer>,
}

/// An optimizer's kind and scalars as `state.json` records them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct StoredOptimizer {
    /// `""` for the model's one optimizer, else the parameter group's name.
    pub group: String,
    /// `adamw` or `sgd`.
    pub kind: String,
    /// AdamW's step count, …
    pub scalars: BTreeMap<String, StoredScalar>,
}

/// A scalar of an optimizer state.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum StoredScalar {
    Int(i64),
    Uint(u64),
    Float(f64),
    Bool(bool),
}

impl From<Scalar> for StoredScalar {
    fn from(s: Scalar) -> Self {
        match s {
            Scalar::Int(v) => Self::Int(v),
            Scalar::UInt(v) => Self::Uint(v),
            Scalar::Float(v) => Self::Float(v),
            Scalar::Bool(v) => Self::Bool(v),
        }
    }
}

impl From<StoredScalar> for Scalar {
    fn from(s: StoredScalar) -> Self {
        match s {
            StoredScalar::Int(v) => Self::Int(v),
            StoredScalar::Uint(v) => Self::UInt(v),
            StoredScalar::Float(v) => Self::Float(v),
            StoredScalar::Bool(v) => Self::Bool(v),
        }
    }
}
