//! What one sample of the system monitor holds: the process, the machine and each device,
//! as a record whose absent values are left out.

use serde_json::{Map, Value, json};

use crate::metrics::{DeviceMemoryPeak, num};

pub(super) const MIB: f64 = 1024.0 * 1024.0;

/// One reading of the system.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SystemSample {
    /// Seconds since the monitor started.
    pub time: f64,
    /// The last optimizer step rank 0 had finished.
    pub step: usize,
    /// Resident memory of the process, MiB.
    pub rss_mib: Option<f64>,
    /// Peak resident memory of the process, MiB.
    pub rss_peak_mib: Option<f64>,
    /// CPU time of the process over the interval, percent of all cores.
    pub cpu_util: Option<f64>,
    /// CPU time of the whole machine over the interval, percent of all cores.
    pub host_cpu_util: Option<f64>,
    /// One entry per replica.
    pub devices: Vec<DeviceSample>,
}

/// One replica's device in a [`SystemSample`]; `None` where nothing answers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceSample {
    /// Bytes of live allocations in Burn's pool, MiB.
    pub mem_in_use_mib: Option<f64>,
    /// Bytes Burn's pool holds from the device, MiB.
    pub mem_reserved_mib: Option<f64>,
    /// CPU time of the replica's threads, percent of its share of the cores.
    pub cpu_util: Option<f64>,
    /// NVML: percent of the interval a kernel ran.
    pub gpu_util: Option<f64>,
    /// NVML: device memory in use (all processes), MiB.
    pub gpu_mem_used_mib: Option<f64>,
    /// NVML: board power draw, W.
    pub power_w: Option<f64>,
}

impl DeviceSample {
    /// Takes this sample's memory figures into `peak`.
    pub fn add_to_peak(&self, peak: &mut DeviceMemoryPeak) {
        let most = |peak: &mut Option<f64>, v: Option<f64>| {
            if let Some(v) = v {
                *peak = Some(peak.map_or(v, |p| p.max(v)));
            }
        };
        most(&mut peak.pool_in_use_mib, self.mem_in_use_mib);
        most(&mut peak.pool_reserved_mib, self.mem_reserved_mib);
        most(&mut peak.gpu_mem_used_mib, self.gpu_mem_used_mib);
    }
}

impl SystemSample {
    /// The sample as a metrics record (`split` = `system`); absent values are left out.
    pub fn to_record(&self) -> Map<String, Value> {
        let mut r = Map::new();
        r.insert("step".into(), json!(self.step));
        r.insert("split".into(), json!("system"));
        r.insert("time".into(), num(self.time));
        let mut put = |key: String, v: Option<f64>| {
            if let Some(v) = v {
                r.insert(key, num(v));
            }
        };
        put("rss_mib".into(), self.rss_mib);
        put("rss_peak_mib".into(), self.rss_peak_mib);
        put("cpu_util".into(), self.cpu_util);
        put("host_cpu_util".into(), self.host_cpu_util);
        for (i, d) in self.devices.iter().enumerate() {
            put(format!("dev{i}_mem_in_use_mib"), d.mem_in_use_mib);
            put(format!("dev{i}_mem_reserved_mib"), d.mem_reserved_mib);
            put(format!("dev{i}_cpu_util"), d.cpu_util);
            put(format!("dev{i}_gpu_util"), d.gpu_util);
            put(format!("dev{i}_gpu_mem_used_mib"), d.gpu_mem_used_mib);
            put(format!("dev{i}_power_w"), d.power_w);
        }
        r
    }

    /// One line for the live view: process memory and CPU, then each device.
    pub fn summary_line(&self) -> String {
        let mut parts = Vec::new();
        let mut head = String::from("process");
        if let Some(rss) = self.rss_mib {
            head += &format!(" rss {}", mib(rss));
        }
        if let Some(c) = self.cpu_util {
            head += &format!(" cpu {c:.0}%");
        }
        parts.push(head);
        for (i, d) in self.devices.iter().enumerate() {
            let mut s = format!("dev{i}");
            let before = s.len();
            if let Some(m) = d.mem_in_use_mib {
                s += &format!(" mem {}", mib(m));
                if let Some(r) = d.mem_reserved_mib {
                    s += &format!("/{}", mib(r));
                }
            } else if let Some(m) = d.gpu_mem_used_mib {
                s += &format!(" mem {}", mib(m));
            }
            if let Some(u) = d.gpu_util {
                s += &format!(" gpu {u:.0}%");
            }
            if let Some(u) = d.cpu_util {
                s += &format!(" cpu {u:.0}%");
            }
            if let Some(w) = d.power_w {
                s += &format!(" {w:.0} W");
            }
            if s.len() > before {
                parts.push(s);
            }
        }
        parts.join(" | ")
    }
}

pub(super) fn mib(x: f64) -> String {
    if x >= 1024.0 {
        format!("{:.1} GiB", x / 1024.0)
    } else {
        format!("{x:.0} MiB")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_devices_memory_peak_keeps_each_figures_most_and_nothing_unsampled() {
        let mut peak = DeviceMemoryPeak::default();
        assert!(peak.is_empty());
        let sample = |live, held| DeviceSample {
            mem_in_use_mib: Some(live),
            mem_reserved_mib: Some(held),
            ..DeviceSample::default()
        };
        sample(300.0, 1000.0).add_to_peak(&mut peak);
        sample(5000.0, 900.0).add_to_peak(&mut peak);
        sample(200.0, 6000.0).add_to_peak(&mut peak);
        assert_eq!(peak.pool_in_use_mib, Some(5000.0));
        assert_eq!(peak.pool_reserved_mib, Some(6000.0));
        // NVML never answered: no figure rather than a zero.
        assert_eq!(peak.gpu_mem_used_mib, None);
        assert!(!peak.is_empty());
    }
}
