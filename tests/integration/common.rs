//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kiln::builtin::Config;
use serde_json::Value;

/// A fresh, empty directory for one test, removed when the test drops it after passing (a
/// failing test keeps its files, and says where they are; `KILN_KEEP_TEST_DIRS=1` keeps a
/// passing test's too).
pub fn temp_dir(name: &str) -> TestDir {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("kiln-it-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TestDir(dir)
}

/// A test's directory: a [`Path`] that is removed on drop unless the thread is panicking.
#[derive(Debug)]
pub struct TestDir(PathBuf);

impl std::ops::Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TestDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept for inspection: {}", self.0.display());
        } else if std::env::var_os("KILN_KEEP_TEST_DIRS").is_some() {
            // What a passing test wrote, for a check by hand (`hf_fixtures.py --check DIR`).
            eprintln!("kept (KILN_KEEP_TEST_DIRS): {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A small, fast digits config writing into `run_dir`.
pub fn small_config(run_dir: &Path, overrides: &[&str]) -> Config {
    let mut all = vec![
        "data.dataset=\"digits\"".to_string(),
        "model.convnet.channels=[4, 8]".to_string(),
        "train.batch_size=16".to_string(),
        "train.log_every=1".to_string(),
        "train.max_steps=12".to_string(),
        "train.epochs=1".to_string(),
        format!("run.dir={:?}", run_dir.display().to_string()),
    ];
    all.extend(overrides.iter().map(|s| s.to_string()));
    kiln::builtin::load(None, &all).unwrap()
}

/// Every record of a run's metrics.jsonl with the given split.
pub fn metrics(run_dir: &Path, split: &str) -> Vec<Value> {
    kiln::metrics::read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|r| r["split"] == split)
        .collect()
}

/// `(step, loss bits)` of every training record.
pub fn train_losses(run_dir: &Path) -> Vec<(u64, u64)> {
    metrics(run_dir, "train")
        .iter()
        .map(|r| {
            (
                r["step"].as_u64().unwrap(),
                r["loss"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

/// Runs the `train` binary with `args` in `cwd`.
pub fn train_bin(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_train"))
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run the train binary")
}

/// Runs the `train` binary with `args` in `cwd`, kiln's cache folder (the planner's kept
/// measurements, CubeCL's kept tuning) in `cache`.
pub fn train_bin_kept<S: AsRef<std::ffi::OsStr>>(cwd: &Path, cache: &Path, args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_train"))
        .args(args)
        .current_dir(cwd)
        .env("KILN_CACHE_DIR", cache)
        .output()
        .expect("run the train binary")
}

/// Asserts that `out` failed with a one-line error containing every needle.
pub fn assert_one_line_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {stderr}"
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {stderr}");
    for n in needles {
        assert!(lines[0].contains(n), "error {:?} lacks {n:?}", lines[0]);
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Largest per-tensor relative difference.
pub fn max_relative_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    assert_eq!(a.len(), b.len());
    assert!(
        !a.is_empty() && a.iter().all(|t| !t.is_empty()),
        "no parameters to compare"
    );
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            let diff: f64 = x
                .iter()
                .zip(y)
                .map(|(p, q)| f64::from(p - q).powi(2))
                .sum::<f64>()
                .sqrt();
            let norm: f64 = y.iter().map(|q| f64::from(*q).powi(2)).sum::<f64>().sqrt();
            diff / norm.max(1e-12)
        })
        .fold(0.0, f64::max)
}

/// Waits for `child` at most `limit`; returns its output and how long it took, or kills it and
/// fails with what it printed.
pub fn finish_within(mut child: Child, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), started.elapsed());
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the run did not end within {limit:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The records of `run`'s metrics.jsonl so far.
pub fn records_logged(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .map(|m| m.lines().count())
        .unwrap_or(0)
}

/// The last training step `run` has logged (a line being written is not read yet).
pub fn last_train_step(run: &Path) -> u64 {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["split"] == "train")
        .filter_map(|r| r["step"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Waits until `run`'s metrics.jsonl has `records` lines (at most 60 s).
pub fn wait_for_records(run: &Path, records: usize) {
    let started = Instant::now();
    while records_logged(run) < records {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no steps logged"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A safetensors file's tensors: their entries (names, dtypes, shapes, offsets) and bytes,
/// without the free-form metadata, whose key order is not fixed.
pub fn tensors(path: &Path) -> (serde_json::Value, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header.as_object_mut().unwrap().remove("__metadata__");
    (header, bytes[8 + n..].to_vec())
}

/// The lines of a run's `restarts.jsonl` (none without the file).
pub fn restarts(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join(kiln::launcher::RESTARTS_FILE))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A run's `summary.json`.
pub fn summary(run: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap()
}
