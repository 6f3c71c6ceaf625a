//! Run output on rank 0: metrics (`metrics.jsonl`, `metrics.csv`, TensorBoard), `summary.json`
//! and the progress display.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::config::SinkKind;
use crate::error::{Error, Result};
use crate::sinks::{CsvSink, TensorBoardSink};

/// Rank 0's metric output: `metrics.jsonl` and the other configured sinks. A sink that fails
/// to open or to write prints one warning and is dropped; training goes on.
pub struct MetricsWriter {
    sinks: Vec<(SinkKind, Sink)>,
}

enum Sink {
    Jsonl(PathBuf, std::fs::File),
    Csv(Box<CsvFiles>),
    TensorBoard(TensorBoardSink),
}

/// `metrics.csv` for training and validation records, and `system.csv` for the system
/// monitor's, whose columns (which depend on the devices) are those of its first record.
struct CsvFiles {
    main: CsvSink,
    system: Option<CsvSink>,
    run_dir: PathBuf,
    keep_until: Option<usize>,
}

impl CsvFiles {
    fn write(&mut self, record: &Map<String, Value>) -> Result<()> {
        if record.get("split").and_then(Value::as_str) != Some(SYSTEM_SPLIT) {
            return self.main.write(record);
        }
        let system = match &mut self.system {
            Some(s) => s,
            None => {
                let mut columns = vec!["step".to_string(), "time".to_string()];
                columns.extend(
                    record
                        .keys()
                        .filter(|k| !matches!(k.as_str(), "step" | "time" | "split"))
                        .cloned(),
                );
                let path = self.run_dir.join("system.csv");
                self.system
                    .insert(CsvSink::create(&path, columns, self.keep_until)?)
            }
        };
        system.write(record)
    }
}

/// The `split` of the system monitor's records.
pub const SYSTEM_SPLIT: &str = "system";

impl MetricsWriter {
    /// Opens the sinks in `run_dir`, keeping the records of an earlier run up to step
    /// `keep_until` (so that a resumed run continues its files without the steps it redoes).
    pub fn open(run_dir: &Path, kinds: &[SinkKind], keep_until: Option<usize>) -> Self {
        let mut sinks = Vec::new();
        for &kind in kinds {
            let opened = match kind {
                SinkKind::Jsonl => open_jsonl(run_dir, keep_until).map(|(p, f)| Sink::Jsonl(p, f)),
                SinkKind::Csv => CsvSink::open(run_dir, keep_until).map(|main| {
                    Sink::Csv(Box::new(CsvFiles {
                        main,
                        system: None,
                        run_dir: run_dir.to_path_buf(),
                        keep_until,
                    }))
                }),
                SinkKind::Tensorboard => TensorBoardSink::open(run_dir).map(Sink::TensorBoard),
            };
            match opened {
                Ok(sink) => sinks.push((kind, sink)),
                Err(e) => eprintln!("warning: metrics sink {kind:?} disabled: {e}"),
            }
        }
        Self { sinks }
    }

    /// Writes one record to every sink still working.
    pub fn write(&mut self, record: &Map<String, Value>) {
        self.sinks.retain_mut(|(kind, sink)| {
            let written = match sink {
                Sink::Jsonl(path, file) => {
                    let line = serde_json::to_string(record).expect("metrics serialise");
                    writeln!(file, "{line}").map_err(|e| Error::io(path, e))
                }
                Sink::Csv(csv) => csv.write(record),
                Sink::TensorBoard(tb) => tb.write(record),
            };
            match written {
                Ok(()) => true,
                Err(e) => {
                    eprintln!("warning: metrics sink {kind:?} disabled: {e}");
                    false
                }
            }
        });
    }
}

fn open_jsonl(run_dir: &Path, keep_until: Option<usize>) -> Result<(PathBuf, std::fs::File)> {
    let path = run_dir.join("metrics.jsonl");
    let kept: Vec<String> = match keep_until {
        Some(limit) if path.exists() => {
            let f = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
            std::io::BufReader::new(f)
                .lines()
                .map_while(std::result::Result::ok)
                .filter(|line| {
                    serde_json::from_str::<Value>(line)
                        .ok()
                        .and_then(|v| v.get("step").and_then(Value::as_u64))
                        .is_some_and(|s| s as usize <= limit)
                })
                .collect()
        }
        _ => Vec::new(),
    };
    let mut file = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
    for line in kept {
        writeln!(file, "{line}").map_err(|e| Error::io(&path, e))?;
    }
    Ok((path, file))
}

