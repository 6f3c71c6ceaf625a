//! Several processes, and machines, over MPI (cargo feature `mpi`): the hierarchical group.
//!
//! `mpirun -np P train --devices N` gives a world of P × N ranks; global rank `p·N + l` is
//! device thread `l` of process `p`. Every group — the world, and every group split from it —
//! is two levels: the group's ranks inside this process form an in-process group
//! ([`LocalComm`](super::LocalComm)), and the group's first rank in each process (its *lead*)
//! joins an MPI communicator of the processes that host the group. A collective runs in
//! three steps: the ranks of each process combine in-process (in rank order), the leads run
//! the MPI collective, and each lead hands the result back to its process's ranks. The
//! reduction order is fixed by the layout, so reruns with one seed give the same bits.
//!
//! MPI is initialised with `MPI_THREAD_MULTIPLE`: every thread may call it, and the leads of
//! different groups do so at once (a single communication thread would serialise collectives
//! of different groups in an order that can differ between processes, and deadlock). A
//! communicator is used for collectives by one thread per process (its lead); point-to-point
//! messages (pipeline activations) go from any thread, each ordered pair of ranks with its own
//! tag, through a sending thread per destination so that two stages sending to each other
//! never wait on each other.
//!
//! A failing rank prints its error and calls `MPI_Abort`: the launcher then ends every process
//! of the job. A process killed outright is seen by the launcher, which does the same.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use kiln_models::Activation;
use mpi::datatype::PartitionMut;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use super::{Collective, Processes, ReduceOp};
use crate::error::{Error, Result};

/// A communicator that several threads use.
struct Comm(SimpleCommunicator);

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (`init` refuses anything less), under
// which MPI calls may be made from any thread at once. kiln keeps MPI's one remaining rule:
// collectives on one communicator are issued by one thread per process (the group's lead).
unsafe impl Send for Comm {}
// SAFETY: as for `Send`.
unsafe impl Sync for Comm {}

struct State {
    world: Arc<Comm>,
    /// A duplicate of the world on which the processes' watchdogs talk ([`Control`]).
    control: Arc<Comm>,
    processes: Processes,
    /// Sub-communicators made by a lead for the other ranks of its process, by group id; `None`
    /// for a group that lives in one process.
    registry: Mutex<HashMap<u64, Option<Arc<Comm>>>>,
    registered: Condvar,
}

static STATE: OnceLock<State> = OnceLock::new();

/// Keeps MPI initialised; dropping it frees kiln's communicators and finalises MPI.
pub struct MpiGuard {
    universe: Option<mpi::environment::Universe>,
}

impl Drop for MpiGuard {
    fn drop(&mut self) {
        if let Some(state) = STATE.get() {
            state
                .registry
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        }
        drop(self.universe.take());
    }
}

/// Initialises MPI when this process was started by a launcher with several processes
/// (`processes.count > 1`); returns the guard that keeps it initialised.
pub fn init(processes: Processes) -> Result<Option<MpiGuard>> {
    if processes.count <= 1 {
        return Ok(None);
    }
    yield_when_idle();
    let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        .ok_or_else(|| Error::Device("MPI was initialised twice".into()))?;
    if threading != mpi::Threading::Multiple {
        return Err(Error::Device(format!(
            "this MPI library provides {threading:?} threading, and kiln needs \
             MPI_THREAD_MULTIPLE (its device threads call MPI at once); use an MPI built with \
             thread support (OpenMPI 4 from Debian has it)"
        )));
    }
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    if (rank, size) != (processes.index, processes.count) {
        return Err(Error::Device(format!(
            "the launcher's environment says process {} of {}, MPI says {rank} of {size}",
            processes.index, processes.count
        )));
    }
    let control = Arc::new(Comm(world.duplicate()));
    let _ = STATE.set(State {
        world: Arc::new(Comm(world)),
        control,
        processes,
        registry: Mutex::new(HashMap::new()),
        registered: Condvar::new(),
    });
    Ok(Some(MpiGuard {
        universe: Some(universe),
    }))
}

/// OpenMPI's setting that makes a rank waiting for the network give its core away between
/// polls instead of spinning on it.
const YIELD_WHEN_IDLE: &str = "OMPI_MCA_mpi_yield_when_idle";

