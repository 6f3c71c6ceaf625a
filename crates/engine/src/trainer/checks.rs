//! The model against the settings, before any worker starts: parameter groups, the precision
//! policy, activation checkpointing and synchronised BatchNorm, then the strategy's own rules.
//! Each refusal is one line naming the key.

use burn::module::Module;
use kiln_models::BlockStack;

use super::settings::TrainerSettings;
use crate::config::RecomputeMode;
use crate::error::{Error, Result};
use crate::strategy::{ModelFacts, Setup};

/// Rejects settings that cannot work with `model`.
pub(super) fn check_model<B, M: BlockStack<B> + Module>(
    model: &M,
    s: &TrainerSettings,
    setup: &Setup,
) -> Result<()> {
    let facts = ModelFacts::of(model);
    check_tp(model, &facts, setup)?;
    check_groups(model, &facts, s, setup)?;
    setup.policy.check_model(facts.buffers)?;
    let world = s.world();
    if facts.blocks == 0 && s.parallel.sync_batchnorm && world > 1 {
        return Err(Error::config(
            "key `ddp.sync_batchnorm`: synchronised BatchNorm cuts the model around the norms \
             of its blocks, but this model describes no blocks (its BlockStack's num_blocks is \
             0); describe the blocks, or turn ddp.sync_batchnorm off"
                .to_string(),
        ));
    }
    let blocks = s.recompute.mode == RecomputeMode::Blocks;
    if blocks && facts.blocks == 0 {
        return Err(Error::config(
            "key `recompute.mode`: \"blocks\" recomputes the model's blocks, but this model \
             has none; use \"balanced\" or \"none\""
                .to_string(),
        ));
    }
    if blocks && !facts.deterministic {
        return Err(Error::config(
            "key `recompute.mode`: \"blocks\" runs each block twice and needs both runs to \
             agree, but this model says its blocks do not (BlockStack::blocks_deterministic); \
             use recompute \"balanced\""
                .to_string(),
        ));
    }
    if facts.groups.is_empty() {
        setup.check_model(&facts)?;
    }
    Ok(())
}

/// Refuses a tensor-parallel group (`parallel.tp > 1`) to a model that does not say how it is
/// cut, or cannot be cut over that many ranks, or steps several optimizers.
fn check_tp<B, M: BlockStack<B> + Module>(
    model: &M,
    facts: &ModelFacts,
    setup: &Setup,
) -> Result<()> {
    if setup.tp <= 1 {
        return Ok(());
    }
    let Some(tp) = model.tensor_parallel() else {
        return Err(Error::config(format!(
            "key `parallel.tp`: {} tensor-parallel ranks need a model that says how its \
             Linears are cut (column or row: kiln_models::tp::TensorParallel, returned by its \
             BlockStack::tensor_parallel); this model says nothing, so set parallel.tp = 1",
            setup.tp
        )));
    };
    tp.tp_check(setup.tp)
        .map_err(|e| Error::config(format!("key `parallel.tp`: {e}")))?;
    if !facts.groups.is_empty() {
        return Err(Error::config(format!(
            "key `parallel.tp`: this model steps {} optimizers ({}), which tensor parallelism \
             does not run; set parallel.tp = 1",
            facts.groups.len(),
            facts.groups.join(", ")
        )));
    }
    // A quantized base (QLoRA) is packed in blocks of its own: it is not cut.
    let splits = kiln_models::tp::splits_of(model, tp, setup.tp);
    let dtypes = crate::params::float_dtypes(model);
    if let Some(((path, _), dtype)) = splits
        .iter()
        .zip(&dtypes)
        .find(|((_, split), dtype)| split.is_cut() && !dtype.is_float())
    {
        return Err(Error::config(format!(
            "key `parallel.tp`: parameter `{path}` is quantized ({dtype:?}), and a quantized \
             weight is not cut over tensor-parallel ranks; set parallel.tp = 1 or leave \
             finetune.lora.quantize out"
        )));
    }
    Ok(())
}

