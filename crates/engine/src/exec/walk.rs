//! The walk and the plain pass: [`run`] of one micro-batch, as the module documentation
//! describes.

use std::ops::Range;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use kiln_models::{Activation, BlockStack, StepOutput};

use super::draws;
use super::segment::segment_backward;
use super::syncbn;
use crate::comm::Collective;
use crate::error::Result;
use crate::params::{collect_floats, has_buffers, replace_floats, sync_running_state};

/// What a micro-batch's backward keeps. (Burn's device-wide `balanced` checkpointing is a
/// property of the device the worker builds, and runs through [`Recompute::Keep`] here.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    /// Keep every activation of the forward pass.
    Keep,
    /// Keep only the inputs of blocks `0, every, 2·every, …` (the last block excepted) and
    /// recompute their forward during backward; the other blocks keep their activations.
    Blocks {
        /// Recompute every `every`-th block (1: all of them).
        every: usize,
    },
}

impl Recompute {
    /// Whether block `i` of `n` keeps only its input and is recomputed. The last block's
    /// activations are the first the backward needs, so keeping them costs no more peak
    /// memory than recomputing them at once would: it is never recomputed.
    pub fn recomputes(self, i: usize, n: usize) -> bool {
        match self {
            Recompute::Keep => false,
            Recompute::Blocks { every } => i.is_multiple_of(every.max(1)) && i + 1 < n,
        }
    }
}

/// Which part of the model a set of gradients belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The whole model (the plain pass).
    All,
    /// The head and the loss (first in the walk).
    Head,
    /// Block `i`.
    Block(usize),
    /// The stem (last in the walk).
    Stem,
}

/// What a strategy does around each block of the walk and with each part's gradients.
pub trait Hooks<M> {
    /// Whether the micro-batch must run as the walk even when neither recomputation nor
    /// synchronised BatchNorm asks for it (the strategy wants the gradients block by block).
    fn blockwise(&self) -> bool {
        false
    }
    /// Before block `i`'s forward (ZeRO-3 gathers its parameters into `model`).
    fn before_forward(&mut self, model: M, i: usize) -> Result<M> {
        let _ = i;
        Ok(model)
    }
    /// After block `i`'s forward; `kept` says whether its graph (and with it the parameters it
    /// used) stays alive until its backward.
    fn after_forward(&mut self, model: M, i: usize, kept: bool) -> Result<M> {
        let _ = (i, kept);
        Ok(model)
    }
    /// Before block `i`'s backward; `kept` as in [`Self::after_forward`].
    fn before_backward(&mut self, model: M, i: usize, kept: bool) -> Result<M> {
        let _ = (i, kept);
        Ok(model)
    }
    /// After block `i`'s backward.
    fn after_backward(&mut self, model: M, i: usize) -> Result<M> {
        let _ = i;
        Ok(model)
    }
    /// The gradients of `part`, computed on `model`.
    fn grads(&mut self, model: &M, part: Part, grads: GradientsParams) -> Result<()>;
}

/// Hooks that add every gradient up: the whole micro-batch's gradients, however it ran.
pub struct Accumulate<M: Module> {
    acc: GradientsAccumulator<M>,
}

impl<M: Module> Default for Accumulate<M> {
    fn default() -> Self {
        Self {
            acc: GradientsAccumulator::new(),
        }
    }
}

impl<M: Module> Accumulate<M> {
    /// The gradients added so far (the accumulator is emptied).
    pub fn take(&mut self) -> GradientsParams {
        self.acc.grads()
    }
}

impl<M: Module> Hooks<M> for Accumulate<M> {
    fn grads(&mut self, model: &M, _part: Part, grads: GradientsParams) -> Result<()> {
        self.acc.accumulate(model, grads);
        Ok(())
    }
}

/// How a micro-batch runs.
#[derive(Clone, Copy)]
pub struct Pass<'a> {
    /// Which blocks are recomputed.
    pub recompute: Recompute,
    /// Synchronise BatchNorm statistics over this group (none: each rank its own batch).
    pub sync_bn: Option<&'a dyn Collective>,
    /// The device the model's parameters live on (with autodiff).
    pub device: &'a Device,
    /// The parameter group whose loss runs ([`TrainStep::group_step`](kiln_models::TrainStep::group_step)),
    /// for a model with several optimizers; `None` runs [`TrainStep::step`](kiln_models::TrainStep::step).
    /// A group's loss runs whole (the settings that walk the blocks refuse such models).
    pub group: Option<usize>,
}