/// Asks OpenMPI to yield the core while it waits, unless the launcher's environment (`mpirun
/// --mca mpi_yield_when_idle 0`, or the variable itself) says otherwise. A rank's
/// communication thread (`dist.overlap`) waits in MPI while the rank computes; spinning, it
/// takes a core from the compute wherever ranks and their threads outnumber the cores (ddp,
/// two processes on a 2-core machine at 1 Gbit/s: 155 ms a step spinning, 128 ms yielding,
/// 139 ms without overlap; see BENCHMARKS.md). Yielding costs a `sched_yield` per poll where
/// cores are idle.
fn yield_when_idle() {
    if std::env::var_os(YIELD_WHEN_IDLE).is_none() {
        // SAFETY: this runs in `cli::run_training` before MPI starts and before kiln starts
        // any thread (signal handlers, workers, monitors); no other thread of kiln reads or
        // writes the environment meanwhile.
        unsafe { std::env::set_var(YIELD_WHEN_IDLE, "1") };
    }
}

/// Whether MPI runs (several processes).
pub fn active() -> bool {
    STATE.get().is_some()
}

/// The processes MPI joined, once it runs.
pub fn processes() -> Option<Processes> {
    STATE.get().map(|s| s.processes)
}

/// Bytes broadcast from process 0 to every process (what process 0 decided, such as the run
/// directory).
pub fn agree(bytes: &mut Vec<u8>) {
    if let Some(state) = STATE.get() {
        let root = state.world.0.process_at_rank(0);
        let mut len = bytes.len() as u64;
        root.broadcast_into(&mut len);
        bytes.resize(len as usize, 0);
        root.broadcast_into(&mut bytes[..]);
    }
}

