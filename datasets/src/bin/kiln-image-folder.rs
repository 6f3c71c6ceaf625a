//! `kiln-image-folder`: writes MNIST or Fashion-MNIST (IDX files) as an image folder in
//! torchvision's ImageFolder layout, for `data.dataset = "image-folder"` and its benchmark.
//!
//! ```text
//! cargo run --release -p kiln-datasets --bin kiln-image-folder -- \
//!     --idx data/fashion-mnist --out data/fashion-folder [--size 64] [--jpeg 90] \
//!     [--train 60000] [--test 10000]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use kiln_datasets::folder::{Format, write_folder};
use kiln_datasets::load_idx_dir;

const USAGE: &str = "usage: kiln-image-folder --idx DIR --out DIR [--size N] [--jpeg QUALITY] \
                     [--train N] [--test N]";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut idx, mut out, mut size, mut format) = (None, None, None, Format::Png);
    let (mut train, mut test) = (usize::MAX, usize::MAX);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value; {USAGE}"));
        let number = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{flag} {v:?}: expected a whole number"))
        };
        match flag.as_str() {
            "--idx" => idx = Some(PathBuf::from(value()?)),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--size" => size = Some(number(value()?)?),
            "--jpeg" => {
                let q = number(value()?)?;
                if !(1..=100).contains(&q) {
                    return Err(format!("--jpeg {q}: the quality is 1 to 100"));
                }
                format = Format::Jpeg(q as u8);
            }
            "--train" => train = number(value()?)?,
            "--test" => test = number(value()?)?,
            other => return Err(format!("unknown argument {other:?}; {USAGE}")),
        }
    }
    let (Some(idx), Some(out)) = (idx, out) else {
        return Err(USAGE.to_string());
    };
    let name = idx
        .file_name()
        .map_or("idx".to_string(), |n| n.to_string_lossy().into_owned());
    let splits = load_idx_dir(&idx, &name).map_err(|e| e.to_string())?;
    let n = write_folder(&splits, &out, size, format, train, test).map_err(|e| e.to_string())?;
    println!("wrote {n} images into {}", out.display());
    Ok(())
}