/// Reads every record of a `metrics.jsonl`.
pub fn read_metrics(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l)
                .map_err(|e| Error::Io(format!("{}: bad line {l:?}: {e}", path.display())))
        })
        .collect()
}

/// The final numbers of a run, written to `summary.json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Optimizer steps taken.
    pub steps: usize,
    /// Epochs completed (fractional when stopped mid-epoch).
    pub epochs: f64,
    /// Mean training loss of the last logged window.
    pub final_train_loss: Option<f64>,
    /// Loss on the validation set at the end.
    pub val_loss: Option<f64>,
    /// Accuracy on the validation set at the end, for classifiers.
    pub val_accuracy: Option<f64>,
    /// Seconds spent training (across resumes).
    pub wall_seconds: f64,
    /// Training samples per second over the whole run.
    pub samples_per_sec: f64,
    /// Number of devices over every process (a CPU device's per-core sub-replicas count as
    /// the one device they are).
    pub devices: usize,
    /// Ranks each device ran as: its per-core sub-replicas on the CPU (`hardware.cpu_split`),
    /// 1 otherwise.
    pub sub_replicas: usize,
    /// Number of processes (1 without a launcher).
    pub processes: usize,
    /// The signal that stopped the run early (after a checkpoint), if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_by: Option<String>,
    /// Why early stopping ended the run before its last step (after a checkpoint), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_early: Option<String>,
    /// Parameters that trained (elements; LoRA adapters, not frozen weights).
    pub params_trainable: usize,
    /// Parameters of the model (elements; frozen weights and adapters included).
    pub params_total: usize,
    /// Parallel strategy (of the data dimension, under tensor parallelism).
    pub strategy: String,
    /// Ranks of one tensor-parallel group (`parallel.tp`; 1: none).
    pub tp: usize,
    /// The floats each tensor-parallel group all-reduces per step, as the model predicts them
    /// (the log's `tp_floats_per_step` is what was measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_floats_predicted: Option<usize>,
    /// Numeric precision.
    pub precision: String,
    /// Accelerator the replicas ran on.
    pub accelerator: String,
    /// Activation checkpointing (`none`, `balanced`, `blocks`).
    pub recompute: String,
    /// Median over logging windows of the training time per optimizer step (data, compute,
    /// sync and optimizer; validation and checkpoints excluded), in seconds.
    pub step_seconds: Option<f64>,
    /// Training FLOPs (forward and backward) of one sample as the model counts them (`None`
    /// for a model that does not): times the samples per second, the FLOP/s achieved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops_per_sample: Option<f64>,
    /// Resident memory of the process when training started (model, optimizer, data
    /// loaded), in MiB; Linux only.
    pub start_rss_mib: Option<f64>,
    /// Peak resident memory of the process from the start of training (its ranks built) to
    /// the end of the run, in MiB; Linux only.
    pub peak_rss_mib: Option<f64>,
    /// Peak resident memory of the process before training started — the planner's probes,
    /// the data and the weights read — in MiB; Linux only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup_peak_rss_mib: Option<f64>,
    /// The most bytes live on the heap at once in the process (every rank of it) from the
    /// start of training to the end of the run, in MiB, as kiln's allocator counts them
    /// (`None` in a program that declares another global allocator). Below the resident set
    /// size, which also holds the pages the allocator keeps after a free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_heap_mib: Option<f64>,
    /// Under `hardware.memory_limit_mib` on the CPU, how many times the process's ranks (all of
    /// them, counted together) handed the freed pages the allocator keeps back to the system at
    /// a step's end, the process's resident memory being past the limit ÷ 1.1
    /// (`heap::hold_under`); `None` without a limit, or on a GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_holds: Option<usize>,
    /// The most parameter bytes each rank held at once (master and compute copies, gathered
    /// units), counted by the strategy; index = rank.
    pub param_bytes_per_rank: Vec<usize>,
    /// The most gradient bytes each rank held at once.
    pub grad_bytes_per_rank: Vec<usize>,
    /// The most optimizer-state bytes each rank held at once.
    pub optim_bytes_per_rank: Vec<usize>,
    /// The most parameter, gradient and optimizer-state bytes each rank held together.
    pub peak_bytes_per_rank: Vec<usize>,
    /// Bytes of frozen parameters each rank held (`[finetune]`; not in the figures above).
    pub frozen_bytes_per_rank: Vec<usize>,
    /// The most bytes each device's memory pool had in use at the end of a micro-batch (the
    /// activations freed), where the backend reports a pool (not on the CPU);
    /// `device_memory_peak` has the monitor's figures, taken at any point of a step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_peak_bytes_per_rank: Option<Vec<u64>>,
    /// Each of this process's devices' memory at its most as the monitor sampled it, on a GPU:
    /// Burn's pool (live and held bytes) and NVML's figure for the card. Unlike
    /// `pool_peak_bytes_per_rank`, which the strategy reads between micro-batches when the
    /// activations are gone, a sample may fall inside a backward. `None` on the CPU or without
    /// the monitor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_memory_peak: Option<Vec<DeviceMemoryPeak>>,
    /// The pools that carve the first device's memory into pages, as its allocator reports
    /// them at the run's end (CubeCL's, on a GPU: every thread's stream has its own): what
    /// `pool_reserved_mib` is made of. `None` where the backend reports none (the CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_pools: Option<Vec<PoolPages>>,
    /// What the planner predicted for this run's settings before it started, beside the
    /// measured `peak_rss_mib` and `step_seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanRecord>,
    /// Each checkpoint's seconds on the step's path in this attempt of the run (gathering the
    /// state, and writing it unless `train.checkpoint_async` writes it in the background), in
    /// order; not counted in `step_seconds`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checkpoint_stall_s: Vec<f64>,
    /// The process's heap peak (`peak_heap_mib`) as the first checkpoint began: the steps' own
    /// peak, against which `peak_heap_mib` shows what the checkpoints added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_heap_before_checkpoints_mib: Option<f64>,
}

