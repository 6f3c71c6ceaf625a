//! Tensor parallelism inside a data-parallel strategy: [`TpRank`], one rank's part of a model
//! cut over its tensor-parallel group (`parallel.tp`), stepped by the strategy of its data
//! dimension (`single`, `ddp`, `zero1`–`zero3`) over the ranks that hold the same part.
//!
//! The mesh puts a group's ranks side by side: ranks `g·tp .. (g+1)·tp` are group `g`, and the
//! ranks at the same place of every group are one data-parallel group, which the strategy
//! inside reduces over. Every rank of a group takes the same batch. The model's forward runs
//! with the group as its thread's ([`kiln_models::tp::with_group`]), so its column- and
//! row-parallel Linears exchange what Megatron's `f` and `g` exchange; the strategy inside sees
//! a model whose cut parameters are the rank's parts and steps them as any parameters. What
//! leaves a rank is whole: [`Strategy::full_model`] gathers every part over the group, the
//! optimizer state is gathered to its canonical (one device's) layout and cut again when it
//! is loaded, so checkpoints know nothing of the mesh.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kiln_models::StepOutput;
use kiln_models::tp::{Split, TpGroup, part_of_values, reshape, whole_of_values, with_group};

use super::memory::Memory;
use super::rules::{Dimension, Setup};
use super::step::{Report, Strategy};
use crate::comm::{Collective, ReduceOp};
use crate::error::{Error, Result};
use crate::optim::{Cut, OptimState, Share, Source, part_name, path_of};
use crate::precision::LossScaler;

/// The tensor dimension of the mesh (`parallel.tp`): groups of neighbouring ranks that each
/// hold a part of every cut parameter, around the data dimension's strategy.
pub struct Tensor;

impl Dimension for Tensor {
    fn size(&self, setup: &Setup) -> usize {
        setup.tp
    }

    fn check(&self, setup: &Setup) -> Result<()> {
        if !setup.ranks.is_multiple_of(setup.tp) {
            return Err(Error::config(format!(
                "key `parallel.tp`: {} tensor-parallel ranks per group must divide the run's {} \
                ranks (devices × processes)",
                setup.tp, setup.ranks
            )));
        }
        if !setup.rules().same_step() {
            return Err(Error::config(format!(
                "key `parallel.tp`: tensor parallelism runs inside single, ddp, zero1-3 and \
                 pipeline stages; \
                it is not composed with {:?} (set parallel.tp = 1, or another strategy)",
                setup.name()
            )));
        }
        Ok(())
    }

    fn describe(&self, setup: &Setup, inside: String) -> String {
        format!(
            "tensor parallelism in groups of {} neighbouring devices (each block's Linear \
             pairs split by columns, then rows), {} group{} under {inside}",
            setup.tp,
            setup.world,
            if setup.world == 1 { "" } else { "s" }
        )
    }

    fn batch_line(
        &self,
        setup: &Setup,
        batch: usize,
        accumulate: usize,
        per_step: usize,
    ) -> String {
        // Every rank of a group (and every stage of a pipeline of them) takes its replica's
        // batch.
        let stages = setup.stages();
        let replicas = setup.world / stages;
        let pp = if stages > 1 {
            format!(" × {stages} stages")
        } else {
            String::new()
        };
        format!(
            "{batch} per replica (tp {}{pp}) × {replicas} replica{} × {accumulate} \
             accumulation = {per_step} per step",
            setup.tp,
            if replicas == 1 { "" } else { "s" }
        )
    }
}

/// A collective as a model's forward sees its tensor-parallel group, timing its all-reduces
/// (the step's synchronisation).
pub struct TpComm {
    comm: Arc<dyn Collective>,
    nanos: AtomicU64,
    /// Floats all-reduced since the last report.
    floats: AtomicU64,
}

impl TpComm {
    /// The group `comm`.
    pub fn new(comm: Arc<dyn Collective>) -> Self {
        Self {
            comm,
            nanos: AtomicU64::new(0),
            floats: AtomicU64::new(0),
        }
    }

    /// Seconds in the group's all-reduces since the last call.
    fn take_seconds(&self) -> f64 {
        self.nanos.swap(0, Ordering::Relaxed) as f64 * 1e-9
    }
}

impl TpGroup for TpComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> std::result::Result<(), String> {
        let started = Instant::now();
        let done = self
            .comm
            .all_reduce(data, ReduceOp::Sum)
            .map_err(|e| e.to_string());
        let nanos = started.elapsed().as_nanos() as u64;
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
        self.floats.fetch_add(data.len() as u64, Ordering::Relaxed);
        done
    }
}

