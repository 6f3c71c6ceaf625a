//! The hierarchical group: the ranks of each process in-process, one lead per process on MPI.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use kiln_models::Activation;
use mpi::datatype::PartitionMut;
use mpi::raw::AsRaw;
use mpi::traits::*;

use super::ffi::{
    bf16_sum, bf16_sum_in_place, gather_into, join_len, split_len, sum_in_place, sum_scatter,
};
use super::ring::{add_bf16, add_f32};
use super::runtime::{Comm, STATE};
use crate::comm::collective::{Collective, ReduceOp, chunk_range, reduce_scatter_widened};
use crate::comm::local::local_group;
use crate::comm::mpi::runtime::say_once;
use crate::error::{Error, Result};

/// One group of the world for each of this process's `devices` device threads, the world
/// being every process's devices.
pub fn world_group(devices: usize) -> Result<Vec<Box<dyn Collective>>> {
    let state = STATE
        .get()
        .ok_or_else(|| Error::Device("MPI is not initialised".into()))?;
    // Every process must run the same number of devices: rank p·N + l is device l of p.
    let mut counts = vec![0u64; state.processes.count];
    state
        .world
        .0
        .all_gather_into(&(devices as u64), &mut counts[..]);
    if counts.iter().any(|c| *c != devices as u64) {
        return Err(Error::config(format!(
            "key `hardware.devices`: every process must run the same number of devices, got \
             {counts:?} across the processes"
        )));
    }
    // Every call makes a new world: its groups' ids must not meet an earlier world's.
    static WORLDS: AtomicU64 = AtomicU64::new(0);
    let id = mix(0, WORLDS.fetch_add(1, Ordering::SeqCst), usize::MAX);
    let p = state.processes.index;
    let world = state.processes.count * devices;
    let proc_of: Vec<usize> = (0..world).map(|g| g / devices).collect();
    let local_index_of: Vec<Option<usize>> = (0..world)
        .map(|g| (g / devices == p).then_some(g % devices))
        .collect();
    Ok(local_group(devices)
        .into_iter()
        .enumerate()
        .map(|(l, local)| {
            Box::new(Hier {
                rank: p * devices + l,
                world,
                id,
                local: Box::new(local),
                local_index_of: local_index_of.clone(),
                proc_of: proc_of.clone(),
                procs: state.processes.count,
                mpi: Some(state.world.clone()),
                splits: AtomicU64::new(0),
                senders: Mutex::new(HashMap::new()),
            }) as Box<dyn Collective>
        })
        .collect())
}

/// A group spread over processes; see the module documentation.
pub(super) struct Hier {
    pub(super) rank: usize,
    pub(super) world: usize,
    /// The same for every member, in every process: the key of sub-communicators handed from a
    /// lead to the other ranks of its process.
    pub(super) id: u64,
    /// The group's ranks in this process, in group order.
    pub(super) local: Box<dyn Collective>,
    /// Group rank → its index in `local`, for the ranks in this process.
    pub(super) local_index_of: Vec<Option<usize>>,
    /// Group rank → its process's rank in `mpi`.
    pub(super) proc_of: Vec<usize>,
    /// Processes that host the group.
    pub(super) procs: usize,
    /// The hosting processes' communicator (`None` when one process hosts the whole group).
    pub(super) mpi: Option<Arc<Comm>>,
    pub(super) splits: AtomicU64,
    /// A sending thread per destination in another process.
    pub(super) senders: Mutex<HashMap<usize, Sender<Message>>>,
}

/// An activation on its way to another process: its shape and dtype, and its values.
pub(super) struct Message {
    pub(super) header: Vec<i64>,
    pub(super) values: Vec<f32>,
}

impl Hier {
    pub(super) fn lead(&self) -> bool {
        self.local.rank() == 0
    }

    /// The MPI communicator, when the group spans processes.
    pub(super) fn spanning(&self) -> Option<&Comm> {
        self.mpi.as_deref().filter(|_| self.procs > 1)
    }

    /// The tag of activations from rank `from` to rank `to`: from 1 up, since the rings of
    /// the collectives use 0 (`ring::TAG`).
    pub(super) fn tag(&self, from: usize, to: usize) -> i32 {
        (1 + from * self.world + to) as i32
    }

    /// Whether a reduce-scatter of `len` values can hand each process one equal block: equal
    /// chunks, and every process hosting the same number of the group's ranks, consecutive
    /// and in the order of the processes' ranks in `mpi`.
    fn blocks_by_process(&self, len: usize) -> bool {
        let k = self.local.world_size();
        len.is_multiple_of(self.world)
            && self.procs * k == self.world
            && self.proc_of.iter().enumerate().all(|(g, p)| *p == g / k)
    }

