//! kiln's integration tests: one test binary, one module per area.

mod chat;
mod cli;
mod common;
mod cores;
#[cfg(feature = "cube-cpu")]
mod cube_cpu;
mod custom;
mod data;
mod ddp;
mod devices;
mod diloco;
mod dist;
mod docs;
mod finetune;
mod fuzz;
mod generative;
mod gpt;
mod heal;
mod hf;
mod kernels;
mod lora;
mod monitor;
#[cfg(feature = "mpi")]
mod mpi;
mod phi3;
mod pipeline;
mod plan;
mod policies;
mod robust;
mod runlock;
mod shards;
mod tp;
mod tp_own;
mod training;
mod wgpu;
mod zero;
