//! The system monitor and the throughput arithmetic of the logging block.
//!
//! [`SystemMonitor`] samples, on its own thread every `monitor.interval_s` seconds: the
//! process's resident memory (now and peak) and CPU utilization, the machine's CPU
//! utilization, each replica's share of the CPU (when CPU replicas run in their own thread
//! pools), what Burn's allocator holds on each device (where the backend reports it) and,
//! through NVML (the `nvml` feature), each GPU's utilization, memory and power. Samples are
//! records with `"split": "system"`; rank 0 drains them into the metric sinks when it logs, so
//! the hot loop gains nothing but one atomic store per step.
//!
//! [`peak_tflops`] and [`Ema`] serve the throughput and MFU columns of the training records.

#[cfg(feature = "nvml")]
mod gpus;
#[cfg(not(feature = "nvml"))]
#[path = "no_gpus.rs"]
mod gpus;
mod proc;
mod sample;
mod system;
mod throughput;

pub use proc::{earlier_resident_peak_mib, process_memory_mib, restart_resident_peak};
pub use system::{MonitorSetup, SystemMonitor};
pub use throughput::{Throughput, peak_tflops};
