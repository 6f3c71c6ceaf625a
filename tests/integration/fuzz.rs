//! Random and truncated bytes fed to every parser a user's file reaches: each answers with an
//! error naming the file (or, for bytes that happen to be valid, a value), never a panic, and
//! never allocates by what a header claims. A seeded generator makes every case reproducible;
//! each test prints how many cases it ran.

use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;

use crate::common::{small_config, temp_dir};

/// xorshift64*: the cases' source of randomness, seeded per test.
struct Cases(u64);

impl Cases {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// A variant of `valid`: truncated, bit-flipped, spliced with random bytes, or all random.
    fn mutate(&mut self, valid: &[u8]) -> Vec<u8> {
        let mut v = valid.to_vec();
        match self.below(5) {
            0 => v.truncate(self.below(valid.len() + 1)),
            1 => {
                for _ in 0..1 + self.below(8) {
                    if !v.is_empty() {
                        let i = self.below(v.len());
                        v[i] ^= 1 << self.below(8);
                    }
                }
            }
            2 => {
                let at = self.below(v.len() + 1);
                let junk: Vec<u8> = (0..self.below(64)).map(|_| self.next() as u8).collect();
                v.splice(at..at, junk);
            }
            3 => {
                let at = self.below(v.len() + 1);
                let end = (at + self.below(32)).min(v.len());
                v.drain(at..end);
            }
            _ => v = (0..self.below(256)).map(|_| self.next() as u8).collect(),
        }
        v
    }
}

/// Runs `parse` on `cases` variants of `valid` written to `path`; every outcome must be a
/// value or an error whose message names the file.
fn fuzz<T>(
    name: &str,
    path: &Path,
    valid: &[u8],
    cases: usize,
    seed: u64,
    parse: impl Fn(&Path) -> Result<T, String>,
) {
    let mut cases_gen = Cases(seed);
    let file = path.file_name().unwrap().to_string_lossy().to_string();
    let mut errors = 0;
    for case in 0..cases {
        let bytes = cases_gen.mutate(valid);
        std::fs::write(path, &bytes).unwrap();
        match catch_unwind(AssertUnwindSafe(|| parse(path))) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                errors += 1;
                assert!(
                    e.contains(&file) || e.contains(&path.display().to_string()),
                    "{name} case {case}: the error does not name {file}: {e}"
                );
                assert!(!e.contains('\n'), "{name} case {case}: {e}");
            }
            Err(_) => panic!("{name} case {case}: the parser panicked on {bytes:?}"),
        }
    }
    println!("{name}: {cases} cases, {errors} errors, no panic");
}

