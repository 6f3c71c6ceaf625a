//! `diloco`: islands of ranks that train on their own and meet every `diloco.inner_steps`
//! steps (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language
//! Models").
//!
//! The ranks are cut into islands of consecutive ranks (by default one per process: the
//! devices of one machine). Inside an island every step is the `ddp` step. Every H =
//! `diloco.inner_steps` optimizer steps, the islands meet: each island's pseudo-gradient (the
//! parameters at the last outer step minus its parameters now) is averaged over the islands
//! and applied to the last outer step's parameters by Nesterov SGD (`diloco.outer_lr`,
//! `diloco.outer_momentum`), and every island continues from the result. Between two outer
//! steps nothing crosses between islands, so the link between machines carries one model's
//! worth of floats every H steps instead of every step.
//!
//! The outer average is cut over the island's ranks: rank `l` of every island averages the
//! `l`-th piece of the pseudo-gradient with rank `l` of the others, then the island gathers
//! the pieces, so an island of N devices sends each float once.
//!
//! What the rest of kiln sees: the whole model ([`Strategy::full_model`]: evaluated,
//! checkpointed, exported) is the islands' mean (at an outer step, the parameters every island
//! holds), and a checkpoint's `optimizer.bpk` is the islands' mean inner optimizer state, so
//! any strategy resumes from the pair; `optimizer.diloco.bpk` holds the rest (the outer step's
//! parameters and momentum, the steps since it, each island's inner state, and, between outer
//! steps, each island's parameters), so a DiLoCo run resumes bit for bit. A checkpoint of another
//! strategy resumes as DiLoCo with a fresh outer loop.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::module::Module;
use burn::prelude::*;
use burn::store::burn_pack::Scalar;
use kiln_models::{BlockStack, StepOutput};

use super::context::Context;
use super::ddp::Ddp;
use super::host::reduce_host;
use super::kit::{Group, RankKit};
use super::memory::Memory;
use super::replica::Replicated;
use super::rules::{
    Checks, Costs, Estimate, ModelFacts, Op, Room, Setup, Shape, Traffic, Variant, Words,
};
use super::step::{Report, Strategy};
use crate::comm::{Collective, ReduceOp, pack};
use crate::config::{DilocoConfig, OptimConfig, ReduceDtype};
use crate::error::{Error, Result};
use crate::optim::OptimState;
use crate::params::{FlatLayout, collect_floats, host_f32};
use crate::precision::LossScaler;

/// The name of DiLoCo's own state in a checkpoint (`optimizer.diloco.bpk`).
pub const STATE: &str = "diloco";

/// Islands that train as `ddp` inside and meet through an outer optimizer.
pub struct Diloco;

/// DiLoCo's own section of `setup`, which its rules read.
fn section(setup: &Setup) -> &DilocoConfig {
    setup.own.diloco()
}

impl Checks for Diloco {
    fn check(&self, setup: &Setup) -> Result<()> {
        let islands = section(setup).islands;
        if islands > 0 && !setup.world.is_multiple_of(islands) {
            return Err(Error::config(format!(
                "key `diloco.islands`: {islands} islands do not divide the {} ranks",
                setup.world
            )));
        }
        Ok(())
    }

    fn check_model(&self, model: &ModelFacts, _setup: &Setup) -> Result<()> {
        if model.buffers {
            return Err(Error::config(
                "key `strategy.name`: \"diloco\" averages the islands' trainable parameters, \
                 and this model has buffers (BatchNorm running statistics) that each island \
                 would keep to itself; use \"ddp\""
                    .to_string(),
            ));
        }
        Ok(())
    }
}

impl Words for Diloco {
    fn describe(&self, setup: &Setup) -> String {
        let d = section(setup);
        let islands = match d.islands {
            0 => "an island per process".to_string(),
            1 => "1 island".to_string(),
            n => format!("{n} islands"),
        };
        format!(
            "diloco ({islands}, ddp inside; every {} steps an outer Nesterov SGD step, lr {}, \
             momentum {})",
            d.inner_steps, d.outer_lr, d.outer_momentum
        )
    }
}

impl Costs for Diloco {
    /// An island's rank holds what a `ddp` rank holds, and the outer loop's state beside its
    /// optimizer's: the anchor and (with momentum) the outer momentum, f32 on the host.
    fn estimate(
        &self,
        layout: &FlatLayout,
        optim: &OptimConfig,
        setup: &Setup,
    ) -> Result<Estimate> {
        let mut estimate = Ddp.estimate(layout, optim, setup)?;
        estimate.optim += outer_bytes(layout.total(), section(setup));
        Ok(estimate)
    }

