//! The optimizer state's file: one tensor per parameter and state leaf, whatever the
//! strategy's shards were.

use std::collections::BTreeMap;
use std::path::Path;

use burn::prelude::*;
use burn::store::burn_pack::{self, Reader, Writer};

use super::manifest::OPTIM_FILE;
use crate::config::{OptimizerKind, one_line};
use crate::error::{Error, Result};
use crate::optim::OptimState;

/// Metadata key of the optimizer file naming the optimizer that wrote it.
pub(super) const OPTIMIZER_KEY: &str = "kiln.optimizer";

/// Metadata key of the optimizer file naming its layout.
pub(super) const LAYOUT_KEY: &str = "kiln.layout";

/// The one layout kiln writes: one tensor per parameter and state leaf.
pub(super) const LAYOUT: &str = "per-parameter";

/// Writes an optimizer state: a burnpack file with one f32 tensor per parameter and state leaf,
/// named `<parameter path>:<leaf>`, the shared scalars, and the optimizer's name.
pub fn save_optimizer(path: &Path, optim: &OptimState) -> Result<()> {
    let tensors = optim
        .tensors
        .iter()
        .map(|(param, leaf, shape, values)| {
            let (bytes, shape, dtype) = TensorData::new(values.clone(), shape.clone()).into_parts();
            burn_pack::Tensor::new(format!("{param}:{leaf}"), dtype, shape, None, bytes)
        })
        .collect();
    let mut writer = Writer::new(tensors)
        .with_metadata(OPTIMIZER_KEY, &crate::config::name_of(&optim.kind))
        .with_metadata(LAYOUT_KEY, LAYOUT);
    for (key, value) in &optim.scalars {
        writer = writer.with_scalar(key, *value);
    }
    writer
        .write_to_file(path)
        .map_err(|e| Error::checkpoint(format!("{}: {}", path.display(), one_line(&e))))
}

/// The file of parameter group `group`'s optimizer state (`""`: the one optimizer of a
/// model without groups, `optimizer.bpk`; otherwise `optimizer.<group>.bpk`).
pub fn optim_file(group: &str) -> String {
    if group.is_empty() {
        OPTIM_FILE.to_string()
    } else {
        format!("optimizer.{group}.bpk")
    }
}

/// Reads a checkpoint's optimizer state.
pub fn load_optimizer(dir: &Path) -> Result<OptimState> {
    load_group_optimizer(dir, "")
}

/// Reads the optimizer state of parameter group `group` (see [`optim_file`]).
pub fn load_group_optimizer(dir: &Path, group: &str) -> Result<OptimState> {
    let path = dir.join(optim_file(group));
    if !path.is_file() {
        return Err(Error::checkpoint(format!(
            "{}: missing optimizer state",
            path.display()
        )));
    }
    let corrupt = |e: &dyn std::fmt::Display| {
        Error::checkpoint(format!(
            "{}: corrupt optimizer state: {}",
            path.display(),
            one_line(e)
        ))
    };
    let reader = Reader::from_file(&path).map_err(|e| corrupt(&e))?;
    let meta = reader.metadata().clone();
    if meta.get(LAYOUT_KEY).map(String::as_str) != Some(LAYOUT) {
        return Err(Error::checkpoint(format!(
            "{}: not a kiln optimizer state (no {LAYOUT_KEY} = {LAYOUT:?}; written by an older \
             kiln or another program)",
            path.display()
        )));
    }
    let kind = match meta.get(OPTIMIZER_KEY).map(String::as_str) {
        Some("adamw") => OptimizerKind::Adamw,
        Some("sgd") => OptimizerKind::Sgd,
        other => {
            return Err(Error::checkpoint(format!(
                "{}: unknown optimizer {other:?} (expected \"adamw\" or \"sgd\")",
                path.display()
            )));
        }
    };
    let scalars: BTreeMap<_, _> = reader.scalars().clone();
    let mut tensors = Vec::new();
    for tensor in reader.into_tensors().map_err(|e| corrupt(&e))? {
        let (name, dtype, shape, _, bytes) = tensor.into_parts().map_err(|e| corrupt(&e))?;
        let Some((param, leaf)) = name.rsplit_once(':') else {
            return Err(corrupt(&format!(
                "tensor {name:?} is not named <parameter>:<leaf>"
            )));
        };
        let data = TensorData::from_bytes(bytes, shape.clone(), dtype);
        let values: Vec<f32> = data
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| corrupt(&format!("tensor {name:?}: {e:?}")))?;
        if values.len() != shape.num_elements() {
            return Err(corrupt(&format!("tensor {name:?} has the wrong size")));
        }
        tensors.push((param.to_string(), leaf.to_string(), shape.to_vec(), values));
    }
    Ok(OptimState {
        kind,
        tensors,
        scalars,
    })
}
