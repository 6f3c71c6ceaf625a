//! The collectives' seconds, measured on the spot: each primitive a strategy's step calls, at
//! the model's size, on a group of the run's ranks (in-process threads, or, once MPI runs,
//! the world's processes).

use std::time::Instant;

use crate::comm::{Collective, ReduceOp};
use crate::error::{Error, Result};

/// Seconds of one call of each collective over the whole model's floats, on the ranks.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Links {
    /// Ranks of the group measured.
    pub ranks: usize,
    /// Floats per call.
    pub floats: usize,
    /// An all-reduce of `floats`.
    pub all_reduce_s: f64,
    /// A reduce-scatter of `floats` (each rank keeps `floats / ranks`).
    pub reduce_scatter_s: f64,
    /// An all-gather into `floats` (each rank gives `floats / ranks`).
    pub all_gather_s: f64,
}

impl Links {
    /// Nothing to measure: one rank calls no collective.
    pub(crate) fn none(floats: usize) -> Self {
        Self {
            ranks: 1,
            floats,
            ..Self::default()
        }
    }

    /// Seconds of an all-reduce of `n` floats (linear in the size measured).
    pub(crate) fn all_reduce(&self, n: usize) -> f64 {
        self.all_reduce_s * self.scale(n)
    }

    /// Seconds of a reduce-scatter of `n` floats.
    pub(crate) fn reduce_scatter(&self, n: usize) -> f64 {
        self.reduce_scatter_s * self.scale(n)
    }

    /// Seconds of an all-gather into `n` floats.
    pub(crate) fn all_gather(&self, n: usize) -> f64 {
        self.all_gather_s * self.scale(n)
    }

    fn scale(&self, n: usize) -> f64 {
        n as f64 / self.floats.max(1) as f64
    }
}

/// Calls of each collective timed (after one untimed).
const CALLS: usize = 3;

/// Measures the collectives over `comms` (one per rank of this process, each on its own
/// thread) with `floats` floats.
pub(crate) fn measure(comms: Vec<Box<dyn Collective>>, floats: usize) -> Result<Links> {
    let ranks = comms.first().map_or(1, |c| c.world_size());
    if ranks < 2 {
        return Ok(Links::none(floats));
    }
    let n = floats.div_ceil(ranks) * ranks;
    let results: Vec<Result<[f64; 3]>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| scope.spawn(move || timed(comm.as_ref(), n)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Worker("a link probe thread died".into())))
            })
            .collect()
    });
    let mut worst = [0.0f64; 3];
    for r in results {
        let t = r?;
        for (w, t) in worst.iter_mut().zip(t) {
            *w = w.max(t);
        }
    }
    Ok(Links {
        ranks,
        floats: n,
        all_reduce_s: worst[0],
        reduce_scatter_s: worst[1],
        all_gather_s: worst[2],
    })
}

/// One rank's median seconds of each collective.
fn timed(comm: &dyn Collective, n: usize) -> Result<[f64; 3]> {
    let mut buf = vec![1.0f32; n];
    let piece = vec![1.0f32; n / comm.world_size()];
    let mut out = [0.0; 3];
    for (k, slot) in out.iter_mut().enumerate() {
        let mut times = Vec::with_capacity(CALLS);
        for call in 0..=CALLS {
            comm.barrier()?;
            let t0 = Instant::now();
            match k {
                0 => comm.all_reduce(&mut buf, ReduceOp::Sum)?,
                1 => drop(comm.reduce_scatter(&buf, ReduceOp::Sum)?),
                _ => drop(comm.all_gather(&piece)?),
            }
            if call > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        *slot = times[times.len() / 2];
    }
    Ok(out)
}
