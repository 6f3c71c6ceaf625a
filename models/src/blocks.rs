//! A model's forward pass seen as a stem, a stack of blocks and a head.
//!
//! Models that implement [`BlockStack`] let a trainer run their forward pass one block at a
//! time — to recompute blocks during backward instead of keeping their activations, or (later)
//! to place blocks on different devices — without changing the model: the stack is the same
//! computation as [`TrainStep::step`], only cut at block boundaries.

use burn::module::ParamId;
use burn::nn::BatchNorm;
use burn::prelude::*;
use burn::tensor::{FloatDType, Gradients};

use crate::step::{StepOutput, TrainStep};

/// The activation that flows between blocks: a float tensor of rank 2, 3 or 4.
#[derive(Debug, Clone)]
pub enum Activation {
    /// `[batch, features]`.
    Rank2(Tensor<2>),
    /// `[batch, time, features]`.
    Rank3(Tensor<3>),
    /// `[batch, channels, height, width]`.
    Rank4(Tensor<4>),
}

macro_rules! each {
    ($value:expr, $t:ident => $body:expr) => {
        match $value {
            Activation::Rank2($t) => Activation::Rank2($body),
            Activation::Rank3($t) => Activation::Rank3($body),
            Activation::Rank4($t) => Activation::Rank4($body),
        }
    };
}

impl Activation {
    /// The same values with no link to the graph that produced them.
    pub fn detach(self) -> Self {
        each!(self, t => t.detach())
    }

    /// Marks a detached activation as a leaf whose gradient backward keeps.
    pub fn require_grad(self) -> Self {
        each!(self, t => t.require_grad())
    }

    /// Whether the activation takes part in an autodiff graph.
    pub fn is_tracked(&self) -> bool {
        match self {
            Activation::Rank2(t) => t.is_tracked(),
            Activation::Rank3(t) => t.is_tracked(),
            Activation::Rank4(t) => t.is_tracked(),
        }
    }

    /// The gradient `grads` holds for this (leaf) activation.
    pub fn grad(&self, grads: &Gradients) -> Option<Self> {
        Some(match self {
            Activation::Rank2(t) => Activation::Rank2(t.grad(grads)?),
            Activation::Rank3(t) => Activation::Rank3(t.grad(grads)?),
            Activation::Rank4(t) => Activation::Rank4(t.grad(grads)?),
        })
    }

    /// `sum(self * other)`, shape `[1]`, differentiated in `self` only
    /// ([`crate::fused::dot_seed`]). Backpropagating it from an activation `y` with `other` =
    /// the gradient of the loss with respect to `y` gives the loss's gradients of everything
    /// `y` depends on (a vector-Jacobian product).
    ///
    /// # Panics
    /// If the two activations have different ranks.
    pub fn dot(self, other: Self) -> Tensor<1> {
        match (self, other) {
            (Activation::Rank2(a), Activation::Rank2(b)) => crate::fused::dot_seed(a, b),
            (Activation::Rank3(a), Activation::Rank3(b)) => crate::fused::dot_seed(a, b),
            (Activation::Rank4(a), Activation::Rank4(b)) => crate::fused::dot_seed(a, b),
            (a, b) => panic!(
                "activation ranks differ: {} vs {}",
                a.dims().len(),
                b.dims().len()
            ),
        }
    }

    /// The activation moved to `device` (a pipeline's next stage).
    pub fn to_device(self, device: &Device) -> Self {
        each!(self, t => t.to_device(device))
    }

    /// The activation on `device` as that device's own tensors are: with autodiff and the
    /// device's gradient-checkpointing strategy when the device has autodiff. For an activation
    /// that arrived from another device or process.
    pub fn arrive(self, device: &Device) -> Self {
        each!(self, t => {
            let t = t.to_device(device);
            if device.is_autodiff() {
                let t = t.autodiff();
                match device.gradient_checkpointing_strategy() {
                    Some(s) => t.with_gradient_checkpointing_strategy(s),
                    None => t,
                }
            } else {
                t
            }
        })
    }

    /// The activation converted to `dtype`.
    pub fn cast(self, dtype: FloatDType) -> Self {
        each!(self, t => t.cast(dtype))
    }

