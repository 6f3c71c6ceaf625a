//! The in-process group: one rank per worker thread, sharing memory.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use kiln_models::Activation;

use super::collective::{Collective, ReduceOp, chunk_range, reduce_scatter_widened};
use crate::error::{Error, Result};

struct Round {
    generation: u64,
    arrived: usize,
    slots: Vec<Vec<f32>>,
    result: Arc<Vec<f32>>,
    aborted: Option<String>,
}

struct Shared {
    world: usize,
    round: Mutex<Round>,
    changed: Condvar,
}

impl Shared {
    fn new(world: usize) -> Arc<Self> {
        Arc::new(Shared {
            world,
            round: Mutex::new(Round {
                generation: 0,
                arrived: 0,
                slots: vec![Vec::new(); world],
                result: Arc::new(Vec::new()),
                aborted: None,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        // A worker that panicked while holding the lock cannot leave the round half-updated in
        // a way that matters: the group is aborted right after, so recover the guard.
        self.round.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What a root group and every group split from it share: the groups themselves (so that an
/// abort reaches all of them), the registry that lets the members of a split find the same
/// new group, and the mailboxes of point-to-point messages (keyed by global ranks).
struct Family {
    groups: Mutex<Vec<Arc<Shared>>>,
    splits: Mutex<HashMap<(usize, u64, usize), Arc<Shared>>>,
    mail: Mutex<Mail>,
    delivered: Condvar,
}

#[derive(Default)]
struct Mail {
    queues: HashMap<(usize, usize), VecDeque<Activation>>,
    aborted: Option<String>,
}

impl Family {
    fn mail(&self) -> MutexGuard<'_, Mail> {
        self.mail.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Creates an in-process group of `world` ranks: one [`LocalComm`] for each worker thread.
pub fn local_group(world: usize) -> Vec<LocalComm> {
    assert!(world > 0, "a group needs at least one rank");
    let shared = Shared::new(world);
    let family = Arc::new(Family {
        groups: Mutex::new(vec![shared.clone()]),
        splits: Mutex::new(HashMap::new()),
        mail: Mutex::new(Mail::default()),
        delivered: Condvar::new(),
    });
    let members: Arc<Vec<usize>> = Arc::new((0..world).collect());
    (0..world)
        .map(|rank| LocalComm {
            rank,
            shared: shared.clone(),
            family: family.clone(),
            members: members.clone(),
            splits: AtomicU64::new(0),
        })
        .collect()
}

/// One rank's handle on a group made by [`local_group`] or split from one.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
    family: Arc<Family>,
    /// The global rank (in the root group) of each of this group's ranks.
    members: Arc<Vec<usize>>,
    /// Splits this rank has made of this group (every member makes them in the same order).
    splits: AtomicU64,
}

impl LocalComm {
    fn lock(&self) -> MutexGuard<'_, Round> {
        self.shared.lock()
    }

    /// Every rank deposits `contribution`; the last to arrive computes the result from all
    /// contributions (indexed by rank) with `combine`; every rank gets that result.
    fn exchange(
        &self,
        contribution: Vec<f32>,
        combine: impl FnOnce(&mut [Vec<f32>]) -> Vec<f32>,
    ) -> Result<Arc<Vec<f32>>> {
        let mut round = self.lock();
        if let Some(reason) = &round.aborted {
            return Err(Error::Worker(reason.clone()));
        }
        round.slots[self.rank] = contribution;
        round.arrived += 1;
        let generation = round.generation;
        if round.arrived == self.shared.world {
            let result = combine(&mut round.slots);
            round.result = Arc::new(result);
            round.arrived = 0;
            round.generation += 1;
            self.shared.changed.notify_all();
            return Ok(round.result.clone());
        }
        while round.generation == generation {
            if let Some(reason) = &round.aborted {
                return Err(Error::Worker(reason.clone()));
            }
            round = self
                .shared
                .changed
                .wait(round)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        Ok(round.result.clone())
    }
}

fn reduce(slots: &mut [Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let world = slots.len();
    let mut acc = std::mem::take(&mut slots[0]);
    for other in slots.iter().skip(1) {
        assert_eq!(
            other.len(),
            acc.len(),
            "all ranks must reduce buffers of one length"
        );
        for (a, b) in acc.iter_mut().zip(other) {
            *a += *b;
        }
    }
    if op == ReduceOp::Mean && world > 1 {
        let inv = world as f32;
        for a in &mut acc {
            *a /= inv;
        }
    }
    acc
}

impl Collective for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce(&self, data: &mut [f32], op: ReduceOp) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let result = self.exchange(data.to_vec(), |slots| reduce(slots, op))?;
        data.copy_from_slice(&result);
        Ok(())
    }

    fn all_reduce_bf16(&self, data: &mut [burn::tensor::bf16], op: ReduceOp) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        // Threads share memory, so the in-process exchange carries the bf16 values widened to
        // f32 (exactly); a transport between processes sends the bf16 bytes.
        let wide: Vec<f32> = data.iter().map(|x| x.to_f32()).collect();
        let result = self.exchange(wide, |slots| reduce(slots, op))?;
        for (d, r) in data.iter_mut().zip(result.iter()) {
            *d = burn::tensor::bf16::from_f32(*r);
        }
        Ok(())
    }

    fn broadcast(&self, data: &mut Vec<f32>, root: usize) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let mine = if self.rank == root {
            data.clone()
        } else {
            Vec::new()
        };
        let result = self.exchange(mine, |slots| std::mem::take(&mut slots[root]))?;
        data.clear();
        data.extend_from_slice(&result);
        Ok(())
    }

    fn all_gather(&self, data: &[f32]) -> Result<Vec<f32>> {
        let result = self.exchange(data.to_vec(), |slots| slots.concat())?;
        Ok(result.to_vec())
    }

    fn reduce_scatter(&self, data: &[f32], op: ReduceOp) -> Result<Vec<f32>> {
        let result = self.exchange(data.to_vec(), |slots| reduce(slots, op))?;
        Ok(result[chunk_range(result.len(), self.shared.world, self.rank)].to_vec())
    }

    fn reduce_scatter_bf16(
        &self,
        data: &[burn::tensor::bf16],
        op: ReduceOp,
    ) -> Result<Vec<burn::tensor::bf16>> {
        // As `all_reduce_bf16`: threads share memory, so the values travel widened.
        reduce_scatter_widened(self, data, op)
    }

    fn barrier(&self) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        self.exchange(Vec::new(), |_| Vec::new()).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        // Every group of the family stops: a rank may be waiting in any of them.
        let groups = self
            .family
            .groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for group in groups {
            let mut round = group.lock();
            if round.aborted.is_none() {
                round.aborted = Some(reason.to_string());
            }
            group.changed.notify_all();
        }
        let mut mail = self.family.mail();
        if mail.aborted.is_none() {
            mail.aborted = Some(reason.to_string());
        }
        self.family.delivered.notify_all();
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        let mine = [color as f32, key as f32, self.rank as f32];
        let all = self.all_gather(&mine)?;
        let mut same: Vec<(usize, usize)> = all
            .chunks(3)
            .filter(|c| c[0] as usize == color)
            .map(|c| (c[1] as usize, c[2] as usize))
            .collect();
        same.sort_unstable();
        let ranks: Vec<usize> = same.iter().map(|(_, r)| *r).collect();
        let rank = ranks
            .iter()
            .position(|r| *r == self.rank)
            .expect("a rank is in its own color");
        let number = self.splits.fetch_add(1, Ordering::SeqCst);
        let id = (Arc::as_ptr(&self.shared) as usize, number, color);
        let shared = {
            let mut splits = self.family.splits.lock().unwrap_or_else(|p| p.into_inner());
            splits
                .entry(id)
                .or_insert_with(|| {
                    let group = Shared::new(ranks.len());
                    self.family
                        .groups
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(group.clone());
                    group
                })
                .clone()
        };
        // A group split after an abort starts aborted.
        if let Some(reason) = self.lock().aborted.clone() {
            shared.lock().aborted.get_or_insert(reason);
        }
        Ok(Box::new(LocalComm {
            rank,
            shared,
            family: self.family.clone(),
            members: Arc::new(ranks.iter().map(|r| self.members[*r]).collect()),
            splits: AtomicU64::new(0),
        }))
    }

    fn send(&self, to: usize, value: Activation) -> Result<()> {
        let key = (self.members[self.rank], self.members[to]);
        let mut mail = self.family.mail();
        if let Some(reason) = &mail.aborted {
            return Err(Error::Worker(reason.clone()));
        }
        mail.queues.entry(key).or_default().push_back(value);
        self.family.delivered.notify_all();
        Ok(())
    }

    fn recv(&self, from: usize) -> Result<Activation> {
        let key = (self.members[from], self.members[self.rank]);
        let mut mail = self.family.mail();
        loop {
            if let Some(reason) = &mail.aborted {
                return Err(Error::Worker(reason.clone()));
            }
            if let Some(value) = mail.queues.get_mut(&key).and_then(VecDeque::pop_front) {
                return Ok(value);
            }
            mail = self
                .family
                .delivered
                .wait(mail)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(world: usize, f: impl Fn(LocalComm) -> T + Sync) -> Vec<T> {
        let comms = local_group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_mean_and_sum_agree_on_every_rank() {
        let out = run(3, |c| {
            let mut v = vec![c.rank() as f32, 1.0];
            c.all_reduce(&mut v, ReduceOp::Mean).unwrap();
            let mut s = vec![c.rank() as f32 + 1.0];
            c.all_reduce(&mut s, ReduceOp::Sum).unwrap();
            (v, s)
        });
        for (v, s) in out {
            assert_eq!(v, vec![1.0, 1.0]);
            assert_eq!(s, vec![6.0]);
        }
    }

    #[test]
    fn many_rounds_in_a_row_stay_in_step() {
        let out = run(4, |c| {
            let mut total = 0.0;
            for i in 0..200 {
                let mut v = vec![(c.rank() * i) as f32];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                total += v[0];
            }
            total
        });
        let expected: f32 = (0..200).map(|i| (6 * i) as f32).sum();
        assert!(out.iter().all(|&t| t == expected));
    }

    #[test]
    fn broadcast_gather_scatter_barrier() {
        let out = run(3, |c| {
            let mut b = if c.rank() == 1 {
                vec![7.0, 8.0]
            } else {
                vec![]
            };
            c.broadcast(&mut b, 1).unwrap();
            let g = c.all_gather(&[c.rank() as f32]).unwrap();
            let rs = c.reduce_scatter(&[1.0; 7], ReduceOp::Sum).unwrap();
            c.barrier().unwrap();
            (b, g, rs)
        });
        for (rank, (b, g, rs)) in out.into_iter().enumerate() {
            assert_eq!(b, vec![7.0, 8.0]);
            assert_eq!(g, vec![0.0, 1.0, 2.0]);
            assert_eq!(rs.len(), chunk_range(7, 3, rank).len());
            assert!(rs.iter().all(|&x| x == 3.0));
        }
    }

    #[test]
    fn abort_wakes_every_waiting_rank_with_the_reason() {
        let out = run(3, |c| {
            if c.rank() == 2 {
                c.abort("rank 2 failed: boom");
                return Err(Error::Worker("aborted".into()));
            }
            c.barrier()
        });
        for r in &out[..2] {
            let e = r.clone().unwrap_err().to_string();
            assert!(e.contains("rank 2 failed: boom"), "{e}");
        }
    }

    #[test]
    fn split_groups_reduce_apart_and_messages_keep_their_order() {
        use burn::prelude::*;
        let out = run(4, |c| {
            // Colors by parity: {0, 2} and {1, 3}, ranked by descending global rank.
            let sub = c.split(c.rank() % 2, 10 - c.rank()).unwrap();
            let mut v = vec![c.rank() as f32];
            sub.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            // A pipeline of the whole group: rank r sends two messages to r + 1.
            let device = Device::flex();
            let t = |x: f32| Activation::Rank2(Tensor::<2>::full([1, 1], x, &device));
            if c.rank() + 1 < 4 {
                c.send(c.rank() + 1, t(c.rank() as f32)).unwrap();
                c.send(c.rank() + 1, t(10.0 + c.rank() as f32)).unwrap();
            }
            let got = (c.rank() > 0).then(|| {
                let first = c
                    .recv(c.rank() - 1)
                    .unwrap()
                    .into_rank::<2>()
                    .into_scalar::<f32>();
                let second = c
                    .recv(c.rank() - 1)
                    .unwrap()
                    .into_rank::<2>()
                    .into_scalar::<f32>();
                (first, second)
            });
            (sub.rank(), sub.world_size(), v[0], got)
        });
        assert_eq!(out[0], (1, 2, 2.0, None));
        assert_eq!(out[2], (0, 2, 2.0, Some((1.0, 11.0))));
        assert_eq!(out[1], (1, 2, 4.0, Some((0.0, 10.0))));
        assert_eq!(out[3].2, 4.0);
    }

    #[test]
    fn an_abort_wakes_a_receiver_and_the_ranks_of_split_groups() {
        let out = run(3, |c| {
            let sub = c.split(0, c.rank()).unwrap();
            match c.rank() {
                0 => {
                    c.abort("rank 0 failed: boom");
                    Err(Error::Worker("aborted".into()))
                }
                1 => c.recv(2).map(|_| ()),
                _ => sub.barrier(),
            }
        });
        for r in &out[1..] {
            let e = r.clone().unwrap_err().to_string();
            assert!(e.contains("rank 0 failed: boom"), "{e}");
        }
    }
}
