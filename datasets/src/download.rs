//! Fetching MNIST and Fashion-MNIST from their canonical hosts, for machines with internet.

use std::fs::{self, File};
use std::io;
use std::path::Path;

use crate::error::DatasetError;
use crate::idx::candidate_names;
use crate::idx::{IdxKind, load_idx_dir};

/// The four files every IDX dataset consists of, as (stem, IDX kind) pairs.
const FILES: [(&str, &str); 4] = [
    ("train-images", "idx3"),
    ("train-labels", "idx1"),
    ("t10k-images", "idx3"),
    ("t10k-labels", "idx1"),
];

impl IdxKind {
    /// The address the four files of this dataset are served under (ends in `/`).
    pub fn base_url(self) -> &'static str {
        match self {
            IdxKind::Mnist => "https://ossci-datasets.s3.amazonaws.com/mnist/",
            IdxKind::FashionMnist => "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        }
    }
}

/// Streams `url` into `dest` via a temporary sibling file, so an interrupted transfer never
/// leaves a partial file under the final name for a later run to trip over.
fn fetch(url: &str, dest: &Path) -> Result<(), DatasetError> {
    let failed = |reason: String| DatasetError::Download {
        url: url.to_string(),
        reason,
    };
    let response = ureq::get(url).call().map_err(|e| failed(e.to_string()))?;
    let mut partial_name = dest.as_os_str().to_owned();
    partial_name.push(".partial");
    let partial = Path::new(&partial_name);
    let result = File::create(partial)
        .and_then(|mut file| {
            io::copy(&mut response.into_body().into_reader(), &mut file)?;
            file.sync_all()
        })
        .map_err(|e| failed(format!("writing {}: {e}", partial.display())))
        .and_then(|()| {
            fs::rename(partial, dest).map_err(|e| DatasetError::io(dest, "cannot rename into", e))
        });
    if result.is_err() {
        let _ = fs::remove_file(partial);
    }
    result
}

/// Downloads the four IDX files of `kind` into `dir` and checks that they load.
///
/// Files already present under any accepted name are kept, so an interrupted download can simply be re-run. The files
/// are stored under their canonical `.gz` names; the reader sniffs the content, so it does not
/// matter whether the server sent them compressed or not.
pub fn download_mnist(dir: &Path, kind: IdxKind) -> Result<(), DatasetError> {
    fs::create_dir_all(dir).map_err(|e| DatasetError::io(dir, "cannot create directory", e))?;
    for (stem, idx) in FILES {
        // Any accepted spelling counts as present, so a directory filled by another route
        // (such as `cargo xtask fetch-data`) is not downloaded a second time.
        let present = candidate_names(stem, idx)
            .iter()
            .any(|name| dir.join(name).is_file());
        if present {
            continue;
        }
        let name = format!("{stem}-{idx}-ubyte.gz");
        fetch(&format!("{}{name}", kind.base_url()), &dir.join(&name))?;
    }
    // Validating right away reports a corrupt transfer now, next to the download that caused it.
    load_idx_dir(dir, kind.name()).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_well_formed() {
        for kind in [IdxKind::Mnist, IdxKind::FashionMnist] {
            let base = kind.base_url();
            assert!(base.starts_with("http") && base.ends_with('/'), "{base}");
        }
    }
}
