//! The system monitor and the throughput arithmetic of the logging block.
//!
//! [`SystemMonitor`] samples, on its own thread every `monitor.interval_s` seconds: the
//! process's resident memory (now and peak) and CPU utilization, the machine's CPU
//! utilization, each replica's share of the CPU (when CPU replicas run in their own thread
//! pools), what Burn's allocator holds on each device (where the backend reports it) and,
//! through NVML, each GPU's utilization, memory and power. Samples are records with
//! `"split": "system"`; rank 0 drains them into the metric sinks when it logs, so the hot
//! loop gains nothing but one atomic store per step.
//!
//! [`peak_tflops`] and [`Ema`] serve the throughput and MFU columns of the training records.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::prelude::Device;
use serde_json::{Map, Value, json};

use crate::metrics::num;

const MIB: f64 = 1024.0 * 1024.0;

/// Dense BF16/FP16 tensor-core peaks in TFLOP/s, from NVIDIA's datasheets, which print the
/// figures "with sparsity" (twice these): H200 SXM and H100 SXM 1,979, H100 NVL 1,671, H100
/// PCIe 1,513, L40S 733, L4 242, A100 624; V100 (no sparsity) 125. Matched against the
/// device's name, most specific first. MFU is reported against these half-precision peaks
/// whatever `precision.mode` is (the usual convention), so an f32 run's MFU is its fraction of
/// the card's bf16 tensor-core peak; `monitor.peak_tflops` sets another reference.
const KNOWN_PEAKS: [(&[&str], f64); 8] = [
    (&["H200"], 989.0),
    (&["H100", "NVL"], 835.0),
    (&["H100", "PCIe"], 756.0),
    (&["H100"], 989.0),
    (&["A100"], 312.0),
    (&["L40S"], 362.0),
    (&["L4"], 121.0),
    (&["V100"], 125.0),
];

/// Peak dense TFLOP/s of one device: `configured` when set, otherwise the table's entry for
/// the device `name` (a GPU's marketing name, e.g. `NVIDIA H100 80GB HBM3`), otherwise none.
pub fn peak_tflops(configured: Option<f64>, name: Option<&str>) -> Option<f64> {
    configured.or_else(|| {
        let name = name?;
        let words: Vec<&str> = name
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        KNOWN_PEAKS
            .iter()
            .find(|(keys, _)| keys.iter().all(|k| words.contains(k)))
            .map(|&(_, peak)| peak)
    })
}

/// An exponential moving average: `smoothing` is the weight of the history.
#[derive(Debug, Clone, Copy)]
pub struct Ema {
    smoothing: f64,
    value: Option<f64>,
}

impl Ema {
    /// An empty average.
    pub fn new(smoothing: f64) -> Self {
        Self {
            smoothing,
            value: None,
        }
    }

    /// Folds `x` in and returns the average; the first value is taken as it is.
    pub fn update(&mut self, x: f64) -> f64 {
        let v = match self.value {
            Some(v) if x.is_finite() => self.smoothing * v + (1.0 - self.smoothing) * x,
            Some(v) => v,
            None => x,
        };
        self.value = Some(v);
        v
    }
}

/// The step-time split as percentages of their sum: data, compute, sync, optimizer.
pub fn split_percent(parts: [f64; 4]) -> [f64; 4] {
    let total: f64 = parts.iter().sum();
    if total > 0.0 {
        parts.map(|p| 100.0 * p / total)
    } else {
        [0.0; 4]
    }
}

/// The throughput columns of the training records: tokens, per-device rates, smoothed rates,
/// MFU and the step-time split in percent.
#[derive(Debug, Clone)]
pub struct Throughput {
    world: usize,
    tokens_per_sample: Option<f64>,
    flops_per_sample: Option<f64>,
    /// Peak FLOP/s of all devices together.
    peak_flops: Option<f64>,
    samples_ema: Ema,
    tokens_ema: Ema,
}

impl Throughput {
    /// For `world` devices of `peak_tflops` each, training a model of `flops_per_sample`
    /// (forward and backward) on samples of `tokens_per_sample` tokens.
    pub fn new(
        world: usize,
        tokens_per_sample: Option<usize>,
        flops_per_sample: Option<f64>,
        peak_tflops: Option<f64>,
        smoothing: f64,
    ) -> Self {
        Self {
            world: world.max(1),
            tokens_per_sample: tokens_per_sample.map(|t| t as f64),
            flops_per_sample,
            peak_flops: peak_tflops.map(|p| p * 1e12 * world.max(1) as f64),
            samples_ema: Ema::new(smoothing),
            tokens_ema: Ema::new(smoothing),
        }
    }