    /// The shape.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Activation::Rank2(t) => t.dims().to_vec(),
            Activation::Rank3(t) => t.dims().to_vec(),
            Activation::Rank4(t) => t.dims().to_vec(),
        }
    }

    /// The rank-`D` tensor inside.
    ///
    /// # Panics
    /// If the activation has another rank (a model handed its own block a wrong activation).
    pub fn into_rank<const D: usize>(self) -> Tensor<D> {
        let dims = self.dims();
        let shape: [usize; D] = dims
            .clone()
            .try_into()
            .unwrap_or_else(|_| panic!("expected a rank-{D} activation, got shape {dims:?}"));
        match self {
            Activation::Rank2(t) => t.reshape(shape),
            Activation::Rank3(t) => t.reshape(shape),
            Activation::Rank4(t) => t.reshape(shape),
        }
    }
}

/// A model whose forward pass is `head(block_{n-1}(… block_0(stem(batch))))`, the same
/// computation as its [`TrainStep::step`].
///
/// Describing the stack is optional: `impl BlockStack<MyBatch> for MyModel {}` declares a model
/// without one (`num_blocks` is 0), which trains through [`TrainStep::step`] under every
/// strategy that does not need the cut; the features that do (block recomputation,
/// synchronised BatchNorm, ZeRO-3, pipeline stages) refuse such a model at start, so the other
/// methods' defaults are never called.
pub trait BlockStack<B>: TrainStep<B> {
    /// How the model is cut over a tensor-parallel group (`parallel.tp`), if it says: `None`,
    /// the default, refuses `tp > 1` in one line. A model that implements
    /// [`crate::tp::TensorParallel`] returns `Some(self)`.
    fn tensor_parallel(&self) -> Option<&dyn crate::tp::TensorParallel> {
        None
    }
    /// Number of blocks. Default 0: the model describes no stack.
    fn num_blocks(&self) -> usize {
        0
    }
    /// The input of block 0 (for a GPT, the token and position embeddings).
    fn stem(&self, batch: &B) -> Activation {
        let _ = batch;
        panic!("BlockStack::stem is called only for a model whose num_blocks is above 0")
    }
    /// Block `i` applied to `x`.
    fn block(&self, i: usize, x: Activation) -> Activation {
        let _ = (i, x);
        panic!("BlockStack::block is called only for a block the model describes")
    }
    /// Block `i` on `x` for `batch`: what a block needs of the batch besides the activation
    /// (a packed batch's documents, which attention stays within). Defaults to
    /// [`BlockStack::block`].
    fn block_in(&self, i: usize, x: Activation, batch: &B) -> Activation {
        let _ = batch;
        self.block(i, x)
    }

    /// Whether [`BlockStack::block_in`] reads the batch, so that a pipeline's middle stages
    /// take it too. Default false.
    fn blocks_read_batch(&self) -> bool {
        false
    }
    /// The layers after the last block and the loss.
    fn head(&self, x: Activation, batch: &B) -> StepOutput {
        let _ = (x, batch);
        panic!("BlockStack::head is called only for a model whose num_blocks is above 0")
    }
    /// The ids of block `i`'s float parameters (see [`crate::modules::param_ids`]), which lets a
    /// trainer gather, reduce or place one block's parameters on their own. A parameter that
    /// no block claims (embeddings, the head, weights tied between them) belongs to the model
    /// as a whole.
    fn block_params(&self, i: usize) -> Vec<ParamId> {
        let _ = i;
        Vec::new()
    }
    /// Whether running a block twice on the same input, with the random numbers of its first
    /// run drawn again (the engine seeds a recomputed block's forward as its first: dropout
    /// masks repeat), gives the same output, which recomputation needs; `false` for a block
    /// whose output depends on more than its input, its parameters and its draws.
    fn blocks_deterministic(&self) -> bool {
        true
    }
    /// The BatchNorm in the middle of block `i`, if it has one. Block `i` is then
    /// `after_norm(norm(before_norm(x)))`, which lets a trainer compute the norm's batch
    /// statistics over several replicas. Default: no block has one.
    fn block_norm(&self, i: usize) -> Option<&BatchNorm> {
        let _ = i;
        None
    }
    /// The part of block `i` before its BatchNorm (called only when [`Self::block_norm`]
    /// returns one).
    fn before_norm(&self, i: usize, x: Activation) -> Activation {
        let _ = i;
        x
    }
    /// The part of block `i` after its BatchNorm (called only when [`Self::block_norm`]
    /// returns one).
    fn after_norm(&self, i: usize, x: Activation) -> Activation {
        let _ = i;
        x
    }
}