/// A rank's tensor-parallel group as its strategy sees it: the group, and which parameters
/// are cut over it (by path; the others are whole on every rank of the group).
#[derive(Clone)]
pub struct TpPlace<'a> {
    /// The group: the neighbouring ranks that hold the other parts.
    pub comm: &'a dyn Collective,
    /// The same group as the model's forward sees it.
    pub group: Arc<TpComm>,
    /// Each float parameter's path and split, in module order.
    pub splits: Arc<Vec<(String, Split)>>,
}

impl TpPlace<'_> {
    /// How the parameter at `path` is held over the group (whole where the model says
    /// nothing of it).
    pub fn split_of(&self, path: &str) -> Split {
        self.splits
            .iter()
            .find(|(p, _)| p == path)
            .map_or(Split::Whole, |(_, s)| *s)
    }

    /// Whether the parameter at `path` is cut over the group (not whole on every rank).
    pub fn is_cut(&self, path: &str) -> bool {
        self.split_of(path).is_cut()
    }

    /// `state` (a canonical optimizer state) cut to this rank's part of every parameter.
    fn cut_state(&self, state: &mut OptimState) -> Result<()> {
        let (rank, size) = (self.comm.rank(), self.comm.world_size());
        for (path, leaf, shape, values) in &mut state.tensors {
            let split = self.split_of(path);
            let (part, part_shape) =
                part_of_values(values, shape, split, rank, size).map_err(|e| {
                    Error::checkpoint(format!(
                        "the optimizer state's `{path}` ({leaf}) cannot be cut over {size} \
                         tensor-parallel ranks: {e}"
                    ))
                })?;
            *values = part;
            *shape = part_shape;
        }
        Ok(())
    }

    /// Whether the parameter at `path` is whole on every rank with a part of its gradient on
    /// each, summed over the group before the step.
    pub fn is_summed(&self, path: &str) -> bool {
        self.split_of(path) == Split::Summed
    }
}

/// A sharded checkpoint as a rank of a tensor-parallel group reads it: each cut tensor is the
/// rank's part of it (its own part when the checkpoint was written by a group of this size,
/// else cut from the whole the parts make).
struct PartsOf<'s, 'a> {
    source: &'s dyn Source,
    place: &'s TpPlace<'a>,
}

impl PartsOf<'_, '_> {
    fn place(&self) -> (usize, usize) {
        (self.place.comm.rank(), self.place.comm.world_size())
    }

    /// Tensor `tensor`'s part on this rank, whole.
    fn part(&self, tensor: &str, split: Split) -> Result<Vec<f32>> {
        let (index, of) = self.place();
        let own = part_name(tensor, index, of);
        if let Some(shape) = self.source.shape(&own) {
            return self.source.read(&own, 0..shape.iter().product());
        }
        let shape = self.source.shape(tensor).ok_or_else(|| {
            Error::checkpoint(format!("the checkpoint holds no tensor `{tensor}`"))
        })?;
        let whole = self.source.read(tensor, 0..shape.iter().product())?;
        part_of_values(&whole, &shape, split, index, of)
            .map(|(part, _)| part)
            .map_err(|e| {
                Error::checkpoint(format!(
                    "the checkpoint's `{tensor}` cannot be cut over {of} tensor-parallel ranks: \
                     {e}"
                ))
            })
    }
}

impl Source for PartsOf<'_, '_> {
    fn read(&self, tensor: &str, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let split = self.place.split_of(path_of(tensor));
        if !split.is_cut() {
            return self.source.read(tensor, range);
        }
        let part = self.part(tensor, split)?;
        part.get(range.clone()).map(<[f32]>::to_vec).ok_or_else(|| {
            Error::checkpoint(format!(
                "the checkpoint's part of `{tensor}` has {} elements, not {range:?}",
                part.len()
            ))
        })
    }

    fn holds(&self, tensor: &str) -> bool {
        self.source.holds(tensor)
    }

    fn shape(&self, tensor: &str) -> Option<Vec<usize>> {
        let mut shape = self.source.shape(tensor)?;
        if let Some(dim) = self.place.split_of(path_of(tensor)).cut_dim() {
            *shape.get_mut(dim)? /= self.place().1;
        }
        Some(shape)
    }

    fn optimizer(
        &self,
        group: &str,
    ) -> Option<(crate::config::OptimizerKind, crate::optim::Scalars)> {
        self.source.optimizer(group)
    }

    fn leaves(&self, group: &str) -> Vec<String> {
        self.source.leaves(group)
    }

    fn canonical(&self, group: &str) -> Result<OptimState> {
        let mut state = self.source.canonical(group)?;
        self.place.cut_state(&mut state)?;
        Ok(state)
    }
}

/// One rank of a tensor-parallel group around the strategy that steps its part.
pub(crate) struct TpRank<'a, M, B> {
    inner: Box<dyn Strategy<M, B> + 'a>,
    /// The group (for gathering parts, and as the forward sees it) and the model's split.
    place: TpPlace<'a>,
    /// Steps begun since the last report, and the forwards' and backwards' seconds in the
    /// group's all-reduces over them.
    steps: usize,
    seconds: f64,
}

