//! `[hardware]` and `[monitor]`: the accelerator, its devices and cores, and where metrics go.

use kiln_models::cube::GpuKernel;
use serde::{Deserialize, Serialize};

use super::names::{bad, switch};
use crate::error::Result;

/// The share of `memory_limit_mib` kept free for the planner's error: a plan fits when its
/// need and this much more do (`cargo xtask bench plan` measures the error; BENCHMARKS.md),
/// and a run under a limit on the CPU hands the allocator's kept pages back once its resident
/// memory is past the limit ÷ (1 + this), where a plan that just fits ends (`heap::hold_under`).
pub const HEADROOM: f64 = 0.10;
/// Which kind of device replicas run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum Accelerator {
    /// CUDA where the build has it and a driver and a device answer, then a hardware WGPU
    /// adapter, then the CPU (`train devices` says which, and why).
    Auto,
    /// Burn's Flex CPU backend; N devices are N replicas, one thread each.
    Cpu,
    /// WGPU adapters (Vulkan, Metal, DX12, WebGPU).
    Wgpu,
    /// CUDA GPUs (needs the `cuda` feature).
    Cuda,
    /// CubeCL's CPU runtime (needs the `cube-cpu` feature): the GPU path — kiln's GPU kernels,
    /// Burn's fusion, the device's memory pool — compiled for the host through LLVM, in every
    /// float type (WGPU's software adapter computes in neither bf16 nor f16). For trying a GPU
    /// recipe without a GPU; slow. N devices are N replicas of the one runtime. kiln treats it
    /// as a GPU: its pool, in host memory, is outside what `memory_limit_mib` holds the process
    /// to, and CubeCL sizes its own threads (`cpu_cores` and `cpu_split` do nothing there).
    CubeCpu,
}

/// Number of devices, or an explicit list of device indices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceList {
    /// The first N devices.
    Count(usize),
    /// These device indices.
    List(Vec<usize>),
}

impl DeviceList {
    /// The device indices this selects.
    pub fn indices(&self) -> Vec<usize> {
        match self {
            DeviceList::Count(n) => (0..*n).collect(),
            DeviceList::List(l) => l.clone(),
        }
    }
}

/// `[hardware]`: accelerator and devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HardwareConfig {
    /// `auto`, `cpu`, `wgpu` or `cuda`. Default `auto`.
    pub accelerator: Accelerator,
    /// How many devices (an integer) or which ones (a list of indices). Default 1.
    pub devices: DeviceList,
    /// On the CPU accelerator, how a device uses its cores: `auto` runs its batch as per-core
    /// sub-replicas (each a one-thread replica with its share of the batch, gradients
    /// averaged as one device — the schedule data parallelism uses across devices); `off`
    /// runs one replica whose kernels spread over the cores. Default `auto`.
    pub cpu_split: CpuSplit,
    /// On a GPU, ranks each device runs: its batch shared among them, their gradients averaged
    /// over the host as one device's (the `ddp` step; `single` and `ddp` only). One replica
    /// against two at the same global batch measures what that exchange costs a step. On the
    /// CPU `cpu_split` does this per core. Default 1.
    pub replicas_per_device: usize,
    /// On the CPU accelerator, the cores the devices share. Default: every core the machine
    /// offers the process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_cores: Option<usize>,
    /// The memory a run may take, in MiB: per device on a GPU, per process on the CPU (where
    /// the devices share the process's memory). A launch whose plan needs more is refused at
    /// start, naming the nearest plan that fits; `--strategy auto` picks among the plans
    /// that fit. Default: on the CPU the memory available to the process; on a GPU no limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_limit_mib: Option<f64>,
    /// Run even when the plan needs more than `memory_limit_mib`. Default `false`.
    pub memory_limit_force: bool,
    /// kiln's own kernels in place of Burn's composed ops. On the CPU accelerator: LayerNorm,
    /// RMSNorm, GELU, SwiGLU, softmax cross-entropy, causal attention, the Linear, the
    /// stride-1 convolution, BatchNorm and ReLU + max-pool as fused kernels (one pass forward,
    /// a backward written for each, vectorised for the CPU's widest instructions), and AdamW's
    /// update as one loop. On a CubeCL GPU (CUDA, WGPU): the embedding table's gradient and
    /// AdamW's update as CubeCL kernels (`kiln_models::cube`). `false` runs Burn's composed ops
    /// everywhere.
    /// Default `true`.
    pub fused_kernels: bool,
    /// With `fused_kernels` on, which of the GPU's paths run (`kiln_models::cube::GpuKernel`):
    /// `"embedding"` (the table's gradient by parts of the batch), `"attention"` (causal
    /// attention forward and backward as kernels), `"adamw"` (the update of a flat shard in
    /// one pass), `"linear"` (a Linear's weight gradient summed by parts of the rows),
    /// `"norm"` (LayerNorm's and RMSNorm's forward and backward as a kernel each),
    /// `"gelu"` (the exact GELU forward and backward as a kernel each),
    /// `"dropout"` (dropout's mask hashed from its seed in a kernel, a block's residual sum in
    /// the same kernel),
    /// `"matrix-units"` (attention's kernels on the tensor cores for bf16 and f16 tensors,
    /// where the device has them; without it they compute in f32 on the ordinary units). One
    /// left out runs Burn's composed ops (or, for `"matrix-units"`, attention's other kernels),
    /// so that each is measured alone. Default: all eight.
    pub gpu_kernels: Vec<GpuKernel>,
    /// Keep the planner's measurements (the probe's steps, the collectives' seconds) in the
    /// cache folder (`$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`) and
    /// read them back on the next launch of the same model, settings, machine and build, so
    /// that a launch near `memory_limit_mib` is decided the same way every time; `false`
    /// measures on every launch and keeps nothing. Default `true`.
    pub plan_cache: bool,
}

