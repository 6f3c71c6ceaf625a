//! Forward and backward of one micro-batch, whole or block by block.
//!
//! [`forward_backward`] with [`Recompute::Keep`] is the ordinary pass: one forward that keeps
//! every activation, one backward. With [`Recompute::Blocks`] the model runs as its
//! [`BlockStack`]: the forward keeps only the inputs of the recomputed blocks (computed without
//! a graph), and the backward walks the stack from the head down, running each recomputed
//! block's forward again under autodiff from its saved input and seeding its backward with the
//! gradient that arrived from above — `backward(sum(block(x) · g))` gives the block's
//! parameter gradients and the gradient for the block below (a vector-Jacobian product).
//! Peak activation memory is then the saved block inputs plus one block's activations, for one
//! extra forward of the recomputed blocks.
//!
//! The walk is [`segment_backward`]; a pipeline stage needs the same step (backward of a
//! segment from its saved input and an upstream gradient), so it is kept separate.

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use kiln_models::{Activation, BlockStack, StepOutput};

use crate::trainer::{collect_floats, replace_floats, sync_running_state};

/// What a micro-batch's backward keeps. (Burn's device-wide `balanced` checkpointing is a
/// property of the device the trainer builds, and runs through [`Recompute::Keep`] here.)
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

/// Runs `model` on `batch` (on `device`), differentiates `objective(loss)` and returns the output (its
/// loss detached, for metrics) and the parameter gradients of `objective(loss)`.
///
/// `objective` turns the model's mean loss into what is differentiated: divided by the
/// accumulation steps, multiplied by a loss scale.
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
    match recompute {
        Recompute::Keep => {
            let out = model.step(batch);
            let grads = GradientsParams::from_grads(objective(out.loss.clone()).backward(), model);
            (detached(out), grads)
        }
        Recompute::Blocks { every } => blockwise(model, batch, device, every.max(1), objective),
    }
}

fn detached(out: StepOutput) -> StepOutput {
    StepOutput {
        loss: out.loss.detach(),
        ..out
    }
}

/// One block's place in the forward pass, as the backward walk needs it: a recomputed block
/// keeps its input (without a graph) and no output; a kept block its input leaf and its output,
/// with the block's graph.
struct Saved {
    input: Activation,
    output: Option<Activation>,
}

fn blockwise<B, M>(
    model: &M,
    batch: B,
    device: &Device,
    every: usize,
    objective: impl FnOnce(Tensor<1>) -> Tensor<1>,
) -> (StepOutput, GradientsParams)
where
    M: BlockStack<B> + Module,
{
    // A copy whose parameters need no gradient: its forward records no graph. It shares the
    // model's tensors and buffers (BatchNorm running statistics), so nothing is copied.
    let untracked = model.clone().no_grad();
    let n = model.num_blocks();

    let mut x = untracked.stem(&batch);
    let mut saved = Vec::with_capacity(n);
    for i in 0..n {
        // The last block's activations are the first the backward needs, so keeping them
        // costs no more peak memory than recomputing them at once would.
        if i % every == 0 && i + 1 < n {
            saved.push(Saved {
                input: x.clone(),
                output: None,
            });
            x = untracked.block(i, x);
        } else {
            let input = x.detach().require_grad();
            let output = model.block(i, input.clone());
            x = output.clone().detach();
            saved.push(Saved {
                input,
                output: Some(output),
            });
        }
    }

    // Buffers (running statistics) have now seen this batch once; recomputing would update
    // them again, so their values are kept here and put back after the backward walk.
    let buffers = has_buffers(model).then(|| {
        sync_running_state(model);
        collect_floats(model, false)
    });

    let mut grads = GradientsAccumulator::new();
    let (out, mut upstream) = head_backward(model, x, &batch, objective, &mut grads);

    for (i, s) in saved.into_iter().enumerate().rev() {
        let (input, output) = match s.output {
            Some(output) => (s.input, output),
            None => {
                let input = s.input.require_grad();
                let output = model.block(i, input.clone());
                (input, output)
            }
        };
        let graph = segment_backward(output, upstream);
        upstream = input
            .grad(&graph)
            .expect("every block's output depends on its input");
        grads.accumulate(model, GradientsParams::from_grads(graph, model));
    }

    // The stem's parameters (embeddings): run it again with a graph and seed it likewise.
    stem_backward(model, model.stem(&batch), upstream, &mut grads);

    if let Some(values) = buffers {
        sync_running_state(model);
        // Running states are shared between clones, so restoring them on a clone restores the
        // model's own.
        let _ = replace_floats(model.clone(), false, values, device);
    }
    (out, grads.grads())
}

/// The head and the loss on the last block's output `x`, differentiated: returns the output
/// (loss detached) and the gradient with respect to `x`; the head's parameter gradients go
/// into `grads`.
pub(crate) fn head_backward<B, M>(
    model: &M,
    x: Activation,
    batch: &B,
    objective: impl FnOnce(Tensor<1>) -> Tensor<1>,
    grads: &mut GradientsAccumulator<M>,
) -> (StepOutput, Activation)
where
    M: BlockStack<B> + Module,
{
    let top = x.detach().require_grad();
    let out = BlockStack::head(model, top.clone(), batch);
    let graph = objective(out.loss.clone()).backward();
    let upstream = top
        .grad(&graph)
        .expect("the loss depends on the last block's output");
    grads.accumulate(model, GradientsParams::from_grads(graph, model));
    (detached(out), upstream)
}

/// The stem's parameter gradients (for a stem that has parameters, i.e. whose output `stem`,
/// computed with a graph, is tracked), seeded with `upstream`, into `grads`.
pub(crate) fn stem_backward<M: Module>(
    model: &M,
    stem: Activation,
    upstream: Activation,
    grads: &mut GradientsAccumulator<M>,
) {
    if stem.is_tracked() {
        grads.accumulate(
            model,
            GradientsParams::from_grads(segment_backward(stem, upstream), model),
        );
    }
}

/// Backward of a segment whose forward produced `output`, seeded with `upstream`, the
/// gradient of the objective with respect to `output`.
pub fn segment_backward(output: Activation, upstream: Activation) -> burn::tensor::Gradients {
    output.dot(upstream).backward()
}

/// Whether `module` holds float state that is not trained (buffers).
pub(crate) fn has_buffers<M: Module>(module: &M) -> bool {
    struct Find(bool);
    impl burn::module::ModuleVisitor for Find {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            self.0 |= !param.is_require_grad();
        }
    }
    let mut f = Find(false);
    module.visit(&mut f);
    f.0
}
