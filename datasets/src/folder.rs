//! Image folders in torchvision's ImageFolder layout: one sub-folder per class, each holding
//! that class's PNG and JPEG files. Files are listed at open time and decoded when a batch
//! needs them, so a folder larger than memory trains as well as a small one.

use std::path::{Path, PathBuf};

use image::imageops::FilterType;

use crate::error::DatasetError;

/// The file names an image folder takes (by extension, case-insensitive); other files
/// (`.DS_Store`, notes) are passed over.
pub const IMAGE_EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// One split of an image folder (`train/`, `test/` or `val/`): its classes and files.
#[derive(Debug, Clone)]
pub struct ImageFolder {
    dir: PathBuf,
    classes: Vec<String>,
    files: Vec<(PathBuf, u32)>,
}

/// The pixels of one decoded image, resized, row-major, channels last (`h × w × c`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pixels {
    /// `height × width × channels` bytes.
    pub data: Vec<u8>,
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// 1 (grey) or 3 (RGB).
    pub channels: usize,
}

impl ImageFolder {
    /// Lists `dir`: every sub-folder is a class (sorted by name, numbered from 0), every image
    /// file in it a sample. A missing folder, a folder without class folders, or a class
    /// folder without images is an error naming it.
    pub fn open(dir: &Path) -> Result<Self, DatasetError> {
        Self::with_classes(dir, &class_folders(dir)?)
    }

    /// Lists `dir` with the classes of another split (`train/`'s): its class folders must
    /// be among them, and are numbered as there; a class may be missing from `dir`.
    pub fn open_as(dir: &Path, classes: &[String]) -> Result<Self, DatasetError> {
        let own = class_folders(dir)?;
        if let Some(unknown) = own.iter().find(|c| !classes.contains(c)) {
            return Err(DatasetError::bad(
                &dir.join(unknown),
                format!(
                    "class folder `{unknown}` is not a class of the training folder (its \
                     classes: {})",
                    classes.join(", ")
                ),
            ));
        }
        let mut folder = Self::with_classes(dir, &own)?;
        // Labels follow the training folder's numbering.
        for (_, label) in &mut folder.files {
            let name = &own[*label as usize];
            *label = classes.iter().position(|c| c == name).expect("checked") as u32;
        }
        folder.classes = classes.to_vec();
        Ok(folder)
    }

    fn with_classes(dir: &Path, classes: &[String]) -> Result<Self, DatasetError> {
        let mut files = Vec::new();
        for (label, class) in classes.iter().enumerate() {
            let class_dir = dir.join(class);
            let mut images: Vec<PathBuf> = read_dir(&class_dir)?
                .into_iter()
                .filter(|p| p.is_file() && is_image(p))
                .collect();
            if images.is_empty() {
                return Err(DatasetError::bad(
                    &class_dir,
                    format!(
                        "class folder `{class}` holds no images (expected .png, .jpg or .jpeg \
                         files)"
                    ),
                ));
            }
            images.sort();
            files.extend(images.into_iter().map(|p| (p, label as u32)));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            classes: classes.to_vec(),
            files,
        })
    }

    /// The folder listed.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The class names, in label order.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether the folder holds no images (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The file of sample `i`.
    pub fn path(&self, i: usize) -> &Path {
        &self.files[i].0
    }

    /// The label of sample `i`.
    pub fn label(&self, i: usize) -> u32 {
        self.files[i].1
    }

    /// Sample `i` decoded, in `channels` (1: grey, 3: RGB), resized to `height × width`
    /// (bilinear) when its size differs.
    pub fn load(
        &self,
        i: usize,
        channels: usize,
        height: usize,
        width: usize,
    ) -> Result<Pixels, DatasetError> {
        load_image(self.path(i), channels, height, width)
    }
}

