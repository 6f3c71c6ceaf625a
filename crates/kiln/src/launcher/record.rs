//! What the launcher writes in the run directory: a line of `restarts.jsonl` for each restart,
//! the restart count in `summary.json`, and a failed attempt's files set aside when the run
//! starts over.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::args::RESTARTS_FILE;
use kiln_engine::error::{Error, Result};
use kiln_engine::files::write_atomic;
use kiln_engine::runlock::LOCK_FILE;

/// Moves what failed attempt `attempt` (0 the first) wrote into the run directory — its
/// config, logs, metrics, unfinished checkpoints — to `restarts/attempt-N/run/`, so that
/// the next attempt starts the run over in the same directory; `restarts.jsonl` and the
/// earlier attempts' records and the job's lock stay. Returns where they went.
pub(super) fn set_aside(run_dir: &Path, attempt: usize) -> Result<PathBuf> {
    let kept = run_dir
        .join("restarts")
        .join(format!("attempt-{}", attempt + 1))
        .join("run");
    std::fs::create_dir_all(&kept).map_err(|e| Error::io(&kept, e))?;
    for entry in std::fs::read_dir(run_dir).map_err(|e| Error::io(run_dir, e))? {
        let path = entry.map_err(|e| Error::io(run_dir, e))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == RESTARTS_FILE
            || name == "restarts"
            || name.trim_start_matches('.').starts_with(LOCK_FILE)
        {
            continue;
        }
        std::fs::rename(&path, kept.join(name)).map_err(|e| Error::io(&path, e))?;
    }
    Ok(kept)
}

/// Appends `line` to the run's `restarts.jsonl` (a warning where it cannot).
pub(super) fn record(run_dir: &Path, line: &serde_json::Value) {
    let path = run_dir.join(RESTARTS_FILE);
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{line}"));
    if let Err(e) = written {
        eprintln!(
            "warning: train launch: cannot write {}: {e}",
            path.display()
        );
    }
}

/// `summary.json` of a finished run counts its restarts.
pub(super) fn count_restarts(run_dir: &Path, restarts: usize) {
    let path = run_dir.join("summary.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return;
    };
    if let Ok(serde_json::Value::Object(mut summary)) = serde_json::from_str(&text) {
        summary.insert("restarts".into(), json!(restarts));
        let bytes = serde_json::to_vec_pretty(&summary).expect("a summary serialises");
        if let Err(e) = write_atomic(&path, &bytes) {
            eprintln!("warning: train launch: {e}");
        }
    }
}