/// Waits until every process arrives.
pub fn barrier() {
    if let Some(state) = STATE.get() {
        state.world.0.barrier();
    }
}

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
    Ok(super::local_group(devices)
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
struct Hier {
    rank: usize,
    world: usize,
    /// The same for every member, in every process: the key of sub-communicators handed from a
    /// lead to the other ranks of its process.
    id: u64,
    /// The group's ranks in this process, in group order.
    local: Box<dyn Collective>,
    /// Group rank → its index in `local`, for the ranks in this process.
    local_index_of: Vec<Option<usize>>,
    /// Group rank → its process's rank in `mpi`.
    proc_of: Vec<usize>,
    /// Processes that host the group.
    procs: usize,
    /// The hosting processes' communicator (`None` when one process hosts the whole group).
    mpi: Option<Arc<Comm>>,
    splits: AtomicU64,
    /// A sending thread per destination in another process.
    senders: Mutex<HashMap<usize, Sender<Message>>>,
}

/// An activation on its way to another process: its shape and dtype, and its values.
struct Message {
    header: Vec<i64>,
    values: Vec<f32>,
}

impl Hier {
    fn lead(&self) -> bool {
        self.local.rank() == 0
    }

    /// The MPI communicator, when the group spans processes.
    fn spanning(&self) -> Option<&Comm> {
        self.mpi.as_deref().filter(|_| self.procs > 1)
    }

    fn tag(&self, from: usize, to: usize) -> i32 {
        (from * self.world + to) as i32
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

/// The sum of bf16 values (as their 16-bit patterns) for MPI: each pair added in f32, rounded
/// to bf16. Built once per process.
fn bf16_sum() -> &'static mpi::collective::UnsafeUserOperation {
    unsafe extern "C" fn sum(
        invec: *mut std::ffi::c_void,
        inoutvec: *mut std::ffi::c_void,
        len: *mut std::ffi::c_int,
        _datatype: *mut mpi::ffi::MPI_Datatype,
    ) {
        // SAFETY: MPI hands `len` values of the operation's datatype (u16) in each buffer.
        let (a, b) = unsafe {
            let n = *len as usize;
            (
                std::slice::from_raw_parts(invec as *const u16, n),
                std::slice::from_raw_parts_mut(inoutvec as *mut u16, n),
            )
        };
        for (x, y) in a.iter().zip(b.iter_mut()) {
            let s = burn::tensor::bf16::from_bits(*x).to_f32()
                + burn::tensor::bf16::from_bits(*y).to_f32();
            *y = burn::tensor::bf16::from_f32(s).to_bits();
        }
    }
    struct Op(mpi::collective::UnsafeUserOperation);
    // SAFETY: an MPI operation handle is a process-wide constant once created.
    unsafe impl Send for Op {}
    unsafe impl Sync for Op {}
    static OP: OnceLock<Op> = OnceLock::new();
    // SAFETY: `sum` reads and writes only the `len` u16 values MPI hands it.
    &OP.get_or_init(|| Op(unsafe { mpi::collective::UnsafeUserOperation::commutative(sum) }))
        .0
}

unsafe extern "C" {
    /// `MPI_IN_PLACE` of the MPI kiln was built against (`in_place.c`).
    fn kiln_mpi_in_place() -> *mut std::ffi::c_void;
}

/// `MPI_Allreduce(MPI_IN_PLACE, data, …, MPI_SUM)` over `comm` (rsmpi has no in-place form).
fn sum_in_place(comm: &Comm, data: &mut [f32]) {
    use mpi::raw::AsRaw;
    let count = std::ffi::c_int::try_from(data.len()).expect("a bucket fits MPI's count");
    // SAFETY: `data` is `count` f32 values, valid for reading and writing during the call;
    // MPI_IN_PLACE says the send buffer is the receive buffer.
    unsafe {
        mpi::ffi::MPI_Allreduce(
            kiln_mpi_in_place(),
            data.as_mut_ptr().cast(),
            count,
            mpi::ffi::RSMPI_FLOAT,
            mpi::ffi::RSMPI_SUM,
            comm.0.as_raw(),
        );
    }
}

/// `send`'s sum over `comm`'s processes, each receiving its equal block into `recv`:
/// `MPI_Reduce_scatter` with equal counts, whose choice of algorithm (in OpenMPI, recursive
/// halving or a ring for a commutative sum) sends each process about its block's share;
/// OpenMPI's `MPI_Reduce_scatter_block` reduced to one process and scattered from it, half
/// again as many bytes on the link.
fn sum_scatter<T: Equivalence>(comm: &Comm, send: &[T], recv: &mut [T], op: mpi::ffi::MPI_Op) {
    use mpi::raw::AsRaw;
    let procs = comm.0.size() as usize;
    assert_eq!(send.len(), recv.len() * procs, "equal blocks");
    let count = std::ffi::c_int::try_from(recv.len()).expect("a block fits MPI's count");
    let counts = vec![count; procs];
    // SAFETY: `send` holds `procs` blocks of `count` values and `recv` one block, both of
    // `T`'s datatype, valid during the call; `counts` has one entry per process.
    unsafe {
        mpi::ffi::MPI_Reduce_scatter(
            send.as_ptr().cast(),
            recv.as_mut_ptr().cast(),
            counts.as_ptr(),
            T::equivalent_datatype().as_raw(),
            op,
            comm.0.as_raw(),
        );
    }
}

/// A length carried exactly through f32 values (two 24-bit halves).
fn split_len(n: usize) -> [f32; 2] {
    [(n >> 24) as f32, (n & 0xff_ffff) as f32]
}

fn join_len(v: &[f32]) -> usize {
    ((v[0] as usize) << 24) | v[1] as usize
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
            let bits: Vec<u16> = data.iter().map(|x| x.to_bits()).collect();
            let mut sums = vec![0u16; bits.len()];
            comm.0.all_reduce_into(&bits[..], &mut sums[..], bf16_sum());
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
            let counts: Vec<i32> = by_proc.iter().map(|n| *n as i32).collect();
            let displs: Vec<i32> = counts
                .iter()
                .scan(0, |at, c| {
                    let d = *at;
                    *at += c;
                    Some(d)
                })
                .collect();
            let mut all = vec![0f32; by_proc.iter().sum()];
            comm.0.all_gather_varcount_into(
                &here[..],
                &mut PartitionMut::new(&mut all[..], &counts[..], &displs[..]),
            );
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
            return Ok(all[super::chunk_range(all.len(), self.world, self.rank)].to_vec());
        };
        // The process's sum (as the all-reduce takes it), then each process receives only its
        // ranks' chunks: half the bytes of an all-reduce between processes.
        let mut sum = data.to_vec();
        self.local.all_reduce(&mut sum, ReduceOp::Sum)?;
        let mut block = vec![0f32; data.len() / self.procs];
        if self.lead() {
            sum_scatter(
                comm,
                &sum,
                &mut block,
                mpi::collective::SystemOperation::sum().as_raw(),
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
            let bits: Vec<u16> = data.iter().map(|x| x.to_bits()).collect();
            let mut sums = vec![0u16; bits.len() / self.procs];
            sum_scatter(comm, &bits, &mut sums, bf16_sum().as_raw());
            return Ok(sums.into_iter().map(|s| self.bf16_landed(s, op)).collect());
        }
        // The sums are exact in f32 and rounded once, as in-process.
        super::reduce_scatter_widened(self, data, op)
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
                unsafe { libc::_exit(2) };
            });
            state.world.0.abort(2);
        }
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
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

    fn send(&self, to: usize, value: Activation) -> Result<()> {
        if let Some(local) = self.local_index_of[to] {
            return self.local.send(local, value);
        }
        let comm = self
            .mpi
            .clone()
            .expect("a rank in another process means the group spans processes");
        let dims = value.dims();
        let (dtype, values): (i64, Vec<f32>) = match value {
            Activation::Rank2(t) => encode(t),
            Activation::Rank3(t) => encode(t),
            Activation::Rank4(t) => encode(t),
        };
        let mut header = vec![dims.len() as i64, dtype];
        header.extend(dims.iter().map(|d| *d as i64));
        let tag = self.tag(self.rank, to);
        let dest = self.proc_of[to] as i32;
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        let sender = senders.entry(to).or_insert_with(|| {
            let (tx, rx) = channel::<Message>();
            std::thread::Builder::new()
                .name(format!("kiln-send-{}-{to}", self.rank))
                .spawn(move || {
                    for m in rx {
                        let p = comm.0.process_at_rank(dest);
                        p.send_with_tag(&m.header[..], tag);
                        p.send_with_tag(&m.values[..], tag);
                    }
                })
                .expect("spawn a sending thread");
            tx
        });
        sender
            .send(Message { header, values })
            .map_err(|_| Error::Worker("the sending thread stopped".into()))
    }

    fn recv(&self, from: usize) -> Result<Activation> {
        if let Some(local) = self.local_index_of[from] {
            return self.local.recv(local);
        }
        let comm = self
            .mpi
            .as_ref()
            .expect("a rank in another process means the group spans processes");
        let tag = self.tag(from, self.rank);
        let p = comm.0.process_at_rank(self.proc_of[from] as i32);
        let (header, _) = p.receive_vec_with_tag::<i64>(tag);
        let (values, _) = p.receive_vec_with_tag::<f32>(tag);
        let dims: Vec<usize> = header[2..].iter().map(|d| *d as usize).collect();
        let dtype = match header[1] {
            1 => FloatDType::BF16,
            2 => FloatDType::F16,
            _ => FloatDType::F32,
        };
        let device = Device::flex();
        let data = |d: Vec<usize>| TensorData::new(values, d);
        Ok(match header[0] {
            2 => Activation::Rank2(Tensor::<2>::from_data(data(dims), &device).cast(dtype)),
            3 => Activation::Rank3(Tensor::<3>::from_data(data(dims), &device).cast(dtype)),
            _ => Activation::Rank4(Tensor::<4>::from_data(data(dims), &device).cast(dtype)),
        })
    }
}

