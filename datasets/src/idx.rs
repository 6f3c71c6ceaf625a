//! Reading and validating IDX files, the format MNIST and Fashion-MNIST are distributed in.
//!
//! An IDX file is a big-endian header (a magic number whose low bytes give the element type and
//! the number of dimensions, then one `u32` per dimension) followed by the raw elements. Files
//! may be stored gzip-compressed; compression is detected from the content, not the name,
//! because downloads and mirrors are inconsistent about the `.gz` suffix.

use std::fmt;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use flate2::read::MultiGzDecoder;
use serde::{Deserialize, Serialize};

use crate::error::DatasetError;
use crate::images::{ImageDataset, ImageSplits};

/// The magic number of an IDX file of unsigned bytes with three dimensions (images).
pub const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
/// The magic number of an IDX file of unsigned bytes with one dimension (labels).
pub const IDX_LABELS_MAGIC: u32 = 0x0000_0801;
/// The number of classes in the IDX datasets this crate loads (both have ten).
pub const IDX_NUM_CLASSES: usize = 10;

/// The largest image side accepted; anything bigger is surely a corrupt header, and rejecting
/// it early gives a clearer message than a length mismatch would.
const MAX_SIDE: usize = 16_384;
const IMAGES_HEADER: usize = 16;
const LABELS_HEADER: usize = 8;
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Which of the two IDX-format image datasets is meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdxKind {
    /// The MNIST handwritten digits (60,000 train and 10,000 test images of 28x28).
    Mnist,
    /// Zalando's Fashion-MNIST clothing images, a drop-in replacement for MNIST.
    FashionMnist,
}

impl IdxKind {
    /// The short name used in configs and on the command line: "mnist" or "fashion-mnist".
    pub fn name(self) -> &'static str {
        match self {
            IdxKind::Mnist => "mnist",
            IdxKind::FashionMnist => "fashion-mnist",
        }
    }

    /// The conventional data directory, relative to the workspace root.
    pub fn default_dir(self) -> &'static str {
        match self {
            IdxKind::Mnist => "data/mnist",
            IdxKind::FashionMnist => "data/fashion-mnist",
        }
    }

    /// Loads this dataset from `dir`; a shorthand for [`load_idx_dir`] with the right name.
    pub fn load(self, dir: &Path) -> Result<ImageSplits, DatasetError> {
        load_idx_dir(dir, self.name())
    }
}

impl fmt::Display for IdxKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for IdxKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "mnist" => Ok(IdxKind::Mnist),
            "fashion-mnist" | "fashionmnist" => Ok(IdxKind::FashionMnist),
            _ => Err(format!(
                "unknown IDX dataset {s:?}, expected \"mnist\" or \"fashion-mnist\""
            )),
        }
    }
}

/// Reads a whole file, transparently inflating it when it starts with the gzip magic bytes.
///
/// A gzip file is inflated no further than its header says its payload is (`payload` reads
/// that from the first `header_len` bytes), plus one byte to tell extra data apart: a small
/// file that inflates without end, or a header that claims billions of items, never makes the
/// reader allocate more than the data that is really there up to what the header declares.
fn read_maybe_gzip(
    path: &Path,
    header_len: usize,
    payload: impl Fn(&[u8]) -> u64,
) -> Result<Vec<u8>, DatasetError> {
    let raw = fs::read(path).map_err(|e| DatasetError::io(path, "cannot read", e))?;
    if !raw.starts_with(&GZIP_MAGIC) {
        return Ok(raw);
    }
    let inflate = |e| DatasetError::io(path, "cannot decompress gzip data", e);
    // Multi-member decoding accepts files that were concatenated from several gzip streams.
    let mut decoder = MultiGzDecoder::new(raw.as_slice());
    let mut inflated = Vec::with_capacity(header_len);
    (&mut decoder)
        .take(header_len as u64)
        .read_to_end(&mut inflated)
        .map_err(inflate)?;
    if inflated.len() < header_len {
        return Ok(inflated);
    }
    let limit = payload(&inflated).saturating_add(1);
    decoder
        .take(limit)
        .read_to_end(&mut inflated)
        .map_err(inflate)?;
    Ok(inflated)
}

fn be_u32(bytes: &[u8], offset: usize) -> u32 {
    let word: [u8; 4] = bytes[offset..offset + 4]
        .try_into()
        .expect("caller checked the header length");
    u32::from_be_bytes(word)
}