    /// Adds the columns for a window that trained `rate` samples per second and spent
    /// `times` (data, compute, sync, optimizer) in each part of a step; returns the words the
    /// progress display adds.
    pub fn annotate(
        &mut self,
        record: &mut Map<String, Value>,
        rate: f64,
        times: [f64; 4],
    ) -> String {
        let world = self.world as f64;
        let mut put = |k: &str, v: f64| {
            record.insert(k.to_string(), num(v));
        };
        let smooth = self.samples_ema.update(rate);
        put("samples_per_sec_ema", smooth);
        put("samples_per_sec_per_device", rate / world);
        let mut words = match self.tokens_per_sample {
            Some(t) => {
                put("tokens_per_sec", rate * t);
                put("tokens_per_sec_ema", self.tokens_ema.update(rate * t));
                put("tokens_per_sec_per_device", rate * t / world);
                format!("{:.0} tokens/s", smooth * t)
            }
            None => format!("{smooth:.0} samples/s"),
        };
        if let (Some(f), Some(peak)) = (self.flops_per_sample, self.peak_flops) {
            let mfu = rate * f / peak;
            put("mfu", mfu);
            words += &format!(" mfu {:.1}%", 100.0 * mfu);
        }
        let pct = split_percent(times);
        for (key, p) in ["pct_data", "pct_compute", "pct_sync", "pct_optim"]
            .iter()
            .zip(pct)
        {
            put(key, p);
        }
        words += &format!(
            " | data {:.0}% compute {:.0}% sync {:.0}% optim {:.0}%",
            pct[0], pct[1], pct[2], pct[3]
        );
        words
    }
}

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

fn mib(x: f64) -> String {
    if x >= 1024.0 {
        format!("{:.1} GiB", x / 1024.0)
    } else {
        format!("{x:.0} MiB")
    }
}