/// Tags of the control communicator's messages.
const ASK: i32 = 1;
const TELL: i32 = 2;

/// The processes' watchdogs talking on their own communicator (a duplicate of the world), from
/// one thread per process: questions and answers are short texts, sent without waiting for the
/// receiver (a process cut off from the others must not block its watchdog).
struct Control {
    comm: Arc<Comm>,
    me: usize,
    processes: usize,
}

/// The control channel, once MPI runs.
pub fn control() -> Option<Box<dyn super::watch::Remote>> {
    let state = STATE.get()?;
    Some(Box::new(Control {
        comm: state.control.clone(),
        me: state.processes.index,
        processes: state.processes.count,
    }))
}

impl Control {
    /// Sends `text` to process `to` and returns at once (the buffer lives until the send is
    /// done, which may be never when `to` is cut off: the few bytes are left behind).
    fn post(&self, to: usize, tag: i32, text: String) {
        let bytes: &'static [u8] = Box::leak(text.into_bytes().into_boxed_slice());
        // SAFETY: the buffer is 'static, so it outlives the send; freeing the request is
        // allowed while the send is in progress (MPI completes it in the background).
        unsafe {
            let mut request = std::mem::MaybeUninit::uninit();
            mpi::ffi::MPI_Isend(
                bytes.as_ptr().cast(),
                bytes.len() as i32,
                u8::equivalent_datatype().as_raw(),
                to as i32,
                tag,
                self.comm.0.as_raw(),
                request.as_mut_ptr(),
            );
            let mut request = request.assume_init();
            mpi::ffi::MPI_Request_free(&mut request);
        }
    }

