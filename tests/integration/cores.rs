//! A CPU device that uses its cores as data parallelism does: per-core sub-replicas of one
//! device match one replica within the parity bound, keep BatchNorm's statistics to the
//! device's batch, resume bit for bit, and say what they chose.

use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::trainer::parameter_values;
use kiln_models::load_run;

use crate::common::{max_relative_diff, small_config, temp_dir, train_bin, train_losses};
use crate::gpt::{gpt_config, text_file};
use crate::training::resume_cut;

const PARITY: f64 = 1e-5;

/// Per-tensor relative differences between the split and one replica after 5 steps.
fn split_vs_off(run: impl Fn(&str, &[&str]) -> kiln::RunResult) -> Vec<f64> {
    let split = run("split", &["hardware.cpu_split=\"auto\""]);
    let off = run("off", &["hardware.cpu_split=\"off\""]);
    assert_eq!((split.summary.devices, split.summary.sub_replicas), (1, 2));
    assert_eq!((off.summary.devices, off.summary.sub_replicas), (1, 1));
    assert_eq!(off.summary.strategy, "single");
    let (a, b) = (params(&split.dir), params(&off.dir));
    a.iter()
        .zip(&b)
        .map(|(x, y)| max_relative_diff(std::slice::from_ref(x), std::slice::from_ref(y)))
        .collect()
}

/// The parameters and buffers of a run's final model (an image classifier or a GPT).
fn params(dir: &std::path::Path) -> Vec<Vec<f32>> {
    let device = Device::flex();
    match load_run(dir, &device) {
        Ok(model) => parameter_values(&model),
        Err(_) => parameter_values(
            &kiln_models::load_family_run::<kiln_models::Gpt>(dir, &device)
                .unwrap()
                .0,
        ),
    }
}

#[test]
fn per_core_sub_replicas_match_one_replica_on_the_gpt_and_a_batchnorm_convnet() {
    let dir = temp_dir("cores-parity");
    let text = text_file(&dir);
    let gpt = split_vs_off(|name, extra| {
        let mut o = vec![
            "train.max_steps=5",
            "hardware.cpu_cores=2",
            "train.batch_size=8",
        ];
        o.extend(extra);
        let config = gpt_config(&dir.join(format!("gpt-{name}")), &text, &o);
        train(&config, &RunOptions::default()).unwrap()
    });
    // Parameters and BatchNorm's running statistics alike. SGD, as for synchronised
    // BatchNorm across devices: the convolutions' biases before a BatchNorm get gradients that
    // are rounding noise, which AdamW would scale up to whole steps.
    let convnet = split_vs_off(|name, extra| {
        let mut o = vec![
            "train.max_steps=5",
            "hardware.cpu_cores=2",
            "model.convnet.batch_norm=true",
            "optim.name=\"sgd\"",
            "optim.lr=0.1",
            "optim.momentum=0.9",
        ];
        o.extend(extra);
        let config = small_config(&dir.join(format!("convnet-{name}")), &o);
        train(&config, &RunOptions::default()).unwrap()
    });
    for (model, diffs) in [("gpt", gpt), ("convnet", convnet)] {
        let worst = diffs.iter().copied().fold(0.0, f64::max);
        println!("{model}: max per-tensor relative difference {worst:.3e}");
        assert!(worst <= PARITY, "{model}: {diffs:?}");
        assert!(
            worst > 0.0,
            "{model}: suspiciously exact, the runs may not differ"
        );
    }
}

#[test]
fn sub_replicas_resume_bit_for_bit_and_any_checkpoint_resumes_without_them() {
    let dir = temp_dir("cores-resume");
    let o = [
        "hardware.cpu_cores=2",
        "model.convnet.batch_norm=true",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=5",
    ];
    let full = train(&small_config(&dir.join("full"), &o), &RunOptions::default()).unwrap();
    assert_eq!(full.summary.sub_replicas, 2);
    for (name, split) in [("same", "auto"), ("off", "off")] {
        let split_set = [format!("hardware.cpu_split={split:?}")];
        let resumed = resume_cut(&full.dir, &dir.join(name), 4, &split_set);
        let (a, b) = (train_losses(&resumed.dir), train_losses(&full.dir));
        assert_eq!(a.len(), b.len());
        if split == "auto" {
            assert_eq!(a, b, "the same core count resumes bit for bit");
        } else {
            assert_eq!(resumed.summary.sub_replicas, 1);
            // Steps 1–4 are the checkpoint's; the rest are one replica's, within parity.
            assert_eq!(a[..4], b[..4]);
            for ((_, x), (_, y)) in a.iter().zip(&b) {
                let (x, y) = (f64::from_bits(*x), f64::from_bits(*y));
                assert!((x - y).abs() <= 1e-5 * y.abs(), "{x} vs {y}");
            }
        }
    }
}

#[test]
fn the_start_up_table_says_how_a_device_uses_its_cores() {
    let dir = temp_dir("cores-table");
    for (extra, needle) in [
        (
            vec!["--batch-size", "32"],
            "2 per-core sub-replicas of 16 samples per device",
        ),
        (
            vec!["--batch-size", "7"],
            "batch 7 does not split evenly over 2 cores",
        ),
        (
            vec!["--batch-size", "32", "--set", "hardware.cpu_split=\"off\""],
            "one replica per device (hardware.cpu_split = \"off\"",
        ),
        (
            vec!["--batch-size", "32", "--devices", "2", "--strategy", "ddp"],
            "1 core per device",
        ),
        // `--devices N` shares the cores among the devices.
        (
            vec![
                "--batch-size",
                "32",
                "--devices",
                "2",
                "--strategy",
                "ddp",
                "--set",
                "hardware.cpu_cores=4",
            ],
            "2 per-core sub-replicas of 16 samples per device",
        ),
    ] {
        let mut args = vec!["--max-steps", "2"];
        if !extra.contains(&"hardware.cpu_cores=4") {
            args.extend(["--set", "hardware.cpu_cores=2"]);
        }
        args.extend(extra);
        let out = train_bin(&dir, &args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        let row = stdout
            .lines()
            .find(|l| l.trim_start().starts_with("cpu cores"))
            .unwrap_or_else(|| panic!("no cpu cores row: {stdout}"));
        assert!(row.contains(needle), "{row}");
    }
    // Several replicas on a device are a GPU's: on the CPU (here `auto` finds no GPU) the
    // key is refused in one line, not left out of the split in silence.
    let out = train_bin(
        &dir,
        &[
            "--max-steps",
            "2",
            "--set",
            "hardware.replicas_per_device=2",
        ],
    );
    crate::common::assert_one_line_error(&out, &["hardware.replicas_per_device = 2", "cpu_split"]);
}
