//! What a run is told and what it returns: the options of the command line, a workload's
//! description for the start-up table, and the result.

use std::path::PathBuf;

use crate::metrics::Summary;

/// How a run starts.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue from this checkpoint directory (inside the run directory).
    pub resume_from: Option<PathBuf>,
    /// The run directory was named explicitly (`--run-dir`): never pick another one.
    pub explicit_dir: bool,
    /// Print the start-up table.
    pub verbose: bool,
    /// Evaluate the starting model on the validation set instead of training (`train eval`):
    /// nothing is written.
    pub evaluate: bool,
    /// Print the plan instead of training (`train plan`): `Some(true)` as JSON.
    pub plan: Option<bool>,
}

/// What a finished run left behind.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// The run directory.
    pub dir: PathBuf,
    /// The summary also written to `summary.json`.
    pub summary: Summary,
    /// An evaluation (`train eval`) or a plan (`train plan`): no step was taken and nothing
    /// was written.
    pub evaluated: bool,
}

/// How a workload's run describes itself besides what kiln knows.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    /// The model's name in the start-up table.
    pub model: String,
    /// More rows of the start-up table (`("data", "…")`).
    pub rows: Vec<(String, String)>,
    /// Sections of the workload's own written into `config.toml` (a program's `[model]` and
    /// `[data]`, so that `--resume` reads them back).
    pub sections: Vec<(String, toml::Value)>,
    /// Drop the last incomplete global batch of an epoch instead of wrapping around (the
    /// built-in recipes' `data.drop_last`).
    pub drop_last: bool,
}

impl RunInfo {
    /// The workload in words for the planner's kept measurements, which it names beside the
    /// config: the model's name and the workload's own sections.
    pub(crate) fn about(&self) -> String {
        let sections: String = self
            .sections
            .iter()
            .map(|(name, value)| format!("[{name}] {value}\n"))
            .collect();
        format!("{}: {sections}", self.model)
    }
}
