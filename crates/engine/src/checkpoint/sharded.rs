//! Sharded checkpoints: every rank writes its share in parallel — `rank-NNNNN.bin`, its
//! pieces' values (f32, little-endian, one piece after another), then `rank-NNNNN.json`, which
//! tensor ranges they are, where in the file, and the file's SHA-256 —, rank 0 (and each
//! pipeline stage) also `rest-NNNNN.bpk` (the model's tensors no piece holds that it writes);
//! rank 0 writes `state.json` last, once every
//! rank's index is there, recording every file's digest and each optimizer's kind and scalars.
//! A rank's index is written after its values are synced, so an index on disk means its values
//! are durable, and `state.json` on disk means the whole checkpoint is.
//!
//! Any world reads one back ([`Sharded`]): a rank asks for the ranges of the tensors it needs
//! and only those bytes are read, whichever ranks wrote them.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::store::burn_pack::{self, Reader, Writer};
use burn::tensor::{DType, FloatDType};
use serde::{Deserialize, Serialize};

use super::manifest::{
    FileDigest, Manifest, STATE_FILE, ShardedInfo, StoredOptimizer, digest, read_manifest,
};
use crate::config::{OptimizerKind, name_of, one_line};
use crate::error::{Error, Result};
use crate::files::{write_atomic, write_synced};
use crate::optim::{Cut, OptimState, Scalars, Share, Source, optim_tensor};
use crate::params::FlatLayout;
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
struct RankIndex {
    rank: usize,
    world: usize,
    file: String,
    /// Its record of the model's tensors outside the pieces, if it wrote one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rest: Option<String>,
    bytes: u64,
    sha256: String,
    pieces: Vec<StoredPiece>,
}

/// A piece as an index records it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredPiece {
    tensor: String,
    shape: Vec<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
    dtype: String,
    start: usize,
    len: usize,
    /// Byte offset of its values in the rank's file.
    offset: u64,
    /// The tensor-parallel part it is of a cut tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cut: Option<Cut>,
}

fn dtype_name(dtype: FloatDType) -> &'static str {
    match dtype {
        FloatDType::BF16 => "bf16",
        FloatDType::F16 => "f16",
        FloatDType::F64 => "f64",
        _ => "f32",
    }
}