/// Runs `model` on `batch`, differentiates `objective(loss)` and hands the parameter gradients
/// to `hooks` (all at once for the plain pass, part by part for the walk). Returns the output
/// (its loss detached, for metrics) and the model as the hooks left it.
///
/// `objective` turns the model's mean loss into what is differentiated: divided by the
/// accumulation steps, multiplied by a loss scale.
pub fn run<B, M, H>(
    model: M,
    batch: B,
    pass: &Pass,
    hooks: &mut H,
    objective: impl FnOnce(Tensor<1>) -> Tensor<1>,
) -> Result<(StepOutput, M)>
where
    M: BlockStack<B> + Module,
    H: Hooks<M>,
{
    // A model that describes no blocks always runs whole (the settings that need its blocks
    // are refused at start).
    let walk = model.num_blocks() > 0
        && (hooks.blockwise() || pass.recompute != Recompute::Keep || pass.sync_bn.is_some());
    if let Some(group) = pass.group {
        if walk {
            return Err(crate::error::Error::Worker(
                "a parameter group's loss runs whole; the block walk takes one loss".into(),
            ));
        }
        let out = draws::forward(|| model.group_step(group, batch));
        let grads = GradientsParams::from_grads(objective(out.loss.clone()).backward(), &model);
        hooks.grads(&model, Part::All, grads)?;
        return Ok((detached(out), model));
    }
    if !walk {
        let out = draws::forward(|| model.step(batch));
        let grads = GradientsParams::from_grads(objective(out.loss.clone()).backward(), &model);
        hooks.grads(&model, Part::All, grads)?;
        return Ok((detached(out), model));
    }
    blockwise(model, batch, pass, hooks, objective)
}

/// [`run`] with hooks that add the gradients up: the output and the gradients of the whole
/// micro-batch.
pub fn forward_backward<B, M>(
    model: &M,
    batch: B,
    device: &Device,
    recompute: Recompute,
    objective: impl FnOnce(Tensor<1>) -> Tensor<1>,
) -> (StepOutput, GradientsParams)
where
    M: BlockStack<B> + Module,
{
    let pass = Pass {
        recompute,
        sync_bn: None,
        device,
        group: None,
    };
    let mut acc = Accumulate::default();
    let (out, _) = run(model.clone(), batch, &pass, &mut acc, objective)
        .expect("a walk without collectives cannot fail");
    (out, acc.take())
}

/// `out` cut from its graph: the loss and the named metrics detached, in f32.
pub(crate) fn detached(out: StepOutput) -> StepOutput {
    StepOutput {
        loss: out.loss.detach(),
        metrics: out
            .metrics
            .into_iter()
            .map(|(name, v)| (name, v.detach().cast(burn::tensor::FloatDType::F32)))
            .collect(),
        // Whole-set metrics are validation's; a training step's hold nothing.
        set_metrics: Vec::new(),
        ..out
    }
}

/// One block's place in the forward pass, as the backward walk needs it.
enum Saved {
    /// Recomputed: its input, without a graph, and its forward's draws.
    Recomputed(Box<Activation>, draws::Draw),
    /// Kept: its input leaf and its output, with the block's graph.
    Kept(Box<(Activation, Activation)>),
    /// Cut around a synchronised BatchNorm: its segments.
    Synced(Vec<syncbn::Segment>),
}

/// What the forward of a range of blocks keeps for its backward: each block's input (and, for
/// a block that is not recomputed, its graph).
pub struct Stash {
    blocks: Vec<(usize, Saved)>,
}

impl Stash {
    /// Blocks whose activations (graph) the stash holds, as opposed to only their input.
    pub fn kept_blocks(&self) -> usize {
        self.blocks
            .iter()
            .filter(|(_, s)| !matches!(s, Saved::Recomputed(..)))
            .count()
    }
}

