//! Starting from trained weights: `init.from` (kiln's files), frozen parts and LoRA adapters
//! under every data-parallel strategy, the merged export, and the one-line refusals of what
//! cannot start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln::builtin::train;
use kiln::run::RunOptions;
use kiln::weights::{Stored, read_tensors};

use crate::common::{assert_one_line_error, max_relative_diff, temp_dir, train_bin};
use crate::gpt::{gpt_config, text_file};

/// A second text of the first's characters (so the vocabulary is the same), in another order.
pub(crate) fn other_text(dir: &Path) -> PathBuf {
    let line = "the sea was calm, and the ship swam past the whale. ";
    let text: String = (0..200).map(|i| format!("{}: {line}", 199 - i)).collect();
    let path = dir.join("other.txt");
    std::fs::write(&path, text).unwrap();
    path
}

/// A pretrained base run in `dir/base`.
pub(crate) fn base(dir: &Path) -> PathBuf {
    let text = text_file(dir);
    let run = dir.join("base");
    train(
        &gpt_config(&run, &text, &["train.max_steps=20"]),
        &RunOptions::default(),
    )
    .unwrap();
    run
}

pub(crate) const LORA: [&str; 3] = [
    "finetune.lora.rank=4",
    "finetune.lora.alpha=8.0",
    "finetune.lora.targets=[\"blocks.*.attn\", \"blocks.*.mlp\"]",
];

/// A LoRA fine-tune of `base` on the other text: 10 steps, a checkpoint at the end.
fn finetune(dir: &Path, name: &str, base: &Path, extra: &[&str]) -> kiln::run::RunResult {
    let from = format!("init.from={:?}", base.display().to_string());
    let mut o: Vec<&str> = vec![
        &from,
        "train.max_steps=10",
        "train.checkpoint_every=10",
        "export.adapters=true",
    ];
    o.extend(LORA);
    o.extend(extra);
    train(
        &gpt_config(&dir.join(name), &other_text(dir), &o),
        &RunOptions::default(),
    )
    .unwrap()
}

pub(crate) fn pick(
    t: &BTreeMap<String, Stored>,
    keep: impl Fn(&str) -> bool,
) -> Vec<(String, Vec<f32>)> {
    t.iter()
        .filter(|(k, _)| keep(k))
        .map(|(k, (_, v))| (k.clone(), v.clone()))
        .collect()
}

pub(crate) fn values(t: &[(String, Vec<f32>)]) -> Vec<Vec<f32>> {
    t.iter().map(|(_, v)| v.clone()).collect()
}

