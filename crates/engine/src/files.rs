//! Files that are never half-written: a leaf every layer that writes may use (checkpoints,
//! the run directory's files, the flight records, plots).

use std::path::Path;

use crate::error::{Error, Result};

/// Writes `bytes` to `path` and flushes them to disk.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(bytes).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}

/// Writes `bytes` to `path` through a temporary file and a rename, so that readers see either
/// the old file or the whole new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    write_synced(&tmp, bytes)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}
