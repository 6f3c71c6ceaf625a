//! kiln's error type: every message is one line naming the input at fault.

use std::fmt;

/// What went wrong, by area, with a one-line message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A config file, key or value is invalid.
    Config(String),
    /// A dataset could not be found or read.
    Data(String),
    /// A checkpoint or run directory could not be written or read.
    Checkpoint(String),
    /// The requested devices are not available.
    Device(String),
    /// A worker failed; the whole run stopped.
    Worker(String),
    /// Training itself went wrong (a non-finite loss or gradient); the run stopped.
    Training(String),
    /// The model cannot run as it is (its first forward failed).
    Model(String),
    /// Another I/O failure.
    Io(String),
}

/// The exit codes of kiln's programs, for a launcher deciding whether to start a run again:
/// only [`exit::FAILED`] (and a death by a signal) is worth a restart.
pub mod exit {
    /// The run finished (or the command did what it was asked).
    pub const DONE: i32 = 0;
    /// Refused: the configuration, the data, the model, the devices or the checkpoint do not
    /// allow the run. The same command fails the same way: never worth retrying as it is.
    pub const REFUSED: i32 = 2;
    /// Stopped by a signal (SIGTERM, SIGINT, SIGUSR2) after a checkpoint was written:
    /// `--resume` continues it.
    pub const STOPPED: i32 = 3;
    /// Failed while running: a rank's error or death, a deadline, a cut link, a write that
    /// failed. Worth retrying from the newest checkpoint.
    pub const FAILED: i32 = 4;
    /// Diverged: a loss or gradient went non-finite past `train.skip_nonfinite`. Retrying
    /// from the checkpoint repeats the same arithmetic: not worth it as it is.
    pub const DIVERGED: i32 = 5;
}

/// The exit code of the failure that is ending this process (set by the rank that failed
/// first, read where the process ends without returning: an MPI abort, a rank that cannot be
/// woken); [`exit::FAILED`] until one is noted.
static ENDING: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(exit::FAILED);
static NOTED: std::sync::Once = std::sync::Once::new();

/// Notes `e` as the failure that ends this process (the first note wins).
pub fn note_failure(e: &Error) {
    NOTED.call_once(|| ENDING.store(e.exit_code(), std::sync::atomic::Ordering::SeqCst));
}

/// The exit code of the failure noted by [`note_failure`] ([`exit::FAILED`] if none).
pub fn failure_code() -> i32 {
    ENDING.load(std::sync::atomic::Ordering::SeqCst)
}

/// Result with kiln's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A config error.
    pub fn config(msg: impl Into<String>) -> Self {
        Error::Config(msg.into())
    }
    /// A data error.
    pub fn data(msg: impl Into<String>) -> Self {
        Error::Data(msg.into())
    }
    /// A checkpoint error.
    pub fn checkpoint(msg: impl Into<String>) -> Self {
        Error::Checkpoint(msg.into())
    }
    /// The message without its area (`checkpoint error: `), for a caller that says it in a
    /// sentence of its own.
    pub fn message(&self) -> &str {
        match self {
            Error::Config(m)
            | Error::Data(m)
            | Error::Checkpoint(m)
            | Error::Device(m)
            | Error::Worker(m)
            | Error::Training(m)
            | Error::Model(m)
            | Error::Io(m) => m,
        }
    }

    /// The exit code a program ends with on this error ([`exit`]).
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Config(_)
            | Error::Data(_)
            | Error::Checkpoint(_)
            | Error::Device(_)
            | Error::Model(_) => exit::REFUSED,
            Error::Training(_) => exit::DIVERGED,
            Error::Worker(_) | Error::Io(_) => exit::FAILED,
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: &std::path::Path, e: impl fmt::Display) -> Self {
        Error::Io(format!("{}: {e}", path.display()))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (area, msg) = match self {
            Error::Config(m) => ("config", m),
            Error::Data(m) => ("data", m),
            Error::Checkpoint(m) => ("checkpoint", m),
            Error::Device(m) => ("device", m),
            Error::Worker(m) => ("worker", m),
            Error::Training(m) => ("training", m),
            Error::Model(m) => ("model", m),
            Error::Io(m) => ("io", m),
        };
        // Messages are shown as one line whatever their source wrote.
        let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
        write!(f, "{area} error: {msg}")
    }
}

impl std::error::Error for Error {}

impl From<kiln_datasets::DatasetError> for Error {
    fn from(e: kiln_datasets::DatasetError) -> Self {
        Error::Data(e.to_string())
    }
}