#[test]
fn lora_on_two_devices_equals_one_and_leaves_the_base_alone() {
    let dir = temp_dir("finetune-lora");
    let base = base(&dir);
    let base_w = read_tensors(&base.join("model.safetensors")).unwrap();
    let one = finetune(&dir, "one", &base, &[]);
    let (trainable, total) = (one.summary.params_trainable, one.summary.params_total);
    // Rank 4 on qkv [32, 96], proj [32, 32], fc [32, 128], mlp.proj [128, 32] of 2 blocks.
    let adapters = 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32));
    assert_eq!(trainable, adapters);
    assert!(total > 7 * trainable, "{trainable} of {total}");
    let checkpoint = |r: &kiln::run::RunResult| {
        read_tensors(&r.dir.join("checkpoints/step-00000010/model.bpk")).unwrap()
    };
    let one_ck = checkpoint(&one);
    // Every frozen tensor is bit for bit the base's.
    let frozen = pick(&one_ck, |k| !k.contains(".lora."));
    assert_eq!(frozen.len(), base_w.len());
    for (k, v) in &frozen {
        let b = &base_w[k].1;
        assert!(
            v.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{k} moved"
        );
    }
    let one_ad = pick(&one_ck, |k| k.contains(".lora."));
    assert_eq!(one_ad.len(), 2 * 4 * 2);
    // The adapters file holds the same factors.
    let file = read_tensors(&one.dir.join("adapters.safetensors")).unwrap();
    assert_eq!(values(&pick(&file, |_| true)), values(&one_ad));
    // Every rank of one device (its per-core sub-replicas) holds the frozen weights whole.
    let frozen_bytes: usize = frozen.iter().map(|(_, v)| 4 * v.len()).sum();
    let held = &one.summary.frozen_bytes_per_rank;
    assert!(held.iter().all(|&h| h == frozen_bytes), "{held:?}");
    for (strategy, extra) in [
        ("ddp", &["hardware.devices=2", "train.batch_size=4"][..]),
        (
            "zero2",
            &[
                "hardware.devices=2",
                "train.batch_size=4",
                "strategy.name=\"zero2\"",
            ],
        ),
        (
            "zero3",
            &[
                "hardware.devices=2",
                "train.batch_size=4",
                "strategy.name=\"zero3\"",
            ],
        ),
        (
            "pipeline",
            &[
                "hardware.devices=2",
                "train.batch_size=4",
                "strategy.name=\"pipeline\"",
                "pipeline.stages=2",
                "pipeline.microbatches=2",
            ],
        ),
    ] {
        let two = finetune(&dir, strategy, &base, extra);
        assert_eq!(two.summary.params_trainable, trainable, "{strategy}");
        let ck = checkpoint(&two);
        let ad = pick(&ck, |k| k.contains(".lora."));
        let names: Vec<&String> = ad.iter().map(|(k, _)| k).collect();
        assert_eq!(names, one_ad.iter().map(|(k, _)| k).collect::<Vec<_>>());
        let diff = max_relative_diff(&values(&ad), &values(&one_ad));
        assert!(
            diff < 1e-5,
            "{strategy}: adapters differ from one device by {diff:e}"
        );
        // Pipeline stages keep the frozen weights of their own blocks (the embeddings and the
        // final norm on both, as the first and the last); zero3 holds its half of them and,
        // at most, the rest and one block gathered; the others hold them whole.
        let held = &two.summary.frozen_bytes_per_rank;
        let block: usize = frozen
            .iter()
            .filter(|(k, _)| k.starts_with("blocks.0."))
            .map(|(_, v)| 4 * v.len())
            .sum();
        let rest = frozen_bytes - 2 * block;
        match strategy {
            // (A released tensor stays as a one-element placeholder.)
            "pipeline" => assert!(
                held.iter()
                    .all(|&h| h >= rest + block && h < rest + block + 4 * frozen.len()),
                "{held:?}"
            ),
            "zero3" => assert_eq!(held, &vec![frozen_bytes / 2 + rest + block; 2]),
            _ => assert_eq!(held, &vec![frozen_bytes; 2], "{strategy}"),
        }
        let fz = pick(&ck, |k| !k.contains(".lora."));
        assert!(
            fz.iter()
                .zip(&frozen)
                .all(|((_, a), (_, b))| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())),
            "{strategy}: a frozen tensor moved"
        );
    }
    // DiLoCo (its own mathematics, so no parity): the adapters train, the base stays.
    let diloco = finetune(
        &dir,
        "diloco",
        &base,
        &[
            "hardware.devices=2",
            "train.batch_size=4",
            "strategy.name=\"diloco\"",
            "diloco.inner_steps=5",
        ],
    );
    let ck = checkpoint(&diloco);
    assert!(
        pick(&ck, |k| !k.contains(".lora.")) == frozen,
        "diloco: a frozen tensor moved"
    );
    assert!(values(&pick(&ck, |k| k.contains(".lora."))) != values(&one_ad));
    // The export folds the adapters in: the plain model's names, and weights that moved.
    let merged = read_tensors(&one.dir.join("model.safetensors")).unwrap();
    assert_eq!(
        merged.keys().collect::<Vec<_>>(),
        base_w.keys().collect::<Vec<_>>()
    );
    let k = "blocks.0.attn.qkv.weight";
    assert!(merged[k].1 != base_w[k].1, "{k} did not take its adapter");
    assert_eq!(merged["wte.weight"].1, base_w["wte.weight"].1);
}

