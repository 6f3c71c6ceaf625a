//! `pipeline`: the model's block stack cut into stages, one device and thread each, with
//! micro-batches flowing through them; `devices / stages` such pipelines are data-parallel
//! replicas.
//!
//! Rank `r` is stage `r mod K` of replica `r div K`. Stage s holds its blocks (the
//! [`partition`]) and, on the first and the last stage, the parameters outside every block
//! (the stem's and the head's, the GPT's token embedding tied between them, kept on both); the
//! other stages' parameters are released in its module. A micro-batch's forward enters at the
//! first stage (the stem), passes each stage's blocks — the activation travels to the next
//! stage's device with Burn's `to_device` — and ends in the head and the loss on the last
//! stage, whose backward starts there; each stage's backward is the block walk's
//! ([`crate::exec::backward_blocks`]) seeded with the gradient the next stage sent back. The
//! order of a stage's forwards and backwards is the [`schedule`]'s (GPipe or 1F1B).
//!
//! The micro-batches of one flush are `pipeline.microbatches` consecutive accumulation
//! micro-steps (each of `train.batch_size` samples), so a pipeline sees exactly the samples of
//! `single --accumulate M`. At the optimizer step each block's gradients are averaged with the
//! same stage of the other replicas; the parameters outside the blocks have their stem part on
//! the first stage and their head part on the last, so those are summed over the first and
//! last stages of every replica (and divided by the replicas), which keeps the two copies of
//! a tied weight identical. Clipping adds every stage's squares (the shared parameters counted
//! once); the overflow check of a loss scaler is all-reduced over every rank.
//!
//! BatchNorm sees one micro-batch at a time, as with gradient accumulation, in micro-batch
//! order on every stage (both schedules run the forwards in order), so its running statistics
//! come out as accumulation's. Evaluation and checkpoints assemble the whole model on every
//! rank (each unit broadcast from the stage that holds it).

mod flush;
pub mod partition;
mod rules;
pub mod schedule;
mod shares;
mod stage;
mod step;
mod timeline;

pub use rules::Pipeline;
pub use stage::Stage;
