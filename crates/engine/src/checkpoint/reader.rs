//! A sharded checkpoint opened for reading ([`Sharded`]): the manifest's optimizers and every
//! rank's index, validated as they are read; the model whole, the ranges a rank asks for
//! ([`Source`]), a tensor a tensor-parallel group wrote in parts put back together.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::prelude::*;
use burn::store::ModuleRecord;
use burn::store::burn_pack::{self, Reader, Writer};
use burn::tensor::{DType, FloatDType};

use super::manifest::{STATE_FILE, read_manifest};
use super::sharded::{dtype_of, index_file, read_index};
use crate::config::{OptimizerKind, one_line};
use crate::error::{Error, Result};
use crate::optim::{Cut, OptimState, Scalars, Source, optim_tensor};
use crate::params::FlatLayout;

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
            let index_path = dir.join(index_file(rank));
            let bad = |what: String| Error::checkpoint(format!("{}: {what}", index_path.display()));
            for p in index.pieces {
                let numel = p
                    .shape
                    .iter()
                    .try_fold(1usize, |n, d| n.checked_mul(*d))
                    .ok_or_else(|| bad(format!("tensor {:?} has shape {:?}", p.tensor, p.shape)))?;
                let end = p.start.checked_add(p.len).filter(|&e| e <= numel);
                let bytes = (p.len as u64)
                    .checked_mul(4)
                    .and_then(|b| b.checked_add(p.offset))
                    .filter(|&b| b <= index.bytes);
                if end.is_none() || bytes.is_none() {
                    return Err(bad(format!(
                        "tensor {:?}: a piece of {} values from {} (at byte {}) does not fit \
                         the tensor of {numel} or the file of {} bytes",
                        p.tensor, p.len, p.start, p.offset, index.bytes
                    )));
                }
                if let Some(cut) = &p.cut {
                    let whole_ok = cut
                        .whole
                        .iter()
                        .try_fold(1usize, |n, d| n.checked_mul(*d))
                        .is_some();
                    let dims_ok = cut
                        .split
                        .cut_dim()
                        .is_some_and(|d| d < cut.whole.len() && d < p.shape.len());
                    if cut.of == 0 || cut.index >= cut.of || !whole_ok || !dims_ok {
                        return Err(bad(format!(
                            "tensor {:?} is part {} of {} of a {:?} tensor cut as {:?}",
                            p.tensor, cut.index, cut.of, cut.whole, cut.split
                        )));
                    }
                }
                if let Some(held) = tensors.get(&p.tensor)
                    && held.shape != p.shape
                {
                    return Err(bad(format!(
                        "tensor {:?} has shape {:?}, another rank's index {:?}",
                        p.tensor, p.shape, held.shape
                    )));
                }
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
            if entry.shape != cut.whole || entry.split != cut.split || entry.names.len() != cut.of {
                return Err(Error::checkpoint(format!(
                    "{}: the parts of tensor `{whole}` disagree on how it was cut",
                    dir.display()
                )));
            }
            entry.names[cut.index] = Some(name.clone());
        }
        if let Some((name, p)) = parts
            .iter()
            .find(|(_, p)| p.names.iter().any(Option::is_none))
        {
            let missing = p.names.iter().position(Option::is_none).unwrap_or(0);
            return Err(Error::checkpoint(format!(
                "{}: no shard holds part {missing} of {} of tensor `{name}`",
                dir.display(),
                p.names.len()
            )));
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

    /// The whole tensors of parameter group `group`'s optimizer state (see [`optim_tensor`]):
    /// `(name, leaf, parameter path)`.
    fn optimizer_tensors(&self, group: &str) -> Vec<(&str, &str, &str)> {
        let prefix = optim_tensor(group, "", "");
        let prefix = prefix.trim_end_matches(':');
        self.names()
            .into_iter()
            .filter_map(|name| {
                let (leaf, path) = name
                    .strip_prefix(prefix)?
                    .strip_prefix(':')?
                    .split_once(':')?;
                Some((name, leaf, path))
            })
            .collect()
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

    /// Lets go of the tensor last put together from its parts (after the ranks have read
    /// what they need).
    pub fn release(&self) {
        *self.assembled.lock().unwrap_or_else(|e| e.into_inner()) = None;
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
        let shapes = crate::params::float_shapes(&model);
        for (path, shape) in &shapes {
            if let Some(held) = self.shape(path)
                && held != *shape
            {
                return Err(Error::checkpoint(format!(
                    "{}: tensor `{path}` has shape {held:?}, the model's {shape:?}",
                    self.dir.display(),
                )));
            }
        }
        let paths: std::collections::HashSet<&str> =
            shapes.iter().map(|(p, _)| p.as_str()).collect();
        if let Some(extra) = self
            .names()
            .into_iter()
            .find(|n| !n.contains(':') && !paths.contains(n))
        {
            return Err(Error::checkpoint(format!(
                "{}: holds tensor `{extra}`, which the model does not have: it was saved for \
                 another model",
                self.dir.display()
            )));
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
        for (_, _, path) in self.optimizer_tensors(group) {
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
        let mut leaves: Vec<String> = self
            .optimizer_tensors(group)
            .into_iter()
            .map(|(_, leaf, _)| leaf.to_string())
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
        let mut tensors = Vec::new();
        for (name, leaf, path) in self.optimizer_tensors(group) {
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