#[test]
fn frozen_parts_keep_their_values_and_the_rest_trains() {
    let dir = temp_dir("finetune-freeze");
    let base = base(&dir);
    let base_w = read_tensors(&base.join("model.safetensors")).unwrap();
    let from = format!("init.from={:?}", base.display().to_string());
    let run = train(
        &gpt_config(
            &dir.join("frozen"),
            &other_text(&dir),
            &[
                &from,
                "train.max_steps=5",
                "finetune.freeze=[\"wte\", \"wpe\", \"blocks.0\"]",
                "hardware.devices=2",
                "train.batch_size=4",
            ],
        ),
        &RunOptions::default(),
    )
    .unwrap();
    let after = read_tensors(&run.dir.join("model.safetensors")).unwrap();
    for (k, (_, v)) in &after {
        let frozen = k.starts_with("wte.") || k.starts_with("wpe.") || k.starts_with("blocks.0.");
        assert_eq!(v == &base_w[k].1, frozen, "{k}");
    }
    let s = &run.summary;
    assert!(s.params_trainable < s.params_total);
    // Only the trainable parameters take gradients and optimizer state (AdamW: two f32 each).
    assert_eq!(s.grad_bytes_per_rank[0], 4 * s.params_trainable);
    assert_eq!(s.optim_bytes_per_rank[0], 2 * 4 * s.params_trainable);
}

