//! The bandwidth of kiln's MPI all-reduce next to a plain `MPI_Allreduce` of the same size,
//! for buffers of 1 to 64 MiB. Run under `mpirun -np 2` (built with the `mpi` feature);
//! `cargo xtask bench mpi` does.

use std::time::Instant;

use kiln_engine::comm::{self, Processes, ReduceOp};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

fn main() {
    let processes = Processes::from_env();
    let _guard = comm::start(processes).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    });
    if processes.count < 2 {
        eprintln!("error: run under mpirun with at least 2 processes");
        std::process::exit(2);
    }
    let group = comm::world_group(1).expect("the world");
    let kiln = &group[0];
    let raw = SimpleCommunicator::world();
    let reps = 10;
    if processes.index == 0 {
        println!(
            "| MiB | kiln all-reduce (sum) GB/s | kiln all-reduce (mean) GB/s | \
             MPI_Allreduce GB/s | kiln sum ÷ MPI | kiln mean ÷ MPI |"
        );
        println!("|---|---|---|---|---|---|");
    }
    for mib in [1usize, 2, 4, 8, 16, 32, 64] {
        let n = mib * 1024 * 1024 / 4;
        let mut data = vec![1.0f32; n];
        let mut recv = vec![0.0f32; n];
        // Warm up both paths, then time them in turn.
        kiln.all_reduce(&mut data, ReduceOp::Mean).unwrap();
        raw.all_reduce_into(&data[..], &mut recv[..], SystemOperation::sum());
        // The fastest of `reps` runs of each, in turn.
        let mut best = [f64::MAX; 3];
        for _ in 0..reps {
            for (i, op) in [
                (0, Some(ReduceOp::Sum)),
                (1, Some(ReduceOp::Mean)),
                (2, None),
            ] {
                raw.barrier();
                let t = Instant::now();
                match op {
                    Some(op) => kiln.all_reduce(&mut data, op).unwrap(),
                    None => raw.all_reduce_into(&data[..], &mut recv[..], SystemOperation::sum()),
                }
                best[i] = best[i].min(t.elapsed().as_secs_f64());
            }
            // Keep the values finite and small whatever the sums did.
            data.iter_mut().for_each(|x| *x = 1.0);
        }
        if processes.index == 0 {
            let gbs = |s: f64| (n * 4) as f64 / s / 1e9;
            println!(
                "| {mib} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} |",
                gbs(best[0]),
                gbs(best[1]),
                gbs(best[2]),
                best[2] / best[0],
                best[2] / best[1]
            );
        }
    }
}
