//! The MPI calls kiln makes through C itself: the in-place all-reduce (`in_place.c`), the
//! reduce-scatter of blocks, and the bf16 sum as a user-defined MPI operation.

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

/// `MPI_Allreduce(MPI_IN_PLACE, data, …, MPI_SUM)` over `comm` (rsmpi has no in-place form).
pub(super) fn sum_in_place(comm: &Comm, data: &mut [f32]) {
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
pub(super) fn sum_scatter<T: Equivalence>(
    comm: &Comm,
    send: &[T],
    recv: &mut [T],
    op: mpi::ffi::MPI_Op,
) {
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
pub(super) fn split_len(n: usize) -> [f32; 2] {
    [(n >> 24) as f32, (n & 0xff_ffff) as f32]
}

pub(super) fn join_len(v: &[f32]) -> usize {
    ((v[0] as usize) << 24) | v[1] as usize
}