    /// Weighed across processes only (each an island).
    fn variants(&self, room: &Room) -> Vec<Variant> {
        if room.world > 1 && room.processes > 1 {
            vec![Variant::plain(crate::config::StrategyKind::Diloco)]
        } else {
            Vec::new()
        }
    }

    /// Its inner steps are `ddp`'s.
    fn probe_as(&self, _setup: &Setup) -> String {
        "ddp".to_string()
    }

    /// The islands' `ddp` inside a process (timed on the world's links: an upper bound), and
    /// the outer all-reduce once every `inner_steps` steps.
    fn traffic(&self, setup: &Setup, floats: usize, local: usize) -> Vec<Traffic> {
        let mut out = Vec::new();
        if local > 1 {
            out.push(Traffic::once(Op::AllReduce, floats));
        }
        out.push(Traffic {
            every: section(setup).inner_steps.max(1),
            ..Traffic::once(Op::AllReduce, floats)
        });
        out
    }

    fn same_step(&self) -> bool {
        false
    }

    fn simplicity(&self) -> usize {
        4
    }
}

impl Shape for Diloco {
    fn own_state(&self) -> Option<&'static str> {
        Some(STATE)
    }
}

/// The outer loop's state for `n` parameters: the anchor and the outer momentum, f32.
fn outer_bytes(n: usize, config: &DilocoConfig) -> usize {
    let vectors = if config.outer_momentum > 0.0 { 2 } else { 1 };
    vectors * n * 4
}

/// A rank of one island: the `ddp` step inside its island, and the outer loop.
pub(crate) struct Islands<'a, M: Module> {
    inner: Replicated<'a, M, Ddp>,
    /// The rank with this rank's place in every island: the outer average runs here.
    cross: Box<dyn Collective>,
    island: usize,
    islands: usize,
    /// This rank's place in its island, and the island's ranks.
    local: usize,
    size: usize,
    config: DilocoConfig,
    /// The parameters of the last outer step (canonical, f32), the same on every rank.
    anchor: Vec<f32>,
    /// The outer momentum (empty without momentum).
    momentum: Vec<f32>,
    /// Optimizer steps since the last outer step.
    since: usize,
    outer_steps: usize,
}

impl<'a, M: Module> Islands<'a, M> {
    pub fn new(model: M, layout: FlatLayout, ctx: Context<'a>) -> Result<Self> {
        let world = ctx.comm.world_size();
        let config = ctx.own.diloco().clone();
        let islands = match config.islands {
            0 => crate::comm::processes().count,
            n => n,
        };
        if islands == 0 || !world.is_multiple_of(islands) {
            return Err(Error::config(format!(
                "key `diloco.islands`: {islands} islands do not divide the {world} ranks"
            )));
        }
        let size = world / islands;
        let rank = ctx.comm.rank();
        let (island, local) = (rank / size, rank % size);
        let group: Arc<dyn Collective> = Arc::from(ctx.comm.split(island, local)?);
        let cross = ctx.comm.split(local, island)?;
        let kit = RankKit::in_group(ctx, Group::Owned(group), layout);
        let mut inner = Replicated::new(model, kit, Ddp);
        let (kit, replica) = inner.parts();
        let anchor = host_f32(kit.shard_of(&replica.model));
        let momentum = if config.outer_momentum > 0.0 {
            vec![0.0; anchor.len()]
        } else {
            Vec::new()
        };
        Ok(Self {
            inner,
            cross,
            island,
            islands,
            local,
            size,
            config,
            anchor,
            momentum,
            since: 0,
            outer_steps: 0,
        })
    }

    /// This rank's parameters, canonical and in f32.
    fn params(&mut self) -> Vec<f32> {
        let (kit, replica) = self.inner.parts();
        host_f32(kit.shard_of(&replica.model))
    }

    /// The mean over islands of `values` (the same on every rank of an island): rank `l` of
    /// each island averages the `l`-th piece with the others' rank `l` — in `wire` between
    /// the islands —, then the island gathers its pieces.
    fn island_mean(&mut self, values: Vec<f32>, wire: ReduceDtype) -> Result<Vec<f32>> {
        if self.islands == 1 {
            return Ok(values);
        }
        let n = values.len();
        let per = n.div_ceil(self.size);
        let start = (self.local * per).min(n);
        let end = (start + per).min(n);
        let mut mine = vec![0.0; per];
        mine[..end - start].copy_from_slice(&values[start..end]);
        drop(values);
        let cross = &*self.cross;
        let (kit, _) = self.inner.parts();
        let bucket = kit.bucket_elements;
        let mut mine = kit.timed(|_| reduce_host(cross, mine, ReduceOp::Mean, wire, bucket))?;
        if self.size == 1 {
            mine.truncate(n);
            return Ok(mine);
        }
        let mut all = kit.timed(|island| island.all_gather(&mine))?;
        all.truncate(n);
        Ok(all)
    }

