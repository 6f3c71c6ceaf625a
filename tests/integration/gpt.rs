//! The GPT workload end to end on a small text: training through the trainer (one device and
//! data-parallel), sampling from the run, and bad text input.

use std::path::{Path, PathBuf};

use burn::prelude::*;
use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::trainer::parameter_values;

use crate::common::{assert_one_line_error, max_relative_diff, metrics, temp_dir, train_bin};

/// A small text with structure worth learning.
pub(crate) fn text_file(dir: &Path) -> PathBuf {
    let line = "the whale swam past the ship, and the sea was calm. ";
    let text: String = (0..200).map(|i| format!("{i}: {line}")).collect();
    let path = dir.join("text.txt");
    std::fs::write(&path, text).unwrap();
    path
}

pub(crate) fn gpt_config(run: &Path, text: &Path, extra: &[&str]) -> kiln::builtin::Config {
    kiln::builtin::load(None, &gpt_overrides(run, text, extra)).unwrap()
}

/// [`gpt_config`]'s overrides, for a test that wants the load's error rather than a panic.
pub(crate) fn gpt_overrides(run: &Path, text: &Path, extra: &[&str]) -> Vec<String> {
    let mut o: Vec<String> = vec![
        "data.dataset=\"text\"".into(),
        format!("data.path={:?}", text.display().to_string()),
        "data.eval_windows=16".into(),
        "model.kind=\"gpt\"".into(),
        "model.gpt.n_layer=2".into(),
        "model.gpt.n_head=2".into(),
        "model.gpt.n_embd=32".into(),
        "model.gpt.block_size=16".into(),
        "train.epochs=0".into(),
        "train.max_steps=40".into(),
        "train.batch_size=8".into(),
        "train.log_every=10".into(),
        "optim.lr=0.003".into(),
        "optim.weight_decay=0.1".into(),
        format!("run.dir={:?}", run.display().to_string()),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    o
}

#[test]
fn gpt_learns_a_small_text_and_samples_from_the_run() {
    let dir = temp_dir("gpt");
    let text = text_file(&dir);
    let result = train(
        &gpt_config(&dir.join("run"), &text, &[]),
        &RunOptions::default(),
    )
    .unwrap();
    let train_lines = metrics(&result.dir, "train");
    let first = train_lines.first().unwrap()["loss"].as_f64().unwrap();
    let last = train_lines.last().unwrap()["loss"].as_f64().unwrap();
    assert!(last < 0.7 * first, "loss went from {first} to {last}");
    assert!(train_lines[0]["tokens_per_sec"].as_f64().unwrap() > 0.0);
    assert!(result.summary.val_loss.unwrap() < first);
    assert!(result.dir.join("tokenizer.json").is_file());

    let sample_args = [
        "sample",
        "--run",
        "run",
        "--prompt",
        "the wh",
        "--tokens",
        "30",
        "--temperature",
        "0.5",
        "--top-k",
        "5",
    ];
    let out = train_bin(&dir, &sample_args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).unwrap();
    assert!(generated.starts_with("the wh"), "{generated:?}");
    assert!(
        generated.trim_end_matches('\n').chars().count() == 36,
        "{generated:?}"
    );
    // The same seed samples the same text.
    let again = train_bin(&dir, &sample_args);
    assert_eq!(String::from_utf8(again.stdout).unwrap(), generated);

    let out = train_bin(&dir, &["sample", "--run", "run", "--prompt", "Ω"]);
    assert_one_line_error(&out, &["--prompt", "Ω"]);
}

#[test]
fn gpt_windows_do_not_depend_on_the_device_count() {
    let dir = temp_dir("gpt-ddp");
    let text = text_file(&dir);
    let one = train(
        &gpt_config(
            &dir.join("one"),
            &text,
            &["train.max_steps=5", "train.batch_size=8"],
        ),
        &RunOptions::default(),
    )
    .unwrap();
    let two = train(
        &gpt_config(
            &dir.join("two"),
            &text,
            &[
                "train.max_steps=5",
                "train.batch_size=4",
                "hardware.devices=2",
                "train.check_replicas=true",
                "train.log_every=1",
            ],
        ),
        &RunOptions::default(),
    )
    .unwrap();
    let device = Device::flex();
    let a = parameter_values(
        &kiln_models::load_family_run::<kiln_models::Gpt>(&one.dir, &device)
            .unwrap()
            .0,
    );
    let b = parameter_values(
        &kiln_models::load_family_run::<kiln_models::Gpt>(&two.dir, &device)
            .unwrap()
            .0,
    );
    let d = max_relative_diff(&b, &a);
    assert!(d <= 1e-5, "max per-tensor relative difference {d:e}");
    // Nor on the split into accumulation: a step's windows are the step's, whoever takes
    // them (what a restart on fewer devices relies on).
    let acc = train(
        &gpt_config(
            &dir.join("acc"),
            &text,
            &[
                "train.max_steps=5",
                "train.batch_size=4",
                "train.accumulate=2",
            ],
        ),
        &RunOptions::default(),
    )
    .unwrap();
    let c = parameter_values(
        &kiln_models::load_family_run::<kiln_models::Gpt>(&acc.dir, &device)
            .unwrap()
            .0,
    );
    let d = max_relative_diff(&c, &a);
    assert!(
        d <= 1e-5,
        "accumulation: max per-tensor relative difference {d:e}"
    );

    // The three metric sinks of the data-parallel run agree record for record.
    let jsonl = kiln::metrics::read_metrics(&two.dir.join("metrics.jsonl")).unwrap();
    let csv = std::fs::read_to_string(two.dir.join("metrics.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), jsonl.len());
    let tb_dir = two.dir.join("tb");
    let event_file = std::fs::read_dir(&tb_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let scalars = kiln::sinks::read_scalars(&event_file).unwrap();
    assert_eq!(jsonl.iter().filter(|r| r["split"] == "train").count(), 5);
    for (record, row) in jsonl.iter().zip(&rows) {
        let step = record["step"].as_i64().unwrap();
        let split = record["split"].as_str().unwrap();
        let loss = record["loss"].as_f64().unwrap();
        assert_eq!(row[0].parse::<i64>().unwrap(), step);
        assert_eq!(row[2], split);
        assert_eq!(row[3].parse::<f64>().unwrap(), loss);
        let tag = format!("{split}/loss");
        let logged: Vec<f32> = scalars
            .iter()
            .filter(|s| s.tag == tag && s.step == step)
            .map(|s| s.value)
            .collect();
        assert_eq!(logged, vec![loss as f32], "{tag} at step {step}");
        if split == "train" {
            assert!(
                scalars
                    .iter()
                    .any(|s| s.tag == "train/tokens_per_sec" && s.step == step)
            );
        }
    }
}

#[test]
fn bad_text_input_is_reported() {
    let dir = temp_dir("gpt-bad");
    let out = train_bin(
        &dir,
        &[
            "--set",
            "data.dataset=text",
            "--set",
            "model.kind=gpt",
            "--set",
            "data.path=/no/such/book.txt",
        ],
    );
    assert_one_line_error(&out, &["/no/such/book.txt", "does not exist"]);
    let out = train_bin(&dir, &["--set", "data.dataset=text"]);
    assert_one_line_error(&out, &["data.dataset", "text"]);
    let text = text_file(&dir);
    let out = train_bin(
        &dir,
        &[
            "--set",
            "data.dataset=text",
            "--set",
            "model.kind=gpt",
            "--set",
            &format!("data.path={:?}", text.display().to_string()),
            "--set",
            "model.gpt.vocab_size=3",
        ],
    );
    assert_one_line_error(&out, &["model.gpt.vocab_size", "smaller"]);
}