/// Checks the magic number and that the whole header is present.
fn check_header(
    path: &Path,
    bytes: &[u8],
    expected: u32,
    format: &'static str,
    header_len: usize,
) -> Result<(), DatasetError> {
    // The magic is checked before the header length so a short file of the wrong kind is
    // reported as the wrong kind, which is the more useful diagnosis.
    if bytes.len() >= 4 {
        let found = be_u32(bytes, 0);
        if found != expected {
            return Err(DatasetError::BadMagic {
                path: path.to_path_buf(),
                found,
                expected,
                format,
            });
        }
    }
    if bytes.len() < header_len {
        return Err(DatasetError::BadHeader {
            path: path.to_path_buf(),
            reason: format!(
                "file holds only {} bytes, too short for the {header_len}-byte {format} header",
                bytes.len()
            ),
        });
    }
    Ok(())
}

/// Checks that exactly `expected` payload bytes follow the header.
fn check_payload(
    path: &Path,
    payload: usize,
    expected: u64,
    header_bytes: usize,
    declared: impl FnOnce() -> String,
) -> Result<(), DatasetError> {
    let found = payload as u64;
    if found < expected {
        return Err(DatasetError::Truncated {
            path: path.to_path_buf(),
            declared: declared(),
            expected_bytes: expected,
            found_bytes: found,
            header_bytes,
        });
    }
    if found > expected {
        return Err(DatasetError::TrailingBytes {
            path: path.to_path_buf(),
            declared: declared(),
            expected_bytes: expected,
            found_bytes: found,
            header_bytes,
        });
    }
    Ok(())
}

/// Parses an in-memory IDX image file; `path` is only used in error messages.
fn parse_images(
    path: &Path,
    mut bytes: Vec<u8>,
) -> Result<(usize, usize, usize, Vec<u8>), DatasetError> {
    check_header(
        path,
        &bytes,
        IDX_IMAGES_MAGIC,
        "IDX u8 images",
        IMAGES_HEADER,
    )?;
    let n = be_u32(&bytes, 4) as usize;
    let rows = be_u32(&bytes, 8) as usize;
    let cols = be_u32(&bytes, 12) as usize;
    let bad = |reason: String| DatasetError::BadHeader {
        path: path.to_path_buf(),
        reason,
    };
    if n == 0 {
        return Err(bad("image count is 0".to_string()));
    }
    if rows == 0 || cols == 0 {
        return Err(bad(format!("image size is {rows}x{cols}")));
    }
    if rows > MAX_SIDE || cols > MAX_SIDE {
        return Err(bad(format!(
            "image size {rows}x{cols} is implausible (at most {MAX_SIDE} per side)"
        )));
    }
    // u64 arithmetic cannot overflow here: both factors are below 2^32 and 2^28.
    let expected = n as u64 * (rows * cols) as u64;
    check_payload(
        path,
        bytes.len() - IMAGES_HEADER,
        expected,
        IMAGES_HEADER,
        || format!("{n} images of {rows}x{cols}"),
    )?;
    bytes.drain(..IMAGES_HEADER);
    Ok((n, rows, cols, bytes))
}

/// Parses an in-memory IDX label file; `path` is only used in error messages.
fn parse_labels(path: &Path, mut bytes: Vec<u8>) -> Result<Vec<u8>, DatasetError> {
    check_header(
        path,
        &bytes,
        IDX_LABELS_MAGIC,
        "IDX u8 labels",
        LABELS_HEADER,
    )?;
    let n = be_u32(&bytes, 4) as usize;
    if n == 0 {
        return Err(DatasetError::BadHeader {
            path: path.to_path_buf(),
            reason: "label count is 0".to_string(),
        });
    }
    check_payload(
        path,
        bytes.len() - LABELS_HEADER,
        n as u64,
        LABELS_HEADER,
        || format!("{n} labels"),
    )?;
    bytes.drain(..LABELS_HEADER);
    if let Some(index) = bytes
        .iter()
        .position(|&label| usize::from(label) >= IDX_NUM_CLASSES)
    {
        return Err(DatasetError::BadLabel {
            path: path.to_path_buf(),
            index,
            label: bytes[index],
            num_classes: IDX_NUM_CLASSES,
        });
    }
    Ok(bytes)
}