    /// The outer step: the islands' mean pseudo-gradient applied to the last outer step's
    /// parameters by Nesterov SGD; every island continues from the result.
    fn outer_step(&mut self) -> Result<()> {
        let now = self.params();
        let delta: Vec<f32> = self.anchor.iter().zip(&now).map(|(a, x)| a - x).collect();
        drop(now);
        // What crosses between machines: in the reduce dtype (bf16: half the bytes).
        let wire = self.inner.parts().0.policy.reduce_dtype();
        let delta = self.island_mean(delta, wire)?;
        let lr = self.config.outer_lr as f32;
        let mu = self.config.outer_momentum as f32;
        if self.momentum.is_empty() {
            for (a, d) in self.anchor.iter_mut().zip(&delta) {
                *a -= lr * d;
            }
        } else {
            // PyTorch's SGD with nesterov = true and no dampening.
            for ((a, m), d) in self.anchor.iter_mut().zip(&mut self.momentum).zip(&delta) {
                *m = mu * *m + d;
                *a -= lr * (d + mu * *m);
            }
        }
        let (kit, replica) = self.inner.parts();
        let model = kit.load_canonical(replica.model.clone(), self.anchor.clone());
        replica.set_model(model);
        self.since = 0;
        self.outer_steps += 1;
        Ok(())
    }

    /// Every island's parameters (between outer steps) and inner optimizer state, on rank 0
    /// as the checkpoint's DiLoCo state; `main` is this island's inner state (on its lead).
    fn own_state(&mut self, main: Option<&OptimState>) -> Result<Option<OptimState>> {
        let (kit, _) = self.inner.parts();
        let kind = kit.optimizer.kind();
        let layout = kit.layout.clone();
        if self.local != 0 {
            // The island's lead speaks for it: every rank of an island holds the same.
            return Ok(None);
        }
        let between = self.since != 0;
        let params = if between { self.params() } else { Vec::new() };
        let main = main.expect("an island's lead holds its optimizer state");
        let leaves = main.leaves(&layout)?;
        let mut payload = params;
        let names: Vec<&str> = leaves.iter().map(|(name, _)| name.as_str()).collect();
        for (_, values) in &leaves {
            payload.extend_from_slice(values);
        }
        let scalars: Vec<String> = main
            .scalars
            .iter()
            .map(|(k, v)| format!("{k}={}", scalar_text(v)))
            .collect();
        // Leaf and scalar names are dotted words: `,` and `|` separate them.
        let words = format!("{}|{}", names.join(","), scalars.join(","));
        let cross = &*self.cross;
        let (kit, _) = self.inner.parts();
        let texts = kit.timed(|_| pack::gather_text(cross, &words))?;
        let payloads = kit.timed(|_| pack::gather_ragged(cross, &payload))?;
        if self.island != 0 {
            return Ok(None);
        }
        let n = layout.total();
        let mut out: Vec<(String, Vec<f32>)> = vec![("outer.anchor".into(), self.anchor.clone())];
        if !self.momentum.is_empty() {
            out.push(("outer.momentum".into(), self.momentum.clone()));
        }
        let mut scalars = BTreeMap::new();
        scalars.insert("diloco.since".to_string(), Scalar::from(self.since as u64));
        scalars.insert(
            "diloco.islands".to_string(),
            Scalar::from(self.islands as u64),
        );
        scalars.insert(
            "diloco.outer_steps".to_string(),
            Scalar::from(self.outer_steps as u64),
        );
        for (j, (text, values)) in texts.iter().zip(&payloads).enumerate() {
            let (names, scalar_words) = text.split_once('|').ok_or_else(|| bad_state(text))?;
            let names = names.split(',').filter(|w| !w.is_empty());
            let mut at = 0;
            if between {
                out.push((format!("island.{j}.params"), values[..n].to_vec()));
                at = n;
            }
            for name in names {
                out.push((format!("island.{j}.{name}"), values[at..at + n].to_vec()));
                at += n;
            }
            for word in scalar_words.split(',').filter(|w| !w.is_empty()) {
                let (k, v) = word.split_once('=').ok_or_else(|| bad_state(word))?;
                scalars.insert(format!("island.{j}.{k}"), text_scalar(v)?);
            }
        }
        Ok(Some(OptimState::from_leaves(kind, &layout, out, scalars)))
    }