    /// The next message with `tag` that has arrived, and its sender.
    fn take(&self, tag: i32) -> Option<(usize, String)> {
        let probed = self
            .comm
            .0
            .any_process()
            .immediate_matched_probe_with_tag(tag)?;
        let (bytes, status) = probed.matched_receive_vec::<u8>();
        Some((
            status.source_rank() as usize,
            String::from_utf8_lossy(&bytes).into_owned(),
        ))
    }
}

impl super::watch::Remote for Control {
    fn serve(&self, answer: &dyn Fn(&str) -> String) {
        while let Some((from, question)) = self.take(ASK) {
            self.post(from, TELL, answer(&question));
        }
    }

    fn ask(
        &self,
        question: &str,
        wait: std::time::Duration,
        answer: &dyn Fn(&str) -> String,
    ) -> Vec<(usize, String)> {
        let others: Vec<usize> = (0..self.processes).filter(|p| *p != self.me).collect();
        for &p in &others {
            self.post(p, ASK, question.to_string());
        }
        let started = std::time::Instant::now();
        let mut answers = Vec::new();
        while answers.len() < others.len() && started.elapsed() < wait {
            self.serve(answer);
            match self.take(TELL) {
                Some(a) => answers.push(a),
                None => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
        answers
    }

    fn cut_off(&self, reason: &str) {
        // OpenMPI's daemons (mpirun on its machine, orted on the others) wait for the
        // processes of the other part until TCP gives up on the link, ~15 min. A daemon that
        // gets SIGTERM ends its processes and leaves; mpirun already taking the job down
        // leaves at once on the second.
        let parent = unsafe { libc::getppid() };
        let name = std::fs::read_to_string(format!("/proc/{parent}/comm")).unwrap_or_default();
        if !LAUNCHER_DAEMONS.contains(&name.trim()) {
            return;
        }
        say_once(&format!(
            "{reason}; cut off from them, this process ends its launcher ({} {parent})",
            name.trim()
        ));
        for _ in 0..2 {
            // SAFETY: a signal to the process that started this one.
            unsafe { libc::kill(parent, libc::SIGTERM) };
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }
}

/// Prints the line of the failure that ends this process, once.
fn say_once(reason: &str) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SAID.swap(true, Ordering::SeqCst) {
        return;
    }
    let p = crate::comm::processes();
    eprintln!("error: process {} of {}: {reason}", p.index, p.count);
}

/// The launcher daemons `Control::cut_off` ends (OpenMPI's and PRRTE's).
const LAUNCHER_DAEMONS: [&str; 6] = ["mpirun", "mpiexec", "orterun", "orted", "prterun", "prted"];

/// A tensor's dtype code and values as f32 (exact for bf16 and f16).
fn encode<const D: usize>(t: Tensor<D>) -> (i64, Vec<f32>) {
    let code = match t.dtype() {
        DType::BF16 => 1,
        DType::F16 => 2,
        _ => 0,
    };
    (code, t.into_data().convert::<f32>().iter::<f32>().collect())
}

/// A group id from its parent's, the split's number and the color.
fn mix(parent: u64, number: u64, color: usize) -> u64 {
    let mut z =
        parent ^ number.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (color as u64).rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) | 1
}
