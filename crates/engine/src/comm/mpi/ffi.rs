//! The MPI calls kiln makes through C itself: the in-place all-reduce (`in_place.c`), the
//! reduce-scatter of blocks, the all-gather of pieces of several lengths, and the bf16 sum as
//! a user-defined MPI operation. The all-reduce, the reduce-scatter and the all-gather run,
//! from [`BLOCKING_BELOW`] bytes, as a non-blocking collective or `ring`'s sends and receives
//! that the calling thread waits for asleep (a broadcast still blocks). MPI's default error
//! handler ends the job on a failing call, so their return codes are not read.

use super::ring;
use crate::comm::mpi::runtime::Comm;
use mpi::traits::*;
use std::sync::OnceLock;

/// The sum of bf16 values (as their 16-bit patterns) for MPI: each pair added in f32, rounded
/// to bf16. Built once per process.
pub(super) fn bf16_sum() -> &'static mpi::collective::UnsafeUserOperation {
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

/// Below this many bytes a collective is a blocking call: its cost is the round trips, which
/// a blocking call's own algorithms keep fewest (a ring over many processes would not), and it
/// ends too soon for a sleeping wait to give a core back.
pub(super) const BLOCKING_BELOW: usize = 64 * 1024;

/// `MPI_Allreduce(MPI_IN_PLACE, data, …, op)` over `comm` (rsmpi has no in-place form); from
/// [`BLOCKING_BELOW`] bytes up `MPI_Iallreduce`, waited for asleep ([`ring::wait_all`]), whose
/// algorithm `runtime` sets to OpenMPI's ring.
fn reduce_in_place<T: Equivalence>(comm: &Comm, data: &mut [T], op: mpi::ffi::MPI_Op) {
    use mpi::raw::AsRaw;
    let count = std::ffi::c_int::try_from(data.len()).expect("a bucket fits MPI's count");
    let datatype = T::equivalent_datatype().as_raw();
    if std::mem::size_of_val(data) < BLOCKING_BELOW {
        // SAFETY: `data` is `count` values of `T`'s datatype, valid for reading and writing
        // during the call; MPI_IN_PLACE says the send buffer is the receive buffer.
        unsafe {
            mpi::ffi::MPI_Allreduce(
                kiln_mpi_in_place(),
                data.as_mut_ptr().cast(),
                count,
                datatype,
                op,
                comm.0.as_raw(),
            );
        }
        return;
    }
    // SAFETY: as above, the buffer valid until `wait_all` returns.
    unsafe {
        let mut request = mpi::ffi::RSMPI_REQUEST_NULL;
        mpi::ffi::MPI_Iallreduce(
            kiln_mpi_in_place(),
            data.as_mut_ptr().cast(),
            count,
            datatype,
            op,
            comm.0.as_raw(),
            &mut request,
        );
        ring::wait_all(std::slice::from_mut(&mut request));
    }
}

/// The sum over `comm` of `data`, in place.
pub(super) fn sum_in_place(comm: &Comm, data: &mut [f32]) {
    // SAFETY: reading MPI's predefined sum.
    reduce_in_place(comm, data, unsafe { mpi::ffi::RSMPI_SUM });
}

/// The bf16 sum over `comm` of `bits` (bf16 values as their patterns), in place.
pub(super) fn bf16_sum_in_place(comm: &Comm, bits: &mut [u16]) {
    use mpi::raw::AsRaw;
    reduce_in_place(comm, bits, bf16_sum().as_raw());
}

/// `send`'s sum over `comm`'s processes, each receiving its equal block into `recv`: below
/// [`BLOCKING_BELOW`] bytes `MPI_Reduce_scatter` with equal counts (OpenMPI's
/// `MPI_Reduce_scatter_block` reduces to one process and scatters from it, half again as many
/// bytes on the link), from there up the ring of [`ring::reduce_scatter`] adding with `add`,
/// in `send` (left holding partial sums).
pub(super) fn sum_scatter<T: Equivalence + Copy + Default>(
    comm: &Comm,
    send: &mut [T],
    recv: &mut [T],
    op: mpi::ffi::MPI_Op,
    add: fn(&mut [T], &[T]),
) {
    use mpi::raw::AsRaw;
    let procs = comm.0.size() as usize;
    assert_eq!(send.len(), recv.len() * procs, "equal blocks");
    if std::mem::size_of_val(send) >= BLOCKING_BELOW {
        // The ring sums in `send` itself (its other blocks end as partial sums).
        ring::reduce_scatter(comm, send, add);
        let me = comm.0.rank() as usize;
        recv.copy_from_slice(&send[me * recv.len()..(me + 1) * recv.len()]);
        return;
    }
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

/// Every process's `send` into `recv`, process `p`'s `counts[p]` values at `displs[p]`:
/// `MPI_Allgatherv`, non-blocking and waited for asleep ([`ring::wait_all`]) from
/// [`BLOCKING_BELOW`] bytes up.
pub(super) fn gather_into(
    comm: &Comm,
    send: &[f32],
    recv: &mut [f32],
    counts: &[i32],
    displs: &[i32],
) {
    use mpi::raw::AsRaw;
    let procs = comm.0.size() as usize;
    assert!(
        counts.len() == procs && displs.len() == procs,
        "one count and place per process"
    );
    assert!(
        counts
            .iter()
            .zip(displs)
            .all(|(c, d)| (*c as usize) + (*d as usize) <= recv.len()),
        "every piece fits the receive buffer"
    );
    let count = std::ffi::c_int::try_from(send.len()).expect("a piece fits MPI's count");
    let datatype = f32::equivalent_datatype().as_raw();
    // SAFETY: `send` is `count` f32 values and `recv` holds every process's piece at its
    // place (checked above); both, and `counts` and `displs`, stay valid until the call or
    // `wait_all` returns.
    unsafe {
        if std::mem::size_of_val(recv) < BLOCKING_BELOW {
            mpi::ffi::MPI_Allgatherv(
                send.as_ptr().cast(),
                count,
                datatype,
                recv.as_mut_ptr().cast(),
                counts.as_ptr(),
                displs.as_ptr(),
                datatype,
                comm.0.as_raw(),
            );
            return;
        }
        let mut request = mpi::ffi::RSMPI_REQUEST_NULL;
        mpi::ffi::MPI_Iallgatherv(
            send.as_ptr().cast(),
            count,
            datatype,
            recv.as_mut_ptr().cast(),
            counts.as_ptr(),
            displs.as_ptr(),
            datatype,
            comm.0.as_raw(),
            &mut request,
        );
        ring::wait_all(std::slice::from_mut(&mut request));
    }
}

/// A length carried exactly through f32 values (two 24-bit halves).
pub(super) fn split_len(n: usize) -> [f32; 2] {
    [(n >> 24) as f32, (n & 0xff_ffff) as f32]
}

pub(super) fn join_len(v: &[f32]) -> usize {
    ((v[0] as usize) << 24) | v[1] as usize
}