impl<'a, M, B> TpRank<'a, M, B> {
    /// `inner`, the strategy stepping this rank's part, at `place` in its group.
    pub(crate) fn new(inner: Box<dyn Strategy<M, B> + 'a>, place: TpPlace<'a>) -> Self {
        Self {
            inner,
            place,
            steps: 0,
            seconds: 0.0,
        }
    }

    /// The whole of each part over the group: every rank's part of `values` (shape
    /// `shape`) gathered, in rank order, and joined as `split` says.
    fn whole(
        &self,
        split: Split,
        values: Vec<f32>,
        shape: &[usize],
    ) -> std::result::Result<(Vec<f32>, Vec<usize>), String> {
        let n = values.len();
        let all = self
            .place
            .comm
            .all_gather(&values)
            .map_err(|e| e.to_string())?;
        let parts: Vec<Vec<f32>> = all.chunks(n.max(1)).map(<[f32]>::to_vec).collect();
        whole_of_values(&parts, shape, split)
    }
}

impl<'a, M: burn::module::Module, B> Strategy<M, B> for TpRank<'a, M, B> {
    fn begin_step(&mut self) -> Result<()> {
        self.steps += 1;
        self.inner.begin_step()
    }

    fn micro_steps(
        &mut self,
        batches: &mut dyn Iterator<Item = Result<B>>,
        count: usize,
        objective: &dyn Fn(burn::prelude::Tensor<1>) -> burn::prelude::Tensor<1>,
    ) -> Result<Vec<StepOutput>> {
        let group: Arc<dyn TpGroup> = self.place.group.clone();
        let inner = &mut self.inner;
        let outs = with_group(Some(group), || inner.micro_steps(batches, count, objective))?;
        // Every rank of the group scored the same samples: its first reports them.
        Ok(if self.place.comm.rank() == 0 {
            outs
        } else {
            Vec::new()
        })
    }

    fn takes_batches(&self) -> bool {
        self.inner.takes_batches()
    }

    fn optimizer_step(
        &mut self,
        lr: f64,
        scaler: Option<&mut LossScaler>,
        clip: Option<f64>,
    ) -> Result<bool> {
        self.inner.optimizer_step(lr, scaler, clip)
    }

    fn full_model(&mut self) -> Result<M> {
        let part = self.inner.full_model()?;
        let splits = self.place.splits.clone();
        reshape(part, &splits, &mut |_, split, values, shape| {
            self.whole(split, values, shape)
        })
        .map_err(|e| Error::Worker(format!("tensor parallelism: gathering the model: {e}")))
    }

    fn optimizer_state(&mut self) -> Result<Option<OptimState>> {
        // The ranks of a group share their place in the data dimension, so they all hold
        // their part's state, or none do.
        let Some(mut state) = self.inner.optimizer_state()? else {
            return Ok(None);
        };
        for i in 0..state.tensors.len() {
            let (path, _, shape, values) = &state.tensors[i];
            let split = self.place.split_of(path);
            if !split.is_cut() {
                continue;
            }
            let (whole, shape) = self
                .whole(split, values.clone(), shape)
                .map_err(|e| Error::Worker(format!("tensor parallelism: `{path}`: {e}")))?;
            state.tensors[i].2 = shape;
            state.tensors[i].3 = whole;
        }
        Ok((self.place.comm.rank() == 0).then_some(state))
    }

    fn load_optimizer_state(&mut self, state: &OptimState) -> Result<()> {
        let mut mine = state.clone();
        self.place.cut_state(&mut mine)?;
        self.inner.load_optimizer_state(&mine)
    }

    fn checkpoint_share(&mut self) -> Result<Share>
    where
        M: burn::module::Module,
    {
        let (index, of) = (self.place.comm.rank(), self.place.comm.world_size());
        let mut share = self.inner.checkpoint_share()?;
        let mut kept = Vec::with_capacity(share.pieces.len());
        for mut piece in std::mem::take(&mut share.pieces) {
            let split = self.place.split_of(path_of(&piece.tensor));
            match split.cut_dim() {
                Some(dim) => {
                    let mut whole = piece.shape.clone();
                    whole[dim] *= of;
                    piece.cut = Some(Cut {
                        index,
                        of,
                        split,
                        whole,
                    });
                    piece.tensor = part_name(&piece.tensor, index, of);
                    kept.push(piece);
                }
                // Whole on every rank of the group: its first writes it.
                None if index == 0 => kept.push(piece),
                None => {}
            }
        }
        share.pieces = kept;
        if index != 0 {
            share.rest = None;
            share.optimizers = None;
        }
        Ok(share)
    }

