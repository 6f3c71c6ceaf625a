//! The devices of the configured accelerator.

use burn::prelude::*;

use crate::config::{Accelerator, HardwareConfig};
use crate::error::{Error, Result};

/// The devices of the configured accelerator, and the accelerator's name.
pub fn resolve_devices(hw: &HardwareConfig) -> Result<(Vec<Device>, String)> {
    let indices = hw.devices.indices();
    let accelerator = match hw.accelerator {
        Accelerator::Auto if cfg!(feature = "cuda") => Accelerator::Cuda,
        Accelerator::Auto => Accelerator::Cpu,
        a => a,
    };
    match accelerator {
        Accelerator::Cpu => Ok((
            indices.iter().map(|_| Device::flex()).collect(),
            "cpu (flex)".into(),
        )),
        Accelerator::Wgpu => {
            // The adapters this machine offers, in the order `train devices` lists them.
            let adapters: Vec<Device> = std::panic::catch_unwind(|| {
                Device::enumerate(burn::tensor::DeviceType::Wgpu)
                    .into_iter()
                    .collect()
            })
            .unwrap_or_default();
            let devices = indices
                .iter()
                .map(|&i| {
                    adapters.get(i).cloned().ok_or_else(|| {
                        Error::Device(format!(
                            "hardware.devices asks for wgpu adapter {i}, but {} found \
                             (see `train devices`)",
                            match adapters.len() {
                                0 => "none was".to_string(),
                                1 => "only 1 was".to_string(),
                                n => format!("only {n} were"),
                            }
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((devices, "wgpu".into()))
        }
        Accelerator::Cuda => cuda_devices(&indices),
        Accelerator::Auto => unreachable!("auto was resolved above"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_devices(indices: &[usize]) -> Result<(Vec<Device>, String)> {
    Ok((
        indices.iter().map(|&i| Device::cuda(i)).collect(),
        "cuda".into(),
    ))
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices(_indices: &[usize]) -> Result<(Vec<Device>, String)> {
    Err(Error::Device(
        "hardware.accelerator = \"cuda\" needs kiln built with the `cuda` feature \
         (cargo run --release --features cuda --bin train ...)"
            .into(),
    ))
}
