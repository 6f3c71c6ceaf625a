//! The small 8x8 handwritten-digits set embedded in the crate, so kiln can train and test
//! without any download.
//!
//! The data is the UCI "Optical Recognition of Handwritten Digits" test set (1,797 images) in
//! the form scikit-learn distributes it; see `datasets/data/README.md` for its origin, licence
//! and the byte layout decoded here.

use std::io::Read;

use flate2::read::GzDecoder;

use crate::images::{ImageDataset, ImageSplits};
use crate::rng::permutation;

/// The gzip-compressed digits file: a 10-byte header, then one record per image.
static DIGITS_GZ: &[u8] = include_bytes!("../data/digits.bin.gz");

const MAGIC: &[u8; 4] = b"KDIG";
const HEADER: usize = 10;
const SIDE: usize = 8;
const MAX_VALUE: u8 = 16;
const NUM_CLASSES: usize = 10;

/// The number of images in the embedded digits set.
pub const DIGITS_TOTAL: usize = 1_797;
/// The number of digits images in the training split.
pub const DIGITS_TRAIN: usize = 1_437;
/// The number of digits images in the test split (about a fifth of the set).
pub const DIGITS_TEST: usize = DIGITS_TOTAL - DIGITS_TRAIN;
/// The seed of the shuffle that assigns images to the train and test splits.
///
/// It is fixed so the split never changes between runs, machines or versions; changing it
/// would silently make old and new test accuracies incomparable.
pub const DIGITS_SEED: u64 = 0x6b69_6c6e_6469_6769;

/// Decodes the embedded file into one dataset in file order.
fn decode(compressed: &[u8]) -> Result<ImageDataset, String> {
    let mut bytes = Vec::new();
    GzDecoder::new(compressed)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot inflate: {e}"))?;
    if bytes.len() < HEADER || &bytes[..4] != MAGIC {
        return Err("missing KDIG header".to_string());
    }
    let count = u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
    let (height, width) = (usize::from(bytes[8]), usize::from(bytes[9]));
    if (height, width) != (SIDE, SIDE) {
        return Err(format!(
            "image size {height}x{width}, expected {SIDE}x{SIDE}"
        ));
    }
    let record = height * width + 1;
    let body = &bytes[HEADER..];
    if body.len() != count * record {
        return Err(format!(
            "header says {count} records of {record} bytes but {} bytes follow",
            body.len()
        ));
    }
    let mut images = Vec::with_capacity(count * (record - 1));
    let mut labels = Vec::with_capacity(count);
    for chunk in body.chunks_exact(record) {
        let (pixels, label) = chunk.split_at(record - 1);
        if pixels.iter().any(|&p| p > MAX_VALUE) || usize::from(label[0]) >= NUM_CLASSES {
            return Err("pixel or label out of range".to_string());
        }
        images.extend_from_slice(pixels);
        labels.push(label[0]);
    }
    Ok(ImageDataset {
        images,
        labels,
        height,
        width,
        num_classes: NUM_CLASSES,
        max_value: MAX_VALUE,
    })
}

/// The embedded 8x8 digits set, split into 1,437 training and 360 test images.
///
/// Pixels range over `0..=16`. The split is a shuffle with the fixed [`DIGITS_SEED`], so every
/// call returns identical data.
pub fn digits() -> ImageSplits {
    // The embedded bytes are checked by this crate's tests, so failure here means the binary
    // itself is corrupt and there is nothing sensible a caller could do about it.
    let all = decode(DIGITS_GZ).expect("embedded digits data is corrupt");
    assert_eq!(
        all.len(),
        DIGITS_TOTAL,
        "embedded digits data has wrong size"
    );
    let order = permutation(all.len(), DIGITS_SEED);
    let (train, test) = order.split_at(DIGITS_TRAIN);
    ImageSplits {
        train: all.subset(train),
        test: all.subset(test),
        name: "digits".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_shapes() {
        let splits = digits();
        assert_eq!(splits.name, "digits");
        assert_eq!(splits.train.len(), DIGITS_TRAIN);
        assert_eq!(splits.test.len(), DIGITS_TEST);
        assert_eq!(DIGITS_TEST, 360);
        for set in [&splits.train, &splits.test] {
            assert_eq!((set.height, set.width), (8, 8));
            assert_eq!(set.pixels(), 64);
            assert_eq!(set.images.len(), set.len() * 64);
            assert_eq!(set.max_value, 16);
            assert_eq!(set.num_classes, 10);
            assert!(set.labels.iter().all(|&l| l < 10));
            assert!(set.images.iter().all(|&p| p <= 16));
        }
    }

    #[test]
    fn file_order_matches_source() {
        // The first record of the source CSV is a zero; checking it pins the decoder's layout.
        let all = decode(DIGITS_GZ).unwrap();
        assert_eq!(all.label(0), 0);
        assert_eq!(&all.image(0)[..8], &[0, 0, 5, 13, 9, 1, 0, 0]);
        assert_eq!(all.label(1), 1);
        assert_eq!(
            all.class_counts(),
            vec![178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
        );
    }

    #[test]
    fn split_is_deterministic_and_disjoint() {
        let a = digits();
        assert_eq!(a, digits());
        // Every source image lands in exactly one split, so the class totals add back up.
        let all = decode(DIGITS_GZ).unwrap().class_counts();
        let train = a.train.class_counts();
        let test = a.test.class_counts();
        for class in 0..10 {
            assert_eq!(train[class] + test[class], all[class]);
            // 36 per class is expected in the test split; a shuffle keeps each near that.
            assert!((20..=52).contains(&test[class]), "{test:?}");
        }
        // The split must be a real shuffle, not the file order.
        let first = decode(DIGITS_GZ).unwrap();
        assert_ne!(a.train.image(0), first.image(0));
    }

    #[test]
    fn corrupt_data_is_rejected() {
        assert!(decode(b"not gzip").is_err());
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut encoder, b"KDIG\0\0\0\x02\x08\x08short").unwrap();
        let err = decode(&encoder.finish().unwrap()).unwrap_err();
        assert!(err.contains("2 records"), "{err}");
    }
}
