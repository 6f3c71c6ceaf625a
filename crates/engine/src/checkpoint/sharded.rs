//! Sharded checkpoints: every rank writes its share in parallel — `rank-NNNNN.bin`, its
//! pieces' values (f32, little-endian, one piece after another), then `rank-NNNNN.json`, which
//! tensor ranges they are, where in the file, and the file's SHA-256 —, rank 0 (and each
//! pipeline stage) also `rest-NNNNN.bpk` (the model's tensors no piece holds that it writes);
//! rank 0 writes `state.json` last, once every
//! rank's index is there, recording every file's digest and each optimizer's kind and scalars.
//! A rank's index is written after its values are synced, so an index on disk means its values
//! are durable, and `state.json` on disk means the whole checkpoint is.
//!
//! Any world reads one back (`reader.rs`: [`Sharded`](super::Sharded)): a rank asks for the
//! ranges of the tensors it needs and only those bytes are read, whichever ranks wrote them.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};

use super::manifest::{
    FileDigest, Manifest, STATE_FILE, ShardedInfo, StoredOptimizer, digest, read_json,
};
use crate::config::{name_of, one_line};
use crate::error::{Error, Result};
use crate::files::{write_atomic, write_synced};
use crate::optim::{Cut, Share};
use crate::state::LoopState;

/// The file of the model's tensors outside the pieces that rank `rank` wrote (rank 0's, or
/// each pipeline stage's own).
pub fn rest_file(rank: usize) -> String {
    format!("rest-{rank:05}.bpk")
}

/// The file of rank `rank`'s values.
pub fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.bin")
}

/// The index of rank `rank`'s values.
pub fn index_file(rank: usize) -> String {
    format!("rank-{rank:05}.json")
}

/// A rank's index: which tensor ranges its file holds and where.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RankIndex {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) file: String,
    /// Its record of the model's tensors outside the pieces, if it wrote one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) rest: Option<String>,
    pub(super) bytes: u64,
    pub(super) sha256: String,
    pub(super) pieces: Vec<StoredPiece>,
}

/// A piece as an index records it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct StoredPiece {
    pub(super) tensor: String,
    pub(super) shape: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) id: Option<u64>,
    pub(super) dtype: String,
    pub(super) start: usize,
    pub(super) len: usize,
    /// Byte offset of its values in the rank's file.
    pub(super) offset: u64,
    /// The tensor-parallel part it is of a cut tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) cut: Option<Cut>,
}

fn dtype_name(dtype: FloatDType) -> &'static str {
    match dtype {
        FloatDType::BF16 => "bf16",
        FloatDType::F16 => "f16",
        FloatDType::F64 => "f64",
        _ => "f32",
    }
}

pub(super) fn dtype_of(name: &str) -> Option<FloatDType> {
    Some(match name {
        "f32" => FloatDType::F32,
        "bf16" => FloatDType::BF16,
        "f16" => FloatDType::F16,
        "f64" => FloatDType::F64,
        _ => return None,
    })
}

/// Writes rank `rank`'s share into the checkpoint's temporary directory `dir`: its values,
/// synced, then its index (atomically, last); rank 0 also the rest of the model.
pub fn write_share(dir: &Path, rank: usize, world: usize, share: Share) -> Result<()> {
    use sha2::Digest;
    let file = rank_file(rank);
    let path = dir.join(&file);
    let io = |e: std::io::Error| Error::checkpoint(format!("{}: {e}", path.display()));
    let mut out = std::fs::File::create(&path).map_err(io)?;
    let mut hasher = sha2::Sha256::new();
    let mut stored = Vec::with_capacity(share.pieces.len());
    let mut offset = 0u64;
    let mut bytes = Vec::with_capacity(1 << 20);
    for p in &share.pieces {
        let values = &share.buffers[p.buffer][p.at..p.at + p.len];
        for chunk in values.chunks(1 << 18) {
            bytes.clear();
            for v in chunk {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            hasher.update(&bytes);
            out.write_all(&bytes).map_err(io)?;
        }
        stored.push(StoredPiece {
            tensor: p.tensor.clone(),
            shape: p.shape.clone(),
            id: p.id,
            dtype: dtype_name(p.dtype).to_string(),
            start: p.start,
            len: p.len,
            offset,
            cut: p.cut.clone(),
        });
        offset += p.len as u64 * 4;
    }
    out.sync_all().map_err(io)?;
    drop(out);
    let sha256 = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let rest = match share.rest {
        Some(record) => {
            let name = rest_file(rank);
            let path = dir.join(&name);
            record
                .save(&path)
                .map_err(|e| Error::checkpoint(format!("{}: {}", path.display(), one_line(&e))))?;
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| Error::io(&path, e))?;
            Some(name)
        }
        None => None,
    };
    if let Some(optimizers) = share.optimizers {
        let optimizers = optimizers
            .into_iter()
            .map(|(group, kind, scalars)| StoredOptimizer {
                group,
                kind: name_of(&kind),
                scalars: scalars.into_iter().map(|(k, v)| (k, v.into())).collect(),
            })
            .collect::<Vec<_>>();
        let json = serde_json::to_vec_pretty(&optimizers).expect("optimizers serialise");
        write_atomic(&dir.join(OPTIMIZERS_FILE), &json)?;
    }
    let index = RankIndex {
        rank,
        world,
        file,
        rest,
        bytes: offset,
        sha256,
        pieces: stored,
    };
    let json = serde_json::to_vec(&index).expect("an index serialises");
    write_atomic(&dir.join(index_file(rank)), &json)
}