    /// The mean over islands of the leads' inner optimizer states (island 0's scalars): the
    /// checkpoint's `optimizer.bpk`, which goes with the islands' mean model (for SGD's
    /// momentum, exactly the state `ddp` would hold).
    fn leads_mean(&mut self, main: OptimState) -> Result<OptimState> {
        let (kit, _) = self.inner.parts();
        let layout = kit.layout.clone();
        let cross = &*self.cross;
        let mut leaves = main.leaves(&layout)?;
        for (_, values) in &mut leaves {
            kit.timed(|_| cross.all_reduce(values, ReduceOp::Mean))?;
        }
        Ok(OptimState::from_leaves(
            main.kind,
            &layout,
            leaves,
            main.scalars,
        ))
    }

    /// Takes the DiLoCo state of a checkpoint: the outer loop, and this island's parameters
    /// and inner state when the checkpoint has as many islands.
    fn load_own_state(&mut self, state: &OptimState) -> Result<()> {
        let (kit, _) = self.inner.parts();
        let layout = kit.layout.clone();
        let count = |key: &str| -> Result<usize> {
            let v = state.scalars.get(key).ok_or_else(|| bad_state(key))?;
            u64::try_from(*v)
                .map(|v| v as usize)
                .map_err(|_| bad_state(key))
        };
        let saved_islands = count("diloco.islands")?;
        let since = count("diloco.since")?;
        let mut leaves: BTreeMap<String, Vec<f32>> = state.leaves(&layout)?.into_iter().collect();
        if let Some(m) = leaves.remove("outer.momentum")
            && !self.momentum.is_empty()
        {
            self.momentum = m;
        }
        self.outer_steps = count("diloco.outer_steps")?;
        if saved_islands != self.islands {
            // Another number of islands: every island starts from the checkpoint's model and
            // optimizer state, as after an outer step.
            if self.island == 0 && self.local == 0 {
                say!(
                    "the checkpoint's DiLoCo state is for {saved_islands} island(s), this run has \
                     {}: every island starts from its model and optimizer state, the outer \
                     momentum carries on",
                    self.islands
                );
            }
            // The anchor is already the checkpoint's model (taken when the strategy was
            // built from it).
            self.since = 0;
            return Ok(());
        }
        self.anchor = leaves
            .remove("outer.anchor")
            .ok_or_else(|| bad_state("outer.anchor"))?;
        self.since = since;
        let prefix = format!("island.{}.", self.island);
        if since != 0 {
            let key = format!("{prefix}params");
            let params = leaves.remove(&key).ok_or_else(|| bad_state(&key))?;
            let (kit, replica) = self.inner.parts();
            let model = kit.load_canonical(replica.model.clone(), params);
            replica.set_model(model);
        }
        {
            let mine: Vec<(String, Vec<f32>)> = leaves
                .into_iter()
                .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|leaf| (leaf.to_string(), v)))
                .collect();
            let scalars = state
                .scalars
                .iter()
                .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|s| (s.to_string(), *v)))
                .collect();
            let (kit, _) = self.inner.parts();
            let inner = OptimState::from_leaves(kit.optimizer.kind(), &layout, mine, scalars);
            kit.load_optimizer_state(&inner)?;
        }
        Ok(())
    }
}

fn bad_state(what: &str) -> Error {
    Error::checkpoint(format!(
        "optimizer.{STATE}.bpk: the DiLoCo state has no valid {what:?}"
    ))
}

/// A scalar as exact text (a float by its bits).
fn scalar_text(v: &Scalar) -> String {
    match v {
        Scalar::Int(i) => format!("i{i}"),
        Scalar::UInt(u) => format!("u{u}"),
        Scalar::Float(f) => format!("f{}", f.to_bits()),
        Scalar::Bool(b) => format!("b{}", u8::from(*b)),
    }
}

fn text_scalar(text: &str) -> Result<Scalar> {
    let parse = || -> Option<Scalar> {
        let (kind, v) = text.split_at_checked(1)?;
        Some(match kind {
            "i" => Scalar::Int(v.parse().ok()?),
            "u" => Scalar::UInt(v.parse().ok()?),
            "f" => Scalar::Float(f64::from_bits(v.parse().ok()?)),
            "b" => Scalar::Bool(v == "1"),
            _ => return None,
        })
    };
    parse().ok_or_else(|| bad_state(text))
}

