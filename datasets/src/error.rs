//! The single error type returned by every fallible loader in this crate.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Everything that can go wrong while locating, reading, validating or downloading a dataset.
///
/// Every message renders on one line and names the file or directory involved, so that a
/// training run that fails at start-up tells the user exactly what to fix.
#[derive(Debug)]
pub enum DatasetError {
    /// The data directory itself is absent.
    MissingDir {
        /// The directory that was looked for.
        dir: PathBuf,
        /// The `cargo xtask fetch-data` target that would populate it.
        fetch_target: String,
    },
    /// None of the accepted spellings of a required file exists in the data directory.
    MissingFile {
        /// The directory that was searched.
        dir: PathBuf,
        /// What the file holds, e.g. "training images".
        role: &'static str,
        /// Every file name that would have been accepted.
        candidates: Vec<String>,
    },
    /// An operating-system error while reading or writing a file.
    Io {
        /// The file being accessed.
        path: PathBuf,
        /// What was being attempted, e.g. "cannot read".
        action: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// The first four bytes of an IDX file are not the expected magic number.
    BadMagic {
        /// The offending file.
        path: PathBuf,
        /// The magic number found in the file.
        found: u32,
        /// The magic number that was required.
        expected: u32,
        /// A human name for the expected format.
        format: &'static str,
    },
    /// The file is shorter than its header says it should be.
    Truncated {
        /// The offending file.
        path: PathBuf,
        /// What the header promised, e.g. "60000 images of 28x28".
        declared: String,
        /// How many payload bytes the header implies.
        expected_bytes: u64,
        /// How many payload bytes are actually present.
        found_bytes: u64,
        /// The size of the header the payload follows.
        header_bytes: usize,
    },
    /// The file carries more bytes than its header accounts for.
    TrailingBytes {
        /// The offending file.
        path: PathBuf,
        /// What the header promised, e.g. "60000 images of 28x28".
        declared: String,
        /// How many payload bytes the header implies.
        expected_bytes: u64,
        /// How many payload bytes are actually present.
        found_bytes: u64,
        /// The size of the header the payload follows.
        header_bytes: usize,
    },
    /// A header field holds a value that cannot describe a real dataset.
    BadHeader {
        /// The offending file.
        path: PathBuf,
        /// What is wrong with the header.
        reason: String,
    },
    /// A label lies outside the class range of the dataset.
    BadLabel {
        /// The offending file.
        path: PathBuf,
        /// The position of the first bad label.
        index: usize,
        /// The bad label value.
        label: u8,
        /// The number of classes, so valid labels are `0..num_classes`.
        num_classes: usize,
    },
    /// Two files that must describe the same examples disagree.
    Mismatch {
        /// The first file.
        first: PathBuf,
        /// The second file.
        second: PathBuf,
        /// What differs, with both values.
        reason: String,
    },
    /// A network transfer failed.
    Download {
        /// The address being fetched.
        url: String,
        /// Why the transfer failed.
        reason: String,
    },
    /// A text corpus cannot be read or split for training.
    BadText {
        /// The file the text came from, or `None` for text handed over in memory.
        path: Option<PathBuf>,
        /// The name the text goes by in logs, used when there is no file to name.
        name: String,
        /// What is wrong with the text.
        reason: String,
    },
    /// A text contains a character the tokenizer has no id for.
    UnknownChar {
        /// The first character that is missing from the vocabulary.
        ch: char,
        /// Its position in the text, counted in characters from zero.
        position: usize,
        /// The size of the vocabulary that lacks it.
        vocab_size: usize,
    },
    /// A file or folder of a user's dataset (an image folder, a CSV table) cannot be used.
    Bad {
        /// The file or folder at fault.
        path: PathBuf,
        /// What is wrong with it, and what was expected.
        reason: String,
    },
    /// A saved tokenizer is malformed or inconsistent.
    BadTokenizer {
        /// The file it was read from, or `None` when parsed from a string.
        path: Option<PathBuf>,
        /// What is wrong with it.
        reason: String,
    },
}

impl DatasetError {
    /// `path` cannot be used, for `reason`.
    pub fn bad(path: &Path, reason: impl Into<String>) -> Self {
        DatasetError::Bad {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// Wraps an I/O error with the path and the action that failed.
    pub(crate) fn io(path: &Path, action: &'static str, source: io::Error) -> Self {
        DatasetError::Io {
            path: path.to_path_buf(),
            action,
            source,
        }
    }

    /// The file or directory the error is about, when there is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            DatasetError::MissingDir { dir, .. } | DatasetError::MissingFile { dir, .. } => {
                Some(dir)
            }
            DatasetError::Io { path, .. }
            | DatasetError::BadMagic { path, .. }
            | DatasetError::Truncated { path, .. }
            | DatasetError::TrailingBytes { path, .. }
            | DatasetError::BadHeader { path, .. }
            | DatasetError::BadLabel { path, .. }
            | DatasetError::Bad { path, .. } => Some(path),
            DatasetError::Mismatch { first, .. } => Some(first),
            DatasetError::BadText { path, .. } | DatasetError::BadTokenizer { path, .. } => {
                path.as_deref()
            }
            DatasetError::Download { .. } | DatasetError::UnknownChar { .. } => None,
        }
    }
}

