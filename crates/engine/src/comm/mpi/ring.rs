//! The waits of the collectives that carry gradients and parameters between processes
//! ([`wait_all`]: asleep), and the reduce-scatter as a ring of non-blocking sends and receives.
//!
//! The ring cuts the values into one block per process; in each of `p − 1` rounds every
//! process sends a block to the next process and receives one from the previous, adding its
//! own values to what it received, so that after the last round each process holds its own
//! block's sum over all processes. Every process sends and receives at once in every round,
//! `(p − 1)/p` of the values in all, what a link carries at the least. OpenMPI's non-blocking
//! reduce-scatter reduces to one process first and scatters from it: 8.5 MB on the link per
//! step of zero2's GPT between two processes, against 6.9 for the ring (`cargo xtask bench
//! links`).

use std::ffi::c_int;
use std::ops::Range;
use std::time::Duration;

use mpi::raw::AsRaw;
use mpi::traits::*;

use crate::comm::mpi::runtime::Comm;

/// The tag of a ring's messages; pipeline activations between processes use tags from 1
/// (`Hier::tag`), so the two never match each other.
pub(super) const TAG: c_int = 0;

/// How long a thread waiting for its sends and receives sleeps between two tests of them, at
/// most.
const PAUSE_MAX: Duration = Duration::from_micros(100);

/// Waits for `requests` to complete: tested, then slept on between tests (from a microsecond,
/// doubling up to [`PAUSE_MAX`]). A blocking MPI call polls the network on the calling thread
/// until it ends: with OpenMPI's `mpi_yield_when_idle` it yields between polls, but it stays
/// runnable, so where the ranks' compute threads fill the cores (a communication thread beside
/// each rank's walk) it takes its share of a core from them and gets the network only when the
/// scheduler comes round to it. Asleep, it takes nothing, and wakes within the pause to move
/// its messages on (OpenMPI's TCP transfers advance inside `MPI_Test*`).
pub(super) fn wait_all(requests: &mut [mpi::ffi::MPI_Request]) {
    let count = c_int::try_from(requests.len()).expect("a few requests");
    let mut pause = Duration::from_micros(1);
    loop {
        let mut done: c_int = 0;
        // SAFETY: `requests` are active requests (or MPI_REQUEST_NULL) from non-blocking calls
        // whose buffers the caller keeps alive until this returns; MPI sets each to
        // MPI_REQUEST_NULL once it completes.
        unsafe {
            mpi::ffi::MPI_Testall(
                count,
                requests.as_mut_ptr(),
                &mut done,
                mpi::ffi::RSMPI_STATUSES_IGNORE,
            );
        }
        if done != 0 {
            return;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(PAUSE_MAX);
    }
}

/// Block `i` of `n` values cut into `p` blocks (the last ones shorter, or empty).
fn block(n: usize, p: usize, i: usize) -> Range<usize> {
    let b = n.div_ceil(p);
    (i * b).min(n)..((i + 1) * b).min(n)
}

/// The blocks process `r` of `p` sends and receives in round `k` of the reduce-scatter: the
/// partial sum of block r−1−k goes out, that of block r−2−k comes in and gets this process's
/// own values added, so after p−1 rounds block r is whole.
fn scatter_round(p: usize, r: usize, k: usize) -> (usize, usize) {
    ((r + 2 * p - 1 - k) % p, (r + 2 * p - 2 - k) % p)
}

/// One round: `data[send]` to the next process while `into` receives from the previous one.
fn exchange<T: Equivalence>(comm: &Comm, data: &[T], send: Range<usize>, into: &mut [T]) {
    let (procs, me) = (comm.0.size(), comm.0.rank());
    let (next, prev) = ((me + 1) % procs, (me + procs - 1) % procs);
    let datatype = T::equivalent_datatype().as_raw();
    let out = &data[send];
    let counts = (
        c_int::try_from(out.len()).expect("a block fits MPI's count"),
        c_int::try_from(into.len()).expect("a block fits MPI's count"),
    );
    // SAFETY: `out` and `into` are disjoint buffers of `T`'s datatype (`into` is not part of
    // `data`, which is borrowed shared), valid until `wait_all` returns; requests start null.
    unsafe {
        let mut requests = [mpi::ffi::RSMPI_REQUEST_NULL; 2];
        mpi::ffi::MPI_Irecv(
            into.as_mut_ptr().cast(),
            counts.1,
            datatype,
            prev,
            TAG,
            comm.0.as_raw(),
            &mut requests[0],
        );
        mpi::ffi::MPI_Isend(
            out.as_ptr().cast(),
            counts.0,
            datatype,
            next,
            TAG,
            comm.0.as_raw(),
            &mut requests[1],
        );
        wait_all(&mut requests);
    }
}

/// The ring's reduce-scatter in place: afterwards `data`'s block `rank` (see [`block`]) holds
/// that block's sum over the processes (`add(acc, x)` adding `x` into `acc`); the other blocks
/// hold partial sums.
pub(super) fn reduce_scatter<T: Equivalence + Copy + Default>(
    comm: &Comm,
    data: &mut [T],
    add: fn(&mut [T], &[T]),
) {
    let (p, r) = (comm.0.size() as usize, comm.0.rank() as usize);
    let n = data.len();
    let mut incoming = vec![T::default(); block(n, p, 0).len()];
    for k in 0..p - 1 {
        let (send, recv) = scatter_round(p, r, k);
        let (send, recv) = (block(n, p, send), block(n, p, recv));
        let into = &mut incoming[..recv.len()];
        exchange(comm, data, send, into);
        add(&mut data[recv], into);
    }
}

/// `x` added into `acc`, in f32.
pub(super) fn add_f32(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += *b;
    }
}