impl HardwareConfig {
    /// The cores CPU devices share: `cpu_cores`, or every core the process may use.
    pub fn cores(&self) -> usize {
        self.cpu_cores.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }
}

/// `hardware.cpu_split`: how a CPU device uses its cores (`true` and `false` read as `"auto"`
/// and `"off"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpuSplit {
    /// Per-core sub-replicas where they fit (see [`HardwareConfig::cpu_split`]).
    Auto,
    /// One replica per device.
    Off,
}

impl<'de> Deserialize<'de> for CpuSplit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let from_name = |name: &str| match name {
            "auto" => Some(CpuSplit::Auto),
            "off" => Some(CpuSplit::Off),
            _ => None,
        };
        switch(
            d,
            &["auto", "off"],
            from_name,
            CpuSplit::Auto,
            CpuSplit::Off,
        )
    }
}

impl Default for HardwareConfig {
    fn default() -> Self {
        Self {
            accelerator: Accelerator::Auto,
            devices: DeviceList::Count(1),
            cpu_split: CpuSplit::Auto,
            replicas_per_device: 1,
            cpu_cores: None,
            memory_limit_mib: None,
            memory_limit_force: false,
            fused_kernels: true,
            gpu_kernels: GpuKernel::ALL.to_vec(),
            plan_cache: true,
        }
    }
}

impl HardwareConfig {
    /// Rejects an empty device selection and a device named twice.
    pub fn check(&self) -> Result<()> {
        let devices = self.devices.indices();
        if devices.is_empty() {
            return bad(
                "hardware.devices",
                "must name at least one device (a count >= 1 or a non-empty list), got 0".into(),
            );
        }
        let mut sorted = devices.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != devices.len() {
            return bad(
                "hardware.devices",
                format!("lists a device twice: {devices:?}"),
            );
        }
        if let Some(limit) = self.memory_limit_mib
            && !(limit.is_finite() && limit > 0.0)
        {
            return bad(
                "hardware.memory_limit_mib",
                format!("must be a number of MiB > 0 (or left unset), got {limit}"),
            );
        }
        if self.replicas_per_device == 0 {
            return bad(
                "hardware.replicas_per_device",
                "must be at least 1, got 0".into(),
            );
        }
        if self.replicas_per_device > 1 && self.accelerator == Accelerator::Cpu {
            return bad(
                "hardware.replicas_per_device",
                format!(
                    "is a GPU's, got {} on the CPU accelerator (there hardware.cpu_split runs a \
                     device as per-core sub-replicas)",
                    self.replicas_per_device
                ),
            );
        }
        if self.cpu_cores == Some(0) {
            return bad(
                "hardware.cpu_cores",
                "must be at least 1 (or left unset for every core), got 0".into(),
            );
        }
        Ok(())
    }
}

/// Where metrics records are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SinkKind {
    /// `metrics.jsonl`, one JSON object per line.
    Jsonl,
    /// `metrics.csv`.
    Csv,
    /// TensorBoard event files under `tb/`.
    Tensorboard,
}

/// `[monitor]`: monitoring settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorConfig {
    /// Metric sinks: any of `jsonl`, `csv`, `tensorboard`. Default all three.
    pub sinks: Vec<SinkKind>,
    /// Seconds between two samples of the system monitor (memory, CPU and GPU utilization,
    /// power); 0 turns the sampler off. Default 1.
    pub interval_s: f64,
    /// Peak dense FLOP/s of one device, in TFLOP/s, for the model FLOPs utilization (MFU).
    /// Default: unset, taken from kiln's table of known GPUs where the device is in it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_tflops: Option<f64>,
    /// Weight of the history in the smoothed throughput (an exponential moving average over
    /// logging windows): 0 keeps only the newest window. Default 0.8.
    pub smoothing: f64,
    /// GPU utilization and power through NVML: `true` asks for them (and says when they cannot
    /// be had), `false` does not try; unset samples what NVML offers and says nothing on a
    /// machine without it. Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<bool>,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            sinks: vec![SinkKind::Jsonl, SinkKind::Csv, SinkKind::Tensorboard],
            interval_s: 1.0,
            peak_tflops: None,
            smoothing: 0.8,
            gpu: None,
        }
    }
}

impl MonitorConfig {
    /// Rejects sampling and throughput settings that cannot work.
    pub fn check(&self) -> Result<()> {
        if !(self.interval_s.is_finite() && self.interval_s >= 0.0) {
            return bad(
                "monitor.interval_s",
                format!(
                    "must be a number of seconds >= 0 (0 turns sampling off), got {}",
                    self.interval_s
                ),
            );
        }
        if let Some(p) = self.peak_tflops
            && !(p.is_finite() && p > 0.0)
        {
            return bad(
                "monitor.peak_tflops",
                format!("must be a positive number of TFLOP/s, got {p}"),
            );
        }
        if !(0.0..1.0).contains(&self.smoothing) {
            return bad(
                "monitor.smoothing",
                format!("must be in [0, 1), got {}", self.smoothing),
            );
        }
        Ok(())
    }
}
