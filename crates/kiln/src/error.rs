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
    /// Another I/O failure.
    Io(String),
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
            | Error::Io(m) => m,
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