#[test]
fn what_cannot_start_from_trained_weights_is_one_line_and_writes_nothing() {
    let dir = temp_dir("finetune-refusals");
    let base = base(&dir);
    let text = text_file(&dir);
    let from = format!("init.from={:?}", base.display().to_string());
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            vec!["init.from=\"nowhere/model.safetensors\"".into()],
            vec!["init.from", "nowhere/model.safetensors", "no such file"],
        ),
        (
            vec![from.clone(), "model.gpt.n_embd=48".into()],
            vec![
                "init.from",
                "does not fit",
                "of another shape",
                "wte.weight",
            ],
        ),
        (
            vec![from.clone(), "finetune.freeze=[\"blocks.*.atn\"]".into()],
            vec!["finetune.freeze[0]", "blocks.*.atn", "matches no parameter"],
        ),
        (
            vec![
                from.clone(),
                "finetune.lora.targets=[\"blocks.*.ln_1\"]".into(),
            ],
            vec![
                "finetune.lora.targets[0]",
                "no 2-D weight",
                "blocks.0.ln_1.gamma",
            ],
        ),
    ];
    for (i, (extra, needles)) in cases.into_iter().enumerate() {
        let run = dir.join(format!("refused-{i}"));
        let mut args = vec![
            "--set".to_string(),
            format!("run.dir={:?}", run.display().to_string()),
        ];
        for o in gpt_args(&text) {
            args.extend(["--set".to_string(), o]);
        }
        for o in extra {
            args.extend(["--set".to_string(), o]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = train_bin(&dir, &args);
        assert_one_line_error(&out, &needles);
        assert!(!run.exists(), "case {i} wrote {}", run.display());
    }
    // A resume continues its own run: a new init.from is refused.
    let args = [
        "--resume".to_string(),
        base.display().to_string(),
        "--set".into(),
        format!("init.from={:?}", base.display().to_string()),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = train_bin(&dir, &args);
    assert_one_line_error(&out, &["init.from", "resume"]);
}

/// The small GPT of `gpt_config` as `--set` values.
fn gpt_args(text: &Path) -> Vec<String> {
    vec![
        "data.dataset=\"text\"".into(),
        format!("data.path={:?}", text.display().to_string()),
        "data.eval_windows=16".into(),
        "model.kind=\"gpt\"".into(),
        "model.gpt.n_layer=2".into(),
        "model.gpt.n_head=2".into(),
        "model.gpt.n_embd=32".into(),
        "model.gpt.block_size=16".into(),
        "train.max_steps=2".into(),
        "train.batch_size=4".into(),
    ]
}

/// The loss `train eval` prints.
fn eval_loss(dir: &Path, args: &[&str]) -> f64 {
    let mut all = vec!["eval"];
    all.extend(args);
    let out = train_bin(dir, &all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("eval: val loss "))
        .unwrap_or_else(|| panic!("no eval line in {stdout}"));
    line["eval: val loss ".len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn the_merged_export_evaluates_as_the_adapted_model_on_any_devices() {
    let dir = temp_dir("finetune-eval");
    let base = base(&dir);
    let tuned = finetune(&dir, "tuned", &base, &[]);
    let adapted = tuned.summary.val_loss.unwrap();
    let run = tuned.dir.display().to_string();
    let one = eval_loss(&dir, &["--run", &run, "--devices", "1"]);
    assert!(
        (one - adapted).abs() <= 1e-5 * adapted,
        "{one} vs {adapted}"
    );
    let two = eval_loss(
        &dir,
        &["--run", &run, "--devices", "2", "--strategy", "zero3"],
    );
    assert!(
        (two - adapted).abs() <= 1e-5 * adapted,
        "{two} vs {adapted}"
    );
    // The base model scores worse on the text the adapters learnt.
    let other = other_text(&dir).display().to_string();
    let before = eval_loss(
        &dir,
        &[
            "--run",
            &base.display().to_string(),
            "--set",
            &format!("data.path={other:?}"),
        ],
    );
    assert!(adapted < before, "fine-tuned {adapted} vs base {before}");
}

#[test]
fn a_pytorch_layout_export_starts_a_run_with_the_same_loss() {
    let dir = temp_dir("finetune-pytorch");
    let text = text_file(&dir);
    let run = train(
        &gpt_config(
            &dir.join("torch"),
            &text,
            &["train.max_steps=10", "export.format=\"pytorch\""],
        ),
        &RunOptions::default(),
    )
    .unwrap();
    let w = read_tensors(&run.dir.join("model.safetensors")).unwrap();
    // PyTorch's names and layouts: LayerNorm `weight`, Linear `[out, in]`.
    assert!(w.contains_key("ln_f.weight") && !w.contains_key("ln_f.gamma"));
    assert_eq!(w["blocks.0.attn.qkv.weight"].0, vec![96, 32]);
    let file = run.dir.join("model.safetensors").display().to_string();
    let config = run.dir.join("config.toml").display().to_string();
    let from = format!("init.from={file:?}");
    let loss = eval_loss(
        &dir,
        &[
            "--config",
            &config,
            "--set",
            &from,
            "--set",
            "init.format=\"pytorch\"",
        ],
    );
    let trained = run.summary.val_loss.unwrap();
    assert!(
        (loss - trained).abs() <= 1e-5 * trained,
        "{loss} vs {trained}"
    );
    // Read as kiln's layout, the transposed weights do not fit: one line.
    let out = train_bin(&dir, &["eval", "--config", &config, "--set", &from]);
    assert_one_line_error(&out, &["init.from", "of another shape", "init.format"]);
}

#[test]
fn a_rank_sends_the_gradients_of_the_trainable_parameters_only() {
    let dir = temp_dir("finetune-wire");
    let base = base(&dir);
    let text = other_text(&dir);
    let run = dir.join("wire");
    let mut args: Vec<String> = vec![
        "--set".into(),
        format!("run.dir={:?}", run.display().to_string()),
    ];
    let from = format!("init.from={:?}", base.display().to_string());
    let extra = [
        from.as_str(),
        "hardware.devices=2",
        "strategy.name=\"ddp\"",
        "dist.overlap=\"off\"",
        "train.max_steps=8",
        "train.log_every=100",
        "train.val_every=100",
    ];
    for o in gpt_args(&text)
        .into_iter()
        .chain(extra.iter().map(|s| s.to_string()))
        .chain(LORA.iter().map(|s| s.to_string()))
    {
        args.extend(["--set".to_string(), o]);
    }
    // The run ends after step 4 with every rank's flight record of its collectives.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_train"))
        .args(&args)
        .current_dir(&dir)
        .env("KILN_FAULT_INJECT", "0:4")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let record = std::fs::read_to_string(run.join("flight").join("rank-1.jsonl")).unwrap();
    let entries: Vec<serde_json::Value> = record
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Gradient buckets are all-reduced; the one-element all-reduces are the step's loss.
    let grads: u64 = entries
        .iter()
        .filter(|e| e["kind"] == "all_reduce" && e["elements"].as_u64().unwrap() > 1)
        .map(|e| e["elements"].as_u64().unwrap())
        .sum();
    let adapters = 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32));
    assert_eq!(
        grads,
        4 * adapters,
        "4 steps of {adapters} trainable parameters"
    );
}

#[test]
fn a_lora_run_resumes_bit_for_bit_and_on_other_devices() {
    let dir = temp_dir("finetune-resume");
    let base = base(&dir);
    let full = finetune(&dir, "full", &base, &["train.checkpoint_every=5"]);
    let adapters = |r: &kiln::RunResult| {
        let ck = read_tensors(&r.dir.join("checkpoints/step-00000010/model.bpk")).unwrap();
        values(&pick(&ck, |k| k.contains(".lora.")))
    };
    let want = adapters(&full);
    let same = crate::training::resume_cut(&full.dir, &dir.join("cut"), 5, &[]);
    assert_eq!(
        adapters(&same),
        want,
        "a resume under the same settings differs"
    );
    let other = crate::training::resume_cut(
        &full.dir,
        &dir.join("cut-zero2"),
        5,
        &[
            "hardware.devices=2".into(),
            "train.batch_size=4".into(),
            "strategy.name=\"zero2\"".into(),
        ],
    );
    let diff = max_relative_diff(&adapters(&other), &want);
    assert!(diff < 1e-5, "resumed under zero2 on 2 devices: {diff:e}");
    // Sharded (the frozen base written as ranges too) and resumed under zero3 on 2 devices,
    // whose ranks read their own ranges of the adapters and of the base: the resume from the
    // gathered checkpoint, bit for bit.
    let sharded = finetune(
        &dir,
        "sharded",
        &base,
        &[
            "train.checkpoint_every=5",
            "train.checkpoint_format=\"sharded\"",
        ],
    );
    let zero3 = |from: &Path, name: &str, format: &str| {
        let r = crate::training::resume_cut(
            from,
            &dir.join(name),
            5,
            &[
                "hardware.devices=2".into(),
                "train.batch_size=4".into(),
                "strategy.name=\"zero3\"".into(),
                format!("train.checkpoint_format={format:?}"),
            ],
        );
        values(&pick(
            &read_tensors(&r.dir.join("model.bpk")).unwrap(),
            |_| true,
        ))
    };
    let (a, b) = (
        zero3(&sharded.dir, "sharded-zero3", "sharded"),
        zero3(&full.dir, "gathered-zero3", "gathered"),
    );
    assert_eq!(a.len(), b.len());
    for (t, (x, y)) in a.iter().zip(&b).enumerate() {
        let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "tensor {t}: the sharded resume under zero3 differs");
    }
}

/// `xtask/reference/gpt_torch_parity.py` with PyTorch (`KILN_PYTHON`, default
/// `/usr/bin/python3`: Debian's python3-torch), on the small GPT of `gpt_config`; its one line
/// of JSON.
fn torch(dir: &Path, args: &[&str]) -> serde_json::Value {
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "/usr/bin/python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../xtask/reference/gpt_torch_parity.py"
    );
    let shape = [
        "--eval-windows",
        "16",
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "16",
    ];
    let out = std::process::Command::new(&python)
        .arg(script)
        .args(args)
        .args(shape)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("{python}: {e} (this test needs PyTorch: python3-torch)"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
#[ignore = "needs PyTorch (Debian's python3-torch); CI installs it and runs this"]
fn pytorch_loads_kilns_export_and_kiln_starts_from_pytorchs_weights() {
    let dir = temp_dir("finetune-torch");
    let text = text_file(&dir);
    let data = text.display().to_string();
    // kiln → PyTorch: the export in PyTorch's layout loads strictly into the reference module.
    let run = train(
        &gpt_config(
            &dir.join("kiln"),
            &text,
            &["train.max_steps=20", "export.format=\"pytorch\""],
        ),
        &RunOptions::default(),
    )
    .unwrap();
    let file = run.dir.join("model.safetensors").display().to_string();
    let scored = torch(&dir, &["score", "--data", &data, "--weights", &file]);
    let (theirs, ours) = (
        scored["val_loss"].as_f64().unwrap(),
        run.summary.val_loss.unwrap(),
    );
    assert!(
        (theirs - ours).abs() <= 1e-4,
        "PyTorch {theirs} vs kiln {ours}"
    );
    // PyTorch → kiln: a state dict PyTorch trained starts a kiln run with PyTorch's loss.
    let out = dir.join("torch");
    std::fs::create_dir_all(&out).unwrap();
    let trained = torch(
        &dir,
        &[
            "train", "--data", &data, "--steps", "30", "--batch", "8", "--lr", "3e-3", "--out",
        ]
        .into_iter()
        .chain([out.to_str().unwrap()])
        .collect::<Vec<_>>(),
    );
    let theirs = trained["val_loss"].as_f64().unwrap();
    let config = run.dir.join("config.toml").display().to_string();
    for name in ["model.pt", "model.safetensors"] {
        let from = format!("init.from={:?}", out.join(name).display().to_string());
        let ours = eval_loss(
            &dir,
            &[
                "--config",
                &config,
                "--set",
                &from,
                "--set",
                "init.format=\"pytorch\"",
            ],
        );
        assert!(
            (theirs - ours).abs() <= 1e-4,
            "{name}: PyTorch {theirs} vs kiln {ours}"
        );
    }
}

#[test]
fn lora_trains_in_mixed_precision_and_the_base_stays_f32() {
    let dir = temp_dir("finetune-mixed");
    let base = base(&dir);
    let base_w = read_tensors(&base.join("model.safetensors")).unwrap();
    let mut adapters = Vec::new();
    for strategy in ["ddp", "zero3"] {
        let set = format!("strategy.name={strategy:?}");
        let run = finetune(
            &dir,
            strategy,
            &base,
            &[
                "hardware.devices=2",
                "train.batch_size=4",
                "precision.mode=\"bf16-mixed\"",
                &set,
            ],
        );
        let ck = read_tensors(&run.dir.join("checkpoints/step-00000010/model.bpk")).unwrap();
        for (k, v) in pick(&ck, |k| !k.contains(".lora.")) {
            assert!(
                v == base_w[&k].1,
                "{strategy}: {k} is not the base's f32 values"
            );
        }
        adapters.push(values(&pick(&ck, |k| k.contains(".lora."))));
    }
    let diff = max_relative_diff(&adapters[1], &adapters[0]);
    assert!(diff < 1e-5, "zero3 against ddp in bf16-mixed: {diff:e}");
}

#[test]
fn qlora_quantises_the_bases_and_trains_alike_on_two_devices() {
    let dir = temp_dir("finetune-qlora");
    let base = base(&dir);
    let adapters = |r: &kiln::RunResult| {
        let ck = read_tensors(&r.dir.join("checkpoints/step-00000010/model.bpk")).unwrap();
        values(&pick(&ck, |k| k.contains(".lora.")))
    };
    let q = "finetune.lora.quantize=\"q8\"";
    let one = finetune(&dir, "one", &base, &[q]);
    let plain = finetune(&dir, "plain", &base, &[]);
    // The quantised bases change the model a little, not the adapters' count.
    assert_eq!(one.summary.params_trainable, plain.summary.params_trainable);
    assert_ne!(one.summary.val_loss, plain.summary.val_loss);
    let want = adapters(&one);
    for strategy in ["ddp", "zero3"] {
        let set = format!("strategy.name={strategy:?}");
        let two = finetune(
            &dir,
            strategy,
            &base,
            &[q, "hardware.devices=2", "train.batch_size=4", &set],
        );
        let diff = max_relative_diff(&adapters(&two), &want);
        assert!(diff < 1e-5, "{strategy}: {diff:e}");
    }
    // The export folds the adapters into the dequantised bases: the adapted model's loss.
    let run = one.dir.display().to_string();
    let loss = eval_loss(&dir, &["--run", &run, "--devices", "1"]);
    let adapted = one.summary.val_loss.unwrap();
    assert!(
        (loss - adapted).abs() <= 1e-5 * adapted,
        "{loss} vs {adapted}"
    );
}