/// One device's memory at its most over the samples of a run (a GPU's; the CPU has no pool);
/// `None` where nothing was sampled. The samples fall every `monitor.interval_s`, so a peak
/// between two is missed.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DeviceMemoryPeak {
    /// The most bytes live in Burn's memory pool in a sample, MiB.
    pub pool_in_use_mib: Option<f64>,
    /// The most bytes Burn's pool held from the device in a sample, MiB.
    pub pool_reserved_mib: Option<f64>,
    /// NVML: the most memory in use on the card in a sample (every process's, the runtime's
    /// own context included), MiB.
    pub gpu_mem_used_mib: Option<f64>,
}

impl DeviceMemoryPeak {
    /// Whether no figure was ever sampled.
    pub fn is_empty(&self) -> bool {
        self.pool_in_use_mib.is_none()
            && self.pool_reserved_mib.is_none()
            && self.gpu_mem_used_mib.is_none()
    }
}

/// One pool of a device's allocator that carves its memory into pages of one size.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PoolPages {
    /// The size of each page, MiB.
    pub page_mib: f64,
    /// Pages held at the run's end.
    pub pages: u64,
    /// The most pages held at once.
    pub pages_peak: u64,
    /// The largest single allocation the pool served, MiB.
    pub largest_alloc_mib: f64,
}

/// The planner's figures for a run's own settings, kept in its `summary.json` beside what
/// happened.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PlanRecord {
    /// Predicted peak resident memory of the process, in MiB (on a GPU, its devices' sum).
    pub peak_rss_mib: f64,
    /// Predicted peak bytes of one device, in MiB.
    pub peak_device_mib: f64,
    /// Predicted seconds per optimizer step.
    pub step_seconds: f64,
    /// The file of the planner's kept measurements that this prediction read back whole, on
    /// the CPU (`None` where it measured now or keeps nothing): the run checks them against
    /// its own peak ([`crate::plan::check_kept`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept: Option<std::path::PathBuf>,
    /// What the run found of those kept measurements: dropped, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_check: Option<String>,
}

/// Progress display: on a terminal a bar with ETA and the latest numbers, with a second line
/// for the devices; otherwise plain log lines carrying the same.
pub struct Progress {
    bar: Option<ProgressBar>,
    /// Under a launcher, the thread that prints the plain lines.
    printer: Option<Printer>,
    total: usize,
    start: usize,
    started: std::time::Instant,
}

/// A thread that prints lines for the training loop, so that a reader who stops reading (a
/// launcher taking the job down stops forwarding output) never blocks a step on a full pipe:
/// lines it cannot take are dropped.
struct Printer {
    lines: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<String>>>,
    done: std::sync::mpsc::Receiver<()>,
}

