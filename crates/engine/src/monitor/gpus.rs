//! The GPUs through NVML: each one's utilization, memory and power, or one line saying why
//! there is none.

use burn::prelude::Device;

use super::sample::{DeviceSample, MIB};

/// NVML and which GPU each replica runs on.
pub(super) struct Gpus {
    nvml: nvml_wrapper::Nvml,
    /// NVML index of each replica's device.
    index: Vec<Option<u32>>,
}

impl Gpus {
    /// Opens NVML and finds each device's GPU by its PCI address. Returns the one line that
    /// says what will be sampled.
    pub(super) fn open(devices: &[Device]) -> (Option<Self>, String) {
        let skipped = "GPU utilization/power not sampled";
        let nvml = match nvml_wrapper::Nvml::init().or_else(|first| {
            // Driver installs often ship only the versioned name.
            nvml_wrapper::Nvml::builder()
                .lib_path("libnvidia-ml.so.1".as_ref())
                .init()
                .map_err(|_| first)
        }) {
            Ok(n) => n,
            Err(e) => {
                let why = crate::config::one_line(&e);
                return (
                    None,
                    format!("monitor: NVML unavailable ({why}); {skipped}"),
                );
            }
        };
        let count = nvml.device_count().unwrap_or(0);
        let gpus: Vec<(u32, Option<burn::tensor::PciAddress>)> = (0..count)
            .map(|i| {
                let address = nvml
                    .device_by_index(i)
                    .and_then(|d| d.pci_info())
                    .ok()
                    .and_then(|p| p.bus_id.parse().ok());
                (i, address)
            })
            .collect();
        let index: Vec<Option<u32>> = devices
            .iter()
            .map(|d| {
                let address = d.identity()?.physical?.pci_address?;
                gpus.iter()
                    .find(|(_, a)| *a == Some(address))
                    .map(|&(i, _)| i)
            })
            .collect();
        let found: Vec<String> = index
            .iter()
            .enumerate()
            .filter_map(|(r, i)| i.map(|i| format!("dev{r} = GPU {i}")))
            .collect();
        if found.is_empty() {
            (
                None,
                format!("monitor: NVML sees {count} GPU(s), none runs a replica; {skipped}"),
            )
        } else {
            let line = format!("monitor: NVML samples {}", found.join(", "));
            (Some(Self { nvml, index }), line)
        }
    }

    pub(super) fn fill(&self, replica: usize, d: &mut DeviceSample) {
        let Some(Some(i)) = self.index.get(replica) else {
            return;
        };
        let Ok(dev) = self.nvml.device_by_index(*i) else {
            return;
        };
        d.gpu_util = dev.utilization_rates().ok().map(|u| f64::from(u.gpu));
        d.gpu_mem_used_mib = dev.memory_info().ok().map(|m| m.used as f64 / MIB);
        d.power_w = dev.power_usage().ok().map(|mw| f64::from(mw) / 1000.0);
    }
}
