//! A model's tensor-parallel split: [`TensorParallel`], what a model says of each of its
//! parameters, and [`cut`], a whole model made into one rank's part of it.

use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;

use super::split::Split;

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

    /// Whether every random number the model's training forward draws (its dropout) is drawn
    /// through [`crate::draw::dropout`], as a function of the forward's key, so that the ranks
    /// of a group — which cannot hold the process's random-number lock for a forward that
    /// waits for them — draw the masks one device draws. `false` (the default): a model that
    /// draws at all is refused a group.
    fn tp_draws_keyed(&self) -> bool {
        false
    }

    /// The floats a rank's group all-reduces for one micro-batch of `samples` samples
    /// (windows of the model's context) over `size` ranks: what the engine predicts a step's
    /// traffic from and `cargo xtask bench tp` holds the measured traffic against. `None`
    /// (the default): the model does not say.
    fn tp_floats(&self, samples: usize, size: usize) -> Option<TpFloats> {
        let _ = (samples, size);
        None
    }

    /// How the parameter at `path` (`blocks.0.attn.qkv.weight`) is cut over a group of
    /// `size` ranks; whole by default.
    fn tp_split(&self, path: &str, size: usize) -> Split {
        let _ = (path, size);
        Split::Whole
    }
}

/// Each float parameter's path and split under `tp` in a group of `size`, in module order. A LoRA adapter's
/// factors (`….weight.lora.a`, `[d_in, r]`, and `….weight.lora.b`, `[r, d_out]`) follow their
/// weight: beside a column-parallel weight `b` is cut by the same columns and `a` is whole
/// with its gradient summed; beside a row-parallel one `a` is cut by the same rows and `b` is
/// whole with its gradient summed.
pub fn splits_of<M: Module>(
    model: &M,
    tp: &dyn TensorParallel,
    size: usize,
) -> Vec<(String, Split)> {
    crate::modules::param_paths(model)
        .into_iter()
        .map(|path| {
            let split = match (path.strip_suffix(".lora.a"), path.strip_suffix(".lora.b")) {
                (Some(weight), _) => match tp.tp_split(weight, size) {
                    rows if rows.cut_dim() == Some(0) => rows,
                    cut if cut.is_cut() => Split::Summed,
                    whole => whole,
                },
                (_, Some(weight)) => match tp.tp_split(weight, size) {
                    columns if columns.cut_dim() == Some(1) => columns,
                    cut if cut.is_cut() => Split::Summed,
                    whole => whole,
                },
                _ => tp.tp_split(&path, size),
            };
            (path, split)
        })
        .collect()
}

/// `Ok` where a group of `size` ranks divides `n`; else why not: `what` (`model.gpt.n_head`)
/// must be a multiple of the group's size. What a model's [`TensorParallel::tp_check`] says of
/// each width it cuts.
pub fn must_divide(what: &str, n: usize, size: usize) -> Result<(), String> {
    if n.is_multiple_of(size) {
        Ok(())
    } else {
        Err(format!(
            "{what} ({n}) must be a multiple of the tensor-parallel size ({size})"
        ))
    }
}

/// The floats a tensor-parallel group all-reduces for one micro-batch
/// ([`TensorParallel::tp_floats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpFloats {
    /// The forward and backward, nothing recomputed.
    pub total: usize,
    /// The stem's forward (its `BlockStack::stem`), which a walk that recomputes runs again.
    pub stem: usize,
    /// One block's forward, which recomputing the block runs again.
    pub block: usize,
}

/// `model` made into rank `rank`'s part in a group of `size`: every parameter cut as
/// [`TensorParallel::tp_split`] says, keeping its id (so a parameter is the same one on every
/// rank, as on one device). Refused as `tp_check` refuses, or naming the parameter whose shape
/// does not divide.
pub fn cut<M: Module + TensorParallel>(model: M, rank: usize, size: usize) -> Result<M, String> {
    model.tp_check(size)?;
    let splits = splits_of(&model, &model, size);
    cut_by(model, &splits, rank, size)
}

/// [`cut`] with the splits given ([`splits_of`]): a model whose split another value says.
pub fn cut_by<M: Module>(
    model: M,
    splits: &[(String, Split)],
    rank: usize,
    size: usize,
) -> Result<M, String> {
    if size == 1 {
        return Ok(model);
    }
    reshape(model, splits, &mut |_, split, values, shape| {
        super::split::part_of_values(&values, shape, split, rank, size)
    })
}

/// What [`reshape`] does with a cut parameter: its path, split, values (in f32, row-major) and
/// shape in, its new values and shape out.
pub type Reshape<'f> =
    dyn FnMut(&str, Split, Vec<f32>, &[usize]) -> Result<(Vec<f32>, Vec<usize>), String> + 'f;

/// `model` with every parameter that is cut ([`Split::is_cut`]) replaced by what `f`
/// makes of it (a rank's part of the whole, the whole from the parts), in the parameter's
/// dtype and on its device, its id and whether it trains kept; `f` is called in module order,
/// on every parameter cut. The parts are leaves of their own (no op of autodiff's graph behind
/// them). An error of `f` names the parameter.
pub fn reshape<M: Module>(
    model: M,
    splits: &[(String, Split)],
    f: &mut Reshape<'_>,
) -> Result<M, String> {
    let mut mapper = Reshaper {
        splits: splits.iter(),
        f,
        failed: None,
    };
    let model = model.map(&mut mapper);
    match mapper.failed {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// Reshapes each float parameter, in module order, as its path's split says.
struct Reshaper<'s, 'f, 'g> {
    splits: std::slice::Iter<'s, (String, Split)>,
    f: &'f mut Reshape<'g>,
    failed: Option<String>,
}

impl ModuleMapper for Reshaper<'_, '_, '_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some((path, split)) = self.splits.next() else {
            return param;
        };
        if !split.is_cut() || self.failed.is_some() {
            return param;
        }
        let mut failed = None;
        let f = &mut self.f;
        let param = param.map(|t| {
            if !t.dtype().is_float() {
                // A quantized base (QLoRA) is packed in blocks of its own.
                failed = Some(format!(
                    "parameter `{path}` is quantized ({:?}), and a quantized weight is not cut \
                     over tensor-parallel ranks",
                    t.dtype()
                ));
                return t;
            }
            let tracked = t.is_require_grad();
            let device = t.device();
            let dtype = burn::tensor::FloatDType::from(t.dtype());
            let shape = t.dims().to_vec();
            let values = match t.clone().detach().try_into_vec_as::<f32>() {
                Ok(v) => v,
                Err(e) => {
                    failed = Some(format!("parameter `{path}`: its values: {e:?}"));
                    return t;
                }
            };
            match f(path, *split, values, &shape) {
                Ok((values, shape)) => {
                    Tensor::<D>::from_data(TensorData::new(values, shape), &device)
                        .cast(dtype)
                        .set_require_grad(tracked)
                }
                Err(e) => {
                    failed = Some(format!("parameter `{path}`: {e}"));
                    t
                }
            }
        });
        self.failed = failed;
        param
    }
}

/// `t`'s values as a tensor of their own on its device: no op of autodiff's graph behind it.
#[cfg(test)]
pub(super) fn leaf<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    let device = t.device();
    Tensor::from_data(t.into_data(), &device)
}