/// The image at `path` decoded, in `channels` (1 or 3), resized to `height × width`. A file
/// that does not decode (corrupt, truncated, not an image) is an error naming it.
pub fn load_image(
    path: &Path,
    channels: usize,
    height: usize,
    width: usize,
) -> Result<Pixels, DatasetError> {
    let bytes = std::fs::read(path).map_err(|e| DatasetError::io(path, "cannot read", e))?;
    let image = image::load_from_memory(&bytes)
        .map_err(|e| DatasetError::bad(path, format!("cannot decode the image: {e}")))?;
    let (w, h) = (width as u32, height as u32);
    let data = match channels {
        1 => {
            let grey = image.into_luma8();
            if grey.dimensions() == (w, h) {
                grey.into_raw()
            } else {
                image::imageops::resize(&grey, w, h, FilterType::Triangle).into_raw()
            }
        }
        3 => {
            let rgb = image.into_rgb8();
            if rgb.dimensions() == (w, h) {
                rgb.into_raw()
            } else {
                image::imageops::resize(&rgb, w, h, FilterType::Triangle).into_raw()
            }
        }
        other => {
            return Err(DatasetError::bad(
                path,
                format!("{other} channels asked for; an image folder gives 1 (grey) or 3 (RGB)"),
            ));
        }
    };
    Ok(Pixels {
        data,
        height,
        width,
        channels,
    })
}

/// The size and colour of the image at `path` (its height, width, and 1 for grey or 3 for
/// colour), read from its header.
pub fn image_shape(path: &Path) -> Result<(usize, usize, usize), DatasetError> {
    let reader = image::ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(|e| DatasetError::io(path, "cannot read", e))?;
    let decoder = reader
        .into_decoder()
        .map_err(|e| DatasetError::bad(path, format!("cannot decode the image: {e}")))?;
    let (w, h) = image::ImageDecoder::dimensions(&decoder);
    let channels = if image::ImageDecoder::color_type(&decoder).has_color() {
        3
    } else {
        1
    };
    Ok((h as usize, w as usize, channels))
}

/// The file format [`write_folder`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Lossless PNG.
    Png,
    /// JPEG at the given quality (1–100).
    Jpeg(u8),
}

/// Writes the first `train` and `test` images of `splits` as an image folder under `root`
/// (`train/` and `test/`, one folder per class named by its label), each resized to
/// `size × size` (bilinear; `None` keeps the size) and written as `format`. Returns the
/// number of files written.
pub fn write_folder(
    splits: &crate::images::ImageSplits,
    root: &Path,
    size: Option<usize>,
    format: Format,
    train: usize,
    test: usize,
) -> Result<usize, DatasetError> {
    let mut written = 0;
    for (name, set, n) in [
        ("train", &splits.train, train),
        ("test", &splits.test, test),
    ] {
        for i in 0..n.min(set.len()) {
            let dir = root.join(name).join(set.label(i).to_string());
            std::fs::create_dir_all(&dir)
                .map_err(|e| DatasetError::io(&dir, "cannot create directory", e))?;
            let scale = 255.0 / f32::from(set.max_value);
            let pixels: Vec<u8> = set
                .image(i)
                .iter()
                .map(|&p| (f32::from(p) * scale).round() as u8)
                .collect();
            let grey = image::GrayImage::from_raw(set.width as u32, set.height as u32, pixels)
                .expect("an IDX image holds width × height pixels");
            let grey = match size {
                Some(s) if (s, s) != (set.width, set.height) => {
                    image::imageops::resize(&grey, s as u32, s as u32, FilterType::Triangle)
                }
                _ => grey,
            };
            let (path, result) = match format {
                Format::Png => {
                    let path = dir.join(format!("{i:05}.png"));
                    let r = grey.save(&path).map_err(|e| e.to_string());
                    (path, r)
                }
                Format::Jpeg(quality) => {
                    let path = dir.join(format!("{i:05}.jpg"));
                    let r = std::fs::File::create(&path)
                        .map_err(|e| e.to_string())
                        .and_then(|f| {
                            let mut w = std::io::BufWriter::new(f);
                            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut w, quality)
                                .encode_image(&grey)
                                .map_err(|e| e.to_string())
                        });
                    (path, r)
                }
            };
            result.map_err(|e| DatasetError::bad(&path, format!("cannot write: {e}")))?;
            written += 1;
        }
    }
    Ok(written)
}