fn dtype_of(name: &str) -> Option<FloatDType> {
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
    let io = |e: std::io::Error| Error::io(&path, e);
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

/// How long rank 0 waits for the other ranks' shares before it gives the checkpoint up.
const WAIT_FOR_SHARES: Duration = Duration::from_secs(600);

/// Rank 0's end of a sharded write: once every rank's index is in `dir` (each polled for, up
/// to a deadline; `cancelled` gives up sooner), writes `state.json` with every file's digest
/// and the optimizers. The directory is still the temporary one; the caller lands it.
pub fn seal(
    dir: &Path,
    world: usize,
    state: &LoopState,
    cancelled: &dyn Fn() -> bool,
) -> Result<()> {
    let started = Instant::now();
    let mut cancel_seen: Option<Instant> = None;
    for rank in 0..world {
        let index = dir.join(index_file(rank));
        while !index.is_file() {
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
            if started.elapsed() > WAIT_FOR_SHARES {
                return Err(Error::checkpoint(format!(
                    "{}: rank {rank}'s shard of step {}'s checkpoint did not appear within {} \
                     s; a sharded checkpoint is written by every process into one run \
                     directory (a shared file system)",
                    dir.display(),
                    state.step,
                    WAIT_FOR_SHARES.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
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
    let optimizers: Vec<StoredOptimizer> = std::fs::read(&optimizers_path)
        .map_err(|e| Error::io(&optimizers_path, e))
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| Error::checkpoint(one_line(&e))))?;
    std::fs::remove_file(&optimizers_path).map_err(|e| Error::io(&optimizers_path, e))?;
    let manifest = Manifest {
        state: state.clone(),
        files,
        sharded: Some(ShardedInfo { world, optimizers }),
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("loop state serialises");
    write_synced(&dir.join(STATE_FILE), &json)
}

fn read_index(dir: &Path, name: &str) -> Result<RankIndex> {
    let path = dir.join(name);
    let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        Error::checkpoint(format!(
            "{}: corrupt shard index: {}",
            path.display(),
            one_line(&e)
        ))
    })
}

/// Whether the checkpoint in `dir` is sharded.
pub fn is_sharded(dir: &Path) -> bool {
    read_manifest(dir).is_ok_and(|m| m.sharded.is_some())
}

/// Where one tensor's ranges are.
#[derive(Debug, Clone)]
struct Held {
    shape: Vec<usize>,
    id: Option<u64>,
    dtype: FloatDType,
    /// `(file, start, len, byte offset)`, by start.
    pieces: Vec<(usize, usize, usize, u64)>,
    /// The tensor-parallel part it is, if it is one.
    cut: Option<Cut>,
}

/// A tensor a tensor-parallel group wrote in parts: each part's name, by the rank's place.
#[derive(Debug, Clone)]
struct Parts {
    shape: Vec<usize>,
    split: kiln_models::tp::Split,
    names: Vec<Option<String>>,
}

/// A sharded checkpoint opened for reading: the manifest's optimizers and every rank's index;
/// the values are read range by range ([`Source`]).
#[derive(Debug)]
pub struct Sharded {
    dir: PathBuf,
    world: usize,
    files: Vec<PathBuf>,
    /// The ranks' records of the model's tensors outside the pieces.
    rests: Vec<PathBuf>,
    tensors: BTreeMap<String, Held>,
    /// The tensors held as tensor-parallel parts, by their whole name.
    parts: BTreeMap<String, Parts>,
    /// The last tensor put together from its parts.
    assembled: std::sync::Mutex<Option<(String, std::sync::Arc<Vec<f32>>)>>,
    optimizers: Vec<(String, OptimizerKind, Scalars)>,
}

impl Sharded {
    /// Opens the sharded checkpoint in `dir` (its files are not verified here: see
    /// [`verify`](super::verify)).
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest = read_manifest(dir)?;
        let Some(info) = manifest.sharded else {
            return Err(Error::checkpoint(format!(
                "{}: not a sharded checkpoint",
                dir.join(STATE_FILE).display()
            )));
        };
        let mut files = Vec::with_capacity(info.world);
        let mut rests = Vec::new();
        let mut tensors: BTreeMap<String, Held> = BTreeMap::new();
        for rank in 0..info.world {
            let index = read_index(dir, &index_file(rank))?;
            rests.extend(index.rest.as_ref().map(|r| dir.join(r)));
            let file = files.len();
            let path = dir.join(&index.file);
            for p in index.pieces {
                let dtype = dtype_of(&p.dtype).ok_or_else(|| {
                    Error::checkpoint(format!(
                        "{}: tensor {:?} has dtype {:?} (expected f32, bf16, f16 or f64)",
                        dir.join(index_file(rank)).display(),
                        p.tensor,
                        p.dtype
                    ))
                })?;
                let held = tensors.entry(p.tensor).or_insert_with(|| Held {
                    shape: p.shape.clone(),
                    id: p.id,
                    dtype,
                    pieces: Vec::new(),
                    cut: p.cut.clone(),
                });
                held.pieces.push((file, p.start, p.len, p.offset));
            }
            files.push(path);
        }
        for held in tensors.values_mut() {
            held.pieces.sort_by_key(|p| p.1);
        }
        let mut parts: BTreeMap<String, Parts> = BTreeMap::new();
        for (name, held) in &tensors {
            let (Some(cut), Some((whole, _))) = (&held.cut, name.rsplit_once('#')) else {
                continue;
            };
            let entry = parts.entry(whole.to_string()).or_insert_with(|| Parts {
                shape: cut.whole.clone(),
                split: cut.split,
                names: vec![None; cut.of],
            });
            if let Some(slot) = entry.names.get_mut(cut.index) {
                *slot = Some(name.clone());
            }
        }
        let mut optimizers = Vec::with_capacity(info.optimizers.len());
        for o in info.optimizers {
            let kind = match o.kind.as_str() {
                "adamw" => OptimizerKind::Adamw,
                "sgd" => OptimizerKind::Sgd,
                other => {
                    return Err(Error::checkpoint(format!(
                        "{}: unknown optimizer {other:?} (expected \"adamw\" or \"sgd\")",
                        dir.join(STATE_FILE).display()
                    )));
                }
            };
            let scalars = o.scalars.into_iter().map(|(k, v)| (k, v.into())).collect();
            optimizers.push((o.group, kind, scalars));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            world: info.world,
            files,
            rests,
            tensors,
            parts,
            assembled: std::sync::Mutex::new(None),
            optimizers,
        })
    }

    /// The whole tensors it holds, by name: those written whole and those a tensor-parallel
    /// group wrote in parts.
    fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .tensors
            .iter()
            .filter(|(_, h)| h.cut.is_none())
            .map(|(n, _)| n.as_str())
            .chain(self.parts.keys().map(String::as_str))
            .collect();
        names.sort_unstable();
        names
    }

    /// The dtype and id a whole tensor is restored with.
    fn kept_as(&self, name: &str) -> Option<(FloatDType, Option<u64>)> {
        let held = match self.tensors.get(name) {
            Some(held) => held,
            None => {
                let first = self.parts.get(name)?.names.iter().flatten().next()?;
                self.tensors.get(first)?
            }
        };
        Some((held.dtype, held.id))
    }

    /// A tensor written in parts, put back together (the last one is kept for the next read).
    fn assemble(&self, name: &str, parts: &Parts) -> Result<std::sync::Arc<Vec<f32>>> {
        let mut kept = self.assembled.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((kept_name, values)) = kept.as_ref()
            && kept_name == name
        {
            return Ok(values.clone());
        }
        let mut values = Vec::with_capacity(parts.names.len());
        let mut part_shape = Vec::new();
        for (i, part) in parts.names.iter().enumerate() {
            let part = part.as_ref().ok_or_else(|| {
                Error::checkpoint(format!(
                    "{}: no shard holds part {i} of {} of tensor `{name}`",
                    self.dir.display(),
                    parts.names.len()
                ))
            })?;
            let held = &self.tensors[part];
            part_shape = held.shape.clone();
            let n: usize = held.shape.iter().product();
            values.push(self.read(part, 0..n)?);
        }
        let (whole, _) = kiln_models::tp::whole_of_values(&values, &part_shape, parts.split)
            .map_err(|e| {
                Error::checkpoint(format!(
                    "{}: tensor `{name}`'s parts do not make it whole: {e}",
                    self.dir.display()
                ))
            })?;
        let whole = std::sync::Arc::new(whole);
        *kept = Some((name.to_string(), whole.clone()));
        Ok(whole)
    }

    /// The ranks that wrote it.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `model` with the checkpoint's weights: its parameters read whole from the shards and
    /// the rest of its tensors from the ranks' `rest-N.bpk`. An error names the file, or the tensor the
    /// model does not take.
    pub fn load_model<M: Module>(&self, model: M) -> Result<M> {
        self.load(model, true)
    }

    /// `model` with the checkpoint's tensors outside the shards (the ranks' `rest-N.bpk`: buffers, a
    /// quantized base, the parameters a gathering strategy kept there): for ranks that read
    /// their own ranges of the parameters.
    pub fn load_rest<M: Module>(&self, model: M) -> Result<M> {
        self.load(model, false)
    }

    /// Checks that `model` takes the checkpoint's weights (names and shapes) without reading
    /// the shards' values: every tensor of the model is in a `rest-N.bpk` or a shard, in its
    /// shape, and nothing else is.
    pub fn fits_model<M: Module>(&self, model: M) -> Result<()> {
        let model = self.load_rest(model)?;
        for (path, shape) in crate::params::float_shapes(&model) {
            if let Some(held) = self.shape(&path)
                && held != shape
            {
                return Err(Error::checkpoint(format!(
                    "{}: tensor `{path}` has shape {held:?}, the model's {shape:?}",
                    self.dir.display(),
                )));
            }
        }
        Ok(())
    }

    fn load<M: Module>(&self, model: M, params: bool) -> Result<M> {
        let mut all = Vec::new();
        let mut named = std::collections::BTreeSet::new();
        for rest in &self.rests {
            let corrupt = |e: &dyn std::fmt::Display| {
                Error::checkpoint(format!(
                    "{}: corrupt model weights: {}",
                    rest.display(),
                    one_line(e)
                ))
            };
            let reader = Reader::from_file(rest).map_err(|e| corrupt(&e))?;
            named.extend(reader.tensor_names().into_iter().map(String::from));
            all.extend(reader.into_tensors().map_err(|e| corrupt(&e))?);
        }
        let corrupt = |e: &dyn std::fmt::Display| {
            Error::checkpoint(format!(
                "{}: corrupt model weights: {}",
                self.dir.display(),
                one_line(e)
            ))
        };
        let mut held = Vec::new();
        for name in self.names() {
            if name.contains(':') {
                continue;
            }
            held.push(name.to_string());
            if !params {
                continue;
            }
            let shape = self.shape(name).expect("a tensor it names");
            let (dtype, id) = self.kept_as(name).expect("a tensor it names");
            let n: usize = shape.iter().product();
            let values = self.read(name, 0..n)?;
            let data = TensorData::new(values, shape).convert_dtype(DType::from(dtype));
            let (bytes, shape, dtype) = data.into_parts();
            all.push(burn_pack::Tensor::new(
                name.to_string(),
                dtype,
                shape,
                id,
                bytes,
            ));
        }
        let bytes = Writer::new(all).into_bytes().map_err(|e| corrupt(&e))?;
        let record = ModuleRecord::from_bytes(bytes).map_err(|e| corrupt(&e))?;
        let record = record.allow_partial(!params);
        let missing = if params {
            Vec::new()
        } else {
            // Without the shards' values, a tensor of the model must still be in one place.
            let have: std::collections::BTreeSet<String> = named.into_iter().chain(held).collect();
            crate::params::float_shapes(&model)
                .into_iter()
                .map(|(path, _)| path)
                .filter(|p| !have.contains(p))
                .collect()
        };
        if let Some(path) = missing.first() {
            return Err(Error::checkpoint(format!(
                "{}: holds no tensor `{path}` of the model ({} missing): it was saved for \
                 another model",
                self.dir.display(),
                missing.len()
            )));
        }
        model.try_load_record(record).map_err(|e| {
            Error::checkpoint(format!(
                "{}: the model does not take its weights: {}",
                self.dir.display(),
                one_line(&e)
            ))
        })
    }

    /// Checks that the checkpoint holds `group`'s optimizer state for `layout`'s parameters,
    /// from its indexes alone (no value is read); an error names the first parameter that is
    /// missing, has another shape, or that the model does not have.
    pub fn fits(&self, group: &str, layout: &FlatLayout) -> Result<()> {
        let leaves = self.leaves(group);
        let prefix = optim_tensor(group, "", "");
        let prefix = prefix.trim_end_matches(':');
        for leaf in &leaves {
            for e in &layout.entries {
                let name = optim_tensor(group, leaf, &e.path);
                match self.shape(&name) {
                    None => {
                        return Err(Error::checkpoint(format!(
                            "{}: the optimizer state has no {leaf:?} for parameter `{}`: it \
                             was saved for another model",
                            self.dir.display(),
                            e.path
                        )));
                    }
                    Some(shape) if shape != e.shape => {
                        return Err(Error::checkpoint(format!(
                            "{}: the optimizer state of parameter `{}` has shape {:?}, the \
                             model's parameter {:?}",
                            self.dir.display(),
                            e.path,
                            shape,
                            e.shape
                        )));
                    }
                    Some(_) => {}
                }
            }
        }
        for name in self.names() {
            let Some((_, path)) = name
                .strip_prefix(prefix)
                .and_then(|r| r.strip_prefix(':'))
                .and_then(|r| r.split_once(':'))
            else {
                continue;
            };
            if !layout.entries.iter().any(|e| e.path == path) {
                return Err(Error::checkpoint(format!(
                    "{}: the optimizer state holds parameter `{path}`, which the model does \
                     not have: it was saved for another model",
                    self.dir.display()
                )));
            }
        }
        Ok(())
    }

    fn read_piece(&self, file: usize, offset: u64, n: usize) -> Result<Vec<f32>> {
        let path = &self.files[file];
        let io = |e: std::io::Error| {
            Error::checkpoint(format!("{}: cannot read a shard: {e}", path.display()))
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        f.seek(SeekFrom::Start(offset)).map_err(io)?;
        let mut bytes = vec![0u8; n * 4];
        f.read_exact(&mut bytes).map_err(io)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

impl Source for Sharded {
    fn read(&self, tensor: &str, range: Range<usize>) -> Result<Vec<f32>> {
        if !self.tensors.contains_key(tensor)
            && let Some(parts) = self.parts.get(tensor)
        {
            let whole = self.assemble(tensor, parts)?;
            return whole
                .get(range.clone())
                .map(<[f32]>::to_vec)
                .ok_or_else(|| {
                    Error::checkpoint(format!(
                        "{}: tensor `{tensor}` has {} elements, not {range:?}",
                        self.dir.display(),
                        whole.len()
                    ))
                });
        }
        let held = self.tensors.get(tensor).ok_or_else(|| {
            Error::checkpoint(format!(
                "{}: no shard holds tensor `{tensor}`: it was saved for another model",
                self.dir.display()
            ))
        })?;
        let mut out = Vec::with_capacity(range.len());
        let mut at = range.start;
        for &(file, start, len, offset) in &held.pieces {
            if at >= range.end {
                break;
            }
            let end = start + len;
            if end <= at || start > at {
                continue;
            }
            let hi = end.min(range.end);
            out.extend(self.read_piece(file, offset + (at - start) as u64 * 4, hi - at)?);
            at = hi;
        }
        if at < range.end {
            return Err(Error::checkpoint(format!(
                "{}: no shard holds elements {at}..{} of tensor `{tensor}`",
                self.dir.display(),
                range.end
            )));
        }
        Ok(out)
    }

    fn holds(&self, tensor: &str) -> bool {
        self.tensors.contains_key(tensor) || self.parts.contains_key(tensor)
    }

    fn shape(&self, tensor: &str) -> Option<Vec<usize>> {
        match self.tensors.get(tensor) {
            Some(held) => Some(held.shape.clone()),
            None => self.parts.get(tensor).map(|p| p.shape.clone()),
        }
    }

    fn optimizer(&self, group: &str) -> Option<(OptimizerKind, Scalars)> {
        self.optimizers
            .iter()
            .find(|(g, _, _)| g == group)
            .map(|(_, kind, scalars)| (*kind, scalars.clone()))
    }

    fn leaves(&self, group: &str) -> Vec<String> {
        let prefix = optim_tensor(group, "", "");
        let prefix = prefix.trim_end_matches(':');
        let mut leaves: Vec<String> = self
            .names()
            .into_iter()
            .filter_map(|name| {
                let (leaf, _) = name
                    .strip_prefix(prefix)?
                    .strip_prefix(':')?
                    .split_once(':')?;
                Some(leaf.to_string())
            })
            .collect();
        leaves.sort();
        leaves.dedup();
        leaves
    }

    fn canonical(&self, group: &str) -> Result<OptimState> {
        let Some((kind, scalars)) = self.optimizer(group) else {
            return Err(Error::checkpoint(format!(
                "{}: holds no optimizer state for {}",
                self.dir.display(),
                if group.is_empty() {
                    "the model's optimizer".to_string()
                } else {
                    format!("parameter group {group:?}")
                }
            )));
        };
        let prefix = optim_tensor(group, "", "");
        let prefix = prefix.trim_end_matches(':');
        let mut tensors = Vec::new();
        for name in self.names() {
            let Some((leaf, path)) = name
                .strip_prefix(prefix)
                .and_then(|r| r.strip_prefix(':'))
                .and_then(|r| r.split_once(':'))
            else {
                continue;
            };
            let shape = self.shape(name).expect("a tensor it names");
            let n: usize = shape.iter().product();
            tensors.push((
                path.to_string(),
                leaf.to_string(),
                shape,
                self.read(name, 0..n)?,
            ));
        }
        Ok(OptimState {
            kind,
            tensors,
            scalars,
        })
    }
}
