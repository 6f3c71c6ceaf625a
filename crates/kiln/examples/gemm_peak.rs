//! The machine's f32 matrix-product peak as kiln's CPU device reaches it: Burn's Flex matmul
//! (the `gemm` kernels that the models' Linears run) on square matrices, on one thread and on
//! every core at once, the best of three tries each. `cargo xtask bench cpu` prints it beside
//! each recipe's achieved FLOP/s.
//!
//! `cargo run --release --example gemm_peak [-- SIZE]` (default 2048) prints one line of JSON:
//! `{"size": 2048, "threads": 16, "gflops_one_thread": …, "gflops_all_threads": …}`.

use std::sync::Barrier;
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::Distribution;

fn main() {
    let size = match std::env::args().nth(1).map(|s| s.parse::<usize>()) {
        None => 2048,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("error: the size must be a positive integer (rows of the square matrices)");
            std::process::exit(2);
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The best of three tries each: a peak, not what a busy moment of the machine allowed.
    let best = |threads: usize| (0..3).map(|_| gflops(size, threads, 2)).fold(0.0, f64::max);
    let one_thread = best(1);
    let all_threads = best(threads);
    println!(
        "{{\"size\": {size}, \"threads\": {threads}, \"gflops_one_thread\": {one_thread:.1}, \
         \"gflops_all_threads\": {all_threads:.1}}}"
    );
}

/// GFLOP/s of `threads` threads that each multiply two random `size × size` matrices `reps`
/// times at once (after one product each to warm up), counting 2·size³ FLOPs per product:
/// every thread runs its own single-threaded products, as a CPU device's per-core replicas do
/// (Flex's `rayon` feature is off in kiln's build, so one product never spreads over cores).
fn gflops(size: usize, threads: usize, reps: usize) -> f64 {
    let device = Device::flex();
    let start = Barrier::new(threads + 1);
    let done = Barrier::new(threads + 1);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let a = Tensor::<2>::random([size, size], Distribution::Default, &device);
                let b = Tensor::<2>::random([size, size], Distribution::Default, &device);
                // Reading one value back waits for the product on any backend.
                let product = || {
                    let c = a.clone().matmul(b.clone());
                    let _ = c.slice([0..1, 0..1]).into_data();
                };
                product();
                start.wait();
                for _ in 0..reps {
                    product();
                }
                done.wait();
            });
        }
        start.wait();
        let clock = Instant::now();
        done.wait();
        let seconds = clock.elapsed().as_secs_f64();
        (threads * reps) as f64 * 2.0 * (size as f64).powi(3) / seconds / 1e9
    })
}