    /// This rank's chunk of its process's block (see [`Self::blocks_by_process`]).
    fn my_chunk(&self, block: &[f32]) -> Vec<f32> {
        let chunk = block.len() / self.local.world_size();
        let l = self.local.rank();
        block[l * chunk..(l + 1) * chunk].to_vec()
    }

    /// `data`, the sums over the group, divided by its ranks for a mean.
    fn finish_mean(&self, data: &mut [f32], op: ReduceOp) {
        if op == ReduceOp::Mean {
            let n = self.world as f32;
            for x in data.iter_mut() {
                *x /= n;
            }
        }
    }

    /// A bf16 sum over the group as MPI returns it (its 16 bits), as `op` asks for it.
    fn bf16_landed(&self, sum: u16, op: ReduceOp) -> burn::tensor::bf16 {
        let s = burn::tensor::bf16::from_bits(sum);
        match op {
            ReduceOp::Mean => burn::tensor::bf16::from_f32(s.to_f32() / self.world as f32),
            ReduceOp::Sum => s,
        }
    }

    /// Replaces `data` on every rank of this process by the lead's.
    fn share_leads(&self, data: &mut [f32]) -> Result<()> {
        if self.local.world_size() == 1 {
            return Ok(());
        }
        let mut v = data.to_vec();
        self.local.broadcast(&mut v, 0)?;
        data.copy_from_slice(&v);
        Ok(())
    }
}

