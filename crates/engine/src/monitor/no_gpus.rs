//! A build without NVML (kiln-engine without its `nvml` feature): no GPU is sampled, and the
//! monitor's line says why.

use burn::prelude::Device;

use super::sample::DeviceSample;

/// No GPU is sampled in this build.
pub(super) struct Gpus;

impl Gpus {
    /// The one line that says no GPU will be sampled, and what would sample them.
    pub(super) fn open(_devices: &[Device]) -> (Option<Self>, String) {
        let line = "monitor: GPU utilization/power not sampled (built without NVML: \
                    kiln-engine's `nvml` feature)";
        (None, line.to_string())
    }

    pub(super) fn fill(&self, _replica: usize, _d: &mut DeviceSample) {}
}