/// Block `i` of `model` on `x`, handed the micro-batch where the stage has it
/// ([`BlockStack::block_in`]: a packed batch's documents).
fn block_on<B, M: BlockStack<B>>(
    model: &M,
    i: usize,
    x: Activation,
    batch: Option<&B>,
) -> Activation {
    match batch {
        Some(batch) => model.block_in(i, x, batch),
        None => model.block(i, x),
    }
}

/// Runs blocks `blocks` of `model` on `x` (the output of the block before, or of the stem)
/// for the micro-batch `batch` (where the caller has it: a pipeline's middle stages have it
/// only for a model whose blocks read it), recomputing the blocks `pass` says (counted within
/// the range: its last block is never recomputed). Returns the output (detached), what the
/// backward needs, and the model as the hooks left it.
pub fn forward_blocks<B, M, H>(
    mut model: M,
    mut x: Activation,
    blocks: Range<usize>,
    batch: Option<&B>,
    pass: &Pass,
    hooks: &mut H,
) -> Result<(Activation, Stash, M)>
where
    M: BlockStack<B> + Module,
    H: Hooks<M>,
{
    let (start, n) = (blocks.start, blocks.len());
    let mut stash = Stash {
        blocks: Vec::with_capacity(n),
    };
    for i in blocks {
        model = hooks.before_forward(model, i)?;
        let synced = match (pass.sync_bn, model.block_norm(i)) {
            (Some(comm), Some(_)) => {
                let (out, segments) =
                    syncbn::block_forward(&model, i, x.clone(), comm, pass.device)?;
                Some((out, Saved::Synced(segments)))
            }
            _ => None,
        };
        let s = match synced {
            Some((out, s)) => {
                x = out;
                s
            }
            None if pass.recompute.recomputes(i - start, n) => {
                // A copy whose parameters need no gradient: its forward records no graph. It
                // shares the model's tensors and buffers, so nothing is copied.
                let input = x.detach();
                let frozen = model.clone().no_grad();
                let draw = draws::next();
                x = draws::run(draw, || block_on(&frozen, i, input.clone(), batch));
                Saved::Recomputed(Box::new(input), draw)
            }
            None => {
                let input = x.detach().require_grad();
                let output = draws::forward(|| block_on(&model, i, input.clone(), batch));
                x = output.clone().detach();
                Saved::Kept(Box::new((input, output)))
            }
        };
        let kept = !matches!(s, Saved::Recomputed(..));
        stash.blocks.push((i, s));
        model = hooks.after_forward(model, i, kept)?;
    }
    Ok((x.detach(), stash, model))
}

/// The backward of the blocks whose forward left `stash`, seeded with `upstream` (the
/// gradient at their output), for the micro-batch the forward had; each block's parameter
/// gradients go to `hooks`. Returns the gradient at the range's input and the model as the
/// hooks left it.
pub fn backward_blocks<B, M, H>(
    mut model: M,
    stash: Stash,
    mut upstream: Activation,
    batch: Option<&B>,
    pass: &Pass,
    hooks: &mut H,
) -> Result<(Activation, M)>
where
    M: BlockStack<B> + Module,
    H: Hooks<M>,
{
    for (i, s) in stash.blocks.into_iter().rev() {
        let kept = !matches!(s, Saved::Recomputed(..));
        model = hooks.before_backward(model, i, kept)?;
        let grads = match s {
            Saved::Synced(segments) => {
                let (below, grads) =
                    syncbn::block_backward(&model, segments, upstream, pass.sync_bn, pass.device)?;
                upstream = below;
                grads
            }
            Saved::Recomputed(input, draw) => {
                // The block's buffers (running statistics) saw this batch in the forward;
                // running it again would update them a second time, so they are put back.
                let buffers = has_buffers(&model).then(|| {
                    sync_running_state(&model);
                    collect_floats(&model, false)
                });
                let input = input.require_grad();
                // The forward's own draws again (its dropout masks): the same output.
                let output = draws::run(draw, || block_on(&model, i, input.clone(), batch));
                if let Some(values) = buffers {
                    sync_running_state(&model);
                    // Running states are shared between clones: restoring them on a clone
                    // restores the model's own.
                    let _ = replace_floats(model.clone(), false, values, pass.device);
                }
                let (below, grads) = block_grads(&model, input, output, upstream);
                upstream = below;
                grads
            }
            Saved::Kept(kept) => {
                let (input, output) = *kept;
                let (below, grads) = block_grads(&model, input, output, upstream);
                upstream = below;
                grads
            }
        };
        hooks.grads(&model, Part::Block(i), grads)?;
        model = hooks.after_backward(model, i)?;
    }
    Ok((upstream, model))
}

