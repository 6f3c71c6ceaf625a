//! Prints the size, shape and class balance of a dataset, as a quick check that a fetched
//! directory loads: `cargo run -p kiln-datasets --example summary -- data/mnist`.
//! With no argument it summarises the embedded digits set.

use std::path::Path;
use std::process::ExitCode;

use kiln_datasets::{ImageDataset, digits, load_idx_dir};

fn describe(split: &str, set: &ImageDataset) {
    let max_pixel = set.images.iter().copied().max().unwrap_or(0);
    println!(
        "{split}: {} images of {}x{}, pixels up to {max_pixel} (scale {}), class counts {:?}",
        set.len(),
        set.height,
        set.width,
        set.max_value,
        set.class_counts()
    );
}

fn main() -> ExitCode {
    let splits = match std::env::args().nth(1) {
        None => digits(),
        Some(dir) => {
            let path = Path::new(&dir);
            // The directory's last component doubles as the dataset name, which also picks
            // the fetch command suggested if the directory is missing.
            let name = path
                .file_name()
                .map_or_else(|| dir.clone(), |n| n.to_string_lossy().into_owned());
            match load_idx_dir(path, &name) {
                Ok(splits) => splits,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    };
    println!("dataset {}", splits.name);
    describe("train", &splits.train);
    describe("test", &splits.test);
    ExitCode::SUCCESS
}