/// Refuses a tensor-parallel group to a model that draws random numbers in its forward
/// (`draws`, the start-up probe's finding) other than through kiln's keyed draws: its ranks,
/// which cannot hold the random-number lock through a forward that waits for them, would draw
/// different masks for what they hold alike.
pub(super) fn check_tp_draws<B, M: BlockStack<B>>(
    model: &M,
    setup: &Setup,
    draws: bool,
) -> Result<()> {
    let keyed = model.tensor_parallel().is_some_and(|t| t.tp_draws_keyed());
    if setup.tp <= 1 || !draws || keyed {
        return Ok(());
    }
    Err(Error::config(format!(
        "key `parallel.tp`: this model draws random numbers in its forward (dropout) from the \
         backend's shared state, which the {} ranks of a tensor-parallel group would draw \
         differently; draw them with kiln_models::draw::dropout and say so \
         (TensorParallel::tp_draws_keyed), or set its dropout to 0",
        setup.tp
    )))
}

/// Checks a model's parameter groups (if it has any) against the settings: names that the
/// config knows, every trainable parameter in exactly one group, and only what a step with
/// several optimizers can run (the strategy says whether it can).
fn check_groups<B, M: BlockStack<B> + Module>(
    model: &M,
    facts: &ModelFacts,
    s: &TrainerSettings,
    setup: &Setup,
) -> Result<()> {
    let groups = model.param_groups();
    let names = &facts.groups;
    if groups.is_empty() {
        if let Some(name) = s.groups.keys().next() {
            return Err(Error::config(format!(
                "key `groups.{name}`: this model steps one optimizer and has no parameter groups \
                 (its TrainStep::param_groups is empty); configure it in [optim]"
            )));
        }
        return Ok(());
    }
    for name in s.groups.keys() {
        if !names.contains(name) {
            return Err(Error::config(format!(
                "key `groups.{name}`: the model has no parameter group {name:?} (its groups: {})",
                names.join(", ")
            )));
        }
    }
    let trainable = crate::params::trainable_params(model);
    let mut owner: std::collections::HashMap<burn::module::ParamId, &str> = Default::default();
    for g in &groups {
        if !crate::config::is_group_name(&g.name) {
            return Err(Error::config(format!(
                "parameter group {:?}: a group name is lower-case letters, digits, `_` and `-`",
                g.name
            )));
        }
        if names.iter().filter(|n| **n == g.name).count() > 1 {
            return Err(Error::config(format!(
                "parameter group {:?} is named twice in TrainStep::param_groups",
                g.name
            )));
        }
        for id in &g.params {
            let Some((_, path, _)) = trainable.iter().find(|(t, _, _)| t == id) else {
                continue;
            };
            if let Some(other) = owner.insert(*id, &g.name) {
                return Err(Error::config(format!(
                    "parameter `{path}` is in parameter groups {other:?} and {:?}; each \
                     parameter belongs to one optimizer",
                    g.name
                )));
            }
        }
    }
    if let Some((_, path, _)) = trainable.iter().find(|(id, _, _)| !owner.contains_key(id)) {
        return Err(Error::config(format!(
            "parameter `{path}` is trainable but in no parameter group ({}); add it to one, or \
             freeze it",
            names.join(", ")
        )));
    }
    // The strategy first: one that steps one optimizer refuses the model whatever else is set.
    setup.check_model(facts)?;
    let refuse = |key: &str, what: &str, instead: &str| {
        Err(Error::config(format!(
            "key `{key}`: {what}, but this model steps {} optimizers ({}); {instead}",
            groups.len(),
            names.join(", ")
        )))
    };
    if s.recompute.mode == RecomputeMode::Blocks {
        return refuse(
            "recompute.mode",
            "\"blocks\" walks one loss block by block",
            "use \"balanced\" or \"none\"",
        );
    }
    if s.parallel.sync_batchnorm && s.world() > 1 {
        return refuse(
            "ddp.sync_batchnorm",
            "synchronised BatchNorm walks one loss block by block",
            "turn it off",
        );
    }
    if setup.policy.config().uses_scaler() {
        return refuse(
            "precision.mode",
            "\"16-mixed\" scales one loss with one dynamic scaler",
            "use \"bf16-mixed\" or \"32\"",
        );
    }
    Ok(())
}
