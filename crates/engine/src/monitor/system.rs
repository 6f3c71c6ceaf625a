//! [`SystemMonitor`]: the sampling thread and the records it leaves for rank 0 to drain.

use crate::monitor::proc::status_kib;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::prelude::Device;
use serde_json::{Map, Value};

use super::gpus::Gpus;
use super::proc::{host_cpu_ticks, process_cpu_seconds, thread_cpu_seconds};
use super::sample::{DeviceSample, MIB, SystemSample};
use crate::metrics::DeviceMemoryPeak;

/// What the sampler needs to know about the run.
#[derive(Debug, Clone)]
pub struct MonitorSetup {
    /// Seconds between samples (> 0).
    pub interval: Duration,
    /// One device per replica, in rank order.
    pub devices: Vec<Device>,
    /// The replicas are CPU replicas in their own thread pools (`kiln-worker-R…` threads), so
    /// each one's CPU time can be told apart.
    pub cpu_replicas: bool,
    /// GPU sampling through NVML: `Some(true)` asks for it (and says when it cannot be had),
    /// `Some(false)` does not try, `None` samples what NVML offers and stays silent otherwise.
    pub gpu: Option<bool>,
}

/// The sampler thread and what it produced.
pub struct SystemMonitor {
    notice: Option<String>,
    step: Arc<AtomicUsize>,
    samples: Mutex<Receiver<SystemSample>>,
    latest: Arc<Mutex<Option<SystemSample>>>,
    peaks: Arc<Mutex<Vec<DeviceMemoryPeak>>>,
    stop: Mutex<Option<Sender<()>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl SystemMonitor {
    /// Starts sampling. NVML is opened here: [`SystemMonitor::notice`] says whether GPU
    /// utilization and power are sampled, and why not.
    pub fn start(setup: MonitorSetup) -> Self {
        let (gpus, notice) = match setup.gpu {
            Some(false) => (None, None),
            asked => {
                let (gpus, line) = Gpus::open(&setup.devices);
                // Without a GPU to sample, a run that did not ask for one hears nothing of it.
                let say = gpus.is_some() || asked == Some(true);
                (gpus, say.then_some(line))
            }
        };
        let step = Arc::new(AtomicUsize::new(0));
        let latest = Arc::new(Mutex::new(None));
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let (sample_tx, sample_rx) = mpsc::channel();
        let mut sampler = Sampler::new(setup.clone(), gpus, step.clone());
        let latest_out = latest.clone();
        let peaks = Arc::new(Mutex::new(vec![
            DeviceMemoryPeak::default();
            setup.devices.len()
        ]));
        let peaks_out = peaks.clone();
        let interval = setup.interval;
        let thread = std::thread::Builder::new()
            .name("kiln-monitor".into())
            .spawn(move || {
                loop {
                    let stopping = match stop_rx.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => false,
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => true,
                    };
                    // A last sample on the way out, unless the previous one is only just taken.
                    if !stopping || sampler.since_last() > interval.mul_f64(0.2) {
                        let sample = sampler.sample();
                        if let Ok(mut l) = latest_out.lock() {
                            *l = Some(sample.clone());
                        }
                        if let Ok(mut p) = peaks_out.lock() {
                            for (peak, d) in p.iter_mut().zip(&sample.devices) {
                                d.add_to_peak(peak);
                            }
                        }
                        if sample_tx.send(sample).is_err() {
                            break;
                        }
                    }
                    if stopping {
                        break;
                    }
                }
            })
            .ok();
        Self {
            notice,
            step,
            samples: Mutex::new(sample_rx),
            latest,
            peaks,
            stop: Mutex::new(Some(stop_tx)),
            thread: Mutex::new(thread),
        }
    }

    /// One line on what is sampled and what is not (NVML), when there is something to say:
    /// GPUs found, or GPU sampling asked for (`monitor.gpu = true`) and not possible.
    pub fn notice(&self) -> Option<&str> {
        self.notice.as_deref()
    }