/// Reads an IDX image file (raw or gzip) and returns `(count, rows, cols, pixels)`.
///
/// The magic number, the dimensions and the exact payload length are all checked; a file that
/// is short or carries extra bytes is rejected rather than partially used.
pub fn read_idx_images(path: &Path) -> Result<(usize, usize, usize, Vec<u8>), DatasetError> {
    let declared = |h: &[u8]| {
        let (n, rows, cols) = (be_u32(h, 4), be_u32(h, 8), be_u32(h, 12));
        if rows as usize > MAX_SIDE || cols as usize > MAX_SIDE {
            return 0;
        }
        u64::from(n) * u64::from(rows) * u64::from(cols)
    };
    parse_images(path, read_maybe_gzip(path, IMAGES_HEADER, declared)?)
}

/// Reads an IDX label file (raw or gzip), checking its header, length and that every label is
/// one of the ten classes.
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>, DatasetError> {
    parse_labels(
        path,
        read_maybe_gzip(path, LABELS_HEADER, |h| u64::from(be_u32(h, 4)))?,
    )
}

/// The accepted spellings of one of the four standard files: the original dash form and the
/// dot form some mirrors use, each raw or gzipped.
pub(crate) fn candidate_names(stem: &str, kind: &str) -> Vec<String> {
    let dotted = format!("{stem}.{kind}-ubyte");
    let dashed = format!("{stem}-{kind}-ubyte");
    vec![
        dashed.clone(),
        format!("{dashed}.gz"),
        dotted.clone(),
        format!("{dotted}.gz"),
    ]
}

fn find_file(
    dir: &Path,
    stem: &str,
    kind: &str,
    role: &'static str,
) -> Result<PathBuf, DatasetError> {
    let candidates = candidate_names(stem, kind);
    candidates
        .iter()
        .map(|name| dir.join(name))
        .find(|path| path.is_file())
        .ok_or_else(|| DatasetError::MissingFile {
            dir: dir.to_path_buf(),
            role,
            candidates,
        })
}

/// Loads one split from its image and label files and checks that they agree.
fn load_split(images_path: &Path, labels_path: &Path) -> Result<ImageDataset, DatasetError> {
    let (n, rows, cols, images) = read_idx_images(images_path)?;
    let labels = read_idx_labels(labels_path)?;
    if labels.len() != n {
        return Err(DatasetError::Mismatch {
            first: images_path.to_path_buf(),
            second: labels_path.to_path_buf(),
            reason: format!("{n} images but {} labels", labels.len()),
        });
    }
    Ok(ImageDataset {
        images,
        labels,
        height: rows,
        width: cols,
        num_classes: IDX_NUM_CLASSES,
        max_value: u8::MAX,
    })
}

/// The `cargo xtask fetch-data` target to suggest for a dataset name.
fn fetch_target(name: &str) -> &'static str {
    if name.to_ascii_lowercase().contains("fashion") {
        "fashion-mnist"
    } else {
        "mnist"
    }
}

