//! A group split from a hierarchical one: the new group's ranks in each process, and the
//! MPI communicator of the processes that host it, made by its lead and handed to the others.

use mpi::topology::Color;
use mpi::traits::*;

use super::group::Hier;
use super::group::mix;
use super::runtime::{Comm, STATE};
use crate::comm::collective::Collective;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

impl Hier {
    pub(super) fn split_group(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        let all = self.all_gather(&[color as f32, key as f32])?;
        let number = self.splits.fetch_add(1, Ordering::SeqCst);
        let local = self.local.split(color, key)?;
        let mut members: Vec<(usize, usize)> = (0..self.world)
            .filter(|g| all[2 * g] as usize == color)
            .map(|g| (all[2 * g + 1] as usize, g))
            .collect();
        members.sort_unstable();
        let members: Vec<usize> = members.into_iter().map(|(_, g)| g).collect();
        let rank = members
            .iter()
            .position(|g| *g == self.rank)
            .expect("a rank is in its own color");
        let mut colors: Vec<usize> = (0..self.world).map(|g| all[2 * g] as usize).collect();
        colors.sort_unstable();
        colors.dedup();
        let id_of = |c: usize| mix(self.id, number, c);
        let state = STATE
            .get()
            .ok_or_else(|| Error::Device("MPI is not initialised".into()))?;
        // The leads split the hosting processes' communicator once per color, in color order,
        // and hand each new communicator to the ranks of their process.
        if self.lead() {
            for &c in &colors {
                let hosts = (0..self.world)
                    .any(|g| all[2 * g] as usize == c && self.local_index_of[g].is_some());
                let procs_of_c: Vec<usize> = {
                    let mut p: Vec<usize> = (0..self.world)
                        .filter(|g| all[2 * g] as usize == c)
                        .map(|g| self.proc_of[g])
                        .collect();
                    p.sort_unstable();
                    p.dedup();
                    p
                };
                let comm = match self.spanning() {
                    Some(parent) => {
                        let me = self.proc_of[self.rank] as i32;
                        let color = if hosts {
                            Color::with_value(0)
                        } else {
                            Color::undefined()
                        };
                        parent
                            .0
                            .split_by_color_with_key(color, me)
                            .filter(|_| procs_of_c.len() > 1)
                            .map(|c| Arc::new(Comm(c)))
                    }
                    None => None,
                };
                if hosts {
                    let mut registry = state.registry.lock().unwrap_or_else(|p| p.into_inner());
                    registry.insert(id_of(c), comm);
                    state.registered.notify_all();
                }
            }
        }
        let id = id_of(color);
        let mpi = {
            let mut registry = state.registry.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(comm) = registry.get(&id) {
                    break comm.clone();
                }
                registry = state
                    .registered
                    .wait(registry)
                    .unwrap_or_else(|p| p.into_inner());
            }
        };
        // The new group's processes, in the order of the parent's: ranks in that communicator.
        let mut procs: Vec<usize> = members.iter().map(|g| self.proc_of[*g]).collect();
        procs.sort_unstable();
        procs.dedup();
        let proc_of = members
            .iter()
            .map(|g| {
                procs
                    .iter()
                    .position(|p| *p == self.proc_of[*g])
                    .expect("listed")
            })
            .collect();
        let mut next_local = 0;
        let local_index_of = members
            .iter()
            .map(|g| {
                self.local_index_of[*g].map(|_| {
                    next_local += 1;
                    next_local - 1
                })
            })
            .collect();
        Ok(Box::new(Hier {
            rank,
            world: members.len(),
            id,
            local,
            local_index_of,
            proc_of,
            procs: procs.len(),
            mpi,
            splits: AtomicU64::new(0),
            senders: Mutex::new(HashMap::new()),
        }))
    }
}