impl<B, M: BlockStack<B> + Module> Strategy<M, B> for Islands<'_, M> {
    fn begin_step(&mut self) -> Result<()> {
        Strategy::<M, B>::begin_step(&mut self.inner)
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(Tensor<1>) -> Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        self.inner.micro_steps(batches, count, objective)
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        let stepped = Strategy::<M, B>::optimizer_step(&mut self.inner, lr, scaler, clip)?;
        // Every call counts, stepped or skipped, so the islands meet at the same steps.
        self.since += 1;
        if self.since >= self.config.inner_steps {
            self.outer_step()?;
        }
        Ok(stepped)
    }

    fn full_model(&mut self) -> Result<M> {
        if self.since == 0 || self.islands == 1 {
            return Strategy::<M, B>::full_model(&mut self.inner);
        }
        let now = self.params();
        let mean = self.island_mean(now, ReduceDtype::F32)?;
        let (kit, replica) = self.inner.parts();
        Ok(kit.load_canonical(replica.model.clone(), mean))
    }

    fn optimizer_state(&mut self) -> Result<Option<OptimState>> {
        Strategy::<M, B>::optimizer_state(&mut self.inner)
    }

    fn load_optimizer_state(&mut self, state: &OptimState) -> Result<()> {
        Strategy::<M, B>::load_optimizer_state(&mut self.inner, state)
    }

    fn optimizer_states(&mut self) -> Result<Option<Vec<(String, OptimState)>>> {
        let main = Strategy::<M, B>::optimizer_state(&mut self.inner)?;
        let own = self.own_state(main.as_ref())?;
        let main = match main {
            Some(main) if self.islands > 1 => Some(self.leads_mean(main)?),
            other => other,
        };
        Ok(main.map(|main| {
            let mut states = vec![(String::new(), main)];
            states.extend(own.map(|s| (STATE.to_string(), s)));
            states
        }))
    }

    fn checkpoint_share(&mut self) -> Result<crate::optim::Share>
    where
        M: Module,
    {
        // Every rank takes part in the gathers; the first island's lead writes what they give
        // (each island's lead holds a whole state: the others' would be written twice).
        let model = Strategy::<M, B>::full_model(self)?;
        let states = Strategy::<M, B>::optimizer_states(self)?;
        Ok(match states {
            Some(states) if self.island == 0 && self.local == 0 => {
                crate::optim::Share::whole(model, states)
            }
            _ => crate::optim::Share::default(),
        })
    }

    fn load_optimizer_states(&mut self, states: &[(String, OptimState)]) -> Result<()> {
        for (name, state) in states {
            match name.as_str() {
                "" => Strategy::<M, B>::load_optimizer_state(&mut self.inner, state)?,
                STATE => {}
                other => {
                    return Err(Error::checkpoint(format!(
                        "the checkpoint holds the optimizer state of group {other:?}, but \
                         this model steps one optimizer"
                    )));
                }
            }
        }
        if let Some((_, state)) = states.iter().find(|(name, _)| name == STATE) {
            self.load_own_state(state)?;
        }
        Ok(())
    }

    fn check_replicas(&mut self, step: usize) -> Result<()> {
        Strategy::<M, B>::check_replicas(&mut self.inner, step)?;
        if self.since == 0 && self.islands > 1 {
            // After an outer step every island holds the same parameters.
            let (kit, replica) = self.inner.parts();
            let values = collect_floats(&replica.model, true);
            kit.check_replicas(&*self.cross, values, step)?;
        }
        Ok(())
    }

    fn report(&mut self) -> Result<Report> {
        let mut report = Strategy::<M, B>::report(&mut self.inner)?;
        report
            .fields
            .push(("outer_steps".into(), self.outer_steps.into()));
        Ok(report)
    }

    fn memory(&self) -> Memory {
        // The outer state is held throughout: it adds to every figure alike.
        let mut memory = Strategy::<M, B>::memory(&self.inner);
        let outer = (self.anchor.len() + self.momentum.len()) * 4;
        memory.optim.now += outer;
        memory.optim.peak += outer;
        memory.total_peak += outer;
        memory
    }

    fn take_sync_seconds(&mut self) -> f64 {
        Strategy::<M, B>::take_sync_seconds(&mut self.inner)
    }

    fn nonfinite(&self) -> bool {
        Strategy::<M, B>::nonfinite(&self.inner)
    }

    fn skipped_on_device(&mut self) -> Result<Vec<usize>> {
        Strategy::<M, B>::skipped_on_device(&mut self.inner)
    }

    fn decided_on_device(&self) -> bool {
        Strategy::<M, B>::decided_on_device(&self.inner)
    }
}