/// Rank 0's note of the optimizers' kinds and scalars, read into `state.json` and removed.
const OPTIMIZERS_FILE: &str = "optimizers.json";

/// How long rank 0 waits for another rank's share while no share arrives before it gives the
/// checkpoint up.
const WAIT_FOR_SHARES: Duration = Duration::from_secs(600);

/// The file a rank whose write failed leaves beside its share, saying why: rank 0 stops
/// waiting for it at once.
pub fn failed_file(rank: usize) -> String {
    format!("rank-{rank:05}.failed")
}

/// Leaves rank `rank`'s failure to write its share in `dir` for rank 0 to read (best effort).
pub fn note_failure(dir: &Path, rank: usize, error: &Error) {
    let _ = std::fs::write(dir.join(failed_file(rank)), error.message());
}

/// Rank 0's end of a sharded write: once every rank's index is in `dir` (each polled for, up
/// to a deadline; `cancelled` gives up sooner), writes `state.json` with every file's digest
/// and the optimizers. The directory is still the temporary one; the caller lands it.
pub fn seal(
    dir: &Path,
    world: usize,
    state: &LoopState,
    cancelled: &dyn Fn() -> bool,
) -> Result<()> {
    let mut progress = Instant::now();
    let mut cancel_seen: Option<Instant> = None;
    for rank in 0..world {
        let index = dir.join(index_file(rank));
        while !index.is_file() {
            if let Ok(why) = std::fs::read_to_string(dir.join(failed_file(rank))) {
                return Err(Error::checkpoint(format!(
                    "{}: rank {rank} could not write its share of step {}'s checkpoint: {why}",
                    dir.display(),
                    state.step
                )));
            }
            if cancelled() {
                // A run that fails still lands the write when its ranks finish theirs soon.
                let since = *cancel_seen.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(10) {
                    return Err(Error::checkpoint(format!(
                        "{}: the run stopped before rank {rank} wrote its shard of step {}'s \
                         checkpoint: the checkpoint before it stays the newest",
                        dir.display(),
                        state.step
                    )));
                }
            }
            if progress.elapsed() > WAIT_FOR_SHARES {
                return Err(Error::checkpoint(format!(
                    "{}: rank {rank}'s shard of step {}'s checkpoint did not appear within {} \
                     s of the last one; a sharded checkpoint is written by every process into \
                     one run directory (a shared file system)",
                    dir.display(),
                    state.step,
                    WAIT_FOR_SHARES.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        progress = Instant::now();
    }
    let mut files = BTreeMap::new();
    for rank in 0..world {
        let name = index_file(rank);
        let index = read_index(dir, &name)?;
        files.insert(name.clone(), digest(&dir.join(&name))?);
        files.insert(
            index.file.clone(),
            FileDigest {
                bytes: index.bytes,
                sha256: index.sha256,
            },
        );
        if let Some(rest) = &index.rest {
            files.insert(rest.clone(), digest(&dir.join(rest))?);
        }
    }
    let optimizers_path = dir.join(OPTIMIZERS_FILE);
    let optimizers: Vec<StoredOptimizer> = read_json(&optimizers_path, "optimizers' note")?;
    std::fs::remove_file(&optimizers_path).map_err(|e| Error::io(&optimizers_path, e))?;
    let manifest = Manifest {
        state: state.clone(),
        files,
        sharded: Some(ShardedInfo { world, optimizers }),
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("loop state serialises");
    write_synced(&dir.join(STATE_FILE), &json)
}

pub(super) fn read_index(dir: &Path, name: &str) -> Result<RankIndex> {
    read_json(&dir.join(name), "shard index")
}
