//! Using a model trained by kiln inside another program: load it from a run directory (or a
//! spec plus a burnpack/SafeTensors weights file) and classify images.
//!
//! ```text
//! cargo run --release --bin train                       # writes runs/digits-convnet
//! cargo run --release -p kiln-models --example predict -- runs/digits-convnet
//! cargo run --release -p kiln-models --example predict -- runs/digits-convnet model.safetensors
//! ```

use std::path::PathBuf;

use burn::prelude::*;
use kiln_models::{load_classifier, load_run, read_spec};

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(run_dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: predict RUN_DIR [WEIGHTS_FILE]");
        std::process::exit(2);
    };
    let device = Device::flex();
    let loaded = match args.next() {
        None => load_run(&run_dir, &device),
        Some(weights) => read_spec(&run_dir.join(kiln_models::load::SPEC_FILE))
            .and_then(|spec| load_classifier(&spec, &run_dir.join(weights), &device)),
    };
    let model = match loaded {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };

    // Classify the embedded digits' test split, scaled to [0, 1] as in training.
    let test = kiln_datasets::digits().test;
    let n = test.len();
    let pixels: Vec<f32> = test
        .images
        .iter()
        .map(|&p| f32::from(p) / f32::from(test.max_value))
        .collect();
    let images = Tensor::<4>::from_data(
        TensorData::new(pixels, [n, 1, test.height, test.width]),
        &device,
    );
    let predicted = model.predict(images);
    let correct = predicted
        .iter()
        .enumerate()
        .filter(|(i, p)| **p == usize::from(test.label(*i)))
        .count();
    println!("first ten predictions: {:?}", &predicted[..10]);
    println!(
        "first ten labels:      {:?}",
        (0..10).map(|i| test.label(i)).collect::<Vec<_>>()
    );
    println!(
        "accuracy on {n} test digits: {:.2}%",
        100.0 * correct as f64 / n as f64
    );
}
