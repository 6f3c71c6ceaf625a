//! [`Watched`]: a group whose collectives are numbered, recorded and watched.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_models::Activation;

use super::recorder::Recorder;
use super::shared::Shared;
use crate::comm::collective::{Collective, ReduceOp};
use crate::comm::pack;
use crate::comm::watch::recorder::Entry;
use crate::comm::watch::recorder::now;
use crate::error::{Error, Result};
use std::time::Instant;

/// A group whose collectives are numbered, recorded and watched; see the module
/// documentation.
pub struct Watched {
    inner: Arc<dyn Collective>,
    recorder: Arc<Recorder>,
    shared: Arc<Shared>,
    group: Arc<str>,
    members: Arc<Vec<usize>>,
    /// Collectives of this group so far (the same count on every rank).
    seq: AtomicU64,
    /// Transfers this rank made in this group (numbered on their own: ranks make different
    /// numbers of them).
    transfers: AtomicU64,
    splits: AtomicU64,
}

/// A collective's signature as the ranks compare it: kind, sequence number, elements, dtype.
pub(super) fn signature(kind: &str, seq: u64, elements: usize, dtype: &str) -> [u64; 4] {
    let code = |s: &str| {
        s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        }) >> 16
    };
    [code(kind), seq, elements as u64, code(dtype)]
}

impl Watched {
    /// The watched world group of one rank: `inner`, recorded in `recorder`.
    pub(super) fn root(
        inner: Arc<dyn Collective>,
        recorder: Arc<Recorder>,
        shared: Arc<Shared>,
    ) -> Self {
        let world = inner.world_size();
        Watched {
            inner,
            recorder,
            shared,
            group: Arc::from("world"),
            members: Arc::new((0..world).collect()),
            seq: AtomicU64::new(0),
            transfers: AtomicU64::new(0),
            splits: AtomicU64::new(0),
        }
    }

    /// Runs `op` on the inner group as collective `kind` of `elements` `dtype` values: numbered,
    /// recorded, checked against the other ranks' signatures when asked.
    fn run<T>(
        &self,
        kind: &'static str,
        elements: usize,
        dtype: &'static str,
        peer: Option<usize>,
        op: impl FnOnce(&dyn Collective) -> Result<T>,
    ) -> Result<T> {
        let seq = match peer {
            Some(_) => self.transfers.fetch_add(1, Ordering::Relaxed),
            None => self.seq.fetch_add(1, Ordering::Relaxed),
        };
        self.recorder.enter(Entry {
            seq,
            kind,
            group: self.group.clone(),
            members: self.members.clone(),
            elements,
            dtype,
            peer: peer.map(|p| self.members[p]),
            start: now(),
            end: None,
            entered: Instant::now(),
        });
        let outcome = if self.shared.config.check && peer.is_none() {
            self.check(kind, seq, elements, dtype)
                .and_then(|()| op(&*self.inner))
        } else {
            op(&*self.inner)
        };
        self.recorder.leave();
        outcome
    }

    /// Fails if another rank of the group is about to run a different collective.
    fn check(&self, kind: &str, seq: u64, elements: usize, dtype: &str) -> Result<()> {
        if self.inner.world_size() == 1 {
            return Ok(());
        }
        let mine = signature(kind, seq, elements, dtype);
        let all = pack::gather_counts(&*self.inner, &mine)?;
        let Some((r, theirs)) = all.iter().enumerate().find(|(_, s)| **s != mine) else {
            return Ok(());
        };
        // The other rank's words: its kind and dtype are known only as codes, so name what
        // differs.
        let differs: Vec<String> = [
            ("kind", mine[0] != theirs[0]),
            ("sequence number", mine[1] != theirs[1]),
            ("elements", mine[2] != theirs[2]),
            ("dtype", mine[3] != theirs[3]),
        ]
        .iter()
        .filter(|(_, d)| *d)
        .map(|(w, _)| w.to_string())
        .collect();
        Err(Error::Worker(format!(
            "mismatched collectives in group {}: rank {} runs {kind} #{seq} of {elements} {dtype}, \
             rank {} runs #{} of {} elements; they differ in {} (dist.check_collectives)",
            self.group,
            self.members[self.inner.rank()],
            self.members[r],
            theirs[1],
            theirs[2],
            differs.join(" and ")
        )))
    }
}

impl Collective for Watched {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce(&self, data: &mut [f32], op: ReduceOp) -> Result<()> {
        self.run("all_reduce", data.len(), "f32", None, |c| {
            c.all_reduce(data, op)
        })
    }

    fn all_reduce_bf16(&self, data: &mut [burn::tensor::bf16], op: ReduceOp) -> Result<()> {
        self.run("all_reduce", data.len(), "bf16", None, |c| {
            c.all_reduce_bf16(data, op)
        })
    }

    fn broadcast(&self, data: &mut Vec<f32>, root: usize) -> Result<()> {
        // Only the root knows the length: the others' signatures say 0.
        let n = if self.inner.rank() == root {
            data.len()
        } else {
            0
        };
        let elements = if self.shared.config.check { 0 } else { n };
        self.run("broadcast", elements, "f32", None, |c| {
            c.broadcast(data, root)
        })
    }

    fn all_gather(&self, data: &[f32]) -> Result<Vec<f32>> {
        // Ranks may gather vectors of different lengths: the signature leaves the length out.
        let elements = if self.shared.config.check {
            0
        } else {
            data.len()
        };
        self.run("all_gather", elements, "f32", None, |c| c.all_gather(data))
    }

    fn reduce_scatter(&self, data: &[f32], op: ReduceOp) -> Result<Vec<f32>> {
        self.run("reduce_scatter", data.len(), "f32", None, |c| {
            c.reduce_scatter(data, op)
        })
    }

    fn reduce_scatter_bf16(
        &self,
        data: &[burn::tensor::bf16],
        op: ReduceOp,
    ) -> Result<Vec<burn::tensor::bf16>> {
        self.run("reduce_scatter", data.len(), "bf16", None, |c| {
            c.reduce_scatter_bf16(data, op)
        })
    }

    fn barrier(&self) -> Result<()> {
        self.run("barrier", 0, "none", None, |c| c.barrier())
    }

    fn abort(&self, reason: &str) {
        // What every rank was doing when the run failed is written before the group goes.
        self.shared.fail(reason);
        self.inner.abort(reason);
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        let number = self.splits.fetch_add(1, Ordering::Relaxed);
        let all = self.run("split", 2, "u64", None, |c| {
            pack::gather_counts(c, &[color as u64, key as u64])
        })?;
        let mut same: Vec<(u64, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, ck)| ck[0] == color as u64)
            .map(|(r, ck)| (ck[1], r))
            .collect();
        same.sort_unstable();
        let members = same.iter().map(|(_, r)| self.members[*r]).collect();
        let inner = self.run("split", 0, "none", None, |c| c.split(color, key))?;
        Ok(Box::new(Watched {
            inner: Arc::from(inner),
            recorder: self.recorder.clone(),
            shared: self.shared.clone(),
            group: Arc::from(format!("{}/split{number}:{color}", self.group)),
            members: Arc::new(members),
            seq: AtomicU64::new(0),
            transfers: AtomicU64::new(0),
            splits: AtomicU64::new(0),
        }))
    }

    fn send(&self, to: usize, value: Activation) -> Result<()> {
        let n = value.dims().iter().product();
        self.run("send", n, "activation", Some(to), |c| c.send(to, value))
    }

    fn recv(&self, from: usize) -> Result<Activation> {
        self.run("recv", 0, "activation", Some(from), |c| c.recv(from))
    }
}