/// The sampler thread and what it produced.
pub struct SystemMonitor {
    notice: Option<String>,
    step: Arc<AtomicUsize>,
    samples: Mutex<Receiver<SystemSample>>,
    latest: Arc<Mutex<Option<SystemSample>>>,
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

/// NVML and which GPU each replica runs on.
struct Gpus {
    nvml: nvml_wrapper::Nvml,
    /// NVML index of each replica's device.
    index: Vec<Option<u32>>,
}

impl Gpus {
    /// Opens NVML and finds each device's GPU by its PCI address. Returns the one line that
    /// says what will be sampled.
    fn open(devices: &[Device]) -> (Option<Self>, String) {
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

    fn fill(&self, replica: usize, d: &mut DeviceSample) {
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

/// A memory field of this process's `/proc/self/status` (`VmRSS`, `VmHWM`), in MiB; `None`
/// where there is no such file.
pub fn process_memory_mib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status_kib(&status, key).map(|k| k as f64 / 1024.0)
}

/// A `Key:   123 kB` field of `/proc/<pid>/status`, in KiB.
fn status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// User + system CPU seconds of the whole process so far.
#[cfg(unix)]
fn process_cpu_seconds() -> Option<f64> {
    // SAFETY: getrusage writes one plain struct that we own.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return None;
        }
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some(secs(usage.ru_utime) + secs(usage.ru_stime))
}

#[cfg(not(unix))]
fn process_cpu_seconds() -> Option<f64> {
    None
}

/// Clock ticks per second of `/proc` CPU times.
fn clock_ticks() -> f64 {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads a configuration value.
        let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if t > 0 {
            return t as f64;
        }
    }
    100.0
}

/// (busy, total) ticks of all CPUs from `/proc/stat`.
fn host_cpu_ticks() -> Option<(u64, u64)> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

fn parse_proc_stat(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// CPU seconds of each replica's threads (`kiln-worker-R` and its pool), from the per-thread
/// `stat` files under `task_dir`.
fn thread_cpu_seconds(task_dir: &Path, world: usize) -> Option<Vec<f64>> {
    let ticks = clock_ticks();
    let mut per_rank = vec![0.0; world];
    for entry in std::fs::read_dir(task_dir).ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((rank, t)) = parse_thread_stat(&stat)
            && let Some(slot) = per_rank.get_mut(rank)
        {
            *slot += t as f64 / ticks;
        }
    }
    Some(per_rank)
}

/// The replica rank named by a thread's `stat` line, and its user + system ticks.
fn parse_thread_stat(stat: &str) -> Option<(usize, u64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let digits: String = comm
        .strip_prefix("kiln-worker-")?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let rank = digits.parse().ok()?;
    // After the name: state (field 3), ..., utime (14), stime (15).
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((rank, utime + stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_table_matches_names_most_specific_first() {
        assert_eq!(
            peak_tflops(None, Some("NVIDIA H100 80GB HBM3")),
            Some(989.0)
        );
        assert_eq!(peak_tflops(None, Some("NVIDIA H100 PCIe")), Some(756.0));
        assert_eq!(peak_tflops(None, Some("NVIDIA H100 NVL")), Some(835.0));
        assert_eq!(peak_tflops(None, Some("NVIDIA H200")), Some(989.0));
        assert_eq!(
            peak_tflops(None, Some("NVIDIA A100-SXM4-80GB")),
            Some(312.0)
        );
        assert_eq!(peak_tflops(None, Some("NVIDIA L4")), Some(121.0));
        assert_eq!(peak_tflops(None, Some("NVIDIA L40S")), Some(362.0));
        assert_eq!(peak_tflops(None, Some("AMD Ryzen 7 PRO 4750U")), None);
        assert_eq!(peak_tflops(None, None), None);
        assert_eq!(peak_tflops(Some(2.5), Some("NVIDIA H100")), Some(2.5));
    }

    #[test]
    fn ema_starts_at_the_first_value_and_weighs_history() {
        let mut e = Ema::new(0.75);
        assert_eq!(e.update(100.0), 100.0);
        assert_eq!(e.update(200.0), 125.0);
        assert_eq!(e.update(f64::NAN), 125.0);
        let mut none = Ema::new(0.0);
        none.update(1.0);
        assert_eq!(none.update(7.0), 7.0);
    }

    #[test]
    fn split_percentages_sum_to_one_hundred() {
        let p = split_percent([1.0, 6.0, 2.0, 1.0]);
        assert_eq!(p, [10.0, 60.0, 20.0, 10.0]);
        assert_eq!(split_percent([0.0; 4]), [0.0; 4]);
    }

    #[test]
    fn throughput_columns_follow_from_the_rate() {
        let mut t = Throughput::new(2, Some(64), Some(6.0e6 * 64.0), Some(1.0), 0.5);
        let mut r = Map::new();
        let words = t.annotate(&mut r, 100.0, [1.0, 7.0, 1.0, 1.0]);
        assert_eq!(r["tokens_per_sec"], 6400.0);
        assert_eq!(r["tokens_per_sec_per_device"], 3200.0);
        assert_eq!(r["samples_per_sec_per_device"], 50.0);
        assert_eq!(r["samples_per_sec_ema"], 100.0);
        // 100 samples/s × 3.84e8 FLOPs ÷ (2 devices × 1e12 FLOP/s)
        assert!((r["mfu"].as_f64().unwrap() - 0.0192).abs() < 1e-12);
        assert_eq!(r["pct_compute"], 70.0);
        assert!(words.contains("mfu 1.9%"), "{words}");
        t.annotate(&mut r, 200.0, [1.0, 1.0, 1.0, 1.0]);
        assert_eq!(r["samples_per_sec_ema"], 150.0);
        assert_eq!(r["pct_sync"], 25.0);
        let mut images = Throughput::new(1, None, None, Some(1.0), 0.5);
        let mut r = Map::new();
        images.annotate(&mut r, 10.0, [0.0; 4]);
        assert!(!r.contains_key("mfu") && !r.contains_key("tokens_per_sec"));
    }

    #[test]
    fn proc_files_parse() {
        let status = "Name:\ttrain\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(status_kib(status, "VmRSS"), Some(102_400));
        assert_eq!(status_kib(status, "VmHWM"), Some(204_800));
        assert_eq!(status_kib(status, "VmSwap"), None);
        let stat = "cpu  100 5 50 800 40 3 2 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        // busy = user + nice + system + irq + softirq + steal; idle = idle + iowait
        assert_eq!(parse_proc_stat(stat), Some((160, 1000)));
        let thread = "4242 (kiln-worker-1-p) S 1 2 3 4 5 6 7 8 9 10 250 30 0 0 20 0 1 0";
        assert_eq!(parse_thread_stat(thread), Some((1, 280)));
        let other = "4243 (train) R 1 2 3 4 5 6 7 8 9 10 250 30 0 0 20 0 1 0";
        assert_eq!(parse_thread_stat(other), None);
        let odd = "4244 (kiln-worker-12) S 1 2 3 4 5 6 7 8 9 10 7 3";
        assert_eq!(parse_thread_stat(odd), Some((12, 10)));
    }

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
        // Asked for, GPU sampling says what it found (on this machine: no NVML).
        let notice = monitor.notice().expect("asked for GPU sampling");
        assert!(notice.starts_with("monitor: NVML"), "{notice}");
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