/// `x` added into `acc`, bf16 values as their patterns: each pair added in f32 and the sum
/// rounded to bf16 (with two processes, the exact sum rounded once).
pub(super) fn add_bf16(acc: &mut [u16], x: &[u16]) {
    use burn::tensor::bf16;
    for (a, b) in acc.iter_mut().zip(x) {
        *a = bf16::from_f32(bf16::from_bits(*a).to_f32() + bf16::from_bits(*b).to_f32()).to_bits();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_blocks_cover_the_values_once_in_order() {
        for (n, p) in [(10, 3), (9, 3), (2, 4), (0, 2), (7, 1)] {
            let blocks: Vec<Range<usize>> = (0..p).map(|i| block(n, p, i)).collect();
            assert_eq!(blocks[0].start, 0, "{n} {p}");
            assert_eq!(blocks[p - 1].end, n, "{n} {p}");
            for w in blocks.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{n} {p}");
            }
        }
    }

    /// The rounds' blocks ([`scatter_round`]) played out on `p` processes without MPI, each
    /// receiving what the previous one sent: every process ends with its own block summed
    /// over all processes.
    #[test]
    fn the_rounds_leave_each_process_its_block_summed() {
        for p in 1..=5usize {
            let n = 2 * p + 1;
            // Process q's values: q * 100 + i, so a block's sum over processes is known.
            let mut data: Vec<Vec<f32>> = (0..p)
                .map(|q| (0..n).map(|i| (q * 100 + i) as f32).collect())
                .collect();
            for k in 0..p - 1 {
                let sent: Vec<Vec<f32>> = (0..p)
                    .map(|r| data[r][block(n, p, scatter_round(p, r, k).0)].to_vec())
                    .collect();
                for r in 0..p {
                    let recv = block(n, p, scatter_round(p, r, k).1);
                    let from = &sent[(r + p - 1) % p];
                    add_f32(&mut data[r][recv], from);
                }
            }
            for (r, d) in data.iter().enumerate() {
                for i in block(n, p, r) {
                    let want: f32 = (0..p).map(|q| (q * 100 + i) as f32).sum();
                    assert_eq!(d[i], want, "{p} processes, process {r}, value {i}");
                }
            }
        }
    }
}