    fn load_optimizer_shards(&mut self, source: &dyn Source, groups: &[String]) -> Result<()> {
        let parts = PartsOf {
            source,
            place: &self.place,
        };
        self.inner.load_optimizer_shards(&parts, groups)
    }

    fn select_group(&mut self, group: usize) -> Result<()> {
        self.inner.select_group(group)
    }

    fn check_replicas(&mut self, step: usize) -> Result<()> {
        self.inner.check_replicas(step)
    }

    fn report(&mut self) -> Result<Report> {
        // What the group's forwards and backwards exchanged, per step since the last line.
        let mut report = self.inner.report()?;
        let steps = std::mem::take(&mut self.steps).max(1) as f64;
        let floats = self.place.group.floats.swap(0, Ordering::Relaxed) as f64;
        let seconds = std::mem::take(&mut self.seconds);
        report.fields.push((
            "tp_floats_per_step".into(),
            serde_json::json!(floats / steps),
        ));
        report.fields.push((
            "tp_seconds_per_step".into(),
            serde_json::json!(seconds / steps),
        ));
        Ok(report)
    }

    fn memory(&self) -> Memory {
        self.inner.memory()
    }

    fn take_sync_seconds(&mut self) -> f64 {
        let group = self.place.group.take_seconds();
        self.seconds += group;
        self.inner.take_sync_seconds() + group
    }

    fn nonfinite(&self) -> bool {
        self.inner.nonfinite()
    }

    fn skipped_on_device(&mut self) -> Result<Vec<usize>> {
        self.inner.skipped_on_device()
    }

    fn decided_on_device(&self) -> bool {
        self.inner.decided_on_device()
    }
}

/// Rank 0's part of `model` in a tensor-parallel group of `tp` ranks, where the model says
/// how it is cut and can be (what the start-up table's memory line and the checks read); the
/// model as it is otherwise, which the start-up checks then refuse.
pub fn rank_part<B, M: kiln_models::BlockStack<B> + burn::module::Module>(
    model: M,
    tp: usize,
) -> M {
    match part_if_cut::<B, M>(&model, tp) {
        Some(part) => part,
        None => model,
    }
}

/// Rank 0's part of `model` in a group of `tp` ranks (`tp` = 1: the model itself), or `None`
/// where the model does not say how it is cut, refuses that many ranks, or holds a weight
/// that cannot be cut (a quantized base).
pub fn part_if_cut<B, M: kiln_models::BlockStack<B> + burn::module::Module>(
    model: &M,
    tp: usize,
) -> Option<M> {
    if tp <= 1 {
        return Some(model.clone());
    }
    let splits = model
        .tensor_parallel()
        .filter(|t| t.tp_check(tp).is_ok())
        .map(|t| kiln_models::tp::splits_of(model, t, tp))?;
    kiln_models::tp::cut_by(model.clone(), &splits, 0, tp).ok()
}

/// A rank's groups in a mesh with tensor parallelism: its tensor-parallel group (the `tp`
/// neighbouring ranks `g·tp .. (g+1)·tp`) and its data-parallel group (the ranks at its place
/// in every tensor-parallel group).
pub struct Mesh {
    group: Arc<dyn Collective>,
    data: Box<dyn Collective>,
}

impl Mesh {
    /// This rank's groups in `comm` with tensor-parallel groups of `tp` ranks; `None` for
    /// `tp = 1`. Every rank of `comm` splits alike.
    pub fn split(comm: &dyn Collective, tp: usize) -> Result<Option<Mesh>> {
        if tp <= 1 {
            return Ok(None);
        }
        let rank = comm.rank();
        let group: Arc<dyn Collective> = Arc::from(comm.split(rank / tp, rank % tp)?);
        let data = comm.split(rank % tp, rank / tp)?;
        Ok(Some(Mesh { group, data }))
    }

    /// The data-parallel group: what the strategy of the data dimension reduces over.
    pub fn data(&self) -> &dyn Collective {
        self.data.as_ref()
    }

    /// The rank's place in its tensor-parallel group for `model` (whole: its split is read
    /// from it), or a one-line refusal for a model that does not say how it is cut.
    pub fn place<B, M>(&self, model: &M) -> Result<TpPlace<'_>>
    where
        M: kiln_models::BlockStack<B> + burn::module::Module,
    {
        let Some(tp) = model.tensor_parallel() else {
            return Err(Error::config(
                "key `parallel.tp`: the model does not say how it is cut over \
                 tensor-parallel ranks (its BlockStack::tensor_parallel is None)"
                    .to_string(),
            ));
        };
        let size = self.group.world_size();
        Ok(TpPlace {
            comm: self.group.as_ref(),
            group: Arc::new(TpComm::new(self.group.clone())),
            splits: Arc::new(kiln_models::tp::splits_of(model, tp, size)),
        })
    }
}
