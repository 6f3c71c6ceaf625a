//! How a CPU device uses its cores.
//!
//! Flex's kernels spread one replica's work over the cores, and lose much of their efficiency
//! as the batch grows on a small cache; one-thread replicas with a share of the batch each
//! (what data parallelism does across devices) train the same samples faster. With
//! `hardware.cpu_split = "auto"`, the launcher runs each CPU device as per-core sub-replicas:
//! `K` ranks of `batch / K` samples, one core each, their gradients averaged as one device
//! averages its batch — the `ddp` step over `devices × K` ranks. The sampler gives the `K`
//! sub-replicas exactly the samples the device would take, a model with BatchNorm normalises
//! with the statistics of the device's whole batch (synchronised BatchNorm), and checkpoints
//! do not record the split, so any checkpoint resumes with any core count.

use burn::prelude::*;

use crate::config::{CpuSplit, RecomputeMode, RootConfig, StrategyKind, name_of};
use crate::error::{Error, Result};
use crate::strategy::ModelFacts;
use crate::trainer::TrainerSettings;

/// Sub-replicas per device, and what the start-up table says of the choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreSplit {
    /// Ranks each device runs as (1: no split).
    pub per_device: usize,
    /// The strategy the sub-replicas run under (the strategy's rules say).
    strategy: Option<StrategyKind>,
    /// The start-up table's words; `None` off the CPU.
    pub words: Option<String>,
}

/// Why a model's BatchNorm statistics cannot be kept to a device's whole batch when replicas
/// share it (synchronising them walks the model's blocks); `None` where they can, or where the
/// model has no BatchNorm.
fn batchnorm_unsynced(config: &RootConfig, facts: &ModelFacts) -> Option<&'static str> {
    if !facts.buffers {
        None
    } else if facts.blocks == 0 {
        Some("it describes no blocks")
    } else if config.recompute.mode == RecomputeMode::Blocks {
        Some("recompute.mode = \"blocks\"")
    } else if !facts.groups.is_empty() {
        Some("it steps several parameter groups")
    } else {
        None
    }
}

impl CoreSplit {
    fn off(why: String) -> Self {
        Self {
            per_device: 1,
            strategy: None,
            words: Some(format!("one replica per device ({why})")),
        }
    }

    /// The split of a run of `config` on `devices` devices of this process (`cpu`: on the CPU
    /// accelerator) out of `processes`, for a model with `facts`, on
    /// `hardware.cpu_cores` cores.
    pub fn plan(
        config: &RootConfig,
        devices: usize,
        cpu: bool,
        processes: usize,
        facts: &ModelFacts,
    ) -> Result<Self> {
        let cores = config.hardware.cores();
        if !cpu {
            return Self::on_a_gpu(config, devices, facts);
        }
        if config.hardware.replicas_per_device > 1 {
            return Err(Error::config(format!(
                "hardware.replicas_per_device = {} is a GPU's, and this run is on the CPU \
                 (there hardware.cpu_split runs a device as per-core sub-replicas)",
                config.hardware.replicas_per_device
            )));
        }
        let per_device = (cores / devices).max(1);
        if config.hardware.cpu_split == CpuSplit::Off {
            return Ok(Self::off(format!(
                "hardware.cpu_split = \"off\"; its kernels share {per_device} core(s)"
            )));
        }
        if processes > 1 {
            return Ok(Self::off(
                "several processes share the machine's cores".into(),
            ));
        }
        if config.parallel.tp > 1 {
            return Ok(Self::off(
                "tensor parallelism splits the model over devices".into(),
            ));
        }
        let asked = config.strategy.name.resolve(devices);
        let Some(strategy) = crate::strategy::rules(asked).core_split() else {
            return Ok(Self::off(format!(
                "{} shards or stages the model over devices",
                name_of(&asked)
            )));
        };
        if per_device < 2 {
            return Ok(Self::off(format!("{per_device} core per device")));
        }
        if let Some(why) = batchnorm_unsynced(config, facts) {
            return Ok(Self::off(format!(
                "the model's BatchNorm would see per-core statistics and synchronising \
                 them is not possible here: {why}"
            )));
        }
        let batch = config.train.batch_size;
        let Some(k) = (2..=per_device).rev().find(|k| batch.is_multiple_of(*k)) else {
            return Ok(Self::off(format!(
                "batch {batch} does not split evenly over {per_device} cores"
            )));
        };
        Ok(Self {
            per_device: k,
            strategy: Some(strategy),
            words: Some(format!(
                "{k} per-core sub-replicas of {} samples per device, gradients averaged as one \
                 device{} (hardware.cpu_split = \"off\" runs one replica)",
                batch / k,
                if facts.buffers {
                    ", BatchNorm statistics over the device's batch"
                } else {
                    ""
                }
            )),
        })
    }

    /// A GPU's split: `hardware.replicas_per_device` ranks on each card, the device's batch
    /// shared among them as per-core sub-replicas share a CPU device's — one replica against
    /// two at the same global batch measures what the exchange of gradients over the host
    /// costs. Refused in one line where the strategy, the batch or the model cannot be split so.
    fn on_a_gpu(config: &RootConfig, devices: usize, facts: &ModelFacts) -> Result<Self> {
        let k = config.hardware.replicas_per_device;
        if k < 2 {
            return Ok(Self {
                per_device: 1,
                strategy: None,
                words: None,
            });
        }
        let refuse = |why: String| {
            Err(Error::config(format!(
                "hardware.replicas_per_device = {k}: {why}"
            )))
        };
        let asked = config.strategy.name.resolve(devices);
        let Some(strategy) = crate::strategy::rules(asked).core_split() else {
            return refuse(format!(
                "{} shards or stages the model over devices; replicas on one device run \
                 single or ddp",
                name_of(&asked)
            ));
        };
        if config.parallel.tp > 1 {
            return refuse("tensor parallelism splits the model over devices".into());
        }
        let batch = config.train.batch_size;
        if !batch.is_multiple_of(k) {
            return refuse(format!(
                "batch {batch} does not split evenly over {k} replicas"
            ));
        }
        if let Some(why) = batchnorm_unsynced(config, facts) {
            return refuse(format!(
                "the model's BatchNorm statistics cannot be synchronised over the replicas: \
                 {why}"
            ));
        }
        Ok(Self {
            per_device: k,
            strategy: Some(strategy),
            words: Some(format!(
                "{k} replicas of {} samples per device, gradients averaged over the host as \
                 one device's (hardware.replicas_per_device)",
                batch / k
            )),
        })
    }

    /// `settings` (built for the user's devices) with every device run as this split's
    /// sub-replicas: `per_device` ranks each, the batch shared among them, the strategy the
    /// asked one's rules name for them, and synchronised BatchNorm for a model with BatchNorm.
    pub fn apply(&self, settings: &mut TrainerSettings, facts: &ModelFacts) {
        let p = &mut settings.parallel;
        p.cores = self.words.clone();
        if self.per_device < 2 {
            return;
        }
        let (k, Some(strategy)) = (self.per_device, self.strategy) else {
            return;
        };
        p.devices = p
            .devices
            .iter()
            .flat_map(|d| std::iter::repeat_n(d.clone(), k))
            .collect::<Vec<Device>>();
        p.sub_replicas = k;
        p.strategy = strategy;
        p.sync_batchnorm |= facts.buffers;
        settings.train.batch_size /= k;
    }
}