fn idx_images(n: u32, side: u32) -> Vec<u8> {
    let mut v = Vec::new();
    for word in [0x0803u32, n, side, side] {
        v.extend(word.to_be_bytes());
    }
    v.extend((0..n * side * side).map(|i| i as u8));
    v
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

#[test]
fn idx_files_raw_and_gzipped() {
    let dir = temp_dir("fuzz-idx");
    let images = idx_images(3, 4);
    let mut labels = vec![0, 0, 8, 1, 0, 0, 0, 3];
    labels.extend([1, 2, 3]);
    let path = dir.join("train-images-idx3-ubyte");
    let read = |p: &Path| {
        kiln_datasets::read_idx_images(p)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    fuzz("idx images", &path, &images, 600, 1, read);
    fuzz("idx images (gzip)", &path, &gzip(&images), 600, 2, read);
    let path = dir.join("train-labels-idx1-ubyte");
    let read = |p: &Path| {
        kiln_datasets::read_idx_labels(p)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    fuzz("idx labels", &path, &labels, 600, 3, read);
    fuzz("idx labels (gzip)", &path, &gzip(&labels), 600, 4, read);

    // A header that claims 2^32 − 1 images of 28×28, raw and gzipped: an error at once,
    // nothing allocated for what it claims.
    let mut huge = Vec::new();
    for word in [0x0803u32, u32::MAX, 28, 28] {
        huge.extend(word.to_be_bytes());
    }
    huge.extend([0u8; 100]);
    for (label, bytes) in [("raw", huge.clone()), ("gzip", gzip(&huge))] {
        std::fs::write(dir.join("huge"), bytes).unwrap();
        let e = kiln_datasets::read_idx_images(&dir.join("huge"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("huge") && e.contains("4294967295"),
            "{label}: {e}"
        );
    }
}

#[test]
fn config_files_and_set_values() {
    let dir = temp_dir("fuzz-config");
    let valid = kiln::builtin::RECIPE.as_bytes();
    let path = dir.join("recipe.toml");
    fuzz("config file", &path, valid, 1500, 5, |p| {
        kiln::builtin::load(Some(p), &[])
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    // `--set` values: random keys and values against the built-in defaults. The error names
    // the key (the file is the command line).
    let mut cases_gen = Cases(6);
    let keys = [
        "train.epochs",
        "optim.lr",
        "hardware.devices",
        "model.mlp.hidden",
        "precision.mode",
        "pipeline.cuts",
        "strategy.name",
        "data.dir",
    ];
    let cases = 1500;
    for case in 0..cases {
        let key = keys[cases_gen.below(keys.len())];
        let raw = cases_gen.mutate(b"[1, 2.5, \"x\", true]");
        let value = String::from_utf8_lossy(&raw).replace('\n', " ");
        let set = format!("{key}={value}");
        match catch_unwind(|| kiln::builtin::load(None, std::slice::from_ref(&set))) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                let e = e.to_string();
                assert!(!e.contains('\n'), "case {case}: {e}");
                assert!(
                    e.contains(key) || e.contains("--set"),
                    "case {case} {set:?}: {e}"
                );
            }
            Err(_) => panic!("case {case}: --set {set:?} panicked"),
        }
    }
    println!("--set values: {cases} cases, no panic");
}

#[test]
fn tokenizer_text_and_loop_state() {
    let dir = temp_dir("fuzz-files");
    let tokenizer = kiln_datasets::text::CharTokenizer::from_text("the whale\nswam");
    let path = dir.join("tokenizer.json");
    fuzz(
        "tokenizer json",
        &path,
        tokenizer.to_json().as_bytes(),
        1000,
        7,
        |p| kiln_datasets::text::CharTokenizer::load(p).map_err(|e| e.to_string()),
    );
    let path = dir.join("text.txt");
    let text = "the whale swam past the ship, and the sea was calm. ".repeat(4);
    fuzz("text file", &path, text.as_bytes(), 1000, 8, |p| {
        kiln_datasets::text::TextData::from_file(p, 0.9).map_err(|e| e.to_string())
    });
    // state.json inside a checkpoint directory.
    let ckpt = dir.join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let state = kiln::checkpoint::LoopState {
        step: 4,
        epoch: 0,
        step_in_epoch: 4,
        seed: 1,
        world_size: 2,
        samples_per_step: 64,
        lr: 0.001,
        samples: 256,
        wall_seconds: 1.5,
        scaler: None,
        early: None,
        plateaus: Vec::new(),
    };
    let valid = serde_json::to_vec_pretty(&state).unwrap();
    fuzz(
        "state.json",
        &ckpt.join("state.json"),
        &valid,
        1000,
        9,
        |p| kiln::checkpoint::read_state(p.parent().unwrap()).map_err(|e| e.to_string()),
    );
}

/// A real checkpoint's files, to mutate.
fn checkpoint(dir: &Path) -> (PathBuf, PathBuf) {
    let config = small_config(
        &dir.join("run"),
        &["model.kind=\"mlp\"", "train.max_steps=1"],
    );
    let result = train(&config, &RunOptions::default()).unwrap();
    let (_, ckpt) = kiln::checkpoint::latest(&result.dir).unwrap();
    (result.dir, ckpt)
}

#[test]
fn checkpoint_files() {
    let dir = temp_dir("fuzz-ckpt");
    let (run, ckpt) = checkpoint(&dir);
    let spec = kiln_models::read_spec(&run.join("model.toml")).unwrap();
    let valid_optim = std::fs::read(ckpt.join(kiln::checkpoint::OPTIM_FILE)).unwrap();
    let valid_model = std::fs::read(ckpt.join(kiln::checkpoint::MODEL_FILE)).unwrap();
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    fuzz(
        "optimizer.bpk",
        &work.join(kiln::checkpoint::OPTIM_FILE),
        &valid_optim,
        400,
        10,
        |p| {
            kiln::checkpoint::load_optimizer(p.parent().unwrap())
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    );
    fuzz(
        "model.bpk",
        &work.join(kiln::checkpoint::MODEL_FILE),
        &valid_model,
        400,
        11,
        |p| {
            let model = spec.classifier(&Device::flex()).unwrap();
            kiln::checkpoint::load_model(p.parent().unwrap(), model)
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    );
}