/// Loads an MNIST-style directory holding the four standard IDX files.
///
/// Each file may be named in the dash form (`train-images-idx3-ubyte`) or the dot form
/// (`train-images.idx3-ubyte`), optionally with `.gz`. `name` labels the result (e.g. "mnist"
/// or "fashion-mnist") and picks the fetch command suggested when the directory is missing.
pub fn load_idx_dir(dir: &Path, name: &str) -> Result<ImageSplits, DatasetError> {
    if !dir.exists() {
        return Err(DatasetError::MissingDir {
            dir: dir.to_path_buf(),
            fetch_target: fetch_target(name).to_string(),
        });
    }
    if !dir.is_dir() {
        return Err(DatasetError::io(
            dir,
            "expected a data directory",
            io::Error::from(io::ErrorKind::NotADirectory),
        ));
    }
    // All four files are located before any is read, so a half-populated directory is
    // reported immediately instead of after parsing 47 MB of training images.
    let train_images = find_file(dir, "train-images", "idx3", "training images")?;
    let train_labels = find_file(dir, "train-labels", "idx1", "training labels")?;
    let test_images = find_file(dir, "t10k-images", "idx3", "test images")?;
    let test_labels = find_file(dir, "t10k-labels", "idx1", "test labels")?;

    let train = load_split(&train_images, &train_labels)?;
    let test = load_split(&test_images, &test_labels)?;
    if (train.height, train.width) != (test.height, test.width) {
        return Err(DatasetError::Mismatch {
            first: train_images,
            second: test_images,
            reason: format!(
                "training images are {}x{} but test images are {}x{}",
                train.height, train.width, test.height, test.width
            ),
        });
    }
    Ok(ImageSplits {
        train,
        test,
        name: name.to_string(),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use flate2::Compression;
    use flate2::write::GzEncoder;

    /// A scratch directory under the system temp dir, removed when dropped.
    pub(crate) struct ScratchDir(pub(crate) PathBuf);

    impl ScratchDir {
        pub(crate) fn new(tag: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let unique = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!(
                "kiln-datasets-{tag}-{}-{unique}",
                std::process::id()
            ));
            // A stale directory from an earlier crashed run with the same pid must not leak in.
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).expect("create scratch dir");
            ScratchDir(path)
        }
    }

    impl Drop for ScratchDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn images_bytes(n: u32, rows: u32, cols: u32, fill: impl Fn(usize) -> u8) -> Vec<u8> {
        let mut out = Vec::new();
        for word in [IDX_IMAGES_MAGIC, n, rows, cols] {
            out.extend_from_slice(&word.to_be_bytes());
        }
        out.extend((0..(n * rows * cols) as usize).map(fill));
        out
    }

    fn labels_bytes(labels: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&IDX_LABELS_MAGIC.to_be_bytes());
        out.extend_from_slice(&(labels.len() as u32).to_be_bytes());
        out.extend_from_slice(labels);
        out
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, bytes).unwrap();
        path
    }

    /// Writes a complete, valid four-file directory; `names` are the four file names in the
    /// order train images, train labels, test images, test labels.
    fn write_dir(dir: &Path, names: [&str; 4], compress: bool) {
        let train_labels: Vec<u8> = (0..5).map(|i| (i * 3 % 10) as u8).collect();
        let test_labels = [9, 0, 4];
        let files = [
            images_bytes(5, 3, 2, |i| (i * 7 % 256) as u8),
            labels_bytes(&train_labels),
            images_bytes(3, 3, 2, |i| (255 - i) as u8),
            labels_bytes(&test_labels),
        ];
        for (name, bytes) in names.iter().zip(files) {
            let bytes = if compress { gzip(&bytes) } else { bytes };
            write(dir, name, &bytes);
        }
    }

    fn check_loaded(splits: &ImageSplits) {
        assert_eq!(splits.name, "mnist");
        assert_eq!(splits.train.len(), 5);
        assert_eq!(splits.test.len(), 3);
        assert_eq!((splits.train.height, splits.train.width), (3, 2));
        assert_eq!(splits.train.pixels(), 6);
        assert_eq!(splits.train.image(1), &[42, 49, 56, 63, 70, 77]);
        assert_eq!(splits.train.labels, vec![0, 3, 6, 9, 2]);
        assert_eq!(splits.test.image(0), &[255, 254, 253, 252, 251, 250]);
        assert_eq!(splits.test.labels, vec![9, 0, 4]);
        assert_eq!(splits.train.max_value, 255);
        assert_eq!(splits.train.num_classes, 10);
    }

    const DASHED: [&str; 4] = [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ];
    const DOTTED: [&str; 4] = [
        "train-images.idx3-ubyte",
        "train-labels.idx1-ubyte",
        "t10k-images.idx3-ubyte",
        "t10k-labels.idx1-ubyte",
    ];

    #[test]
    fn round_trip_raw_dashed() {
        let dir = ScratchDir::new("raw-dashed");
        write_dir(&dir.0, DASHED, false);
        check_loaded(&load_idx_dir(&dir.0, "mnist").unwrap());
    }

    #[test]
    fn round_trip_raw_dotted() {
        let dir = ScratchDir::new("raw-dotted");
        write_dir(&dir.0, DOTTED, false);
        check_loaded(&load_idx_dir(&dir.0, "mnist").unwrap());
    }

    #[test]
    fn round_trip_gzip_both_namings() {
        let dir = ScratchDir::new("gz");
        let names = [
            "train-images-idx3-ubyte.gz",
            "train-labels.idx1-ubyte.gz",
            "t10k-images.idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte.gz",
        ];
        write_dir(&dir.0, names, true);
        check_loaded(&IdxKind::Mnist.load(&dir.0).unwrap());
    }

    #[test]
    fn gzip_is_detected_by_content_not_name() {
        let dir = ScratchDir::new("sniff");
        // Compressed data under a raw name and raw data under a .gz name must both load.
        let images = write(&dir.0, "a", &gzip(&images_bytes(2, 2, 2, |i| i as u8)));
        let labels = write(&dir.0, "b.gz", &labels_bytes(&[1, 7]));
        let (n, rows, cols, pixels) = read_idx_images(&images).unwrap();
        assert_eq!((n, rows, cols), (2, 2, 2));
        assert_eq!(pixels, (0..8).collect::<Vec<u8>>());
        assert_eq!(read_idx_labels(&labels).unwrap(), vec![1, 7]);
    }

    #[test]
    fn wrong_magic_is_reported_in_hex() {
        let dir = ScratchDir::new("magic");
        let labels = write(&dir.0, "labels", &labels_bytes(&[1, 2]));
        let err = read_idx_images(&labels).unwrap_err();
        assert!(matches!(
            err,
            DatasetError::BadMagic {
                found: 0x801,
                expected: 0x803,
                ..
            }
        ));
        let text = err.to_string();
        assert!(
            text.contains("bad magic number 0x00000801, expected 0x00000803 (IDX u8 images)"),
            "{text}"
        );
        assert!(text.contains("label file"), "{text}");
        assert!(text.contains("labels"), "{text}");

        let zeros = write(&dir.0, "zeros", &[0u8; 32]);
        let text = read_idx_labels(&zeros).unwrap_err().to_string();
        assert!(
            text.ends_with("bad magic number 0x00000000, expected 0x00000801 (IDX u8 labels)"),
            "{text}"
        );
    }

    #[test]
    fn short_header_is_rejected() {
        let dir = ScratchDir::new("short");
        let path = write(&dir.0, "short", &[0, 0, 8, 3, 0, 0]);
        let err = read_idx_images(&path).unwrap_err();
        assert!(matches!(err, DatasetError::BadHeader { .. }), "{err}");
        assert!(err.to_string().contains("only 6 bytes"), "{err}");
        let empty = write(&dir.0, "empty", &[]);
        assert!(read_idx_labels(&empty).is_err());
    }

    #[test]
    fn truncated_images_are_rejected() {
        let dir = ScratchDir::new("trunc");
        let mut bytes = images_bytes(4, 28, 28, |_| 1);
        bytes.truncate(IMAGES_HEADER + 1000);
        let path = write(&dir.0, "imgs", &bytes);
        let err = read_idx_images(&path).unwrap_err();
        assert!(matches!(err, DatasetError::Truncated { .. }));
        let text = err.to_string();
        assert!(
            text.contains(
                "truncated: header says 4 images of 28x28 (3136 bytes) but file holds 1000 bytes"
            ),
            "{text}"
        );
        // A truncated gzip stream must fail too, not yield a short buffer silently.
        let gz = gzip(&images_bytes(4, 28, 28, |i| i as u8));
        let path = write(&dir.0, "imgs.gz", &gz[..gz.len() / 2]);
        let err = read_idx_images(&path).unwrap_err();
        assert!(err.to_string().contains("imgs.gz"), "{err}");
    }

    #[test]
    fn extra_bytes_are_rejected() {
        let dir = ScratchDir::new("extra");
        let mut bytes = labels_bytes(&[1, 2, 3]);
        bytes.push(4);
        let path = write(&dir.0, "labels", &bytes);
        let err = read_idx_labels(&path).unwrap_err();
        assert!(matches!(
            err,
            DatasetError::TrailingBytes {
                expected_bytes: 3,
                found_bytes: 4,
                ..
            }
        ));
        let mut bytes = images_bytes(1, 2, 2, |_| 0);
        bytes.extend_from_slice(&[0; 9]);
        let path = write(&dir.0, "images", &bytes);
        assert!(matches!(
            read_idx_images(&path).unwrap_err(),
            DatasetError::TrailingBytes { .. }
        ));
    }

    #[test]
    fn bad_dimensions_are_rejected() {
        let dir = ScratchDir::new("dims");
        for (n, rows, cols, needle) in [
            (0, 28, 28, "image count is 0"),
            (3, 0, 28, "image size is 0x28"),
            (1, 100_000, 1, "implausible"),
        ] {
            let mut bytes = Vec::new();
            for word in [IDX_IMAGES_MAGIC, n, rows, cols] {
                bytes.extend_from_slice(&word.to_be_bytes());
            }
            let path = write(&dir.0, "dims", &bytes);
            let text = read_idx_images(&path).unwrap_err().to_string();
            assert!(text.contains(needle), "{text}");
        }
        let path = write(&dir.0, "nolabels", &labels_bytes(&[]));
        let text = read_idx_labels(&path).unwrap_err().to_string();
        assert!(text.contains("label count is 0"), "{text}");
    }

    #[test]
    fn out_of_range_label_is_rejected() {
        let dir = ScratchDir::new("label");
        let path = write(&dir.0, "labels", &labels_bytes(&[1, 9, 10, 3]));
        let err = read_idx_labels(&path).unwrap_err();
        assert!(matches!(
            err,
            DatasetError::BadLabel {
                index: 2,
                label: 10,
                ..
            }
        ));
        assert!(
            err.to_string()
                .contains("label 2 is 10, expected a class in 0..10")
        );
    }

    #[test]
    fn count_mismatch_is_rejected() {
        let dir = ScratchDir::new("count");
        write_dir(&dir.0, DASHED, false);
        write(&dir.0, DASHED[3], &labels_bytes(&[1, 2]));
        let err = load_idx_dir(&dir.0, "mnist").unwrap_err();
        assert!(matches!(err, DatasetError::Mismatch { .. }));
        let text = err.to_string();
        assert!(text.contains("3 images but 2 labels"), "{text}");
        assert!(text.contains("t10k-labels-idx1-ubyte"), "{text}");
    }

    #[test]
    fn shape_mismatch_between_splits_is_rejected() {
        let dir = ScratchDir::new("shape");
        write_dir(&dir.0, DASHED, false);
        write(&dir.0, DASHED[2], &images_bytes(3, 2, 3, |_| 0));
        let text = load_idx_dir(&dir.0, "mnist").unwrap_err().to_string();
        assert!(
            text.contains("training images are 3x2 but test images are 2x3"),
            "{text}"
        );
    }

    #[test]
    fn missing_dir_names_the_fetch_command() {
        let dir = ScratchDir::new("gone");
        let missing = dir.0.join("nowhere");
        let text = load_idx_dir(&missing, "mnist").unwrap_err().to_string();
        assert_eq!(
            text,
            format!(
                "data directory {} does not exist (run `cargo xtask fetch-data mnist` or set data.dir)",
                missing.display()
            )
        );
        let text = load_idx_dir(&missing, "fashion-mnist")
            .unwrap_err()
            .to_string();
        assert!(text.contains("fetch-data fashion-mnist"), "{text}");

        let file = write(&dir.0, "plain-file", b"x");
        let text = load_idx_dir(&file, "mnist").unwrap_err().to_string();
        assert!(text.contains("expected a data directory"), "{text}");
    }

    #[test]
    fn missing_file_lists_accepted_names() {
        let dir = ScratchDir::new("partial");
        write_dir(&dir.0, DASHED, false);
        fs::remove_file(dir.0.join(DASHED[1])).unwrap();
        let text = load_idx_dir(&dir.0, "mnist").unwrap_err().to_string();
        assert!(!text.contains('\n'));
        assert!(text.contains(&dir.0.display().to_string()), "{text}");
        assert!(text.contains("no training labels file"), "{text}");
        for name in [
            "train-labels-idx1-ubyte",
            "train-labels-idx1-ubyte.gz",
            "train-labels.idx1-ubyte",
            "train-labels.idx1-ubyte.gz",
        ] {
            assert!(text.contains(name), "{text}");
        }
    }

    #[test]
    fn unreadable_file_names_the_path() {
        let dir = ScratchDir::new("io");
        let path = dir.0.join("absent");
        let err = read_idx_labels(&path).unwrap_err();
        assert!(std::error::Error::source(&err).is_some());
        assert!(err.to_string().starts_with(&path.display().to_string()));
        assert_eq!(err.path(), Some(path.as_path()));
    }

    #[test]
    fn kind_names_parse_and_print() {
        for kind in [IdxKind::Mnist, IdxKind::FashionMnist] {
            assert_eq!(kind.name().parse::<IdxKind>().unwrap(), kind);
            assert_eq!(kind.to_string(), kind.name());
            assert!(kind.default_dir().ends_with(kind.name()));
        }
        assert_eq!(
            "Fashion_MNIST".parse::<IdxKind>().unwrap(),
            IdxKind::FashionMnist
        );
        assert!("cifar".parse::<IdxKind>().is_err());
    }
}
