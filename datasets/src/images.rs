//! Labelled images in memory: a set of one size, and its training and test splits.

use std::fmt;

/// An in-memory labelled image set, pixels row-major u8.
///
/// Image `i` occupies `images[i * pixels() .. (i + 1) * pixels()]`, one byte per pixel,
/// rows first. Pixel values lie in `0..=max_value`, so dividing by `max_value` maps them to
/// `[0, 1]` whatever the source's intensity scale.
#[derive(Clone, PartialEq, Eq)]
pub struct ImageDataset {
    /// All pixels of all images, concatenated.
    pub images: Vec<u8>,
    /// One class label per image, each below `num_classes`.
    pub labels: Vec<u8>,
    /// Image height in pixels.
    pub height: usize,
    /// Image width in pixels.
    pub width: usize,
    /// The number of classes labels are drawn from.
    pub num_classes: usize,
    /// The largest possible pixel value: 255 for MNIST, 16 for digits.
    pub max_value: u8,
}

impl ImageDataset {
    /// The number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the set holds no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The pixels of image `i`, row-major.
    ///
    /// # Panics
    ///
    /// Panics if `i >= len()`.
    pub fn image(&self, i: usize) -> &[u8] {
        let size = self.pixels();
        &self.images[i * size..(i + 1) * size]
    }

    /// The label of image `i`.
    ///
    /// # Panics
    ///
    /// Panics if `i >= len()`.
    pub fn label(&self, i: usize) -> u8 {
        self.labels[i]
    }

    /// The number of pixels in one image (`height * width`).
    pub fn pixels(&self) -> usize {
        self.height * self.width
    }

    /// How many images carry each label, indexed by class.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.num_classes];
        for &label in &self.labels {
            counts[usize::from(label)] += 1;
        }
        counts
    }

    /// A new set holding the images at `indices`, in that order (repeats allowed).
    ///
    /// # Panics
    ///
    /// Panics if any index is out of range.
    pub fn subset(&self, indices: &[usize]) -> ImageDataset {
        let mut images = Vec::with_capacity(indices.len() * self.pixels());
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            images.extend_from_slice(self.image(i));
            labels.push(self.label(i));
        }
        ImageDataset {
            images,
            labels,
            height: self.height,
            width: self.width,
            num_classes: self.num_classes,
            max_value: self.max_value,
        }
    }
}

// A derived Debug would print every pixel, which buries the useful shape information.
impl fmt::Debug for ImageDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImageDataset")
            .field("len", &self.len())
            .field("height", &self.height)
            .field("width", &self.width)
            .field("num_classes", &self.num_classes)
            .field("max_value", &self.max_value)
            .finish_non_exhaustive()
    }
}

/// A dataset's fixed train and test partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSplits {
    /// The examples to fit on.
    pub train: ImageDataset,
    /// The held-out examples to evaluate on.
    pub test: ImageDataset,
    /// A short name for logs and run metadata, e.g. "mnist" or "digits".
    pub name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ImageDataset {
        ImageDataset {
            images: (0..12).collect(),
            labels: vec![2, 0, 2],
            height: 2,
            width: 2,
            num_classes: 3,
            max_value: 11,
        }
    }

    #[test]
    fn accessors_slice_by_image() {
        let set = tiny();
        assert_eq!(set.len(), 3);
        assert!(!set.is_empty());
        assert_eq!(set.pixels(), 4);
        assert_eq!(set.image(1), &[4, 5, 6, 7]);
        assert_eq!(set.label(2), 2);
        assert_eq!(set.class_counts(), vec![1, 0, 2]);
    }

    #[test]
    fn subset_copies_selected_images() {
        let set = tiny();
        let sub = set.subset(&[2, 0]);
        assert_eq!(sub.len(), 2);
        assert_eq!(sub.image(0), set.image(2));
        assert_eq!(sub.image(1), set.image(0));
        assert_eq!(sub.labels, vec![2, 2]);
        assert!(set.subset(&[]).is_empty());
    }

    #[test]
    fn debug_is_a_summary() {
        let text = format!("{:?}", tiny());
        assert!(text.contains("len: 3"), "{text}");
        assert!(!text.contains("images"), "{text}");
    }
}