/// The head and the loss on the last block's output `x`, differentiated through
/// `objective`: the output (loss detached), the gradient at `x`, and the head's parameter
/// gradients.
pub fn head_backward<B, M>(
    model: &M,
    x: Activation,
    batch: &B,
    objective: impl FnOnce(Tensor<1>) -> Tensor<1>,
) -> (StepOutput, Activation, GradientsParams)
where
    M: BlockStack<B> + Module,
{
    let top = x.detach().require_grad();
    let out = draws::forward(|| BlockStack::head(model, top.clone(), batch));
    let graph = objective(out.loss.clone()).backward();
    let upstream = top
        .grad(&graph)
        .expect("the loss depends on the last block's output");
    (
        detached(out),
        upstream,
        GradientsParams::from_grads(graph, model),
    )
}

/// What the stem's backward needs: the stem's graph, or its forward's draws to run it again.
pub enum StemKept {
    /// The output with its graph.
    Graph(Box<Activation>),
    /// Run again, with the draws of its forward.
    Again(draws::Draw),
}

/// The stem's output for the walk: with its graph (to differentiate later), or, when
/// `recompute`, without one (the stem then runs again for its backward, with the same draws).
pub fn stem_forward<B, M: BlockStack<B> + Module>(
    model: &M,
    batch: &B,
    recompute: bool,
) -> (Activation, StemKept) {
    if recompute {
        let draw = draws::next();
        let x = draws::run(draw, || model.clone().no_grad().stem(batch));
        (x, StemKept::Again(draw))
    } else {
        let stem = draws::forward(|| model.stem(batch));
        (stem.clone().detach(), StemKept::Graph(Box::new(stem)))
    }
}

/// The stem's parameter gradients seeded with `upstream`, the gradient at its output; `None`
/// for a stem without parameters (whose output is not tracked).
pub fn stem_backward<B, M: BlockStack<B> + Module>(
    model: &M,
    batch: &B,
    kept: StemKept,
    upstream: Activation,
) -> Option<GradientsParams> {
    let stem = match kept {
        StemKept::Graph(stem) => *stem,
        StemKept::Again(draw) => draws::run(draw, || model.stem(batch)),
    };
    stem.is_tracked()
        .then(|| GradientsParams::from_grads(segment_backward(stem, upstream), model))
}

fn blockwise<B, M, H>(
    model: M,
    batch: B,
    pass: &Pass,
    hooks: &mut H,
    objective: impl FnOnce(Tensor<1>) -> Tensor<1>,
) -> Result<(StepOutput, M)>
where
    M: BlockStack<B> + Module,
    H: Hooks<M>,
{
    let n = model.num_blocks();
    let any_recomputed = (0..n).any(|i| pass.recompute.recomputes(i, n));
    let (x, stem_graph) = stem_forward(&model, &batch, any_recomputed);
    let (x, stash, model) = forward_blocks(model, x, 0..n, Some(&batch), pass, hooks)?;
    let (out, upstream, head) = head_backward(&model, x, &batch, objective);
    hooks.grads(&model, Part::Head, head)?;
    let (upstream, model) = backward_blocks(model, stash, upstream, Some(&batch), pass, hooks)?;
    if let Some(grads) = stem_backward(&model, &batch, stem_graph, upstream) {
        hooks.grads(&model, Part::Stem, grads)?;
    }
    Ok((out, model))
}

/// The backward of one block from its input leaf and output: the gradient for the block below
/// and the block's parameter gradients.
fn block_grads<M: Module>(
    model: &M,
    input: Activation,
    output: Activation,
    upstream: Activation,
) -> (Activation, GradientsParams) {
    let graph = segment_backward(output, upstream);
    let below = input
        .grad(&graph)
        .expect("every block's output depends on its input");
    (below, GradientsParams::from_grads(graph, model))
}
