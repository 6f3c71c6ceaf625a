//! A model's tensor-parallel split: [`TensorParallel`], what a model says of each of its
//! parameters, and [`cut`], a whole model made into one rank's part of it.

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;

use super::split::{Split, part_of};

/// What a model says to run tensor-parallel: how each parameter is cut over the group
/// ([`Split`], by the parameter's path), and what it cannot be cut into. Its forward calls
/// [`super::column`] and [`super::row`] (or their `_rows` forms) where its Linears are split,
/// and sizes what it computes from its parameters' shapes (a rank's heads from its part of the
/// projection). A model that says nothing runs on one device per replica: a tensor-parallel
/// group of more than one rank refuses it.
pub trait TensorParallel {
    /// Whether the model's forward runs on its parts; `false` (the default) refuses a group.
    fn tp_ready(&self) -> bool {
        false
    }

    /// Why the model cannot run in a group of `size` ranks (heads that do not divide, a
    /// setting the split does not keep), or `Ok`.
    fn tp_check(&self, size: usize) -> Result<(), String> {
        if size == 1 || self.tp_ready() {
            Ok(())
        } else {
            Err(format!(
                "the model does not say how its parameters are cut over {size} tensor-parallel \
                 ranks (it implements no `TensorParallel` split)"
            ))
        }
    }

    /// How the parameter at `path` (`blocks.0.attn.qkv.weight`) is cut; whole by default.
    fn tp_split(&self, path: &str) -> Split {
        let _ = path;
        Split::Whole
    }
}

/// `model` made into rank `rank`'s part in a group of `size`: every parameter cut as
/// [`TensorParallel::tp_split`] says, keeping its id (so a parameter is the same one on every
/// rank, as on one device). Refused as `tp_check` refuses, or naming the parameter whose shape
/// does not divide.
pub fn cut<M: Module + TensorParallel>(model: M, rank: usize, size: usize) -> Result<M, String> {
    model.tp_check(size)?;
    if size == 1 {
        return Ok(model);
    }
    let splits: Vec<(String, Split)> = crate::modules::param_paths(&model)
        .into_iter()
        .map(|path| {
            let split = model.tp_split(&path);
            (path, split)
        })
        .collect();
    let mut cutter = Cutter {
        splits: splits.into_iter(),
        rank,
        size,
        failed: None,
    };
    let model = model.map(&mut cutter);
    match cutter.failed {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// Cuts each float parameter, in module order, as its path's split says.
struct Cutter {
    splits: std::vec::IntoIter<(String, Split)>,
    rank: usize,
    size: usize,
    failed: Option<String>,
}

impl ModuleMapper for Cutter {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some((path, split)) = self.splits.next() else {
            return param;
        };
        let (rank, size) = (self.rank, self.size);
        let mut failed = None;
        let param = param.map(|t| {
            // The part is a leaf of its own (its values, not an op on the whole), tracked as
            // the whole was.
            let tracked = t.is_require_grad();
            match part_of(t.clone().detach(), split, rank, size) {
                Ok(part) => leaf(part).set_require_grad(tracked),
                Err(e) => {
                    failed = Some(format!("parameter `{path}`: {e}"));
                    t
                }
            }
        });
        if self.failed.is_none() {
            self.failed = failed;
        }
        param
    }
}

/// `t`'s values as a tensor of their own on its device: no op of autodiff's graph behind it.
pub(super) fn leaf<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    let device = t.device();
    Tensor::from_data(t.into_data(), &device)
}
