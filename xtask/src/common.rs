//! What the tasks share: the error type, a temporary directory, running a command, reading
//! a number out of a JSON file, the flags of a bench, a median.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) type Result<T> = std::result::Result<T, String>;

/// A uniquely named directory under the system temp dir, deleted when dropped so failed
/// fetches do not litter it with unpacked packages.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Result<Self> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = env::temp_dir().join(format!("kiln-xtask-{tag}-{}-{nanos}", std::process::id()));
        fs::create_dir_all(&path)
            .map_err(|e| format!("cannot create temp dir {}: {e}", path.display()))?;
        Ok(TempDir(path))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Runs a command, returning its stdout, or a one-line error quoting the last line it printed
/// to stderr (tools like npm print pages of noise before the actual reason).
pub(crate) fn run_captured(command: &mut Command, what: &str) -> Result<String> {
    let output = command.stdin(Stdio::null()).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            format!("{what}: command not found on PATH")
        } else {
            format!("{what}: cannot start: {e}")
        }
    })?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let reason = stderr
        .lines()
        .rev()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or("no error output");
    Err(format!("{what} failed ({}): {reason}", output.status))
}

/// The number after `"key":` in a JSON text (the std-only reading of `summary.json`).
pub(crate) fn json_number(text: &str, key: &str) -> Option<f64> {
    let at = text.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The `ms_per_step` a PyTorch reference script (`xtask/reference/`) printed, or why there is
/// none: `what` and the script's standard error.
pub(crate) fn reference_ms_per_step(what: &str, out: &std::process::Output) -> Result<f64> {
    json_number(&String::from_utf8_lossy(&out.stdout), "ms_per_step").ok_or_else(|| {
        format!(
            "{what} printed no ms_per_step: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })
}

/// Every number of the JSON array under `key` (`None` where there is none, or a member is not a
/// number).
pub(crate) fn json_array(text: &str, key: &str) -> Option<Vec<f64>> {
    let at = text.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    let rest = rest.strip_prefix('[')?;
    rest[..rest.find(']')?]
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| n.parse().ok())
        .collect()
}

/// Walks a bench's `--flag VALUE` arguments: `each` gets every flag and a function that takes
/// its value (an error naming the flag when there is none).
pub(crate) fn each_flag(
    rest: &[&str],
    mut each: impl FnMut(&str, &mut dyn FnMut() -> Result<String>) -> Result<()>,
) -> Result<()> {
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value"))
                .map(|v| v.to_string())
        };
        each(flag, &mut value)?;
    }
    Ok(())
}

/// A comma-separated list of positive integers for `flag`.
pub(crate) fn positives(flag: &str, raw: &str) -> Result<Vec<usize>> {
    raw.split(',').map(|n| positive(flag, n.trim())).collect()
}

/// `raw` as a positive integer, or the error naming `flag`.
pub(crate) fn positive(flag: &str, raw: &str) -> Result<usize> {
    raw.parse::<usize>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{flag} {raw:?}: expected a positive integer"))
}

/// Cargo's target folder for the workspace at `root` (`CARGO_TARGET_DIR` where set).
pub(crate) fn target_dir(root: &Path) -> PathBuf {
    env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// Runs `cargo build --release -q` with `args` in `root`, so that every measurement runs one
/// build and nothing is rebuilt in between; a failure is an error naming `what`. Returns the
/// folder of the release build.
pub(crate) fn build_release(root: &Path, args: &[&str], what: &str) -> Result<PathBuf> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args(["build", "--release", "-q"])
        .args(args)
        .current_dir(root)
        .status()
        .map_err(|e| format!("cannot build {what}: {e}"))?;
    if !status.success() {
        return Err(format!("building {what} failed ({status})"));
    }
    Ok(target_dir(root).join("release"))
}

/// Runs `command` (a `train`, or an `mpirun` of it) with its progress discarded; a failure is
/// an error naming `what`, with `train`'s own message.
pub(crate) fn run_quietly(command: &mut Command, what: &str) -> Result<()> {
    let out = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run train: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what}: train failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