/// Names a few well-known things a wrong magic number might really be, so the error can say
/// "this is a label file" or "this is an HTML page" rather than only printing hex.
fn guess_content(magic: u32) -> Option<&'static str> {
    let bytes = magic.to_be_bytes();
    match magic {
        0x0000_0801 => Some("an IDX u8 label file"),
        0x0000_0803 => Some("an IDX u8 image file"),
        _ if &bytes == b"vers" => Some("a Git LFS pointer rather than the data"),
        _ if bytes[0] == b'<' => Some("HTML or XML text, probably a failed download"),
        _ => None,
    }
}

impl fmt::Display for DatasetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DatasetError::Bad { path, reason } => write!(f, "{}: {reason}", path.display()),
            DatasetError::MissingDir { dir, fetch_target } => write!(
                f,
                "data directory {} does not exist (run `cargo xtask fetch-data {fetch_target}` or set data.dir)",
                dir.display()
            ),
            DatasetError::MissingFile {
                dir,
                role,
                candidates,
            } => write!(
                f,
                "data directory {} has no {role} file: expected one of {}",
                dir.display(),
                candidates.join(", ")
            ),
            DatasetError::Io {
                path,
                action,
                source,
            } => write!(f, "{}: {action}: {source}", path.display()),
            DatasetError::BadMagic {
                path,
                found,
                expected,
                format,
            } => {
                write!(
                    f,
                    "{}: bad magic number 0x{found:08x}, expected 0x{expected:08x} ({format})",
                    path.display()
                )?;
                if let Some(guess) = guess_content(*found) {
                    write!(f, "; the file looks like {guess}")?;
                }
                Ok(())
            }
            DatasetError::Truncated {
                path,
                declared,
                expected_bytes,
                found_bytes,
                header_bytes,
            } => write!(
                f,
                "{}: truncated: header says {declared} ({expected_bytes} bytes) but file holds {found_bytes} bytes after the {header_bytes}-byte header",
                path.display()
            ),
            DatasetError::TrailingBytes {
                path,
                declared,
                expected_bytes,
                found_bytes,
                header_bytes,
            } => write!(
                f,
                "{}: unexpected trailing data: header says {declared} ({expected_bytes} bytes) but file holds {found_bytes} bytes after the {header_bytes}-byte header",
                path.display()
            ),
            DatasetError::BadHeader { path, reason } => {
                write!(f, "{}: bad header: {reason}", path.display())
            }
            DatasetError::BadLabel {
                path,
                index,
                label,
                num_classes,
            } => write!(
                f,
                "{}: label {index} is {label}, expected a class in 0..{num_classes}",
                path.display()
            ),
            DatasetError::Mismatch {
                first,
                second,
                reason,
            } => write!(
                f,
                "{} and {} disagree: {reason}",
                first.display(),
                second.display()
            ),
            DatasetError::Download { url, reason } => {
                write!(f, "download of {url} failed: {reason}")
            }
            DatasetError::BadText { path, name, reason } => match path {
                Some(path) => write!(f, "{}: {reason}", path.display()),
                None => write!(f, "text {name:?}: {reason}"),
            },
            DatasetError::UnknownChar {
                ch,
                position,
                vocab_size,
            } => write!(
                f,
                "character {ch:?} (U+{:04X}) at position {position} is not in the tokenizer's {vocab_size}-character vocabulary",
                u32::from(*ch)
            ),
            DatasetError::BadTokenizer { path, reason } => match path {
                Some(path) => write!(f, "{}: bad tokenizer: {reason}", path.display()),
                None => write!(f, "bad tokenizer JSON: {reason}"),
            },
        }
    }
}

impl std::error::Error for DatasetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DatasetError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