fn is_image(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

fn read_dir(dir: &Path) -> Result<Vec<PathBuf>, DatasetError> {
    if !dir.is_dir() {
        return Err(DatasetError::bad(
            dir,
            "is not a folder (or does not exist)",
        ));
    }
    std::fs::read_dir(dir)
        .map_err(|e| DatasetError::io(dir, "cannot list", e))?
        .map(|entry| {
            entry
                .map(|e| e.path())
                .map_err(|e| DatasetError::io(dir, "cannot list", e))
        })
        .collect()
}

/// The class folders of `dir`, sorted by name (hidden folders passed over); none is an error.
fn class_folders(dir: &Path) -> Result<Vec<String>, DatasetError> {
    let mut classes: Vec<String> = read_dir(dir)?
        .into_iter()
        .filter(|p| p.is_dir())
        .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(str::to_string))
        .filter(|n| !n.starts_with('.'))
        .collect();
    if classes.is_empty() {
        return Err(DatasetError::bad(
            dir,
            "holds no class folders (expected one sub-folder per class, each with its \
             .png/.jpg images)",
        ));
    }
    classes.sort();
    Ok(classes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_png(path: &Path, w: u32, h: u32, value: u8) {
        let img = image::GrayImage::from_pixel(w, h, image::Luma([value]));
        img.save(path).unwrap();
    }

    #[test]
    fn lists_classes_and_reads_images_resized() {
        let root = std::env::temp_dir().join(format!("kiln-folder-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (class, n) in [("cat", 2), ("dog", 3)] {
            std::fs::create_dir_all(root.join("train").join(class)).unwrap();
            for i in 0..n {
                write_png(
                    &root.join(format!("train/{class}/{i}.png")),
                    8,
                    6,
                    10 * i as u8,
                );
            }
        }
        std::fs::write(root.join("train/cat/notes.txt"), "not an image").unwrap();
        let f = ImageFolder::open(&root.join("train")).unwrap();
        assert_eq!(f.classes(), ["cat", "dog"]);
        assert_eq!(f.len(), 5);
        assert_eq!((f.label(1), f.label(2)), (0, 1));
        assert_eq!(image_shape(f.path(0)).unwrap(), (6, 8, 1));
        let px = f.load(3, 1, 6, 8).unwrap();
        assert_eq!(px.data, vec![10; 48]);
        let small = f.load(3, 3, 3, 4).unwrap();
        assert_eq!(small.data.len(), 3 * 4 * 3);

        // The test split numbers its classes as training does.
        std::fs::create_dir_all(root.join("test/dog")).unwrap();
        write_png(&root.join("test/dog/a.png"), 8, 6, 0);
        let test = ImageFolder::open_as(&root.join("test"), f.classes()).unwrap();
        assert_eq!((test.len(), test.label(0)), (1, 1));
        std::fs::create_dir_all(root.join("test/bird")).unwrap();
        let e = ImageFolder::open_as(&root.join("test"), f.classes()).unwrap_err();
        assert!(e.to_string().contains("`bird` is not a class"), "{e}");

        // An empty class folder, and a corrupt file, are one line naming them.
        std::fs::create_dir_all(root.join("train/eel")).unwrap();
        let e = ImageFolder::open(&root.join("train"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train/eel") && e.contains("holds no images"),
            "{e}"
        );
        let bad = root.join("train/cat/0.png");
        let bytes = std::fs::read(&bad).unwrap();
        std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
        let e = load_image(&bad, 1, 6, 8).unwrap_err().to_string();
        assert!(
            e.contains("cat/0.png") && e.contains("cannot decode"),
            "{e}"
        );
        assert!(!e.contains('\n'));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