    /// Tells the sampler the last finished step.
    pub fn set_step(&self, step: usize) {
        self.step.store(step, Ordering::Relaxed);
    }

    /// The samples taken since the last call, as records.
    pub fn drain(&self) -> Vec<Map<String, Value>> {
        match self.samples.lock() {
            Ok(rx) => rx.try_iter().map(|s| s.to_record()).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// The newest sample.
    pub fn latest(&self) -> Option<SystemSample> {
        self.latest.lock().ok().and_then(|l| l.clone())
    }

    /// Each device's memory at its most over the samples so far (one per device).
    pub fn memory_peaks(&self) -> Vec<DeviceMemoryPeak> {
        self.peaks.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Stops the thread (after a last sample) and waits for it; later calls do nothing.
    pub fn stop(&self) {
        if let Ok(mut s) = self.stop.lock() {
            s.take();
        }
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for SystemMonitor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The sampler's state between two samples.
struct Sampler {
    setup: MonitorSetup,
    gpus: Option<Gpus>,
    step: Arc<AtomicUsize>,
    started: Instant,
    cores: f64,
    last: Instant,
    last_cpu: Option<f64>,
    last_host: Option<(u64, u64)>,
    last_threads: Option<Vec<f64>>,
}

impl Sampler {
    fn new(setup: MonitorSetup, gpus: Option<Gpus>, step: Arc<AtomicUsize>) -> Self {
        let now = Instant::now();
        let world = setup.devices.len();
        let mut s = Self {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()) as f64,
            started: now,
            last: now,
            last_cpu: process_cpu_seconds(),
            last_host: host_cpu_ticks(),
            last_threads: None,
            setup,
            gpus,
            step,
        };
        s.last_threads = s.replica_cpu_seconds(world);
        s
    }

    fn since_last(&self) -> Duration {
        self.last.elapsed()
    }

    fn replica_cpu_seconds(&self, world: usize) -> Option<Vec<f64>> {
        if !self.setup.cpu_replicas {
            return None;
        }
        thread_cpu_seconds(Path::new("/proc/self/task"), world)
    }

    fn sample(&mut self) -> SystemSample {
        let now = Instant::now();
        let wall = (now - self.last).as_secs_f64().max(1e-9);
        self.last = now;
        let world = self.setup.devices.len();
        let status = std::fs::read_to_string("/proc/self/status").ok();
        let kib = |key: &str| {
            status
                .as_deref()
                .and_then(|s| status_kib(s, key))
                .map(|k| k as f64 / 1024.0)
        };
        let cpu = process_cpu_seconds();
        let cpu_util = match (cpu, self.last_cpu) {
            (Some(now), Some(before)) => Some(100.0 * (now - before) / wall / self.cores),
            _ => None,
        };
        self.last_cpu = cpu;
        let host = host_cpu_ticks();
        let host_cpu_util = match (host, self.last_host) {
            (Some((busy, total)), Some((b0, t0))) if total > t0 => {
                Some(100.0 * busy.saturating_sub(b0) as f64 / (total - t0) as f64)
            }
            _ => None,
        };
        self.last_host = host;
        let threads = self.replica_cpu_seconds(world);
        let share = (self.cores / world as f64).floor().max(1.0);
        let replica_util: Vec<Option<f64>> = match (&threads, &self.last_threads) {
            (Some(now), Some(before)) => now
                .iter()
                .zip(before)
                .map(|(n, b)| Some(100.0 * (n - b).max(0.0) / wall / share))
                .collect(),
            _ => vec![None; world],
        };
        self.last_threads = threads;
        let devices = self
            .setup
            .devices
            .iter()
            .enumerate()
            .map(|(i, device)| {
                let pool = device.memory_pool_usage();
                let mut d = DeviceSample {
                    mem_in_use_mib: pool.map(|p| p.bytes_in_use as f64 / MIB),
                    mem_reserved_mib: pool.map(|p| p.bytes_reserved as f64 / MIB),
                    cpu_util: replica_util.get(i).copied().flatten(),
                    ..DeviceSample::default()
                };
                if let Some(g) = &self.gpus {
                    g.fill(i, &mut d);
                }
                d
            })
            .collect();
        SystemSample {
            time: self.started.elapsed().as_secs_f64(),
            step: self.step.load(Ordering::Relaxed),
            rss_mib: kib("VmRSS"),
            rss_peak_mib: kib("VmHWM"),
            cpu_util,
            host_cpu_util,
            devices,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_leave_absent_values_out() {
        let s = SystemSample {
            time: 2.0,
            step: 7,
            rss_mib: Some(512.0),
            cpu_util: Some(50.0),
            devices: vec![
                DeviceSample {
                    cpu_util: Some(90.0),
                    ..DeviceSample::default()
                },
                DeviceSample {
                    mem_in_use_mib: Some(100.0),
                    mem_reserved_mib: Some(2048.0),
                    gpu_util: Some(97.0),
                    power_w: Some(300.0),
                    ..DeviceSample::default()
                },
            ],
            ..SystemSample::default()
        };
        let r = s.to_record();
        assert_eq!(r["split"], "system");
        assert_eq!(r["step"], 7);
        assert_eq!(r["dev0_cpu_util"], 90.0);
        assert!(!r.contains_key("dev0_mem_in_use_mib"));
        assert!(!r.contains_key("rss_peak_mib"));
        assert_eq!(r["dev1_power_w"], 300.0);
        assert_eq!(
            s.summary_line(),
            "process rss 512 MiB cpu 50% | dev0 cpu 90% | dev1 mem 100 MiB/2.0 GiB gpu 97% 300 W"
        );
    }

    #[test]
    fn the_sampler_samples_and_stops_promptly() {
        let monitor = SystemMonitor::start(MonitorSetup {
            interval: Duration::from_millis(20),
            devices: vec![Device::flex(), Device::flex()],
            cpu_replicas: true,
            gpu: Some(true),
        });
        // Asked for, GPU sampling says what it found (on this machine: no NVML), or, in a
        // build without the `nvml` feature, that it samples none.
        let notice = monitor.notice().expect("asked for GPU sampling");
        let said = if cfg!(feature = "nvml") {
            "monitor: NVML"
        } else {
            "monitor: GPU utilization/power not sampled (built without NVML"
        };
        assert!(notice.starts_with(said), "{notice}");
        let quiet = SystemMonitor::start(MonitorSetup {
            interval: Duration::from_millis(20),
            devices: vec![Device::flex()],
            cpu_replicas: false,
            gpu: Some(false),
        });
        assert_eq!(quiet.notice(), None);
        monitor.set_step(3);
        std::thread::sleep(Duration::from_millis(150));
        let stopped = Instant::now();
        monitor.stop();
        assert!(stopped.elapsed() < Duration::from_secs(2));
        let records = monitor.drain();
        assert!(records.len() >= 2, "{records:?}");
        let last = records.last().unwrap();
        assert_eq!(last["step"], 3);
        if cfg!(target_os = "linux") {
            assert!(last["rss_mib"].as_f64().unwrap() > 1.0, "{last:?}");
            assert!(last["rss_peak_mib"].as_f64() >= last["rss_mib"].as_f64());
            assert!(last.contains_key("cpu_util"));
            // No thread named after a replica ran: each replica's share reads 0.
            assert_eq!(last["dev1_cpu_util"], 0.0);
        }
        // Flex does not report its allocator: absent, not zero.
        assert!(!last.contains_key("dev0_mem_in_use_mib"));
        let times: Vec<f64> = records
            .iter()
            .map(|r| r["time"].as_f64().unwrap())
            .collect();
        assert!(times.windows(2).all(|w| w[0] < w[1]), "{times:?}");
        monitor.stop();
        assert!(monitor.latest().is_some());
    }
}