impl Printer {
    fn start() -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<String>(4096);
        let (done_tx, done) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("kiln-console".into())
            .spawn(move || {
                let mut out = std::io::stdout();
                for line in rx {
                    let _ = writeln!(out, "{line}");
                    let _ = out.flush();
                }
                let _ = done_tx.send(());
            })
            .expect("spawn the console thread");
        Self {
            lines: std::sync::Mutex::new(Some(tx)),
            done,
        }
    }

    fn print(&self, line: String) {
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = lines.as_ref() {
            let _ = tx.try_send(line);
        }
    }

    /// Lets the queued lines out, waiting for them at most `wait`.
    fn finish(&self, wait: std::time::Duration) {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).take();
        let _ = self.done.recv_timeout(wait);
    }
}

impl Progress {
    /// A display for `total` steps starting at `start`.
    pub fn new(total: usize, start: usize) -> Self {
        // The bar is drawn where the plain lines would go, and only when that is a terminal. A
        // launcher of several processes (mpirun) gives each a terminal whatever its own output
        // is, and forwards it as lines: plain lines there.
        let launched = crate::comm::Processes::from_env().count > 1;
        let bar = (std::io::stdout().is_terminal() && !launched).then(|| {
            let bar =
                ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stdout());
            bar.set_style(bar_style().expect("the bar template is checked by a test"));
            bar.set_position(start as u64);
            bar
        });
        Self {
            bar,
            printer: launched.then(Printer::start),
            total,
            start,
            started: std::time::Instant::now(),
        }
    }

    /// Prints a plain line (through the printer under a launcher).
    fn line(&self, line: String) {
        match &self.printer {
            Some(p) => p.print(line),
            None => say!("{line}"),
        }
    }

    /// Reports the state after `step` steps; `devices` is the per-device summary line, when the
    /// system monitor has one.
    pub fn update(&self, step: usize, message: &str, devices: Option<&str>) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(step as u64);
                bar.set_message(message.to_string());
                if let Some(d) = devices {
                    bar.set_prefix(d.to_string());
                }
            }
            None => {
                let eta = eta(
                    self.started.elapsed().as_secs_f64(),
                    step.saturating_sub(self.start),
                    self.total.saturating_sub(step),
                );
                let devices = devices.map_or(String::new(), |d| format!(" | {d}"));
                self.line(format!("step {step:>6} | {message} | eta {eta}{devices}"));
            }
        }
    }

    /// Prints a line above the bar (or plainly).
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => self.line(line.to_string()),
        }
    }

    /// Removes the bar, or lets the printer's last lines out: waiting at most 2 s for a
    /// reader, or 0.2 s after a stop signal (a launcher taking the job down may have stopped
    /// reading).
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        if let Some(p) = &self.printer {
            let wait = match crate::signal::requested() {
                Some(_) => std::time::Duration::from_millis(200),
                None => std::time::Duration::from_secs(2),
            };
            p.finish(wait);
        }
    }
}

/// Two lines: the bar, ETA and latest numbers, then the devices' summary (the prefix).
fn bar_style() -> std::result::Result<ProgressStyle, indicatif::style::TemplateError> {
    ProgressStyle::with_template(
        "{bar:30.cyan/blue} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}\n{prefix}",
    )
}

/// Time left for `left` steps at the rate of `done` steps in `elapsed` seconds, as `1h02m03s`.
fn eta(elapsed: f64, done: usize, left: usize) -> String {
    if done == 0 {
        return "?".into();
    }
    let secs = (elapsed / done as f64 * left as f64).round() as u64;
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if h > 0 {
        format!("{h}h{m:02}m{s:02}s")
    } else if m > 0 {
        format!("{m}m{s:02}s")
    } else {
        format!("{s}s")
    }
}

/// Builds a metrics record from key/value pairs.
pub fn record(pairs: &[(&str, Value)]) -> Map<String, Value> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// A JSON number, or null when not finite.
pub fn num(x: f64) -> Value {
    if x.is_finite() { json!(x) } else { Value::Null }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_line_bar_renders() {
        let bar = ProgressBar::hidden();
        bar.set_style(bar_style().unwrap());
        bar.set_length(10);
        bar.set_message("loss 1.0");
        bar.set_prefix("process rss 10 MiB | dev0 cpu 90%");
        bar.set_position(3);
        assert_eq!(bar.position(), 3);
    }

    #[test]
    fn eta_scales_the_elapsed_time() {
        assert_eq!(eta(10.0, 10, 5), "5s");
        assert_eq!(eta(60.0, 1, 62), "1h02m00s");
        assert_eq!(eta(3.0, 2, 100), "2m30s");
        assert_eq!(eta(3.0, 0, 100), "?");
    }
}
