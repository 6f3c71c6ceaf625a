//! `train launch`'s command line.

use std::path::PathBuf;

/// The file of a run directory that records each restart, one JSON object a line.
pub const RESTARTS_FILE: &str = "restarts.jsonl";

/// `train launch`'s options; `train`'s own arguments follow `--`.
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// The run directory: a new run goes there, and a run already there is continued.
    #[arg(long, value_name = "DIR")]
    pub run_dir: PathBuf,
    /// Restarts after failures before giving up.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub restarts: usize,
    /// The hosts, comma-separated, one process each under `mpirun` (none: one process here;
    /// without --hosts and --hostfile, Slurm's SLURM_JOB_NODELIST when set).
    #[arg(long, value_delimiter = ',', value_name = "HOST,...")]
    pub hosts: Vec<String>,
    /// A file of hosts, one a line (`#` starts a comment; `host slots=N` reads as `host`).
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// The command that reaches a host, as `mpirun`'s rsh agent: `AGENT HOST true` checks
    /// that a host answers, and `mpirun` starts the processes with it (default: ssh).
    #[arg(long, value_name = "CMD")]
    pub rsh_agent: Option<String>,
    /// The `mpirun` command with options of its own, before the launcher's `--host` and `-np`
    /// (split on spaces).
    #[arg(long, default_value = "mpirun", value_name = "CMD")]
    pub mpirun: String,
    /// Seconds before the first restart, doubled at each (at most 60).
    #[arg(long, default_value_t = 2.0, value_name = "S")]
    pub backoff_s: f64,
    /// A host lost, taken back when it answered again, and lost again within this many
    /// seconds is left out for the rest of the job.
    #[arg(long = "readmit-after", default_value_t = 600.0, value_name = "S")]
    pub readmit_after_s: f64,
    /// `train`'s arguments: the config, flags and `--set`s of the run.
    #[arg(last = true, value_name = "TRAIN_ARGS")]
    pub train: Vec<String>,
}