impl Collective for Hier {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, data: &mut [f32], op: ReduceOp) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        self.local.all_reduce(data, ReduceOp::Sum)?;
        if let Some(comm) = self.spanning() {
            if self.lead() {
                // MPI reduces in place (no second buffer to fault in or copy back).
                sum_in_place(comm, data);
            }
            self.share_leads(data)?;
        }
        self.finish_mean(data, op);
        Ok(())
    }

    fn all_reduce_bf16(&self, data: &mut [burn::tensor::bf16], op: ReduceOp) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        if let Some(comm) = self.spanning()
            && self.local.world_size() == 1
        {
            // One rank per process: bf16 crosses the wire, half the bytes of f32. MPI's
            // reduction adds pairs in f32 and rounds each sum to bf16; with two processes that
            // is the exact sum rounded once, as in-process.
            let mut sums: Vec<u16> = data.iter().map(|x| x.to_bits()).collect();
            bf16_sum_in_place(comm, &mut sums);
            for (d, s) in data.iter_mut().zip(sums) {
                *d = self.bf16_landed(s, op);
            }
            return Ok(());
        }
        // The sums are exact in f32 and rounded once, as in-process.
        let mut wide: Vec<f32> = data.iter().map(|x| x.to_f32()).collect();
        self.all_reduce(&mut wide, op)?;
        for (d, w) in data.iter_mut().zip(wide) {
            *d = burn::tensor::bf16::from_f32(w);
        }
        Ok(())
    }

    fn broadcast(&self, data: &mut Vec<f32>, root: usize) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        if let Some(local_root) = self.local_index_of[root] {
            self.local.broadcast(data, local_root)?;
        }
        if let Some(comm) = self.spanning() {
            if self.lead() {
                let from = comm.0.process_at_rank(self.proc_of[root] as i32);
                let mut len = data.len() as u64;
                from.broadcast_into(&mut len);
                data.resize(len as usize, 0.0);
                from.broadcast_into(&mut data[..]);
            }
            let mut len = vec![0.0, 0.0];
            if self.lead() {
                len = split_len(data.len()).to_vec();
            }
            self.local.broadcast(&mut len, 0)?;
            data.resize(join_len(&len), 0.0);
            self.local.broadcast(data, 0)?;
        }
        Ok(())
    }

    fn all_gather(&self, data: &[f32]) -> Result<Vec<f32>> {
        if self.world == 1 {
            return Ok(data.to_vec());
        }
        let lens = self.local.all_gather(&split_len(data.len()))?;
        let here = self.local.all_gather(data)?;
        let Some(comm) = self.spanning() else {
            return Ok(here);
        };
        let mut out = Vec::new();
        if self.lead() {
            // Every process's members' lengths, then their values, process by process.
            let hosted: Vec<usize> = (0..self.procs)
                .map(|p| self.proc_of.iter().filter(|q| **q == p).count())
                .collect();
            let mut all_lens = vec![0f32; 2 * self.world];
            let counts: Vec<i32> = hosted.iter().map(|h| 2 * *h as i32).collect();
            let displs: Vec<i32> = counts
                .iter()
                .scan(0, |at, c| {
                    let d = *at;
                    *at += c;
                    Some(d)
                })
                .collect();
            comm.0.all_gather_varcount_into(
                &lens[..],
                &mut PartitionMut::new(&mut all_lens[..], &counts[..], &displs[..]),
            );
            let member_lens: Vec<usize> = all_lens.chunks(2).map(join_len).collect();
            // Members are listed process by process, each process's in group order.
            let order: Vec<usize> = (0..self.procs)
                .flat_map(|p| (0..self.world).filter(move |g| self.proc_of[*g] == p))
                .collect();
            let mut by_proc = vec![0usize; self.procs];
            for (i, g) in order.iter().enumerate() {
                by_proc[self.proc_of[*g]] += member_lens[i];
            }
            let counts: Vec<i32> = by_proc
                .iter()
                .map(|n| i32::try_from(*n).expect("a process's values fit MPI's count"))
                .collect();
            let displs: Vec<i32> = counts
                .iter()
                .scan(0i32, |at, c| {
                    let d = *at;
                    *at = at
                        .checked_add(*c)
                        .expect("the gathered values fit MPI's displacements");
                    Some(d)
                })
                .collect();
            let mut all = vec![0f32; by_proc.iter().sum()];
            gather_into(comm, &here, &mut all, &counts, &displs);
            // Back into group order.
            let mut pieces: Vec<&[f32]> = vec![&[]; self.world];
            let mut at = 0;
            for (i, g) in order.iter().enumerate() {
                pieces[*g] = &all[at..at + member_lens[i]];
                at += member_lens[i];
            }
            out = pieces.concat();
        }
        let mut len = if self.lead() {
            split_len(out.len()).to_vec()
        } else {
            vec![0.0, 0.0]
        };
        self.local.broadcast(&mut len, 0)?;
        out.resize(join_len(&len), 0.0);
        self.local.broadcast(&mut out, 0)?;
        Ok(out)
    }

    fn reduce_scatter(&self, data: &[f32], op: ReduceOp) -> Result<Vec<f32>> {
        if self.world == 1 {
            return Ok(data.to_vec());
        }
        let Some(comm) = self
            .spanning()
            .filter(|_| self.blocks_by_process(data.len()))
        else {
            let mut all = data.to_vec();
            self.all_reduce(&mut all, op)?;
            return Ok(all[chunk_range(all.len(), self.world, self.rank)].to_vec());
        };
        // The process's sum (as the all-reduce takes it), then each process receives only its
        // ranks' chunks: half the bytes of an all-reduce between processes.
        let mut sum = data.to_vec();
        self.local.all_reduce(&mut sum, ReduceOp::Sum)?;
        let mut block = vec![0f32; data.len() / self.procs];
        if self.lead() {
            sum_scatter(
                comm,
                &mut sum,
                &mut block,
                mpi::collective::SystemOperation::sum().as_raw(),
                add_f32,
            );
        }
        drop(sum);
        self.share_leads(&mut block)?;
        let mut mine = self.my_chunk(&block);
        self.finish_mean(&mut mine, op);
        Ok(mine)
    }

    fn reduce_scatter_bf16(
        &self,
        data: &[burn::tensor::bf16],
        op: ReduceOp,
    ) -> Result<Vec<burn::tensor::bf16>> {
        if let Some(comm) = self.spanning()
            && self.local.world_size() == 1
            && self.blocks_by_process(data.len())
        {
            // One rank per process: bf16 crosses the wire, as in `all_reduce_bf16`.
            let mut bits: Vec<u16> = data.iter().map(|x| x.to_bits()).collect();
            let mut sums = vec![0u16; bits.len() / self.procs];
            sum_scatter(comm, &mut bits, &mut sums, bf16_sum().as_raw(), add_bf16);
            return Ok(sums.into_iter().map(|s| self.bf16_landed(s, op)).collect());
        }
        // The sums are exact in f32 and rounded once, as in-process.
        reduce_scatter_widened(self, data, op)
    }

    fn barrier(&self) -> Result<()> {
        self.local.barrier()?;
        if let Some(comm) = self.spanning() {
            if self.lead() {
                comm.0.barrier();
            }
            self.local.barrier()?;
        }
        Ok(())
    }

    fn abort(&self, reason: &str) {
        self.local.abort(reason);
        if let Some(state) = STATE.get() {
            // The launcher ends every process; this one says why first.
            say_once(reason);
            // A process cut off from the launcher may not get through to it: it ends itself.
            std::thread::spawn(|| {
                std::thread::sleep(std::time::Duration::from_secs(10));
                // SAFETY: `_exit` ends the process at once; nothing is touched afterwards.
                unsafe { libc::_exit(crate::error::failure_code()) };
            });
            state.world.0.abort(crate::error::failure_code());
        }
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        self.split_group(color, key)
    }

    fn send(&self, to: usize, value: Activation) -> Result<()> {
        self.send_to(to, value)
    }

    fn recv(&self, from: usize) -> Result<Activation> {
        self.recv_from(from)
    }
}

/// A group id from its parent's, the split's number and the color.
pub(super) fn mix(parent: u64, number: u64, color: usize) -> u64 {
    let mut z =
        parent ^ number.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (color as u64).rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) | 1
}
